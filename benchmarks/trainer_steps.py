"""What the trainer-step benchmarks share (`hf_step.py`, `trl_step.py`): the seeded GPT-2, a
callback that times each optimizer step, each variant's peak in a fresh process, the medians of
per-round step times and ratios, and the table."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

import torch
from measure import PeakMemory

__all__ = ["compare_variants", "fresh_process_peaks", "gpt2", "memory_worker", "print_step_table", "step_medians", "step_times"]


def gpt2(args):
    """A seeded GPT-2 of ``args.dim``, ``args.layers``, ``args.vocab``, ``args.length`` (no dropout)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.dim, n_head=max(args.dim // 64, 1), vocab_size=args.vocab,
                     n_positions=args.length, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def step_times(cuda: bool = False):
    """A ``TrainerCallback`` whose ``seconds`` are each optimizer step's wall time (``on_step_begin``
    to ``on_step_end``; synchronized on CUDA)."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self._start)

    return StepTimes()


def memory_worker(trainer, variant: str) -> None:
    """Train `trainer` and print its peak (`measure.PeakMemory`) as ``RESULT {...}`` for
    `fresh_process_peaks`."""
    with PeakMemory(torch.device("cpu")) as peak:
        trainer.train()
    print("RESULT " + json.dumps({"variant": variant, "peak_bytes": peak.bytes}))


def fresh_process_peaks(script: str, variants: list[str], flags: list[str]) -> dict[str, int]:
    """variant -> peak bytes, each in a fresh process: ``script --worker V *flags`` (`memory_worker`)."""
    peaks = {}
    for variant in variants:
        done = subprocess.run([sys.executable, script, "--worker", variant, *flags], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise SystemExit(f"the memory worker of {variant} failed:\n{done.stderr[-3000:]}")
        (line,) = [json.loads(x[len("RESULT "):]) for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        peaks[variant] = line["peak_bytes"]
    return peaks


def step_medians(make: Callable[[str], tuple], variants: list[str], rounds: int,
                 baseline: str = "plain") -> tuple[dict[str, float], dict[str, float]]:
    """(variant -> median step seconds, variant -> median over rounds of its ratio to `baseline` in
    the same round): each round trains every variant's ``make(variant)`` = (trainer, `step_times`)
    and takes the median of its steps after the first (a warm-up); the rounds alternate the order."""
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        times = {}
        for variant in variants if r % 2 == 0 else variants[::-1]:
            trainer, timer = make(variant)
            trainer.train()
            times[variant] = statistics.median(timer.seconds[1:])
        for v in variants:
            seconds[v].append(times[v])
            ratios[v].append(times[v] / times[baseline])
    return ({v: statistics.median(s) for v, s in seconds.items()}, {v: statistics.median(x) for v, x in ratios.items()})


def print_step_table(title: str, variants: list[str], seconds: Mapping[str, float], ratios: Mapping[str, float],
                     peaks: Mapping[str, int]) -> None:
    """The markdown table of step times and peaks against ``plain``, then the JSON of the numbers."""
    print(title)
    print("| variant | step (s) | time / plain | training peak (MiB) | peak / plain |")
    print("|---|---:|---:|---:|---:|")
    for v in variants:
        print(f"| {v} | {seconds[v]:.3f} | {ratios[v]:.3f} | {peaks[v] / 2**20:.0f} | {peaks[v] / max(peaks['plain'], 1):.3f} |")
    print(json.dumps({"seconds": dict(seconds), "ratios": dict(ratios), "peak_bytes": dict(peaks)}))


def compare_variants(script: str, args, known: Mapping[str, object], make: Callable[[str, int, str], tuple],
                     flags: list[str], what: str) -> None:
    """The single-process comparison of ``args.variants`` (comma-separated, with ``plain``, among
    `known`): peaks in fresh processes of `script` (with `flags`), step times over ``args.rounds``
    rounds of ``make(variant, steps, out)`` trainers, and the table titled by `what` and the sizes."""
    import os

    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in known]
    if unknown or "plain" not in variants:
        raise SystemExit(f"--variants {args.variants!r}: expected 'plain' and any of {', '.join(known)}")
    peaks = fresh_process_peaks(script, variants, flags)
    seconds, ratios = step_medians(lambda v: make(v, 1 + args.steps, os.path.join(args.out, f"time-{v}")), variants,
                                   args.rounds)
    print_step_table(f"{what}, GPT-2 d={args.dim}, {args.layers} layers, V={args.vocab}, {args.batch}×{args.length} "
                     f"tokens per step, fp32 CPU ({torch.get_num_threads()} threads), median of {args.rounds} rounds × "
                     f"{args.steps} steps", variants, seconds, ratios, peaks)
