"""Cost of the metrics on CPU, as ratios to a plain LM-head forward+backward measured in the
same process (performance.md §6.2: min over --reps timed rounds after one warm-up round,
cases interleaved within each round).

- baseline: ``F.cross_entropy(head(h), y)`` forward+backward, fp32, N tokens, V×d head;
- one full geometry measurement of the head (`GeometryPlugin` through `AnisoPlugins.measure`:
  Gram, two eigen-decompositions, raw and centered I(W), mean cosines, spectrum metrics), and
  its parts (`mean_cosine`, `spectrum`, `isotropy`; ``torch.linalg.svdvals`` for scale);
- the gradient-bottleneck probe (`BottleneckPlugin`): the probe micro-batch's forward+backward
  with the hooks armed, and the measurement that finishes it.

Run: ``python benchmarks/metrics.py [--vocab 50304] [--hidden 768] [--tokens 4096] [--reps 5]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from aniso_plugins import AnisoConfig, AnisoPlugins, ModelHandle, StepInfo, isotropy, mean_cosine, spectrum


class Head(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():  # a GPT-2-like init plus a shared offset (a mildly anisotropic head)
            self.lm_head.weight.normal_(0.0, 0.02).add_(0.01)


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = Head(args.vocab, args.hidden)
    weight = model.lm_head.weight
    h = torch.randn(args.tokens, args.hidden)
    y = torch.randint(0, args.vocab, (args.tokens,))

    def head_step(head: nn.Module) -> None:
        x = h.clone().requires_grad_(True)
        F.cross_entropy(head(x), y).backward()
        head.weight.grad = None

    geometry = AnisoPlugins(AnisoConfig(metrics=("geometry",), load_entry_points=False))
    geometry.setup(ModelHandle(model, head="lm_head"))
    probed = Head(args.vocab, args.hidden)  # the same weight, with the probe's hooks
    probed.lm_head.weight = model.lm_head.weight
    probe = AnisoPlugins(AnisoConfig(metrics=("bottleneck",), load_entry_points=False))
    probe.setup(ModelHandle(probed, head="lm_head"))
    probe_parts: dict[str, list[float]] = {"probe: armed forward+backward": [], "probe: measurement": []}

    def probe_step() -> None:
        probe.targets(y, StepInfo(step=1, measure=True))
        probe_parts["probe: armed forward+backward"].append(_timed(lambda: head_step(probed.lm_head)))
        probe_parts["probe: measurement"].append(_timed(lambda: probe.measure(StepInfo(step=1, measure=True))))

    cases: dict[str, Callable[[], None]] = {
        "head forward+backward (baseline)": lambda: head_step(model.lm_head),
        "geometry measurement (all metrics, head)": lambda: geometry.measure(StepInfo(step=1, measure=True)),
        "  mean_cosine": lambda: mean_cosine(weight),
        "  spectrum (float64 Gram + eigh)": lambda: spectrum(weight),
        "  isotropy (Gram + eigh + V×d×d GEMM)": lambda: isotropy(weight),
        "  torch.linalg.svdvals (fp32, for scale)": lambda: torch.linalg.svdvals(weight.detach()),
        "probe: probe step + measurement": probe_step,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(args.reps + 1):
        for name, fn in cases.items():
            elapsed = _timed(fn)
            if round_ > 0:
                times[name].append(elapsed)
    for parts in probe_parts.values():
        del parts[0]  # the warm-up round
    times.update(probe_parts)

    base = min(times["head forward+backward (baseline)"])
    print(
        f"V={args.vocab} d={args.hidden} N={args.tokens} threads={args.threads} torch {torch.__version__}, "
        f"min of {args.reps} after 1 warm-up"
    )
    print(f"| {'case':<44} | {'seconds':>8} | {'/ baseline':>10} |")
    print(f"|{'-' * 46}|{'-' * 10}|{'-' * 12}|")
    for name, values in times.items():
        best = min(values)
        print(f"| {name:<44} | {best:8.3f} | {best / base:9.2f}x |")
    overhead = (min(times["probe: armed forward+backward"]) + min(times["probe: measurement"])) / base - 1
    print(f"probe overhead on the probed micro-batch (armed step + measurement) / baseline - 1: {100 * overhead:+.1f}%")


if __name__ == "__main__":
    main()
