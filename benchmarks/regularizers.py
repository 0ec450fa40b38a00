"""Time of each regularizer (value + gradient) relative to a plain LM-head step.

Baseline: F.linear(h, W) + F.cross_entropy over N tokens, forward and backward (gradients of
h and W), fp32 on CPU, measured in the same process. Each regularizer R(W) is timed as
``R(W).backward()``. Minimum over interleaved rounds after one warm-up (docs/performance.md §6.2).
Both wall time and the process's CPU time are reported: on a shared machine the CPU-time
ratio is the steadier one. The exact hinge costs 4V²d flops (about a minute at V = 50304 on two threads): it is timed once
at a smaller vocabulary (--hinge-vocab) and extrapolated by (V / V_small)², which the table says.

    python benchmarks/regularizers.py            # V=50304, d=768, N=4096, 2 threads
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from measure import add_device_args, device_of, precision
from timing import timed

from aniso_plugins.methods.regularizers.penalties import cosine_hinge, cosreg, spectrum_penalty


def _min(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return min(a[0], b[0]), min(a[1], b[1])


def _head_step(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, args) -> Callable[[], None]:
    def run() -> None:
        with precision(h.device, args.dtype):
            loss = F.cross_entropy(F.linear(h, w).float(), y)
        loss.backward()
        h.grad = w.grad = None

    return run


def _reg_step(w: torch.Tensor, reg: Callable[[torch.Tensor], torch.Tensor], args) -> Callable[[], None]:
    def run() -> None:
        with precision(w.device, args.dtype):
            value = reg(w)
        value.backward()
        w.grad = None

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(parser)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sample", type=int, default=512, help="rows of the sampled hinge")
    parser.add_argument("--hinge-vocab", type=int, default=16384, help="vocabulary of the timed exact hinge")
    parser.add_argument("--block", type=int, default=1024, help="rows per block of the hinge")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = device_of(args)
    g = torch.Generator().manual_seed(0)
    v, d, n = args.vocab, args.hidden, args.tokens
    w = (torch.randn(v, d, generator=g) * 0.02 + 0.01).to(device).requires_grad_(True)  # a mildly anisotropic head
    h = torch.randn(n, d, generator=g).to(device).requires_grad_(True)
    y = torch.randint(0, v, (n,), generator=g).to(device)
    gen = torch.Generator(device).manual_seed(1)
    cases: dict[str, tuple[str, Callable[[], None]]] = {
        "head step (baseline)": (f"N={n}", _head_step(h, w, y, args)),
        "cosreg": ("exact", _reg_step(w, cosreg, args)),
        "hinge, sampled": (
            f"{args.sample} rows, block {args.block}",
            _reg_step(w, lambda x: cosine_hinge(x, 0.5, block=args.block, sample=args.sample, generator=gen), args),
        ),
        "spectrum, poly": ("Gram + eigvalsh", _reg_step(w, lambda x: spectrum_penalty(x, "poly", c1=1.0), args)),
        "spectrum, ratio": ("Gram + eigvalsh", _reg_step(w, lambda x: spectrum_penalty(x, "ratio"), args)),
    }
    best = {name: (float("inf"), float("inf")) for name in cases}
    for name, (_, run) in cases.items():  # warm-up
        run()
    for _ in range(args.rounds):
        for name, (_, run) in cases.items():
            best[name] = _min(best[name], timed(run, device))

    small = w.detach()[: args.hinge_vocab].clone().requires_grad_(True)
    exact = _reg_step(small, lambda x: cosine_hinge(x, 0.5, block=args.block), args)
    _reg_step(small[:2048].detach().clone().requires_grad_(True), lambda x: cosine_hinge(x, 0.5), args)()  # warm-up
    hinge_small = timed(exact, device)
    grow = (v / args.hinge_vocab) ** 2
    hinge_full = (hinge_small[0] * grow, hinge_small[1] * grow)
    baseline = cases["head step (baseline)"][1]
    best["head step (baseline)"] = _min(best["head step (baseline)"], timed(baseline, device))  # adjacent to the hinge

    base = best["head step (baseline)"]
    print(f"V={v}, d={d}, N={n} tokens, {args.dtype} {args.device}, torch.set_num_threads({args.threads}), min of {args.rounds} rounds")
    print()
    print("| regularizer (value + gradient) | setting | wall (s) | / head step | CPU (s) | / head step |")
    print("|---|---|---|---|---|---|")
    for name, (setting, _) in cases.items():
        wall, cpu = best[name]
        print(f"| {name} | {setting} | {wall:.3f} | {wall / base[0]:.3f} | {cpu:.3f} | {cpu / base[1]:.3f} |")
    print(
        f"| hinge, exact | block {args.block}; timed once at V={args.hinge_vocab} "
        f"({hinge_small[0]:.1f} s wall), × (V/{args.hinge_vocab})² | {hinge_full[0]:.0f} (extrapolated) | "
        f"{hinge_full[0] / base[0]:.1f} | {hinge_full[1]:.0f} (extrapolated) | {hinge_full[1] / base[1]:.1f} |"
    )


if __name__ == "__main__":
    main()
