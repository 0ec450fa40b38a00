"""Update efficiency through the LM head (Godey & Artzi 2026, §3.4 / Fig. 6; docs/methods.md §9.5).

The math against an explicit float64 reference written here (cross-entropy by hand from the
log-softmax of explicitly perturbed logits, P = (G·W)·Wᵀ as explicit products, norms and cos
by explicit sums); its pooling over parts; two derived relations (first order: ratio → cos;
Cauchy–Schwarz: cos ≤ √(1 − lost_fraction), equal for WᵀW = c·I); the probe in a real
transformers.Trainer run of a tiny GPT-2 against G = ∂L/∂Z recomputed by autograd from the
probed micro-batch; and 2 gloo ranks (DDP, FSDP2 with a sharded head) against the
single-process reference over the pooled positions."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aniso_plugins import AnisoConfig, AnisoPlugins, ModelHandle, StepInfo, full_rows
from aniso_plugins.metrics.bottleneck.probe import (
    eps_key,
    hidden_logit_direction,
    sample_loss_positions,
    update_efficiency,
    update_efficiency_finish,
    update_efficiency_loss_stats,
    update_efficiency_stats,
)
from aniso_plugins.methods.heads.lowrank import LowRankHead
from dist_utils import run_distributed
from test_bottleneck import ref_bottleneck

IGNORE = -100
EPS = (1e-3, 1e-2, 0.1, 1.0)
UE = "aniso/bottleneck/update_efficiency/"


# --- the reference -------------------------------------------------------------------------


def ref_mean_ce(z: np.ndarray, y: np.ndarray) -> float:
    """Mean over rows of −log softmax(z_i)[y_i], written out (max-shifted log-sum-exp)."""
    total = 0.0
    for row, t in zip(z, y):
        m = max(row)
        total += m + math.log(sum(math.exp(v - m) for v in row)) - row[t]
    return total / len(y)


def ref_fro(a: np.ndarray) -> float:
    return math.sqrt(sum(x * x for x in a.ravel()))


def ref_update_efficiency(z, y, g, w, eps=EPS) -> dict[str, float]:
    """The docs/methods.md §9.5 definitions on rows z (k×V), targets y, logit gradients g (any
    positive scale) and the (V, d) head w, in float64."""
    z, g, w = (np.asarray(a, np.float64) for a in (z, g, w))
    p = (g @ w) @ w.T  # ∇_H = G·W, moved back through the head
    l0 = ref_mean_ce(z, y)
    out = {"loss": l0, "tokens": float(len(y))}
    for e in eps:
        dl = l0 - ref_mean_ce(z - e * ref_fro(z) * g / ref_fro(g), y)
        dh = l0 - ref_mean_ce(z - e * ref_fro(z) * p / ref_fro(p), y)
        out[f"{eps_key(e)}/decrease_logits"] = dl
        out[f"{eps_key(e)}/decrease_hidden"] = dh
        out[f"{eps_key(e)}/ratio"] = dh / dl
    out["cos"] = sum(a * b for a, b in zip(g.ravel(), p.ravel())) / (ref_fro(g) * ref_fro(p))
    return out


def ref_logit_grad(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """softmax(z) − onehot(y), float64."""
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p


def assert_metrics(got: dict[str, float], ref: dict[str, float], rtol: float, prefix: str = "") -> None:
    for name, value in ref.items():
        found = got[prefix + name]
        assert found == pytest.approx(value, rel=rtol, abs=1e-12), f"{name}: {found} vs {value}"


def case(k=13, v=40, d=5, seed=0, scale=0.37):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) * 0.8 + 0.2
    h = torch.randn(k, d, generator=g, dtype=torch.float64) * 1.5
    y = torch.randint(0, v, (k,), generator=g)
    z = h @ w.T
    grad = scale * torch.from_numpy(ref_logit_grad(z.numpy(), y.numpy()))
    return z, y, grad, w


# --- the math -------------------------------------------------------------------------------


def test_math_matches_explicit_reference():
    z, y, grad, w = case()
    direction = hidden_logit_direction(grad @ w, w, block_rows=7)  # blocks of vocabulary rows
    gl, wl = grad.tolist(), w.tolist()
    dh = [[sum(gl[i][u] * wl[u][j] for u in range(len(wl))) for j in range(len(wl[0]))] for i in range(len(gl))]
    explicit = [[sum(dh[i][j] * wl[v][j] for j in range(len(wl[0]))) for v in range(len(wl))] for i in range(len(gl))]
    np.testing.assert_allclose(direction.numpy(), np.array(explicit), rtol=1e-12, atol=1e-12)
    got = update_efficiency(z, grad, direction, y, EPS)
    ref = ref_update_efficiency(z.numpy(), y.numpy(), grad.numpy(), w.numpy())
    assert set(got) == set(ref)
    assert_metrics(got, ref, rtol=1e-9)
    assert ref[f"{eps_key(1e-3)}/decrease_logits"] > ref[f"{eps_key(1e-3)}/decrease_hidden"] > 0


def test_float32_rows_match_the_reference_of_their_values():
    z, y, grad, w = case(seed=1)
    z32, g32, w32 = z.float(), grad.float(), w.float()
    direction = hidden_logit_direction(g32 @ w32, w32)
    assert direction.dtype == torch.float32
    got = update_efficiency(z32, g32, direction, y, EPS)
    ref = ref_update_efficiency(z32.double().numpy(), y.numpy(), g32.double().numpy(), w32.double().numpy())
    assert_metrics(got, ref, rtol=1e-4)


def test_low_rank_direction_is_through_the_product():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(30, 3, generator=g, dtype=torch.float64)
    b = torch.randn(3, 6, generator=g, dtype=torch.float64)
    dh = torch.randn(4, 6, generator=g, dtype=torch.float64)
    w = (a.numpy() @ b.numpy())
    np.testing.assert_allclose(hidden_logit_direction(dh @ b.T, a).numpy(), dh.numpy() @ w.T, rtol=1e-12)


def test_statistics_pool_over_parts():
    """Two 'ranks' with different numbers of positions (and an empty third): summed round-0
    statistics, round 1 from the pooled norms, finish = the reference on all rows."""
    z, y, grad, w = case(k=17, seed=3)
    direction = hidden_logit_direction(grad @ w, w)
    parts = [slice(0, 12), slice(12, 17), slice(0, 0)]
    rows = [(z[s], grad[s], direction[s], y[s]) for s in parts]
    reduced: dict[str, torch.Tensor] = {}
    for r in rows:
        for name, stat in update_efficiency_stats(*r, prefix="p/").items():
            assert stat.op == "sum"
            reduced[name] = reduced.get(name, 0) + stat.value
    round1: dict[str, torch.Tensor] = {}
    for r in rows:
        for name, stat in update_efficiency_loss_stats(*r, EPS, reduced, prefix="p/").items():
            round1[name] = round1.get(name, 0) + stat.value
    got = update_efficiency_finish({**reduced, **round1}, EPS, prefix="p/")
    assert_metrics(got, ref_update_efficiency(z.numpy(), y.numpy(), grad.numpy(), w.numpy()), rtol=1e-9)


def test_first_order_ratio_is_the_cosine_and_cauchy_schwarz_bounds_it():
    """ratio → cos as ε → 0 (both decreases are ε‖Z‖⟨∇L, direction⟩ to first order), and
    cos ≤ √(1 − lost_fraction) (P = G·WWᵀ lies in col(W)); equality for WᵀW = c·I."""
    z, y, grad, w = case(k=25, v=60, d=6, seed=4)
    h = torch.linalg.lstsq(w, z.T).solution.T  # z = h·Wᵀ exactly (case builds it so)
    for weight in (w, 3.0 * torch.linalg.qr(w).Q):  # generic, then orthogonal equal-norm columns
        logits = h @ weight.T
        grad = torch.from_numpy(ref_logit_grad(logits.numpy(), y.numpy()))
        got = update_efficiency(logits, grad, hidden_logit_direction(grad @ weight, weight), y, (1e-7,))
        ref = ref_update_efficiency(logits.numpy(), y.numpy(), grad.numpy(), weight.numpy(), eps=(1e-7,))
        assert got["cos"] == pytest.approx(ref["cos"], rel=1e-9)
        assert got[f"{eps_key(1e-7)}/ratio"] == pytest.approx(ref["cos"], rel=1e-4)
        kept = math.sqrt(1 - ref_bottleneck(h.numpy(), weight.numpy(), y.numpy())["lost_fraction"])
        if weight is w:
            assert ref["cos"] < kept - 1e-3
        else:
            assert ref["cos"] == pytest.approx(kept, rel=1e-9)


def test_random_initialisation_loses_most_of_the_decrease():
    """D ≪ V at random init: ratio ≈ cos ≈ √(d/V) ≪ 1 at small ε."""
    g = torch.Generator().manual_seed(5)
    v, d, k = 4096, 32, 256
    w = 0.02 * torch.randn(v, d, generator=g, dtype=torch.float64)
    h = torch.randn(k, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (k,), generator=g)
    z = h @ w.T
    grad = torch.from_numpy(ref_logit_grad(z.numpy(), y.numpy()))
    got = update_efficiency(z, grad, hidden_logit_direction(grad @ w, w), y, (1e-3, 0.1))
    assert got["cos"] == pytest.approx(math.sqrt(d / v), rel=0.15)
    assert got[f"{eps_key(1e-3)}/ratio"] == pytest.approx(got["cos"], rel=0.01)
    assert got[f"{eps_key(0.1)}/ratio"] < 0.2


def test_degenerate_inputs_give_nan():
    z, y, grad, w = case(seed=6)
    direction = hidden_logit_direction(grad @ w, w)
    empty = update_efficiency(z[:0], grad[:0], direction[:0], y[:0], EPS)
    assert empty["tokens"] == 0 and all(math.isnan(v) for k, v in empty.items() if k != "tokens")
    zero = update_efficiency(z, torch.zeros_like(grad), torch.zeros_like(direction), y, EPS)
    assert math.isnan(zero["cos"]) and math.isnan(zero[f"{eps_key(0.1)}/decrease_logits"])
    assert zero["loss"] == pytest.approx(ref_mean_ce(z.numpy(), y.numpy()), rel=1e-12)
    bad = z.clone()
    bad[2, 3] = math.inf
    nonfinite = update_efficiency(bad, grad, direction, y, EPS)
    assert all(math.isnan(v) for k, v in nonfinite.items() if k not in ("tokens", "cos"))


def test_sampling_and_keys():
    y = torch.arange(60).reshape(3, 20)
    y[:, ::3] = IGNORE
    valid = set((y.reshape(-1) != IGNORE).nonzero().squeeze(1).tolist())
    idx = sample_loss_positions(y, 9, torch.Generator().manual_seed(1))
    assert idx.tolist() == sorted(set(idx.tolist())) and len(idx) == 9 and set(idx.tolist()) <= valid
    again = sample_loss_positions(y, 9, torch.Generator().manual_seed(1))
    other = sample_loss_positions(y, 9, torch.Generator().manual_seed(2))
    assert torch.equal(idx, again) and not torch.equal(idx, other)
    assert set(sample_loss_positions(y, 500, torch.Generator()).tolist()) == valid
    assert [eps_key(e) for e in (0.001, 0.01, 1e-5, 1.0)] == ["eps_0.001", "eps_0.01", "eps_1e-05", "eps_1.0"]
    with pytest.raises(ValueError, match="k=0"):
        sample_loss_positions(y, 0, torch.Generator())


# --- the probe in a real HF Trainer run --------------------------------------------------------


class HeadCapture:
    """Per training forward: the head's logits and the weight it used (cloned)."""

    def __init__(self, head: nn.Module) -> None:
        self.logits: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        head.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if module.training:
            self.logits.append(output.detach().clone())
            self.weights.append(module.weight.detach().clone())


