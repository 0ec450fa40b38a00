"""Fused linear + cross-entropy, `fused_linear_cross_entropy` (optionally label-smoothed, weighted,
z-loss, through a logit transform, and with a row-gated weight gradient, e.g. AGG's): never the
full N×V logits.

The loss and its gradients are computed in the forward over tiles of the logits (`passes`: row
chunks that hold the whole vocabulary, or every row × a block of ids with a second logits GEMM),
and the backward scales them by the incoming gradient (``reduction="none"``: the backward runs the
passes again with the incoming per-position gradient as token weights). By default
(`plan_tiles`) a tile takes the bytes of PyTorch's chunk of float32 logits (about the hidden
states'), so the peak extra memory is dW (V × d, at least float32) + dX + about N·d logits: the floor of PyTorch's
``F.linear_cross_entropy`` (docs/performance.md §11). ``chunk_size=1024`` (whole rows of 1024
tokens) takes one logits GEMM fewer where the default takes vocabulary blocks, for 1024·V logits
of memory.

Under ``torch.compile`` both run as `torch.library` custom ops (``aniso::fused_linear_cross_entropy``
and ``aniso::fused_linear_cross_entropy_rows``) with fake implementations and autograd formulas, so
``fullgraph=True`` keeps them whole; eagerly the same code runs op by op in an autograd Function
(visible to dispatch modes). Nothing in them, nor in the checks around them, reads a value back
to the host (the target range is checked on the device).

Vocabulary parallel (``shard``, tensor parallelism with loss parallel): `weight` and `bias` hold
the ids ``[shard.start, shard.stop)`` of ``shard.total``, and every rank of ``shard.group`` calls
the op with the same hidden states and global targets (and row gates). Each row chunk's
statistics are all-reduced over the group (the log-sum-exp: MAX then SUM; target logits and
logit sums: SUM), so the loss, identical on every rank, is the whole vocabulary's; dW and db are
the shard's rows and dX is the shard's part ``G_shard W_shard``, which the ranks sum
(torchtitan's sharding of the head's input does).
"""

from __future__ import annotations

import torch

from aniso_plugins.methods.fused_loss.gemm import check_inputs, compute_dtypes, index_targets
from aniso_plugins.methods.fused_loss.logit_transform import LogitTransform
from aniso_plugins.methods.fused_loss.passes import PassOptions, Plan, Shard, fused_pass, plan_tiles
from aniso_plugins.methods.fused_loss.row_gates import RowGates
from aniso_plugins.methods.fused_loss.token_outputs import FusedCrossEntropyOutput, checked_outputs
from aniso_plugins.methods.fused_loss.workspace import RowTerms, block_bytes
from aniso_plugins.numerics.distributed import VocabShard

__all__ = ["fused_linear_cross_entropy"]

_T = torch.Tensor


def _row_terms(targets: _T, ignore_index: int, token: _T | None, classes: _T | None, scale: _T, smoothing: float,
               z_loss: float, vocab: int, acc: torch.dtype) -> RowTerms:
    """The `RowTerms` of the flat `targets`: ω_i = [y_i ≠ ignore]·t_i·scale, c_{y_i}, C."""
    valid = targets != ignore_index
    weight = valid.to(acc) * scale.to(acc)
    if token is not None:
        weight = weight * token.to(acc)
    if classes is None:
        return RowTerms(weight, None, None, float(vocab), smoothing, vocab, z_loss)
    c = classes.to(acc)
    return RowTerms(weight, c[torch.where(valid, targets, 0)], c, c.sum(), smoothing, vocab, z_loss)


