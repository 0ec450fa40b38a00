"""The tile arithmetic of `fused_linear_cross_entropy`: a tile holds the logits of some rows and
some vocabulary ids (`Tile`), and its float32 work is done in place, whole-tile, or in row blocks
of `STAGE_BYTES` where it needs a temporary or a float32 stage:

- statistics (`block_stats`): per row the maximum, Σ exp(z' − max), the target logit z'_{i,y_i}
  (where the tile holds y_i) and Σ_k c_k z'_k, from which the log-sum-exp of all ids is combined
  over tiles (and over vocabulary shards) without any (N, V) tensor;
- the logit gradient (`RowTerms.gradient_`): with the row's log-sum-exp known, p = exp(z' − lse)
  in place, then G_i = ω_i·H_i (`RowTerms`; ω_i = 0 on ignored rows) and the chain rule of the
  logit transform, while the block is in cache.

Nothing here selects rows by a mask or reads a value back to the host (docs/performance.md, "What
the GPU pays")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DEVICE_BLOCK_BYTES", "RowTerms", "STAGE_BYTES", "Tile", "block_stats", "block_bytes", "softmax_stats_",
           "token_stats"]

STAGE_BYTES = 4 * 2**20
"""float32 bytes of one row block of a tile's work where it needs a temporary of its size (the
transform's derivative, kept statistics) or a float32 stage (bf16 logits), on the CPU; without
either a tile's work is whole-tile ops (few, large: each op is a parallel region)."""
DEVICE_BLOCK_BYTES = 64 * 2**20
"""The same off the CPU (larger: each block is a few kernel launches)."""


def block_bytes(device: torch.device) -> int:
    """The work block of `device` (read at call time, so that a test may shrink `STAGE_BYTES`)."""
    return STAGE_BYTES if device.type == "cpu" else DEVICE_BLOCK_BYTES


