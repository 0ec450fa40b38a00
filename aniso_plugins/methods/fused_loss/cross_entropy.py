"""Fused, chunked linear + cross-entropy, `fused_linear_cross_entropy` (optionally label-smoothed
and with row-gated weight gradient, e.g. AGG's): never the full N×V logits.

The approach of Liger-Kernel's fused linear cross-entropy (docs/performance.md §1.1): the forward
walks over chunks of token rows, computes a chunk of logits, its loss and its logit gradient
G_c = (softmax − onehot)/D, projects it at once (dX_c = G_c W, dW += G_cᵀ X_c) and keeps only dX,
dW, db for the backward, which scales them by the incoming scalar gradient. Two passes touch the
chunk: one row-local softmax kernel, and the copy to the GEMM dtype under autocast; the loss is
−log p_{i,y_i}, and the 1/D goes on the (rows, d) and V-sized results, not on the chunk.
The gates Γ of `RowGates` (AGG's) cost no N×V pass: rows are ordered so that the larger row group
(non-rare or rare targets) comes first; its chunks accumulate unscaled, then dW is scaled once
by that group's gate vector, the smaller group's chunks are multiplied in place by theirs, and
target entries are corrected at the end with one index_add (docs/performance.md §3.2, §6.1).
Ignored rows (``ignore_index``) are skipped: they have no loss and no gradient. Label smoothing ε
(as transformers' ``LabelSmoother``) adds ε·mean_k(−log p_ik) to each row's (1 − ε)·CE: in the
same pass, one more row sum of the logits chunk.

Vocabulary parallel (``shard``, tensor parallelism with loss parallel): `weight` and `bias` hold
the ids ``[shard.start, shard.stop)`` of ``shard.total``, and every rank of ``shard.group`` calls
the op with the same hidden states and global targets (and row gates). Each chunk's logits are
the shard's only; their row maxima, then their sums of exp, target logits and logit sums are
all-reduced over the group (two all-reduces of a few values per row per chunk), so the loss,
identical on every rank, is the whole vocabulary's; dW and db are the shard's rows and dX is the
shard's part ``G_shard W_shard``, which the ranks sum (torchtitan's sharding of the head's input
does). Per rank: one chunk of ``chunk_size × V/tp`` logits and dW of ``V/tp × d``, never V × d.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from aniso_plugins.methods.fused_loss.gemm import addmm_in_, check_inputs, compute_dtypes, index_targets
from aniso_plugins.methods.fused_loss.logit_transform import LogitTransform
from aniso_plugins.methods.fused_loss.row_gates import RowGates, row_gating
from aniso_plugins.methods.fused_loss.workspace import PLAIN, RowTerms, VocabParallelWorkspace, Workspace, staged_logits
from aniso_plugins.numerics.distributed import VocabShard
from aniso_plugins.numerics.linalg import ROW_BLOCK

__all__ = ["default_chunk_rows", "fused_linear_cross_entropy"]

CHUNK_LOGITS_BYTES = 512 * 2**20
"""Budget of one float32 logits chunk when ``chunk_size`` is None (`default_chunk_rows`)."""
MIN_CHUNK_ROWS = 256
"""Fewest default rows per chunk: smaller GEMMs and a dW pass per chunk are slow (docs/performance.md §1.1)."""


def default_chunk_rows(vocab: int, tokens: int, logit_bytes: int = 4) -> int:
    """Token rows per chunk when ``chunk_size`` is None: the rows whose logits (`logit_bytes`
    each: 4 for float32, 2 for the bf16 logits of a CPU autocast step, whose float32 stage is a
    few rows) take 1/8 of the bytes of the batch's float32 logits (N/8 rows in float32, N/4 in
    bf16), at least 512 and at most ``ROW_BLOCK`` (1024); fewer where those rows would exceed
    `CHUNK_LOGITS_BYTES` (float32 V > 131072): 512 at V = 262144, 256 at V = 524288, never fewer
    than `MIN_CHUNK_ROWS`: smaller chunks cost more of the step, larger ones more memory (the
    measurements behind these bounds: docs/performance.md §7.3). The peak is then dW + dX + at
    most 512 MiB of logits up to V = 524288."""
    by_batch = min(ROW_BLOCK, max(ROW_BLOCK // 2, tokens * 4 // (8 * logit_bytes)))
    return max(MIN_CHUNK_ROWS, min(by_batch, CHUNK_LOGITS_BYTES // (logit_bytes * vocab)))


def _row_order(y: torch.Tensor, valid: torch.Tensor, gates, acc: torch.dtype, shard: VocabShard | None):
    """The valid rows in chunk order and where the second group starts: ungated, all valid rows
    (split = their count); gated, first the rows of the larger group (gate ``base``), then those
    of the smaller one (`row_gating`'s ``in_other``), so each chunk has one gate pattern. The
    order depends on the global targets only: every shard of a vocabulary chunks alike."""
    if gates is None:
        rows = valid.nonzero().squeeze(1)
        return rows, rows.numel(), None
    rg = row_gating(gates, y, valid, acc, shard)
    first = (valid & ~rg.in_other).nonzero().squeeze(1)
    second = (valid & rg.in_other).nonzero().squeeze(1)
    return torch.cat([first, second]), first.numel(), rg


def _add_target_rows(dw: torch.Tensor, coef: torch.Tensor, X: torch.Tensor, rows: torch.Tensor,
                     ys: torch.Tensor, chunk_size: int) -> None:
    """dW[y_i] += coef_i · x_i over the ordered rows, chunk by chunk (the gated target-row
    correction: row y_i of the gradient keeps its own gate)."""
    for s in range(0, rows.numel(), chunk_size):
        dw.index_add_(0, ys[s : s + chunk_size], coef[s : s + chunk_size, None] * X[rows[s : s + chunk_size]].to(dw.dtype))


def _is_one(scale: float | torch.Tensor) -> bool:
    return isinstance(scale, float) and scale == 1.0


def _scaled(t: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``t · scale``, skipping the multiply when the scale is the number 1."""
    return t if _is_one(scale) else t * scale


def _row_losses(p_target: torch.Tensor, X: torch.Tensor, rows: torch.Tensor, ys: torch.Tensor, w: torch.Tensor,
                b: torch.Tensor | None, compute: torch.dtype, chunk_size: int,
                transform: LogitTransform | None = None) -> torch.Tensor:
    """Each row's −log p_{i,y_i} = logsumexp(z'_i) − z'_{i,y_i} from its target probability; rows
    whose probability is below the dtype's smallest normal number (a loss above ≈ 87 nats in
    float32, where −log p loses precision or is infinite) get it from their logits z' (after
    `transform`), recomputed (rare: one small GEMM for those rows only)."""
    nll = p_target.log().neg_()
    low = (p_target < torch.finfo(p_target.dtype).tiny).nonzero().squeeze(1)
    for s in range(0, low.numel(), chunk_size):
        at = low[s : s + chunk_size]
        z = F.linear(X[rows[at]].to(compute), w, b).to(p_target.dtype)
        z = z if transform is None else transform(z)
        nll[at] = torch.logsumexp(z, 1) - z.gather(1, ys[at, None]).squeeze(1)
    return nll



class _Options(NamedTuple):
    """One call's settings, as `fused_linear_cross_entropy` checked them."""

    ignore_index: int
    scale: float | torch.Tensor
    chunk_size: int
    smoothing: float
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]
    shard: VocabShard | None
    transform: LogitTransform | None
    token_weights: torch.Tensor | None  # flat (N,)
    class_weights: torch.Tensor | None  # (V,)
    z_loss: float

    def terms(self, rows: torch.Tensor, ys: torch.Tensor, acc: torch.dtype) -> RowTerms:
        """The `RowTerms` of the ordered `rows` (targets `ys`)."""
        if self.token_weights is None and self.class_weights is None and not self.z_loss:
            return PLAIN
        t = None if self.token_weights is None else self.token_weights[rows].to(acc)
        c = None if self.class_weights is None else self.class_weights.to(acc)
        return RowTerms(t, None if c is None else c[ys], c, 0.0 if c is None else float(c.sum()), float(self.z_loss))