def _kernel(hidden: _T, weight: _T, bias: _T | None, targets: _T, g1: _T | None, g2: _T | None, rare: _T | None,
            g_target: _T | None, token: _T | None, classes: _T | None, scale: _T, ignore_index: int,
            smoothing: float, z_loss: float, transform: list[float], plan: list[int], compute: torch.dtype,
            shard: list[int] | None, group: str | None, wants: list[bool], tokens: bool):
    """The passes (`fused_pass`) of one call: (row losses, z-loss parts or None, dX, dW, db,
    the token statistics (4, N) and argmax (N,), both empty without `tokens`: `_token_rows`)."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    t = None if not transform else LogitTransform(transform[0], transform[1] if len(transform) > 1 else None)
    part = None if shard is None else Shard(*shard, _process_group(group))
    vocab = weight.shape[0] if shard is None else shard[2]
    terms = _row_terms(targets.reshape(-1), ignore_index, token, classes, scale, smoothing, z_loss, vocab, acc)
    gates = None if g1 is None else RowGates(g1, g2, rare, g_target)
    options = PassOptions(compute, acc, t, part, Plan(*plan), tuple(wants), tokens)
    losses, z_parts, dx, dw, db, rows = fused_pass(hidden, weight, bias, targets, terms, gates, options)
    dw = None if dw is None else dw.to(weight.dtype)
    db = None if db is None else db.to(bias.dtype)
    stats, argmax = _token_rows(rows, vocab, acc, hidden.device)
    return losses, z_parts, dx, dw, db, stats, argmax


TOKEN_STATS = ("lse", "entropy", "log_sum_sq_probs", "mean_logits")
"""The rows of the ops' token statistics output, in order (`_token_rows`)."""


def _token_rows(rows, vocab: int, acc: torch.dtype, device: torch.device) -> tuple[_T, _T]:
    """(`TOKEN_STATS` stacked (4, N): lse, H = lse − E_p[z'], log Σ_k p_k² = log Σ_k exp 2z'_k − 2·lse,
    Σ_k z'_k / V; argmax (N,)) of `fused_pass`'s token rows, or two empty tensors."""
    if rows is None:
        return torch.empty(0, dtype=acc, device=device), torch.empty(0, dtype=torch.int64, device=device)
    lse, t = rows
    return torch.stack([lse, lse - t.mean, t.squares - 2.0 * lse, t.total / vocab]), t.argmax


def _process_group(name: str | None):
    if name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _or_empty(t: _T | None, like: _T) -> _T:
    return like.new_empty(0) if t is None else t


def _sum_outputs(hidden: _T, weight: _T, *args) -> tuple[_T, _T, _T, _T, _T, _T, _T]:
    """Σ of the row losses and of their z-loss parts, (dX, dW, db) (empty where not wanted) and the
    token statistics and argmax in the targets' shape (empty without tokens, the last argument):
    the outputs of ``reduction="mean" | "sum"`` (backward_twice, the one before, unused here)."""
    losses, z_parts, dx, dw, db, stats, argmax = _kernel(hidden, weight, *args[:-2], args[-1])
    z_sum = torch.zeros((), dtype=losses.dtype, device=losses.device) if z_parts is None else z_parts.sum()
    shape = args[1].shape  # the targets'
    return (losses.sum(), z_sum, _or_empty(dx, hidden), _or_empty(dw, weight), _or_empty(db, weight),
            _shaped(stats, shape), _shaped(argmax, shape))


def _shaped(t: _T, shape: torch.Size) -> _T:
    """A token output in the targets' shape (behind its leading rows, for the stacked statistics)."""
    return t if t.numel() == 0 else t.reshape(*t.shape[:-1], *shape)


@torch.library.custom_op("aniso::fused_linear_cross_entropy", mutates_args=())
def _fused_sum(hidden: _T, weight: _T, bias: _T | None, targets: _T, g1: _T | None, g2: _T | None, rare: _T | None,
               g_target: _T | None, token: _T | None, classes: _T | None, scale: _T, ignore_index: int,
               smoothing: float, z_loss: float, transform: list[float], plan: list[int], compute: torch.dtype,
               shard: list[int] | None, group: str | None, wants: list[bool],
               backward_twice: bool, tokens: bool) -> tuple[_T, _T, _T, _T, _T, _T, _T]:
    """`_sum_outputs` as one op for ``torch.compile``."""
    return _sum_outputs(hidden, weight, bias, targets, g1, g2, rare, g_target, token, classes, scale, ignore_index,
                        smoothing, z_loss, transform, plan, compute, shard, group, wants, backward_twice, tokens)


