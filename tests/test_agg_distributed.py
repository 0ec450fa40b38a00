"""AGG on 2 real gloo ranks with different micro-batches: the token counts are summed across
ranks, so both ranks compute identical gates, equal to a single-process dense counter fed with
both ranks' targets; the gradients equal the three-logit reference with those gates, for a
plain replica, a DDP-wrapped model, an FSDP2 ``fully_shard`` model (tied embedding/head, one
unit) and an untied head in its own FSDP2 unit that is resharded after its forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aniso_plugins import RowGates, AnisoConfig, AnisoPlugins, ModelHandle, RunInfo, StepInfo
from dist_utils import run_distributed
from test_agg import IGN, _batches, grads, ref_gates, rel_err, three_logit_loss
from test_counter import DenseRing

ALPHA, WINDOW, VOCAB = 0.6, 3, 19


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.block = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def body(self, ids):
        return torch.tanh(self.block(self.embed(ids)))

    def forward(self, ids):
        return self.lm_head(self.body(ids))


def _model(tied=True):
    torch.manual_seed(0)
    model = TiedLM().double()
    if not tied:
        model.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone() * 0.5)
    return model


def _config():
    return AnisoConfig(method="agg", alpha=ALPHA, window=WINDOW, metrics=(), load_entry_points=False)


def _worker(rank, world, modes):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    batches = _batches(steps=5, micro=2, seed=100 + rank)
    out = {"batches": batches}
    for mode in modes:
        model = _model(tied=mode != "fsdp2_head_unit")
        plugins = AnisoPlugins(_config())
        plugins.setup(ModelHandle(model, head="lm_head", input_embedding="embed"))
        plugins.begin_training(RunInfo())
        if mode == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(model)
        elif mode == "fsdp2":
            wrapped = fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
            assert isinstance(model.lm_head.weight, DTensor) and model.lm_head.weight is model.embed.weight
        elif mode == "fsdp2_head_unit":  # untied head in its own unit, resharded after its forward
            mesh = init_device_mesh("cpu", (world,))
            fully_shard(model.lm_head, mesh=mesh, reshard_after_forward=True)
            wrapped = fully_shard(model, mesh=mesh)
            assert isinstance(model.lm_head.weight, DTensor)
        else:
            wrapped = model
        gates, step_grads = [], []
        for t, step in enumerate(batches, start=1):
            for p in model.parameters():
                p.grad = None
            plugins.step_targets([tgt for _, tgt in step], StepInfo(step=t, accumulation_steps=len(step)))
            for m, (ids, tgt) in enumerate(step):
                plugins.targets(tgt, StepInfo(step=t, micro_batch=m, accumulation_steps=len(step)))
                g = plugins.get("agg").last_gates
                gates.append((g.g1.clone(), g.g2.clone(), g.rare.clone()))
                logits = wrapped(ids)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1), ignore_index=IGN) / len(step)
                loss.backward()
            plugins.step_end(StepInfo(step=t, accumulation_steps=len(step)))
            step_grads.append(
                [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone() for p in model.parameters()]
            )
        out[mode] = {"gates": gates, "grads": step_grads, "state": plugins.state_dict()["agg"]}
    return out


@pytest.mark.slow
def test_two_ranks_identical_gates_and_reference_gradients():
    modes = ("plain", "ddp", "fsdp2", "fsdp2_head_unit")
    results = run_distributed(_worker, modes)
    per_rank = [r["batches"] for r in results]
    assert not torch.equal(per_rank[0][0][0][1], per_rank[1][0][0][1])  # the ranks see different targets

    # single-process reference: one dense counter fed with the whole step (both ranks' micro-batches)
    # before its first micro-batch; every micro-batch of the step gated by the step's gates
    ring = DenseRing(VOCAB, WINDOW)
    ref_gates_list, rare_rows = [], 0
    models = {True: _model(), False: _model(tied=False)}
    ref_grads = {True: [], False: []}
    for t in range(1, 6):
        step_grads = {k: [[torch.zeros_like(p) for p in m.parameters()] for _ in results] for k, m in models.items()}
        a = ring.criterion_call(torch.cat([per_rank[r][t - 1][m][1].reshape(-1) for r in range(2) for m in range(2)]), t)
        g1, g2, rare = ref_gates(a, ALPHA, min(t, WINDOW))
        gates = RowGates(g1.float(), g2.float(), rare)
        for m in range(2):
            ref_gates_list.append(gates)
            for r in range(2):
                ids, tgt = per_rank[r][t - 1][m]
                rare_rows += int(rare[tgt[tgt != IGN]].sum())
                for tied, model in models.items():
                    loss = three_logit_loss(model.body(ids), model.lm_head.weight, tgt, gates) / 2
                    for acc, g in zip(step_grads[tied][r], grads(loss, *model.parameters())):
                        acc += g
        for tied in models:
            ref_grads[tied].append(step_grads[tied])
    assert rare_rows > 0  # rare-target rows (part (c), gate g2) occur

    for mode in modes:
        got0, got1 = (r[mode] for r in results)
        for (a1, a2, ar), (b1, b2, br), ref in zip(got0["gates"], got1["gates"], ref_gates_list):
            assert torch.equal(a1, b1) and torch.equal(a2, b2) and torch.equal(ar, br)  # identical on both ranks
            assert torch.equal(ar, ref.rare)
            torch.testing.assert_close(a1, ref.g1, rtol=1e-6, atol=0)
            torch.testing.assert_close(a2, ref.g2, rtol=1e-6, atol=0)
        for key in got0["state"]:
            assert torch.equal(got0["state"][key], got1["state"][key]), key
        ref = ref_grads[mode != "fsdp2_head_unit"]
        for t in range(5):
            for r, res in enumerate((got0, got1)):
                for got, ref0, ref1, ref_local in zip(res["grads"][t], ref[t][0], ref[t][1], ref[t][r]):
                    # DDP and FSDP2 average the ranks' gradients; the plain replica keeps its own
                    expected = ref_local if mode == "plain" else (ref0 + ref1) / 2
                    assert rel_err(got, expected) < 1e-6, (mode, t, r)
