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

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aniso_plugins.methods.fused_loss.gemm import addmm_in_, check_inputs, compute_dtypes, index_targets
from aniso_plugins.methods.fused_loss.logit_transform import LogitTransform
from aniso_plugins.methods.fused_loss.row_gates import RowGates, row_gating
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


STAGE_BYTES = 8 * 2**20
"""float32 rows of one block of the bf16-logits gradient stage on the CPU (`_Workspace.gradient`)."""


class _Workspace:
    """The chunk buffers of one call, allocated once and reused by every chunk (views of their
    first rows for the last, shorter chunk). On the CPU a new tensor of tens of MiB is fresh
    pages from the OS, a cost per chunk that reuse avoids (docs/performance.md §7.3)."""

    def __init__(self, rows: int, v: int, d: int, compute: torch.dtype, acc: torch.dtype, device: torch.device,
                 dw_product: bool) -> None:
        self.acc = acc
        self.logits = torch.empty(rows, v, dtype=compute, device=device)
        # On the CPU, bf16 logits go through the float32 stage in blocks of rows that stay in cache
        self.on_cpu = device.type == "cpu"
        staged = _staged(device, compute, acc)
        self.block = max(1, STAGE_BYTES // (4 * v)) if staged else max(rows, 1)
        self.stage = torch.empty(min(self.block, rows), v, dtype=acc, device=device) if staged else None
        # Off the CPU each chunk's dW product is one (V, d) GEMM into this buffer (`addmm_in_`)
        self.product = (torch.empty(v, d, dtype=compute, device=device)
                        if dw_product and compute != acc and not self.on_cpu else None)

    def logits_of(self, xc: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out = self.logits[: xc.shape[0]]
        return torch.mm(xc, w.T, out=out) if b is None else torch.addmm(b, xc, w.T, out=out)

    def _softmax(self, z: torch.Tensor) -> torch.Tensor:
        """softmax over the rows of `z` in the accumulation dtype: one row-local kernel (each row
        is read while it is in cache) instead of separate max, subtract, exp, sum and divide
        passes. On the CPU in place (in the float32 stage for bf16 logits): the aten kernel
        writes each row after reading it (tests/test_fused_loss.py compares with float64);
        elsewhere torch.softmax's own output."""
        if not self.on_cpu:
            return torch.softmax(z, 1, dtype=self.acc)
        if self.stage is not None:
            z = self.stage[: z.shape[0]].copy_(z)
        return torch.ops.aten._softmax.out(z, 1, False, out=z)

    def gradient(self, z: torch.Tensor, yc: torch.Tensor, smoothing: float, row: torch.Tensor,
                 target_grad: torch.Tensor | None, db: torch.Tensor | None,
                 smooth: torch.Tensor | None, transform: LogitTransform | None = None) -> torch.Tensor:
        """D·G = (softmax(z') − (1 − ε)·onehot(y) − ε/V) ⊙ dz'/dz for the logits chunk `z`, z' its
        `transform` (z itself when None), in the GEMM dtype (in place in the logits buffer on the
        CPU), computed in float32 block by block. Writes p_{i,y_i} into `row` (`row_losses` turns
        it into −log p), G's target entries into `target_grad` and ε(z'_iy − mean_k z'_ik) into
        `smooth`, adds Σ_rows G into `db` (each None: not wanted)."""
        if transform is not None:
            return self._transformed_gradient(z, yc, smoothing, row, target_grad, db, smooth, transform)
        if smooth is not None:  # the smoothing part of the row loss, before the in-place softmax
            smooth.copy_(smoothing * (z.gather(1, yc).squeeze(1).to(self.acc) - z.mean(1, dtype=self.acc)))
        p_target = row
        for i in range(0, z.shape[0], self.block):
            zi, yi = z[i : i + self.block], yc[i : i + self.block]
            g = self._softmax(zi)
            p_target[i : i + zi.shape[0]] = g.gather(1, yi).squeeze(1)
            if smoothing:
                g.sub_(smoothing / zi.shape[1])
            g.scatter_add_(1, yi, torch.full_like(yi, smoothing - 1.0, dtype=g.dtype))
            if target_grad is not None:
                target_grad[i : i + zi.shape[0]] = g.gather(1, yi).squeeze(1)
            if db is not None:
                db.add_(g.sum(0))
            if g.dtype == z.dtype:
                z = g  # float32 logits: the gradient is the chunk itself (one block)
            elif self.stage is not None:
                zi.copy_(g)
            else:
                return g.to(z.dtype)  # off the CPU: one block, a new tensor
        return z

    def _transformed_gradient(self, z: torch.Tensor, yc: torch.Tensor, smoothing: float, row: torch.Tensor,
                              target_grad: torch.Tensor | None, db: torch.Tensor | None, smooth: torch.Tensor | None,
                              transform: LogitTransform) -> torch.Tensor:
        """`gradient` through `transform`, block by block in float32: z' and dz'/dz of the block,
        the smoothing term from z', softmax(z'), then the chain rule before the target entries and
        Σ_rows G are taken."""
        for i in range(0, z.shape[0], self.block):
            zi, yi = z[i : i + self.block], yc[i : i + self.block]
            n = zi.shape[0]
            if zi.dtype == self.acc:
                zf = zi  # in place: the float32 chunk
            elif self.stage is not None:
                zf = self.stage[:n].copy_(zi)
            else:
                zf = zi.to(self.acc)
            derivative = transform.apply_(zf)
            if smooth is not None:
                smooth[i : i + n] = smoothing * (zf.gather(1, yi).squeeze(1) - zf.mean(1))
            g = torch.ops.aten._softmax.out(zf, 1, False, out=zf) if self.on_cpu else torch.softmax(zf, 1)
            row[i : i + n] = g.gather(1, yi).squeeze(1)
            if smoothing:
                g.sub_(smoothing / zf.shape[1])
            g.scatter_add_(1, yi, torch.full_like(yi, smoothing - 1.0, dtype=g.dtype))
            transform.chain_(g, derivative)
            if target_grad is not None:
                target_grad[i : i + n] = g.gather(1, yi).squeeze(1)
            if db is not None:
                db.add_(g.sum(0))
            if g is not zi:
                zi.copy_(g)
        return z


class _VocabParallelWorkspace(_Workspace):
    """`_Workspace` for a vocabulary shard (tensor parallelism, loss parallel): each chunk's
    softmax over all V ids from this rank's logits of its ids, with two all-reduces of a few
    values per row over the shard group (the row maxima; then the sums of exp, the target
    logits and the logit sums), as Megatron-LM's vocabulary-parallel cross-entropy does for
    whole logits. The row losses log Σ exp − z_y come out of the same sums: no recomputation."""

    def __init__(self, rows: int, v: int, d: int, compute: torch.dtype, acc: torch.dtype, device: torch.device,
                 dw_product: bool, shard: VocabShard) -> None:
        super().__init__(rows, v, d, compute, acc, device, dw_product)
        self.shard = shard
        self.stage = None  # the float32 chunk below replaces the few-row stage
        self.work = torch.empty(rows, v, dtype=acc, device=device) if compute != acc else None

    def gradient(self, z: torch.Tensor, yc: torch.Tensor, smoothing: float, row: torch.Tensor,
                 target_grad: torch.Tensor | None, db: torch.Tensor | None,
                 smooth: torch.Tensor | None, transform: LogitTransform | None = None) -> torch.Tensor:
        """`_Workspace.gradient` over the shard's columns of G; writes −log p_{i,y_i} into `row`
        (identical on every shard) and G's target entries only where this shard holds y_i."""
        shard, group = self.shard, self.shard.group
        g = z if z.dtype == self.acc else self.work[: z.shape[0]].copy_(z)
        derivative = None if transform is None else transform.apply_(g)  # z' of the shard's columns
        y = yc.squeeze(1)
        owned = shard.owned(y)
        local = torch.where(owned, y - shard.start, 0)[:, None]
        peak = g.amax(1)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        g.sub_(peak[:, None])
        sums = torch.stack([torch.zeros_like(peak), torch.where(owned, g.gather(1, local).squeeze(1), 0.0), g.sum(1)])
        g.exp_()
        sums[0] = g.sum(1)
        dist.all_reduce(sums, group=group)  # Σ_k exp(z_k − m), z_y − m, Σ_k (z_k − m) over all V
        row.copy_(sums[0].log() - sums[1])
        if smooth is not None:  # ε(z_y − mean_k z_k): the shift by m cancels
            smooth.copy_(smoothing * (sums[1] - sums[2] / shard.total))
        g.div_(sums[0][:, None])
        if smoothing:
            g.sub_(smoothing / shard.total)
        g.scatter_add_(1, local, torch.where(owned, g.new_tensor(smoothing - 1.0), g.new_tensor(0.0))[:, None])  # in g's dtype
        if transform is not None:
            transform.chain_(g, derivative)
        if target_grad is not None:
            target_grad.copy_(torch.where(owned, g.gather(1, local).squeeze(1), 0.0))
        if db is not None:
            db.add_(g.sum(0))
        return g if g is z else z.copy_(g)


def _staged(device: torch.device, compute: torch.dtype, acc: torch.dtype) -> bool:
    """Whether the logits chunk stays in the narrower GEMM dtype, with a float32 stage of a few
    rows (`_Workspace`): bf16 logits on the CPU."""
    return device.type == "cpu" and compute != acc


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


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, gates, ignore_index, scale, chunk_size, smoothing, dtypes, grad_enabled,
                shard, backward_twice, transform):
        compute, acc, _ = dtypes
        v, d = weight.shape
        want_dx, want_dw, want_db = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        with torch.autocast(hidden.device.type, enabled=False):
            X = hidden.reshape(-1, d)
            y = targets.reshape(-1)
            rows, split, rg = _row_order(y, y != ignore_index, gates, acc, shard)
            n = rows.numel()
            ys = y[rows]
            w = weight.to(compute)
            b = None if bias is None else bias.to(compute)
            dx, dw, db = (torch.zeros(shape, dtype=dtype, device=X.device) if want else None for want, shape, dtype in
                          ((want_dx, X.shape, hidden.dtype), (want_dw, (v, d), acc), (want_db, (v,), acc)))
            tv = torch.empty(n, dtype=acc, device=X.device) if gates is not None and want_dw else None
            row = torch.empty(n, dtype=acc, device=X.device)  # p_{i,y_i}; −log p_{i,y_i} for a shard
            smooth = torch.empty(n, dtype=acc, device=X.device) if smoothing else None
            bounds = [(s, min(s + chunk_size, split)) for s in range(0, split, chunk_size)]
            bounds += [(s, min(s + chunk_size, n)) for s in range(split, n, chunk_size)]
            base_scaled = gates is None
            shape = (max((e - s for s, e in bounds), default=0), v, d, compute, acc, X.device, want_dw)
            space = _Workspace(*shape) if shard is None else _VocabParallelWorkspace(*shape, shard)
            if gates is not None:  # the 1/D goes into the gate multiplies, which touch dW and G_c anyway
                base_gate, other_gate = _scaled(rg.base, scale), _scaled(rg.other, scale)
            for s, e in bounds:
                if want_dw and not base_scaled and s >= split:
                    dw.mul_(base_gate[:, None])
                    base_scaled = True
                xc = X[rows[s:e]].to(compute)  # the chunk's rows only: no (N, d) copy of X
                yc = ys[s:e, None]
                z = space.logits_of(xc, w, b)
                # D·G_c, the chunk's logit gradient before the 1/D: that goes on the (rows, d) and
                # V-sized results, not on the chunk
                zc = space.gradient(z, yc, smoothing, row[s:e], None if tv is None else tv[s:e], db,
                                    None if smooth is None else smooth[s:e], transform)
                if want_dx:
                    dx[rows[s:e]] = _scaled(torch.mm(zc, w).to(hidden.dtype), scale)
                if want_dw:
                    gate = other_gate if gates is not None and s >= split else None
                    if gate is not None and zc.dtype == acc:
                        zc.mul_(gate)  # G ⊙ gate: the float32 chunk itself
                        gate = None
                    addmm_in_(dw, zc.T, xc, compute, space.product, gate)  # in bf16, diag(gate)·GᵀX
            space = z = zc = None  # free the chunk buffers before the row losses
            if db is not None:
                db = _scaled(db, scale)
            nll = row if shard is not None else _row_losses(row, X, rows, ys, w, b, compute, chunk_size, transform)
            loss = (nll if smooth is None else nll + smooth).sum() * scale
            if want_dw and gates is not None:
                if not base_scaled:
                    dw.mul_(base_gate[:, None])
                _add_target_rows(dw, _scaled(rg.target_fix[rows] * tv, scale), X, rows, rg.target_index[rows], chunk_size)
            elif want_dw and not _is_one(scale):
                dw.mul_(scale)
            if want_dx:
                dx = dx.reshape(hidden.shape)
        ctx.grads = (dx, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype))
        ctx.scaled_by, ctx.backward_twice = None, backward_twice
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
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
        return (*grads, None, None, None, None, None, None, None, None, None, None, None)


