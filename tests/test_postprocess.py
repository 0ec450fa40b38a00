"""Post-processing transforms (aniso_plugins.offline.postprocess, docs/methods.md §5.1), each checked
against an explicit numpy / float64 formula written out here: whitening (covariance I, ZCA =
U s^-1/2 Uᵀ), all-but-the-top (both projections, orthogonal to the removed directions),
centering, rotations, the outlier metric; streaming == whole-tensor fits, numpy in/out, the
module form, files, inverses, degenerate data, errors; centering an untied LM head is lossless;
2 gloo ranks fit exactly the single-process transforms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from aniso_plugins import ConfigError, StateError, isotropy
from aniso_plugins.offline.postprocess import (
    AllButTheTop,
    Centering,
    Rotation,
    Transform,
    TransformModule,
    Whitening,
    load_transform,
    outlier_stats,
)
from dist_utils import run_distributed

N, D = 200, 12


def _data(n: int = N, d: int = D, seed: int = 0) -> np.ndarray:
    """Anisotropic float64 rows: a common offset and very unequal variances."""
    rng = np.random.default_rng(seed)
    scales = np.geomspace(5.0, 0.05, d)
    mix = np.linalg.qr(rng.standard_normal((d, d)))[0]
    return rng.standard_normal((n, d)) * scales @ mix + 3.0


def _centered(x: np.ndarray) -> np.ndarray:
    return x - x.mean(0)


def _cov_eig(x: np.ndarray):
    """Σ = np.cov (1/(n − 1)) and its eigen-decomposition, descending (numpy SVD of Σ)."""
    u, s, _ = np.linalg.svd(np.cov(x.T))
    return u, s


def _close(a, b, tol=1e-9):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=tol, atol=tol)


def _all_transforms():
    return [Centering(), Whitening(), Whitening(k=5), Whitening(zca=True), AllButTheTop(D=2),
            AllButTheTop(D=2, project="raw"), Rotation("random", seed=3), Rotation("hadamard", seed=1)]


# ----------------------------------------------------------------------------- formulas


def test_centering_is_x_minus_mean_and_inverts():
    x = _data()
    t = Centering().fit(x)
    _close(t.mean, x.mean(0), 1e-12)
    _close(t(x), x - x.mean(0), 1e-12)
    _close(t.inverse(t(x)), x, 1e-12)
    assert (t.dim, t.out_dim, t.count) == (D, D, N)


def test_whitening_full_gives_identity_covariance_and_the_formula():
    x = _data()
    t = Whitening().fit(torch.from_numpy(x))
    y = t(torch.from_numpy(x)).numpy()
    _close(np.cov(y.T), np.eye(D), 1e-9)
    u, s = _cov_eig(x)
    w = u / np.sqrt(s)                                   # W = U diag(s)^(-1/2), Su et al. 2021
    ref = _centered(x) @ w
    signs = np.sign((y * ref).sum(0))                    # eigenvector signs are a convention
    _close(y * signs, ref, 1e-8)
    _close(t.variances, s, 1e-10)
    _close(t.inverse(y), x, 1e-9)                        # all d kept: invertible


def test_whitening_k_keeps_the_top_directions():
    x = _data()
    k = 5
    t = Whitening(k=k).fit(x)
    y = t(x)
    assert y.shape == (N, k) and t.out_dim == k
    _close(np.cov(y.T), np.eye(k), 1e-9)
    u, s = _cov_eig(x)
    xc = _centered(x)
    # y yᵀ = X̃ U_k diag(s_k)^-1 U_kᵀ X̃ᵀ (sign-free)
    _close(y @ y.T, xc @ (u[:, :k] / s[:k]) @ u[:, :k].T @ xc.T, 1e-8)
    with pytest.raises(ConfigError, match="no inverse: it keeps 5 of 12 directions"):
        t.inverse(y)
    with pytest.raises(ConfigError, match="maps dimension 12 to 5"):
        t.apply_(torch.zeros(3, D))


def test_zca_is_u_s_inv_sqrt_ut():
    x = _data()
    t = Whitening(zca=True).fit(x)
    u, s = _cov_eig(x)
    zca = u @ np.diag(s**-0.5) @ u.T
    _close(t.as_module().matrix.numpy(), zca, 1e-9)
    _close(t(x), _centered(x) @ zca, 1e-9)
    _close(np.cov(t(x).T), np.eye(D), 1e-9)
    _close(t.inverse(t(x)), x, 1e-9)


def test_fewer_rows_than_dimensions_drop_the_null_directions():
    n, d = 6, 10
    x = _data(n, d)
    u, s = _cov_eig(x)
    assert s[n - 1] < 1e-12 * s[0]                       # rank n - 1 = 5
    r = n - 1
    t = Whitening().fit(x)
    y = t(x)
    assert y.shape == (n, r) and t.out_dim == r
    _close(np.cov(y.T), np.eye(r), 1e-8)
    xc = _centered(x)
    _close(y @ y.T, xc @ np.linalg.pinv(np.cov(x.T), rcond=1e-10) @ xc.T, 1e-7)
    with pytest.raises(ValueError, match=r"6 directions requested but only r=5 of d=10"):
        Whitening(k=6).fit(x)
    z = Whitening(zca=True).fit(x)                       # U_r s_r^-1/2 U_rᵀ: nulls map to 0
    _close(z.as_module().matrix.numpy(), u[:, :r] @ np.diag(s[:r] ** -0.5) @ u[:, :r].T, 1e-7)
    with pytest.raises(ConfigError, match="no inverse: it keeps 5 of 10"):
        z.inverse(z(x))
    null = u[:, r:].sum(1)[None]                         # a vector along null directions only
    _close(z(null + x.mean(0)), np.zeros((1, d)), 1e-9)
    with pytest.raises(ValueError, match="6 directions requested but only r=5"):
        AllButTheTop(D=6).fit(x)


def test_zero_variance_coordinate_is_dropped_not_floored():
    x = _data(50, 6)
    x[:, 3] = 7.0                                        # a constant channel
    t = Whitening().fit(x)
    assert t.out_dim == 5
    _close(t.components[3], np.zeros(5), 1e-10)          # no kept direction reads channel 3
    _close(np.cov(t(x).T), np.eye(5), 1e-9)
    shifted = x.copy()
    shifted[:, 3] += 1e3                                 # unseen variation is ignored, not amplified
    _close(t(shifted), t(x), 1e-6)                       # (a floor would scale it by 1/√(eps·s_max) ~ 1e4)
    with pytest.raises(ValueError, match="no variance"):
        Whitening().fit(np.ones((4, 3)))
    with pytest.raises(ValueError, match="at least 2 rows"):
        AllButTheTop(D=1).fit(np.ones((1, 3)))


@pytest.mark.parametrize("project", ["centered", "raw"])
def test_all_but_the_top_matches_the_explicit_formula(project):
    x = _data()
    dd = 3
    t = AllButTheTop(D=dd, project=project).fit(x)
    xc = _centered(x)
    _, _, vt = np.linalg.svd(xc, full_matrices=False)    # PCA of the centred rows
    u = vt[:dd].T
    base = xc if project == "centered" else x
    ref = base - (base @ u) @ u.T                        # x' = x̃ − Σ (u_iᵀ x̃) u_i  /  x − Σ (u_iᵀ x) u_i
    y = t(x)
    _close(y, ref, 1e-9)
    _close(y @ u, np.zeros((N, dd)), 1e-9)               # orthogonal to the removed directions
    assert t.directions == dd
    with pytest.raises(ConfigError, match="no inverse: it removes the top 3 principal components"):
        t.inverse(y)


def test_all_but_the_top_default_D():
    assert AllButTheTop().fit(_data(40, 12)).directions == 1           # round(0.12), at least 1
    assert AllButTheTop().fit(_data(40, 150)).directions == 2          # ⌊1.5 + ½⌋
    assert AllButTheTop(D=0).fit(_data(40, 12)).directions == 0
    _close(AllButTheTop(D=0).fit(_data())(_data()), _centered(_data()), 1e-12)


@pytest.mark.parametrize("kind", ["random", "hadamard"])
@pytest.mark.parametrize("d", [16, 12, 7])
def test_rotation_is_orthogonal_and_keeps_inner_products(kind, d):
    x = _data(30, d)
    t = Rotation(kind, seed=5).fit(x)
    r = t.matrix.numpy()
    _close(r.T @ r, np.eye(d), 1e-12)
    y = t(x)
    _close(y @ y.T, x @ x.T, 1e-9)
    _close(t.inverse(y), x, 1e-9)
    assert torch.equal(Rotation(kind, seed=5).fit(np.zeros((0, d))).matrix, t.matrix)   # (kind, seed, d) only
    assert not torch.equal(Rotation(kind, seed=6).fit(np.zeros((0, d))).matrix, t.matrix)


def test_hadamard_rotation_flattens_a_one_hot_outlier_channel():
    d = 16
    t = Rotation("hadamard", seed=0).fit(np.zeros((0, d)))
    _close(np.abs(t.matrix.numpy()), np.full((d, d), 1 / 4), 1e-15)
    one_hot = np.eye(d)[[3]]
    assert outlier_stats(one_hot)["max_over_rms_mean"] == pytest.approx(math.sqrt(d))
    assert outlier_stats(t(one_hot))["max_over_rms_mean"] == pytest.approx(1.0)
    # activations with one outlier channel: the rotation spreads it over all channels
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, d))
    x[:, 3] *= 30.0
    x[::50, 5] += 200.0                                    # a heavy-tailed channel
    before, after = outlier_stats(x), outlier_stats(t(x))
    assert after["max_over_rms_mean"] < 0.5 * before["max_over_rms_mean"]
    assert after["kurtosis_max"] < 0.5 * before["kurtosis_max"]
    # d = 12 = 4·3: H_4 ⊗ Q_3, a one-hot vector ends with max/RMS <= √3
    t12 = Rotation("hadamard", seed=0).fit(np.zeros((0, 12)))
    ratios = [outlier_stats(t12(np.eye(12)[[j]]))["max_over_rms_mean"] for j in range(12)]
    assert max(ratios) <= math.sqrt(3) + 1e-9


def test_outlier_stats_formulas():
    rng = np.random.default_rng(1)
    x = rng.standard_t(3, size=(300, 8))
    x[:, 2] = 4.0                                          # constant channel: no kurtosis
    got = outlier_stats(torch.from_numpy(x).float())
    x32 = x.astype(np.float32).astype(np.float64)
    ratio = np.abs(x32).max(1) / np.sqrt((x32**2).mean(1))
    varying = np.delete(x32, 2, axis=1)
    c = varying - varying.mean(0)
    kurt = (c**4).mean(0) / (c**2).mean(0) ** 2 - 3      # excess kurtosis, biased central moments
    _close(got["max_over_rms_mean"], ratio.mean(), 1e-10)
    _close(got["max_over_rms_max"], ratio.max(), 1e-10)
    _close(got["max_over_rms_overall"], np.abs(x32).max() / np.sqrt((x32**2).mean()), 1e-10)
    _close(got["kurtosis_max"], kurt.max(), 1e-9)
    _close(got["kurtosis_mean"], kurt.mean(), 1e-9)
    assert (got["vectors"], got["channels"]) == (300, 7)
    with_zero = outlier_stats(np.vstack([x, np.zeros((1, 8))]))   # a zero vector has no ratio
    assert with_zero["vectors"] == 300 and with_zero["max_over_rms_max"] == pytest.approx(ratio.max(), rel=1e-6)
    stacked = outlier_stats(x.reshape(3, 100, 8))          # (..., d): leading dimensions are vectors
    assert stacked["max_over_rms_mean"] == pytest.approx(outlier_stats(x)["max_over_rms_mean"])
    empty = outlier_stats(np.zeros((0, 4)))
    assert math.isnan(empty["max_over_rms_mean"]) and math.isnan(empty["kurtosis_max"])


# ----------------------------------------------------------------------------- forms


@pytest.mark.parametrize("index", range(8))
def test_streaming_fit_equals_whole_tensor_fit(index):
    x = _data()
    whole = _all_transforms()[index].fit(torch.from_numpy(x))
    parts = (x[i : i + 37] for i in range(0, N, 37))        # a generator of numpy batches
    streamed = _all_transforms()[index].fit(parts)
    assert streamed.count == whole.count == N
    for name, value in whole._state.items():
        _close(streamed._state[name], value, 1e-10)
    mixed = _all_transforms()[index].fit([torch.from_numpy(x[:50]).float(), x[50:]])
    _close(mixed(x), whole(x), 1e-5)                       # float32 batch: float32 rounding of its rows


@pytest.mark.parametrize("index", range(8))
def test_module_form_equals_function_form(index):
    x = _data()
    t = _all_transforms()[index].fit(x)
    module = t.as_module()
    assert isinstance(module, TransformModule) and isinstance(module, nn.Module)
    xt = torch.from_numpy(x)
    torch.testing.assert_close(module(xt), t(xt), rtol=0, atol=0)
    torch.testing.assert_close(module(xt.float()), t(xt.float()), rtol=0, atol=0)
    assert set(module.state_dict()) <= {"shift", "matrix"} and module.out_features == t.out_dim
    before = module(xt)
    t.fit(x[:50] * 2)                                      # a refit leaves the module alone
    torch.testing.assert_close(module(xt), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="fitted on dimension 12"):
        module(torch.zeros(2, 5))


def test_numpy_in_numpy_out_and_dtypes():
    x = _data()
    t = Whitening(zca=True).fit(x)
    y32 = t(x.astype(np.float32))
    assert isinstance(y32, np.ndarray) and y32.dtype == np.float32
    assert t(x).dtype == np.float64
    assert t(x.astype(np.int64)).dtype == np.float64
    assert t(torch.from_numpy(x)).dtype == torch.float64
    assert t(torch.from_numpy(x).bfloat16()).dtype == torch.bfloat16
    _close(y32, t(x), 1e-4)
    batched = t(x.reshape(4, 50, D))                       # leading dimensions
    _close(batched.reshape(N, D), t(x), 1e-12)
    _close(t.inverse(y32.astype(np.float64)), x, 1e-4)
    xt = torch.from_numpy(x).requires_grad_()
    t(xt).sum().backward()                                 # differentiable function form
    assert xt.grad is not None and xt.grad.shape == (N, D)


def test_apply_rewrites_weight_rows_in_place():
    w = torch.from_numpy(_data(64, D)).float()
    head = nn.Linear(D, 64, bias=False)
    with torch.no_grad():
        head.weight.copy_(w)
    storage = head.weight.data_ptr()
    t = Centering().fit(head.weight)
    assert t.apply_(head) is head.weight and head.weight.data_ptr() == storage
    _close(head.weight.detach(), w.double().numpy() - w.double().numpy().mean(0), 1e-6)
    assert head.weight.requires_grad
    emb = nn.Embedding(64, D)
    r = Rotation("hadamard").fit(np.zeros((0, D)))
    before = emb.weight.detach().clone()
    r.apply_(emb.weight)
    _close(emb.weight.detach() @ emb.weight.detach().T, before @ before.T, 1e-5)
    with pytest.raises(ValueError, match="rows of dimension 5, the transform 12"):
        t.apply_(torch.zeros(3, 5))


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("index", range(8))
def test_save_load_round_trip(tmp_path, index):
    x = _data()
    t = _all_transforms()[index].fit(x)
    path = tmp_path / "t.safetensors"
    t.save(path)
    back = Transform.load(path)
    assert type(back) is type(t) and back.params == t.params
    assert (back.dim, back.out_dim, back.count) == (t.dim, t.out_dim, t.count)
    for name, value in t._state.items():
        assert torch.equal(back._state[name], value)
    torch.testing.assert_close(back(torch.from_numpy(x)), t(torch.from_numpy(x)), rtol=0, atol=0)
    assert type(load_transform(path)) is type(t) and type(type(t).load(path)) is type(t)


def test_load_refuses_corrupt_foreign_and_other_kinds(tmp_path):
    from safetensors.torch import save_file

    from aniso_plugins import save_state

    path = tmp_path / "c.safetensors"
    Centering().fit(_data()).save(path)
    with pytest.raises(StateError, match="holds a Centering, not a Whitening"):
        Whitening.load(path)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(path.read_bytes()[:40])
    with pytest.raises(StateError, match="corrupt.safetensors: not a readable safetensors file"):
        Transform.load(corrupt)
    with pytest.raises(StateError, match="not a readable"):
        Transform.load(tmp_path / "missing.safetensors")
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, weights)
    with pytest.raises(StateError, match="not an aniso_plugins transform file"):
        Transform.load(weights)
    state = tmp_path / "state.safetensors"
    save_state(state, {"agg": {"x": torch.zeros(1)}}, {})
    with pytest.raises(StateError, match="format='aniso_plugins.core.state'"):
        Transform.load(state)
    tampered = tmp_path / "tampered.safetensors"
    save_file({"mean": torch.zeros(5, dtype=torch.float64)}, tampered, metadata={
        "format": "aniso_plugins.transform", "version": "1", "kind": "centering", "params": "{}",
        "dim": "12", "out_dim": "12", "count": "3"})
    with pytest.raises(StateError, match="inconsistent centering transform file"):
        Transform.load(tampered)
    with pytest.raises(StateError, match="not fitted"):
        Centering().save(tmp_path / "x.safetensors")


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_value_and_the_fix():
    x = _data()
    with pytest.raises(StateError, match=r"Whitening is not fitted: call \.fit\(data\) first"):
        Whitening()(x)
    with pytest.raises(ValueError, match="last dimension 5, expected 12"):
        Centering().fit(x)(np.zeros((3, 5)))
    with pytest.raises(ValueError, match="last dimension 5, expected 12, the transform's output dimension"):
        Rotation().fit(x).inverse(np.zeros((3, 5)))
    for bad, match in [
        (lambda: Whitening(k=0), "k must be None or an integer >= 1, got 0"),
        (lambda: Whitening(k=True), "got True"),
        (lambda: Whitening(k=3, zca=True), "zca=True keeps the dimension"),
        (lambda: Whitening(eps=0.0), r"eps must be a float in \(0, 1\)"),
        (lambda: AllButTheTop(D=-1), "D must be None or an integer >= 0"),
        (lambda: AllButTheTop(project="mixed"), "project must be 'centered'"),
        (lambda: Rotation("dct"), "kind must be 'random' or 'hadamard', got 'dct'"),
        (lambda: Rotation(seed=1.5), "seed must be an integer"),
        (lambda: Whitening(k=13).fit(x), "k=13 exceeds the data's dimension d=12"),
        (lambda: AllButTheTop(D=13).fit(x), "D=13 exceeds the data's dimension d=12"),
    ]:
        with pytest.raises(ConfigError, match=match):
            bad()
    nan = x.copy()
    nan[4, 2] = np.nan
    for bad, match in [
        (lambda: Whitening().fit(nan), "NaN or inf"),
        (lambda: Centering().fit(x[0]), r"must be 2-D \(n, d\), got shape \(12,\)"),
        (lambda: Centering().fit(iter([])), "no batches"),
        (lambda: Centering().fit([x, x[:, :5]]), "batch 1 has dimension 5, earlier batches 12"),
        (lambda: Centering().fit(np.zeros((0, 3))), "no rows"),
        (lambda: Centering().fit("rows.npy"), "iterable of"),
        (lambda: Centering().fit(x.astype(np.complex128)), "not numeric"),
    ]:
        with pytest.raises(ValueError, match=match):
            bad()


# ----------------------------------------------------------------------------- LM head


def test_centering_an_untied_lm_head_keeps_predictions_and_raises_isotropy():
    from hf_utils import tiny_llama

    model = tiny_llama(seed=0, tied=False).eval()
    head = model.lm_head
    with torch.no_grad():                                  # an anisotropic head: a shared offset
        head.weight += 0.5 * torch.randn(head.weight.shape[1])
    ids = torch.randint(0, head.weight.shape[0], (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits.double().softmax(-1)
    embed_before = model.get_input_embeddings().weight.detach().clone()
    iso_before = isotropy(head.weight)
    Centering().fit(head.weight).apply_(head)
    with torch.no_grad():
        after = model(input_ids=ids).logits.double().softmax(-1)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    assert torch.equal(model.get_input_embeddings().weight, embed_before)
    _close(head.weight.detach().double().mean(0), np.zeros(head.weight.shape[1]), 1e-6)
    iso_after = isotropy(head.weight)
    assert iso_after > iso_before and iso_after > 2 * iso_before, (iso_before, iso_after)


# ----------------------------------------------------------------------------- 2 ranks

DIST_N, DIST_D = 101, 12


def _dist_transforms():
    return {"centering": Centering(), "whiten": Whitening(), "whiten_k": Whitening(k=5),
            "zca": Whitening(zca=True), "abtt": AllButTheTop(D=2), "abtt_raw": AllButTheTop(D=2, project="raw"),
            "hadamard": Rotation("hadamard", seed=2)}


def _dist_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x = torch.from_numpy(_data(DIST_N, DIST_D, seed=4))
    out = {}
    for name, t in _dist_transforms().items():
        # rank 0: one tensor of 60 rows; rank 1: the other 41 as an iterator of batches, one empty
        data = x[:60] if rank == 0 else iter([x[60:70], x[70:70], x[70:].numpy()])
        t.fit(data)
        out[name] = (t.count, {k: v.clone() for k, v in t._state.items()})
    out["rank0_only"] = Centering().fit(x[:60] if rank == 0 else []).mean  # a rank without batches
    try:
        Centering().fit(x if rank == 0 else x[:, :5])
    except ValueError as e:
        out["mismatch"] = str(e)
    head = nn.Linear(DIST_D, DIST_N, bias=False)           # FSDP2: a Shard(0) DTensor weight
    with torch.no_grad():
        head.weight.copy_(x.float())
    fully_shard(head, mesh=init_device_mesh("cpu", (world,)))
    Centering().fit(head.weight).apply_(head)
    out["fsdp_head"] = head.weight.full_tensor().detach().clone()
    return out


@pytest.mark.slow
def test_two_gloo_ranks_fit_the_single_process_transforms():
    results = run_distributed(_dist_worker)
    x = torch.from_numpy(_data(DIST_N, DIST_D, seed=4))
    for name, t in _dist_transforms().items():
        t.fit(x)
        for r in results:
            count, state = r[name]
            assert count == DIST_N, name
            for key, value in t._state.items():
                torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-10, msg=f"{name}/{key}")
    for r in results:
        torch.testing.assert_close(r["rank0_only"], x[:60].mean(0), rtol=1e-12, atol=1e-12)
        assert "different dimensions (between 5 and 12)" in r["mismatch"]
        torch.testing.assert_close(r["fsdp_head"], (x - x.mean(0)).float(), rtol=1e-6, atol=1e-6)
