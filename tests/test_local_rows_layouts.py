"""`local_rows` on every row layout a parameter takes in FSDP2, HSDP and tensor parallelism
(4 gloo ranks, the DTensors made by torch's own `fully_shard` and `distribute_tensor`): each
rank's rows are the global rows ``[offset, offset + n)`` of the full tensor, and over the
world every row is held exactly once. The reference is the full tensor itself (an
``arange`` matrix, so a row's values name the row) and a plain count of the row ids."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

WORLD = 4


def _layouts_worker(rank: int, world: int, vocab: int) -> dict:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from aniso_plugins.numerics.distributed import local_rows

    full = torch.arange(vocab * 3, dtype=torch.float64).reshape(vocab, 3)
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    mesh1 = init_device_mesh("cpu", (world,), mesh_dim_names=("all",))
    tensors = {
        "plain (DDP replica)": full,
        "FSDP2 Shard(0)": distribute_tensor(full, mesh1, [Shard(0)]),
        "HSDP (Replicate, Shard(0))": distribute_tensor(full, mesh2, [Replicate(), Shard(0)]),
        "(Shard(0), Replicate)": distribute_tensor(full, mesh2, [Shard(0), Replicate()]),
        "(Replicate, Replicate)": distribute_tensor(full, mesh2, [Replicate(), Replicate()]),
    }
    # FSDP2 over a tensor-parallel shard, as torchtitan builds it: TP first, then fully_shard
    head = nn.Linear(3, vocab, bias=False, dtype=torch.float64)
    head.weight = nn.Parameter(distribute_tensor(full, mesh2["inner"], [Shard(0)]))
    fully_shard(head, mesh=mesh2["outer"])
    tensors["FSDP2 + TP (_StridedShard(0), Shard(0))"] = head.weight
    out = {"placements": {}}
    for name, t in tensors.items():
        lr = local_rows(t.detach())
        out[name] = (lr.offset, lr.total, lr.rows.to_local().clone() if hasattr(lr.rows, "to_local") else lr.rows.clone())
        out["placements"][name] = str(getattr(t, "placements", ""))
    try:  # a mesh smaller than the world cannot be partitioned over it
        local_rows(distribute_tensor(full, mesh2["inner"], [Shard(0)]))
        out["submesh"] = "accepted"
    except NotImplementedError as e:
        out["submesh"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [16, 11])
def test_every_row_layout_partitions_the_rows_over_the_world(vocab):
    results = run_distributed(_layouts_worker, vocab, world=WORLD)
    full = torch.arange(vocab * 3, dtype=torch.float64).reshape(vocab, 3)
    names = [n for n in results[0] if n not in ("placements", "submesh")]
    assert "_StridedShard" in results[0]["placements"]["FSDP2 + TP (_StridedShard(0), Shard(0))"]
    for name in names:
        seen = torch.zeros(vocab, dtype=torch.long)
        for r in results:
            offset, total, rows = r[name]
            assert total == vocab
            assert torch.equal(rows, full[offset : offset + rows.shape[0]]), (name, offset)
            seen[offset : offset + rows.shape[0]] += 1
        assert seen.tolist() == [1] * vocab, (name, seen.tolist())
    assert all("spans it" in r["submesh"] for r in results)
