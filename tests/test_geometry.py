"""Geometry metrics and IsoScore against independent float64 numpy references (SVD, explicit
pairwise loops), on isotropic, anisotropic and degenerate matrices.

The reference functions here (``ref_*``) share no code with the package; the plugin and
distributed tests import them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from aniso_plugins import (
    effective_rank,
    isoscore,
    isotropy,
    mean_cosine,
    normalized_singular_values,
    principal_variance_share,
    singular_entropy,
    spectrum,
    w_error,
)

# --- independent references ----------------------------------------------------------------


def ref_mean_cosine(x: np.ndarray, center: bool = False) -> float:
    """Mean of cos(x_i, x_j) over ordered pairs i != j of nonzero rows, by explicit loops."""
    x = np.asarray(x, dtype=np.float64)
    if center:
        x = x - x.mean(0)
    rows = [r for r in x if np.linalg.norm(r) > 0]
    total, pairs = 0.0, 0
    for i, a in enumerate(rows):
        for j, b in enumerate(rows):
            if i != j:
                total += a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
                pairs += 1
    return total / pairs if pairs else math.nan


def ref_cross_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Mean cos over all pairs (row of a, row of b), nonzero rows only, explicit loops."""
    a = [u / np.linalg.norm(u) for u in a if np.linalg.norm(u) > 0]
    b = [v / np.linalg.norm(v) for v in b if np.linalg.norm(v) > 0]
    vals = [u @ v for u in a for v in b]
    return float(np.mean(vals)) if vals else math.nan


def ref_singular_values(x: np.ndarray, center: bool) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if center:
        x = x - x.mean(0)
    return np.linalg.svd(x, compute_uv=False)


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def ref_effective_rank(x, center=True, variant="sigma") -> float:
    s = ref_singular_values(x, center)
    q = s if variant == "sigma" else s**2
    return math.exp(_entropy(q / q.sum()))


def ref_singular_entropy(x, center=False, variant="sigma") -> float:
    s = ref_singular_values(x, center)
    q = s if variant == "sigma" else s**2
    return math.log(len(s)) - _entropy(q / q.sum())


def ref_orient(vectors: np.ndarray) -> np.ndarray:
    """Columns flipped so that each one's entry of largest magnitude is positive."""
    out = vectors.copy()
    for k in range(out.shape[1]):
        i = int(np.argmax(np.abs(out[:, k])))
        if out[i, k] < 0:
            out[:, k] = -out[:, k]
    return out


def ref_isotropy(x, center=False, both_signs=False) -> float:
    """I(W) = min_a Z(a) / max_a Z(a), a over the right singular vectors of W (the unit
    eigenvectors of WᵀW, from numpy's SVD), Z(a) = Σ_i exp(w_i·a) by an explicit loop."""
    x = np.asarray(x, dtype=np.float64)
    if center:
        x = x - x.mean(0)
    _, _, vt = np.linalg.svd(x, full_matrices=True)
    directions = ref_orient(vt.T)
    if both_signs:
        directions = np.concatenate([directions, -directions], axis=1)
    z = [sum(math.exp(float(w @ a)) for w in x) for a in directions.T]
    return min(z) / max(z)


def ref_isoscore(points: np.ndarray) -> float:
    """IsoScore, the five steps of Rudman et al. 2022 (docs/methods.md §5), points as rows."""
    x = np.asarray(points, dtype=np.float64)
    n = x.shape[1]
    centered = x - x.mean(0)
    _, _, vt = np.linalg.svd(centered, full_matrices=True)  # all n principal components
    projected = centered @ vt.T
    var = projected.var(axis=0, ddof=1)  # step 2
    normalized = math.sqrt(n) * var / np.linalg.norm(var)  # step 3
    delta = np.linalg.norm(normalized - 1) / math.sqrt(2 * (n - math.sqrt(n)))  # step 4
    return ((n - delta**2 * (n - math.sqrt(n))) ** 2 - n) / (n * (n - 1))  # step 5


# --- inputs ----------------------------------------------------------------------------------


