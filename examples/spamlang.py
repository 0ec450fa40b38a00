"""SpamLang (Godey & Artzi 2026, §3.2; docs/methods.md §9.6): a language whose every sequence is
one token, drawn uniformly from the usable vocabulary, repeated, after an optional BOS. A model
that has seen the token once can predict every later position, so accuracy on the positions
≥ 2 measures how well the LM head learned; the seed reports that this gets harder as the
vocabulary V grows at a fixed width D, which it attributes to the gradient bottleneck.

    python examples/spamlang.py                 # both sweeps (V at fixed D, then D at fixed V), 3 seeds
    python examples/spamlang.py --quick         # a smoke run: 2 + 2 tiny runs, a few steps

Each run trains a tiny tied GPT-2 through the real HF Trainer with an `AnisoCallback` whose
``bottleneck`` probe measures the lost fraction at step 1 (initialisation) and at the last
step. D is the rank of a low-rank head on a fixed backbone (``--d-mode rank``, the seed's
setting) or the model width (``--d-mode width``). Reported per run: accuracy and loss on
positions ≥ 2 of held-out sequences, the coverage (share of usable ids that occurred as a
target in training: an id never seen cannot be predicted however good the head, which
separates untrained rows from the bottleneck), the lost fraction at start and end, wall time.
Writes ``spamlang.json``, ``spamlang.md`` and ``spamlang.png`` (accuracy against V/D) into
``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.hf import AnisoCallback

BOS = 0


class SpamLang(torch.utils.data.Dataset):
    """`n` sequences of `length` ids: BOS (id 0, when `bos`), then one token drawn uniformly
    from the usable ids [1, vocab) (all of [0, vocab) without BOS), repeated. Labels = inputs."""

    def __init__(self, vocab: int, n: int, length: int, seed: int, bos: bool = True) -> None:
        if vocab < 2 or length < 3:
            raise ValueError(f"vocab={vocab}, length={length}: expected vocab >= 2 and length >= 3")
        g = torch.Generator().manual_seed(seed)
        first = 1 if bos else 0
        self.tokens = torch.randint(first, vocab, (n,), generator=g)
        ids = self.tokens[:, None].expand(n, length).clone()
        if bos:
            ids[:, 0] = BOS
        self.ids = ids
        self.usable = vocab - first

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def coverage(self) -> float:
        """Share of the usable ids that occur in these sequences (each as a target)."""
        return len(torch.unique(self.tokens)) / self.usable


@torch.no_grad()
def accuracy_and_loss(model: torch.nn.Module, data: SpamLang, batch: int = 64) -> tuple[float, float]:
    """Greedy accuracy and mean cross-entropy of the targets at positions ≥ 2 (the logits at
    t ≥ 1 predict position t + 1: the token is then already in the context)."""
    model.eval()
    hits = total = 0
    nll = 0.0
    for start in range(0, len(data), batch):
        ids = data.ids[start : start + batch]
        logits = model(input_ids=ids).logits[:, 1:-1].float()
        targets = ids[:, 2:]
        hits += int((logits.argmax(-1) == targets).sum())
        nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
        total += targets.numel()
    return hits / total, nll / total


def run(vocab: int, d: int, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """One SpamLang run at vocabulary `vocab`, head rank or width `d` and `seed`."""
    width = d if args.d_mode == "width" else args.width
    if d > width:
        raise ValueError(f"D={d} > --width {width}: a low-rank head's rank is at most the width; raise --width")
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=vocab, n_positions=args.length, n_embd=width, n_layer=args.layers, n_head=2,
                   bos_token_id=BOS, eos_token_id=BOS)
    )
    model.loss_type = "ForCausalLM"
    head = dict(head="lowrank", lowrank_rank=d, lowrank_init="random") if args.d_mode == "rank" and d < width else {}
    config = AnisoConfig(metrics=("bottleneck",), **head)
    train = SpamLang(vocab, args.steps * args.batch_size, args.length, seed=seed)
    valid = SpamLang(vocab, args.valid, args.length, seed=seed + 1)
    out = tempfile.mkdtemp(prefix="aniso_spamlang_")
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch_size, learning_rate=args.lr,
            warmup_steps=args.steps // 10, lr_scheduler_type="cosine", logging_steps=args.steps, logging_first_step=True,
            save_strategy="no", report_to="none", use_cpu=True, seed=seed, disable_tqdm=True,
        ),
        train_dataset=train,
        callbacks=[AnisoCallback(config)],
    )
    trainer.remove_callback(PrinterCallback)  # one line per run below instead of the Trainer's log records
    start = time.perf_counter()
    try:
        trainer.train()
    finally:
        shutil.rmtree(out, ignore_errors=True)  # nothing is saved there (save_strategy="no")
    wall = time.perf_counter() - start
    lost = [row["aniso/bottleneck/lost_fraction"] for row in trainer.state.log_history if "aniso/bottleneck/lost_fraction" in row]
    accuracy, loss = accuracy_and_loss(trainer.model, valid)
    return {
        "vocab": vocab, "d": d, "seed": seed, "width": width, "accuracy": accuracy, "loss": loss, "coverage": train.coverage(),
        "lost_fraction_start": lost[0] if lost else float("nan"), "lost_fraction_end": lost[-1] if lost else float("nan"),
        "one_minus_d_over_v": 1 - d / vocab, "wall_s": wall,
    }  # fmt: skip


COLUMNS = ("vocab", "d", "accuracy", "loss", "coverage", "lost_fraction_start", "one_minus_d_over_v", "lost_fraction_end", "wall_s")


def write_outputs(results: list[dict], directory: str, title: str) -> list[str]:
    """spamlang.json (every run), spamlang.md (a table per sweep, mean ± std over seeds) and
    spamlang.png (accuracy against V/D, seed mean with the seeds' spread as error bars)."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, name) for name in ("spamlang.json", "spamlang.md", "spamlang.png")]
    with open(paths[0], "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"# {title}", ""]
    for sweep in ("vocab", "d"):
        lines += [f"## sweep over {'V at fixed D' if sweep == 'vocab' else 'D at fixed V'}", "",
                  "| " + " | ".join(COLUMNS) + " | seeds |", "|" + "---|" * (len(COLUMNS) + 1)]  # fmt: skip
        for runs in _points(results, sweep):
            cells = [_mean_std([r[c] for r in runs]) if isinstance(runs[0][c], float) else str(runs[0][c]) for c in COLUMNS]
            lines.append("| " + " | ".join(cells) + f" | {len(runs)} |")
        lines.append("")
    with open(paths[1], "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for sweep, marker in (("vocab", "o"), ("d", "s")):
        points = sorted(_points(results, sweep), key=lambda runs: runs[0]["vocab"] / runs[0]["d"])
        acc = [[r["accuracy"] for r in runs] for runs in points]
        spread = [statistics.stdev(a) if len(a) > 1 else 0.0 for a in acc]
        if not points:
            continue
        first = points[0][0]
        label = f"V varies, D = {first['d']}" if sweep == "vocab" else f"D varies, V = {first['vocab']}"
        ax.errorbar([runs[0]["vocab"] / runs[0]["d"] for runs in points], [statistics.fmean(a) for a in acc],
                    yerr=spread, marker=marker, capsize=3, label=label)  # fmt: skip
    ax.set(xscale="log", xlabel="V / D", ylabel="accuracy on positions ≥ 2", ylim=(-0.02, 1.02))
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    plt.close(fig)
    return paths


def _points(results: list[dict], sweep: str) -> list[list[dict]]:
    """The runs of one sweep grouped by (V, D), in sweep order; each group holds its seeds."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        if r["sweep"] == sweep:
            groups.setdefault((r["vocab"], r["d"]), []).append(r)
    return list(groups.values())


def _mean_std(values: list[float]) -> str:
    """"mean ± sample std" over seeds; the value alone for one seed."""
    mean = statistics.fmean(values)
    return f"{mean:.4g} ± {statistics.stdev(values):.2g}" if len(values) > 1 else f"{mean:.4g}"


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", type=int, nargs="+", default=[512, 2048, 8192, 32768], help="V of the V sweep")
    p.add_argument("--fixed-d", type=int, default=16, help="D of the V sweep")
    p.add_argument("--ds", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="D of the D sweep")
    p.add_argument("--fixed-vocab", type=int, default=2048, help="V of the D sweep (small enough that coverage is ~1)")
    p.add_argument("--d-mode", choices=("rank", "width"), default="rank", help="D as a low-rank head's rank, or as the width")
    p.add_argument("--width", type=int, default=128, help="backbone width when --d-mode rank")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--length", type=int, default=16, help="tokens per sequence, BOS included")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--valid", type=int, default=512, help="held-out sequences")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--output-dir", default="spamlang_out")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny sweeps, a few steps")
    a = p.parse_args(argv)
    if a.quick:
        a.vocabs, a.fixed_d, a.ds, a.fixed_vocab = [64, 256], 8, [4, 8], 128
        a.width, a.steps, a.batch_size, a.valid, a.length, a.seeds = 16, 4, 8, 16, 8, [0]
    plan = [("vocab", v, a.fixed_d) for v in a.vocabs] + [("d", a.fixed_vocab, d) for d in a.ds]
    plan = [(sweep, vocab, d, seed) for sweep, vocab, d in plan for seed in a.seeds]
    results = []
    for i, (sweep, vocab, d, seed) in enumerate(plan, 1):
        result = {"sweep": sweep, **run(vocab, d, seed, a)}
        results.append(result)
        print(f"[{i}/{len(plan)}] V={vocab} D={d} seed {seed}: accuracy {result['accuracy']:.3f}, coverage {result['coverage']:.3f}, "
              f"lost {result['lost_fraction_start']:.3f} -> {result['lost_fraction_end']:.3f} ({result['wall_s']:.0f} s)", flush=True)  # fmt: skip
    title = f"SpamLang, {a.d_mode} D, {a.steps} steps x {a.batch_size} sequences of {a.length}, seeds {a.seeds}"
    paths = write_outputs(results, a.output_dir, title)
    print("\n".join(paths))
    return paths


if __name__ == "__main__":
    main()
