"""What a GPU charges the head regularizers and the uniformity term, checked on the CPU
(docs/performance.md §5.8; tests/device_discipline.py):

- no host read in a steady-state training step: `HostSyncs` counts 0 around each plugin's loss
  term (CosReg, the hinge exact and sampled, spectrum control, the uniformity of the head rows
  exact and sampled and of the hidden states) and its backward; spectrum's c1 is the one read,
  once, at the first call;
- every penalty's forward, with its gradient computed in the forward, runs under `fake_cuda()` (a
  fake CUDA device that raises on a host read, a data-dependent shape or a host tensor meeting a
  device tensor), in float32 and bfloat16; the plugins' hooks too;
- the sampled rows reach the device through a non-blocking copy, and are the same on every rank
  and on a resumed run;
- spectrum control builds WᵀW from float32 row blocks summed in float64 (no float64 V×d copy),
  exact against float64 references: numpy's SVD and float64 autograd through WᵀW.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from device_discipline import HostSyncs, LargestTensor, fake_cuda
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from aniso_plugins import AnisoConfig, AnisoPlugins, ModelHandle, StepInfo
from aniso_plugins.methods.regularizers.penalties import cosine_hinge, cosreg, spectrum_penalty
from aniso_plugins.methods.uniformity.kernels import row_uniformity

V, D, IGNORE = 37, 6, -100

CASES = {
    "cosreg": dict(method="cosreg"),
    "cosreg, excluded ids": dict(method="cosreg", reg_exclude_ids=(0, 3, 4)),
    "hinge": dict(method="hinge", hinge_block=8, reg_exclude_ids=(2,)),
    "hinge, sampled": dict(method="hinge", hinge_sample=9, hinge_block=4, reg_exclude_ids=(0, 3, 4)),
    "spectrum, poly": dict(method="spectrum"),
    "spectrum, exp": dict(method="spectrum", spectrum_prior="exp", spectrum_c1=2.0),
    "spectrum, ratio": dict(method="spectrum", spectrum_prior="ratio"),
    "uniformity, head": dict(method="uniformity", uniformity_block=8, reg_exclude_ids=(1,)),
    "uniformity, head sampled": dict(method="uniformity", uniformity_sample=9, uniformity_block=4, reg_exclude_ids=(0, 3)),
    "uniformity, hidden": dict(method="uniformity", uniformity_on="hidden", uniformity_block=4),
}


class TinyLM(nn.Module):
    def __init__(self, device: str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embed = nn.Embedding(V, D, device=device, dtype=dtype)
        self.lm_head = nn.Linear(D, V, bias=False, device=device, dtype=dtype)

    def forward(self, ids):
        return self.lm_head(self.embed(ids))


def _plugins(model: nn.Module, **config) -> AnisoPlugins:
    plugins = AnisoPlugins(AnisoConfig(metrics=(), load_entry_points=False, **config))
    plugins.setup(ModelHandle(model, input_embedding="embed"))
    return plugins


def _terms(plugins: AnisoPlugins, model: TinyLM, step: StepInfo, ids: torch.Tensor, targets: torch.Tensor) -> list:
    """Every plugin's loss terms of one micro-batch, through the hooks themselves (the core's own
    bookkeeping of the values is not part of what is counted here)."""
    out = []
    for plugin in plugins.pm.get_plugins():
        if hasattr(plugin, "aniso_loss_terms"):
            out += list((plugin.aniso_loss_terms(step=step) or {}).values())
        if hasattr(plugin, "aniso_activation_loss_terms"):
            hidden = model.embed(ids)
            out += list((plugin.aniso_activation_loss_terms(hidden=hidden, targets=targets, step=step) or {}).values())
    return out


def _batch(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(12, device=device).view(2, 6) * 5 % V
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE, device=device)], 1)
    return ids, targets


# --- host reads -------------------------------------------------------------------------------


def test_the_counter_sees_a_host_read_inside_a_backward():
    """The counting below covers backward passes (the autograd engine runs CPU backwards on the
    calling thread, inside the dispatch mode)."""

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.sum()

        @staticmethod
        def backward(ctx, grad):
            return grad.expand(3) * float(grad)

    x = torch.ones(3, requires_grad=True)
    with HostSyncs() as syncs:
        ReadsInBackward.apply(x).backward()
    assert syncs.counts == {"item": 1}


@pytest.mark.parametrize("name", list(CASES))
def test_no_host_read_in_a_steady_state_step(name):
    """Step 2 (after the first), the terms and their backward: 0 host reads; the regularizer's
    value is read at the measurement (train_metrics) instead of in the step."""
    torch.manual_seed(0)
    model = TinyLM()
    plugins = _plugins(model, **CASES[name])
    ids, targets = _batch()
    sum(_terms(plugins, model, StepInfo(step=1), ids, targets)).backward()
    with HostSyncs(where=True) as syncs:
        terms = _terms(plugins, model, StepInfo(step=2), ids, targets)
        sum(terms).backward()
    assert syncs.total == 0, dict(syncs.sites)
    if name.startswith(("cosreg", "hinge", "spectrum")):  # step 2's value, read when measured (reg_weight 1)
        value = plugins.measure(StepInfo(step=2))[f"aniso/{CASES[name]['method']}/value"]
        assert value == float(terms[0].detach())


def test_spectrum_reads_c1_once_at_the_first_call():
    """Without spectrum_c1 the prior's scale is σ1 of the head at the first call: one host read
    then (kept as a float in the state), none after."""
    model = TinyLM()
    plugins = _plugins(model, method="spectrum")
    ids, targets = _batch()
    with HostSyncs(where=True) as first:
        sum(_terms(plugins, model, StepInfo(step=1), ids, targets)).backward()
    assert first.counts == {"item": 1}, dict(first.sites)
    with HostSyncs() as later:
        for step in (2, 3):
            sum(_terms(plugins, model, StepInfo(step=step), ids, targets)).backward()
    assert later.total == 0
    sigma = np.linalg.svd(model.lm_head.weight.detach().double().numpy(), compute_uv=False)
    assert plugins.get("spectrum").c1 == pytest.approx(sigma[0], rel=1e-6)


# --- a fake CUDA device -----------------------------------------------------------------------


def _functions(generator: torch.Generator) -> dict:
    return {
        "cosreg": lambda w: cosreg(w, (0, 3)),
        "hinge": lambda w: cosine_hinge(w, 0.1, block=8, exclude_ids=(2,)),
        "hinge, sampled": lambda w: cosine_hinge(w, 0.1, block=4, sample=9, generator=generator, exclude_ids=(0, 3, 4)),
        "spectrum, poly": lambda w: spectrum_penalty(w, "poly", c1=2.0),
        "spectrum, ratio": lambda w: spectrum_penalty(w, "ratio"),
        "uniformity": lambda w: row_uniformity(w, block=8, exclude_ids=(1,)),
        "uniformity, sampled": lambda w: row_uniformity(w, block=4, sample=9, generator=generator, exclude_ids=(0, 3)),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(_functions(torch.Generator())))
def test_penalties_run_on_a_fake_cuda_device(name, dtype):
    """Forward with requires_grad (the hinge's and the uniformity's gradients are computed in
    the forward): no host read, no data-dependent shape, no host tensor meeting a device one."""
    fn = _functions(torch.Generator().manual_seed(5))[name]
    with fake_cuda():
        w = torch.randn(V, D, device="cuda", dtype=dtype, requires_grad=True)
        value = fn(w)
    assert value.device.type == "cuda" and value.dtype == torch.float64 and value.shape == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_plugin_hooks_run_on_a_fake_cuda_device(name, dtype):
    config = dict(CASES[name])
    if config["method"] == "spectrum" and config.get("spectrum_prior") != "ratio":
        config["spectrum_c1"] = 2.0  # the first call's read of σ1 is a set-up read (test above)
    with fake_cuda():
        model = TinyLM("cuda", dtype)
        plugins = _plugins(model, **config)
        terms = _terms(plugins, model, StepInfo(step=2), *_batch("cuda"))
    assert terms and all(t.device.type == "cuda" and t.shape == () for t in terms)


def test_the_spectrum_backward_runs_on_a_fake_cuda_device():
    """The Gram's backward W(Ḡ + Ḡᵀ), by blocks (the autograd engine itself needs a real device)."""
    from aniso_plugins.numerics.linalg import gram_backward

    with fake_cuda():
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(V, D, device="cuda", dtype=dtype)
            grad = gram_backward(w, torch.randn(D, D, device="cuda", dtype=torch.float64), block=8)
            assert grad.device.type == "cuda" and grad.dtype == dtype and grad.shape == (V, D)