@_fused_sum.register_fake
def _(hidden, weight, bias, targets, g1, g2, rare, g_target, token, classes, scale, ignore_index, smoothing, z_loss,
      transform, plan, compute, shard, group, wants, backward_twice, tokens):
    acc = torch.promote_types(weight.dtype, torch.float32)
    loss = hidden.new_empty((), dtype=acc)
    dx = hidden.new_empty(hidden.shape if wants[0] else (0,))
    dw = weight.new_empty(weight.shape if wants[1] else (0,))
    db = weight.new_empty(0) if not wants[2] or bias is None else bias.new_empty(bias.shape)
    return (loss, torch.empty_like(loss), dx, dw, db, *_fake_tokens(hidden, targets, acc, tokens))


def _fake_tokens(hidden: _T, targets: _T, acc: torch.dtype, tokens: bool) -> tuple[_T, _T]:
    if not tokens:
        return hidden.new_empty(0, dtype=acc), hidden.new_empty(0, dtype=torch.int64)
    return (hidden.new_empty((len(TOKEN_STATS), *targets.shape), dtype=acc),
            hidden.new_empty(targets.shape, dtype=torch.int64))


def _setup_sum(ctx, inputs, output) -> None:
    ctx.grads = output[2:5]
    ctx.wants, ctx.backward_twice, ctx.scaled_by = inputs[19], inputs[20], None
    ctx.set_materialize_grads(False)


def _backward_sum(ctx, grad, *_):
    """The gradients computed in the forward, scaled by `grad` in place. Handed over once (no
    reference kept, so autograd takes them without a copy), or with ``backward_twice`` kept for a
    second backward with the same `grad` (zero-bubble pipeline schedules run one for the inputs'
    and one for the weights' gradients)."""
    none = [None] * 22
    if grad is None:
        return tuple(none)
    grads = ctx.grads
    if grads is None:
        raise RuntimeError(
            "fused_linear_cross_entropy: backward can run once per forward (the gradients are computed in "
            "forward); pass backward_twice=True for a schedule that runs it twice"
        )
    if ctx.scaled_by is None:
        grads = tuple(g.mul_(grad.to(g.dtype)) if want else g for g, want in zip(grads, ctx.wants))
        ctx.scaled_by = grad.detach().clone()
    else:
        torch._assert_async((grad.detach() == ctx.scaled_by).all(), "fused_linear_cross_entropy: a second backward "
                            "with another output gradient than the first; the gradients are computed in forward and "
                            "scaled once")
    ctx.grads = grads if ctx.backward_twice else None
    none[:3] = (g if want else None for g, want in zip(grads, ctx.wants))
    return tuple(none)


_fused_sum.register_autograd(_backward_sum, setup_context=_setup_sum)


def _rows_outputs(hidden: _T, weight: _T, bias: _T | None, targets: _T, *args) -> tuple[_T, _T, _T, _T]:
    """Each position's loss and z-loss part (0 where ignored), in the out_dtype argument's dtype,
    the targets' shape, and the token statistics and argmax (empty without tokens, the last
    argument): the outputs of ``reduction="none"``."""
    out_dtype, tokens = args[-2], args[-1]
    losses, z_parts, _, _, _, stats, argmax = _kernel(hidden, weight, bias, targets, *args[:-2], [False, False, False],
                                                      tokens)
    z_parts = torch.zeros_like(losses) if z_parts is None else z_parts
    shape = targets.shape
    return (losses.to(out_dtype).reshape(shape), z_parts.to(out_dtype).reshape(shape), _shaped(stats, shape),
            _shaped(argmax, shape))


