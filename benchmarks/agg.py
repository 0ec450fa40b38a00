"""AGG head cost on CPU: plain F.linear + CE vs the official three-logit construction vs
`gated_linear` + CE vs the fused chunked `fused_linear_cross_entropy`; and the token counter.

    python benchmarks/agg.py                       # N=4096, d=768, V=50304, fp32, 2 threads
    python benchmarks/agg.py --tokens 512 --dim 64 --vocab 4096 --rounds 1 --counter-steps 30 \
        --window 10 --counter-tokens 1000                                 # smoke run
    python benchmarks/agg.py --device cuda --dtype bf16                   # GPU: CUDA events, allocator peaks

Method (docs/performance.md §4, §6.2; the machine is shared and loaded, so absolute seconds vary 2-4×):
- memory: each variant in a fresh subprocess; peak memory during its first step minus the memory
  held just before it (`measure.PeakMemory`: on the CPU the peak resident set size, on CUDA
  the allocator's peak), so inputs, weights and imports are excluded and the weight gradient,
  logits and temporaries are included;
- time: wall-clock forward+backward of one step, in one process holding the inputs, after one
  untimed step per variant; every round runs each variant next to a plain step (alternating
  which goes first) and records their ratio; reported: the median of these paired ratios, the
  median and the minimum time;
- gates: Zipf(1.2) targets and the appearance a_k of 32k-token steps (``--counter-tokens``) of
  the same law, α = 0.03 ("typical": 44% of ids rare, 1.6% rare-target rows), and a worst case
  for the row groups (half the rows have rare targets).
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
import torch.nn.functional as F
from measure import PeakMemory, add_device_args, device_of, elapsed, precision

VARIANTS = ("plain", "three_logit", "gated_linear", "fused", "fused_plain", "gated_linear_worst", "fused_worst")


def _zipf(vocab: int, s: float = 1.2) -> torch.Tensor:
    p = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-s)
    return p / p.sum()


def _inputs(args, worst: bool):
    from aniso_plugins import agg_gates

    g = torch.Generator().manual_seed(0)
    probs = _zipf(args.vocab)
    a = (probs * args.counter_tokens).float()  # expected count per step: the appearance over a full window
    gates = agg_gates(a, 0.03)
    y = torch.multinomial(probs, args.tokens, replacement=True, generator=g)
    if worst:
        rare_ids = gates.rare.nonzero().squeeze(1)
        half = torch.rand(args.tokens, generator=g) < 0.5
        y[half] = rare_ids[torch.randint(len(rare_ids), (int(half.sum()),), generator=g)]
    device = torch.device(args.device)
    x = torch.randn(args.tokens, args.dim, generator=g).to(device).requires_grad_(True)
    w = (torch.randn(args.vocab, args.dim, generator=g) * 0.02).to(device).requires_grad_(True)
    return x, w, y.to(device), gates.to(device)


def _three_logit(x, w, y, gates):
    """The official structure (cross_entropy_agg.py): dense gate tensors, three logits, three
    log-softmaxes; rare-target rows found with gates.rare[y] instead of the N×|V_r| matrix."""
    rare_t = gates.rare[y]
    nr, r = (~rare_t).nonzero().squeeze(1), rare_t.nonzero().squeeze(1)
    loss = F.cross_entropy(F.linear(x, w.detach()), y, reduction="sum")
    for rows, gv in ((nr, gates.g1), (r, gates.g2)):
        gate = gv.expand(rows.numel(), w.shape[0]).clone()
        gate[torch.arange(rows.numel(), device=gate.device), y[rows]] = 1.0
        z = F.linear(x.detach()[rows], w)
        z = gate * z + (1.0 - gate) * z.detach()
        loss = loss + F.cross_entropy(z, y[rows], reduction="sum")
    return loss / y.numel()


def _loss(variant, x, w, y, gates, chunk):
    from aniso_plugins import fused_linear_cross_entropy, gated_linear

    if variant == "plain":
        loss = F.cross_entropy(F.linear(x, w).float(), y)
    elif variant == "three_logit":
        loss = _three_logit(x, w, y, gates)
    elif variant.startswith("gated_linear"):
        loss = F.cross_entropy(gated_linear(x, w, y, gates), y)
    elif variant == "fused_plain":
        loss = fused_linear_cross_entropy(x, w, y, None, chunk_size=chunk)
    else:
        loss = fused_linear_cross_entropy(x, w, y, gates, chunk_size=chunk)
    return loss


def _step(variant, x, w, y, gates, args):
    """One forward (under the benchmark's precision) and backward of `variant`."""
    x.grad = w.grad = None
    with precision(torch.device(args.device), args.dtype):
        loss = _loss(variant, x, w, y, gates, args.chunk)
    loss.backward()


def _warm_up(args) -> None:
    tiny = argparse.Namespace(tokens=16, dim=4, vocab=64, counter_tokens=8, device=args.device)
    for v in VARIANTS:  # lazy imports and first-call costs, before any measurement
        _step(v, *_inputs(tiny, worst=v.endswith("_worst")), args)


def memory_worker(args) -> None:
    torch.set_num_threads(args.threads)
    _warm_up(args)
    x, w, y, gates = _inputs(args, worst=args.memory_worker.endswith("_worst"))
    with PeakMemory(device_of(args)) as peak:
        _step(args.memory_worker, x, w, y, gates, args)
    print(json.dumps({"peak": peak.bytes, "rare_rows": float(gates.rare[y].float().mean())}))


def timing(args, variants: list[str]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Times per variant, and ratios to a plain step run right before or after it (paired)."""
    torch.set_num_threads(args.threads)
    _warm_up(args)
    typical, worst = _inputs(args, worst=False), _inputs(args, worst=True)

    def run(v: str) -> float:
        x, w, y, gates = worst if v.endswith("_worst") else typical
        return elapsed(lambda: _step(v, x, w, y, gates, args), device_of(args))

    for v in variants:  # untimed first step of each variant
        run(v)
    times: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            if v == "plain":
                continue
            if r % 2:  # alternate which of the pair runs first
                tv, tp = run(v), run("plain")
            else:
                tp, tv = run("plain"), run(v)
            times[v].append(tv)
            times["plain"].append(tp)
            ratios[v].append(tv / tp)
        done = ", ".join(f"{v} {ratios[v][-1]:.2f}" for v in variants if v != "plain")
        print(f"round {r + 1}: {done}", file=sys.stderr, flush=True)
    ratios["plain"] = [1.0]
    return times, ratios


COUNTER_POOL = 64
"""Distinct target batches per law, cycled over the steps (generating a fresh batch per step
would cost more than the update being measured)."""


def _target_pool(args, law: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n, v = args.counter_tokens, args.vocab
    if law == "uniform":
        return [torch.randint(0, v, (n,), generator=g).to(args.device) for _ in range(COUNTER_POOL)]
    probs = _zipf(v)
    return [torch.multinomial(probs, n, replacement=True, generator=g).to(args.device) for _ in range(COUNTER_POOL)]


def counter_benchmark(args) -> list[str]:
    """One table row per target law: `SlidingTokenCounter` over ``args.counter_steps`` steps of
    ``args.counter_tokens`` targets (on ``args.device``, where the counter counts them; on CUDA
    each timed part ends with a synchronize) from `COUNTER_POOL` batches cycled; update + step and appearance + gates timed on
    the steps after the window is full (every step while it never fills), median in ms; memory
    = `SlidingTokenCounter.nbytes` at the end."""
    from aniso_plugins import SlidingTokenCounter, agg_gates

    torch.set_num_threads(args.threads)
    lines = []
    for law in ("zipf1.2", "uniform"):
        pool = _target_pool(args, law)
        counter = SlidingTokenCounter(args.vocab, args.window, device=pool[0].device)  # where the targets are
        sync = torch.cuda.synchronize if pool[0].device.type == "cuda" else (lambda: None)
        upd, gate_t = [], []
        timed_from = args.window if args.counter_steps > args.window else 0
        for i in range(args.counter_steps):
            y = pool[i % COUNTER_POOL]
            sync()
            t0 = time.perf_counter()
            counter.update(y)
            sync()
            t1 = time.perf_counter()
            if i >= timed_from:
                agg_gates(counter.appearance(), 0.03, steps=counter.steps_in_window)
            sync()
            t2 = time.perf_counter()
            counter.step()
            sync()
            t3 = time.perf_counter()
            if i >= timed_from:
                upd.append((t1 - t0) + (t3 - t2))
                gate_t.append(t2 - t1)
        full = counter.step_index > args.window
        dense = (args.window + 1) * args.vocab * 4
        lines.append(
            f"| {law} | {args.counter_tokens} | {args.vocab} | {args.window} | "
            f"{statistics.median(upd) * 1e3:.2f} | {statistics.median(gate_t) * 1e3:.2f} | "
            f"{counter.nbytes / 2**20:.1f}{'' if full else ' (window not full)'} | {dense / 2**20:.1f} | "
            f"{counter.nbytes / dense:.3f} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(p)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=1024, help="token rows per chunk of the fused op")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (each runs every variant next to plain)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--window", type=int, default=5000)
    p.add_argument("--counter-tokens", type=int, default=32768)
    p.add_argument("--counter-steps", type=int, default=5200)
    p.add_argument("--memory-worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    device_of(args)
    if args.memory_worker:
        memory_worker(args)
        return

    variants = args.variants.split(",")
    base = [sys.executable, os.path.abspath(__file__)] + [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("tokens", "dim", "vocab", "threads", "chunk", "counter_tokens", "device", "dtype")
    ]
    memory = {}
    for v in variants:
        out = subprocess.run(base + [f"--memory-worker={v}"], capture_output=True, text=True, check=True)
        memory[v] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"memory {v}: {memory[v]}", file=sys.stderr, flush=True)
    if "plain" not in variants:
        raise SystemExit("--variants must include plain (the baseline)")
    times, ratios = timing(args, variants) if args.rounds else ({}, {})

    print(
        f"\nHead, N={args.tokens} tokens, d={args.dim}, V={args.vocab}, {args.dtype} {args.device}, {args.threads} threads, "
        f"fused chunks of {args.chunk} rows; {args.rounds} timed rounds\n"
    )
    print(
        "| variant | rare-target rows | time x plain (median of paired ratios) | time median (s) | time min (s) "
        "| peak extra MB | memory x plain |"
    )
    print("|---|---|---|---|---|---|---|")
    ref_mem = memory.get("plain", {"peak": 1})["peak"]
    for v in variants:
        if times:
            cells = f"{statistics.median(ratios[v]):.2f} | {statistics.median(times[v]):.2f} | {min(times[v]):.2f}"
        else:
            cells = "- | - | -"
        mem = memory[v]["peak"]
        print(f"| {v} | {memory[v]['rare_rows']:.1%} | {cells} | {mem / 2**20:.0f} | {mem / ref_mem:.3f} |")
    if args.counter_steps:
        print(f"\nToken counter, {args.counter_steps} steps (window full after {args.window})\n")
        print(
            "| targets | tokens/step | V | K | update+step ms (median) | appearance+gates ms | memory MiB "
            "| dense (K+1)xV fp32 MiB | ratio |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for line in counter_benchmark(args):
            print(line)


if __name__ == "__main__":
    main()