class _Pass(NamedTuple):
    """What one pass over the chunks computed: the ordered valid `rows`, their `losses`
    t_i·[a_i·(−log p_{i,y_i}) + s_i + λ·lse_i²] (before the 1/D), their z-loss parts t_i·λ·lse_i²
    (None without z-loss), and the gradients (dX, dW, db), already times the 1/D (None: not wanted)."""

    rows: torch.Tensor
    losses: torch.Tensor
    z_losses: torch.Tensor | None
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _fused_pass(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                gates: RowGates | None, o: _Options, wants: tuple[bool, bool, bool]) -> _Pass:
    """The row losses and, where `wants` says, the gradients of the fused loss: one pass over the
    chunks of valid rows (the module docstring), outside autocast (the dtypes are `o.dtypes`)."""
    compute, acc, _ = o.dtypes
    v, d = weight.shape
    want_dx, want_dw, want_db = wants
    with torch.autocast(hidden.device.type, enabled=False):
        X = hidden.reshape(-1, d)
        y = targets.reshape(-1)
        rows, split, rg = _row_order(y, y != o.ignore_index, gates, acc, o.shard)
        n = rows.numel()
        ys = y[rows]
        terms = o.terms(rows, ys, acc)
        w = weight.to(compute)
        b = None if bias is None else bias.to(compute)
        dx, dw, db = (torch.zeros(shape, dtype=dtype, device=X.device) if want else None for want, shape, dtype in
                      ((want_dx, X.shape, hidden.dtype), (want_dw, (v, d), acc), (want_db, (v,), acc)))
        tv, row, smooth, z_rows = (torch.empty(n, dtype=acc, device=X.device) if want else None for want in
                                   (gates is not None and want_dw, True, bool(o.smoothing), bool(o.z_loss)))
        chunks = [(s, min(s + o.chunk_size, split)) for s in range(0, split, o.chunk_size)]
        chunks += [(s, min(s + o.chunk_size, n)) for s in range(split, n, o.chunk_size)]
        shape = (max((e - s for s, e in chunks), default=0), v, d, compute, acc, X.device, want_dw)
        space = Workspace(*shape) if o.shard is None else VocabParallelWorkspace(*shape, o.shard)
        gated = None if gates is None else (_scaled(rg.base, o.scale), _scaled(rg.other, o.scale))
        base_scaled = gated is None
        for s, e in chunks:
            if want_dw and not base_scaled and s >= split:
                dw.mul_(gated[0][:, None])
                base_scaled = True
            xc = X[rows[s:e]].to(compute)  # the chunk's rows only: no (N, d) copy of X
            # D·G_c, the chunk's logit gradient before the 1/D: that goes on the (rows, d) and
            # V-sized results, not on the chunk
            zc = space.gradient(space.logits_of(xc, w, b), ys[s:e, None], o.smoothing, row[s:e],
                                _part(tv, s, e), db, _part(smooth, s, e), o.transform, terms.chunk(s, e), _part(z_rows, s, e))
            if want_dx:
                dx[rows[s:e]] = _scaled(torch.mm(zc, w).to(hidden.dtype), o.scale)
            if want_dw:
                _add_chunk_weight_gradient(dw, zc, xc, compute, acc, space.product,
                                           gated[1] if gated is not None and s >= split else None)
        space = zc = None  # free the chunk buffers before the row losses
        nll = row if o.shard is not None else _row_losses(row, X, rows, ys, w, b, compute, o.chunk_size, o.transform)
        losses, z_losses = _combine_row_losses(nll, smooth, z_rows, terms, o.smoothing, v)
        if want_dw and gates is not None:
            if not base_scaled:
                dw.mul_(gated[0][:, None])
            _add_target_rows(dw, _scaled(rg.target_fix[rows] * tv, o.scale), X, rows, rg.target_index[rows], o.chunk_size)
        elif want_dw and not _is_one(o.scale):
            dw.mul_(o.scale)
    return _Pass(rows, losses, z_losses, (dx if dx is None else dx.reshape(hidden.shape), dw, _scaled_or_none(db, o.scale)))


