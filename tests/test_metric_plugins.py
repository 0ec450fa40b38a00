"""The metric plugins driven through `AnisoPlugins` as an adapter would (setup, targets with
StepInfo, forward/backward, optimizer step, step_end, measure, eval_batch), against
independent float64 references computed from the captured weights and activations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aniso_plugins import AnisoConfig, AnisoPlugins, ModelHandle, SetupError, StepInfo
from test_bottleneck import ref_bottleneck
from test_geometry import (
    ref_cross_cosine,
    ref_effective_rank,
    ref_isoscore,
    ref_isotropy,
    ref_mean_cosine,
    ref_singular_entropy,
    ref_singular_values,
)

V, D, LAYERS, IGNORE = 50, 8, 2, -100
GROUP_NAMES = ("rare", "medium", "frequent")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class TinyLM(nn.Module):
    def __init__(self, tied: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(D) for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight
        with torch.no_grad():  # an anisotropic start: a shared offset on every embedding
            self.embed.weight.add_(0.7)
            if not tied:
                self.lm_head.weight.add_(0.3)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def handle(model: nn.Module) -> ModelHandle:
    return ModelHandle(model, head="lm_head", input_embedding="embed", blocks="blocks")


def batch(seed: int, b: int = 3, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    # a skewed token distribution, so that the frequency groups differ from the id order
    probs = torch.linspace(1.0, 0.05, V) ** 3
    ids = torch.multinomial(probs, b * t, replacement=True, generator=g).reshape(b, t)
    targets = torch.cat([ids[:, 1:], torch.full((b, 1), IGNORE)], dim=1)
    targets[0, 2] = IGNORE
    return ids, targets


class Capture:
    """The test's own hooks: head input and weight at forward time, block outputs."""

    def __init__(self, model: TinyLM) -> None:
        self.head_inputs: list[torch.Tensor] = []
        self.head_weights: list[torch.Tensor] = []
        self.blocks: dict[int, list[torch.Tensor]] = {i: [] for i in range(LAYERS)}
        model.lm_head.register_forward_hook(self._head)
        for i, block in enumerate(model.blocks):
            block.register_forward_hook(self._block(i))

    def _head(self, module, args, output):
        self.head_inputs.append(args[0].detach().clone())
        self.head_weights.append(module.weight.detach().clone())

    def _block(self, i):
        def hook(module, args, output):
            self.blocks[i].append(output.detach().clone())

        return hook


