"""The passes of `fused_linear_cross_entropy` over tiles of the N × V logits (docs/performance.md §11):
a tile is `Plan.rows` token rows × `Plan.cols` vocabulary ids, never the whole N × V.

- A tile that holds every id of its rows (``cols = V``, row chunks: Liger-Kernel's and PyTorch's
  scheme) is computed once: its statistics, softmax and logit gradient in one pass (on the CPU the
  row-local softmax kernel, in place; a few rows ids-major, `TRANSPOSED_ROWS`), then
  dX_rows = H W, the gates, dW += Hᵀ X_rows.
- Tiles of part of the vocabulary (Cut Cross-Entropy's scheme) take two passes over the ids of
  each row chunk: the first combines each row's log-sum-exp over the tiles (online, no logits
  kept), the second recomputes each tile's logits and takes p = exp(z' − lse), its gradient,
  dX_rows += H W_ids and dW_ids += Hᵀ X_rows: one more logits GEMM, every GEMM rows × d × ids.

On a vocabulary shard the per-row statistics are all-reduced over the shard group once per row
chunk (log-sum-exp: MAX then SUM; target logit and logit sum: SUM). Ignored rows are not removed:
their weight ω_i is 0 (`RowTerms`), so every shape is known before the data (no host read)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from aniso_plugins.methods.fused_loss.gemm import addmm_in_
from aniso_plugins.methods.fused_loss.logit_transform import LogitTransform
from aniso_plugins.methods.fused_loss.row_gates import RowGates, columns_of, gate_block_, row_flags
from aniso_plugins.methods.fused_loss.workspace import STAGE_BYTES, RowTerms, Tile, block_stats, softmax_stats_, token_stats
from aniso_plugins.numerics.linalg import ROW_BLOCK

__all__ = ["FLOOR_ROWS", "TRANSPOSED_ROWS", "PassOptions", "Plan", "Shard", "TokenRows", "fused_pass", "plan_tiles",
           "pytorch_chunk_rows"]

FLOOR_ROWS = 64
"""Fewest token rows of a tile that holds the whole vocabulary in the default plan: each such tile
reads W twice and dW twice, which at fewer rows costs more than a second logits GEMM over
vocabulary blocks (docs/performance.md §11.4)."""
TRANSPOSED_ROWS = 128
"""On the CPU, a float32 tile of whole rows of at most this many rows is held ids-major
(ids × rows, `Tile`): the logits GEMM of a few rows runs 1.2-1.5× faster as W Xᵀ than as X Wᵀ there,
and the softmax is then a reduction over the contiguous dimension's rows (docs/performance.md §11.4).
Only where the tile's one-pass softmax and gradient follow: the statistics of a pass without a
gradient (``reduction="none"``'s forward, token outputs) run over row blocks, 3× slower ids-major."""
MIN_TILE_BYTES = 2**20
"""A tile of at least this many bytes (small problems are not cut in tiny tiles)."""
ROW_BYTES = 64
"""Bytes per token row of the per-row vectors of a call (weights, targets, statistics, gates)."""


class Plan(NamedTuple):
    """Tiles of `rows` token rows × `cols` vocabulary ids (of this rank's ids), and the bytes of a
    float32 work block (`Tile`, `gate_block_`)."""

    rows: int
    cols: int
    block: int


def pytorch_chunk_rows(n: int, v: int, d: int) -> int:
    """The rows of a logits chunk of PyTorch's ``F.linear_cross_entropy`` (its default
    ``chunking_method="aspect_ratio"``): next_pow2(⌈N / ⌈V/d⌉⌉), at most N; its float32 logits
    take about the bytes of the hidden states (N·d floats) or up to twice them."""
    target = -(-n // -(-v // d))
    return min(1 << max(target - 1, 0).bit_length(), n)


def plan_tiles(n: int, v: int, d: int, rows: int | None = None, cols: int | None = None, itemsize: int = 4,
               block: int = STAGE_BYTES) -> Plan:
    """The tiles of N × V logits of `itemsize` bytes. Given `rows` (token rows per tile) and / or
    `cols` (ids per tile), those (the other: all). By default the bytes of PyTorch's float32 chunk
    (`pytorch_chunk_rows` × V, at least `MIN_TILE_BYTES`): whole rows where at least `FLOOR_ROWS`
    fit (PyTorch's rows, twice them for bf16 logits, at most 1024; a power of two, which the GEMMs
    of a few rows need), with work blocks of at most a 64th of the chunk; else every row × the ids
    that fit in the chunk less two work blocks (`block` bytes, the device's: `STAGE_BYTES` on the
    CPU; at most an eighth of the chunk) and `ROW_BYTES` per row. Beyond dW and dX we then hold
    one tile, one work block and the per-row vectors, where PyTorch holds its chunk and its
    per-row vectors."""
    n, v = max(n, 1), max(v, 1)
    if rows is not None or cols is not None:
        return Plan(min(rows or n, n), min(cols or v, v), block)
    chunk = 4 * v * pytorch_chunk_rows(n, v, d)
    block = min(block, max(chunk // 8, 2**18))
    fit = max(chunk, MIN_TILE_BYTES) // (itemsize * v)
    if fit >= min(n, FLOOR_ROWS):
        return Plan(min(fit, ROW_BLOCK, n), v, min(block, max(chunk // 64, 2**12)))
    budget = max(chunk - 2 * block - ROW_BYTES * n, MIN_TILE_BYTES) // itemsize
    return Plan(n, min(v, max(budget // n, 1)), block)


class Shard(NamedTuple):
    """This rank's ids ``[start, stop)`` of `total`, and the group of the other shards."""

    start: int
    stop: int
    total: int
    group: object


class PassOptions(NamedTuple):
    """One call's settings: dtypes (GEMM, accumulation), the transform, the shard, the tiles,
    which gradients (dX, dW, db) are wanted and whether each token's outputs are (`TokenRows`)."""

    compute: torch.dtype
    acc: torch.dtype
    transform: LogitTransform | None
    shard: Shard | None
    plan: Plan
    wants: tuple[bool, bool, bool]
    tokens: bool = False


class TokenRows(NamedTuple):
    """Per-row statistics of the transformed logits z' over all ids, beyond the loss's: E_p[z'],
    log Σ_k exp 2z'_k, max_k z'_k, its first id, Σ_k z'_k (the token outputs of
    `fused_linear_cross_entropy`: entropy = lse − E_p[z'], log Σ p² = log Σ exp 2z' − 2·lse,
    argmax, mean logit)."""

    mean: torch.Tensor
    squares: torch.Tensor
    peak: torch.Tensor
    argmax: torch.Tensor
    total: torch.Tensor


class _Rows(NamedTuple):
    """Per-row statistics of all N rows, combined over the tiles (log-sum-exp, target logit,
    Σ_k c_k z'_k or None, the `TokenRows` or None)."""

    lse: torch.Tensor
    target: torch.Tensor
    total: torch.Tensor | None
    tokens: TokenRows | None = None


def fused_pass(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
               terms: RowTerms, gates: RowGates | None, o: PassOptions):
    """(row losses, their z-loss parts or None, dX, dW, db, (lse, `TokenRows`) or None) of the
    fused loss: the module docstring's passes, outside autocast; the last with ``o.tokens``."""
    want_dx, want_dw, want_db = o.wants
    with torch.autocast(hidden.device.type, enabled=False):
        d = weight.shape[1]
        X, y = hidden.reshape(-1, d), targets.reshape(-1)
        n, v, acc = X.shape[0], weight.shape[0], o.acc
        offset = 0 if o.shard is None else o.shard.start
        valid = terms.weight != 0  # ignored rows (and rows of token weight 0) weigh nothing
        flags = None if gates is None or not want_dw else row_flags(gates, torch.where(valid, y, 0), valid, acc)
        columns = None if flags is None else tuple(g.to(acc)[offset : offset + v] for g in (gates.g1, gates.g2))
        w = weight.to(o.compute)
        b = None if bias is None else bias.to(o.compute)
        dx = torch.zeros(hidden.shape, dtype=acc, device=X.device) if want_dx else None  # not a view: an output
        dw = torch.zeros(v, d, dtype=acc, device=X.device) if want_dw else None
        db = torch.zeros(v, dtype=acc, device=X.device) if want_db and bias is not None else None
        rows = _Rows(*(torch.zeros(n, dtype=acc, device=X.device) for _ in range(2)),
                     torch.zeros(n, dtype=acc, device=X.device) if terms.smoothing else None,
                     _empty_tokens(n, acc, X.device) if o.tokens else None)
        transposed = (X.device.type == "cpu" and o.plan.cols >= v and o.plan.rows <= TRANSPOSED_ROWS
                      and o.compute == acc and o.transform is None and any(o.wants) and not o.tokens)  # the one-pass softmax
        tile = Tile(min(o.plan.rows, n), min(o.plan.cols, v), o.compute, acc, X.device, o.plan.block, transposed)
        for r0 in range(0, n, o.plan.rows):
            r1 = min(r0 + o.plan.rows, n)
            part = terms.rows(r0, r1)
            local = torch.where(valid[r0:r1], y[r0:r1], 0) - offset  # ignored rows' id: 0 (no N-sized copy held)
            ctx = _Chunk(X[r0:r1].to(o.compute), local, part, w, b, tile, o, columns, flags, r0)
            stats = _chunk_pass(ctx, (None if dx is None else dx.view(n, d), dw, db))
            for full, part in zip((*rows[:3], *(rows.tokens or ())), (*stats[:3], *(stats.tokens or ()))):
                if full is not None:
                    full[r0:r1] = part
        losses, z_parts = terms.losses(*rows[:3])
        if dx is not None:
            dx.view(n, d).mul_(terms.weight[:, None])  # G = ω ⊙ H
            dx = dx.to(hidden.dtype)
    return losses, z_parts, dx, dw, db, None if rows.tokens is None else (rows.lse, rows.tokens)


def _empty_tokens(n: int, acc: torch.dtype, device: torch.device) -> TokenRows:
    return TokenRows(*(torch.zeros(n, dtype=torch.int64 if name == "argmax" else acc, device=device)
                       for name in TokenRows._fields))


class _Chunk(NamedTuple):
    """What the tiles of one row chunk share: its rows of X, its targets as local ids of this
    rank's vocabulary (y − shard start), its `RowTerms`, W and b in the GEMM dtype, the tile
    buffer, the options, the gates g1, g2 of this rank's ids with the rows' `RowFlags` (None:
    ungated), and its first row."""

    x: torch.Tensor
    local: torch.Tensor
    terms: RowTerms
    w: torch.Tensor
    b: torch.Tensor | None
    tile: Tile
    o: PassOptions
    gates: tuple[torch.Tensor, torch.Tensor] | None
    flags: object
    r0: int


def _chunk_pass(c: _Chunk, grads) -> tuple:
    """One row chunk: its rows' statistics (returned) and its parts of the gradients."""
    v, cols = c.w.shape[0], c.o.plan.cols
    blocks = [(s, min(s + cols, v)) for s in range(0, v, cols)]
    want = any(g is not None for g in grads)
    fast = want and len(blocks) == 1 and c.o.shard is None and c.x.device.type == "cpu" and not c.o.tokens
    if fast:  # every id in one tile, nothing to reduce across ranks: one pass
        return _tile_gradient(c, grads, 0, v, c.tile.logits(c.x, c.w, c.b), None, True)
    stats, z = None, None
    for s, e in blocks:
        z = c.tile.logits(c.x, c.w[s:e], None if c.b is None else c.b[s:e])
        part = _tile_stats(c, z, s, e, keep=want and len(blocks) == 1)
        stats = part if stats is None else _combine(stats, part)
    if c.o.shard is not None:
        stats = _reduce_over_shards(stats, c.o.shard.group)
    if want:
        for s, e in blocks:
            if len(blocks) > 1:
                z = c.tile.logits(c.x, c.w[s:e], None if c.b is None else c.b[s:e])
            _tile_gradient(c, grads, s, e, z, stats, len(blocks) > 1 or c.tile.staged)
    return stats


def _owned(c: _Chunk, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's target column in the tile of ids [s, e) (clamped) and whether the tile holds it."""
    return columns_of(c.local, c.terms.weight != 0, s, e)


def _classes(c: _Chunk, s: int, e: int) -> torch.Tensor | None:
    return None if c.terms.classes is None else c.terms.classes[s:e]


def _tile_stats(c: _Chunk, z: torch.Tensor, s: int, e: int, keep: bool) -> _Rows:
    """The rows' statistics over the tile's ids; a float32 tile becomes z' (its transform) with
    `keep` (its gradient pass follows), else it is spent (recomputed for the gradient)."""
    local, owned = _owned(c, s, e)
    parts, tokens = [], []
    for i, work in c.tile.blocks(z, keep or c.o.tokens):
        if c.o.transform is not None:
            c.o.transform.apply_(work)
        k = slice(i, i + work.shape[0])
        if c.o.tokens:
            part, token = token_stats(work, s + (0 if c.o.shard is None else c.o.shard.start), local[k], owned[k],
                                      _classes(c, s, e), bool(c.terms.smoothing), keep)
            parts.append(part)
            tokens.append(token)
        else:
            parts.append(block_stats(work, local[k], owned[k], _classes(c, s, e), bool(c.terms.smoothing), keep))
    stats = [None if p[0] is None else torch.cat(p) for p in zip(*parts)]
    return _Rows(*stats, TokenRows(*(torch.cat(p) for p in zip(*tokens))) if tokens else None)


def _combine(a: _Rows, b: _Rows) -> _Rows:
    lse = torch.logaddexp(a.lse, b.lse)
    total = None if a.total is None else a.total + b.total
    if a.tokens is None:
        return _Rows(lse, a.target + b.target, total)
    x, y = a.tokens, b.tokens
    later = y.peak > x.peak  # ties keep the earlier id, as argmax
    tokens = TokenRows((a.lse - lse).exp() * x.mean + (b.lse - lse).exp() * y.mean, torch.logaddexp(x.squares, y.squares),
                       torch.where(later, y.peak, x.peak), torch.where(later, y.argmax, x.argmax), x.total + y.total)
    return _Rows(lse, a.target + b.target, total, tokens)


def _reduce_over_shards(stats: _Rows, group) -> _Rows:
    """The whole vocabulary's statistics from every shard's: log Σ_r exp(lse_r) (MAX, then SUM
    of exp(lse_r − max)); target logits and logit sums summed (one shard holds each target)."""
    peak = stats.lse.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    parts = [(stats.lse - peak).exp(), stats.target] + ([] if stats.total is None else [stats.total])
    sums = torch.stack(parts)
    dist.all_reduce(sums, group=group)
    return _Rows(sums[0].log() + peak, sums[1], None if stats.total is None else sums[2])


def _tile_gradient(c: _Chunk, grads, s: int, e: int, z: torch.Tensor, stats: _Rows | None, apply: bool) -> _Rows | None:
    """G of the tile of ids [s, e) in place (with `stats` given: p = exp(z' − lse); else the
    one-pass softmax, whose statistics are returned), then its parts of dX, db (inside the
    blocks) and, gated, dW. `apply`: the tile holds z, not yet z'."""
    db = grads[2]
    local, owned = _owned(c, s, e)
    transform, terms = c.o.transform, c.terms
    targets = torch.empty(local.shape, dtype=c.o.acc, device=local.device)
    found = []
    for i, work in c.tile.blocks(z, transform is not None):
        k = slice(i, i + work.shape[0])
        if transform is not None and apply:
            transform.apply_(work)
        derivative = None if transform is None else transform.derivative(work)
        if stats is None:
            found.append(softmax_stats_(work, local[k], owned[k], _classes(c, s, e), bool(terms.smoothing)))
            lse = found[-1][0]
        else:
            lse = stats.lse[k]
            work.sub_(lse[:, None]).exp_()
        terms.rows(k.start, k.stop).gradient_(work, lse, local[k], owned[k], slice(s, e))
        if transform is not None:
            transform.chain_(work, derivative)
        targets[k] = work.gather(1, local[k, None]).squeeze(1)
        if db is not None:
            db[s:e].addmv_(work.T, terms.weight[k])
        c.tile.store(z, i, work)
    _project(c, grads, s, e, z, targets, owned, local)
    return None if stats is not None else _Rows(*(None if p[0] is None else torch.cat(p) for p in zip(*found)))


def _project(c: _Chunk, grads, s: int, e: int, z: torch.Tensor, targets: torch.Tensor, owned: torch.Tensor,
             local: torch.Tensor) -> None:
    """dX_rows += H W_ids (ungated; ω on dX's rows at the end), then dW_ids += (H ⊙ ω ⊙ Γ)ᵀ X_rows:
    ω folded into Γ's temporary, or without gates onto a copy of X's rows where it takes at most an
    eighth of the tile's elements (whole-row tiles), else onto the tile."""
    dx, dw, _ = grads
    r0, r1 = c.r0, c.r0 + z.shape[0]
    if dx is not None:
        addmm_in_(dx[r0:r1], z, c.w[s:e], c.o.compute)
    if dw is None:
        return
    weight, x = c.terms.weight, c.x
    if c.gates is not None:
        g1, g2 = c.gates
        gate_block_(z, c.flags.rare[r0:r1], g1[s:e], g2[s:e], local, owned,
                    targets * c.flags.target_gate[r0:r1] * weight, c.o.plan.block, weight)
    elif 8 * x.numel() <= z.numel():  # an eighth of the tile or less: whole rows
        x = (x.to(c.o.acc) * weight[:, None]).to(c.o.compute)
    else:
        z.mul_(weight[:, None])
    addmm_in_(dw[s:e], z.T, x, c.o.compute)
