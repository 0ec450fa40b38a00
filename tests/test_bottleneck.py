"""Gradient-bottleneck metrics against an explicit projector (numpy lstsq, float64), the
random-initialisation baseline 1 − d/V, and the empirical rank against an SVD count and a
pivoted QR."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F

from aniso_plugins import bottleneck_finish, bottleneck_stats, gradient_bottleneck, logit_gradient_rank
from aniso_plugins.metrics.bottleneck.probe import squared_row_norms

IGNORE = -100


def ref_logit_gradients(h: np.ndarray, w: np.ndarray, y: np.ndarray) -> np.ndarray:
    """G = softmax(H Wᵀ) − onehot(y), rows with y == IGNORE dropped (float64)."""
    keep = y != IGNORE
    h, y = h[keep], y[keep]
    z = h @ w.T
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p


def ref_bottleneck(h, w, y) -> dict[str, float]:
    """The metrics with an explicit projection P g = W lstsq(W, g) onto col(W)."""
    g = ref_logit_gradients(np.asarray(h, np.float64), np.asarray(w, np.float64), np.asarray(y))
    w = np.asarray(w, np.float64)
    coef, *_ = np.linalg.lstsq(w, g.T, rcond=None)
    pg = (w @ coef).T
    kept = (pg**2).sum(1)
    total = (g**2).sum(1)
    lost = 1 - kept.sum() / total.sum()
    return {
        "lost_fraction": lost,
        "lost_fraction_norm": math.sqrt(max(lost, 0.0)),
        "kept_cosine": float(np.mean(np.sqrt(kept / total))),
        "lost_fraction_token": float(np.mean(1 - kept / total)),
        "tokens": float(len(total)),
    }


def make_case(kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, v, d = 64, 300, 12
    if kind == "wide":  # V < d: col(W) = R^V, nothing is lost
        v = 8
    w = torch.randn(v, d, generator=g, dtype=torch.float64)
    if kind == "anisotropic":
        w = w @ torch.diag(torch.logspace(0, -2, d, dtype=torch.float64)) + 2.0
    elif kind == "duplicated":
        w = torch.cat([w[: v // 2], w[: v - v // 2]])
    elif kind == "zero_rows":
        w[::7] = 0.0
    elif kind == "rank_deficient":  # rank d/2 < d: the Gram is singular
        w = w[:, : d // 2] @ torch.randn(d // 2, d, generator=g, dtype=torch.float64)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = IGNORE
    return h, w, y


KINDS = ["isotropic", "anisotropic", "duplicated", "zero_rows", "rank_deficient", "wide"]


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_bottleneck_matches_explicit_projector(kind):
    h, w, y = make_case(kind)
    got = gradient_bottleneck(h, w, y, ignore_index=IGNORE)
    ref = ref_bottleneck(h.numpy(), w.numpy(), y.numpy())
    assert set(got) == set(ref)
    for name, value in ref.items():
        # √ turns round-off of a zero ℓ² (the wide case) into ~1e-8
        tol = 1e-7 if name == "lost_fraction_norm" else 1e-9
        assert got[name] == pytest.approx(value, rel=1e-9, abs=tol), name
    if kind == "wide":
        assert got["lost_fraction"] == pytest.approx(0.0, abs=1e-12)


def test_random_initialisation_loses_about_one_minus_d_over_v():
    g = torch.Generator().manual_seed(1)
    v, d = 4096, 64
    w = 0.02 * torch.randn(v, d, generator=g)
    h = torch.randn(1024, d, generator=g)
    y = torch.randint(0, v, (1024,), generator=g)
    got = gradient_bottleneck(h, w, y)
    assert got["lost_fraction"] == pytest.approx(1 - d / v, abs=0.005)
    assert got["kept_cosine"] == pytest.approx(math.sqrt(d / v), rel=0.1)


def test_stats_from_autograd_gradients_with_any_scale():
    """bottleneck_stats fed with what a head's backward gives (dh = c·Wᵀg, ‖c·g‖²), for a
    mean-reduced loss times an arbitrary factor, equals the reference."""
    h, w, y = make_case("anisotropic")
    hh = h.clone().requires_grad_(True)
    logits = hh @ w.T
    logits.retain_grad()
    (7.5 * F.cross_entropy(logits, y, ignore_index=IGNORE)).backward()
    grad_sq = logits.grad.square().sum(1)
    stats = bottleneck_stats(hh.grad, grad_sq, w.T @ w, prefix="p/")
    got = bottleneck_finish({k: s.value for k, s in stats.items()}, prefix="p/")
    ref = ref_bottleneck(h.numpy(), w.numpy(), y.numpy())
    for name, value in ref.items():
        assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-9), name


def test_float32_inputs():
    h, w, y = make_case("isotropic")
    got = gradient_bottleneck(h.float(), w.float(), y)
    ref = ref_bottleneck(h.float().double().numpy(), w.float().double().numpy(), y.numpy())
    for name, value in ref.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_squared_row_norms(dtype):
    g = torch.randn(2500, 3000, dtype=torch.float64).to(dtype)
    ref = (g.double().numpy() ** 2).sum(1)
    got = squared_row_norms(g, block_rows=1000)
    assert got.dtype == torch.float64 and got.shape == (2500,)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-12 if dtype == torch.float64 else 2e-6)


def test_no_valid_positions_gives_nan():
    h, w, y = make_case("isotropic")
    got = gradient_bottleneck(h, w, torch.full_like(y, IGNORE))
    assert got["tokens"] == 0 and math.isnan(got["lost_fraction"]) and math.isnan(got["kept_cosine"])


def _rank_references(h, w, y, rtol=1e-6):
    g = ref_logit_gradients(h.numpy(), w.numpy(), y.numpy())
    s = np.linalg.svd(g, compute_uv=False)
    svd_count = int((s > rtol * s[0]).sum())
    _, r, _ = scipy.linalg.qr(g.T, mode="economic", pivoting=True)
    diag = np.abs(np.diag(r))
    qr_count = int((diag > rtol * diag[0]).sum())
    return svd_count, qr_count


@pytest.mark.parametrize("case", ["full", "repeated", "rows_sum_to_zero"])
def test_logit_gradient_rank_matches_svd_and_pivoted_qr(case):
    g = torch.Generator().manual_seed(2)
    if case == "full":  # N < V: rank N
        n, v, d = 40, 200, 16
        h, y = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, v, (n,), generator=g)
        expected = n
    elif case == "repeated":  # 10 distinct (h, y) pairs, each 4 times: rank 10
        n, v, d = 40, 200, 16
        h0, y0 = torch.randn(10, d, generator=g, dtype=torch.float64), torch.randint(0, v, (10,), generator=g)
        h, y = h0.repeat(4, 1), y0.repeat(4)
        expected = 10
    else:  # N > V: every row of G sums to 0, so rank <= V - 1
        n, v, d = 100, 20, 16
        h, y = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, v, (n,), generator=g)
        expected = v - 1
    w = torch.randn(v, d, generator=g, dtype=torch.float64)
    got = logit_gradient_rank(h, w, y)
    svd_count, qr_count = _rank_references(h, w, y)
    assert got == svd_count == qr_count == expected


def test_bad_inputs_raise():
    h, w, y = make_case("isotropic")
    bad = y.clone()
    bad[0] = w.shape[0]
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 300\)"):
        gradient_bottleneck(h, w, bad)
    with pytest.raises(ValueError, match="targets shape"):
        gradient_bottleneck(h, w, y[:-1])
    with pytest.raises(ValueError, match="last dimension"):
        gradient_bottleneck(h[:, :-1], w, y)
    with pytest.raises(ValueError, match="rtol"):
        logit_gradient_rank(h, w, y, rtol=2.0)
    with pytest.raises(ValueError, match="dh must be"):
        bottleneck_stats(torch.zeros(3, 4), torch.zeros(2), torch.eye(4))
    with pytest.raises(ValueError, match="gram must be"):
        bottleneck_stats(torch.zeros(3, 4), torch.zeros(3), torch.eye(3))