def train(plugins, model, steps, accumulation=1, measure=lambda s: True, loss_extra=None):
    """What an adapter does per optimizer step; returns the metrics measured after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = {}
    for step in range(1, steps + 1):
        for mb in range(accumulation):
            ids, y = batch(100 * step + mb)
            info = StepInfo(step=step, micro_batch=mb, accumulation_steps=accumulation, measure=measure(step))
            plugins.targets(y, info)
            logits = model(ids)
            loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=IGNORE) / accumulation
            if loss_extra is not None:
                loss = loss + loss_extra(model)
            loss.backward()
        opt.step()
        opt.zero_grad()
        plugins.step_end(StepInfo(step=step, accumulation_steps=accumulation))
        if measure(step):
            out[step] = plugins.measure(StepInfo(step=step, measure=True))
    return out


def all_targets(steps, accumulation=1):
    return torch.cat([batch(100 * s + mb)[1].reshape(-1) for s in range(1, steps + 1) for mb in range(accumulation)])


def ref_groups(counts: np.ndarray, fractions=(0.2, 0.5, 0.3)) -> np.ndarray:
    """0 rare / 1 medium / 2 frequent: order by count descending, ties by ascending id."""
    v = len(counts)
    order = sorted(range(v), key=lambda k: (-counts[k], k))
    n_rare, n_freq = math.floor(fractions[0] * v + 0.5), math.floor(fractions[2] * v + 0.5)
    groups = np.ones(v, dtype=int)
    groups[order[:n_freq]] = 2
    groups[order[v - n_rare :]] = 0
    return groups


def ref_geometry(w: np.ndarray) -> dict[str, float]:
    s_raw = ref_singular_values(w, center=False)
    s_cen = ref_singular_values(w, center=True)
    norm = s_raw / s_raw[0]
    return {
        "mean_cosine": ref_mean_cosine(w),
        "mean_cosine_centered": ref_mean_cosine(w, center=True),
        "isotropy": ref_isotropy(w),
        "isotropy_centered": ref_isotropy(w, center=True),
        "effective_rank": ref_effective_rank(w, center=True, variant="sigma"),
        "effective_rank_sigma2": ref_effective_rank(w, center=True, variant="sigma2"),
        "singular_entropy": ref_singular_entropy(w, center=False),
        "sigma_max": s_raw[0],
        "sv_normalized_q25": norm[int(0.25 * (len(norm) - 1))],
        "sv_normalized_q50": norm[int(0.5 * (len(norm) - 1))],
        "sv_normalized_q75": norm[int(0.75 * (len(norm) - 1))],
        "variance_share_top1": (s_cen[:1] ** 2).sum() / (s_cen**2).sum(),
        "variance_share_top3": (s_cen[:3] ** 2).sum() / (s_cen**2).sum(),
        "isoscore": ref_isoscore(w),
    }


def assert_close(got: float, ref: float, name: str, rtol: float = 1e-7, atol: float = 1e-9) -> None:
    assert got == pytest.approx(ref, rel=rtol, abs=atol), f"{name}: {got} vs {ref}"


def config(**kw) -> AnisoConfig:
    kw.setdefault("metrics", ("geometry", "frequency", "hidden", "bottleneck", "eval"))
    return AnisoConfig(load_entry_points=False, hidden_samples=1000, **kw)


def test_all_metric_plugins_match_references_untied_with_accumulation():
    model = TinyLM().double()
    plugins = AnisoPlugins(config())
    plugins.setup(handle(model))
    cap = Capture(model)
    metrics = train(plugins, model, steps=2, accumulation=2)[2]

    # geometry of the head and of the untied input embedding (weights after the step)
    for name, weight in (("head", model.lm_head.weight), ("embedding", model.embed.weight)):
        for key, ref in ref_geometry(weight.detach().numpy()).items():
            assert_close(metrics[f"aniso/geometry/{name}/{key}"], float(ref), f"{name}/{key}")

    # frequency groups from the counts of all training targets (both micro-batches)
    counts = np.bincount(all_targets(2, 2).numpy()[all_targets(2, 2).numpy() != IGNORE], minlength=V)
    groups = ref_groups(counts)
    w = model.lm_head.weight.detach().numpy()
    for index, group in enumerate(GROUP_NAMES):
        rows = w[groups == index]
        assert_close(metrics[f"aniso/frequency/{group}/isotropy"], ref_isotropy(rows), f"{group} isotropy")
        assert_close(metrics[f"aniso/frequency/{group}/mean_cosine"], ref_mean_cosine(rows), f"{group} cosine")
    ref = ref_cross_cosine(w[groups == 0], w[groups == 2])
    assert_close(metrics["aniso/frequency/rare_frequent_cosine"], ref, "rare-frequent")

    # hidden states: micro-batch 0 of step 2 (the 3rd forward), all valid positions sampled
    y0 = batch(200)[1].reshape(-1).numpy()
    for i in range(LAYERS):
        out = cap.blocks[i][2].reshape(-1, D).numpy()
        assert_close(metrics[f"aniso/hidden/layer_{i}/mean_cosine"], ref_mean_cosine(out[y0 != IGNORE]), f"layer {i}")

    # bottleneck probe: micro-batch 0 of step 2, with the weight the head used then
    ref = ref_bottleneck(cap.head_inputs[2].reshape(-1, D).numpy(), cap.head_weights[2].numpy(), y0)
    for key, value in ref.items():
        assert_close(metrics[f"aniso/bottleneck/{key}"], value, f"bottleneck/{key}", rtol=1e-9)
    assert metrics["aniso/bottleneck/tokens"] == (y0 != IGNORE).sum()
    assert not any(k.startswith("aniso/eval/") for k in metrics)


def test_eval_plugin_perplexity_and_uniq_per_group():
    model = TinyLM().double()
    plugins = AnisoPlugins(config(metrics=("eval",)))
    plugins.setup(handle(model))
    train(plugins, model, steps=2, measure=lambda s: False)
    g = torch.Generator().manual_seed(5)
    logits = [torch.randn(2, 6, V, generator=g, dtype=torch.float64) * 3 for _ in range(2)]
    targets = [torch.randint(0, V, (2, 6), generator=g) for _ in range(2)]
    targets[1][0, :2] = IGNORE
    for z, y in zip(logits, targets):
        plugins.eval_batch(z, y)
    got = plugins.measure(StepInfo(step=2, measure=True), kind="eval")

    counts = np.bincount(all_targets(2).numpy()[all_targets(2).numpy() != IGNORE], minlength=V)
    groups = ref_groups(counts)
    z = torch.cat([x.reshape(-1, V) for x in logits]).numpy()
    y = torch.cat([t.reshape(-1) for t in targets]).numpy()
    z, y = z[y != IGNORE], y[y != IGNORE]
    nll = np.array([np.log(np.exp(row - row.max()).sum()) + row.max() - row[t] for row, t in zip(z, y)])
    pred = set(z.argmax(1).tolist())
    assert_close(got["aniso/eval/ppl"], math.exp(nll.mean()), "ppl")
    assert got["aniso/eval/uniq"] == len(pred)
    for index, group in enumerate(GROUP_NAMES):
        member = groups[y] == index
        ref = math.exp(nll[member].mean()) if member.any() else math.nan
        assert got[f"aniso/eval/ppl_{group}"] == pytest.approx(ref, rel=1e-7, nan_ok=True), group
        assert got[f"aniso/eval/uniq_{group}"] == sum(groups[p] == index for p in pred)
    # finished measurements reset: nothing seen since
    again = plugins.measure(StepInfo(step=3, measure=True), kind="eval")
    assert math.isnan(again["aniso/eval/ppl"]) and again["aniso/eval/uniq"] == 0
    assert plugins.measure(StepInfo(step=3, measure=True), kind="train") == {}


def test_tied_model_measures_the_head_only():
    model = TinyLM(tied=True).double()
    plugins = AnisoPlugins(config(metrics=("geometry",)))
    plugins.setup(handle(model))
    metrics = train(plugins, model, steps=1)[1]
    assert not any("/embedding/" in k for k in metrics)
    ref = ref_isotropy(model.lm_head.weight.detach().numpy())
    assert_close(metrics["aniso/geometry/head/isotropy"], ref, "isotropy")


def test_mean_norm_ratio_of_the_head_and_the_embedding():
    """‖μ‖ / mean_i ‖w_i‖ against numpy, for the untied head and embedding, and 0 after centring."""
    model = TinyLM(tied=False).double()
    with torch.no_grad():
        model.lm_head.weight.add_(0.3)  # a common component: the ratio well inside (0, 1)
    plugins = AnisoPlugins(config(metrics=("geometry",)))
    plugins.setup(handle(model))
    metrics = train(plugins, model, steps=1)[1]
    for name, weight in (("head", model.lm_head.weight), ("embedding", model.embed.weight)):
        w = weight.detach().numpy()
        ref = np.linalg.norm(w.mean(0)) / np.linalg.norm(w, axis=1).mean()
        assert_close(metrics[f"aniso/geometry/{name}/mean_norm_ratio"], ref, name)
    assert 0.1 < metrics["aniso/geometry/head/mean_norm_ratio"] < 0.99
    with torch.no_grad():
        model.lm_head.weight.sub_(model.lm_head.weight.mean(0))
    centred = plugins.measure(StepInfo(step=2, measure=True))
    assert centred["aniso/geometry/head/mean_norm_ratio"] < 1e-12


class GatedLinear(torch.autograd.Function):
    """An AGG-style head: ordinary gradient into the input, a scaled one into the weight."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gw = grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        return grad @ w, 0.25 * gw


