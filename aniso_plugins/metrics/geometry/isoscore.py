"""IsoScore (Rudman, Gillman, Rayne & Eickhoff, Findings of ACL 2022), docs/methods.md §5.

Points are the rows of an (m, n) matrix: m points in n dimensions (the orientation of the
PyPI ``IsoScore`` 2.0.1 package; the GitHub numpy version takes the transpose). The score
depends only on the covariance spectrum, so it is computed from the reduced d×d Gram of the
rows, exact under DDP and FSDP2 like the other geometry metrics.
"""

from __future__ import annotations

import math

import torch

from aniso_plugins.metrics.geometry.stats import Spectrum, matrix_rows, moment_stats, moments
from aniso_plugins.numerics.reduce import reduce_stats


def isoscore_from_variances(variances: torch.Tensor) -> float:
    """`isoscore_value` as a float."""
    return float(isoscore_value(variances))


def isoscore_value(variances: torch.Tensor) -> torch.Tensor:
    """Steps 3–5 of IsoScore from Σ_D, the variances of the points along their n principal
    axes (any common scale: covariance eigenvalues, with or without the 1/(m − 1)):

        Σ̂_D = √n Σ_D / ‖Σ_D‖₂,   δ = ‖Σ̂_D − 1‖₂ / √(2(n − √n)),
        ι = ((n − δ²(n − √n))² − n) / (n(n − 1))  ∈ [0, 1]   (1 = isotropic).

    A 0-d tensor (nothing read back); NaN when all variances are 0; requires n ≥ 2."""
    var = variances.to(torch.float64)
    n = var.numel()
    if n < 2:
        raise ValueError(f"IsoScore needs points of dimension n >= 2, got n={n}")
    norm = var.norm()
    rn = math.sqrt(n)
    normalized = rn * var / torch.where(norm == 0, 1.0, norm)
    delta = (normalized - 1).norm() / math.sqrt(2 * (n - rn))
    score = ((n - delta.square() * (n - rn)) ** 2 - n) / (n * (n - 1))
    return torch.where(norm == 0, math.nan, score)


def isoscore(points: torch.Tensor) -> float:
    """IsoScore ι(X) of the rows of `points` (m points × n dimensions), Rudman et al. 2022:

    1. project the centered points onto all n principal components;
    2. Σ_D = the variances along them (= the eigenvalues of the sample covariance);
    3–5. `isoscore_from_variances`.

    ι = 1 when the variance is spread evenly over all n dimensions, 0 when it lies along one;
    invariant to rotation, scale and the mean. `points` may be a full tensor, a DDP replica
    or an FSDP2 DTensor shard (collective under torch.distributed, as `isotropy`). With fewer
    points than dimensions the missing directions count with variance 0 (the reference
    implementation, sklearn's PCA, refuses m < n)."""
    rows = matrix_rows(points, "points")
    spec = Spectrum.from_moments(moments(reduce_stats(moment_stats(rows))), center=True)
    return isoscore_from_variances(spec.eigenvalues)


__all__ = ["isoscore", "isoscore_from_variances", "isoscore_value"]
