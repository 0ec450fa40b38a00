"""Cost of `aniso report` on a Llama-3-sized embedding: a V = 128256, d = 4096 bf16 matrix in a
safetensors file, reported by the real CLI in a subprocess (target: ≤ 4 minutes, ≤ 6 GiB peak
RSS on a 2-core machine). Prints a markdown table:

- the report's wall time and peak RSS (``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``);
- the baseline, measured in this process: one float32 Gram XᵀX of a (16384, d) block (the
  default row sample), and the ratio of the report to it; the exact float32 Gram of all V rows,
  extrapolated from it (why the Gram-based metrics sample rows at this size);
- precision: float32 Gram blocks accumulated in float64 against the float64 Gram, and the
  sampled Gram against the exact one, on a smaller matrix (differences of the metrics).

Run: ``python benchmarks/report.py [--vocab 128256] [--hidden 4096] [--skip-precision]``
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from aniso_plugins.metrics.geometry.stats import Spectrum, moment_stats, moments
from aniso_plugins.offline.analysis import _gram_f32, matrix_geometry
from aniso_plugins.offline.sources import MatrixSource


def synthetic(v: int, d: int, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    """Rows with a decaying spectrum (column scales ∝ (i+1)^-0.5) plus a common offset: an
    anisotropic embedding, written in blocks to bound this process's memory."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(v, d, dtype=dtype)
    scale = (torch.arange(d, dtype=torch.float32) + 1).pow(-0.5) * 0.05
    offset = torch.randn(d, generator=g) * 0.01
    for a in range(0, v, 8192):
        b = min(v, a + 8192)
        out[a:b] = (torch.randn(b - a, d, generator=g) * scale + offset).to(dtype)
    return out


def precision(v: int = 32768, d: int = 1024) -> list[tuple[str, float, float, float]]:
    """(metric, float64 exact, float32-block Gram, sampled 4d rows) on a (v, d) bf16 matrix."""
    w = synthetic(v, d, seed=1)
    m64 = moments({k: s.value for k, s in moment_stats(w).items()})
    f32 = sum(_gram_f32(b) for b in w.split(8192))
    m32 = m64._replace(gram=f32)
    exact = matrix_geometry(MatrixSource.of_tensor("w", w), keep_rows=False)
    sampled = matrix_geometry(MatrixSource.of_tensor("w", w), gram_rows=4 * d, keep_rows=False)
    rows = []
    for center in (False, True):
        s64, s32 = Spectrum.from_moments(m64, center), Spectrum.from_moments(m32, center)
        key = "centered" if center else "raw"
        rows.append((f"effective rank ({key})", s64.effective_rank(), s32.effective_rank(),
                     sampled[key]["effective_rank"]))
        rows.append((f"σ_max ({key})", float(s64.singular_values[0]), float(s32.singular_values[0]),
                     sampled[key]["sigma_max"]))
    rows.append(("I(W) (raw)", exact["raw"]["isotropy"], math.nan, sampled["raw"]["isotropy"]))
    rows.append(("IsoScore", exact["isoscore"], math.nan, sampled["isoscore"]))
    rows.append(("mean cosine (raw)", exact["raw"]["mean_cosine"], math.nan, sampled["raw"]["mean_cosine"]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--skip-precision", action="store_true")
    a = p.parse_args()
    v, d = a.vocab, a.hidden
    with tempfile.TemporaryDirectory(prefix="aniso_bench_report_") as tmp:
        path = Path(tmp) / "embedding.safetensors"
        t0 = time.perf_counter()
        w = synthetic(v, d)
        save_file({"model.embed_tokens.weight": w}, str(path))
        del w
        made = time.perf_counter() - t0
        cmd = [sys.executable, "-m", "aniso_plugins.offline.cli", "report", str(path), "--out", str(Path(tmp) / "out"),
               "--quiet", "--json"]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
        if r.returncode:
            sys.exit(f"report failed ({r.returncode}): {r.stderr}")
        geo = json.loads(r.stdout)["models"][0]["matrices"]["model.embed_tokens.weight"]
    block = torch.randn(min(v, 16384), d)
    t0 = time.perf_counter()
    block.T @ block
    gemm = time.perf_counter() - t0
    full = gemm * v / block.shape[0]
    print(f"\n## aniso report: V = {v}, d = {d}, bf16 safetensors ({v * d * 2 / 2**30:.2f} GiB; written in {made:.0f} s), "
          f"{torch.get_num_threads()} threads\n")
    print("| measurement | value |\n|---|---:|")
    print(f"| report wall time (subprocess, incl. start-up and plots) | {wall:.1f} s |")
    print(f"| report peak RSS | {rss:.2f} GiB |")
    print(f"| Gram mode | {geo['gram']} |")
    print(f"| baseline: one float32 XᵀX of ({block.shape[0]}, {d}) | {gemm:.1f} s ({2 * block.shape[0] * d * d / gemm / 1e9:.1f} GFLOP/s) |")
    print(f"| report / baseline | {wall / gemm:.2f} |")
    print(f"| exact float32 Gram of all {v} rows (extrapolated) | {full:.0f} s |")
    print(f"| mean cosine raw / centred (exact, all rows) | {geo['raw']['mean_cosine']:.4f} / {geo['centered']['mean_cosine']:.4f} |")
    print(f"| effective rank centred / I(W) raw (sampled Gram) | {geo['centered']['effective_rank']:.1f} / {geo['raw']['isotropy']:.3g} |")
    if not a.skip_precision:
        print("\n### Precision on a (32768, 1024) bf16 matrix\n")
        print("| metric | float64 exact | float32 Gram blocks → float64 | sampled Gram (4096 rows) |\n|---|---:|---:|---:|")
        for name, x64, x32, xs in precision():
            f32 = "–" if math.isnan(x32) else f"{x32:.10g} (rel {abs(x32 - x64) / abs(x64):.1e})"
            print(f"| {name} | {x64:.10g} | {f32} | {xs:.6g} (rel {abs(xs - x64) / abs(x64):.1e}) |")


if __name__ == "__main__":
    main()
