"""Geometry of an embedding matrix W (V×d, rows w_i): mean pairwise cosine, the singular
spectrum (effective rank, spectral saturation, principal-variance share, W-error) and the
partition-function isotropy I(W); exact under DDP and FSDP2 (docs/methods.md §2, §8).

Every metric is built in three steps so that plugins can batch all of them into the core's
single reduction (`AnisoPlugins.measure`):

1. ``*_stats(rows, prefix, ...) -> dict[str, Stat]``: local sums (or log-sum-exps) over this
   rank's rows, ``rows = matrix_rows(weight)`` (`aniso_plugins.numerics.distributed.local_rows`);
2. `aniso_plugins.numerics.reduce.reduce_stats` (the core does it for plugins);
3. a finish function over the reduced tensors, identical on every rank.

The public one-call functions (`mean_cosine`, `effective_rank`, `isotropy`, ...) run the three
steps themselves: they take the weight as a full tensor, a DDP replica or an FSDP2 DTensor
shard, are collective when torch.distributed is initialized (every rank must call them), and
return the same Python float on every rank as the full-matrix call on one process. Nothing
gathers the V×d matrix: one d×d Gram matrix, a few d-vectors and, for I(W), a second round of
d log-sum-exps cross the ranks. Computation is float64, in blocks of `BLOCK_ROWS` rows.

**Zero rows** (a zero-initialised pad row, say): a cosine with a zero vector is undefined, so
mean cosines skip rows of zero norm (after centering, for the centered variant). All other
metrics are functions of the matrix as given: a zero row adds nothing to WᵀW and
contributes exp(0) = 1 to every Z(a) of I(W), exactly as in the formulas. Centering subtracts
the mean μ of all V rows, zero rows included.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from aniso_plugins.numerics.distributed import local_rows
from aniso_plugins.numerics.host_copy import read_values
from aniso_plugins.numerics.linalg import GramStats, covariance, eigh_gram, gram_stats_blocked
from aniso_plugins.numerics.reduce import Stat, reduce_stats

BLOCK_ROWS = 8192
"""Rows converted to float64 at a time."""

Variant = Literal["sigma", "sigma2"]
VARIANTS = ("sigma", "sigma2")


def matrix_rows(weight: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """This rank's rows of a (V, d) matrix, detached: all rows on one process, chunk r of a
    DDP replica, the local shard of an FSDP2 DTensor (`local_rows`). Raises for anything that
    is not a 2-D floating-point tensor."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (V, d), got {type(weight).__name__}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"{name} must be a 2-D floating-point (V, d) tensor, got shape {tuple(weight.shape)} {weight.dtype}"
        )
    return local_rows(weight.detach()).rows


def _blocks(rows: torch.Tensor) -> Iterator[torch.Tensor]:
    for block in rows.split(BLOCK_ROWS):
        yield block.to(torch.float64)


def nonfinite_count(rows: torch.Tensor) -> torch.Tensor:
    """Number of NaN or ±inf entries of `rows` (float64, 0-d), counted `BLOCK_ROWS` rows at a
    time: the temporary is one block's boolean mask, not the (V, d) int64 copy that
    ``(~torch.isfinite(rows)).sum()`` makes (4 GiB at V = 131072, d = 4096; docs/performance.md §7.7)."""
    total = torch.zeros((), dtype=torch.int64, device=rows.device)
    for block in rows.split(BLOCK_ROWS):
        total += torch.count_nonzero(~torch.isfinite(block))
    return total.to(torch.float64)


