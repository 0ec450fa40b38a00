"""Cost of the metrics on CPU, as ratios to a plain LM-head forward+backward measured in the
same process (docs/performance.md §6.2: min over --reps timed rounds after one warm-up round,
cases interleaved within each round). Wall time and CPU time (all threads of this process) are
both reported: on a shared machine the CPU-time ratios are the steadier.

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
from collections.abc import Callable

import torch
import torch.nn.functional as F
from measure import add_device_args, device_of, precision
from timing import timed
from torch import nn

from aniso_plugins import (
    AnisoConfig,
    AnisoPlugins,
    ModelHandle,
    StepInfo,
    isotropy,
    mean_cosine,
    spectrum,
)


class Head(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():  # a GPT-2-like init plus a shared offset (a mildly anisotropic head)
            self.lm_head.weight.normal_(0.0, 0.02).add_(0.01)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_args(parser)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = device_of(args)

    model = Head(args.vocab, args.hidden).to(device)
    weight = model.lm_head.weight
    h = torch.randn(args.tokens, args.hidden, device=device)
    y = torch.randint(0, args.vocab, (args.tokens,), device=device)

    def head_step(head: nn.Module) -> None:
        x = h.clone().requires_grad_(True)
        with precision(device, args.dtype):
            loss = F.cross_entropy(head(x).float(), y)
        loss.backward()
        head.weight.grad = None

    geometry = AnisoPlugins(AnisoConfig(metrics=("geometry",), load_entry_points=False))
    geometry.setup(ModelHandle(model, head="lm_head"))
    probed = Head(args.vocab, args.hidden).to(device)  # the same weight, with the probe's hooks
    probed.lm_head.weight = model.lm_head.weight
    probe = AnisoPlugins(AnisoConfig(metrics=("bottleneck",), load_entry_points=False))
    probe.setup(ModelHandle(probed, head="lm_head"))
    probe_parts: dict[str, list[tuple[float, float]]] = {"probe: armed forward+backward": [], "probe: measurement": []}

    def probe_step() -> None:
        probe.targets(y, StepInfo(step=1, measure=True))
        probe_parts["probe: armed forward+backward"].append(timed(lambda: head_step(probed.lm_head), device))
        probe_parts["probe: measurement"].append(timed(lambda: probe.measure(StepInfo(step=1, measure=True)), device))

    cases: dict[str, Callable[[], None]] = {
        "head forward+backward (baseline)": lambda: head_step(model.lm_head),
        "geometry measurement (all metrics, head)": lambda: geometry.measure(StepInfo(step=1, measure=True)),
        "  mean_cosine": lambda: mean_cosine(weight),
        "  spectrum (float64 Gram + eigh)": lambda: spectrum(weight),
        "  isotropy (Gram + eigh + V×d×d GEMM)": lambda: isotropy(weight),
        "  torch.linalg.svdvals (fp32, for scale)": lambda: torch.linalg.svdvals(weight.detach()),
        "probe: armed step + measurement (total)": probe_step,
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for round_ in range(args.reps + 1):
        for name, fn in cases.items():
            elapsed = timed(fn, device)
            if round_ > 0:
                times[name].append(elapsed)
    for parts in probe_parts.values():
        del parts[0]  # the warm-up round
    times.update(probe_parts)

    best = {name: (min(t[0] for t in v), min(t[1] for t in v)) for name, v in times.items()}
    base = best["head forward+backward (baseline)"]
    print(
        f"V={args.vocab} d={args.hidden} N={args.tokens} {args.dtype} {args.device} threads={args.threads} torch {torch.__version__}, "
        f"min of {args.reps} after 1 warm-up"
    )
    print(f"| {'case':<44} | wall s | wall / baseline |  CPU s | CPU / baseline |")
    print(f"|{'-' * 46}|--------|-----------------|--------|----------------|")
    for name, (wall, cpu) in best.items():
        print(f"| {name:<44} | {wall:6.2f} | {wall / base[0]:14.2f}x | {cpu:6.2f} | {cpu / base[1]:13.2f}x |")
    for i, kind in enumerate(("wall", "CPU")):
        armed, measured = best["probe: armed forward+backward"][i], best["probe: measurement"][i]
        print(f"probe overhead on the probed micro-batch, {kind}: {100 * ((armed + measured) / base[i] - 1):+.1f}%")


if __name__ == "__main__":
    main()