def _loss_scale(targets: torch.Tensor, ignore_index: int, reduction: str, normalizer) -> float | torch.Tensor:
    """1 / D of `fused_linear_cross_entropy`'s loss."""
    if reduction == "mean":
        if normalizer is not None:
            raise ValueError("normalizer: only used with reduction='sum' (mean divides by the non-ignored targets)")
        return 1.0 / max(int((targets != ignore_index).sum()), 1)
    if reduction == "sum":
        return 1.0 if normalizer is None else 1.0 / normalizer
    raise ValueError(f"reduction={reduction!r}: expected 'mean' or 'sum'")


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
    shard: VocabShard | None = None,
    backward_twice: bool = False,
    logit_transform: LogitTransform | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``F.linear(hidden, weight, bias)`` against `targets`, fused and chunked.

        loss = Σ_{i: y_i ≠ ignore} (logsumexp(z_i) − (1 − ε) z_{i,y_i} − ε mean_k z_ik) / D,   z_i = T(W h_i + b),

    T = `logit_transform` (a soft-cap or scale, `LogitTransform`, dT/dz in every gradient; None:
    the identity), ε = `label_smoothing` (as ``F.cross_entropy(label_smoothing=ε)`` and
    transformers' ``LabelSmoother``: (1 − ε)·CE + ε·mean_k(−log p_ik) per row), D = the number of non-ignored targets (``reduction="mean"``, as ``F.cross_entropy``; 0 loss
    and 0 gradients when there is none) or `normalizer` (``reduction="sum"``; 1 if None; pass
    torchtitan's ``global_valid_tokens`` here). Gradients: plain CE for `hidden` and `bias`;
    for `weight` the gated ``(G ⊙ Γ)ᵀ X`` of `row_gates` (AGG's: docs/methods.md §1.5), as
    `aniso_plugins.gated_linear`, or the plain one when `row_gates` is None (an ordinary fused
    linear CE).

    Peak extra memory: one logits chunk (`chunk_size` × V; `chunk_size` None: the rows of
    `default_chunk_rows`, at most 512 MiB) and its temporaries beyond the gradients dW (V × d,
    in at least float32) and dX; never N × V, and no (N, d) copy of `hidden`. The gradients are
    computed in the forward (skipped when grad mode is off, e.g. validation), so the backward may
    run once; `backward_twice`: a second one (retained graph) gets them again, for one more dX +
    dW. Under autocast all three GEMMs (logits, dX, dW) take autocast-dtype operands, as autograd's; the softmax, the loss and dW are float32 (on the CPU the bf16 logits chunk
    goes through a float32 stage of a few rows; elsewhere through a float32 copy), and each
    chunk's dW product, rounded to the autocast dtype, is added into dW (on the CPU in blocks of
    rows, elsewhere through one V × d buffer: `aniso_plugins.methods.fused_loss.gemm.addmm_in_`).
    `weight`: the full (V, d) tensor (under FSDP2 where the head is unsharded), or with `shard` a
    vocabulary shard of it (see the module docstring)."""
    check_inputs(hidden, weight, targets, row_gates, ignore_index, "fused_linear_cross_entropy", shard)
    dtypes = compute_dtypes(hidden, weight)
    if chunk_size is None:
        compute, acc, _ = dtypes
        staged = shard is None and _staged(hidden.device, compute, acc)
        chunk_size = default_chunk_rows(weight.shape[0], targets.numel(), compute.itemsize if staged else 4)
    elif not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(
            f"chunk_size={chunk_size!r}: expected an integer >= 1 (token rows per chunk) or None (the default)"
        )
    scale = _loss_scale(targets, ignore_index, reduction, normalizer)
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r}: expected a number in [0, 1)")
    gates = None if row_gates is None else row_gates.to(weight.device)
    targets = index_targets(targets, hidden.device)
    return _FusedLinearCrossEntropy.apply(
        hidden, weight, bias, targets, gates, ignore_index, scale, chunk_size, float(label_smoothing), dtypes,
        torch.is_grad_enabled(), shard, backward_twice, None if logit_transform is None or logit_transform.identity
        else logit_transform,
    )
