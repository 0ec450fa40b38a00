"""The geometry of one matrix for `aniso report`: the two rounds of
`aniso_plugins.metrics.geometry.rounds.GeometryRounds` (the training plugin's), each one
streamed pass over the matrix's row blocks whose statistics are summed block by block
(`sum_over_blocks`, exactly as `reduce_stats` sums ranks), then finished by the same code.

Large matrices: when 2·V·d² exceeds ``gram_flops`` the d×d Gram (spectrum, effective rank,
IsoScore, variance shares) and the partition functions of I(W) come from ``gram_rows``
uniformly sampled rows (the Gram scaled by V/m, log Z shifted by log(V/m)), in float32 blocks
accumulated in float64; the mean cosines (raw and centred), norms and the 2-D projection stay
exact over all V rows. The result says which (``"gram": "exact"`` or ``"sampled (m rows)"``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aniso_plugins.metrics.geometry.rounds import GeometryRounds, measure_geometry
from aniso_plugins.metrics.geometry.stats import BLOCK_ROWS
from aniso_plugins.numerics.reduce import Stat, combine_stats, stat_values, sum_over_blocks
from aniso_plugins.offline.outliers import outlier_stats
from aniso_plugins.offline.sources import MatrixSource

GRAM_FLOPS = 2.0e11
"""Above 2·V·d² flops (one exact Gram pass) the Gram-based metrics use a row sample."""
HIST_ROWS = 2000
"""Rows sampled for the histogram of pairwise cosines."""
HIST_BINS = 100

Progress = Callable[[Iterable, int, str], Iterable]


def _gram_f32(rows: torch.Tensor) -> torch.Tensor:
    """XᵀX of `rows` in float32, returned as float64 (to be accumulated in float64)."""
    x = rows.to(torch.float32)
    return (x.T @ x).to(torch.float64)


def _histogram(x: torch.Tensor, mean: torch.Tensor | None) -> dict[str, list[float]]:
    """`HIST_BINS`-bin histogram on [-1, 1] of the pairwise cosines of the rows of `x` (of x − mean)."""
    x = x.to(torch.float64)
    if mean is not None:
        x = x - mean
    norm = x.norm(dim=1)
    x = x[norm > 0] / norm[norm > 0, None]
    cos = x @ x.T
    i, j = torch.triu_indices(len(x), len(x), 1)
    c = cos[i, j].clamp(-1, 1)
    counts = torch.histc(c, bins=HIST_BINS, min=-1.0, max=1.0)
    return {"counts": [int(v) for v in counts.tolist()], "min": -1.0, "max": 1.0, "pairs": int(c.numel())}


def _picked(pick: torch.Tensor, a: int, x: torch.Tensor) -> torch.Tensor:
    """The rows of block `x` (starting at row `a`) whose indices are in the sorted `pick`."""
    sel = pick[(pick >= a) & (pick < a + len(x))] - a
    return x[sel]


# --- which rows the Gram reads -------------------------------------------------------------
@dataclass(frozen=True)
class _GramPlan:
    """The Gram of all V rows (``exact``) or of m sampled ones (``gram_pick``), and the rows
    sampled for the cosine histogram (``hist_pick``); both sorted, from one seeded generator."""

    exact: bool
    m: int
    gram_pick: torch.Tensor | None
    hist_pick: torch.Tensor

    @classmethod
    def of(cls, v: int, d: int, gram_rows: int | None, gram_flops: float, seed: int) -> _GramPlan:
        """Exact when one Gram pass costs at most `gram_flops` (and `gram_rows` is None), or
        when the sample would hold every row."""
        exact = gram_rows is None and 2.0 * v * d * d <= gram_flops
        m = v if exact else min(v, gram_rows or max(4 * d, int(gram_flops / (2.0 * d * d))))
        exact = exact or m >= v
        g = torch.Generator().manual_seed(seed)
        gram_pick = None if exact else torch.randperm(v, generator=g)[:m].sort().values
        hist_pick = torch.randperm(v, generator=g)[: min(HIST_ROWS, v)].sort().values
        return cls(exact, m, gram_pick, hist_pick)

    @property
    def label(self) -> str:
        return "exact" if self.exact else f"sampled ({self.m} rows, float32 blocks)"


def _sampled_log_z(sample: torch.Tensor, directions, shift: float, block_rows: int) -> dict[str, Stat]:
    """log Z(a) of I(W) over the sampled rows (float32 products, float64 log-sum-exps, blocks
    of `block_rows`), shifted by log(V/m) to stand for all V rows."""
    acc: dict[str, Stat] = {}
    for s in sample.split(block_rows):
        for key, vecs, mean in directions:
            z = (s @ vecs.to(torch.float32)).to(torch.float64)
            log_z = torch.logsumexp(z, dim=0)
            if mean is not None:
                log_z = log_z - mean @ vecs
            combine_stats(acc, {key + "log_z": Stat(log_z, "lse")})
    return {k: Stat(s.value + shift, "lse") for k, s in acc.items()}


# --- the streamed rounds -------------------------------------------------------------------
class _StreamedRounds:
    """The report's rows for `measure_geometry`: round r is one pass over the source's row
    blocks (transformed first when there is a `transform`), its statistics summed over the
    blocks; with a sampled `_GramPlan` the Gram-cost statistics come from the sampled rows.
    Keeps what the report shows beside the metrics: row norms, the histogram's rows and the
    2-D projection on the top two raw singular directions."""

    def __init__(self, source: MatrixSource, plan: _GramPlan, transform: Any, progress: Progress | None,
                 keep_rows: bool, block_rows: int) -> None:
        self.source, self.plan, self.transform = source, plan, transform
        self.keep_rows, self.block_rows = keep_rows, block_rows
        self.n_blocks = math.ceil(source.shape[0] / block_rows)
        self.bar = progress if progress is not None and self.n_blocks >= 4 else (lambda it, total, desc: it)
        self.norms: list[torch.Tensor] = []
        self.hist_rows: list[torch.Tensor] = []
        self.gram_sample: list[torch.Tensor] = []
        self.projection: list[torch.Tensor] = []

    def __call__(self, geometry: GeometryRounds) -> dict[str, Stat]:
        return self._round0(geometry) if geometry.round == 0 else self._round1(geometry)

    def _rows(self, round_index: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset, rows) of every block, post-processed, under the progress bar."""
        desc = f"{self.source.name}: pass {round_index + 1}/2"
        for a, block in self.bar(self.source.blocks(self.block_rows), self.n_blocks, desc):
            if self.transform is not None:
                block = self.transform.transform(block if block.dtype in (torch.float32, torch.float64) else block.float())
            yield a, block

    def _block0(self, geometry: GeometryRounds, a: int, x: torch.Tensor) -> dict[str, Stat]:
        """Round 0 of one block, plus its sampled Gram rows, norms and histogram rows."""
        stats = geometry.stats(x, gram=self.plan.exact)
        if not self.plan.exact:
            s = _picked(self.plan.gram_pick, a, x)
            self.gram_sample.append(s.to(torch.float32))
            stats["gram"] = Stat(_gram_f32(s))
        self.norms.append(x.to(torch.float64).norm(dim=1).to(torch.float32))
        self.hist_rows.append(_picked(self.plan.hist_pick, a, x).to(torch.float32))
        return stats

    def _round0(self, geometry: GeometryRounds) -> dict[str, Stat]:
        """Gram (or its sample, scaled to V rows), row sum, count, raw unit-row sum, non-finite."""
        acc = sum_over_blocks(self._block0(geometry, a, x) for a, x in self._rows(0))
        if not self.plan.exact:
            acc["gram"] = Stat(acc["gram"].value * (self.source.shape[0] / self.plan.m))
        return acc

    def _round1(self, geometry: GeometryRounds) -> dict[str, Stat]:
        """log Z of I(W) along both eigenbases (exact, or from the sample), centred unit-row sum,
        and the projection on the top two raw singular directions."""
        acc: dict[str, Stat] = {}
        if not self.plan.exact:
            shift = math.log(self.source.shape[0] / self.plan.m)
            acc = _sampled_log_z(torch.cat(self.gram_sample), geometry.directions(), shift, self.block_rows)
        top2 = geometry.spectra["raw"].eigenvectors[:, :2].to(torch.float32)
        for _, x in self._rows(1):
            combine_stats(acc, geometry.stats(x, gram=self.plan.exact))
            if self.keep_rows:
                self.projection.append(x.to(torch.float32) @ top2)
        return acc


