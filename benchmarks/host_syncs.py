"""Host synchronisations per steady-state training step, per method, through a real HF Trainer
(docs/performance.md, "What the GPU pays").

    python benchmarks/host_syncs.py                      # CPU: counted by tests/device_discipline.py's HostSyncs
    python benchmarks/host_syncs.py --device cuda        # and on a GPU under torch.cuda.set_sync_debug_mode("warn")
    python benchmarks/host_syncs.py --methods agg,cosreg --steps 3

A tiny GPT-2 (d = 16, V = 64) trains 2 + ``--steps`` optimizer steps of 4 sequences with each
method; the counted window is the last ``--steps`` steps (no logging and no measurement step in
it: ``logging_steps`` and ``metrics_every`` far away), from the Trainer's ``on_step_begin`` to its
``on_step_end`` (forward, backward, optimizer step). ``HostSyncs`` counts the aten ops that read a
value back to the host on CUDA (``.item()``, ``nonzero``, ``unique``, boolean-mask indexing,
``masked_select``, ``bincount``, ``repeat_interleave`` without ``output_size``), by kind and by the
line of this package that issued them; on CUDA the driver's own count is added
(``set_sync_debug_mode("warn")``: one warning per synchronising call, blocking copies included).
The table: method | syncs per step | beyond the plain Trainer's | where (the package's lines).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from device_discipline import TRAINING_METHODS as METHODS  # noqa: E402
from device_discipline import StepWindow, hf_window  # noqa: E402

def run(config: dict | None, steps: int, device: str) -> tuple[StepWindow, int]:
    """The counted window of a run with `config` (None: no callback), and the driver-reported
    synchronisations in it (CUDA only)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from aniso_plugins import AnisoConfig
    from hf_utils import TokenDataset, tiny_gpt2

    window, driver = StepWindow(range(3, 3 + steps)), [0]

    class Driver(TrainerCallback):  # CUDA's own count: one warning per synchronising call
        records: list = []

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 in window.steps:
                self.caught = warnings.catch_warnings(record=True)
                self.records = self.caught.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in window.steps:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("default")
                driver[0] += sum("synchroniz" in str(w.message) for w in self.records)
                self.caught.__exit__(None, None, None)

    args = TrainingArguments(
        output_dir=os.path.join("/tmp", "aniso_host_syncs"), report_to="none", use_cpu=device == "cpu",
        disable_tqdm=True, save_strategy="no", per_device_train_batch_size=4, max_steps=2 + steps,
        logging_steps=10_000, learning_rate=1e-3, seed=0,
    )
    callbacks = [hf_window(window)] + ([Driver()] if device == "cuda" else [])
    if config is not None:
        from aniso_plugins.integrations.hf import AnisoCallback

        callbacks.append(AnisoCallback(AnisoConfig(load_entry_points=False, **{"metrics": (), **config})))
    Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(n=64), callbacks=callbacks).train()
    return window, driver[0]


def measurement(family: str) -> tuple[float, dict[str, float]]:
    """Host reads inside one measurement of the metric `family` (``TrainingSession.measure``,
    per call, over 3 measured steps of a tiny GPT-2 through the HF Trainer) and their sites."""
    from transformers import Trainer, TrainingArguments

    from aniso_plugins import AnisoConfig
    from aniso_plugins.core.session import TrainingSession
    from aniso_plugins.integrations.hf import AnisoCallback
    from device_discipline import HostSyncs
    from hf_utils import TokenDataset, tiny_gpt2

    calls, total, sites = [0], [0], {}
    original = TrainingSession.measure

    def counted(self, step, kind="train"):
        with HostSyncs(where=True) as mode:
            out = original(self, step, kind)
        calls[0] += 1
        total[0] += mode.total
        for site, n in mode.sites.items():
            sites[site] = sites.get(site, 0) + n
        return out

    TrainingSession.measure = counted
    try:
        args = TrainingArguments(
            output_dir=os.path.join("/tmp", "aniso_host_syncs"), report_to="none", use_cpu=True, disable_tqdm=True,
            save_strategy="no", per_device_train_batch_size=4, max_steps=3, logging_steps=1, learning_rate=1e-3,
            seed=0, eval_strategy="steps" if family == "eval" else "no", eval_steps=1,
        )
        config = AnisoConfig(load_entry_points=False, metrics=(family,), metrics_every=1)
        data = TokenDataset(n=64)
        Trainer(model=tiny_gpt2(), args=args, train_dataset=data, eval_dataset=TokenDataset(n=8) if family == "eval" else None,
                callbacks=[AnisoCallback(config)]).train()
    finally:
        TrainingSession.measure = original
    n = max(calls[0], 1)
    return total[0] / n, {site: k / n for site, k in sites.items()}


def measurement_table(families: list[str]) -> None:
    print("\nhost reads per measurement (TrainingSession.measure), HF Trainer, tiny GPT-2, cpu")
    print("| metric family | reads / measurement | where (this package) |")
    print("|---|---|---|")
    for family in families:
        per_call, sites = measurement(family)
        where = ", ".join(f"{s} ×{n:g}" for s, n in sorted(sites.items(), key=lambda kv: -kv[1]) if "(not ours)" not in s)
        print(f"| {family} | {per_call:g} | {where or '—'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of " + ", ".join(METHODS))
    parser.add_argument("--steps", type=int, default=3, help="steady-state steps counted")
    parser.add_argument("--measurement", default="",
                        help="comma-separated metric families: count the host reads of one measurement of each "
                             "instead (e.g. geometry,frequency,hidden)")
    a = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    if a.measurement:
        measurement_table(a.measurement.split(","))
        return
    base, base_driver = run(None, a.steps, a.device)
    rows = [("plain Trainer", base.per_step, 0.0, base_driver / a.steps, "")]
    for name in a.methods.split(","):
        window, driver = run(METHODS[name], a.steps, a.device)
        ours = ", ".join(f"{site} ×{n:g}" for site, n in sorted(window.ours().items(), key=lambda kv: -kv[1]))
        rows.append((name, window.per_step, window.per_step - base.per_step, (driver - base_driver) / a.steps, ours))
    driver_col = a.device == "cuda"
    print(f"\nhost syncs per steady-state step, HF Trainer, tiny GPT-2, {a.device}, {a.steps} steps counted")
    print("| method | syncs / step | beyond the plain Trainer |" + (" driver-reported beyond |" if driver_col else "") + " where (this package) |")
    print("|---|---|---|" + ("---|" if driver_col else "") + "---|")
    for name, total, extra, driver_extra, where in rows:
        print(f"| {name} | {total:g} | {extra:g} |" + (f" {driver_extra:g} |" if driver_col else "") + f" {where or '—'} |")


if __name__ == "__main__":
    main()