@torch.library.custom_op("aniso::fused_linear_cross_entropy_rows", mutates_args=())
def _fused_rows(hidden: _T, weight: _T, bias: _T | None, targets: _T, g1: _T | None, g2: _T | None, rare: _T | None,
                g_target: _T | None, token: _T | None, classes: _T | None, scale: _T, ignore_index: int,
                smoothing: float, z_loss: float, transform: list[float], plan: list[int],
                compute: torch.dtype, shard: list[int] | None, group: str | None, out_dtype: torch.dtype,
                tokens: bool) -> tuple[_T, _T, _T, _T]:
    """`_rows_outputs` as one op for ``torch.compile``."""
    return _rows_outputs(hidden, weight, bias, targets, g1, g2, rare, g_target, token, classes, scale, ignore_index,
                         smoothing, z_loss, transform, plan, compute, shard, group, out_dtype, tokens)


@_fused_rows.register_fake
def _(hidden, weight, bias, targets, g1, g2, rare, g_target, token, classes, scale, ignore_index, smoothing, z_loss,
      transform, plan, compute, shard, group, out_dtype, tokens):
    out = hidden.new_empty(targets.shape, dtype=out_dtype)
    return (out, torch.empty_like(out),
            *_fake_tokens(hidden, targets, torch.promote_types(weight.dtype, torch.float32), tokens))


def _setup_rows(ctx, inputs, output) -> None:
    ctx.save_for_backward(*(t for t in inputs[:11]))
    ctx.rest = inputs[11:19]
    ctx.set_materialize_grads(False)


def _backward_rows(ctx, grad, *_, run=None):
    """The passes again, with the incoming per-position gradient times the token weights as the
    token weights (one more logits GEMM per tile, as PyTorch's own chunked op does for 'none');
    `run`: the sum's outputs (its op by default). The token outputs have no gradient."""
    none = [None] * 21
    if grad is None:
        return tuple(none)
    saved = list(ctx.saved_tensors)
    upstream = grad.reshape(-1)
    saved[8] = upstream if saved[8] is None else upstream * saved[8]
    wants = [bool(w) for w in ctx.needs_input_grad[:3]]
    _, _, dx, dw, db, *_ = (run or torch.ops.aniso.fused_linear_cross_entropy)(*saved, *ctx.rest, wants, False, False)
    none[:3] = (g if want else None for g, want in zip((dx, dw, db), wants))
    return tuple(none)


_fused_rows.register_autograd(_backward_rows, setup_context=_setup_rows)


class _EagerSum(torch.autograd.Function):
    """The sum's op run eagerly (every aten op visible to dispatch modes): same outputs, same backward."""

    @staticmethod
    def forward(ctx, *args):
        out = _sum_outputs(*args)
        ctx.mark_non_differentiable(*out[1:])
        _setup_sum(ctx, args, out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return _backward_sum(ctx, *grads)


class _EagerRows(torch.autograd.Function):
    """The per-position op run eagerly; its backward runs `_sum_outputs` directly."""

    @staticmethod
    def forward(ctx, *args):
        out = _rows_outputs(*args)
        ctx.mark_non_differentiable(*out[1:])
        _setup_rows(ctx, args, out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, *_):
        return _backward_rows(ctx, grad, run=_sum_outputs)


def _loss_scale(targets: _T, ignore_index: int, reduction: str, normalizer, class_weights: _T | None,
                acc: torch.dtype) -> _T:
    """1 / D of `fused_linear_cross_entropy`'s loss (1 for ``reduction="none"``), a 0-dim tensor on
    the targets' device, computed there (no host read)."""
    if normalizer is not None and reduction != "sum":
        raise ValueError(f"normalizer: only used with reduction='sum' (reduction={reduction!r})")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: expected 'mean', 'sum' or 'none'")
    one = torch.ones((), dtype=acc, device=targets.device)
    if reduction == "mean":
        valid = targets != ignore_index
        if class_weights is None:
            return one / valid.sum().clamp_min(1).to(acc)
        total = (class_weights.to(acc)[torch.where(valid, targets, 0)] * valid).sum()  # Σ c_{y_i}, as F.cross_entropy
        return torch.where(total != 0, one / total, one)
    if normalizer is None:
        return one
    return one / torch.as_tensor(normalizer).to(targets.device, acc)


def _checked(chunk_size: int | None, vocab_chunk_size: int | None, label_smoothing: float, z_loss: float) -> None:
    """The scalar options' checks, with the value and the fix."""
    where = "fused_linear_cross_entropy"
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r}: expected a number in [0, 1)")
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}={value!r}: expected an integer >= 1 "
                             f"({'token rows' if name == 'chunk_size' else 'vocabulary ids'} per tile) or None (the default)")
    if isinstance(z_loss, bool) or not isinstance(z_loss, (int, float)) or not z_loss >= 0.0 or z_loss == float("inf"):
        raise ValueError(f"{where}: z_loss={z_loss!r}: expected a finite number >= 0 (PaLM uses 1e-4)")


