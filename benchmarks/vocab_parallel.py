"""The vocabulary-parallel fused AGG cross-entropy per rank against the 1-rank fused op (docs/performance.md §9).

    python benchmarks/vocab_parallel.py                                  # N=4096, V=32768 and 131072, d=768, tp=2
    python benchmarks/vocab_parallel.py --tokens 1024 --vocab 4096 --dim 64 --rounds 1   # smoke run

For each V, `fused_linear_cross_entropy` (typical AGG gates, as benchmarks/agg.py: Zipf(1.2)
targets, α = 0.03 on the appearance of 32k-token steps of the same law) runs forward + backward:

- 1 rank: the whole (V, d) head in one process;
- tp ranks (real gloo processes, ``torch.multiprocessing``): each holds ``torch.chunk(W, tp)[rank]``,
  the same hidden states and targets, and computes the same loss (the two all-reduces per chunk
  included).

Per rank: peak memory of a step (`measure.PeakMemory`: the process's peak RSS above what it
held before the call; inputs excluded; after a 256-row warm-up step, which takes the one-time
allocations of the GEMM library and gloo out of it) and the median step time over ``--rounds``.
The ratios are per rank against the 1-rank op (target: memory ≤ 0.6× at tp = 2). One
thread per process, so the tp processes use as many cores as tp single-rank runs would.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)


def _inputs(n: int, v: int, d: int):
    from aniso_plugins import agg_gates

    g = torch.Generator().manual_seed(0)
    probs = torch.arange(1, v + 1, dtype=torch.float64) ** -1.2
    probs /= probs.sum()
    y = torch.multinomial(probs, n, replacement=True, generator=g)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * 0.02
    return x, w, y, agg_gates((probs * 32768).float(), 0.03)


def step(x, w, y, gates, shard=None) -> float:
    """One forward + backward; returns the loss."""
    from aniso_plugins import fused_linear_cross_entropy

    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    loss = fused_linear_cross_entropy(x, w, y, gates, shard=shard)
    loss.backward()
    return float(loss.detach())


def measure(x, w, y, gates, rounds: int, shard=None) -> tuple[float, float, float]:
    """(loss, peak bytes, median seconds) of `step`."""
    from measure import PeakMemory, elapsed

    cpu = torch.device("cpu")
    step(x[:256], w, y[:256], gates, shard)  # warm-up: the one-time allocations (GEMM, gloo) out of the peak
    with PeakMemory(cpu) as peak:
        loss = step(x, w, y, gates, shard)
    times = [elapsed(lambda: step(x, w, y, gates, shard), cpu) for _ in range(rounds)]
    return loss, peak.bytes, statistics.median(times)


def _rank_worker(rank: int, world: int, n: int, v: int, d: int, rounds: int) -> tuple[float, float, float]:
    from torch.distributed.device_mesh import init_device_mesh

    from aniso_plugins.numerics.distributed import VocabShard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    shard = VocabShard.of(mesh, v)
    x, w, y, gates = _inputs(n, v, d)
    w = w[shard.start : shard.stop].clone()
    return measure(x, w, y, gates, rounds, shard)


def _one_rank(n: int, v: int, d: int, rounds: int) -> tuple[float, float, float]:
    torch.set_num_threads(1)
    return measure(*_inputs(n, v, d), rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", default="32768,131072", help="comma-separated vocabulary sizes")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from dist_utils import run_distributed

    print(f"fused AGG cross-entropy, N={args.tokens}, d={args.dim}, float32, CPU, 1 thread per rank; "
          f"tp={args.tp} gloo processes; median of {args.rounds} steps after one")
    print("| V | 1 rank: peak MiB | 1 rank: step s | per rank at tp: peak MiB | step s | memory ratio | time ratio "
          "| loss equal |\n|---|---|---|---|---|---|---|---|")
    for v in (int(s) for s in args.vocab.split(",")):
        with tempfile.TemporaryDirectory():
            loss1, mem1, t1 = _one_rank(args.tokens, v, args.dim, args.rounds)
        ranks = run_distributed(_rank_worker, args.tokens, v, args.dim, args.rounds, world=args.tp)
        mem, t = max(r[1] for r in ranks), max(r[2] for r in ranks)
        same = all(abs(r[0] - loss1) <= 1e-5 * abs(loss1) for r in ranks)
        memory_ratio = f"{mem / mem1:.2f}" if mem1 > 0 else "n/a (no growth above the warm-up)"
        print(f"| {v} | {mem1 / 2**20:.0f} | {t1:.3f} | {mem / 2**20:.0f} | {t:.3f} | {memory_ratio} | {t / t1:.2f} "
              f"| {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