def test_bottleneck_schedule_and_forward_override():
    """Probes every 2nd step only; hooks still work when the head's forward is replaced by an
    instance attribute (as the AGG plugin does)."""
    model = TinyLM().double()
    plugins = AnisoPlugins(config(metrics=("bottleneck",), bottleneck_every=2))
    plugins.setup(handle(model))
    head = model.lm_head
    head.forward = lambda x: GatedLinear.apply(x, head.weight)
    cap = Capture(model)
    results = train(plugins, model, steps=3)
    assert not any(k.startswith("aniso/bottleneck/") for k in results[1])
    assert not any(k.startswith("aniso/bottleneck/") for k in results[3])
    y = batch(200)[1].reshape(-1).numpy()
    ref = ref_bottleneck(cap.head_inputs[1].reshape(-1, D).numpy(), cap.head_weights[1].numpy(), y)
    for key, value in ref.items():
        assert_close(results[2][f"aniso/bottleneck/{key}"], value, key, rtol=1e-9)


def test_bottleneck_ignores_other_consumers_of_the_head_input():
    """dh is the head's own contribution even when the head input also feeds another loss."""
    model = TinyLM().double()
    plugins = AnisoPlugins(config(metrics=("bottleneck",)))
    plugins.setup(handle(model))
    cap = Capture(model)
    h_seen = []
    model.norm.register_forward_hook(lambda m, a, out: h_seen.append(out))
    metrics = train(plugins, model, steps=1, loss_extra=lambda m: 5.0 * h_seen[-1].pow(2).sum())[1]
    y = batch(100)[1].reshape(-1).numpy()
    ref = ref_bottleneck(cap.head_inputs[0].reshape(-1, D).numpy(), cap.head_weights[0].numpy(), y)
    for key, value in ref.items():
        assert_close(metrics[f"aniso/bottleneck/{key}"], value, key, rtol=1e-9)


