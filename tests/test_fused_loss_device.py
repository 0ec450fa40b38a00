"""The training head under the rules a GPU enforces, checked on the CPU (docs/performance.md, "What
the GPU pays"): `fused_linear_cross_entropy` (every option, both kinds of tiles, a vocabulary
shard's statistics), `gated_linear` and `TrainingHead`'s training forward read no value back to the
host (`HostSyncs` counts zero ops that would, and counts them where a control makes them), run
on a fake CUDA device (`fake_cuda`: a host read or a data-dependent shape raises there) in float32
and bf16, and trace under ``torch.compile(fullgraph=True)`` without a graph break, compiled equal
to eager (backend "aot_eager": inductor compiles the same graph, minutes on this CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aniso_plugins import LogitTransform, RowGates, TrainingHead, agg_gates, fused_linear_cross_entropy, gated_linear
from device_discipline import HostSyncs, fake_cuda

V, D, N = 50, 8, 64
OPTIONS = {
    "plain": {},
    "agg": dict(gates=True),
    "agg_target_gate": dict(gates="target"),
    "every_option": dict(gates=True, label_smoothing=0.1, z_loss=1e-3, logit_transform=LogitTransform(0.5, 3.0),
                         class_weights=True, token_weights=True),
    "sum_tensor_normalizer": dict(gates=True, reduction="sum", normalizer=True),
    "none": dict(gates=True, reduction="none", token_weights=True, class_weights=True),
}
TILINGS = {"one_tile": {}, "row_chunks": dict(chunk_size=16), "vocab_blocks": dict(vocab_chunk_size=16)}


def _inputs(device="cpu", dtype=torch.float32, options=None):
    """hidden, weight, bias (leaves), targets (3 ignored), and the keyword arguments of `options`."""
    h = torch.randn(N, D, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(V, D, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(V, device=device, dtype=dtype, requires_grad=True)
    y = torch.randint(0, V, (N,), device=device)
    y[:3] = -100
    kw = dict(options or {})
    gates = kw.pop("gates", None)
    if gates:
        rare = torch.arange(V, device=device) < 10
        g_target = torch.rand(V, device=device) if gates == "target" else None
        kw["row_gates"] = RowGates(torch.rand(V, device=device), torch.rand(V, device=device), rare, g_target)
    if kw.get("class_weights"):
        kw["class_weights"] = torch.rand(V, device=device, dtype=dtype) + 0.5
    if kw.get("token_weights"):
        kw["token_weights"] = torch.rand(N, device=device, dtype=dtype)
    if kw.get("normalizer"):
        kw["normalizer"] = torch.tensor(40.0, device=device)
    return h, w, b, y, kw


def _fused(h, w, b, y, kw, tiling):
    out = fused_linear_cross_entropy(h, w, y, kw.pop("row_gates", None), bias=b, **kw, **TILINGS[tiling])
    return out.sum() if out.dim() else out


@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_fused_loss_forward_and_backward_read_nothing_back(option, tiling):
    h, w, b, y, kw = _inputs(options=OPTIONS[option])
    with HostSyncs(where=True) as syncs:
        loss = _fused(h, w, b, y, kw, tiling)
        loss.backward()
    assert syncs.total == 0, dict(syncs.sites)
    assert h.grad is not None and w.grad is not None and b.grad is not None


def test_gated_linear_and_the_training_head_read_nothing_back():
    h, w, b, y, kw = _inputs(options={"gates": True})
    with HostSyncs(where=True) as syncs:
        F.cross_entropy(gated_linear(h, w, y, kw["row_gates"], bias=b), y).backward()
    assert syncs.total == 0, dict(syncs.sites)
    head = nn.Linear(D, V)
    installed = TrainingHead(head)
    for fused in (False, True):
        installed.arm(y, kw["row_gates"])
        if fused:
            installed.fuse(torch.tensor(61.0))
        with HostSyncs(where=True) as syncs:
            out = head(h)
            (out if fused else F.cross_entropy(out, y)).backward()
        assert syncs.total == 0, (fused, dict(syncs.sites))
        assert not installed.armed and head.weight.grad is not None


def test_the_counter_sees_host_reads_where_there_are_some():
    """The control: the old code's kinds of host reads are counted (a range check by .item(), a
    boolean mask, nonzero)."""
    y = torch.randint(0, V, (N,))
    with HostSyncs() as syncs:
        int(y.max())
        y[y != -100]
        (y == 3).nonzero()
    assert dict(syncs.counts) == {"item": 1, "bool_index": 1, "nonzero": 1}


def _grad_like(t):
    return torch.ones_like(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("option", ["agg", "every_option", "none"])
def test_fused_loss_runs_on_a_fake_cuda_device(option, tiling, dtype):
    """The forward under `fake_cuda` (bf16: bf16 leaves, the GEMMs in bf16 and the rest in float32),
    then the autograd node's backward called directly (the engine needs a real device)."""
    with fake_cuda():
        h, w, b, y, kw = _inputs("cuda", dtype, OPTIONS[option])
        out = fused_linear_cross_entropy(h, w, y, kw.pop("row_gates"), bias=b, **kw, **TILINGS[tiling])
        grads = out.grad_fn.apply(_grad_like(out), *[None] * (4 if out.dim() == 0 else 1))
    assert out.device.type == "cuda"
    assert [g.shape for g in grads[:3]] == [h.shape, w.shape, b.shape]
    assert all(g.device.type == "cuda" for g in grads[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_linear_runs_on_a_fake_cuda_device(dtype):
    with fake_cuda():
        h, w, b, y, kw = _inputs("cuda", dtype, {"gates": "target"})
        logits = gated_linear(h, w, y, kw["row_gates"], bias=b)
        dh, dw, db = logits.grad_fn.apply(_grad_like(logits))[:3]
    assert logits.shape == (N, V) and (dh.shape, dw.shape, db.shape) == (h.shape, w.shape, b.shape)
    assert dw.device.type == "cuda"


def test_the_fake_device_raises_where_the_data_decides():
    """The control: under `fake_cuda` a host read and a data-dependent shape raise."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    with fake_cuda():
        y = torch.randint(0, V, (N,), device="cuda")
        with pytest.raises(DynamicOutputShapeException):
            (y == 3).nonzero()
        with pytest.raises(DataDependentOutputException):
            int(y.max())


def _compiled_equals_eager(fn, *params):
    explained = torch._dynamo.explain(fn)(*params)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got = compiled(*params)
    got_grads = torch.autograd.grad(got, params)
    want = fn(*params)
    want_grads = torch.autograd.grad(want, params)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for a, r in zip(got_grads, want_grads):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tiling", ["one_tile", "vocab_blocks"])
@pytest.mark.parametrize("option", ["agg", "every_option", "none"])
def test_the_fused_loss_compiles_whole_and_equals_eager(option, tiling):
    h, w, b, y, kw = _inputs(options=OPTIONS[option])
    upstream = torch.linspace(0.5, 2.0, N)

    def loss(h, w, b):
        out = fused_linear_cross_entropy(h, w, y, kw.get("row_gates"), bias=b,
                                         **{k: v for k, v in kw.items() if k != "row_gates"}, **TILINGS[tiling])
        return (out * upstream).sum() if out.dim() else out * 3.0

    _compiled_equals_eager(loss, h, w, b)


def test_the_gated_head_compiles_whole_and_equals_eager():
    h, w, b, y, kw = _inputs(options={"gates": "target"})

    def loss(h, w, b):
        return gated_linear(h, w, y, kw["row_gates"], bias=b).square().sum() + F.cross_entropy(
            gated_linear(h, w, y, kw["row_gates"], bias=b), y)

    _compiled_equals_eager(loss, h, w, b)


def test_agg_gates_from_the_counter_compile_into_the_head():
    """The gates AGG computes (agg_gates), armed on a `TrainingHead` whose fused forward runs
    inside the compiled function."""
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(D, V)
    installed = TrainingHead(head)
    y = torch.randint(0, V, (N,), generator=g)
    gates = agg_gates(torch.rand(V, generator=g), 0.3)
    h = torch.randn(N, D, generator=g, requires_grad=True)

    def step(h):
        installed.arm(y, gates)
        installed.fuse(torch.tensor(float(N)))
        return head(h)

    explained = torch._dynamo.explain(step)(h)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(h)
    torch.testing.assert_close(got, step(h))