def _part(t: torch.Tensor | None, s: int, e: int) -> torch.Tensor | None:
    return None if t is None else t[s:e]


def _scaled_or_none(t: torch.Tensor | None, scale: float | torch.Tensor) -> torch.Tensor | None:
    return None if t is None else _scaled(t, scale)


def _add_chunk_weight_gradient(dw: torch.Tensor, zc: torch.Tensor, xc: torch.Tensor, compute: torch.dtype,
                               acc: torch.dtype, product: torch.Tensor | None, gate: torch.Tensor | None) -> None:
    """dW += (G_c ⊙ gate)ᵀ X_c, the gate (the smaller row group's, or None) on the float32 chunk
    itself or, in bf16, on the rounded product (`addmm_in_`)."""
    if gate is not None and zc.dtype == acc:
        zc.mul_(gate)
        gate = None
    addmm_in_(dw, zc.T, xc, compute, product, gate)


def _combine_row_losses(nll: torch.Tensor, smooth: torch.Tensor | None, z_rows: torch.Tensor | None, terms: RowTerms,
                        smoothing: float, vocab: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's loss t_i·[a_i·nll_i + s_i + λ·lse_i²] and its z-loss part t_i·λ·lse_i² (`RowTerms`)."""
    a = terms.probability_factor(smoothing, vocab)
    losses = nll if isinstance(a, float) and a == 1.0 else nll * a
    for part in (smooth, z_rows):
        if part is not None:
            losses = losses + part
    if terms.token is not None:
        losses = losses * terms.token
        z_rows = None if z_rows is None else z_rows * terms.token
    return losses, z_rows


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """The scalar losses (mean / sum): the gradients computed in the forward pass."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, gates, options, grad_enabled, backward_twice):
        wants = tuple(grad_enabled and need for need in ctx.needs_input_grad[:3])
        done = _fused_pass(hidden, weight, bias, targets, gates, options, wants)
        dx, dw, db = done.grads
        ctx.grads = (dx, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype))
        ctx.scaled_by, ctx.backward_twice = None, backward_twice
        z_loss = torch.zeros((), dtype=done.losses.dtype) if done.z_losses is None else done.z_losses.sum() * options.scale
        ctx.mark_non_differentiable(z_loss)
        return done.losses.sum() * options.scale, z_loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _z_grad):
        """The gradients computed in forward, scaled by `grad` in place. Handed over once (no
        reference kept, so autograd takes them without a copy), or with ``backward_twice`` kept
        for a second backward through the retained graph with the same `grad` (zero-bubble
        pipeline schedules run one for the inputs' and one for the weights' gradients)."""
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "fused_linear_cross_entropy: backward can run once per forward (the gradients are computed in "
                "forward); pass backward_twice=True for a schedule that runs it twice"
            )
        if ctx.scaled_by is None:
            grads = tuple(None if g is None else g.mul_(grad.to(g.dtype)) for g in grads)
            ctx.scaled_by = grad.detach().clone()
        elif not torch.equal(grad.detach(), ctx.scaled_by):
            raise RuntimeError(
                "fused_linear_cross_entropy: a second backward with another output gradient than the first "
                f"({float(grad)} after {float(ctx.scaled_by)}); the gradients are computed in forward and scaled once"
            )
        ctx.grads = grads if ctx.backward_twice else None
        return (*grads, None, None, None, None, None)


class _PerTokenLinearCrossEntropy(torch.autograd.Function):
    """``reduction="none"``: each position's loss (0 where ignored); the backward pass runs the
    chunks again with the incoming per-position gradient as token weights (one more logits GEMM
    per chunk, as PyTorch's own chunked op does for 'none')."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, gates, options):
        done = _fused_pass(hidden, weight, bias, targets, gates, options, (False, False, False))
        out = torch.zeros(targets.numel(), dtype=options.dtypes[2], device=hidden.device)
        out[done.rows] = done.losses.to(out.dtype)
        z = torch.zeros_like(out)
        if done.z_losses is not None:
            z[done.rows] = done.z_losses.to(z.dtype)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.gates, ctx.options = gates, options
        z = z.reshape(targets.shape)
        ctx.mark_non_differentiable(z)
        return out.reshape(targets.shape), z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _z_grad):
        hidden, weight, bias, targets = ctx.saved_tensors
        o = ctx.options
        upstream = grad.reshape(-1)
        token = upstream if o.token_weights is None else upstream * o.token_weights
        done = _fused_pass(hidden, weight, bias, targets, ctx.gates, o._replace(token_weights=token), ctx.needs_input_grad[:3])
        dx, dw, db = done.grads
        return dx, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype), None, None, None


