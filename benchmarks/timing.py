"""Timing for the benchmark scripts (docs/performance.md §6.2): each case's minimum over
interleaved rounds after one warm-up call, in wall seconds and in CPU seconds of this process
(all its threads; the steadier figure on a shared machine), and the table of ratios to a
baseline measured in the same process. On CUDA the wall time is taken between CUDA events
around the call, synchronized (`measure.elapsed`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch
from measure import elapsed

CPU = torch.device("cpu")


def timed(fn: Callable[[], None], device: torch.device = CPU) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call of `fn` on `device`."""
    cpu = time.process_time()
    wall = elapsed(fn, device)
    return wall, time.process_time() - cpu


def best_times(
    cases: Mapping[str, Callable[[], None]], rounds: int, device: torch.device = CPU
) -> dict[str, tuple[float, float]]:
    """name -> (min wall, min CPU) over `rounds` rounds, every case once per round, after one
    warm-up call of each."""
    for run in cases.values():
        run()
    best = {name: (float("inf"), float("inf")) for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            wall, cpu = timed(run, device)
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def print_ratio_table(best: Mapping[str, tuple[float, float]], settings: Mapping[str, str], baseline: str) -> None:
    """A markdown table of every case's times and their ratios to the `baseline` case."""
    base_wall, base_cpu = best[baseline]
    print("| case | setting | wall (s) | / baseline | CPU (s) | / baseline |")
    print("|---|---|---|---|---|---|")
    for name, (wall, cpu) in best.items():
        print(f"| {name} | {settings.get(name, '')} | {wall:.3f} | {wall / base_wall:.3f} | {cpu:.3f} | {cpu / base_cpu:.3f} |")


__all__ = ["best_times", "print_ratio_table", "timed"]