def test_hidden_states_only_on_measurement_micro_batches_and_bounded_sample():
    model = TinyLM().double()
    plugins = AnisoPlugins(AnisoConfig(metrics=("hidden",), hidden_samples=4, load_entry_points=False))
    plugins.setup(handle(model))
    # nothing announced with measure=True: no sample, NaN
    train(plugins, model, steps=1, measure=lambda s: False)
    empty = plugins.measure(StepInfo(step=1, measure=True))
    assert all(math.isnan(empty[f"aniso/hidden/layer_{i}/mean_cosine"]) for i in range(LAYERS))
    results = train(plugins, model, steps=1)
    plugin = plugins.get("hidden")
    assert all(math.isfinite(v) for v in results[1].values())
    assert plugin._stats == {}  # reset after the measurement
    # the bound: 4 samples per layer, whatever the batch size
    plugins.targets(batch(9)[1], StepInfo(step=5, measure=True))
    model(batch(9)[0])
    assert [float(plugin._stats[i]["hidden/layer_%d/nonzero" % i].value) for i in range(LAYERS)] == [4.0, 4.0]
    # targets that do not match the block outputs' positions: every position is a candidate
    wide = AnisoPlugins(AnisoConfig(metrics=("hidden",), hidden_samples=1000, load_entry_points=False))
    wide.setup(handle(model))
    ids, y = batch(9)
    wide.targets(y[:, :-1], StepInfo(step=1, measure=True))
    model(ids)
    assert float(wide.get("hidden")._stats[0]["hidden/layer_0/nonzero"].value) == ids.numel()


def test_bottleneck_records_nothing_without_a_head_input_gradient():
    model = TinyLM().double()
    for module in (model.embed, model.blocks, model.norm):
        module.requires_grad_(False)
    plugins = AnisoPlugins(config(metrics=("bottleneck",)))
    plugins.setup(handle(model))
    assert train(plugins, model, steps=1)[1] == {}


def test_counters_are_checkpointed(tmp_path):
    model = TinyLM().double()
    cfg = config(metrics=("frequency", "eval"))
    plugins = AnisoPlugins(cfg)
    plugins.setup(handle(model))
    train(plugins, model, steps=2, measure=lambda s: False)
    path = tmp_path / "state.safetensors"
    plugins.save(path)
    restored = AnisoPlugins(cfg)
    restored.setup(handle(TinyLM().double()))
    restored.load(path)
    expected = torch.bincount(all_targets(2)[all_targets(2) != IGNORE], minlength=V)
    assert torch.equal(restored.get("target_counts").counter.counts, expected)
    assert restored.get("frequency").counts is restored.get("eval").counts is restored.get("target_counts")


def test_setup_and_input_errors():
    model = TinyLM().double()
    with pytest.raises(SetupError, match="blocks="):
        AnisoPlugins(config(metrics=("hidden",))).setup(ModelHandle(model, head="lm_head"))
    plugins = AnisoPlugins(config(metrics=("frequency", "eval")))
    plugins.setup(handle(model))
    with pytest.raises(ValueError, match=r"ids must be in \[0, 50\).*got values in \[1, 50\]"):
        plugins.targets(torch.tensor([[1, 50]]), StepInfo(step=1))
    with pytest.raises(ValueError, match="expected logits"):
        plugins.eval_batch(torch.zeros(2, 3, V + 1), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="aniso_setup"):
        AnisoPlugins(config(metrics=("geometry",))).measure(StepInfo(step=1, measure=True))


def test_groups_of_the_seen_ids_leave_the_unseen_in_none():
    from aniso_plugins.metrics.frequency.groups import UNSEEN, frequency_groups

    counts = torch.tensor([5, 0, 3, 0, 9, 1, 1, 0, 2, 7, 4])
    seen = [k for k in sorted(range(len(counts)), key=lambda k: (-int(counts[k]), k)) if counts[k] > 0]  # 8 ids
    ref = np.full(len(counts), UNSEEN)
    ref[seen] = 1
    ref[seen[:2]] = 2  # round(0.3 · 8) = 2 frequent
    ref[seen[-2:]] = 0  # round(0.2 · 8) = 2 rare
    assert frequency_groups(counts, (0.2, 0.5, 0.3), seen_only=True).tolist() == ref.tolist()
    assert (frequency_groups(counts) != UNSEEN).all()  # the vocabulary form: every id in a group