@dataclass(frozen=True)
class RowTerms:
    """The per-row parts of the loss: the formula of a row's loss and logit gradient.

    weight: ω_i = [y_i ≠ ignore]·t_i/D (N,) (t the token weights, D the normalizer);
    target_class: c_{y_i} of the class weights c (None: no class weights); classes: c (V,);
    total: C = Σ_k c_k (a 0-dim tensor; V without class weights); smoothing ε; vocab V; z_loss λ.

        loss_i = ω_i·[a_i·(lse_i − z'_{i,y_i}) + (ε/V)·(C·z'_{i,y_i} − Σ_k c_k z'_ik) + λ·lse_i²],
        G_i = ω_i·H_i,   H_i = (a_i + 2λ·lse_i)·p_i − (ε/V)·c − (1 − ε)·c_{y_i}·e_{y_i},

    a_i = (1 − ε)·c_{y_i} + ε·C/V (1 without class weights), p_i = exp(z'_i − lse_i), z'_i the
    transformed logits; times dz'/dz for the logits' own gradient."""

    weight: torch.Tensor
    target_class: torch.Tensor | None = None
    classes: torch.Tensor | None = None
    total: torch.Tensor | float = 0.0
    smoothing: float = 0.0
    vocab: int = 1
    z_loss: float = 0.0

    def rows(self, s: int, e: int) -> RowTerms:
        """The terms of rows [s, e)."""
        part = None if self.target_class is None else self.target_class[s:e]
        return RowTerms(self.weight[s:e], part, self.classes, self.total, self.smoothing, self.vocab, self.z_loss)

    def loss_factor(self) -> torch.Tensor | float:
        """a_i = (1 − ε)·c_{y_i} + ε·C/V (1 without class weights)."""
        eps = self.smoothing
        return 1.0 if self.target_class is None else (1.0 - eps) * self.target_class + eps * self.total / self.vocab

    def probability_factor(self, lse: torch.Tensor) -> torch.Tensor | float:
        """a_i + 2λ·lse_i: H's factor on p_i."""
        return self.loss_factor() + (2.0 * self.z_loss) * lse if self.z_loss else self.loss_factor()

    def target_factor(self) -> torch.Tensor | float:
        """(1 − ε)·c_{y_i}: H's one-hot factor."""
        return 1.0 - self.smoothing if self.target_class is None else (1.0 - self.smoothing) * self.target_class

    def gradient_(self, p: torch.Tensor, lse: torch.Tensor, local: torch.Tensor, owned: torch.Tensor,
                  columns: slice) -> torch.Tensor:
        """Turn the probabilities `p` of a block of rows (these terms' rows) and of the vocabulary
        ids `columns` into H in place (G = ω ⊙ H: the caller applies ω); `local`: each row's target
        column in the block (valid where `owned`)."""
        coef = self.probability_factor(lse)
        if isinstance(coef, torch.Tensor):
            p.mul_(coef[:, None])
        if self.smoothing and self.classes is None:
            p.sub_(self.smoothing / self.vocab)
        elif self.smoothing:
            p.sub_(self.classes[columns][None, :], alpha=self.smoothing / self.vocab)
        target = self.target_factor()
        target = target * owned if isinstance(target, torch.Tensor) else owned.to(p.dtype) * target
        return p.scatter_add_(1, local[:, None], target.neg().to(p.dtype)[:, None])

    def losses(self, lse: torch.Tensor, target_logit: torch.Tensor,
               logit_sum: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's loss and its z-loss part (None without z-loss); 0 wherever ω_i = 0 (also
        when an ignored row's logits are not finite)."""
        eps = self.smoothing
        value = self.loss_factor() * (lse - target_logit)
        if eps:
            value = value + (eps / self.vocab) * (self.total * target_logit - logit_sum)
        z_part = self.z_loss * lse.square() if self.z_loss else None
        if z_part is not None:
            value = value + z_part
        kept = self.weight != 0
        z_part = None if z_part is None else torch.where(kept, self.weight * z_part, 0.0)
        return torch.where(kept, self.weight * value, 0.0), z_part


class Tile:
    """The logits buffer of one tile (rows × ids in the GEMM dtype), reused by every tile of a
    call (a contiguous view of its first elements for a smaller one), and its float32 work: in
    place where the logits are float32 (in row blocks of `block_bytes` where a temporary is
    needed), through a stage of `block_bytes` where they are not (bf16 logits). The block is
    `STAGE_BYTES` on the CPU, `DEVICE_BLOCK_BYTES` elsewhere, or less (`plan_tiles`).
    `transposed`: the logits are held ids-major (the transpose of a contiguous ids × rows block;
    `passes.TRANSPOSED_ROWS`), for float32 tiles worked whole."""

    def __init__(self, rows: int, cols: int, compute: torch.dtype, acc: torch.dtype, device: torch.device,
                 block_bytes: int, transposed: bool = False) -> None:
        self.acc = acc
        self.transposed = transposed
        self.buffer = torch.empty(rows * cols, dtype=compute, device=device)
        self.staged = compute != acc
        self.block = max(1, block_bytes // (4 * max(cols, 1)))
        self.stage = torch.empty(min(self.block, rows) * cols, dtype=acc, device=device) if self.staged else None

    def logits(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x wᵀ (+ b) into the buffer: (rows of x) × (rows of w); `transposed`: computed as w xᵀ,
        the transpose of a contiguous (rows of w) × (rows of x) block."""
        if self.transposed:
            out = self.buffer[: x.shape[0] * w.shape[0]].view(w.shape[0], x.shape[0])
            z = torch.mm(w, x.T, out=out) if b is None else torch.addmm(b[:, None], w, x.T, out=out)
            return z.T
        out = self.buffer[: x.shape[0] * w.shape[0]].view(x.shape[0], w.shape[0])
        return torch.mm(x, w.T, out=out) if b is None else torch.addmm(b, x, w.T, out=out)

    def blocks(self, z: torch.Tensor, temporaries: bool):
        """(start, float32 work block) over the rows of the tile `z` (the whole tile at once where it
        is float32 and the work needs no temporary of its size); `store` writes a block back."""
        step = self.block if self.staged or temporaries else max(z.shape[0], 1)
        for i in range(0, z.shape[0], step):
            part = z[i : i + step]
            if self.staged:
                yield i, self.stage[: part.numel()].view(part.shape).copy_(part)
            else:
                yield i, part

    def store(self, z: torch.Tensor, i: int, work: torch.Tensor) -> None:
        if self.staged:
            z[i : i + work.shape[0]].copy_(work)


def block_stats(w: torch.Tensor, local: torch.Tensor, owned: torch.Tensor, classes: torch.Tensor | None,
                want_sum: bool, keep: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log Σ_k exp z'_ik, z'_{i,y_i} where owned else 0, Σ_k c_k z'_ik or None) over the block's
    ids, from its float32 logits `w`: unchanged with `keep` (one temporary of its size), else
    overwritten by exp(z' − max)."""
    target = torch.where(owned, w.gather(1, local[:, None]).squeeze(1), 0.0)
    total = None if not want_sum else (w.sum(1) if classes is None else torch.mv(w, classes))
    peak = w.amax(1)
    shifted = torch.sub(w, peak[:, None]) if keep else w.sub_(peak[:, None])
    return shifted.exp_().sum(1).log_().add_(peak), target, total


def token_stats(w: torch.Tensor, first_id: int, local: torch.Tensor, owned: torch.Tensor, classes: torch.Tensor | None,
                want_sum: bool, keep: bool) -> tuple[tuple, tuple]:
    """`block_stats` and, beside them, the statistics from which each token's outputs are combined
    over blocks (`passes.TokenRows`): (E_p[z'] = Σ_k p_k z'_k under the block's softmax,
    log Σ_k exp 2z'_k, max_k z'_k, the first id of that maximum (ids ``first_id`` on), Σ_k z'_k),
    in one pass over the block's float32 logits `w`: unchanged with `keep` (two temporaries of its
    size), else overwritten by z' − max (one)."""
    target = torch.where(owned, w.gather(1, local[:, None]).squeeze(1), 0.0)
    total = w.sum(1)
    weighted = None if not want_sum else (total if classes is None else torch.mv(w, classes))
    at = w.argmax(1)
    peak = w.gather(1, at[:, None]).squeeze(1)
    shifted = torch.sub(w, peak[:, None]) if keep else w.sub_(peak[:, None])
    e = shifted.exp()
    mass = e.sum(1)
    mean = torch.linalg.vecdot(e, shifted, dim=1).div_(mass).add_(peak)
    squares = torch.linalg.vector_norm(e, dim=1).log_().add_(peak).mul_(2.0)
    return (mass.log_().add_(peak), target, weighted), (mean, squares, peak, at + first_id, total)


def softmax_stats_(w: torch.Tensor, local: torch.Tensor, owned: torch.Tensor, classes: torch.Tensor | None,
                   want_sum: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`block_stats` for a block that holds every id of its rows, turning `w` into softmax(w) in
    place with one row-local kernel (CPU; an ids-major block's rows are its columns, which the kernel
    reduces along the contiguous dimension): lse_i = max_k z'_ik − log p_{i,argmax}."""
    target = torch.where(owned, w.gather(1, local[:, None]).squeeze(1), 0.0)
    total = None if not want_sum else (w.sum(1) if classes is None else torch.mv(w, classes))
    peak, at = w.max(1)
    if w.T.is_contiguous() and not w.is_contiguous():
        torch.ops.aten._softmax.out(w.T, 0, False, out=w.T)
    else:
        torch.ops.aten._softmax.out(w, 1, False, out=w)
    lse = peak - w.gather(1, at[:, None]).squeeze(1).log()
    return lse, target, total