def _loss_scale(targets: torch.Tensor, ignore_index: int, reduction: str, normalizer,
                class_weights: torch.Tensor | None) -> float | torch.Tensor:
    """1 / D of `fused_linear_cross_entropy`'s loss (1 for ``reduction="none"``)."""
    if normalizer is not None and reduction != "sum":
        raise ValueError(f"normalizer: only used with reduction='sum' (reduction={reduction!r})")
    if reduction == "mean":
        valid = targets != ignore_index
        if class_weights is None:
            return 1.0 / max(int(valid.sum()), 1)
        total = class_weights[torch.where(valid, targets, 0)][valid].sum()  # Σ c_{y_i}, as F.cross_entropy
        return 1.0 / float(total) if float(total) != 0 else 1.0
    if reduction in ("sum", "none"):
        return 1.0 if normalizer is None else 1.0 / normalizer
    raise ValueError(f"reduction={reduction!r}: expected 'mean', 'sum' or 'none'")


def _chunk_rows(chunk_size: int | None, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                dtypes: tuple[torch.dtype, torch.dtype, torch.dtype], shard: VocabShard | None, label_smoothing: float) -> int:
    """The rows per chunk (`default_chunk_rows` when None), after checking it and `label_smoothing`."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r}: expected a number in [0, 1)")
    if chunk_size is None:
        staged = shard is None and staged_logits(hidden.device, dtypes[0], dtypes[1])
        return default_chunk_rows(weight.shape[0], targets.numel(), dtypes[0].itemsize if staged else 4)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: expected an integer >= 1 (token rows per chunk) or None (the default)")
    return chunk_size


def _checked_weights(token_weights: torch.Tensor | None, class_weights: torch.Tensor | None, z_loss: float,
                     targets: torch.Tensor, vocab: int, shard: VocabShard | None, device: torch.device):
    """`token_weights` flattened and `class_weights` on `device`, detached, after the checks."""
    where = "fused_linear_cross_entropy"
    if isinstance(z_loss, bool) or not isinstance(z_loss, (int, float)) or not z_loss >= 0.0 or z_loss == float("inf"):
        raise ValueError(f"{where}: z_loss={z_loss!r}: expected a finite number >= 0 (PaLM uses 1e-4)")
    if shard is not None and (token_weights is not None or class_weights is not None or z_loss):
        raise ValueError(f"{where}: token_weights, class_weights and z_loss are not supported with a vocabulary "
                         "shard (tensor-parallel loss); leave them unset there")
    for name, t, shape in (("token_weights", token_weights, tuple(targets.shape)), ("class_weights", class_weights, (vocab,))):
        if t is not None and (not t.dtype.is_floating_point or tuple(t.shape) != shape):
            raise ValueError(f"{where}: {name} must be a floating-point tensor of shape {shape} (like "
                             f"{'the targets' if name == 'token_weights' else 'the vocabulary'}), got {t.dtype} "
                             f"{tuple(t.shape)}")
    token = None if token_weights is None else token_weights.detach().reshape(-1).to(device)
    return token, None if class_weights is None else class_weights.detach().to(device)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_gates: RowGates | None = None,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    normalizer: float | torch.Tensor | None = None,
    chunk_size: int | None = None,
    label_smoothing: float = 0.0,
    token_weights: torch.Tensor | None = None,
    class_weights: torch.Tensor | None = None,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    shard: VocabShard | None = None,
    backward_twice: bool = False,
    logit_transform: LogitTransform | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``F.linear(hidden, weight, bias)`` against `targets`, fused and chunked.

        loss = Σ_{i: y_i ≠ ignore} t_i·[(1 − ε) c_{y_i}(lse_i − z_{i,y_i}) + (ε/V) Σ_k c_k (lse_i − z_ik) + λ·lse_i²] / D,
        z_i = T(W h_i + b),   lse_i = logsumexp(z_i),

    T = `logit_transform` (a soft-cap or scale, `LogitTransform`, dT/dz in every gradient; None:
    the identity); ε = `label_smoothing`, c = `class_weights` (V,) and the reductions as
    ``F.cross_entropy(weight=c, label_smoothing=ε)`` (c ≡ 1 when None); t = `token_weights`
    (targets' shape; constants that scale each row's loss and gradient; 1 when None); λ = `z_loss`
    (PaLM's auxiliary loss, 1e-4 there). D: ``reduction="mean"`` the non-ignored targets' Σ c_{y_i}
    (their number without class weights; 0 loss and gradients when there is none; token weights
    do not change D), ``"sum"`` `normalizer` (1 if None; torchtitan's ``global_valid_tokens``),
    ``"none"`` 1: each position's loss, 0 where ignored (its backward runs the chunks again).
    `return_z_loss`: also return the z-loss part (detached, for logging; already in the loss).
    Gradients: for `hidden` and `bias` those of the loss; for `weight` the gated
    ``(G ⊙ Γ)ᵀ X`` of `row_gates` (AGG's: docs/methods.md §1.5), as `aniso_plugins.gated_linear`, or
    the plain one when `row_gates` is None.

    Peak extra memory: one logits chunk (`chunk_size` × V; None: `default_chunk_rows`) beyond the
    gradients dW (V × d, at least float32) and dX; never N × V. The gradients of a mean or sum are
    computed in the forward (skipped when grad mode is off), so the backward may run once;
    `backward_twice`: a second one (retained graph) gets them again. Under autocast the three GEMMs
    take autocast-dtype operands, as autograd's; softmax, loss and dW are float32 (docs/performance.md
    §7.3). `weight`: the full (V, d) tensor, or with `shard` a vocabulary shard (module docstring)."""
    check_inputs(hidden, weight, targets, row_gates, ignore_index, "fused_linear_cross_entropy", shard)
    dtypes = compute_dtypes(hidden, weight)
    chunk_size = _chunk_rows(chunk_size, hidden, weight, targets, dtypes, shard, label_smoothing)
    token, classes = _checked_weights(token_weights, class_weights, z_loss, targets, weight.shape[0], shard, hidden.device)
    targets = index_targets(targets, hidden.device)
    scale = _loss_scale(targets, ignore_index, reduction, normalizer, classes)
    transform = None if logit_transform is None or logit_transform.identity else logit_transform
    options = _Options(ignore_index, scale, chunk_size, float(label_smoothing), dtypes, shard, transform, token, classes,
                       float(z_loss))
    gates = None if row_gates is None else row_gates.to(weight.device)
    if reduction == "none":
        loss, z_part = _PerTokenLinearCrossEntropy.apply(hidden, weight, bias, targets, gates, options)
    else:
        loss, z_part = _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, gates, options,
                                                      torch.is_grad_enabled(), backward_twice)
    return (loss, z_part) if return_z_loss else loss