class _HostToDevice(TorchDispatchMode):
    """Records every copy of a CPU tensor to another device: (non_blocking, shape)."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple[bool, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu":
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                self.copies.append((bool(kwargs.get("non_blocking", False)), tuple(args[0].shape)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("method", ["hinge", "uniformity"])
def test_sampled_rows_reach_the_device_without_a_blocking_copy(method):
    config = dict(CASES["hinge, sampled" if method == "hinge" else "uniformity, head sampled"])
    with fake_cuda():
        model = TinyLM("cuda")
        plugins = _plugins(model, **config)
        with _HostToDevice() as copies:
            _terms(plugins, model, StepInfo(step=2), *_batch("cuda"))
    sample = config.get("hinge_sample") or config.get("uniformity_sample")
    assert copies.copies == [(True, (sample,))]  # the drawn ids, once, non-blocking


@pytest.mark.parametrize("method", ["hinge", "uniformity"])
def test_sampled_rows_are_the_same_on_every_rank_and_on_a_resumed_run(method):
    """Two ranks (two plugin sets) see the same values at every step; a run resumed at step 3
    (a fresh plugin set) draws the rows the first run drew at step 3; the rows change with the
    step. The draws are the documented rule (tests/test_regularizers.py, test_uniformity.py)."""
    config = dict(CASES["hinge, sampled" if method == "hinge" else "uniformity, head sampled"])
    model = TinyLM()
    ids, targets = _batch()
    rank0, rank1 = _plugins(model, **config), _plugins(model, **config)
    steps = [StepInfo(step=s, micro_batch=m, accumulation_steps=2) for s, m in ((1, 0), (2, 1), (3, 0))]
    first = [float(sum(_terms(rank0, model, s, ids, targets)).detach()) for s in steps]
    assert first == [float(sum(_terms(rank1, model, s, ids, targets)).detach()) for s in steps]
    resumed = _plugins(model, **config)
    assert float(sum(_terms(resumed, model, steps[2], ids, targets)).detach()) == first[2]
    assert len(set(first)) == 3


# --- spectrum control without a float64 V×d copy -----------------------------------------------




@pytest.mark.parametrize("prior", ["poly", "ratio"])
def test_spectrum_makes_no_float64_copy_of_the_head(prior):
    """Value and gradient of a float32 head: no float64 tensor larger than the d×d Gram."""
    v, d = 600, 12
    w = torch.randn(v, d, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    with LargestTensor(torch.float64) as probe:
        spectrum_penalty(w, prior, c1=3.0).backward()
    assert 0 < probe.largest <= d * d < v * d


def _ref_spectrum(w64: np.ndarray, prior: str, c1: float, c2: float, gamma: float) -> tuple[float, np.ndarray]:
    """R and ∂R/∂W from numpy's float64 SVD: ∂σ_k/∂W = u_k v_kᵀ."""
    u, s, vt = np.linalg.svd(w64, full_matrices=False)
    if prior == "ratio":
        return s[0] / s[-1], np.outer(u[:, 0], vt[0]) / s[-1] - s[0] / s[-1] ** 2 * np.outer(u[:, -1], vt[-1])
    k = np.arange(1, len(s) + 1, dtype=np.float64)
    target = c1 * k**-gamma if prior == "poly" else c1 * np.exp(-c2 * k**gamma)
    return ((s - target) ** 2).sum(), (u * (2 * (s - target))) @ vt