def make_matrix(kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "isotropic":
        return torch.randn(40, 6, generator=g, dtype=torch.float64)
    if kind == "anisotropic":  # shared offset + low-rank part + small noise
        f64 = torch.float64
        base = torch.randn(40, 2, generator=g, dtype=f64) @ torch.randn(2, 6, generator=g, dtype=f64)
        return 1.5 * torch.ones(6, dtype=f64) + base + 0.05 * torch.randn(40, 6, generator=g, dtype=f64)
    if kind == "zero_rows":
        w = torch.randn(40, 6, generator=g, dtype=torch.float64) + 0.3
        w[[0, 7, 39]] = 0.0
        return w
    if kind == "duplicated":
        w = torch.randn(10, 6, generator=g, dtype=torch.float64)
        return torch.cat([w, w, w[:5]])
    if kind == "wide":  # V < d
        return torch.randn(5, 9, generator=g, dtype=torch.float64) + 0.2
    raise ValueError(kind)


KINDS = ["isotropic", "anisotropic", "zero_rows", "duplicated", "wide"]


def close(a: float, b: float, rtol: float = 1e-9, atol: float = 1e-12) -> bool:
    return abs(a - b) <= atol + rtol * abs(b)


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("center", [False, True])
def test_mean_cosine_matches_pairwise_loops(kind, center):
    w = make_matrix(kind)
    assert close(mean_cosine(w, center=center), ref_mean_cosine(w.numpy(), center))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("variant", ["sigma", "sigma2"])
def test_spectrum_metrics_match_numpy_svd(kind, center, variant):
    w = make_matrix(kind)
    x = w.numpy()
    assert close(effective_rank(w, center=center, variant=variant), ref_effective_rank(x, center, variant), rtol=1e-7)
    got = singular_entropy(w, center=center, variant=variant)
    assert close(got, ref_singular_entropy(x, center, variant), rtol=1e-7, atol=1e-7)
    s = ref_singular_values(x, center)
    got = normalized_singular_values(w, center=center).numpy()
    np.testing.assert_allclose(got, s / s[0], rtol=1e-6, atol=1e-7)
    for k in (1, 3):
        ref = float((s[:k] ** 2).sum() / (s**2).sum())
        assert close(principal_variance_share(w, k, center=center), ref, rtol=1e-9)
    for r in (0, 2):
        ref = float(np.sqrt((s[r:] ** 2).sum()) / np.linalg.norm(x - (x.mean(0) if center else 0)))
        assert close(w_error(w, r, center=center), ref, rtol=1e-7, atol=1e-7)


def test_effective_rank_variants_differ_and_bound():
    w = make_matrix("anisotropic")
    a, b = effective_rank(w, variant="sigma"), effective_rank(w, variant="sigma2")
    assert 1.0 <= b < a <= 6.0  # σ² concentrates more mass on the top directions
    # an orthogonal matrix has a flat spectrum: erank = d, singular entropy 0
    q, _ = torch.linalg.qr(torch.randn(30, 6, dtype=torch.float64))
    assert close(effective_rank(q, center=False), 6.0)
    assert abs(singular_entropy(q)) < 1e-12


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("center", [False, True])
def test_isotropy_matches_explicit_partition_function(kind, center):
    w = make_matrix(kind)
    assert close(isotropy(w, center=center), ref_isotropy(w.numpy(), center), rtol=1e-8)
    ref = ref_isotropy(w.numpy(), center, both_signs=True)
    assert close(isotropy(w, center=center, both_signs=True), ref, rtol=1e-8)


def test_isotropy_does_not_depend_on_the_solver_signs(monkeypatch):
    w = make_matrix("anisotropic")
    expected = isotropy(w), isotropy(w, center=True)
    eigh = torch.linalg.eigh

    def flipped(matrix):  # a solver returning every eigenvector with the other sign
        lam, vec = eigh(matrix)
        return lam, -vec

    monkeypatch.setattr(torch.linalg, "eigh", flipped)
    assert (isotropy(w), isotropy(w, center=True)) == expected


def test_isotropy_sign_convention_and_orderings():
    w = make_matrix("anisotropic")
    one_sign, both = isotropy(w), isotropy(w, both_signs=True)
    assert 0 < both <= one_sign <= 1
    # centering removes the shared offset: much more isotropic (docs/methods.md §2)
    assert isotropy(w, center=True) > 5 * one_sign
    # a small isotropic cloud: Z(a) ≈ V for every a, I ≈ 1
    small = 0.01 * torch.randn(4000, 8, dtype=torch.float64)
    assert isotropy(small) > 0.99
    # the ±a variant is sign-free: invariant under a reflection of a coordinate
    reflected = w * torch.tensor([1, -1, 1, 1, 1, 1], dtype=torch.float64)
    assert close(isotropy(reflected, both_signs=True), both, rtol=1e-9)


def test_isotropy_is_computed_in_log_space():
    w = 30.0 * make_matrix("anisotropic")  # exp(w·a) overflows float64 for these norms
    assert not math.isfinite(math.exp(float(w.norm(dim=1).max())) * 1e300)
    value = isotropy(w)
    assert 0.0 <= value < 1e-6


def test_float32_and_bfloat16_inputs_are_measured_in_float64():
    w = make_matrix("anisotropic")
    for dtype in (torch.float32, torch.bfloat16):
        wl = w.to(dtype)
        ref = wl.double().numpy()
        assert close(mean_cosine(wl), ref_mean_cosine(ref), rtol=1e-9)
        assert close(effective_rank(wl), ref_effective_rank(ref), rtol=1e-7)
        assert close(isotropy(wl), ref_isotropy(ref), rtol=1e-8)


def test_spectrum_object_and_rows():
    w = make_matrix("wide")
    spec = spectrum(w)
    assert spec.rows == 5 and spec.size == 5 and spec.eigenvalues.dtype == torch.float64
    # eigenvalues beyond the rank are exactly 0 (unresolved round-off removed)
    assert torch.all(spec.eigenvalues[5:] == 0)
    np.testing.assert_allclose(spec.singular_values.numpy(), ref_singular_values(w.numpy(), False), rtol=1e-10)


@pytest.mark.parametrize("kind", KINDS + ["big"])
def test_isoscore_matches_numpy_steps(kind):
    if kind == "big":
        pts = torch.randn(500, 20, dtype=torch.float64) * torch.linspace(0.1, 3, 20, dtype=torch.float64)
    else:
        pts = make_matrix(kind)
    assert close(isoscore(pts), ref_isoscore(pts.numpy()), rtol=1e-8, atol=1e-10)


def test_isoscore_extremes():
    assert isoscore(torch.randn(20000, 4, dtype=torch.float64)) > 0.99
    line = torch.randn(100, 1, dtype=torch.float64) * torch.tensor([[1.0, 2.0, -1.0, 0.5]], dtype=torch.float64)
    assert abs(isoscore(line)) < 1e-9
    # invariant to the mean and to scale
    pts = make_matrix("anisotropic")
    assert close(isoscore(3 * pts + 7), isoscore(pts), rtol=1e-9)


def test_degenerate_values_are_nan():
    zero = torch.zeros(6, 4)
    assert math.isnan(mean_cosine(zero)) and math.isnan(effective_rank(zero)) and math.isnan(isoscore(zero))
    one_row = torch.zeros(6, 4)
    one_row[2] = 1.0
    assert math.isnan(mean_cosine(one_row))
    # a zero matrix is perfectly isotropic under I(W): Z(a) = V for all a
    assert isotropy(zero) == 1.0


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="weight must be a 2-D"):
        mean_cosine(torch.zeros(5))
    with pytest.raises(ValueError, match="weight must be a 2-D floating-point"):
        effective_rank(torch.zeros(5, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        isotropy(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="variant='svd'"):
        effective_rank(torch.randn(5, 3), variant="svd")
    with pytest.raises(ValueError, match="k=0"):
        principal_variance_share(torch.randn(5, 3), k=0)
    with pytest.raises(ValueError, match="rank=-1"):
        w_error(torch.randn(5, 3), -1)
    with pytest.raises(ValueError, match="points must be a 2-D"):
        isoscore(torch.randn(5))
    with pytest.raises(ValueError, match="n >= 2"):
        isoscore(torch.randn(5, 1))
