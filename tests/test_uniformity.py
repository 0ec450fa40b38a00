"""Uniformity (Wang & Isola 2020) as a regularizer and as a metric (single process; the 2-rank
checks are at the end, marked slow). References are written here: explicit float64 double loops
over ordered pairs (small inputs) and a dense float64 broadcast of ‖x̂_i − x̂_j‖² (trainer tests),
autograd through them for gradients."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aniso_plugins import AnisoConfig, AnisoPlugins, ConfigError, ModelHandle, SetupError, StepInfo, TrainingSession
from aniso_plugins.methods.uniformity.kernels import pair_logsumexp, row_uniformity, uniformity_finish, uniformity_stats
from dist_utils import run_distributed
from device_discipline import LargestTensor
from test_regularizers import _sampled_rows

V, D, T = 29, 5, 2.0
IGNORE = -100


def _weight(v: int = V, d: int = D, seed: int = 0, zero_rows=(5,)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) + 0.4  # a shared direction
    w[list(zero_rows)] = 0.0
    return w


# --- references -------------------------------------------------------------------------------


def ref_loop(x: torch.Tensor, t: float, exclude=(), rows=None, population=None) -> torch.Tensor:
    """log( c / (N(N−1)) Σ_{i∈rows} Σ_{j≠i} exp(−t‖x̂_i − x̂_j‖²) ) by an explicit double loop over
    ordered pairs of valid rows (nonzero, not excluded), float64; c = population/len(rows) for
    sampled rows, 1 otherwise. Differentiable."""
    x = x.to(torch.float64)
    valid = [i for i in range(len(x)) if i not in exclude and float(x[i].detach().norm()) > 0]
    unit = {i: x[i] / x[i].norm() for i in valid}
    first = valid if rows is None else [i for i in rows if i in unit]
    total = x.new_zeros(())
    for i in first:
        for j in valid:
            if j != i:
                total = total + torch.exp(-t * (unit[i] - unit[j]).square().sum())
    n = len(valid)
    scale = 1.0 if rows is None else population / len(rows)
    return torch.log(scale * total / (n * (n - 1)))


def ref_dense(x: torch.Tensor, t: float) -> torch.Tensor:
    """The same over all valid (nonzero) rows through a float64 (n, n, d) broadcast of x̂_i − x̂_j."""
    x = x.to(torch.float64)
    x = x[x.detach().norm(dim=1) > 0]
    u = x / x.norm(dim=1, keepdim=True)
    sq = (u[:, None, :] - u[None, :, :]).square().sum(-1)
    off = ~torch.eye(len(u), dtype=torch.bool)
    return torch.log(torch.exp(-t * sq[off]).mean())


def _value_and_grad(fn, w: torch.Tensor):
    w = w.clone().requires_grad_(True)
    value = fn(w)
    (grad,) = torch.autograd.grad(value, w)
    return value.detach(), grad


_REFS: dict = {}


def _ref(w_key: str, w: torch.Tensor, t: float, exclude=(), rows=None, population=None):
    key = (w_key, t, tuple(exclude), None if rows is None else tuple(rows))
    if key not in _REFS:
        _REFS[key] = _value_and_grad(lambda x: ref_loop(x, t, exclude, rows, population), w)
    return _REFS[key]


# --- the head regularizer (the function) -------------------------------------------------------


@pytest.mark.parametrize("t", [2.0, 0.7])
@pytest.mark.parametrize("block", [1, 4, 13, 29, 1000])
def test_exact_matches_double_loop_for_every_block(block, t):
    w, exclude = _weight(), (2, 28)
    got, got_grad = _value_and_grad(lambda x: row_uniformity(x, t, block=block, exclude_ids=exclude), w)
    ref, ref_grad = _ref("w", w, t, exclude)
    assert got.dtype == torch.float64 and got.dim() == 0
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(got_grad, ref_grad, rtol=1e-10, atol=1e-13)
    for i in (5, 2, 28):  # the zero row and the excluded rows: no gradient, no NaN
        assert got_grad[i].abs().max() == 0
    assert torch.isfinite(got_grad).all()


@pytest.mark.parametrize("block", [3, 1000])
def test_sampled_matches_double_loop_on_the_seeded_rows(block):
    w, exclude, sample, seed = _weight(), (3,), 8, 2
    rows = _sampled_rows(seed, exclude, sample, v=V)
    assert 5 in rows  # the zero row is drawn: it takes part in no pair
    population = V - len(exclude)
    got, got_grad = _value_and_grad(
        lambda x: row_uniformity(
            x, T, block=block, sample=sample, generator=torch.Generator().manual_seed(seed), exclude_ids=exclude
        ),
        w,
    )
    ref, ref_grad = _ref("w", w, T, exclude, rows, population)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(got_grad, ref_grad, rtol=1e-10, atol=1e-13)
    assert got_grad[3].abs().max() == 0 and got_grad[5].abs().max() == 0


def test_sampled_pair_mean_is_unbiased_and_sample_of_all_rows_is_exact():
    w = _weight(v=10, d=3, zero_rows=())
    exact, exact_grad = _value_and_grad(lambda x: row_uniformity(x, T).exp(), w)
    gen = torch.Generator().manual_seed(0)
    draws, grads = [], []
    for _ in range(400):  # exp(L̂) is the estimated pair mean
        value, grad = _value_and_grad(lambda x: row_uniformity(x, T, sample=3, generator=gen).exp(), w)
        draws.append(value)
        grads.append(grad)
    draws, grads = torch.stack(draws), torch.stack(grads)
    se = draws.std() / math.sqrt(len(draws))
    assert abs(draws.mean() - exact) < 4 * se and float(draws.std()) > 0
    grad_se = grads.std(0) / math.sqrt(len(grads))
    assert ((grads.mean(0) - exact_grad).abs() <= 4 * grad_se + 1e-12).float().mean() > 0.95
    everything = row_uniformity(w, T, sample=10, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(everything, ref_dense(w, T), rtol=1e-12, atol=0)


def test_large_t_stays_finite_in_float32():
    # t = 1500: exp(−t‖·‖²) underflows float32 for every pair, so a plain float32 sum is 0 (log −inf)
    w, t = _weight(v=24, d=6, seed=1, zero_rows=()), 1500.0
    u = w.float() / w.float().norm(dim=1, keepdim=True)
    off = ~torch.eye(24, dtype=torch.bool)
    assert float(torch.exp(-t * (u[:, None] - u[None]).square().sum(-1)[off]).sum()) == 0.0
    ref, ref_grad = _value_and_grad(lambda x: ref_loop(x, t), w)
    got, got_grad = _value_and_grad(lambda x: row_uniformity(x.float(), t, block=5), w)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_grad, ref_grad, rtol=0, atol=1e-5 * float(ref_grad.abs().max()))
    sampled = row_uniformity(
        w.float(), t, block=5, sample=10, generator=torch.Generator().manual_seed(0)
    )
    rows = _sampled_rows(0, (), 10, v=24)
    torch.testing.assert_close(sampled, ref_loop(w, t, rows=rows, population=24).detach(), rtol=1e-6, atol=0)


def test_float32_bf16_and_autocast_accumulate_in_float32():
    w = _weight(v=60, d=8)
    ref = ref_dense(w, T)
    torch.testing.assert_close(row_uniformity(w.float(), T, block=16), ref, rtol=1e-6, atol=1e-7)
    wb = w.bfloat16()
    torch.testing.assert_close(row_uniformity(wb, T, block=16), ref_dense(wb.double(), T), rtol=1e-6, atol=1e-7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(row_uniformity(w.float(), T, block=16), ref, rtol=1e-6, atol=1e-7)


def test_memory_is_block_times_rows_never_rows_squared():
    v, d, block = 161, 8, 16
    w = _weight(v=v, d=d).float().requires_grad_(True)
    with LargestTensor() as probe:
        row_uniformity(w, T, block=block).backward()
    assert v * block <= probe.largest <= max(v * block, v * (d + 1)) < v * v // 4
    with LargestTensor() as probe:
        row_uniformity(w, T, block=block, sample=20).backward()
    assert probe.largest <= max(v * block, v * (d + 1))


def test_fewer_than_two_rows_or_no_sampled_partner_give_a_connected_zero():
    w = torch.zeros(6, 3, dtype=torch.float64)
    w[4] = 1.0
    value, grad = _value_and_grad(lambda x: row_uniformity(x, T), w)  # N = 1
    assert float(value) == 0.0 and grad.abs().max() == 0
    w = _weight(v=10, d=3, zero_rows=range(8))  # rows 8, 9 valid; a sample of one zero row
    seed = next(s for s in range(100) if _sampled_rows(s, (), 1, v=10)[0] < 8)
    value, grad = _value_and_grad(
        lambda x: row_uniformity(x, T, sample=1, generator=torch.Generator().manual_seed(seed)), w
    )
    assert float(value) == 0.0 and grad.abs().max() == 0


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda w: row_uniformity(w, T, block=0), ["block=0", ">= 1"]),
        (lambda w: row_uniformity(w, T, sample=0), ["sample=0", "None"]),
        (lambda w: row_uniformity(w, 0.0), ["t=0.0", "> 0"]),
        (lambda w: row_uniformity(w, float("nan")), ["t=nan"]),
        (lambda w: row_uniformity(w, T, exclude_ids=(V,)), ["exclude_ids=[29]", "[0, 29)"]),
        (lambda w: row_uniformity(w[0], T), ["2-D", "(5,)"]),
        (lambda w: pair_logsumexp(w, T, block=-1), ["block=-1"]),
    ],
)
def test_bad_inputs_raise_clear_errors(call, words):
    with pytest.raises(ValueError) as info:
        call(_weight())
    for word in words:
        assert word in str(info.value)


# --- the metric pieces --------------------------------------------------------------------------


def test_pair_logsumexp_shares_combine_to_the_double_loop():
    x = _weight(v=17, d=4, zero_rows=(0, 9))
    lse, pairs = pair_logsumexp(x, T, block=5)
    assert float(pairs) == 15 * 14
    torch.testing.assert_close(lse - math.log(15 * 14), ref_loop(x, T), rtol=1e-12, atol=0)
    parts = [uniformity_stats(x, T, "u/", block=3, rows=slice(lo, hi)) for lo, hi in ((0, 6), (6, 9), (9, 17))]
    reduced = {
        "u/pair_lse": torch.logsumexp(torch.stack([p["u/pair_lse"].value for p in parts]), 0),
        "u/pairs": sum(p["u/pairs"].value for p in parts),
    }
    assert [p["u/pair_lse"].op for p in parts] == ["lse"] * 3 and parts[0]["u/pairs"].op == "sum"
    assert uniformity_finish(reduced, "u/") == pytest.approx(float(ref_loop(x, T)), rel=1e-12)
    empty = uniformity_stats(torch.zeros(1, 4), T, "e/")
    assert float(empty["e/pairs"].value) == 0 and float(empty["e/pair_lse"].value) == -math.inf
    assert math.isnan(uniformity_finish({k: s.value for k, s in empty.items()}, "e/"))


# --- the plugins on a tiny model ----------------------------------------------------------------


class TinyLM(nn.Module):
    def __init__(self, vocab: int = V, dim: int = D):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(_weight(vocab, dim, seed=3, zero_rows=()).float())

    def hidden(self, ids):
        return torch.tanh(self.mix(self.embed(ids)))

    def forward(self, ids):
        return self.lm_head(self.hidden(ids))


def _batch(seed: int, b: int = 3, length: int = 6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, length), generator=g)
    targets = torch.cat([ids[:, 1:], torch.full((b, 1), IGNORE)], 1)
    return ids, targets


def _plugins(model, **config) -> AnisoPlugins:
    plugins = AnisoPlugins(AnisoConfig(load_entry_points=False, **{"metrics": (), **config}))
    plugins.setup(ModelHandle(model, input_embedding="embed"))
    return plugins


def test_head_term_value_gradient_weight_and_name():
    model = TinyLM()
    plugins = _plugins(model, method="uniformity", uniformity_weight=0.3, reg_exclude_ids=(0, 4), uniformity_block=7)
    term = plugins.loss_terms(StepInfo(step=1))
    w = model.lm_head.weight.detach().double()
    ref, ref_grad = _value_and_grad(lambda x: 0.3 * ref_loop(x, T, (0, 4)), w)
    torch.testing.assert_close(term.detach(), ref, rtol=1e-6, atol=0)
    term.backward()
    torch.testing.assert_close(model.lm_head.weight.grad.double(), ref_grad, rtol=1e-4, atol=1e-7)
    assert plugins.measure(StepInfo(step=1))["aniso/loss/uniformity_head"] == pytest.approx(float(ref), rel=1e-6)
    every = _plugins(model, method="uniformity", uniformity_weight=0.3, reg_exclude_ids=(0, 4), reg_every_microbatch=True)
    step = StepInfo(step=3, micro_batch=1, accumulation_steps=4)
    torch.testing.assert_close(every.loss_terms(step).detach(), ref / 4, rtol=1e-6, atol=0)
    with pytest.raises(ConfigError, match=r"reg_exclude_ids=\(29,\)"):
        _plugins(TinyLM(), method="uniformity", reg_exclude_ids=(V,))


def test_sampled_head_term_is_seeded_by_step_and_micro_batch():
    model = TinyLM()
    a = _plugins(model, method="uniformity", uniformity_sample=6)
    b = _plugins(model, method="uniformity", uniformity_sample=6)  # another rank, or a resumed run
    steps = [StepInfo(step=s, micro_batch=m, accumulation_steps=2) for s, m in ((1, 1), (2, 1), (7, 0))]
    values = [float(a.loss_terms(s).detach()) for s in steps]
    assert values == [float(b.loss_terms(s).detach()) for s in steps] and len(set(values)) == 3
    w = model.lm_head.weight.detach().double()
    rows = _sampled_rows(7 * 65_536 + 0, (), 6, v=V)  # the rows of step 7, micro-batch 0
    assert values[2] == pytest.approx(float(ref_loop(w, T, rows=rows, population=V)), rel=1e-6)


def test_hidden_term_is_the_micro_batch_share_and_zero_without_pairs():
    model = TinyLM()
    plugins = _plugins(model, method="uniformity", uniformity_on="hidden", uniformity_weight=0.5, uniformity_block=4)
    assert plugins.loss_terms(StepInfo(step=1)) is None  # no head term
    ids, y = _batch(1)
    y[0, :3] = IGNORE
    h = model.hidden(ids)
    share = plugins.activation_loss_terms(h, y, StepInfo(step=1, accumulation_steps=2))
    (grad,) = torch.autograd.grad(share, model.mix.weight)
    hv = model.hidden(ids).double()[y != IGNORE]
    ref = 0.5 * ref_loop(hv, T) / 2
    (ref_grad,) = torch.autograd.grad(ref, model.mix.weight)
    torch.testing.assert_close(share.detach(), ref.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(grad.double(), ref_grad.double(), rtol=1e-4, atol=1e-7)
    y[:] = IGNORE
    y[1, 2] = 4  # one position: no pair
    h = model.hidden(ids)
    share = plugins.activation_loss_terms(h, y, StepInfo(step=2))
    (grad,) = torch.autograd.grad(share, h)
    assert float(share) == 0.0 and grad.abs().max() == 0
    with pytest.raises(SetupError, match=r"not aligned"):
        plugins.activation_loss_terms(h, y[:, :-1], StepInfo(step=2))


def _measure_once(model, plugins, ids, y, step: int = 2) -> dict[str, float]:
    plugins.targets(y, StepInfo(step=step, measure=True))
    model(ids).sum().backward()
    plugins.step_end(StepInfo(step=step))
    return plugins.measure(StepInfo(step=step, measure=True))


def test_metric_values_equal_double_loops():
    model = TinyLM()
    seen: list[torch.Tensor] = []
    model.lm_head.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    plugins = _plugins(model, metrics=("uniformity",), hidden_samples=1000, uniformity_rows=V, uniformity_block=5)
    ids, y = _batch(2)
    y[1, :4] = IGNORE
    metrics = _measure_once(model, plugins, ids, y)
    w = model.lm_head.weight.detach().double()
    assert metrics["aniso/uniformity/head"] == pytest.approx(float(ref_loop(w, T)), rel=1e-10)
    hv = seen[0].double()[y != IGNORE]
    assert metrics["aniso/uniformity/hidden"] == pytest.approx(float(ref_loop(hv, T)), rel=1e-10)

    # k < V head rows drawn with the step's seed; k < positions drawn with the rank-seeded generator
    model = TinyLM()
    seen.clear()
    model.lm_head.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    with torch.no_grad():
        model.lm_head.weight[[1, 2]] = 0.0
    plugins = _plugins(model, metrics=("uniformity",), hidden_samples=5, uniformity_rows=11, uniformity_t=1.5)
    metrics = _measure_once(model, plugins, ids, y, step=9)
    rows = torch.randperm(V, generator=torch.Generator().manual_seed(9))[:11].tolist()
    w = model.lm_head.weight.detach().double()
    assert metrics["aniso/uniformity/head"] == pytest.approx(float(ref_loop(w[rows], 1.5)), rel=1e-10)
    flat = seen[0].double().reshape(-1, D)[(y != IGNORE).reshape(-1)]
    pick = torch.randperm(len(flat), generator=torch.Generator().manual_seed(0))[:5]
    assert metrics["aniso/uniformity/hidden"] == pytest.approx(float(ref_loop(flat[pick], 1.5)), rel=1e-10)
    assert plugins.measure(StepInfo(step=9, measure=True), kind="eval") == {}


def test_metric_is_nan_with_one_warning(caplog):
    model = TinyLM()
    plugins = _plugins(model, metrics=("uniformity",))
    with caplog.at_level(logging.WARNING, logger="aniso_plugins"):
        first = plugins.measure(StepInfo(step=1, measure=True))  # no measurement micro-batch was seen
        assert math.isnan(first["aniso/uniformity/hidden"]) and math.isfinite(first["aniso/uniformity/head"])
        with torch.no_grad():
            model.lm_head.weight[3, 0] = float("nan")
        second = plugins.measure(StepInfo(step=2, measure=True))
        plugins.measure(StepInfo(step=3, measure=True))
    assert math.isnan(second["aniso/uniformity/head"])
    messages = [r.getMessage() for r in caplog.records if "uniformity" in r.getMessage()]
    assert len(messages) == 2 and "uniformity/hidden" in messages[0] and "uniformity/head" in messages[1]


# --- real trainers ------------------------------------------------------------------------------


def _hf_trainer(tmp_path, config, model, callbacks, **args):
    from transformers import Trainer, TrainingArguments

    from aniso_plugins.integrations.hf import AnisoCallback
    from hf_utils import TokenDataset

    kw = dict(
        report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0,
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, learning_rate=1e-2, max_grad_norm=0.0,
    )
    kw.update(args)
    return Trainer(
        model=model, args=TrainingArguments(**kw), train_dataset=TokenDataset(),
        callbacks=[AnisoCallback(config), *callbacks],
    )


def test_hf_agg_with_head_and_hidden_uniformity_under_gradient_accumulation(tmp_path):
    """("agg", "uniformity") minus ("agg",): the head term once per step plus the hidden term of
    each micro-batch averaged over the A = 2 micro-batches, against float64 autograd through a
    float64 copy of the initial model."""
    from hf_utils import ForwardCapture, GradCapture, tiny_gpt2

    names = ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.mlp.c_fc.weight")
    grads, labels = {}, {}
    for method in (("agg",), ("agg", "uniformity")):
        cfg = AnisoConfig(
            method=method, alpha=0.5, window=4, uniformity_on=("head", "hidden"), uniformity_weight=0.3,
            uniformity_block=9, metrics=(), load_entry_points=False,
        )
        model, cap = tiny_gpt2(), GradCapture(names)
        seen = ForwardCapture(model)
        _hf_trainer(tmp_path, cfg, model, [cap], gradient_accumulation_steps=2).train()
        grads[method], labels[method] = cap.grads[0], seen.labels
    base, both = labels[("agg",)], labels[("agg", "uniformity")]
    assert len(base) == 2 and all(torch.equal(a, b) for a, b in zip(base, both))

    ref_model = tiny_gpt2().double()  # the same initial weights (the head is tied to wte)
    total = 0.3 * ref_dense(ref_model.transformer.wte.weight, 2.0)  # the head rows, once
    for lab in both:
        h = ref_model.transformer(input_ids=lab).last_hidden_state  # the LM head's input
        valid = torch.ones_like(lab, dtype=torch.bool)
        valid[:, -1] = False  # the causal shift leaves the last position without a target
        total = total + 0.3 * ref_dense(h[valid], 2.0) / 2
    params = dict(ref_model.named_parameters())
    expected = torch.autograd.grad(total, [params[n] for n in names])
    for name, ref in zip(names, expected):
        diff = grads[("agg", "uniformity")][name].double() - grads[("agg",)][name].double()
        assert ref.abs().max() > 1e-6, name
        torch.testing.assert_close(diff, ref, rtol=1e-4, atol=1e-7, msg=name)


def _head_mean_cosine(w: torch.Tensor) -> float:
    """Mean cos(w_i, w_j) over ordered pairs i ≠ j, float64 (explicit pairwise matrix)."""
    u = w.double() / w.double().norm(dim=1, keepdim=True)
    cos = u @ u.T
    n = len(u)
    return float((cos.sum() - cos.diagonal().sum()) / (n * (n - 1)))


def _train(method: str, steps: int = 60) -> float:
    from token_data import TokenDataset

    vocab, dim = 64, 16
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, vocab, bias=False))
    session = TrainingSession(AnisoConfig(method=method, metrics=(), load_entry_points=False))
    session.setup(ModelHandle(model, head="3"))
    session.begin_training()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = TokenDataset(n=256, length=16, vocab=vocab).ids
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second intra-op thread only contends on a busy machine
    try:
        for step in range(1, steps + 1):
            ids = data[(step * 8) % 256 : (step * 8) % 256 + 8]
            y = torch.cat([ids[:, 1:], torch.full((len(ids), 1), IGNORE)], 1)
            session.begin_micro_batch(y, step=step)
            F.cross_entropy(model(ids).reshape(-1, vocab), y.reshape(-1), ignore_index=IGNORE).backward()
            opt.step()
            opt.zero_grad()
            session.end_step(step)
    finally:
        torch.set_num_threads(threads)
    return _head_mean_cosine(model[3].weight.detach())


def test_training_with_head_uniformity_lowers_the_head_mean_cosine():
    mle, uniform = _train("none"), _train("uniformity")
    print(f"head mean cosine after 60 steps: MLE {mle:.4f}, uniformity {uniform:.4f}")
    assert uniform < mle - 0.05, (mle, uniform)


# --- 2 real gloo ranks --------------------------------------------------------------------------

DIST_EXCLUDE, DIST_SAMPLE, DIST_WEIGHT = (26,), 9, 0.4


def _dist_cases():
    """name -> regularizer of a weight (test_regularizers_distributed's 53 × 6 weight, shards of
    27 and 26 rows, zero rows 3 and 40, row 26 excluded: the last of rank 0's shard)."""
    return {
        "exact": lambda w: row_uniformity(w, T, block=4, exclude_ids=DIST_EXCLUDE),
        "sampled": lambda w: row_uniformity(
            w, T, block=4, sample=DIST_SAMPLE, generator=torch.Generator().manual_seed(7), exclude_ids=DIST_EXCLUDE
        ),
    }


def _dist_worker(rank: int, world: int, mode: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from aniso_plugins import full_rows, local_rows
    from test_metrics_distributed import LM, _batch as lm_batch
    from test_regularizers_distributed import TinyLM as RegLM, _full_weight, _inside_forward

    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {"functions": {}}
    # --- the function on a replica / DDP (inside the forward) / FSDP2 (inside and outside) ---------
    for name, fn in _dist_cases().items():
        if mode == "ddp":
            w = _full_weight().requires_grad_(True)
            value = fn(w)
            value.backward()
            out["functions"][(name, "replica")] = (float(value.detach()), False, 0, w.grad.clone())
            ddp = nn.parallel.DistributedDataParallel(RegLM())
            value, dtensor = _inside_forward(ddp, ddp.module.lm_head, fn, rank)
            out["functions"][(name, "ddp")] = (value, dtensor, 0, ddp.module.lm_head.weight.grad.clone())
            continue
        model = RegLM()
        fully_shard(model, mesh=mesh)
        value, dtensor = _inside_forward(model, model.lm_head, fn, rank)
        rows = local_rows(model.lm_head.weight.grad)
        out["functions"][(name, "fsdp2_forward")] = (value, dtensor, rows.offset, rows.rows.clone())
        model = RegLM()
        fully_shard(model, mesh=mesh)
        value = fn(model.lm_head.weight)
        value.backward()
        rows = local_rows(model.lm_head.weight.grad)
        is_dtensor = type(model.lm_head.weight).__name__ == "DTensor"
        out["functions"][(name, "fsdp2_outside")] = (float(value.detach()), is_dtensor, rows.offset, rows.rows.clone())

    # --- the plugins through a TrainingSession on a wrapped model, different data per rank -----
    model = LM()
    out["init"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = AnisoConfig(
        method="uniformity", uniformity_on=("head", "hidden"), uniformity_weight=DIST_WEIGHT, uniformity_block=7,
        metrics=("uniformity",), hidden_samples=1000, uniformity_rows=40, load_entry_points=False,
    )
    session = TrainingSession(cfg)
    session.setup(ModelHandle(model, head="lm_head", input_embedding="embed", blocks="blocks"))
    head_in: list[torch.Tensor] = []
    model.norm.register_forward_hook(lambda m, a, o: head_in.append(o.detach().clone()))
    if mode == "fsdp2":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model)
    session.begin_training(accumulation_steps=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in (1, 2):
        for m in range(2):
            ids, y = lm_batch(100 * step + 10 * rank + m)
            session.begin_micro_batch(y, step=step, accumulation_steps=2, measure=step == 2)
            (wrapped(ids) * 0).sum().backward()  # only the uniformity terms send gradient
        if step == 1:
            out["grads"] = {n: full_rows(p.grad).detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        session.end_step(step)
        out[f"after_{step}"] = full_rows(model.lm_head.weight).detach().clone()
    out["metrics"] = session.measure(2)
    out["head_in"] = head_in
    return out


def _ref_function(name: str, w: torch.Tensor) -> torch.Tensor:
    if name == "exact":
        return ref_loop(w, T, DIST_EXCLUDE)
    rows = _sampled_rows(7, DIST_EXCLUDE, DIST_SAMPLE, v=len(w))
    return ref_loop(w, T, DIST_EXCLUDE, rows, len(w) - len(DIST_EXCLUDE))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_equal_single_process_references(mode):
    from test_metrics_distributed import LM, _batch as lm_batch
    from test_regularizers_distributed import _full_weight

    results = run_distributed(_dist_worker, mode)

    # the function: global value on every rank, each rank's gradient rows of the global gradient
    refs = {name: _value_and_grad(lambda w: _ref_function(name, w), _full_weight()) for name in _dist_cases()}
    for rank, result in enumerate(results):
        assert len(result["functions"]) == 4
        for (name, where), (value, dtensor, offset, grad) in result["functions"].items():
            msg = f"{name} / {where} / rank {rank}"
            ref, ref_grad = refs[name]
            assert dtensor == (where == "fsdp2_outside"), msg
            assert value == pytest.approx(float(ref), rel=1e-10), msg
            expected_rows = ((0, 27), (27, 26))[rank] if where.startswith("fsdp2") else (0, 53)
            assert (offset, len(grad)) == expected_rows, msg
            torch.testing.assert_close(grad, ref_grad[offset : offset + len(grad)], rtol=1e-9, atol=1e-12, msg=msg)

    # the session: step-1 gradient = head term + mean over ranks and micro-batches of the hidden terms
    r0, r1 = results
    for name in r0["grads"]:
        assert torch.equal(r0["grads"][name], r1["grads"][name]), name
    ref_model = LM().double()
    ref_model.load_state_dict({n: v.double() for n, v in r0["init"].items()})
    total = DIST_WEIGHT * ref_loop(ref_model.lm_head.weight, T)

    def head_input(model, ids):
        x = model.embed(ids)
        for block in model.blocks:
            x = block(x)
        return model.norm(x)

    for rank in range(2):
        for m in range(2):
            ids, y = lm_batch(100 + 10 * rank + m)
            h = head_input(ref_model, ids)[y != IGNORE]
            total = total + DIST_WEIGHT * ref_dense(h, T) / 4
    params = dict(ref_model.named_parameters())
    expected = dict(zip(params, torch.autograd.grad(total, list(params.values()))))
    for name, grad in r0["grads"].items():
        assert expected[name].abs().max() > 1e-8, name
        torch.testing.assert_close(grad, expected[name], rtol=1e-8, atol=1e-11, msg=name)

    # logged at step 2: the terms' values, and the two metrics
    metrics = r0["metrics"]
    assert metrics == r1["metrics"]
    hidden_2 = {}  # (rank, m) -> step 2's head inputs at the positions with a target
    for rank, result in enumerate(results):
        for m in range(2):
            _, y = lm_batch(200 + 10 * rank + m)
            hidden_2[rank, m] = result["head_in"][2 + m][y != IGNORE]
    mean_hidden = sum(float(ref_dense(h, T)) for h in hidden_2.values()) / 4
    assert metrics["aniso/loss/uniformity_hidden"] == pytest.approx(DIST_WEIGHT * mean_hidden, rel=1e-9)
    head_1 = float(ref_loop(r0["after_1"], T))
    assert metrics["aniso/loss/uniformity_head"] == pytest.approx(DIST_WEIGHT * head_1, rel=1e-9)
    rows = torch.randperm(51, generator=torch.Generator().manual_seed(2))[:40].tolist()
    assert metrics["aniso/uniformity/head"] == pytest.approx(float(ref_loop(r0["after_2"][rows], T)), rel=1e-9)
    # hidden metric: within-rank pairs of both ranks pooled: log(Σ_r Σ_pairs e / Σ_r n_r(n_r − 1))
    sums, pairs = 0.0, 0
    for rank in range(2):
        h = hidden_2[rank, 0]
        u = h / h.norm(dim=1, keepdim=True)
        for i in range(len(u)):
            for j in range(len(u)):
                if i != j:
                    sums += math.exp(-T * float((u[i] - u[j]).square().sum()))
        pairs += len(u) * (len(u) - 1)
    assert metrics["aniso/uniformity/hidden"] == pytest.approx(math.log(sums / pairs), rel=1e-9)


# --- the real Lightning Trainer ----------------------------------------------------------------
def test_lightning_head_and_hidden_uniformity_under_gradient_accumulation(tmp_path):
    """accumulate_grad_batches=2: the step's gradient minus MLE's equals ∇ of the float64 loop
    reference: the head term once (weights of the step) plus the mean over the 2 micro-batches
    of the hidden-state term over the positions with a target."""
    import copy

    import lightning.pytorch as pl

    from aniso_plugins.integrations.lightning import AnisoCallback
    from aniso_plugins import causal_targets
    from lightning_utils import GradCapture, LitLM, loader

    weight = 0.5

    def run(method):
        module = LitLM(tied=False)
        start = copy.deepcopy(module)
        cap = GradCapture()
        cfg = AnisoConfig(
            method=method, uniformity_on=("head", "hidden"), uniformity_weight=weight, uniformity_block=5,
            metrics=(), load_entry_points=False,
        )
        cb = AnisoCallback(cfg, head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal")
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
            num_sanity_val_steps=0, accumulate_grad_batches=2, callbacks=[cb, cap],
        )
        data = loader(n=8, batch_size=4)
        trainer.fit(module, data)
        return start, cap.grads[0], list(data)[:2]

    _, mle, _ = run("none")
    start, got, batches = run("uniformity")
    model = copy.deepcopy(start).double()
    hiddens = []
    model.model.lm_head.register_forward_pre_hook(lambda m, a: hiddens.append(a[0]))
    for batch in batches:
        model.model(batch["input_ids"])
    hidden_terms = []
    for h, batch in zip(hiddens, batches):
        valid = causal_targets(batch["labels"]).reshape(-1) != IGNORE
        hidden_terms.append(ref_loop(h.reshape(-1, h.shape[-1])[valid], T))
    ref = weight * ref_loop(model.model.lm_head.weight, T) + weight * sum(hidden_terms) / 2
    params = dict(model.named_parameters())
    grads = dict(zip(params, torch.autograd.grad(ref, list(params.values()), allow_unused=True)))
    checked = 0
    for name, g in got.items():
        expected = grads[name] if grads[name] is not None else torch.zeros_like(g, dtype=torch.float64)
        torch.testing.assert_close((g - mle[name]).double(), expected, rtol=1e-5, atol=1e-7, msg=name)
        checked += bool(expected.abs().max() > 1e-6)
    assert checked >= 4 and grads["model.lm_head.weight"].abs().max() > 1e-6
