"""The regularizers on 2 real gloo ranks: value and gradient equal the single-process dense
formulas for a replicated plain tensor, under DDP (term attached inside the head's forward,
gradients averaged by DDP), under FSDP2 inside the forward (unsharded weight, gradients
reduce-scattered) and under FSDP2 outside the forward (the Shard(0) DTensor: local rows plus
reductions; each rank's shard gradient must be its rows of the single-process gradient)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aniso_plugins import attach_loss, local_rows
from aniso_plugins.methods.regularizers.penalties import cosine_hinge, cosreg, spectrum_penalty
from dist_utils import run_distributed
from test_regularizers import _sampled_rows, ref_cosreg, ref_hinge

V, D = 53, 6  # shards of 27 and 26 rows
EXCLUDE = (26,)  # the last row of rank 0's shard
SAMPLE = 9


def _full_weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) + 0.3
    w[3] = 0.0  # a zero row on rank 0
    w[40] = 0.0  # and one on rank 1
    return w


def _ref_spectrum(w: torch.Tensor, prior: str) -> torch.Tensor:
    s = torch.linalg.svdvals(w)  # an SVD, not the Gram path under test
    if prior == "ratio":
        return s[0] / s[-1]
    k = torch.arange(1, D + 1, dtype=torch.float64)
    return (s - 2.0 * k**-0.75).square().sum()


def _cases():
    """name -> (regularizer of a weight, dense single-process reference of a full weight)."""
    rows = _sampled_rows(7, EXCLUDE, SAMPLE, v=V)
    population = V - len(EXCLUDE)
    return {
        "cosreg": (lambda w: cosreg(w, EXCLUDE), lambda w: ref_cosreg(w, EXCLUDE)),
        "hinge": (
            lambda w: cosine_hinge(w, -0.2, block=4, exclude_ids=EXCLUDE),
            lambda w: ref_hinge(w, -0.2, EXCLUDE),
        ),
        "hinge_sampled": (
            lambda w: cosine_hinge(
                w, 0.1, block=4, sample=SAMPLE, generator=torch.Generator().manual_seed(7), exclude_ids=EXCLUDE
            ),
            lambda w: ref_hinge(w, 0.1, EXCLUDE, rows=rows, scale=population / SAMPLE),
        ),
        "spectrum_poly": (lambda w: spectrum_penalty(w, "poly", c1=2.0), lambda w: _ref_spectrum(w, "poly")),
        "spectrum_ratio": (lambda w: spectrum_penalty(w, "ratio"), lambda w: _ref_spectrum(w, "ratio")),
    }


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D, dtype=torch.float64)
        self.lm_head = nn.Linear(D, V, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.lm_head.weight.copy_(_full_weight())

    def forward(self, ids):
        return self.lm_head(self.embed(ids))


def _inside_forward(wrapper: nn.Module, head: nn.Module, fn, rank: int) -> tuple[float, bool]:
    """Attach fn(head weight) inside the head's forward (as the adapters do) and backpropagate
    a main loss that contributes no gradient; returns the regularizer's value and whether the
    weight it saw was a DTensor."""
    from torch.distributed.tensor import DTensor

    seen = {}

    def hook(module, args, output):
        value = fn(module.weight)
        seen.update(value=float(value.detach()), dtensor=isinstance(module.weight, DTensor))
        return attach_loss(output, value)

    handle = head.register_forward_hook(hook)
    ids = torch.arange(8).reshape(2, 4) + 5 * rank  # different data on each rank
    (wrapper(ids) * 0).sum().backward()
    handle.remove()
    return seen["value"], seen["dtensor"]


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, (fn, _) in _cases().items():
        # replica: a plain tensor while torch.distributed is initialized, computed in full
        w = _full_weight().requires_grad_(True)
        value = fn(w)
        value.backward()
        out[(name, "replica")] = (float(value.detach()), False, 0, w.grad.clone())

        ddp = nn.parallel.DistributedDataParallel(TinyLM())
        value, dtensor = _inside_forward(ddp, ddp.module.lm_head, fn, rank)
        out[(name, "ddp")] = (value, dtensor, 0, ddp.module.lm_head.weight.grad.clone())

        model = TinyLM()
        fully_shard(model, mesh=mesh)
        value, dtensor = _inside_forward(model, model.lm_head, fn, rank)
        rows = local_rows(model.lm_head.weight.grad)
        out[(name, "fsdp2_forward")] = (value, dtensor, rows.offset, rows.rows.clone())

        model = TinyLM()
        fully_shard(model, mesh=mesh)
        weight = model.lm_head.weight
        value = fn(weight)
        value.backward()
        rows = local_rows(weight.grad)
        out[(name, "fsdp2_outside")] = (float(value.detach()), type(weight).__name__ == "DTensor", rows.offset, rows.rows.clone())
    return out


@pytest.mark.slow
def test_two_ranks_value_and_gradient_equal_single_process():
    results = run_distributed(_worker)
    cases = _cases()
    for rank, result in enumerate(results):
        assert len(result) == 4 * len(cases)
        for (name, mode), (value, dtensor, offset, grad) in result.items():
            where = f"{name} / {mode} / rank {rank}"
            assert dtensor == (mode == "fsdp2_outside"), where
            w = _full_weight().requires_grad_(True)
            ref = cases[name][1](w)
            (ref_grad,) = torch.autograd.grad(ref, w)
            ref = ref.detach()
            assert abs(value - float(ref)) <= 1e-10 * max(1.0, abs(float(ref))), where
            if mode.startswith("fsdp2"):
                assert (offset, len(grad)) == ((0, 27), (27, 26))[rank], where
            else:
                assert (offset, len(grad)) == (0, V), where
            torch.testing.assert_close(grad, ref_grad[offset : offset + len(grad)], rtol=1e-9, atol=1e-12, msg=where)