def _checked_weights(token_weights: _T | None, class_weights: _T | None, z_loss: float, targets: _T, vocab: int,
                     shard: VocabShard | None, device: torch.device):
    """`token_weights` flattened and `class_weights` on `device`, detached, after the checks."""
    where = "fused_linear_cross_entropy"
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
    vocab_chunk_size: int | None = None,
    label_smoothing: float = 0.0,
    token_weights: torch.Tensor | None = None, class_weights: torch.Tensor | None = None, z_loss: float = 0.0,
    shard: VocabShard | None = None, backward_twice: bool = False, logit_transform: LogitTransform | None = None,
    return_z_loss: bool = False, return_lse: bool = False, return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False, token_outputs: tuple[str, ...] = (),
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | FusedCrossEntropyOutput:
    """Cross-entropy of ``F.linear(hidden, weight, bias)`` against `targets`, fused and tiled.

        loss = Σ_{i: y_i ≠ ignore} t_i·[(1 − ε) c_{y_i}(lse_i − z_{i,y_i}) + (ε/V) Σ_k c_k (lse_i − z_ik) + λ·lse_i²] / D,
        z_i = T(W h_i + b),   lse_i = logsumexp(z_i),

    T = `logit_transform` (a soft-cap or scale, `LogitTransform`, dT/dz in every gradient; None:
    the identity); ε = `label_smoothing`, c = `class_weights` (V,) and the reductions as
    ``F.cross_entropy(weight=c, label_smoothing=ε)`` (c ≡ 1 when None); t = `token_weights`
    (targets' shape; constants that scale each row's loss and gradient; 1 when None); λ = `z_loss`
    (PaLM's auxiliary loss, 1e-4 there). D: ``reduction="mean"`` the non-ignored targets' Σ c_{y_i}
    (their number without class weights; 0 loss and gradients when there is none; token weights
    do not change D), ``"sum"`` `normalizer` (1 if None; torchtitan's ``global_valid_tokens``),
    ``"none"`` 1: each position's loss, 0 where ignored (its backward runs the passes again).
    `return_z_loss`: also return the z-loss part (detached, for logging; already in the loss).
    `return_lse` (Cut Cross-Entropy's), `return_token_accuracy`, `return_predicted_tokens`
    (Liger-Kernel's) and `token_outputs` (TRL's `TOKEN_OUTPUTS`): a `FusedCrossEntropyOutput`
    with each token's outputs too, from the same passes over the tiles, without gradient.
    Gradients: for `hidden` and `bias` those of the loss; for `weight` the gated
    ``(G ⊙ Γ)ᵀ X`` of `row_gates` (AGG's: docs/methods.md §1.5), as `aniso_plugins.gated_linear`, or
    the plain one when `row_gates` is None.

    Tiles: `chunk_size` token rows × `vocab_chunk_size` ids of logits at a time (None: all); both
    None, `plan_tiles` (the module docstring). The gradients of a mean or sum are computed in the
    forward (skipped when grad mode is off), so the backward may run once; `backward_twice`: a
    second one (retained graph) gets them again. Under autocast the GEMMs take autocast-dtype
    operands, as autograd's; softmax, loss and dW are float32. `weight`: the full (V, d) tensor,
    or with `shard` a vocabulary shard (module docstring)."""
    check_inputs(hidden, weight, targets, row_gates, ignore_index, "fused_linear_cross_entropy", shard)
    tokens = checked_outputs(token_outputs, return_lse or return_token_accuracy or return_predicted_tokens, shard)
    _checked(chunk_size, vocab_chunk_size, label_smoothing, z_loss)
    token, classes = _checked_weights(token_weights, class_weights, z_loss, targets, weight.shape[0], shard, hidden.device)
    targets = index_targets(targets, hidden.device)
    args, logits_dtype = _op_args(hidden, weight, bias, targets, row_gates, token, classes, ignore_index, reduction,
                                  normalizer, (chunk_size, vocab_chunk_size), float(label_smoothing), float(z_loss),
                                  logit_transform, shard)
    loss, z_part, stats, argmax = _run(args, reduction, logits_dtype, backward_twice, tokens)
    if not tokens:
        return (loss, z_part.detach()) if return_z_loss else loss
    return FusedCrossEntropyOutput.of(loss, z_part, stats, argmax, targets, ignore_index, reduction,
                                      (return_z_loss, return_lse, return_token_accuracy, return_predicted_tokens), token_outputs)