def _count(n: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(n, dtype=torch.float64, device=device).reshape(())


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: expected 'sigma' (p_i = σ_i/Σσ) or 'sigma2' (p_i = σ_i²/Σσ²)")


# --- first moments and the Gram matrix -----------------------------------------------------
def mean_stats(rows: torch.Tensor, prefix: str = "") -> dict[str, Stat]:
    """Σ_i w_i and the row count (sums; keys ``sum``, ``count``): what centering needs, O(Vd)."""
    total = torch.zeros(rows.shape[1], dtype=torch.float64, device=rows.device)
    for x in _blocks(rows):
        total += x.sum(0)
    return {f"{prefix}sum": Stat(total), f"{prefix}count": Stat(_count(rows.shape[0], rows.device))}


def moment_stats(rows: torch.Tensor, prefix: str = "") -> dict[str, Stat]:
    """Σ_i w_i w_iᵀ (d×d), Σ_i w_i and the row count (sums; keys ``gram``, ``sum``, ``count``):
    everything the spectrum, centering and the I(W) eigenvectors need (docs/performance.md §5.2)."""
    m = gram_stats_blocked(rows, BLOCK_ROWS)
    return {f"{prefix}gram": Stat(m.gram), f"{prefix}sum": Stat(m.row_sum), f"{prefix}count": Stat(m.count)}


def moments(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> GramStats:
    """The reduced `moment_stats` as `aniso_plugins.numerics.linalg.GramStats`."""
    return GramStats(reduced[f"{prefix}gram"], reduced[f"{prefix}sum"], reduced[f"{prefix}count"])


def mean_row(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
    """μ = (1/V) Σ_i w_i from reduced `mean_stats` or `moment_stats`."""
    return reduced[f"{prefix}sum"] / reduced[f"{prefix}count"].clamp_min(1.0)


# --- mean pairwise cosine --------------------------------------------------------------------
def mean_cosine_stats(rows: torch.Tensor, prefix: str = "", mean: torch.Tensor | None = None) -> dict[str, Stat]:
    """s = Σ_i u_i, n = #{i : ‖x_i‖ > 0} and Σ_i ‖x_i‖, with x_i = w_i − μ (μ = `mean`, or 0
    when None) and u_i = x_i/‖x_i‖ over this rank's nonzero rows (sums; keys ``unit_sum``,
    ``nonzero``, ``norm_sum``)."""
    s = torch.zeros(rows.shape[1], dtype=torch.float64, device=rows.device)
    n = torch.zeros((), dtype=torch.float64, device=rows.device)
    norms = torch.zeros((), dtype=torch.float64, device=rows.device)
    for x in _blocks(rows):
        if mean is not None:
            x = x - mean
        norm = x.norm(dim=1)
        keep = norm > 0  # a zero row adds 0 / 1 to s: no row is selected (no host read)
        s += (x / torch.where(keep, norm, 1.0)[:, None]).sum(0)
        n += keep.sum()
        norms += norm.sum(dtype=torch.float64)
    return {f"{prefix}unit_sum": Stat(s), f"{prefix}nonzero": Stat(n), f"{prefix}norm_sum": Stat(norms)}


def mean_cosine_value(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
    """Mean of cos(x_i, x_j) over ordered pairs i ≠ j of nonzero rows,
    (‖s‖² − n)/(n(n − 1)) (docs/methods.md §8; Gao et al. 2019; A(H) of Godey et al. 2024), a
    0-d tensor (nothing read back). NaN when fewer than two rows are nonzero."""
    s, n = reduced[f"{prefix}unit_sum"], reduced[f"{prefix}nonzero"].to(torch.float64)
    return torch.where(n < 2, math.nan, (s @ s - n) / (n * (n - 1)).clamp_min(1.0))


def mean_norm_ratio_value(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
    """‖μ‖ / mean_i ‖w_i‖ = ‖Σ_i w_i‖ / Σ_i ‖w_i‖ over all V rows (Stollenwerk & Stollenwerk
    2025's ‖μ‖ ratio; 1 when every row points the same way, 0 when the rows are centred), from
    `moment_stats` / `mean_stats` (``sum``) and the raw `mean_cosine_stats` (``raw/norm_sum``);
    NaN for an all-zero matrix. A 0-d tensor."""
    total, norms = reduced[f"{prefix}sum"], reduced[f"{prefix}raw/norm_sum"]
    return torch.where(norms > 0, total.norm() / norms.clamp_min(torch.finfo(torch.float64).tiny), math.nan)


def mean_cosine_finish(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> float:
    """`mean_cosine_value` as a float."""
    return float(mean_cosine_value(reduced, prefix))


def cross_cosine_value(reduced: Mapping[str, torch.Tensor], prefix_a: str, prefix_b: str) -> torch.Tensor:
    """Mean of cos(x_i, x_j) over i in set A, j in set B (nonzero rows; A and B disjoint), from
    their `mean_cosine_stats`: s_A·s_B/(n_A n_B), a 0-d tensor (nothing read back). NaN when a
    set has no nonzero row."""
    n = reduced[f"{prefix_a}nonzero"].to(torch.float64) * reduced[f"{prefix_b}nonzero"].to(torch.float64)
    value = reduced[f"{prefix_a}unit_sum"] @ reduced[f"{prefix_b}unit_sum"] / n.clamp_min(1.0)
    return torch.where(n == 0, math.nan, value)


def cross_cosine_finish(reduced: Mapping[str, torch.Tensor], prefix_a: str, prefix_b: str) -> float:
    """`cross_cosine_value` as a float."""
    return float(cross_cosine_value(reduced, prefix_a, prefix_b))


# --- singular spectrum -----------------------------------------------------------------------
SV_QUANTILES = (0.25, 0.5, 0.75)
"""Where `Spectrum.summary` reads the normalized singular values: the quarter points of k."""


@dataclass(frozen=True)
class Spectrum:
    """Spectrum of W (center=False) or W − 1μᵀ (center=True), from the reduced d×d Gram.

    eigenvalues: λ_i = σ_i², descending, float64 (round-off below d·ε·λ_max set to 0, see
        `aniso_plugins.numerics.linalg.eigh_gram`);
    eigenvectors: (d, d), column i the unit right singular vector for λ_i (sign convention
        of `eigh_gram`: largest-magnitude entry positive);
    rows: V, the number of rows of the matrix.

    Distributions over the spectrum use the k = min(V, d) singular values of the V×d matrix.
    """

    eigenvalues: torch.Tensor
    eigenvectors: torch.Tensor
    rows: int
    center: bool

    @classmethod
    def from_moments(cls, m: GramStats, center: bool, rows: int | None = None) -> Spectrum:
        """Spectrum from reduced `moment_stats` (`moments(reduced, prefix)`); `rows`: the count
        V when the caller has read it already (else read here)."""
        lam, vec = eigh_gram(covariance(m, center))
        return cls(lam, vec, int(m.count.item()) if rows is None else rows, center)

    @property
    def size(self) -> int:
        """k = min(V, d), the number of singular values."""
        return min(self.rows, self.eigenvalues.shape[0])

    @property
    def singular_values(self) -> torch.Tensor:
        """σ_1 ≥ … ≥ σ_k (float64)."""
        return self.eigenvalues[: self.size].sqrt()

    def distribution(self, variant: Variant = "sigma") -> torch.Tensor:
        """p_i = σ_i/Σ_j σ_j ("sigma", Roy & Vetterli 2007, RankMe) or σ_i²/Σ_j σ_j² ("sigma2",
        the covariance / matrix-entropy form) over the k singular values."""
        _check_variant(variant)
        x = self.singular_values if variant == "sigma" else self.eigenvalues[: self.size]
        return x / x.sum()

    def entropy_value(self, variant: Variant = "sigma") -> torch.Tensor:
        """Shannon entropy H(p) = −Σ p_i ln p_i (0 ln 0 = 0) of `distribution(variant)`, a 0-d
        tensor (nothing read back); NaN for W = 0."""
        p = self.distribution(variant)
        h = -torch.where(p > 0, p * p.log(), 0.0).sum()
        return torch.where(torch.isfinite(p).all(), h, math.nan)

    def entropy(self, variant: Variant = "sigma") -> float:
        """`entropy_value` as a float."""
        return float(self.entropy_value(variant))

    def effective_rank(self, variant: Variant = "sigma") -> float:
        """erank = exp H(p) (docs/methods.md §8; seed 000 uses p_i = σ_i/Σσ, "sigma")."""
        return math.exp(self.entropy(variant))

    def singular_entropy(self, variant: Variant = "sigma") -> float:
        """Spectral saturation of Godey, de la Clergerie & Sagot 2024: KL(p ‖ U_k) = ln k − H(p),
        the divergence of the normalised singular-value distribution from the uniform one
        (0 = flat spectrum). The paper does not say whether σ or σ² is normalised; the default
        "sigma" makes it ln k − ln erank_sigma (docs/methods.md §8)."""
        return math.log(self.size) - self.entropy(variant)

    def normalized(self) -> torch.Tensor:
        """σ_i/σ_max, descending (Godey et al. 2024's saturation curves; AGG Fig. 3c)."""
        sigma = self.singular_values
        return sigma / sigma[0]

    def variance_share(self, k: int) -> float:
        """Σ_{i≤k} σ_i² / Σ_i σ_i²: with center=True, the share of the total variance along the
        top-k principal components (seed 000: "the first 1 to 3 principal components")."""
        return float(self.variance_share_value(k))

    def variance_share_value(self, k: int) -> torch.Tensor:
        """`variance_share` as a 0-d tensor (nothing read back)."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k={k!r}: expected an integer >= 1")
        lam = self.eigenvalues
        return lam[:k].sum() / lam.sum()

    def w_error(self, rank: int) -> float:
        """‖σ_{r+1:}‖₂ / ‖W‖_F: relative Frobenius error of the best rank-r approximation
        (Eckart–Young), the W-error of Godey et al. 2024 (docs/methods.md §8)."""
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"rank={rank!r}: expected an integer >= 0")
        return float(self.w_error_value(rank))

    def w_error_value(self, rank: int) -> torch.Tensor:
        """`w_error` as a 0-d tensor (nothing read back)."""
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"rank={rank!r}: expected an integer >= 0")
        lam = self.eigenvalues
        return (lam[rank:].sum() / lam.sum()).sqrt()

    def summary_values(self) -> dict[str, torch.Tensor]:
        """The scalar summaries of this spectrum that the geometry plugin and `aniso report`
        log, as 0-d tensors (nothing read back; `summary` reads them): ``effective_rank`` /
        ``effective_rank_sigma2``, ``singular_entropy`` / ``singular_entropy_sigma2``,
        ``sigma_max``, ``sv_normalized_q25|q50|q75`` (σ_i/σ_max at a quarter, half and three
        quarters of the way down the k singular values) and ``variance_share_top1|top3``."""
        normalized = self.normalized()
        lam = self.eigenvalues
        h = {variant: self.entropy_value(variant) for variant in ("sigma", "sigma2")}
        out = {
            "effective_rank": h["sigma"].exp(),
            "effective_rank_sigma2": h["sigma2"].exp(),
            "singular_entropy": math.log(self.size) - h["sigma"],
            "singular_entropy_sigma2": math.log(self.size) - h["sigma2"],
            "sigma_max": self.singular_values[0],
            "variance_share_top1": self.variance_share_value(1),
            "variance_share_top3": self.variance_share_value(min(3, lam.numel())),
        }
        for q in SV_QUANTILES:
            out[f"sv_normalized_q{round(100 * q)}"] = normalized[int(q * (normalized.numel() - 1))]
        return out

    def summary(self) -> dict[str, float]:
        """`summary_values`, read back at once (one transfer)."""
        return read_values(self.summary_values())


# --- isotropy I(W) ---------------------------------------------------------------------------
def isotropy_directions(spectrum: Spectrum, both_signs: bool = False) -> torch.Tensor:
    """The set E of unit directions a for I(W): the d eigenvectors of WᵀW (columns, sign
    convention of `eigh_gram`), or the 2d vectors ±u_k with `both_signs` (sign-free)."""
    u = spectrum.eigenvectors
    return torch.cat([u, -u], dim=1) if both_signs else u


def isotropy_stats(
    rows: torch.Tensor, directions: torch.Tensor, prefix: str = "", mean: torch.Tensor | None = None
) -> dict[str, Stat]:
    """log Z_r(a) = log Σ_{i on this rank} exp(⟨w_i − μ, a⟩) for every column a of
    `directions` (μ = `mean`, or 0), float64; key ``log_z``, op "lse", so the reduction gives
    log Z(a) over all V rows (docs/performance.md §5.3)."""
    directions = directions.to(torch.float64)
    log_z = torch.full((directions.shape[1],), -math.inf, dtype=torch.float64, device=rows.device)
    for x in _blocks(rows):
        log_z = torch.logaddexp(log_z, torch.logsumexp(x @ directions, dim=0))
    if mean is not None:
        log_z = log_z - mean @ directions
    return {f"{prefix}log_z": Stat(log_z, "lse")}


def log_isotropy_value(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
    """log I(W) = min_a log Z(a) − max_a log Z(a), from reduced `isotropy_stats` (a 0-d tensor)."""
    log_z = reduced[f"{prefix}log_z"]
    return log_z.min() - log_z.max()


def log_isotropy_finish(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> float:
    """`log_isotropy_value` as a float."""
    return float(log_isotropy_value(reduced, prefix))


def isotropy_value(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
    """I(W) = min_a Z(a) / max_a Z(a) = exp(`log_isotropy_value`), a 0-d tensor."""
    return log_isotropy_value(reduced, prefix).exp()


def isotropy_finish(reduced: Mapping[str, torch.Tensor], prefix: str = "") -> float:
    """`isotropy_value` as a float."""
    return float(isotropy_value(reduced, prefix))


# --- one-call public functions ---------------------------------------------------------------
def spectrum(weight: torch.Tensor, center: bool = False) -> Spectrum:
    """The `Spectrum` of `weight` (or of its centered rows), from the reduced d×d Gram: no SVD
    of the V×d matrix. Collective under torch.distributed."""
    rows = matrix_rows(weight)
    return Spectrum.from_moments(moments(reduce_stats(moment_stats(rows))), center)


def mean_cosine(weight: torch.Tensor, center: bool = False) -> float:
    """Mean pairwise cosine of the rows of `weight` over ordered pairs i ≠ j,

        mean_{i≠j} cos(x_i, x_j) = (‖Σ_i u_i‖² − n) / (n(n − 1)),   u_i = x_i / ‖x_i‖,

    exact in O(Vd) (docs/methods.md §8, docs/performance.md §5.5; Gao et al. 2019's regulariser without
    its 1/N² normaliser). x_i = w_i (default) or w_i − μ with μ the mean row (``center=True``).
    Rows with ‖x_i‖ = 0 are excluded and n counts the others; NaN when n < 2."""
    rows = matrix_rows(weight)
    mean = mean_row(reduce_stats(mean_stats(rows))) if center else None
    return mean_cosine_finish(reduce_stats(mean_cosine_stats(rows, mean=mean)))


def effective_rank(weight: torch.Tensor, center: bool = True, variant: Variant = "sigma") -> float:
    """Effective rank exp(−Σ_i p_i ln p_i) of `weight` (of W − 1μᵀ by default).

    variant "sigma": p_i = σ_i/Σ_j σ_j (Roy & Vetterli 2007; RankMe; the definition of seed 000);
    "sigma2": p_i = σ_i²/Σ_j σ_j² (covariance eigenvalues, "matrix entropy"). The two disagree
    (63.1 vs 58.2 on one matrix, docs/methods.md §8): always name the variant. σ from the d×d Gram."""
    _check_variant(variant)
    return spectrum(weight, center).effective_rank(variant)


def singular_entropy(weight: torch.Tensor, center: bool = False, variant: Variant = "sigma") -> float:
    """Spectral saturation (Godey, de la Clergerie & Sagot 2024): KL(p ‖ uniform) = ln k − H(p)
    over the k = min(V, d) singular values of the LM head (raw by default), p_i = σ_i/Σσ
    ("sigma", our choice; the paper does not say) or σ_i²/Σσ² ("sigma2")."""
    _check_variant(variant)
    return spectrum(weight, center).singular_entropy(variant)


def normalized_singular_values(weight: torch.Tensor, center: bool = False) -> torch.Tensor:
    """σ_i / σ_max (descending, float64, k = min(V, d) values), Godey et al. 2024."""
    return spectrum(weight, center).normalized()


def principal_variance_share(weight: torch.Tensor, k: int = 1, center: bool = True) -> float:
    """Share of the total variance along the top-k principal components,
    Σ_{i≤k} λ_i / Σ_i λ_i with λ the eigenvalues of (W − 1μᵀ)ᵀ(W − 1μᵀ) (uncentered λ = σ² of W
    with ``center=False``)."""
    return spectrum(weight, center).variance_share(k)


def w_error(weight: torch.Tensor, rank: int, center: bool = False) -> float:
    """W-error(r) = ‖σ_{r+1:}‖₂ / ‖W‖_F (Godey et al. 2024; Eckart–Young)."""
    return spectrum(weight, center).w_error(rank)


__all__ = [
    "BLOCK_ROWS",
    "Spectrum",
    "Variant",
    "cross_cosine_finish",
    "cross_cosine_value",
    "effective_rank",
    "isotropy_directions",
    "isotropy_finish",
    "isotropy_stats",
    "log_isotropy_finish",
    "isotropy_value",
    "log_isotropy_value",
    "matrix_rows",
    "mean_cosine",
    "mean_cosine_finish",
    "mean_cosine_value",
    "mean_norm_ratio_value",
    "mean_cosine_stats",
    "mean_row",
    "mean_stats",
    "moment_stats",
    "moments",
    "nonfinite_count",
    "normalized_singular_values",
    "principal_variance_share",
    "singular_entropy",
    "spectrum",
    "w_error",
]