def _entry(source: MatrixSource, rows: _StreamedRounds, geometry: GeometryRounds, result: dict) -> dict[str, Any]:
    """The JSON-able geometry of one matrix, plus ``_norms``/``_projection`` with `keep_rows`."""
    raw, centered = geometry.spectra["raw"], geometry.spectra["centered"]
    samples = torch.cat(rows.hist_rows)
    out: dict[str, Any] = {
        "rows": source.shape[0],
        "dim": source.shape[1],
        "dtype": source.dtype,
        "gram": rows.plan.label,
        "nonfinite": result["nonfinite"],
        "isoscore": result["isoscore"],
        "norm_mean": float(torch.cat(rows.norms).double().mean()),
        "raw": result["raw"],
        "centered": result["centered"],
        "spectrum": [float(x) for x in raw.normalized().tolist()],
        "spectrum_centered": [float(x) for x in centered.normalized().tolist()],
        "outliers_sampled": outlier_stats(samples),
        "cosine_histogram": _histogram(samples, None),
        "cosine_histogram_centered": _histogram(samples, geometry.mean),
    }
    if rows.keep_rows:
        out["_norms"] = torch.cat(rows.norms).cpu()
        out["_projection"] = torch.cat(rows.projection).cpu()
    return out


def matrix_geometry(
    source: MatrixSource,
    *,
    transform: Any = None,
    gram_rows: int | None = None,
    gram_flops: float = GRAM_FLOPS,
    seed: int = 0,
    progress: Progress | None = None,
    keep_rows: bool = True,
    block_rows: int = BLOCK_ROWS,
) -> dict[str, Any]:
    """Every geometry metric of one matrix, raw and centred, in two streamed passes (the two
    rounds of `GeometryRounds`, as `aniso_plugins.metrics.geometry.plugin` measures them).
    `transform`: an object with ``.transform(rows)`` applied to every block first
    (post-processing). Returns a dict of JSON-able numbers, plus ``_norms``/``_projection``
    tensors (dropped from the JSON)."""
    v, d = source.shape
    plan = _GramPlan.of(v, d, gram_rows, gram_flops, seed)
    rows = _StreamedRounds(source, plan, transform, progress, keep_rows, block_rows)
    geometry = GeometryRounds()
    result = measure_geometry(geometry, rows, stat_values)
    return _entry(source, rows, geometry, result)


