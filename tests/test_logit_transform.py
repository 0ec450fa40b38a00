"""The fused loss through a logit transform (`LogitTransform`: Gemma's soft-cap c·tanh(s·z/c),
Cohere's / Granite's / Falcon-H1's scale s·z), against float64 references written out here:
``F.cross_entropy`` of the transformed full logits and autograd; AGG's gated weight gradient
through `gated_linear` followed by the transform. Several chunks, ignored rows, label smoothing,
a bias, rows far below their maximum, bf16 autocast, and the vocabulary-parallel shard on 2 gloo
ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed

from aniso_plugins import LogitTransform, agg_gates, fused_linear_cross_entropy, gated_linear

V, D, N = 37, 8, 60
TRANSFORMS = {
    "softcap": LogitTransform(softcap=3.0),  # logits of a few units: tanh far from linear
    "softcap_scaled": LogitTransform(scale=0.5, softcap=2.0),
    "scale": LogitTransform(scale=1 / 3),  # Granite's logits / logits_scaling
}


def _data():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, N // 2, D, generator=g, dtype=torch.float64) * 2
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (2, N // 2), generator=g)
    y[1, :5] = -100
    appearance = torch.rand(V, generator=g, dtype=torch.float64)
    return h, w, b, y, appearance


def _reference(transform: LogitTransform, smoothing: float, gated: bool):
    """(loss, dh, dW, db) in float64: the cross-entropy of T(h Wᵀ + b), through `gated_linear`
    (AGG's gates on dW) when `gated`."""
    h, w, b, y, appearance = _data()
    h, w, b = (t.clone().requires_grad_() for t in (h, w, b))
    if gated:
        z = gated_linear(h, w, y, agg_gates(appearance, 0.3))
    else:
        z = F.linear(h, w, b)
    softcap, scale = transform.softcap, transform.scale
    zt = torch.tanh(z * scale / softcap) * softcap if softcap is not None else z * scale  # written out, not the class
    loss = F.cross_entropy(zt.reshape(-1, V), y.reshape(-1), label_smoothing=smoothing)
    return (loss, *torch.autograd.grad(loss, (h, w, b), allow_unused=True))


@pytest.mark.parametrize("tiles", [dict(chunk_size=7), dict(vocab_chunk_size=8), dict(chunk_size=7, vocab_chunk_size=8)],
                         ids=["rows", "vocabulary_blocks", "both"])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "agg"])
def test_fused_loss_through_a_logit_transform_equals_float64(name, smoothing, gated, tiles):
    transform = TRANSFORMS[name]
    loss, dh, dw, db = _reference(transform, smoothing, gated)
    h, w, b, y, appearance = _data()
    h, w, b = (t.clone().requires_grad_() for t in (h, w, b))
    gates = agg_gates(appearance, 0.3) if gated else None
    got = fused_linear_cross_entropy(h, w, y, gates, bias=None if gated else b, label_smoothing=smoothing,
                                     logit_transform=transform, **tiles)  # fmt: skip
    torch.testing.assert_close(got, loss, rtol=1e-12, atol=1e-14)
    grads = torch.autograd.grad(got, (h, w) if gated else (h, w, b))
    for ours, want in zip(grads, (dh, dw) if gated else (dh, dw, db)):
        torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-13)


def test_the_transform_changes_the_loss_and_identity_is_the_plain_loss():
    """The transform is not silently dropped, and scale 1 without a cap is the plain loss."""
    h, w, b, y, _ = _data()
    plain = fused_linear_cross_entropy(h, w, y, bias=b)
    capped = fused_linear_cross_entropy(h, w, y, bias=b, logit_transform=TRANSFORMS["softcap"])
    assert abs(float(capped - plain)) > 1e-2
    assert float(fused_linear_cross_entropy(h, w, y, bias=b, logit_transform=LogitTransform())) == float(plain)


def test_rows_far_below_their_maximum_keep_a_finite_exact_loss():
    """A scale that puts a target hundreds of nats below its row's maximum (p underflows float32):
    the row's loss is recomputed from its transformed logits, equal to float64."""
    transform = LogitTransform(scale=40.0)
    h, w, b, y, _ = _data()
    loss, dh, dw, db = _reference(transform, 0.0, False)
    got = fused_linear_cross_entropy(h.float(), w.float(), y, bias=b.float(), chunk_size=7, logit_transform=transform)
    assert torch.isfinite(got) and float(loss) > 50
    torch.testing.assert_close(got.double(), loss.detach(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["softcap", "scale"])
def test_bf16_autocast_on_the_cpu_stage(name):
    """Under bf16 autocast the GEMMs take bf16 operands and the transform, softmax and loss run in
    float32 (the CPU's few-row stage): within bf16 rounding of float64."""
    transform = TRANSFORMS[name]
    loss, dh, dw, db = _reference(transform, 0.0, False)
    h, w, b, y, _ = _data()
    h, w, b = (t.float().requires_grad_() for t in (h, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_cross_entropy(h, w, y, bias=b, chunk_size=7, logit_transform=transform)
    grads = torch.autograd.grad(got, (h, w, b))
    torch.testing.assert_close(got.double(), loss.detach(), rtol=2e-2, atol=0)
    for ours, want in zip(grads, (dh, dw, db)):
        torch.testing.assert_close(ours.double(), want, rtol=5e-2, atol=5e-3)


def _shard_worker(rank: int, world: int, name: str, gated: bool, tiles: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from aniso_plugins.numerics.distributed import VocabShard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    shard = VocabShard.of(mesh, V)
    h, w, b, y, appearance = _data()
    h = h.clone().requires_grad_()
    w_local = w[shard.start : shard.stop].clone().requires_grad_()
    b_local = b[shard.start : shard.stop].clone().requires_grad_()
    gates = agg_gates(appearance, 0.3) if gated else None
    loss = fused_linear_cross_entropy(h, w_local, y, gates, bias=None if gated else b_local, label_smoothing=0.1,
                                      shard=shard, logit_transform=TRANSFORMS[name], **tiles)  # fmt: skip
    grads = torch.autograd.grad(loss, (h, w_local) if gated else (h, w_local, b_local))
    return {"loss": loss.detach(), "grads": [g.detach() for g in grads], "rows": (shard.start, shard.stop)}


@pytest.mark.slow
@pytest.mark.parametrize("tiles", [dict(chunk_size=7), dict(vocab_chunk_size=6)], ids=["rows", "vocabulary_blocks"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "agg"])
def test_vocabulary_parallel_shard_through_a_soft_cap(gated, tiles):
    """Each of 2 ranks holds a vocabulary shard: the loss equals the whole vocabulary's on both,
    the shards' dW rows stacked and db equal the reference, their dX summed equals it."""
    name = "softcap_scaled"
    loss, dh, dw, db = _reference(TRANSFORMS[name], 0.1, gated)
    results = run_distributed(_shard_worker, name, gated, tiles, world=2)
    for r in results:
        torch.testing.assert_close(r["loss"], loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(sum(r["grads"][0] for r in results), dh, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(torch.cat([r["grads"][1] for r in results]), dw, rtol=1e-10, atol=1e-13)
    if not gated:
        torch.testing.assert_close(torch.cat([r["grads"][2] for r in results]), db, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"scale": 0.0}, "scale=0.0"), ({"scale": float("inf")}, "scale=inf"), ({"softcap": 0.0}, "softcap=0.0"),
    ({"softcap": -1.0}, "softcap=-1.0"), ({"softcap": True}, "softcap=True"),
])  # fmt: skip
def test_bad_transforms_are_refused_naming_the_value(kwargs, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        LogitTransform(**kwargs)