def _head_with_spectrum(v: int, d: int, sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W = Q₁ diag(σ) Q₂ᵀ (random orthonormal Q₁, Q₂), rounded to `dtype`."""
    g = torch.Generator().manual_seed(1)
    q1, _ = torch.linalg.qr(torch.randn(v, d, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return ((q1 * sigma) @ q2.T).to(dtype)


def _spectrum_and_gradient(w: torch.Tensor, prior: str, c1: float, c2: float, gamma: float):
    leaf = w.clone().requires_grad_(True)
    value = spectrum_penalty(leaf, prior, c1=c1, c2=c2, gamma=gamma)
    (grad,) = torch.autograd.grad(value, leaf)
    assert grad.dtype == w.dtype
    return float(value.detach()), grad.double().numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prior", ["poly", "exp", "ratio"])
def test_spectrum_of_a_low_precision_head_equals_the_float64_reference(prior, dtype):
    """A 9000 × 24 head (three blocks of 4096 rows), σ_k = 4·0.97^k: value and gradient against
    numpy's float64 SVD of the same (rounded) weights, to 1e-6 (the gradient is delivered in the
    head's dtype: 2⁻⁸ for bf16). Float32 products summed in float64 leave a relative error of
    ~1e-8 on the Gram (methods.md §4)."""
    w = _head_with_spectrum(9000, 24, 4.0 * 0.97 ** torch.arange(24, dtype=torch.float64), dtype)
    c1, c2, gamma = 3.0, 0.2, 0.8
    value, grad = _spectrum_and_gradient(w, prior, c1, c2, gamma)
    ref, ref_grad = _ref_spectrum(w.double().numpy(), prior, c1, c2, gamma)
    np.testing.assert_allclose(value, ref, rtol=1e-6)
    rounding = 1e-6 if dtype == torch.float32 else 2**-8
    np.testing.assert_allclose(grad, ref_grad, rtol=rounding, atol=rounding * np.abs(ref_grad).max())


@pytest.mark.parametrize("prior", ["poly", "ratio"])
def test_spectrum_of_a_random_head_is_within_its_conditioning(prior):
    """A random, mildly anisotropic float32 head (close singular values, as at initialisation):
    the value to 1e-6, the gradient to 1e-6 · λ₁ / (smallest gap of λ = σ²), the sensitivity of
    the eigenvectors to a relative error of ~1e-8 of the Gram (methods.md §4)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(9000, 24, generator=g) * 0.02 + 0.004
    value, grad = _spectrum_and_gradient(w, prior, 3.0, 0.2, 0.8)
    ref, ref_grad = _ref_spectrum(w.double().numpy(), prior, 3.0, 0.2, 0.8)
    np.testing.assert_allclose(value, ref, rtol=1e-6)
    lam = np.linalg.svd(w.double().numpy(), compute_uv=False) ** 2
    bound = 1e-6 * lam[0] / np.diff(-lam).min()
    assert 1e-5 < bound < 1e-3  # close eigenvalues: a looser bound than above, and still a tight one
    np.testing.assert_allclose(grad, ref_grad, rtol=0, atol=bound * np.abs(ref_grad).max())


@pytest.mark.parametrize("kappa", [10.0, 1000.0])
def test_singular_values_of_an_ill_conditioned_head_follow_the_documented_bound(kappa):
    """σ_k of a float32 head with σ₁/σ_d = κ against numpy's float64 SVD: relative error at most
    1e-7·(σ₁/σ_k)² (the Gram's error ~1e-8·λ₁ seen by λ_k = σ_k²; methods.md §4), which the
    float64 Gram would meet at any κ; and the bound is not loose by more than 100×."""
    from aniso_plugins.methods.regularizers.penalties import weight_singular_values

    d = 24
    sigma = kappa ** -(torch.arange(d, dtype=torch.float64) / (d - 1))
    w = _head_with_spectrum(9000, d, sigma, torch.float32)
    ref = np.linalg.svd(w.double().numpy(), compute_uv=False)
    error = np.abs(weight_singular_values(w).numpy() - ref) / ref
    bound = 1e-7 * (ref[0] / ref) ** 2
    assert (error <= bound).all() and (error / bound).max() > 1e-2


@pytest.mark.parametrize("block", [1, 7, 64, 10_000])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_block_gram_equals_the_float64_gram_and_its_gradient(block, dtype):
    """WᵀW and the gradient of ⟨C, WᵀW⟩ against float64 autograd through a float64 copy: exact in
    float64 for float64 rows, to float32 rounding for float32 / bf16 rows, for every block size."""
    from aniso_plugins.numerics.linalg import block_gram

    g = torch.Generator().manual_seed(2)
    w = (torch.randn(300, 9, generator=g) + 0.3).to(dtype)
    probe = torch.randn(9, 9, generator=g, dtype=torch.float64)
    leaf = w.clone().requires_grad_(True)
    gram = block_gram(leaf, block)
    (grad,) = torch.autograd.grad((gram * probe).sum(), leaf)
    w64 = w.double().requires_grad_(True)
    ref = w64.T @ w64
    (ref_grad,) = torch.autograd.grad((ref * probe).sum(), w64)
    assert gram.dtype == torch.float64 and grad.dtype == dtype
    exact = dtype == torch.float64
    tol = 1e-13 if exact else 1e-6  # float32 sums: relative to the largest entry, not to each
    torch.testing.assert_close(gram, ref.detach(), rtol=tol, atol=tol * float(ref.abs().max()))
    tol = 1e-12 if exact else (1e-6 if dtype == torch.float32 else 2**-8)  # delivered in the rows' dtype
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=tol * float(ref_grad.abs().max()))


def test_the_float32_products_ignore_a_tf32_setting():
    """On CUDA the blocks are multiplied in IEEE float32 even where the user allowed TF32; the
    setting is restored after."""
    from aniso_plugins.numerics.linalg import ieee_float32

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        with ieee_float32(torch.device("cuda")):
            assert matmul.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32"
        with ieee_float32(torch.device("cpu")):
            assert matmul.fp32_precision == "tf32"  # nothing to do off CUDA
    finally:
        matmul.fp32_precision = before
