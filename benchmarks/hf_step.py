"""One HF Trainer training step with and without the fused loss (docs/performance.md §8).

    python benchmarks/hf_step.py                 # GPT-2 d=256, 2 layers, V=50257, 8×512 tokens per step, fp32 CPU
    python benchmarks/hf_step.py --smoke         # tiny sizes (the test suite)

Variants, each a real `transformers.Trainer` (AdamW, no clipping) on the same seeded model and
Zipf(1.2) token ids: ``plain`` (no callback: the model's own loss from the full logits),
``mle_fused`` (``AnisoConfig(fused_loss=True)``: the same loss from the fused chunked
cross-entropy), ``agg_fused`` (``method="agg"``: fused by default), ``agg_gated`` (``method="agg",
fused_loss=False``: the gated head, full logits).

- time: one process; ``--rounds`` rounds each train every variant for ``--steps`` optimizer steps
  (after one warm-up step in the same Trainer); a step is the wall time from the Trainer's
  ``on_step_begin`` to its ``on_step_end`` (forward, backward, optimizer); the table gives each
  variant's median step time and the median over rounds of its ratio to ``plain`` of the same
  round;
- memory: each variant in a fresh process: the peak resident memory during ``train()`` of two
  steps above what the process held after building the model, the data and the Trainer
  (`measure.PeakMemory`).

The target of issue 25: fused rows ≤ 0.5× plain's peak at ≤ 1.0× its time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from measure import PeakMemory  # noqa: E402

VARIANTS = {
    "plain": None,
    "mle_fused": dict(fused_loss=True),
    "agg_fused": dict(method="agg"),
    "agg_gated": dict(method="agg", fused_loss=False),
}


def _model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.dim, n_head=max(args.dim // 64, 1), vocab_size=args.vocab,
                     n_positions=args.length, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class _Ids(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1)
        p = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-1.2)
        self.ids = torch.multinomial(p / p.sum(), n * length, replacement=True, generator=g).view(n, length)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(args, variant: str, steps: int, out: str):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.hf import AnisoCallback

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, *a, **k):
            self._start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.seconds.append(time.perf_counter() - self._start)

    fields = VARIANTS[variant]
    callbacks = [] if fields is None else [AnisoCallback(AnisoConfig(metrics=(), window=100, load_entry_points=False, **fields))]
    times = StepTimes()
    trainer = Trainer(
        model=_model(args),
        args=TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch, max_steps=steps, use_cpu=True,
                               report_to="none", disable_tqdm=True, save_strategy="no", logging_strategy="no",
                               max_grad_norm=0.0, seed=0, dataloader_num_workers=0),
        train_dataset=_Ids(args.batch * steps, args.length, args.vocab),
        callbacks=[*callbacks, times],
    )
    return trainer, times


def _memory_worker(args) -> None:
    trainer, _ = _trainer(args, args.worker, 2, os.path.join(args.out, f"mem-{args.worker}"))
    with PeakMemory(torch.device("cpu")) as peak:
        trainer.train()
    print("RESULT " + json.dumps({"variant": args.worker, "peak_bytes": peak.bytes}))


def _memory(args, variants: list[str]) -> dict[str, int]:
    peaks = {}
    for variant in variants:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, *_size_flags(args)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"the memory worker of {variant} failed:\n{done.stderr[-3000:]}")
        (line,) = [json.loads(x[len("RESULT "):]) for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        peaks[variant] = line["peak_bytes"]
    return peaks


def _times(args, variants: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        round_times = {}
        for variant in variants if r % 2 == 0 else variants[::-1]:
            trainer, times = _trainer(args, variant, 1 + args.steps, os.path.join(args.out, f"time-{variant}"))
            trainer.train()
            round_times[variant] = statistics.median(times.seconds[1:])  # after the warm-up step
            seconds[variant].append(round_times[variant])
        for variant in variants:
            ratios[variant].append(round_times[variant] / round_times["plain"])
    return ({v: statistics.median(s) for v, s in seconds.items()}, {v: statistics.median(x) for v, x in ratios.items()})


def _size_flags(args) -> list[str]:
    return ["--dim", str(args.dim), "--layers", str(args.layers), "--vocab", str(args.vocab), "--batch", str(args.batch),
            "--length", str(args.length), "--out", args.out, "--threads", str(args.threads)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per round (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="/tmp/aniso-hf-step")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.dim, args.layers, args.vocab, args.batch, args.length, args.steps, args.rounds = 32, 1, 1000, 2, 32, 1, 1
    if args.worker:
        _memory_worker(args)
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or "plain" not in variants:
        raise SystemExit(f"--variants {args.variants!r}: expected 'plain' and any of {', '.join(VARIANTS)}")
    peaks = _memory(args, variants)
    seconds, ratios = _times(args, variants)
    print(f"HF Trainer step, GPT-2 d={args.dim}, {args.layers} layers, V={args.vocab}, {args.batch}×{args.length} "
          f"tokens per step, fp32 CPU ({torch.get_num_threads()} threads), median of {args.rounds} rounds × {args.steps} steps")
    print("| variant | step (s) | time / plain | training peak (MiB) | peak / plain |")
    print("|---|---:|---:|---:|---:|")
    for v in variants:
        print(f"| {v} | {seconds[v]:.3f} | {ratios[v]:.3f} | {peaks[v] / 2**20:.0f} | {peaks[v] / max(peaks['plain'], 1):.3f} |")
    print(json.dumps({"seconds": seconds, "ratios": ratios, "peak_bytes": peaks}))


if __name__ == "__main__":
    main()
