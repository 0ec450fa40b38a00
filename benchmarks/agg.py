"""AGG head cost on CPU: plain F.linear + CE vs the official three-logit construction vs
`agg_linear` + CE vs the fused chunked `agg_cross_entropy`; and the token counter.

    python benchmarks/agg.py                       # N=4096, d=768, V=50304, fp32, 2 threads
    python benchmarks/agg.py --tokens 512 --vocab 4096 --rounds 1 --counter-steps 50   # smoke run

Method (performance.md §4, §6.2):
- every (variant, round) runs in a fresh subprocess; rounds are interleaved over the variants,
  so load from other processes on the machine hits all variants alike;
- time: wall-clock forward+backward of one step, after one untimed step; reported as the
  median and the minimum over all timed steps of all rounds;
- memory: peak resident set size during the first step (``ru_maxrss`` after it) minus the
  resident set size just before it (``/proc/self/statm``), so inputs, weights and imports are
  excluded and the weight gradient, logits and temporaries are included; torch's CPU allocator
  exposes no peak statistic and tracemalloc does not see torch allocations.
- gates: Zipf(1.2) targets and the appearance a_k of 32k-token steps (``--counter-tokens``) of
  the same law, α = 0.03
  ("typical": ≈43% of ids rare, ≈1.4% rare-target rows), and a worst case for the row groups
  (half the rows have rare targets).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

VARIANTS = ("plain", "three_logit", "agg_linear", "fused", "fused_plain", "agg_linear_worst", "fused_worst")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
    x = torch.randn(args.tokens, args.dim, generator=g).requires_grad_(True)
    w = (torch.randn(args.vocab, args.dim, generator=g) * 0.02).requires_grad_(True)
    return x, w, y, gates


def _three_logit(x, w, y, gates):
    """The official structure (cross_entropy_agg.py): dense gate tensors, three logits, three
    log-softmaxes; rare-target rows found with gates.rare[y] instead of the N×|V_r| matrix."""
    rare_t = gates.rare[y]
    nr, r = (~rare_t).nonzero().squeeze(1), rare_t.nonzero().squeeze(1)
    loss = F.cross_entropy(F.linear(x, w.detach()), y, reduction="sum")
    for rows, gv in ((nr, gates.g1), (r, gates.g2)):
        gate = gv.expand(rows.numel(), w.shape[0]).clone()
        gate[torch.arange(rows.numel()), y[rows]] = 1.0
        z = F.linear(x.detach()[rows], w)
        z = gate * z + (1.0 - gate) * z.detach()
        loss = loss + F.cross_entropy(z, y[rows], reduction="sum")
    return loss / y.numel()


def _step(variant, x, w, y, gates, chunk):
    from aniso_plugins import agg_cross_entropy, agg_linear

    x.grad = w.grad = None
    if variant == "plain":
        loss = F.cross_entropy(F.linear(x, w).float(), y)
    elif variant == "three_logit":
        loss = _three_logit(x, w, y, gates)
    elif variant.startswith("agg_linear"):
        loss = F.cross_entropy(agg_linear(x, w, y, gates), y)
    elif variant == "fused_plain":
        loss = agg_cross_entropy(x, w, y, None, chunk_size=chunk)
    else:
        loss = agg_cross_entropy(x, w, y, gates, chunk_size=chunk)
    loss.backward()


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    tiny = argparse.Namespace(tokens=16, dim=4, vocab=64, counter_tokens=8)
    _step(args.worker, *_inputs(tiny, worst=False), args.chunk)  # lazy imports before the baseline
    x, w, y, gates = _inputs(args, worst=args.worker.endswith("_worst"))
    before = _rss_bytes()
    start = time.perf_counter()
    _step(args.worker, x, w, y, gates, args.chunk)
    first = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        _step(args.worker, x, w, y, gates, args.chunk)
        times.append(time.perf_counter() - start)
    rare_rows = float(gates.rare[y].float().mean())
    print(json.dumps({"peak": peak, "times": times, "first": first, "rare_rows": rare_rows, "rare_ids": float(gates.rare.float().mean())}))


def counter_benchmark(args) -> list[str]:
    from aniso_plugins import TokenCounter, agg_gates

    torch.set_num_threads(args.threads)
    lines = []
    for law in ("zipf1.2", "uniform"):
        g = torch.Generator().manual_seed(1)
        probs = _zipf(args.vocab)
        counter = TokenCounter(args.vocab, args.window)
        upd, gate_t = [], []
        for _ in range(args.counter_steps):
            if law == "uniform":
                y = torch.randint(0, args.vocab, (args.counter_tokens,), generator=g)
            else:
                y = torch.multinomial(probs, args.counter_tokens, replacement=True, generator=g)
            t0 = time.perf_counter()
            counter.update(y)
            t1 = time.perf_counter()
            agg_gates(counter.appearance(), 0.03, steps=counter.steps_in_window)
            t2 = time.perf_counter()
            counter.step()
            t3 = time.perf_counter()
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
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=1024, help="token rows per chunk of the fused op")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=1, help="timed steps per process, after the memory step")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--window", type=int, default=5000)
    p.add_argument("--counter-tokens", type=int, default=32768)
    p.add_argument("--counter-steps", type=int, default=5200)
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    variants = args.variants.split(",")
    results = {v: [] for v in variants}
    base = [sys.executable, os.path.abspath(__file__)] + [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("tokens", "dim", "vocab", "threads", "chunk", "reps", "counter_tokens")
    ]
    for r in range(args.rounds):
        for v in variants:
            out = subprocess.run(base + [f"--worker={v}"], capture_output=True, text=True, check=True)
            results[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {v}: {results[v][-1]}", file=sys.stderr, flush=True)

    def summary(v):
        times = [t for res in results[v] for t in res["times"]]
        return statistics.median(times), min(times), statistics.median(res["peak"] for res in results[v])

    ref_med, ref_min, ref_mem = summary("plain") if "plain" in variants else (1.0, 1.0, 1.0)
    print(
        f"\nHead, N={args.tokens} tokens, d={args.dim}, V={args.vocab}, fp32 CPU, {args.threads} threads, "
        f"chunk {args.chunk}; {args.rounds} rounds x {args.reps} timed step(s), one process each, interleaved\n"
    )
    print("| variant | rare-target rows | time median (s) | x plain | time min (s) | x plain | peak extra MB | x plain |")
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        med, mn, mem = summary(v)
        rr = results[v][0]["rare_rows"]
        print(
            f"| {v} | {rr:.1%} | {med:.2f} | {med / ref_med:.2f} | {mn:.2f} | {mn / ref_min:.2f} | "
            f"{mem / 2**20:.0f} | {mem / ref_mem:.3f} |"
        )
    if args.counter_steps:
        print(f"\nToken counter, {args.counter_steps} steps (window full after {args.window})\n")
        print("| targets | tokens/step | V | K | update+step ms (median) | appearance+gates ms | memory MiB | dense (K+1)xV fp32 MiB | ratio |")
        print("|---|---|---|---|---|---|---|---|---|")
        for line in counter_benchmark(args):
            print(line)


if __name__ == "__main__":
    main()
