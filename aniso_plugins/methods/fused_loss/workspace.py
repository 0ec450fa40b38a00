"""The chunk buffers of `fused_linear_cross_entropy` and each chunk's logit gradient
D·G = (softmax(z') − onehot) ⊙ dz'/dz (with label smoothing, class and token weights, z-loss), computed
in place in float32 block by block: one row-local softmax kernel per block, never N × V."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from aniso_plugins.methods.fused_loss.logit_transform import LogitTransform
from aniso_plugins.numerics.distributed import VocabShard

__all__ = ["PLAIN", "RowTerms", "STAGE_BYTES", "VocabParallelWorkspace", "Workspace", "staged_logits"]


@dataclass(frozen=True)
class RowTerms:
    """The per-row parts of the loss beyond plain cross-entropy, for the rows of one chunk (or
    of the whole call: `chunk` slices them).

    token: t_i, each row's weight (None: 1); target_class: c_{y_i} of the class weights c
    (None: no class weights); classes: c itself (V,); total: C = Σ_k c_k; z_loss: λ.
    Row i's loss is t_i·[a_i·(−log p_{i,y_i}) + s_i + λ·lse_i²] with a_i = (1 − ε)·c_{y_i} + ε·C/V
    and s_i = (ε/V)·(C·z'_{i,y_i} − Σ_k c_k z'_ik); its logit gradient is
    D·G_i = t_i·[(a_i + 2λ·lse_i)·p_i − (1 − ε)·c_{y_i}·e_{y_i} − (ε/V)·c] (c ≡ 1: a_i = 1)."""

    token: torch.Tensor | None = None
    target_class: torch.Tensor | None = None
    classes: torch.Tensor | None = None
    total: float = 0.0
    z_loss: float = 0.0

    @property
    def plain(self) -> bool:
        """Whether the rows are plain (label-smoothed) cross-entropy: no weights, no z-loss."""
        return self.token is None and self.classes is None and not self.z_loss

    def chunk(self, s: int, e: int) -> RowTerms:
        """The terms of rows [s, e)."""
        return RowTerms(None if self.token is None else self.token[s:e],
                        None if self.target_class is None else self.target_class[s:e], self.classes, self.total, self.z_loss)

    def target_factor(self, smoothing: float) -> torch.Tensor | float:
        """(1 − ε)·c_{y_i}: the one-hot's factor in D·G_i before t_i."""
        return (1.0 - smoothing) if self.target_class is None else (1.0 - smoothing) * self.target_class

    def probability_factor(self, smoothing: float, vocab: int) -> torch.Tensor | float:
        """a_i = (1 − ε)·c_{y_i} + ε·C/V: the loss's factor on −log p_{i,y_i} and the gradient's on p_i."""
        if self.target_class is None:
            return 1.0
        return (1.0 - smoothing) * self.target_class + smoothing * self.total / vocab


PLAIN = RowTerms()


STAGE_BYTES = 8 * 2**20
"""float32 rows of one block of the bf16-logits gradient stage on the CPU (`Workspace.gradient`)."""


