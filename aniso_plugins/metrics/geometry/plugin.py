"""Embedding geometry of the LM head (and of the input embedding when it is untied), at every
train measurement: `aniso_plugins.metrics.geometry.stats` metrics from one Gram matrix per matrix.

Round 0 reduces Σ w_i w_iᵀ, Σ w_i, V and the raw unit-row sum; round 1, from the reduced Gram's
eigenvectors (raw and centered), reduces the log-partition functions of I(W) and the centered
unit-row sum: the rounds of `aniso_plugins.metrics.geometry.rounds.GeometryRounds`, the same
ones `aniso report` sums over row blocks. Logged as ``geometry/<matrix>/<metric>``, matrix ``head`` or ``embedding``:

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
from aniso_plugins.metrics.geometry.rounds import GeometryRounds
from aniso_plugins.metrics.geometry.stats import matrix_rows
from aniso_plugins.numerics.reduce import Stat


class GeometryPlugin(Plugin):
    """Geometry metrics of the head's weight and, when untied, of the input embedding's."""

    name = "geometry"
    summary = {"I(W)": "geometry/head/isotropy", "cos": "geometry/head/mean_cosine"}

    def __init__(self, config: AnisoConfig) -> None:
        super().__init__(config)
        self._rounds: dict[str, GeometryRounds] = {}
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
        """Round `round_index` of every matrix's `GeometryRounds` over this rank's rows (the core
        reduces them over the ranks with every other plugin's statistics)."""
        if round_index >= GeometryRounds.rounds:
            return None
        matrices = self.matrices()
        if round_index == 0:
            self._rounds = {name: GeometryRounds(f"geometry/{name}/") for name in matrices}
        stats: dict[str, Stat] = {}
        for name, weight in matrices.items():
            geometry = self._rounds[name]
            geometry.start(round_index, reduced)
            stats |= geometry.stats(matrix_rows(weight, f"{name} weight"))
        return stats or None

    def train_metrics(self, step: StepInfo, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
        """The finished metrics of every matrix, named ``geometry/<matrix>/<metric>``."""
        done = {name: g for name, g in self._rounds.items() if g.ready}
        self._rounds = {}
        if not done:
            return None
        out: dict[str, float] = {}
        for name, geometry in done.items():
            out |= self._matrix_metrics(name, geometry.finish(reduced), step)
        return out

    def _matrix_metrics(self, name: str, result: dict, step: StepInfo) -> dict[str, float]:
        """One matrix's logged metrics from `GeometryRounds.finish`; warns once per matrix about
        non-finite entries."""
        p = f"geometry/{name}/"
        nonfinite = result["nonfinite"]
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
        raw, centered = result["raw"], result["centered"]
        out = {
            p + "nonfinite": float(nonfinite),
            p + "mean_cosine": raw["mean_cosine"],
            p + "mean_cosine_centered": centered["mean_cosine"],
            p + "isotropy": raw["isotropy"],
            p + "isotropy_centered": centered["isotropy"],
        }
        for key in _CENTERED_KEYS:
            out[p + key] = centered[key]  # of W − 1μᵀ
        for key in _RAW_KEYS:
            out[p + key] = raw[key]  # of the raw W
        out[p + "isoscore"] = result["isoscore"]
        out[p + "mean_norm_ratio"] = result["mean_norm_ratio"]
        return out


_CENTERED_KEYS = ("effective_rank", "effective_rank_sigma2", "variance_share_top1", "variance_share_top3")
_RAW_KEYS = ("singular_entropy", "sigma_max", "sv_normalized_q25", "sv_normalized_q50", "sv_normalized_q75")


__all__ = ["GeometryPlugin"]
