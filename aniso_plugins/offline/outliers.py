"""An outlier-channel metric of embedding vectors: what a rotation does to them
(docs/methods.md §5.1; `aniso_plugins.offline.postprocess.Rotation`)."""

from __future__ import annotations

import math

import torch

from aniso_plugins.numerics.linalg import ROW_BLOCK
from aniso_plugins.offline.transform_base import Array, _as_tensor


def outlier_stats(x: Array) -> dict[str, float]:
    """Outlier-channel statistics of the vectors x_i (rows of an (n, d) array, or (..., d)),
    float64, to show what a rotation does (docs/methods.md §5.1):

    - ``max_over_rms_mean`` / ``max_over_rms_max``: r_i = max_j |x_ij| / RMS(x_i),
      RMS(x_i) = sqrt(mean_j x_ij²), averaged / maximised over the vectors of nonzero norm
      (1 for a flat vector, √d for a one-hot one);
    - ``max_over_rms_overall``: max_{i,j} |x_ij| / sqrt(mean_{i,j} x_ij²);
    - ``kurtosis_max`` / ``kurtosis_mean``: per-channel excess kurtosis over the n vectors,
      κ_j = m4_j / m2_j² − 3 with central moments m_p,j = mean_i (x_ij − x̄_j)^p (Fisher,
      biased: ``scipy.stats.kurtosis(x, axis=0)``; 0 for a Gaussian channel), over the channels
      whose standard deviation exceeds 1e-10·max_i |x_ij| (constant channels have none);
    - ``vectors``, ``channels``: how many vectors / channels entered.

    NaN where nothing entered. Two passes over blocks of `ROW_BLOCK` rows; local to this
    process (no reduction)."""
    t = _as_tensor(x, "outlier_stats input")
    if t.dim() == 0 or t.shape[-1] == 0:
        raise ValueError(f"outlier_stats needs vectors of shape (..., d) with d >= 1, got shape {tuple(t.shape)}")
    rows = t.detach().reshape(-1, t.shape[-1])
    n, d = rows.shape
    zeros = torch.zeros(d, dtype=torch.float64, device=rows.device)
    ratio_sum, ratio_max, vectors, peak, sq = 0.0, -math.inf, 0, 0.0, 0.0
    col_sum, col_max, m2, m4 = zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone()
    blocks = rows.split(ROW_BLOCK) if n else ()
    for b in blocks:
        b = b.to(torch.float64)
        a = b.abs()
        rms = b.pow(2).mean(1).sqrt()
        ratio = a.max(1).values[rms > 0] / rms[rms > 0]
        if len(ratio):
            ratio_sum, ratio_max = ratio_sum + float(ratio.sum()), max(ratio_max, float(ratio.max()))
            vectors += len(ratio)
        peak, sq = max(peak, float(a.max())), sq + float(b.pow(2).sum())
        col_sum += b.sum(0)
        col_max = torch.maximum(col_max, a.max(0).values)
    mean = col_sum / max(n, 1)
    for b in blocks:
        c = b.to(torch.float64) - mean
        m2 += c.pow(2).sum(0)
        m4 += c.pow(4).sum(0)
    m2, m4 = m2 / max(n, 1), m4 / max(n, 1)
    ok = m2.sqrt() > 1e-10 * col_max
    kurt = m4[ok] / m2[ok].pow(2) - 3
    nan = math.nan
    return {
        "max_over_rms_mean": ratio_sum / vectors if vectors else nan,
        "max_over_rms_max": ratio_max if vectors else nan,
        "max_over_rms_overall": peak / math.sqrt(sq / (n * d)) if sq > 0 else nan,
        "kurtosis_max": float(kurt.max()) if len(kurt) else nan,
        "kurtosis_mean": float(kurt.mean()) if len(kurt) else nan,
        "vectors": float(vectors),
        "channels": float(len(kurt)),
    }


__all__ = ["outlier_stats"]