def _op_args(hidden: _T, weight: _T, bias: _T | None, targets: _T, row_gates: RowGates | None, token: _T | None,
             classes: _T | None, ignore_index: int, reduction: str, normalizer, tiles: tuple[int | None, int | None],
             smoothing: float, z_loss: float, transform: LogitTransform | None,
             shard: VocabShard | None) -> tuple[tuple, torch.dtype]:
    """The ops' leading arguments (inputs, gates, weights, 1/D, options, tiles, dtype, shard) and the logits' dtype."""
    compute, acc, logits_dtype = compute_dtypes(hidden, weight)
    scale = _loss_scale(targets, ignore_index, reduction, normalizer, classes, acc)
    plan = list(plan_tiles(targets.numel(), weight.shape[0], weight.shape[1], *tiles, compute.itemsize,
                           block_bytes(hidden.device)))
    return (hidden, weight, bias, targets, *_gate_tensors(row_gates, weight.device), token, classes, scale, ignore_index,
            smoothing, z_loss, _transform_values(transform), plan, compute, *_shard_values(shard)), logits_dtype


def _run(args: tuple, reduction: str, logits_dtype: torch.dtype, backward_twice: bool,
         tokens: bool) -> tuple[_T, _T, _T, _T]:
    """The loss, its z-loss part, the token statistics and argmax (empty without `tokens`): the
    custom ops under ``torch.compile``, eagerly the same code op by op (`_EagerSum`, `_EagerRows`)."""
    compiling = torch.compiler.is_compiling()
    if reduction == "none":
        run = torch.ops.aniso.fused_linear_cross_entropy_rows if compiling else _EagerRows.apply
        return run(*args, logits_dtype, tokens)
    hidden, weight, bias = args[:3]
    grad = torch.is_grad_enabled()
    wants = [grad and hidden.requires_grad, grad and weight.requires_grad, grad and bias is not None and bias.requires_grad]
    run = torch.ops.aniso.fused_linear_cross_entropy if compiling else _EagerSum.apply
    loss, z_part, _, _, _, stats, argmax = run(*args, wants, backward_twice, tokens)
    return loss, z_part, stats, argmax


def _gate_tensors(gates: RowGates | None, device: torch.device) -> tuple:
    if gates is None:
        return None, None, None, None
    gates = gates.to(device)
    return gates.g1, gates.g2, gates.rare, gates.g_target


def _transform_values(transform: LogitTransform | None) -> list[float]:
    """The op's form of a logit transform: [] (none), [scale] or [scale, softcap]."""
    if transform is None or transform.identity:
        return []
    return [float(transform.scale)] + ([] if transform.softcap is None else [float(transform.softcap)])


def _shard_values(shard: VocabShard | None) -> tuple[list[int] | None, str | None]:
    """The op's form of a vocabulary shard: its bounds and its group's name."""
    if shard is None:
        return None, None
    return [shard.start, shard.stop, shard.total], None if shard.group is None else shard.group.group_name