def autograd_reference(logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, rows=None):
    """The reference of one probed micro-batch: G = ∂L/∂Z of the model's mean CE by autograd
    (float64), restricted to the loss positions (or `rows`)."""
    z = logits.reshape(-1, logits.shape[-1]).double().requires_grad_(True)
    y = targets.reshape(-1)
    F.cross_entropy(z, y, ignore_index=IGNORE).backward()
    keep = (y != IGNORE).nonzero().squeeze(1) if rows is None else rows
    z, g = z.detach()[keep].numpy(), z.grad[keep].numpy()
    return ref_update_efficiency(z, y[keep].numpy(), g, weight.double().numpy())


@pytest.mark.parametrize("variant", ["untied", "tied", "sampled"])
def test_hf_trainer_probe_equals_autograd_reference(tmp_path, variant):
    from transformers import Trainer, TrainingArguments  # here: the 2-rank workers import this module

    from aniso_plugins.integrations.hf import AnisoCallback
    from hf_utils import TokenDataset, tiny_gpt2

    k = 7 if variant == "sampled" else 256
    model = tiny_gpt2()
    cap = HeadCapture(model.lm_head)
    cfg = AnisoConfig(
        head="keep" if variant == "tied" else "untie", metrics=("bottleneck",), update_efficiency=True,
        update_efficiency_eps=EPS, update_efficiency_positions=k, metrics_every=1, load_entry_points=False,
    )
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0,
        data_seed=0, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2, learning_rate=0.05,
        logging_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[AnisoCallback(cfg)])
    labels = []
    model.register_forward_pre_hook(
        lambda m, a, kw: labels.append(kw["labels"].clone()) if m.training else None, with_kwargs=True
    )
    trainer.train()
    assert (model.lm_head.weight is model.transformer.wte.weight) == (variant == "tied")
    logged = [r for r in trainer.state.log_history if UE + "loss" in r]
    assert [r["step"] for r in logged] == [1, 2]
    for row, forward in zip(logged, (0, 2)):  # micro-batch 0 of each step
        targets = torch.cat([labels[forward][:, 1:], torch.full_like(labels[forward][:, :1], IGNORE)], dim=1)
        rows = None
        if variant == "sampled":  # the positions the probe drew (its seed: step, rank 0)
            from aniso_plugins.metrics.bottleneck.plugin import SEED_STRIDE

            gen = torch.Generator().manual_seed(SEED_STRIDE * row["step"])
            rows = sample_loss_positions(targets, k, gen)
            assert row[UE + "tokens"] == k
        ref = autograd_reference(cap.logits[forward], targets, cap.weights[forward], rows)
        assert_metrics(row, ref, rtol=2e-5, prefix=UE)
        if variant != "sampled":  # same positions as the bottleneck probe: the Cauchy–Schwarz bound
            assert row[UE + "tokens"] == row["aniso/bottleneck/tokens"]
            assert row[UE + "cos"] <= math.sqrt(1 - row["aniso/bottleneck/lost_fraction"]) + 1e-6


