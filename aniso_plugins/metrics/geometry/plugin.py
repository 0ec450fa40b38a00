"""Embedding geometry of the LM head (and of the input embedding when it is untied), at every
train measurement: `aniso_plugins.metrics.geometry.stats` metrics from one Gram matrix per matrix.

Round 0 reduces Σ w_i w_iᵀ, Σ w_i, V and the raw unit-row sum; round 1, from the reduced Gram's
eigenvectors (raw and centered), reduces the log-partition functions of I(W) and the centered
unit-row sum. Logged as ``geometry/<matrix>/<metric>``, matrix ``head`` or ``embedding``:

- ``mean_cosine`` / ``mean_cosine_centered``: mean pairwise cosine of w_i / of w_i − μ;
- ``isotropy`` / ``isotropy_centered``: I(W) raw (paper-comparable) / centered;
- ``effective_rank`` / ``effective_rank_sigma2``: erank of W − 1μᵀ with p ∝ σ / p ∝ σ²;
- ``singular_entropy``: spectral saturation KL(p ‖ U), p ∝ σ of the raw W (Godey et al. 2024);
- ``sigma_max`` and ``sv_normalized_q25|q50|q75``: σ_max of the raw W, and σ_i/σ_max at a
  quarter, half and three quarters of the way down the k = min(V, d) raw singular values;
- ``variance_share_top1`` / ``variance_share_top3``: share of the variance on the top 1 / 3
  principal components (centered);
- ``isoscore``: IsoScore of the rows (Rudman et al. 2022);
- ``nonfinite``: how many entries of the matrix are NaN or ±inf. When it is not 0 every other
  metric of that matrix is NaN (nothing raises, training goes on) and one warning names the
  matrix and the count.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.plugins import logger
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.metrics.geometry.isoscore import isoscore_from_variances
from aniso_plugins.metrics.geometry.stats import (
    Spectrum,
    isotropy_finish,
    isotropy_stats,
    matrix_rows,
    mean_cosine_finish,
    mean_cosine_stats,
    mean_row,
    moment_stats,
    moments,
    nonfinite_count,
)
from aniso_plugins.numerics.reduce import Stat


class GeometryPlugin(Plugin):
    """Geometry metrics of the head's weight and, when untied, of the input embedding's."""

    name = "geometry"

    def __init__(self, config: AnisoConfig) -> None:
        super().__init__(config)
        self._spectra: dict[str, tuple[Spectrum, Spectrum]] = {}
        self._warned: set[str] = set()

    def matrices(self) -> dict[str, torch.Tensor]:
        """The matrices measured: ``head`` always, ``embedding`` when the model has an input
        embedding that is not tied to the head."""
        out = {"head": self.model.head_weight()}
        embedding = self.model.input_embedding()
        if embedding is not None and not self.model.tied():
            out["embedding"] = getattr(embedding, "weight", None)
        return out

    def train_stats(self, step: StepInfo, round_index: int, reduced: Mapping[str, torch.Tensor]) -> dict[str, Stat] | None:
        if round_index > 1:
            return None
        stats: dict[str, Stat] = {}
        for name, weight in self.matrices().items():
            prefix = f"geometry/{name}/"
            rows = matrix_rows(weight, f"{name} weight")
            if round_index == 0:  # Gram, row sum, count; raw unit-row sum; non-finite entries
                stats |= moment_stats(rows, prefix) | mean_cosine_stats(rows, prefix + "raw/")
                stats[prefix + "nonfinite"] = Stat(nonfinite_count(rows))
                continue
            # round 1: from the reduced Gram's eigenvectors, the partition functions of I(W)
            m = moments(reduced, prefix)
            raw, centered = Spectrum.from_moments(m, center=False), Spectrum.from_moments(m, center=True)
            self._spectra[name] = (raw, centered)
            mu = mean_row(reduced, prefix)
            stats |= isotropy_stats(rows, raw.eigenvectors, prefix + "raw/")
            stats |= isotropy_stats(rows, centered.eigenvectors, prefix + "centered/", mean=mu)
            stats |= mean_cosine_stats(rows, prefix + "centered/", mean=mu)
        return stats or None

    def train_metrics(self, step: StepInfo, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        if not self._spectra:
            return None
        out: dict[str, float] = {}
        for name, (raw, centered) in self._spectra.items():
            p = f"geometry/{name}/"
            nonfinite = int(reduced[p + "nonfinite"])
            out[p + "nonfinite"] = float(nonfinite)
            if nonfinite and name not in self._warned:
                self._warned.add(name)
                logger.warning(
                    "aniso_plugins geometry: the %s weight has %d non-finite entries (NaN or inf) at step %d; its "
                    "geometry metrics are NaN while they remain (aniso/geometry/%s/nonfinite counts them). "
                    "Training goes on.",
                    name,
                    nonfinite,
                    step.step,
                    name,
                )
            out[p + "mean_cosine"] = mean_cosine_finish(reduced, p + "raw/")
            out[p + "mean_cosine_centered"] = mean_cosine_finish(reduced, p + "centered/")
            out[p + "isotropy"] = isotropy_finish(reduced, p + "raw/")
            out[p + "isotropy_centered"] = isotropy_finish(reduced, p + "centered/")
            r, c = raw.summary(), centered.summary()
            for key in ("effective_rank", "effective_rank_sigma2", "variance_share_top1", "variance_share_top3"):
                out[p + key] = c[key]  # of W − 1μᵀ
            for key in ("singular_entropy", "sigma_max", "sv_normalized_q25", "sv_normalized_q50", "sv_normalized_q75"):
                out[p + key] = r[key]  # of the raw W
            out[p + "isoscore"] = isoscore_from_variances(centered.eigenvalues)
        self._spectra.clear()
        return out


__all__ = ["GeometryPlugin"]
