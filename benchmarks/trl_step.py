"""TRL's SFTTrainer step with aniso_plugins' head methods against the plain SFTTrainer
(docs/performance.md §13): TRL's chunked loss kept, or given up for the head's logits.

    python benchmarks/trl_step.py             # GPT-2 d=128, 2 layers, V=151936 (Qwen's), 4×512 tokens per step, fp32 CPU
    python benchmarks/trl_step.py --vocab 50257
    python benchmarks/trl_step.py --smoke     # tiny sizes (the test suite)

Variants, each a real ``trl.SFTTrainer`` with TRL's defaults (its fused LM head: log-probabilities
in vocabulary tiles of 32768 ids, never the logits; AdamW, no clipping) on the same seeded model
and Zipf(1.2) token ids: ``plain`` (no callback), ``agg`` (``method="agg"``: the head answers
TRL's fused call chunk by chunk, AGG-gated), ``cosreg`` (``method="cosreg"``: the same chunked
call, plus the regularizer), ``agg_logits`` (``method="agg", fused_loss=False``: TRL's call
computed from the head's full logits, the 0.2 behaviour).

- time: one process; ``--rounds`` rounds each train every variant for ``--steps`` optimizer steps
  after one warm-up step in the same trainer; the table gives each variant's median step time and
  the median over rounds of its ratio to ``plain`` of the same round;
- memory: each variant in a fresh process: the peak resident memory during ``train()`` of two
  steps above what the process held after building the model, the data and the trainer
  (`measure.PeakMemory`).

The target of issue 50: ``agg`` ≤ 1.0× plain's peak at ≤ 1.05× its time.
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
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, HERE)

from measure import PeakMemory  # noqa: E402

VARIANTS = {
    "plain": None,
    "agg": dict(method="agg"),
    "cosreg": dict(method="cosreg", reg_weight=0.1),
    "agg_logits": dict(method="agg", fused_loss=False),
}
SIZES = {"full": (128, 2, 151936, 4, 512), "smoke": (32, 1, 1000, 2, 32)}  # dim, layers, vocab, batch, length


def _model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.dim, n_head=max(args.dim // 64, 1), vocab_size=args.vocab,
                     n_positions=args.length, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _data(n: int, length: int, vocab: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    p = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-1.2)
    ids = torch.multinomial(p / p.sum(), n * length, replacement=True, generator=g).view(n, length)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def _trainer(args, variant: str, steps: int, out: str):
    import trl
    from transformers import TrainerCallback

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.hf import AnisoCallback

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, *a, **k):
            self._start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.seconds.append(time.perf_counter() - self._start)

    sys.path.insert(0, TESTS)
    from word_data import tokenizer  # the pad and eos ids only: the data is token ids already

    fields = VARIANTS[variant]
    config = None if fields is None else AnisoConfig(metrics=(), window=100, load_entry_points=False, **fields)
    times = StepTimes()
    trainer = trl.SFTTrainer(
        model=_model(args),
        args=trl.SFTConfig(output_dir=out, per_device_train_batch_size=args.batch, max_steps=steps, report_to="none",
                           disable_tqdm=True, save_strategy="no", logging_strategy="no", max_grad_norm=0.0, seed=0,
                           use_cpu=True, bf16=False, max_length=args.length, dataloader_num_workers=0),
        train_dataset=_data(args.batch * steps, args.length, args.vocab),
        processing_class=tokenizer(),
        callbacks=([] if config is None else [AnisoCallback(config)]) + [times],
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
    return [f"--{name}={getattr(args, name)}" for name in ("dim", "layers", "vocab", "batch", "length")] + [
        f"--out={args.out}"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, help="default 128")
    p.add_argument("--layers", type=int, help="default 2")
    p.add_argument("--vocab", type=int, help="default 151936")
    p.add_argument("--batch", type=int, help="sequences per step; default 4")
    p.add_argument("--length", type=int, help="default 512")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per round (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="/tmp/aniso-trl-step")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, value in zip(("dim", "layers", "vocab", "batch", "length"), SIZES["smoke" if args.smoke else "full"]):
        if getattr(args, name) is None or args.smoke:
            setattr(args, name, value)
    if args.smoke:
        args.steps, args.rounds = 1, 1
    if args.worker:
        _memory_worker(args)
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or "plain" not in variants:
        raise SystemExit(f"--variants {args.variants!r}: expected 'plain' and any of {', '.join(VARIANTS)}")
    peaks = _memory(args, variants)
    seconds, ratios = _times(args, variants)
    print(f"TRL SFTTrainer step, GPT-2 d={args.dim}, {args.layers} layers, V={args.vocab}, {args.batch}×{args.length} "
          f"tokens per step, fp32 CPU ({torch.get_num_threads()} threads), median of {args.rounds} rounds × {args.steps} steps")
    print("| variant | step (s) | time / plain | training peak (MiB) | peak / plain |")
    print("|---|---:|---:|---:|---:|")
    for v in variants:
        print(f"| {v} | {seconds[v]:.3f} | {ratios[v]:.3f} | {peaks[v] / 2**20:.0f} | {peaks[v] / max(peaks['plain'], 1):.3f} |")
    print(json.dumps({"seconds": seconds, "ratios": ratios, "peak_bytes": peaks}))


if __name__ == "__main__":
    main()
