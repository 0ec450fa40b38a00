"""local_rows + reduce_stats on 2 real gloo ranks equal the single-process values, for a plain
tensor, a DDP-replicated parameter and FSDP2-sharded parameters (uneven shards, a tied
embedding/head in one fully_shard group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aniso_plugins import Stat, local_rows, reduce_stats
from aniso_plugins.numerics.linalg import all_reduce_sum_shared, gram_stats
from dist_utils import run_distributed

V, D = 101, 6  # 101 rows: shards of 51 and 50


def _full_weight():
    g = torch.Generator().manual_seed(1)
    return torch.randn(V, D, generator=g) + 0.5


def _reference(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Single-process values of the statistics, by explicit formulas in float64."""
    x = w.double()
    a = torch.linspace(-1, 1, D, dtype=torch.float64)
    return {
        "sum": x.sum(0),
        "gram": x.T @ x,
        "n": torch.tensor(float(V), dtype=torch.float64),
        "maxnorm": x.norm(dim=1).max(),
        "minnorm": x.norm(dim=1).min(),
        "lse": torch.logsumexp(x @ a, 0).reshape(1),
        "seen": torch.zeros(V, dtype=torch.bool).index_fill_(0, torch.tensor([3, 50, 51, 100]), True),
    }


def _stats(w: torch.Tensor, rank: int) -> dict[str, Stat]:
    lr = local_rows(w)
    x = lr.rows.detach().double()
    a = torch.linspace(-1, 1, D, dtype=torch.float64)
    seen = torch.zeros(V, dtype=torch.bool)
    seen[[3, 50] if rank == 0 else [51, 100, 3]] = True  # a union, with a duplicate
    return {
        "sum": Stat(x.sum(0)),
        "gram": Stat(x.T @ x),
        "n": Stat(torch.tensor(float(x.shape[0]), dtype=torch.float64)),
        "maxnorm": Stat(x.norm(dim=1).max() if len(x) else torch.tensor(0.0, dtype=torch.float64), "max"),
        "minnorm": Stat(x.norm(dim=1).min() if len(x) else torch.tensor(float("inf"), dtype=torch.float64), "min"),
        "lse": Stat(torch.logsumexp(x @ a, 0).reshape(1), "lse"),
        "seen": Stat(seen, "max"),
    }


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.embed.weight
        with torch.no_grad():
            self.embed.weight.copy_(_full_weight())


def _worker(rank, world, mode):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = TiedLM()
    ref = _reference(model.lm_head.weight.detach())
    if mode == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model, mesh=mesh)  # embedding and head: one group (tied)
        assert type(model.lm_head.weight).__name__ == "DTensor"
        assert model.lm_head.weight is model.embed.weight
    elif mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model).module
    lr = local_rows(model.lm_head.weight)
    got = reduce_stats(_stats(model.lm_head.weight, rank))
    # differentiable sum over row shards, for a loss every rank computes identically: each
    # local row gets the single-process gradient once
    rows = lr.rows.detach().double().requires_grad_(True)
    total = all_reduce_sum_shared(gram_stats(rows).row_sum)
    (total * torch.arange(1, D + 1, dtype=torch.float64)).sum().backward()
    return {
        "offset": lr.offset,
        "n_local": lr.rows.shape[0],
        "got": got,
        "ref": ref,
        "diff_sum": total.detach(),
        "row_grad": rows.grad,
    }


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "ddp", "fsdp2"])
def test_two_ranks_reduce_to_single_process_values(mode):
    results = run_distributed(_worker, mode)
    assert [(r["offset"], r["n_local"]) for r in results] == [(0, 51), (51, 50)]
    for r in results:
        for name, ref in r["ref"].items():
            got = r["got"][name]
            if ref.dtype == torch.bool:
                assert torch.equal(got, ref), name
            else:
                torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(r["diff_sum"], r["ref"]["sum"], rtol=1e-12, atol=1e-12)
        expected_grad = torch.arange(1, D + 1, dtype=torch.float64).expand(r["n_local"], D)
        torch.testing.assert_close(r["row_grad"], expected_grad)


def test_single_process_passthrough():
    w = _full_weight()
    lr = local_rows(w)
    assert lr.offset == 0 and lr.rows is w and lr.total == V
    got = reduce_stats(_stats(w, 0))
    torch.testing.assert_close(got["gram"], _reference(w)["gram"])
    with pytest.raises(ValueError, match="op must be"):
        reduce_stats({"x": Stat(torch.zeros(1), "mean")})
    with pytest.raises(TypeError, match="Stat"):
        reduce_stats({"x": torch.zeros(1)})
