"""`fused_linear_cross_entropy`'s per-token output, token weights, class weights and z-loss against
an independent float64 reference: ``F.cross_entropy`` of the explicit logits (its ``weight=`` and
``label_smoothing=``), the z-loss λ·logsumexp(z)² written out, and autograd through both."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aniso_plugins import LogitTransform, RowGates, fused_linear_cross_entropy, gated_linear
from aniso_plugins.methods.fused_loss import workspace
from aniso_plugins.numerics.distributed import VocabShard

V, D = 13, 6


def _inputs(seed=0, dtype=torch.float64, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, 9, D, dtype=dtype, generator=g, requires_grad=True)
    w = (torch.randn(V, D, dtype=dtype, generator=g) * 0.8).requires_grad_()
    b = torch.randn(V, dtype=dtype, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, V, (3, 9), generator=g)
    y[0, :4] = -100
    y[2, -1] = -100
    return h, w, b, y, g


def _reference(h, w, b, y, *, reduction="mean", smoothing=0.0, classes=None, tokens=None, z_loss=0.0, transform=None):
    """F.cross_entropy of the float64 logits, times the token weights, plus λ·lse² per row."""
    z = F.linear(h, w, b).reshape(-1, V)
    z = z if transform is None else transform(z)
    yf = y.reshape(-1)
    valid = yf != -100
    rows = F.cross_entropy(z, yf, weight=classes, label_smoothing=smoothing, reduction="none")
    zrows = z_loss * torch.logsumexp(z, 1).square() * valid
    t = torch.ones_like(rows) if tokens is None else tokens.reshape(-1)
    rows, zrows = rows * t, zrows * t
    if reduction == "none":
        return (rows + zrows).reshape(y.shape), zrows.reshape(y.shape)
    d = valid.sum() if classes is None else classes[yf[valid]].sum()
    d = d if reduction == "mean" else 1.0
    return (rows.sum() + zrows.sum()) / d, zrows.sum() / d


def _grads(loss, params):
    return torch.autograd.grad(loss, [p for p in params if p is not None])


def _close(got, ref, tol=1e-10):
    assert got.shape == ref.shape
    assert float((got - ref).abs().max()) <= tol * max(1.0, float(ref.abs().max())), (got, ref)


@pytest.mark.parametrize("smoothing", [0.0, 0.15])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_class_weights_equal_f_cross_entropy_weight(reduction, smoothing):
    h, w, b, y, g = _inputs()
    c = torch.rand(V, dtype=torch.float64, generator=g) * 2
    got = fused_linear_cross_entropy(h, w, y, bias=b, class_weights=c, label_smoothing=smoothing, reduction=reduction,
                                     chunk_size=5)
    ref, _ = _reference(h, w, b, y, reduction=reduction, smoothing=smoothing, classes=c)
    _close(got, ref)
    for a, r in zip(_grads(got, (h, w, b)), _grads(ref, (h, w, b))):
        _close(a, r)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_token_weights_scale_each_rows_loss_and_gradient(smoothing):
    h, w, b, y, g = _inputs(1)
    t = torch.rand(y.shape, dtype=torch.float64, generator=g) * 3
    got = fused_linear_cross_entropy(h, w, y, bias=b, token_weights=t, label_smoothing=smoothing, chunk_size=4)
    ref, _ = _reference(h, w, b, y, smoothing=smoothing, tokens=t)
    _close(got, ref)
    for a, r in zip(_grads(got, (h, w, b)), _grads(ref, (h, w, b))):
        _close(a, r)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_z_loss_is_in_the_loss_and_returned_for_logging(reduction):
    h, w, b, y, _ = _inputs(2)
    got, z_part = fused_linear_cross_entropy(h, w, y, bias=b, z_loss=1e-2, return_z_loss=True, reduction=reduction,
                                             chunk_size=7)
    ref, z_ref = _reference(h, w, b, y, reduction=reduction, z_loss=1e-2)
    _close(got, ref)
    _close(z_part, z_ref)
    assert not z_part.requires_grad and float(z_ref.abs().sum()) > 1e-3  # the z-loss is not negligible here
    upstream = torch.linspace(0.5, 2.0, y.numel(), dtype=torch.float64).reshape(y.shape) if reduction == "none" else 1.0
    for a, r in zip(_grads((got * upstream).sum(), (h, w, b)), _grads((ref * upstream).sum(), (h, w, b))):
        _close(a, r)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_reduction_none_equals_f_cross_entropy_per_position_with_any_upstream_gradient(smoothing):
    h, w, b, y, g = _inputs(3)
    c = torch.rand(V, dtype=torch.float64, generator=g) + 0.5
    t = torch.rand(y.shape, dtype=torch.float64, generator=g)
    got = fused_linear_cross_entropy(h, w, y, bias=b, reduction="none", label_smoothing=smoothing, class_weights=c,
                                     token_weights=t, chunk_size=3)
    ref, _ = _reference(h, w, b, y, reduction="none", smoothing=smoothing, classes=c, tokens=t)
    _close(got, ref)
    assert float(got[0, :4].abs().max()) == 0.0  # ignored positions: 0, as F.cross_entropy
    u = torch.randn(y.shape, dtype=torch.float64, generator=g)
    for a, r in zip(_grads((got * u).sum(), (h, w, b)), _grads((ref * u).sum(), (h, w, b))):
        _close(a, r)


@pytest.mark.parametrize("block_rows", [None, 2])
def test_every_option_at_once_through_a_soft_cap(block_rows, monkeypatch):
    if block_rows:  # the CPU's row blocks of the logit gradient: 2 rows each instead of the whole chunk
        monkeypatch.setattr(workspace, "STAGE_BYTES", 8 * V * block_rows)
    h, w, b, y, g = _inputs(4)
    h = (h.detach() * 3).requires_grad_()  # logits beyond the cap's linear range
    c = torch.rand(V, dtype=torch.float64, generator=g) + 0.5
    t = torch.rand(y.shape, dtype=torch.float64, generator=g)
    cap = LogitTransform(scale=0.7, softcap=4.0)
    got = fused_linear_cross_entropy(h, w, y, bias=b, label_smoothing=0.1, class_weights=c, token_weights=t,
                                     z_loss=1e-3, logit_transform=cap, chunk_size=5)
    ref, _ = _reference(h, w, b, y, smoothing=0.1, classes=c, tokens=t, z_loss=1e-3, transform=cap)
    _close(got, ref)
    for a, r in zip(_grads(got, (h, w, b)), _grads(ref, (h, w, b))):
        _close(a, r)


def test_token_weights_compose_with_row_gates():
    """AGG's gates on dW and token weights on every row: the reference is `gated_linear`'s logits
    (the gates in its backward) under the weighted float64 cross-entropy."""
    h, w, b, y, g = _inputs(5)
    t = torch.rand(y.shape, dtype=torch.float64, generator=g)
    rare = torch.zeros(V, dtype=torch.bool)
    rare[:4] = True
    gates = RowGates(torch.rand(V, generator=g), torch.rand(V, generator=g), rare, torch.rand(V, generator=g))
    got = fused_linear_cross_entropy(h, w, y, gates, bias=b, token_weights=t, z_loss=1e-2, chunk_size=4)
    z = gated_linear(h, w, y, gates, bias=b).reshape(-1, V)
    yf = y.reshape(-1)
    valid = yf != -100
    rows = (F.cross_entropy(z, yf, reduction="none") + 1e-2 * torch.logsumexp(z, 1).square() * valid) * t.reshape(-1)
    ref = rows.sum() / valid.sum()
    _close(got, ref)
    for a, r in zip(_grads(got, (h, w, b)), _grads(ref, (h, w, b))):
        _close(a, r)


def test_bf16_autocast_options_match_float64_within_bf16_rounding():
    h, w, b, y, g = _inputs(6, dtype=torch.float32)
    c = torch.rand(V, generator=g) + 0.5
    t = torch.rand(y.shape, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_cross_entropy(h, w, y, bias=b, class_weights=c, token_weights=t, z_loss=1e-3,
                                         label_smoothing=0.1)
    got_grads = _grads(got, (h, w, b))
    hd, wd, bd = (x.detach().double().requires_grad_() for x in (h, w, b))
    ref, _ = _reference(hd, wd, bd, y, smoothing=0.1, classes=c.double(), tokens=t.double(), z_loss=1e-3)
    assert got.dtype == torch.float32 and abs(float(got) - float(ref)) < 2e-2 * float(ref)
    for a, r in zip(got_grads, _grads(ref, (hd, wd, bd))):
        assert float((a.double() - r).norm() / r.norm()) < 2e-2


def test_the_options_are_checked_with_the_value_and_the_fix():
    h, w, b, y, _ = _inputs()
    with pytest.raises(ValueError, match=r"token_weights must be a floating-point tensor of shape \(3, 9\)"):
        fused_linear_cross_entropy(h, w, y, token_weights=torch.ones(27, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"class_weights must be a floating-point tensor of shape \(13,\)"):
        fused_linear_cross_entropy(h, w, y, class_weights=torch.ones(V, dtype=torch.long))
    with pytest.raises(ValueError, match=r"z_loss=-1.0: expected a finite number >= 0"):
        fused_linear_cross_entropy(h, w, y, z_loss=-1.0)
    with pytest.raises(ValueError, match="reduction='avg': expected 'mean', 'sum' or 'none'"):
        fused_linear_cross_entropy(h, w, y, reduction="avg")
    with pytest.raises(ValueError, match="not supported with a vocabulary shard"):
        fused_linear_cross_entropy(h, w[:7], y.clamp(min=0), z_loss=1e-4, shard=VocabShard(0, 7, V, None))
