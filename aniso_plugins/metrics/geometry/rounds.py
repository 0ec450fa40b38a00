"""The geometry of one (V, d) matrix as two measurement rounds: the one pipeline that the
training plugin (`aniso_plugins.metrics.geometry.plugin`), the one-call `isotropy` and
the offline report (`aniso_plugins.offline.analysis`) drive.

Round 0 sums Σ w_i w_iᵀ, Σ w_i, V (`moment_stats`) and, for the full set of metrics, the raw
unit-row sum and the non-finite entries; round 1, from the reduced Gram's eigenvectors (raw and
centred), takes the log-partition functions of I(W) and, for the full set, the centred unit-row
sum. A `GeometryRounds` says what each round needs (`start`, `stats`) and finishes the metrics
(`finish`); who produces the rows and who combines the statistics differs by caller:

- training: the core's measurement loop (`AnisoPlugins.measure`) with this rank's rows and
  `reduce_stats` over the ranks, batched with every other plugin's statistics;
- `isotropy`: `measure_geometry` with this rank's rows and `reduce_stats`;
- the report: `measure_geometry` with one streamed pass over row blocks per round, the blocks'
  statistics summed by `aniso_plugins.numerics.reduce.sum_over_blocks` exactly as `reduce_stats` sums ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from aniso_plugins.metrics.geometry.isoscore import isoscore_value
from aniso_plugins.metrics.geometry.stats import (
    Spectrum,
    isotropy_directions,
    isotropy_stats,
    isotropy_value,
    matrix_rows,
    mean_cosine_stats,
    mean_cosine_value,
    mean_norm_ratio_value,
    mean_row,
    mean_stats,
    moment_stats,
    moments,
    nonfinite_count,
)
from aniso_plugins.numerics.host_copy import read_values
from aniso_plugins.numerics.reduce import Stat, reduce_stats

FORMS = ("raw", "centered")
"""The two forms of the matrix: W, and W − 1μᵀ (μ the mean row)."""

Reduced = Mapping[str, torch.Tensor]


# --- the two rounds ----------------------------------------------------------------------------
class GeometryRounds:
    """The two rounds of one matrix's geometry, keys under `prefix`.

    ``full=True`` (default): every metric of both forms (mean cosine, I(W), the spectrum's
    summaries, IsoScore, non-finite entries). ``full=False``: only I(W) of the forms in `forms`
    (`isotropy`); ``both_signs`` takes I(W) over ±u_k (`isotropy_directions`).

    Use: for round r = 0, 1, … while ``start(r, reduced)`` is True, sum ``stats(rows)`` over all
    rows (ranks, blocks), reduce, add to `reduced`; then ``finish(reduced)``."""

    rounds = 2

    def __init__(self, prefix: str = "", *, forms: tuple[str, ...] = FORMS, full: bool = True,
                 both_signs: bool = False) -> None:
        if not forms or any(f not in FORMS for f in forms) or (full and tuple(forms) != FORMS):
            raise ValueError(f"forms={forms!r}: expected some of {FORMS} (all of them with full=True)")
        self.prefix, self.forms, self.full, self.both_signs = prefix, tuple(forms), full, both_signs
        self.round = -1
        self.spectra: dict[str, Spectrum] = {}
        self.mean: torch.Tensor | None = None

    def start(self, round_index: int, reduced: Reduced) -> bool:
        """Begin round `round_index` from the reduced statistics of the earlier ones (round 1:
        the spectra of the reduced Gram, raw and centred, and the mean row μ). False when the
        measurement has no such round."""
        if round_index >= self.rounds:
            return False
        self.round = round_index
        if round_index == 0:
            self.spectra, self.mean = {}, None
            return True
        m = moments(reduced, self.prefix)
        rows = int(m.count.item())  # V: the one read of this round (the spectra's k = min(V, d))
        self.spectra = {form: Spectrum.from_moments(m, form == "centered", rows) for form in self.forms}
        self.mean = mean_row(reduced, self.prefix) if "centered" in self.forms else None
        return True

    @property
    def ready(self) -> bool:
        """Whether round 1 has started (the spectra exist), so `finish` can run."""
        return bool(self.spectra)

    def directions(self) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """Round 1's I(W) measurements: (key prefix, directions (d, k), mean subtracted or None)
        for each form."""
        return [
            (f"{self.prefix}{form}/", isotropy_directions(self.spectra[form], self.both_signs),
             self.mean if form == "centered" else None)
            for form in self.forms
        ]

    def stats(self, rows: torch.Tensor, *, gram: bool = True) -> dict[str, Stat]:
        """This round's statistics of `rows` (a rank's rows, or one block of them).
        ``gram=False`` leaves out the ones of the d×d Gram's cost (round 0: Σ w_i w_iᵀ, round 1:
        log Z), for a caller that estimates those from a row sample."""
        p = self.prefix
        out: dict[str, Stat] = {}
        if self.round == 0:
            out |= moment_stats(rows, p) if gram else mean_stats(rows, p)
            if self.full:  # raw unit-row sum; non-finite entries
                out |= mean_cosine_stats(rows, p + "raw/")
                out[p + "nonfinite"] = Stat(nonfinite_count(rows))
            return out
        if gram:  # the partition functions of I(W) along the eigenvectors
            for key, directions, mean in self.directions():
                out |= isotropy_stats(rows, directions, key, mean=mean)
        if self.full:
            out |= mean_cosine_stats(rows, p + "centered/", mean=self.mean)
        return out

    def finish(self, reduced: Reduced) -> dict[str, Any]:
        """The metrics from all rounds' reduced statistics: ``{form: {"isotropy": I(W)}}``, and
        with ``full``: ``nonfinite``, ``isoscore`` (of the centred spectrum) and per form
        ``mean_cosine``, ``isotropy``, `Spectrum.summary` and ``w_error_half_rank``. Every value
        is computed on the statistics' device and read back at once (`read_values`)."""
        p = self.prefix
        if not self.full:
            return read_values({form: {"isotropy": isotropy_value(reduced, f"{p}{form}/")} for form in self.forms})
        out: dict[str, Any] = {
            "nonfinite": reduced[p + "nonfinite"],
            "isoscore": isoscore_value(self.spectra["centered"].eigenvalues),
            "mean_norm_ratio": mean_norm_ratio_value(reduced, p),
        }
        for form in FORMS:
            spec = self.spectra[form]
            out[form] = {
                "mean_cosine": mean_cosine_value(reduced, f"{p}{form}/"),
                "isotropy": isotropy_value(reduced, f"{p}{form}/"),
                **spec.summary_values(),
                "w_error_half_rank": spec.w_error_value(spec.size // 2),
            }
        out = read_values(out)
        out["nonfinite"] = int(out["nonfinite"])
        return out


RoundStats = Callable[[GeometryRounds], Mapping[str, Stat]]


def measure_geometry(
    geometry: GeometryRounds,
    round_stats: RoundStats,
    reduce: Callable[[Mapping[str, Stat]], Reduced] = reduce_stats,
) -> dict[str, Any]:
    """Drive `geometry` through its rounds and finish it: in each round, `round_stats(geometry)`
    gives the round's statistics of the rows this process holds, summed over them, and
    `reduce` combines those over the processes (`reduce_stats`, collective under
    torch.distributed; `stat_values` where one process holds all rows)."""
    reduced: dict[str, torch.Tensor] = {}
    round_index = 0
    while geometry.start(round_index, reduced):
        reduced.update(reduce(round_stats(geometry)))
        round_index += 1
    return geometry.finish(reduced)


def isotropy(weight: torch.Tensor, center: bool = False, both_signs: bool = False) -> float:
    """Partition-function isotropy (Arora et al. 2016; Mu & Viswanath 2018; Wang et al. 2020
    §5.1; the I(W) of the AGG paper, Yu et al. 2022):

        Z(a) = Σ_i exp(⟨w_i, a⟩),   I(W) = min_{a∈E} Z(a) / max_{a∈E} Z(a) ∈ [0, 1],

    E the unit eigenvectors of WᵀW. Computed in log space, float64: log Z(a) is a distributed
    log-sum-exp, I(W) = exp(min log Z − max log Z). ``center=False`` (default) is the
    paper-comparable raw matrix; ``center=True`` uses w_i − μ and the eigenvectors of the
    centered Gram (docs/methods.md §2: Pythia-70m 0.083 raw vs 0.972 centered).

    Eigenvector signs are arbitrary and Z(a) ≠ Z(−a): each eigenvector is taken with its
    largest-magnitude entry positive (`aniso_plugins.numerics.linalg.eigh_gram`); ``both_signs=True``
    uses E = {±u_k} instead, which is sign-free (and can only lower I). Collective under
    torch.distributed: two reductions (the Gram, then d log-sum-exps), the two rounds of
    `GeometryRounds` (I(W) only)."""
    rows = matrix_rows(weight)
    form = "centered" if center else "raw"
    geometry = GeometryRounds(forms=(form,), full=False, both_signs=both_signs)
    return measure_geometry(geometry, lambda g: g.stats(rows), reduce_stats)[form]["isotropy"]


__all__ = [
    "FORMS",
    "GeometryRounds",
    "isotropy",
    "measure_geometry",
]
