"""CosReg, the pairwise cosine hinge and spectrum control (single process): values and
gradients against dense float64 formulas written out here (explicit V×V cosine matrices, numpy
SVDs), bounded memory of the blockwise hinge, unbiasedness of the sampled hinge, and the plugin."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from device_discipline import LargestTensor
from torch import nn

from aniso_plugins import AnisoConfig, AnisoPlugins, ModelHandle, SetupError, StepInfo
from aniso_plugins.methods.heads.lowrank import LowRankHead
from aniso_plugins.methods.regularizers.penalties import cosine_hinge, cosreg, spectrum_penalty, weight_singular_values

V, D = 37, 6


def _weight(v: int = V, d: int = D, seed: int = 0, zero_rows=(5,)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) + 0.4  # a shared direction: many cos > 0
    w[list(zero_rows)] = 0.0
    return w


# --- dense references -----------------------------------------------------------------------


def _dense_cos(w: torch.Tensor, exclude=()):
    """Full V×V cosine matrix and the mask of pairs (i ≠ j, both rows nonzero and not excluded)."""
    norms = w.norm(dim=1)
    valid = norms > 0
    valid[list(exclude)] = False
    u = torch.where(valid[:, None], w / norms.clamp_min(1e-300)[:, None], torch.zeros_like(w))
    cos = u @ u.T
    pairs = valid[:, None] & valid[None, :] & ~torch.eye(len(w), dtype=torch.bool)
    return cos, pairs, int(valid.sum())


def ref_cosreg(w, exclude=()):
    cos, pairs, n = _dense_cos(w, exclude)
    return cos[pairs].sum() / n**2


def ref_hinge(w, margin, exclude=(), rows=None, scale=1.0):
    cos, pairs, n = _dense_cos(w, exclude)
    if rows is not None:
        keep = torch.zeros(len(w), dtype=torch.bool)
        keep[rows] = True
        pairs = pairs & keep[:, None]
    return scale * (cos - margin).clamp_min(0)[pairs].sum() / n**2


def _value_and_grad(fn, w):
    w = w.clone().requires_grad_(True)
    value = fn(w)
    (grad,) = torch.autograd.grad(value, w)
    return value.detach(), grad


# --- CosReg -----------------------------------------------------------------------------------


@pytest.mark.parametrize("exclude", [(), (0, 3, 36)])
def test_cosreg_value_and_gradient_match_dense_formula(exclude):
    w = _weight()
    got, got_grad = _value_and_grad(lambda x: cosreg(x, exclude), w)
    ref, ref_grad = _value_and_grad(lambda x: ref_cosreg(x, exclude), w)
    assert got.dtype == torch.float64 and got.dim() == 0
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert got_grad[5].abs().max() == 0 and torch.isfinite(got_grad).all()  # zero row: no gradient, no NaN
    for i in exclude:
        assert got_grad[i].abs().max() == 0
    # the closed-form gradient of docs/methods.md §3 on one row
    n = V - 1 - len(exclude)
    valid = [i for i in range(V) if i != 5 and i not in exclude]
    u = w[valid] / w[valid].norm(dim=1, keepdim=True)
    s = u.sum(0)
    i = valid[1]
    ui = u[1]
    closed = 2 / (n**2 * w[i].norm()) * (torch.eye(D, dtype=torch.float64) - torch.outer(ui, ui)) @ (s - ui)
    torch.testing.assert_close(got_grad[i], closed, rtol=1e-10, atol=1e-14)


def test_cosreg_float32_and_bf16_accumulate_in_float32():
    w = _weight(v=300, d=16)
    ref = ref_cosreg(w)
    torch.testing.assert_close(cosreg(w.float()), ref, rtol=1e-5, atol=1e-6)
    wb = w.bfloat16()
    torch.testing.assert_close(cosreg(wb), ref_cosreg(wb.double()), rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(cosreg(w.float()), ref, rtol=1e-5, atol=1e-6)


def test_cosreg_degenerate_cases():
    assert float(cosreg(torch.zeros(4, 3))) == 0.0  # no valid row
    one = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    assert abs(float(cosreg(one))) < 1e-7  # N = 1: no pair (float32 rows: ‖û‖² = 1 up to rounding)
    same = torch.ones(5, 3)
    assert math.isclose(float(cosreg(same)), 20 / 25, rel_tol=1e-7)  # all cos = 1: N(N-1)/N²


# --- hinge ------------------------------------------------------------------------------------


@pytest.mark.parametrize("margin", [-0.5, 0.0, 0.3, 0.8])
@pytest.mark.parametrize("block", [1, 5, 16, 37, 1000])
def test_hinge_exact_matches_dense_formula_for_every_block(margin, block):
    w = _weight()
    exclude = (2, 36)
    got, got_grad = _value_and_grad(lambda x: cosine_hinge(x, margin, block=block, exclude_ids=exclude), w)
    ref, ref_grad = _value_and_grad(lambda x: ref_hinge(x, margin, exclude), w)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert got_grad[5].abs().max() == 0 and got_grad[2].abs().max() == 0


def test_hinge_limits_relate_to_cosreg():
    w = _weight()
    n = V - 1
    torch.testing.assert_close(cosine_hinge(w, -1.0), cosreg(w) + n * (n - 1) / n**2, rtol=1e-12, atol=0)
    assert float(cosine_hinge(w, 1.0)) == 0.0


def test_hinge_float32_and_autocast():
    w = _weight(v=200, d=12)
    ref = ref_hinge(w, 0.2)
    torch.testing.assert_close(cosine_hinge(w.float(), 0.2, block=64), ref, rtol=2e-5, atol=1e-7)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # disabled inside: no bf16 matmul
        torch.testing.assert_close(cosine_hinge(w.float(), 0.2, block=64), ref, rtol=2e-5, atol=1e-7)


def test_hinge_memory_is_block_times_vocab_never_vocab_squared():
    v, d, block = 301, 8, 16
    w = _weight(v=v, d=d).float().requires_grad_(True)
    with LargestTensor() as probe:
        cosine_hinge(w, 0.1, block=block).backward()
    assert v * block <= probe.largest <= max(v * block, v * (d + 1)) < v * v // 4
    with LargestTensor() as probe:
        cosine_hinge(w, 0.1, block=block, sample=40).backward()
    assert probe.largest <= max(v * block, v * (d + 1))


def _sampled_rows(seed: int, exclude, sample: int, v: int = V) -> list[int]:
    """The documented sampling rule: P[torch.randperm(|P|, generator)[:sample]]."""
    population = [i for i in range(v) if i not in exclude]
    perm = torch.randperm(len(population), generator=torch.Generator().manual_seed(seed))
    return [population[int(k)] for k in perm[:sample]]


@pytest.mark.parametrize("margin", [-0.3, 0.25])
def test_hinge_sampled_equals_dense_estimator(margin):
    w = _weight()
    exclude, sample = (3,), 7
    population = V - len(exclude)
    got, got_grad = _value_and_grad(
        lambda x: cosine_hinge(
            x, margin, block=3, sample=sample, generator=torch.Generator().manual_seed(11), exclude_ids=exclude
        ),
        w,
    )
    rows = _sampled_rows(11, exclude, sample)
    ref, ref_grad = _value_and_grad(
        lambda x: ref_hinge(x, margin, exclude, rows=rows, scale=population / sample), w
    )
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_grad, ref_grad, rtol=1e-10, atol=1e-14)


def test_hinge_sampled_is_unbiased():
    w = _weight(v=14, d=4)
    exact, exact_grad = _value_and_grad(lambda x: cosine_hinge(x, 0.1), w)
    gen = torch.Generator().manual_seed(0)
    draws, grads = [], []
    for _ in range(1000):
        value, grad = _value_and_grad(lambda x: cosine_hinge(x, 0.1, sample=3, generator=gen), w)
        draws.append(value)
        grads.append(grad)
    draws, grads = torch.stack(draws), torch.stack(grads)
    se = draws.std() / math.sqrt(len(draws))
    assert abs(draws.mean() - exact) < 4 * se, (float(draws.mean()), float(exact), float(se))
    grad_se = grads.std(0) / math.sqrt(len(grads))
    assert ((grads.mean(0) - exact_grad).abs() <= 4 * grad_se + 1e-12).float().mean() > 0.99
    assert float(draws.std()) > 0  # it is a random estimate, not the exact value


def test_hinge_sample_at_least_population_is_exact():
    w = _weight()
    torch.testing.assert_close(cosine_hinge(w, 0.2, sample=V), ref_hinge(w, 0.2), rtol=1e-12, atol=0)


# --- spectrum control -------------------------------------------------------------------------


def _svd(w):
    u, s, vt = np.linalg.svd(w.detach().numpy(), full_matrices=False)
    return u, s, vt


@pytest.mark.parametrize("prior", ["poly", "exp", "ratio"])
def test_spectrum_value_and_gradient_match_svd(prior):
    w = _weight(v=50, d=7, zero_rows=())
    c1, c2, gamma = 3.0, 0.3, 0.9
    got, got_grad = _value_and_grad(lambda x: spectrum_penalty(x, prior, c1=c1, c2=c2, gamma=gamma), w)
    u, s, vt = _svd(w)
    k = np.arange(1, 8, dtype=np.float64)
    if prior == "ratio":
        ref = s[0] / s[-1]
        ref_grad = np.outer(u[:, 0], vt[0]) / s[-1] - s[0] / s[-1] ** 2 * np.outer(u[:, -1], vt[-1])
    else:
        target = c1 * k**-gamma if prior == "poly" else c1 * np.exp(-c2 * k**gamma)
        ref = ((s - target) ** 2).sum()
        ref_grad = sum(2 * (s[i] - target[i]) * np.outer(u[:, i], vt[i]) for i in range(7))  # dσ_k/dW = u_k v_kᵀ
    np.testing.assert_allclose(float(got), ref, rtol=1e-10)
    np.testing.assert_allclose(got_grad.numpy(), ref_grad, rtol=1e-7, atol=1e-10)


def test_weight_singular_values_and_float32_input():
    w = _weight(v=64, d=9, zero_rows=())
    np.testing.assert_allclose(weight_singular_values(w).numpy(), _svd(w)[1], rtol=1e-10)
    got = spectrum_penalty(w.float(), "poly", c1=2.0)
    assert got.dtype == torch.float64
    _, s, _ = _svd(w.float().double())
    ref = ((s - 2.0 * np.arange(1, 10) ** -0.75) ** 2).sum()
    np.testing.assert_allclose(float(got), ref, rtol=1e-6)  # float32 products, float64 sums (methods.md §4)


# --- bad inputs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda w: cosreg(w, exclude_ids=(V,)), ["exclude_ids=[37]", "[0, 37)"]),
        (lambda w: cosreg(w[0]), ["2-D", "(6,)"]),
        (lambda w: cosine_hinge(w, 0.1, block=0), ["block=0", ">= 1"]),
        (lambda w: cosine_hinge(w, 0.1, sample=0), ["sample=0", "None"]),
        (lambda w: cosine_hinge(w, float("nan")), ["margin=nan"]),
        (lambda w: cosine_hinge(w, 0.1, exclude_ids=(-1,)), ["exclude_ids=[-1]"]),
        (lambda w: spectrum_penalty(w, "flat", c1=1.0), ["prior='flat'", "poly, exp, ratio"]),
        (lambda w: spectrum_penalty(w, "poly"), ["c1=None", "> 0"]),
        (lambda w: spectrum_penalty(w, "exp", c1=1.0, c2=-1.0), ["c2=-1.0", ">= 0"]),
        (lambda w: spectrum_penalty(w, "poly", c1=1.0, gamma=0.0), ["gamma=0.0", "> 0"]),
    ],
)
def test_bad_inputs_raise_clear_errors(call, words):
    with pytest.raises(ValueError) as info:
        call(_weight())
    for word in words:
        assert word in str(info.value)


# --- the plugin -------------------------------------------------------------------------------


class TinyLM(nn.Module):
    def __init__(self, vocab=V, dim=D, tied=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(_weight(vocab, dim, seed=3, zero_rows=()).float())
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(self.embed(ids))


def _plugins(model, **config):
    plugins = AnisoPlugins(AnisoConfig(metrics=(), load_entry_points=False, **config))
    plugins.setup(ModelHandle(model, input_embedding="embed"))
    return plugins


def test_plugin_cosreg_term_weight_exclusion_and_logging():
    model = TinyLM()
    plugins = _plugins(model, method="cosreg", reg_weight=0.3, reg_exclude_ids=(0, 4))
    assert plugins.get("cosreg") is not None
    term = plugins.loss_terms(StepInfo(step=1))
    w = model.lm_head.weight.detach().double()
    torch.testing.assert_close(term, 0.3 * ref_cosreg(w, (0, 4)), rtol=1e-6, atol=0)
    term.backward()
    _, ref_grad = _value_and_grad(lambda x: 0.3 * ref_cosreg(x, (0, 4)), w)
    torch.testing.assert_close(model.lm_head.weight.grad.double(), ref_grad, rtol=1e-4, atol=1e-7)
    metrics = plugins.measure(StepInfo(step=1))
    assert math.isclose(metrics["aniso/loss/cosreg"], 0.3 * metrics["aniso/cosreg/value"], rel_tol=1e-12)
    assert math.isclose(metrics["aniso/cosreg/value"], float(ref_cosreg(w, (0, 4))), rel_tol=1e-6)


def test_plugin_every_microbatch_divides_by_accumulation_steps():
    model = TinyLM()
    once = _plugins(model, method="hinge", reg_weight=2.0, hinge_margin=0.1)
    every = _plugins(model, method="hinge", reg_weight=2.0, hinge_margin=0.1, reg_every_microbatch=True)
    step = StepInfo(step=3, micro_batch=1, accumulation_steps=4)  # when terms are due: test_core (the session's policy)
    w = model.lm_head.weight.detach().double()
    torch.testing.assert_close(every.loss_terms(step), 2.0 * ref_hinge(w, 0.1) / 4, rtol=1e-6, atol=0)
    last = StepInfo(step=3, micro_batch=3, accumulation_steps=4)
    torch.testing.assert_close(once.loss_terms(last), 2.0 * ref_hinge(w, 0.1), rtol=1e-6, atol=0)


def test_plugin_sampled_hinge_is_the_same_on_every_rank_and_changes_with_the_step():
    model = TinyLM()
    a = _plugins(model, method="hinge", hinge_margin=0.0, hinge_sample=4)
    b = _plugins(model, method="hinge", hinge_margin=0.0, hinge_sample=4)  # another rank, same config
    values = [float(a.loss_terms(StepInfo(step=s)).detach()) for s in (1, 2, 3)]
    assert values == [float(b.loss_terms(StepInfo(step=s)).detach()) for s in (1, 2, 3)]
    assert len(set(values)) == 3


def test_plugin_spectrum_c1_from_the_head_and_kept_in_the_state():
    model = TinyLM()
    plugins = _plugins(model, method="spectrum", spectrum_prior="exp", spectrum_c2=0.2, spectrum_gamma=0.8, reg_weight=0.5)
    term = plugins.loss_terms(StepInfo(step=1))
    _, s, _ = _svd(model.lm_head.weight.detach().double())
    k = np.arange(1, D + 1)
    ref = 0.5 * ((s - s[0] * np.exp(-0.2 * k**0.8)) ** 2).sum()
    np.testing.assert_allclose(float(term.detach()), ref, rtol=1e-6)
    state = plugins.state_dict()
    np.testing.assert_allclose(float(state["spectrum"]["c1"]), s[0], rtol=1e-6)
    # a resumed run keeps c1 although its head has changed
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    resumed = _plugins(model, method="spectrum", spectrum_prior="exp", spectrum_c2=0.2, spectrum_gamma=0.8)
    resumed.load_state_dict(state)
    resumed.loss_terms(StepInfo(step=2))
    np.testing.assert_allclose(resumed.get("spectrum").c1, s[0], rtol=1e-6)
    explicit = _plugins(model, method="spectrum", spectrum_c1=1.5)
    explicit.loss_terms(StepInfo(step=1))
    assert explicit.get("spectrum").c1 == 1.5 and explicit.state_dict() == {}


def test_plugin_reads_a_low_rank_head_weight_and_its_gradient_reaches_a_and_b():
    model = TinyLM()
    plugins = _plugins(model, method="cosreg", head="lowrank", lowrank_rank=3)
    head = model.lm_head
    assert isinstance(head, LowRankHead)
    plugins.loss_terms(StepInfo(step=1)).backward()
    a, b = head.A.detach().double().requires_grad_(True), head.B.detach().double().requires_grad_(True)
    ref_ga, ref_gb = torch.autograd.grad(ref_cosreg(a @ b), (a, b))
    torch.testing.assert_close(head.A.grad.double(), ref_ga, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(head.B.grad.double(), ref_gb, rtol=1e-4, atol=1e-7)


def test_plugin_spectrum_on_a_low_rank_head_is_refused():
    with pytest.raises(SetupError, match="spectrum.*lowrank"):
        _plugins(TinyLM(), method="spectrum", head="lowrank", lowrank_rank=2)