# --- post-processing -------------------------------------------------------------------------
def _fit(transform, source: MatrixSource, block_rows: int = BLOCK_ROWS):
    """Fit `transform` on all rows of `source`, streamed block by block (float32 or float64)."""
    def blocks():
        for _, b in source.blocks(block_rows):
            yield b if b.dtype in (torch.float32, torch.float64) else b.float()

    try:
        return transform.fit(blocks(), distributed=False)
    except TypeError:  # a transform object without the `distributed` keyword
        return transform.fit(blocks())


def source_geometry(source: MatrixSource, transforms: Sequence[tuple[str, Any]], *, gram_rows: int | None,
                    gram_flops: float, progress: Progress | None, block_rows: int = BLOCK_ROWS) -> dict[str, Any]:
    """`matrix_geometry` of `source` and, under ``postprocessed``, of its rows after each
    transform of `transforms` ((name, prototype) pairs; a copy of each is fitted on the rows)."""
    geo = matrix_geometry(source, gram_rows=gram_rows, gram_flops=gram_flops, progress=progress, block_rows=block_rows)
    post = {}
    for name, proto in transforms:
        t = _fit(copy.deepcopy(proto), source, block_rows)
        post[name] = matrix_geometry(source, transform=t, gram_rows=gram_rows, gram_flops=gram_flops,
                                     progress=progress, keep_rows=False, block_rows=block_rows)
    if post:
        geo["postprocessed"] = post
    return geo


__all__ = ["GRAM_FLOPS", "HIST_BINS", "HIST_ROWS", "matrix_geometry", "source_geometry"]