class Workspace:
    """The chunk buffers of one call, allocated once and reused by every chunk (views of their
    first rows for the last, shorter chunk). On the CPU a new tensor of tens of MiB is fresh
    pages from the OS, a cost per chunk that reuse avoids (docs/performance.md §7.3)."""

    def __init__(self, rows: int, v: int, d: int, compute: torch.dtype, acc: torch.dtype, device: torch.device,
                 dw_product: bool) -> None:
        self.acc = acc
        self.logits = torch.empty(rows, v, dtype=compute, device=device)
        # On the CPU, bf16 logits go through the float32 stage in blocks of rows that stay in cache
        self.on_cpu = device.type == "cpu"
        staged = staged_logits(device, compute, acc)
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
                 target_grad: torch.Tensor | None, db: torch.Tensor | None, smooth: torch.Tensor | None,
                 transform: LogitTransform | None = None, terms: RowTerms = PLAIN,
                 z_rows: torch.Tensor | None = None) -> torch.Tensor:
        """D·G = (softmax(z') − (1 − ε)·onehot(y) − ε/V) ⊙ dz'/dz for the logits chunk `z`, z' its
        `transform` (z itself when None), with the row `terms` (`RowTerms`), in the GEMM dtype (in
        place in the logits buffer on the CPU), computed in float32 block by block. Writes
        p_{i,y_i} into `row` (`row_losses` turns it into −log p), G's target entries into
        `target_grad`, the smoothing part s_i of the row loss into `smooth` and λ·lse_i² into
        `z_rows`, adds Σ_rows G into `db` (each None: not wanted)."""
        if transform is not None or not terms.plain:
            return self._general_gradient(z, yc, smoothing, row, target_grad, db, smooth, transform, terms, z_rows)
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

    def _general_gradient(self, z: torch.Tensor, yc: torch.Tensor, smoothing: float, row: torch.Tensor,
                          target_grad: torch.Tensor | None, db: torch.Tensor | None, smooth: torch.Tensor | None,
                          transform: LogitTransform | None, terms: RowTerms, z_rows: torch.Tensor | None) -> torch.Tensor:
        """`gradient` through `transform` and with `terms`, block by block in float32: z' and dz'/dz
        of the block, its smoothing and z-loss parts, softmax(z'), the row factors, then the chain
        rule before the target entries and Σ_rows G are taken. On the CPU in blocks of at most
        `STAGE_BYTES` of float32 rows: dz'/dz and the row temporaries are that small, not a chunk."""
        step = min(self.block, max(1, STAGE_BYTES // (4 * z.shape[1]))) if self.on_cpu else self.block
        for i in range(0, z.shape[0], step):
            zi, yi = z[i : i + step], yc[i : i + step]
            n = zi.shape[0]
            if zi.dtype == self.acc:
                zf = zi  # in place: the float32 chunk
            elif self.stage is not None:
                zf = self.stage[:n].copy_(zi)
            else:
                zf = zi.to(self.acc)
            derivative = None if transform is None else transform.apply_(zf)
            block = terms.chunk(i, i + n)
            lse = _block_scalars(zf, yi, smoothing, block, None if smooth is None else smooth[i : i + n],
                                 None if z_rows is None else z_rows[i : i + n])
            g = torch.ops.aten._softmax.out(zf, 1, False, out=zf) if self.on_cpu else torch.softmax(zf, 1)
            row[i : i + n] = g.gather(1, yi).squeeze(1)
            _weigh_rows_(g, yi, smoothing, block, lse)
            if transform is not None:
                transform.chain_(g, derivative)
            if target_grad is not None:
                target_grad[i : i + n] = g.gather(1, yi).squeeze(1)
            if db is not None:
                db.add_(g.sum(0))
            if g is not zi:
                zi.copy_(g)
        return z


def _block_scalars(zf: torch.Tensor, yi: torch.Tensor, smoothing: float, terms: RowTerms,
                   smooth: torch.Tensor | None, z_rows: torch.Tensor | None) -> torch.Tensor | None:
    """From the block's logits z' (before the softmax): the smoothing part s_i of each row's loss
    into `smooth`, λ·lse_i² into `z_rows`; returns lse_i where the z-loss needs it (else None)."""
    if smooth is not None:
        zy = zf.gather(1, yi).squeeze(1)
        if terms.classes is None:
            smooth.copy_(smoothing * (zy - zf.mean(1)))
        else:
            smooth.copy_((smoothing / zf.shape[1]) * (terms.total * zy - torch.mv(zf, terms.classes)))
    if not terms.z_loss:
        return None
    lse = torch.logsumexp(zf, 1)
    if z_rows is not None:
        z_rows.copy_(terms.z_loss * lse.square())
    return lse


def _weigh_rows_(g: torch.Tensor, yi: torch.Tensor, smoothing: float, terms: RowTerms, lse: torch.Tensor | None) -> None:
    """Turn the block's softmax p into D·G_i = t_i·[(a_i + 2λ·lse_i)·p_i − (1 − ε)·c_{y_i}·e_{y_i} − (ε/V)·c]
    in place (`RowTerms`)."""
    t = terms.token
    coef = terms.probability_factor(smoothing, g.shape[1])
    if lse is not None:
        coef = coef + 2.0 * terms.z_loss * lse
    if t is not None:
        coef = coef * t
    if isinstance(coef, torch.Tensor):
        g.mul_(coef[:, None])
    elif coef != 1.0:
        g.mul_(coef)
    if smoothing:
        weight = torch.ones_like(g[:, 0]) if t is None else t
        classes = torch.ones_like(g[0]) if terms.classes is None else terms.classes
        g.addr_(weight, classes, alpha=-smoothing / g.shape[1])
    target = terms.target_factor(smoothing)
    target = target * t if t is not None else target
    target = target[:, None] if isinstance(target, torch.Tensor) else torch.full_like(yi, target, dtype=g.dtype)
    g.scatter_add_(1, yi, -target.to(g.dtype))


class VocabParallelWorkspace(Workspace):
    """`Workspace` for a vocabulary shard (tensor parallelism, loss parallel): each chunk's
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
                 target_grad: torch.Tensor | None, db: torch.Tensor | None, smooth: torch.Tensor | None,
                 transform: LogitTransform | None = None, terms: RowTerms = PLAIN,
                 z_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`Workspace.gradient` over the shard's columns of G; writes −log p_{i,y_i} into `row`
        (identical on every shard) and G's target entries only where this shard holds y_i. Plain
        `terms` only (`fused_linear_cross_entropy` refuses the others with a shard)."""
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


def staged_logits(device: torch.device, compute: torch.dtype, acc: torch.dtype) -> bool:
    """Whether the logits chunk stays in the narrower GEMM dtype, with a float32 stage of a few
    rows (`Workspace`): bf16 logits on the CPU."""
    return device.type == "cpu" and compute != acc