def test_zero_head_reports_nan_with_a_warning(caplog):
    """A zero head: ‖Z‖ = 0 and P = 0, nothing to step along: NaN and one warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 4), nn.Linear(4, 20, bias=False))
    nn.init.zeros_(model[1].weight)
    plugins = AnisoPlugins(AnisoConfig(metrics=("bottleneck",), update_efficiency=True, load_entry_points=False))
    plugins.setup(ModelHandle(model, head="1", input_embedding="0"))
    ids = torch.randint(0, 20, (2, 5))
    plugins.targets(ids, StepInfo(step=1, measure=True))
    F.cross_entropy(model(ids).reshape(-1, 20), ids.reshape(-1)).backward()
    with caplog.at_level(logging.WARNING, logger="aniso_plugins"):
        metrics = plugins.measure(StepInfo(step=1, measure=True))
    assert metrics[UE + "loss"] == pytest.approx(math.log(20), rel=1e-12)
    assert math.isnan(metrics[UE + "cos"]) and math.isnan(metrics[UE + "eps_0.1/ratio"])
    assert "update efficiency" in caplog.text and "NaN" in caplog.text


def test_low_rank_head():
    """W = A·B: the probe's P goes through the factors; reference from the product."""
    torch.manual_seed(1)
    v, d = 30, 6
    model = nn.Sequential(nn.Embedding(v, d), nn.Tanh(), LowRankHead(d, v, rank=2)).double()
    plugins = AnisoPlugins(
        AnisoConfig(metrics=("bottleneck",), update_efficiency=True, update_efficiency_eps=EPS, load_entry_points=False)
    )
    plugins.setup(ModelHandle(model, head="2"))
    ids = torch.randint(0, v, (3, 6))
    y = torch.cat([ids[:, 1:], torch.full((3, 1), IGNORE)], dim=1)
    weight = model[2].weight.detach().clone()
    plugins.targets(y, StepInfo(step=1, measure=True))
    logits = model(ids)
    F.cross_entropy(logits.reshape(-1, v), y.reshape(-1), ignore_index=IGNORE).backward()
    metrics = plugins.measure(StepInfo(step=1, measure=True))
    assert_metrics(metrics, autograd_reference(logits.detach(), y, weight), rtol=1e-9, prefix=UE)


