"""Cost of each regularizer (value + gradient) relative to a plain LM-head step and to CosReg,
and spectrum control's peak memory before and after 0.2.0.

``--section time`` (default). Baseline: F.linear(h, W) + F.cross_entropy over N tokens, forward
and backward (gradients of h and W), measured in the same process. Each regularizer R(W) is timed
as ``R(W).backward()``. Minimum over interleaved rounds after one warm-up (docs/performance.md
§6.2). Both wall time and the process's CPU time are reported: on a shared machine the CPU-time
ratio is the steadier one. The exact hinge costs 4V²d flops (about a minute at V = 50304 on two
threads): it is timed once at a smaller vocabulary (--hinge-vocab) and extrapolated by
(V / V_small)², which the table says. "spectrum, ... float64 copy" is the route before 0.2.0
(W copied to float64, WᵀW in float64), kept here as the reference for the new one (float32 row
blocks summed into a float64 Gram, `aniso_plugins.numerics.linalg.block_gram`).

``--section memory``: the peak memory of one spectrum step (value + gradient) above the weight,
each route in a fresh process (`measure.PeakMemory`: CUDA's allocator peak, or the CPU's peak RSS).

The host reads each method adds to a training step: ``benchmarks/host_syncs.py``.

    python benchmarks/regularizers.py                        # V=50304, d=768, N=4096, 2 threads
    python benchmarks/regularizers.py --section memory
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from measure import PeakMemory, add_device_args, device_of, precision
from timing import timed

from aniso_plugins.methods.regularizers.penalties import cosine_hinge, cosreg, spectrum_penalty

SPECTRUM_ROUTES = ("float32 blocks", "float64 copy")


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


def spectrum_float64_copy(w: torch.Tensor, prior: str, c1: float = 1.0, gamma: float = 0.75) -> torch.Tensor:
    """Spectrum control as it was before 0.2.0: W copied to float64 (V×d), WᵀW and eigvalsh in float64."""
    x = w.to(torch.float64)
    sigma = torch.linalg.eigvalsh(x.T @ x).clamp_min(0.0).sqrt().flip(0)
    if prior == "ratio":
        return sigma[0] / sigma[-1]
    k = torch.arange(1, sigma.numel() + 1, dtype=torch.float64, device=sigma.device)
    return (sigma - c1 * k.pow(-gamma)).square().sum()


def _spectrum(route: str, prior: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if route == "float64 copy":
        return lambda x: spectrum_float64_copy(x, prior)
    return lambda x: spectrum_penalty(x, prior, c1=1.0) if prior != "ratio" else spectrum_penalty(x, "ratio")


def _inputs(args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    v, d, n = args.vocab, args.hidden, args.tokens
    w = (torch.randn(v, d, generator=g) * 0.02 + 0.01).to(device).requires_grad_(True)  # a mildly anisotropic head
    h = torch.randn(n, d, generator=g).to(device).requires_grad_(True)
    y = torch.randint(0, v, (n,), generator=g).to(device)
    return w, h, y


def time_section(args, device: torch.device) -> None:
    w, h, y = _inputs(args, device)
    gen = torch.Generator(device).manual_seed(1)
    cases: dict[str, tuple[str, Callable[[], None]]] = {
        "head step (baseline)": (f"N={args.tokens}", _head_step(h, w, y, args)),
        "cosreg": ("exact", _reg_step(w, cosreg, args)),
        "hinge, sampled": (
            f"{args.sample} rows, block {args.block}",
            _reg_step(w, lambda x: cosine_hinge(x, 0.5, block=args.block, sample=args.sample, generator=gen), args),
        ),
    }
    for prior in ("poly", "ratio"):
        for route in SPECTRUM_ROUTES:
            cases[f"spectrum, {prior}, {route}"] = ("Gram + eigvalsh", _reg_step(w, _spectrum(route, prior), args))
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
    grow = (args.vocab / args.hinge_vocab) ** 2
    hinge_full = (hinge_small[0] * grow, hinge_small[1] * grow)
    baseline = cases["head step (baseline)"][1]
    best["head step (baseline)"] = _min(best["head step (baseline)"], timed(baseline, device))  # adjacent to the hinge
    _print_times(args, cases, best, hinge_small, hinge_full)


def _print_times(args, cases, best, hinge_small, hinge_full) -> None:
    base, ref = best["head step (baseline)"], best["cosreg"]
    print(
        f"V={args.vocab}, d={args.hidden}, N={args.tokens} tokens, {args.dtype} {args.device}, "
        f"torch.set_num_threads({args.threads}), min of {args.rounds} rounds"
    )
    print()
    print("| regularizer (value + gradient) | setting | wall (s) | / head step | / cosreg | CPU (s) | / head step | / cosreg |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (setting, _) in cases.items():
        wall, cpu = best[name]
        print(
            f"| {name} | {setting} | {wall:.3f} | {wall / base[0]:.3f} | {wall / ref[0]:.2f} | "
            f"{cpu:.3f} | {cpu / base[1]:.3f} | {cpu / ref[1]:.2f} |"
        )
    print(
        f"| hinge, exact | block {args.block}; timed once at V={args.hinge_vocab} "
        f"({hinge_small[0]:.1f} s wall), × (V/{args.hinge_vocab})² | {hinge_full[0]:.0f} (extrapolated) | "
        f"{hinge_full[0] / base[0]:.1f} | {hinge_full[0] / ref[0]:.0f} | {hinge_full[1]:.0f} (extrapolated) | "
        f"{hinge_full[1] / base[1]:.1f} | {hinge_full[1] / ref[1]:.0f} |"
    )


def memory_worker(args, device: torch.device) -> None:
    """One spectrum step of `args.worker` (a route) in this fresh process: prints its peak as JSON."""
    w, _, _ = _inputs(args, device)
    del _
    reg = _spectrum(args.worker, "poly")
    _reg_step(w, reg, args)()  # warm-up: the allocator's and the solver's first-call costs
    with PeakMemory(device) as peak:
        _reg_step(w, reg, args)()
    print(json.dumps({"route": args.worker, "peak": peak.bytes}))


def memory_section(args) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    peaks = {}
    for route in SPECTRUM_ROUTES:
        cmd = [sys.executable, os.path.join(here, "regularizers.py"), "--worker", route, "--device", args.device,
               "--dtype", args.dtype, "--vocab", str(args.vocab), "--hidden", str(args.hidden),
               "--threads", str(args.threads)]  # fmt: skip
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        peaks[route] = json.loads(done.stdout.splitlines()[-1])["peak"]
    w_bytes = args.vocab * args.hidden * 4
    print(f"V={args.vocab}, d={args.hidden}, {args.dtype} {args.device}: peak memory of one spectrum step (poly) above W")
    print(f"(W: {w_bytes / 2**20:.0f} MiB float32; the V×d float64 copy alone is {2 * w_bytes / 2**20:.0f} MiB)")
    print()
    print("| route | peak (MiB) | / W | / float64 copy route |")
    print("|---|---|---|---|")
    for route, peak in peaks.items():
        ratio = peak / max(peaks["float64 copy"], 1)
        print(f"| {route} | {peak / 2**20:.0f} | {peak / w_bytes:.2f} | {ratio:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(parser)
    parser.add_argument("--section", choices=("time", "memory"), default="time")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sample", type=int, default=512, help="rows of the sampled hinge")
    parser.add_argument("--hinge-vocab", type=int, default=16384, help="vocabulary of the timed exact hinge")
    parser.add_argument("--block", type=int, default=1024, help="rows per block of the hinge")
    parser.add_argument("--worker", choices=SPECTRUM_ROUTES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        memory_worker(args, device_of(args))
    elif args.section == "memory":
        memory_section(args)
    else:
        time_section(args, device_of(args))


if __name__ == "__main__":
    main()
