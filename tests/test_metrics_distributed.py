"""Metrics on 2 real gloo ranks equal the single-process values: the public geometry functions
on a DDP-replicated and an FSDP2-sharded weight (uneven shards, V odd), and every metric
plugin driven through `AnisoPlugins.measure` on a DDP-wrapped and an FSDP2-sharded model with
different data on each rank (references from the pooled data of both ranks)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aniso_plugins import (
    AnisoConfig,
    AnisoPlugins,
    ModelHandle,
    StepInfo,
    effective_rank,
    full_rows,
    isoscore,
    isotropy,
    mean_cosine,
    normalized_singular_values,
    principal_variance_share,
    singular_entropy,
    w_error,
)
from dist_utils import run_distributed
from test_bottleneck import ref_bottleneck
from test_geometry import ref_isotropy, ref_mean_cosine
from test_metric_plugins import GROUP_NAMES, ref_geometry, ref_groups
from test_under_trained import ref_scores

V, D, IGNORE = 51, 6, -100  # 51 rows: shards of 26 and 25


def _weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    f64 = torch.float64
    w = torch.randn(V, D, generator=g, dtype=f64) @ torch.diag(torch.linspace(1.0, 0.2, D, dtype=f64)) + 0.8
    w[[4, 30]] = 0.0  # zero rows on both shards
    return w


def _functions(weight: torch.Tensor) -> dict[str, object]:
    return {
        "mean_cosine": mean_cosine(weight),
        "mean_cosine_centered": mean_cosine(weight, center=True),
        "erank": effective_rank(weight),
        "erank_sigma2": effective_rank(weight, variant="sigma2"),
        "erank_raw": effective_rank(weight, center=False),
        "singular_entropy": singular_entropy(weight),
        "normalized": normalized_singular_values(weight),
        "variance_share": principal_variance_share(weight, 2),
        "w_error": w_error(weight, 2),
        "isotropy": isotropy(weight),
        "isotropy_centered": isotropy(weight, center=True),
        "isotropy_both": isotropy(weight, both_signs=True),
        "isoscore": isoscore(weight),
    }


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        with torch.no_grad():
            self.embed.weight.add_(0.5)
            self.lm_head.weight.add_(0.2)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    probs = torch.linspace(1.0, 0.05, V, dtype=torch.float64) ** 3
    ids = torch.multinomial(probs, 4 * 6, replacement=True, generator=g).reshape(4, 6)
    targets = torch.cat([ids[:, 1:], torch.full((4, 1), IGNORE)], dim=1)
    return ids, targets


def _worker(rank: int, world: int, mode: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_default_dtype(torch.float64)
    # --- the public functions on a replica / a shard --------------------------------------
    holder = nn.Linear(D, V, bias=False)
    with torch.no_grad():
        holder.weight.copy_(_weight())
    if mode == "fsdp2":
        fully_shard(holder, mesh=init_device_mesh("cpu", (world,)))
        assert type(holder.weight).__name__ == "DTensor" and holder.weight.to_local().shape[0] == (26, 25)[rank]
    functions = _functions(holder.weight)

    # --- the plugins on a wrapped model, different data per rank ---------------------------
    model = LM()
    config = AnisoConfig(
        metrics=("geometry", "frequency", "hidden", "bottleneck", "eval", "under_trained"),
        hidden_samples=1000,
        load_entry_points=False,
    )
    plugins = AnisoPlugins(config)
    plugins.setup(ModelHandle(model, head="lm_head", input_embedding="embed", blocks="blocks"))
    blocks_out: dict[int, torch.Tensor] = {}
    head_in: list[torch.Tensor] = []
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, a, out, i=i: blocks_out.__setitem__(i, out.detach().clone()))
    model.norm.register_forward_hook(lambda m, a, out: head_in.append(out.detach().clone()))
    if mode == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    targets = []
    for step in (1, 2):
        ids, y = _batch(100 * step + 10 * rank)
        targets.append(y)
        plugins.targets(y, StepInfo(step=step, measure=step == 2))
        F.cross_entropy(wrapped(ids).reshape(-1, V), y.reshape(-1), ignore_index=IGNORE).backward()
        w_used = full_rows(model.lm_head.weight).detach().clone()
        opt.step()
        opt.zero_grad()
        plugins.step_end(StepInfo(step=step))
    metrics = plugins.measure(StepInfo(step=2, measure=True))
    g = torch.Generator().manual_seed(7 + rank)
    eval_logits = torch.randn(3, 5, V, generator=g) * 2
    eval_targets = torch.randint(0, V, (3, 5), generator=g)
    plugins.eval_batch(eval_logits, eval_targets)
    eval_metrics = plugins.measure(StepInfo(step=2, measure=True), kind="eval")
    return {
        "functions": functions,
        "metrics": metrics,
        "eval": eval_metrics,
        "targets": torch.cat([t.reshape(-1) for t in targets]),
        "probe_targets": targets[1].reshape(-1),
        "head_in": head_in[-1].reshape(-1, D),
        "blocks": {i: out.reshape(-1, D) for i, out in blocks_out.items()},
        "w_used": w_used,
        "head": full_rows(model.lm_head.weight).detach().clone(),
        "embed": full_rows(model.embed.weight).detach().clone(),
        "eval_logits": eval_logits.reshape(-1, V),
        "eval_targets": eval_targets.reshape(-1),
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def _check_close(got: float, ref: float, name: str) -> None:
    assert got == pytest.approx(ref, rel=1e-6, abs=1e-9, nan_ok=True), f"{name}: {got} vs {ref}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_equal_single_process(mode):
    results = run_distributed(_worker, mode)
    r0, r1 = results

    # every rank finished the same floats
    for key in ("functions", "metrics", "eval"):
        assert r0[key].keys() == r1[key].keys()
        for name in r0[key]:
            assert _same(r0[key][name], r1[key][name]), f"{key}/{name} differs across ranks"

    # public functions: the single-process call on the full weight
    single = _functions(_weight())
    for name, ref in single.items():
        got = r0["functions"][name]
        if isinstance(ref, torch.Tensor):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-9)
        else:
            _check_close(got, ref, name)
    _check_close(r0["functions"]["isotropy"], ref_isotropy(_weight().numpy()), "isotropy vs numpy")

    # plugins: references from both ranks' data
    metrics = r0["metrics"]
    for name, weight in (("head", r0["head"]), ("embedding", r0["embed"])):
        for key, ref in ref_geometry(weight.numpy()).items():
            _check_close(metrics[f"aniso/geometry/{name}/{key}"], float(ref), f"{name}/{key}")
    pooled = torch.cat([r["targets"] for r in results]).numpy()
    groups = ref_groups(np.bincount(pooled[pooled != IGNORE], minlength=V))
    w = r0["head"].numpy()
    for index, group in enumerate(GROUP_NAMES):
        _check_close(metrics[f"aniso/frequency/{group}/isotropy"], ref_isotropy(w[groups == index]), group)
        _check_close(metrics[f"aniso/frequency/{group}/mean_cosine"], ref_mean_cosine(w[groups == index]), group)
    unseen = np.bincount(pooled[pooled != IGNORE], minlength=V) == 0
    assert 0 < unseen.sum() < V
    score = ref_scores(w, unseen)
    assert metrics["aniso/under_trained/reference"] == unseen.sum()
    assert metrics["aniso/under_trained/suspected"] == (score[~unseen] >= 0.5).sum()
    _check_close(metrics["aniso/under_trained/mean_score"], float(score[~unseen].mean()), "under_trained")
    valid = [r["probe_targets"].numpy() != IGNORE for r in results]
    for i in range(2):
        rows = np.concatenate([r["blocks"][i].numpy()[m] for r, m in zip(results, valid)])
        _check_close(metrics[f"aniso/hidden/layer_{i}/mean_cosine"], ref_mean_cosine(rows), f"layer {i}")
    assert torch.equal(r0["w_used"], r1["w_used"])
    ref = ref_bottleneck(
        np.concatenate([r["head_in"].numpy() for r in results]),
        r0["w_used"].numpy(),
        np.concatenate([r["probe_targets"].numpy() for r in results]),
    )
    for key, value in ref.items():
        _check_close(metrics[f"aniso/bottleneck/{key}"], value, f"bottleneck/{key}")

    # evaluation: union of predictions, pooled NLL
    z = np.concatenate([r["eval_logits"].numpy() for r in results])
    y = np.concatenate([r["eval_targets"].numpy() for r in results])
    nll = np.log(np.exp(z).sum(1)) - z[np.arange(len(y)), y]
    _check_close(r0["eval"]["aniso/eval/ppl"], math.exp(nll.mean()), "ppl")
    assert r0["eval"]["aniso/eval/uniq"] == len(set(z.argmax(1).tolist()))
    for index, group in enumerate(GROUP_NAMES):
        member = groups[y] == index
        ref = math.exp(nll[member].mean()) if member.any() else math.nan
        _check_close(r0["eval"][f"aniso/eval/ppl_{group}"], ref, group)