# --- 2 gloo ranks ---------------------------------------------------------------------------

V, D = 51, 6  # 51 head rows: FSDP2 shards of 26 and 25


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])
        self.lm_head = nn.Linear(D, V, bias=False)
        with torch.no_grad():
            self.lm_head.weight.add_(0.2)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.lm_head(x)


def _rank_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + 10 * rank)
    ids = torch.randint(0, V, (4, 6), generator=g)
    y = torch.cat([ids[:, 1:], torch.full((4, 1), IGNORE)], dim=1)
    if rank == 1:  # unequal numbers of loss positions per rank
        y[2, :3] = IGNORE
    return ids, y


def _worker(rank: int, world: int, mode: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_default_dtype(torch.float64)
    model = LM()
    config = AnisoConfig(
        metrics=("bottleneck",), update_efficiency=True, update_efficiency_eps=EPS, load_entry_points=False
    )
    plugins = AnisoPlugins(config)
    plugins.setup(ModelHandle(model, head="lm_head", input_embedding="embed", blocks="blocks"))
    logits: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda m, a, out: logits.append(out.detach().clone()))
    if mode == "fsdp2":  # the head in its own group, resharded after forward (storage freed)
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.lm_head, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh)
        assert type(model.lm_head.weight).__name__ == "DTensor"
        wrapped = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in (1, 2):
        ids, y = _rank_batch(rank, step)
        plugins.targets(y, StepInfo(step=step, measure=step == 2))
        count = torch.tensor(float((y != IGNORE).sum()))
        dist.all_reduce(count)  # one token weight on every rank (a global token mean, as HF's Trainer)
        loss = F.cross_entropy(wrapped(ids).reshape(-1, V), y.reshape(-1), ignore_index=IGNORE, reduction="sum")
        (loss * world / count).backward()  # DDP / FSDP2 average over ranks
        w_used = full_rows(model.lm_head.weight).detach().clone()
        opt.step()
        opt.zero_grad()
        plugins.step_end(StepInfo(step=step))
    metrics = plugins.measure(StepInfo(step=2, measure=True))
    return {"metrics": metrics, "logits": logits[-1].reshape(-1, V), "targets": y.reshape(-1), "w_used": w_used}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_equal_single_process_on_pooled_positions(mode):
    r0, r1 = run_distributed(_worker, mode)
    assert r0["metrics"].keys() == r1["metrics"].keys()
    for name, value in r0["metrics"].items():  # every rank finished the same floats
        assert value == r1["metrics"][name], name
    assert torch.equal(r0["w_used"], r1["w_used"])
    z = torch.cat([r["logits"] for r in (r0, r1)]).numpy()
    y = torch.cat([r["targets"] for r in (r0, r1)]).numpy()
    keep = y != IGNORE
    z, y = z[keep], y[keep]
    assert (r0["targets"] != IGNORE).sum() != (r1["targets"] != IGNORE).sum()
    ref = ref_update_efficiency(z, y, ref_logit_grad(z, y), r0["w_used"].numpy())
    assert_metrics(r0["metrics"], ref, rtol=1e-6, prefix=UE)
