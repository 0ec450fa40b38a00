"""The training head on a vocabulary shard (tensor parallelism with loss parallel), on real gloo
ranks: each rank holds the rows ``torch.chunk(W, tp)[rank]`` and the same hidden states and
global targets. The fused cross-entropy's loss equals the whole vocabulary's on every rank; the
shards' dW stacked, the shards' dX summed (what torchtitan's sharding of the head input does)
and db equal a float64 reference: ``F.cross_entropy`` of the full logits for the plain and the
label-smoothed loss, the official three-logit AGG construction (tests/references.py) for the
gated weight gradient. `gated_linear` on a shard, under torchtitan's own vocabulary-parallel
loss, gives the same gated dW. Rows hundreds of nats below their maximum, ignored rows, several
chunks, both row groups, an uneven split (V = 37 on 2 ranks: 19 + 18) and bf16 autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed

V, D, N = 37, 8, 60
ALPHA = 0.3


def _data():
    g = torch.Generator().manual_seed(7)
    h = torch.randn(2, N // 2, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (2, N // 2), generator=g)
    y[1, :5] = -100
    for i, j in [(0, 0), (1, 9)]:  # the target far below the rest: ≈ 300 nats
        h[i, j] = -60.0 * w[y[i, j]] / w[y[i, j]].norm() ** 2
    appearance = torch.rand(V, generator=g, dtype=torch.float64)
    return h, w, b, y, appearance


def _reference(smoothing: float, gated: bool, bias: bool):
    """(loss, dh, dW, db) in float64 from the full logits z = hWᵀ + b: F.cross_entropy and
    autograd; for AGG, dW = (G ⊙ Γ)ᵀ X with G = ∂L/∂z and the official gates written out
    (Γ_ik = g1_k if y_i is not rare, g2_k if it is, 1 at k = y_i)."""
    h, w, b, y, appearance = _data()
    h, w, b = (t.clone().requires_grad_() for t in (h, w, b))
    z = h @ w.T + (b if bias else 0.0)
    loss = F.cross_entropy(z.reshape(-1, V), y.reshape(-1), label_smoothing=smoothing)
    dh, dw, db, G = torch.autograd.grad(loss, (h, w, b, z), allow_unused=True)
    if gated:
        a = appearance.float().double()
        rare = a < ALPHA
        g1 = torch.where(rare, a, torch.ones_like(a))
        g2 = torch.where(rare, (a / (a[rare].mean() + 1e-7)).clamp(max=1.0), torch.ones_like(a))
        flat = y.reshape(-1)
        gamma = torch.where(rare[flat.clamp_min(0)][:, None], g2[None, :], g1[None, :])
        valid = (flat != -100).nonzero().squeeze(1)
        gamma[valid, flat[valid]] = 1.0
        dw = (G.reshape(-1, V) * gamma).T @ h.detach().reshape(-1, D)
    return float(loss.detach()), dh, dw, db


def _shard_worker(rank: int, world: int, smoothing: float, gated: bool, op: str, dtype: str, tiles: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from aniso_plugins import agg_gates, fused_linear_cross_entropy, gated_linear
    from aniso_plugins.numerics.distributed import VocabShard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    shard = VocabShard.of(mesh, V)
    h, w, b, y, appearance = _data()
    cast = torch.float32
    h = h.to(cast).requires_grad_()
    w_local = w[shard.start : shard.stop].to(cast).clone().requires_grad_()
    b_local = b[shard.start : shard.stop].to(cast).clone().requires_grad_()
    gates = agg_gates(appearance.float(), ALPHA) if gated else None
    bias = None if gated else b_local
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        if op == "fused":
            loss = fused_linear_cross_entropy(h, w_local, y, gates, bias=bias, label_smoothing=smoothing, shard=shard,
                                              **tiles)
        else:  # torchtitan's own vocabulary-parallel cross-entropy of the shard's gated logits
            from torchtitan.components.loss import _LossParallelCrossEntropy

            logits = gated_linear(h, w_local, y, gates, bias=bias, shard=shard)
            loss = _LossParallelCrossEntropy.apply(logits.flatten(0, 1).float(), y.flatten(), shard.group, V, "sum")
            loss = loss / int((y != -100).sum())
    loss.backward()
    dh = h.grad.clone()
    dist.all_reduce(dh)  # the shards' parts of the head input's gradient
    return {"loss": float(loss), "dh": dh.double(), "dw": w_local.grad.double(),
            "db": None if b_local.grad is None else b_local.grad.double(), "rows": (shard.start, shard.stop)}


ROWS, BLOCKS, BOTH = dict(chunk_size=7), dict(vocab_chunk_size=5), dict(chunk_size=7, vocab_chunk_size=4)
CASES = [  # (smoothing, gated, op, dtype, world, tiles); BLOCKS: 19 ids = 5 + 5 + 5 + 4 on rank 0, 18 = 5 + 5 + 5 + 3
    (0.0, False, "fused", "fp32", 2, ROWS),
    (0.1, False, "fused", "fp32", 2, ROWS),
    (0.0, True, "fused", "fp32", 2, ROWS),
    (0.1, True, "fused", "fp32", 3, ROWS),
    (0.0, True, "gated_linear", "fp32", 2, ROWS),
    (0.0, True, "fused", "bf16", 2, ROWS),
    (0.1, False, "fused", "fp32", 2, BLOCKS),
    (0.1, True, "fused", "fp32", 2, BOTH),
    (0.0, True, "fused", "fp32", 3, BLOCKS),
    (0.0, True, "fused", "bf16", 2, BLOCKS),
]


@pytest.mark.slow
@pytest.mark.parametrize("smoothing,gated,op,dtype,world,tiles", CASES)
def test_a_vocabulary_shard_per_rank_gives_the_whole_vocabularys_loss_and_gradients(smoothing, gated, op, dtype, world,
                                                                                    tiles):
    results = run_distributed(_shard_worker, smoothing, gated, op, dtype, tiles, world=world)
    loss, dh, dw, db = _reference(smoothing, gated, bias=not gated)
    tol = 2e-2 if dtype == "bf16" else 1e-5
    assert [r["rows"] for r in results] == _chunks(world)
    for r in results:  # every rank: the loss of the whole vocabulary
        assert abs(r["loss"] - loss) <= tol * abs(loss), (r["loss"], loss)
        assert float((r["dh"] - dh).abs().max()) <= tol * float(dh.abs().max())
    got_dw = torch.cat([r["dw"] for r in results])
    assert float((got_dw - dw).abs().max()) <= tol * float(dw.abs().max())
    if not gated:
        got_db = torch.cat([r["db"] for r in results])
        assert float((got_db - db).abs().max()) <= tol * float(db.abs().max())
    if gated:  # the gates really change dW here
        _, _, plain, _ = _reference(smoothing, False, bias=False)
        assert float((plain - dw).abs().max()) > 0.05 * float(dw.abs().max())


def _chunks(world: int) -> list[tuple[int, int]]:
    size = -(-V // world)
    return [(min(r * size, V), min(r * size + size, V)) for r in range(world)]


class _Mesh:
    """What the refusals read of a tensor-parallel mesh (its size and name)."""

    mesh_dim_names = ("tp",)

    @staticmethod
    def size() -> int:
        return 2


def _handle():
    from torch import nn

    from aniso_plugins import ModelHandle

    model = nn.Module()
    model.embed, model.blocks, model.lm_head = nn.Embedding(8, 4), nn.ModuleList([nn.Linear(4, 4)]), nn.Linear(4, 8)
    return ModelHandle(model, head="lm_head", input_embedding="embed", blocks="blocks")


@pytest.mark.parametrize(
    "metric, mesh, match",
    [("bottleneck", "vocab_mesh", "vocabulary shard of the training logits"),
     ("ethayarajh", "sequence_mesh", "no-enable-sequence-parallel")],
)
def test_metrics_a_layout_cannot_measure_are_refused_at_setup_naming_the_way_out(metric, mesh, match):
    from aniso_plugins import AnisoConfig, ParallelLayout, SetupError, TrainingSession

    handle = _handle()
    session = TrainingSession(AnisoConfig(metrics=(metric,), load_entry_points=False))
    with pytest.raises(SetupError, match=match):
        session.setup(handle, ParallelLayout(**{mesh: _Mesh()}))
    assert not handle.model.lm_head._forward_hooks and not handle.model.blocks[0]._forward_hooks  # nothing stays
    plain = TrainingSession(AnisoConfig(metrics=(metric,), load_entry_points=False))
    plain.setup(_handle())  # the same metric without the layout sets up
