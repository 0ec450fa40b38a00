"""Post-processing transforms of embedding vectors (docs/methods.md §5.1): centering,
BERT-whitening / ZCA, all-but-the-top, orthogonal rotations, and an outlier-channel metric.

Every transform is affine, ``y = (x − shift) @ matrix`` (either part may be absent), and is
fitted from reducible statistics of the rows it sees: the row count n, Σ x_i and the d×d
Gram Σ x_i x_iᵀ, all float64 (`aniso_plugins.numerics.linalg`). So ``fit`` streams over an iterator of
batches without holding the vectors, and under torch.distributed it sums the statistics over
the ranks (`aniso_plugins.numerics.reduce.reduce_stats`): every rank ends with the transform a single
process would fit on all ranks' rows together.

    t = Whitening(k=256).fit(batches)        # a tensor, a numpy array or an iterator of batches
    y = t(x)                                 # function form: torch in -> torch out, numpy -> numpy
    pipeline.append(t.as_module())           # nn.Module form with buffers
    Centering().fit(head.weight).apply_(head)    # rewrite the (V, d) rows of a weight in place
    t.save("whiten.safetensors"); t = Transform.load("whiten.safetensors")

Errors: `ConfigError` for bad arguments (and an inverse that does not exist), `StateError`
for an unfitted transform or an unreadable file, ``ValueError`` for bad data (dimension
mismatch, NaN, too few rows or directions).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import ClassVar, Literal

import torch

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.offline.outliers import outlier_stats
from aniso_plugins.offline.transform_base import (
    DEFAULT_EPS,
    TRANSFORMS,
    Transform,
    TransformModule,
    _Moments,
    _principal,
)


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ConfigError(f"eps must be a float in (0, 1), got {eps!r}")
    return float(eps)


def _check_count(value: object, name: str, minimum: int) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ConfigError(f"{name} must be None or an integer >= {minimum}, got {value!r}")
    return value


class Centering(Transform):
    """x ↦ x − μ, μ the mean of the fit rows (seed 000, "Mean Centering"; docs/methods.md §5.1).
    Invertible: y ↦ y + μ.

    **Lossless on an untied LM head.** With logits z_k = ⟨w_k, h⟩ (+ b_k), centring the head's
    rows, w_k ← w_k − μ, gives z_k − ⟨μ, h⟩: every logit of a position moves by the same
    amount, so softmax probabilities, argmax predictions and the loss are unchanged, while the
    head's raw I(W) (docs/methods.md §2) typically rises, the shared mean direction being gone:

        Centering().fit(model.lm_head.weight).apply_(model.lm_head)

    **Not lossless for a tied head**: the head and the input embedding are one matrix, so the
    same call also shifts every input embedding by −μ, and the network sees other inputs."""

    kind = "centering"
    _order = 1
    _tensors = ("mean",)

    @property
    def params(self) -> dict:
        return {}

    def _solve(self, m: _Moments) -> dict[str, torch.Tensor]:
        if m.count == 0:
            raise ValueError("Centering: the fit data has no rows")
        return {"mean": m.stats.row_sum / m.count}

    def _build_forward(self):
        return self._require_fitted()["mean"], None

    def _backward(self):
        return None, self._require_fitted()["mean"]

    def _check_state(self, state, dim):
        if state["mean"].shape != (dim,):
            raise ValueError(f"mean has shape {tuple(state['mean'].shape)}, expected ({dim},)")

    @property
    def mean(self) -> torch.Tensor:
        return self._require_fitted()["mean"]


class _PrincipalDirections(Transform):
    """State shared by the transforms built on principal directions of the fit data: the mean
    μ, the directions U (d, k) float64 by decreasing variance, and their variances s
    (covariance eigenvalues, 1/(n − 1) normalised)."""

    _positive_variances: ClassVar[bool] = True

    def _check_state(self, state, dim):
        u, s = state["components"], state["variances"]
        shapes = state["mean"].shape == (dim,) and u.dim() == 2 and u.shape[0] == dim and s.shape == (u.shape[1],)
        if not shapes or (self._positive_variances and not bool((s > 0).all())):
            raise ValueError(f"mean ({dim},), components ({dim}, k) and variances (k,) expected (positive: whitening)")

    @property
    def mean(self) -> torch.Tensor:
        return self._require_fitted()["mean"]

    @property
    def components(self) -> torch.Tensor:
        """U of the directions, (d, k) float64, columns by decreasing variance."""
        return self._require_fitted()["components"]

    @property
    def variances(self) -> torch.Tensor:
        """s of the directions (covariance eigenvalues, 1/(n − 1) normalised)."""
        return self._require_fitted()["variances"]


class Whitening(_PrincipalDirections):
    """BERT-whitening (Su et al. 2021, arXiv 2103.15316; seed 000; docs/methods.md §5.1):

        Σ = (1/(n − 1)) Σ_i (x_i − μ)(x_i − μ)ᵀ = U diag(s) Uᵀ    (s descending; np.cov)
        W = U diag(s)^(−1/2),   y = (x − μ) W

    keeping the first k columns of W (the k largest-variance directions; k=None: all), so the
    fit rows have sample covariance I_k. ``zca=True`` gives W = U diag(s)^(−1/2) Uᵀ
    (ZCA / Mahalanobis whitening): same dimension, the coordinates kept; k must be None.
    The paper then L2-normalises y for cosine retrieval; that is left to the caller.

    **Null directions** (s_i ≤ eps·s_max, `DEFAULT_EPS`; fewer rows than dimensions, constant
    coordinates) are **dropped, not floored**: flooring would scale by 1/√(eps·s_max) along
    directions the fit data never saw. k=None keeps the r non-null directions (out_dim = r,
    d for full-rank data), k > r raises ValueError; ZCA projects the null directions to 0
    (W = U_r s_r^(−1/2) U_rᵀ). The inverse exists when all d directions are kept
    (y ↦ y diag(s)^(1/2) Uᵀ + μ, ZCA: y ↦ y U diag(s)^(1/2) Uᵀ + μ)."""

    kind = "whitening"
    _order = 2
    _tensors = ("mean", "components", "variances")

    def __init__(self, k: int | None = None, zca: bool = False, eps: float = DEFAULT_EPS) -> None:
        super().__init__()
        self.k = _check_count(k, "k", 1)
        if not isinstance(zca, bool):
            raise ConfigError(f"zca must be True or False, got {zca!r}")
        if zca and k is not None:
            raise ConfigError(
                f"zca=True keeps the dimension: k must be None, got k={k}; use zca=False to keep k directions"
            )
        self.zca, self.eps = zca, _check_eps(eps)

    @property
    def params(self) -> dict:
        return {"k": self.k, "zca": self.zca, "eps": self.eps}

    def _solve(self, m: _Moments) -> dict[str, torch.Tensor]:
        if self.k is not None and self.k > m.dim:
            raise ConfigError(f"Whitening: k={self.k} exceeds the data's dimension d={m.dim}; pass k <= {m.dim}")
        s, u, r = _principal(m, self.eps, self.k, "Whitening")
        keep = r if self.k is None else self.k
        mean = m.stats.row_sum / m.count
        return {"mean": mean, "components": u[:, :keep], "variances": s[:keep]}

    def _build_forward(self):
        st = self._require_fitted()
        w = st["components"] * st["variances"].rsqrt()
        return st["mean"], (w @ st["components"].T if self.zca else w)

    @property
    def out_dim(self) -> int:
        return self.dim if self.zca else self.components.shape[1]

    def _backward(self):
        st = self._require_fitted()
        u, s = st["components"], st["variances"]
        if u.shape[1] != self._dim:
            raise ConfigError(
                f"{self!r} has no inverse: it keeps {u.shape[1]} of {self._dim} directions "
                "(k < d, or null directions dropped), so the rest of x is lost"
            )
        back = (u * s.sqrt()).T
        return (u @ back if self.zca else back), st["mean"]



class AllButTheTop(_PrincipalDirections):
    """All-but-the-top (Mu & Viswanath 2018, ICLR; docs/methods.md §5.1): remove the mean and
    the top D principal directions u_1..u_D of the centred fit rows,

        project="centered" (default):  x̃ = x − μ,  x' = x̃ − Σ_{i≤D} (u_iᵀ x̃) u_i = x̃ (I − U_D U_Dᵀ)
        project="raw":                  x' = x − Σ_{i≤D} (u_iᵀ x) u_i = x (I − U_D U_Dᵀ)  (μ kept)

    D = None: ⌊d/100 + ½⌋, at least 1 (the paper's D ≈ d/100); D = 0 is plain centering
    ("centered"). The two variants differ by the constant vector μ(I − U_D U_Dᵀ), so
    differences of vectors agree but cosines do not. Both outputs are orthogonal to every u_i.
    u_i are the eigenvectors of the sample covariance (as `Whitening`); the D removed
    directions must be non-null (s_i > eps·s_max, ValueError otherwise). No inverse: the
    removed components are lost."""

    kind = "all_but_the_top"
    _order = 2
    _tensors = ("mean", "components", "variances")

    def __init__(self, D: int | None = None, project: Literal["centered", "raw"] = "centered",
                 eps: float = DEFAULT_EPS) -> None:
        super().__init__()
        self.D = _check_count(D, "D", 0)
        if project not in ("centered", "raw"):
            raise ConfigError(
                f"project must be 'centered' (x − μ, the default) or 'raw' (x, μ kept), got {project!r}"
            )
        self.project, self.eps = project, _check_eps(eps)

    @property
    def params(self) -> dict:
        return {"D": self.D, "project": self.project, "eps": self.eps}

    def _solve(self, m: _Moments) -> dict[str, torch.Tensor]:
        D = max(1, int(m.dim / 100 + 0.5)) if self.D is None else self.D
        if D > m.dim:
            raise ConfigError(f"AllButTheTop: D={D} exceeds the data's dimension d={m.dim}; pass D <= {m.dim}")
        s, u, _ = _principal(m, self.eps, D, "AllButTheTop")
        return {"mean": m.stats.row_sum / m.count, "components": u[:, :D], "variances": s[:D]}

    def _build_forward(self):
        st = self._require_fitted()
        u = st["components"]
        proj = torch.eye(self._dim, dtype=torch.float64) - u @ u.T
        return (st["mean"] if self.project == "centered" else None), proj

    def _backward(self):
        raise ConfigError(
            f"{self!r} has no inverse: it removes the top {self.directions} principal components"
            f"{' and the mean' if self.project == 'centered' else ''}, which cannot be recovered from the output"
        )

    _positive_variances = False

    @property
    def directions(self) -> int:
        """The D used (the default resolved at fit)."""
        return self._require_fitted()["components"].shape[1]


def hadamard(n: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix H_n / √n (orthogonal, entries ±1/√n), n a power of two."""
    if n < 1 or n & (n - 1):
        raise ConfigError(f"hadamard: n must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """A Haar-distributed n×n orthogonal matrix: Q of the QR of a Gaussian matrix, columns signed
    by diag(R) (Mezzadri 2007), float64."""
    q, r = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=generator))
    return (q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, 1.0)).contiguous()


class Rotation(Transform):
    """An orthogonal rotation x ↦ x R, RᵀR = I (seed 000, QuaRot / SpinQuant paragraph;
    docs/methods.md §5.1): every inner product, norm and cosine is kept, while outlier channels
    are spread over all coordinates (see `outlier_stats`). Inverse: y ↦ y Rᵀ.

    - kind="random": R Haar-random orthogonal from `seed` (`random_orthogonal`).
    - kind="hadamard": the randomized Hadamard rotation of QuaRot, R = diag(±1) H_d/√d with
      signs drawn from `seed`: a one-hot x becomes ±1/√d in every coordinate. For d = 2^m·q
      with q odd and > 1 (no Hadamard matrix is built for such d here), R = diag(±1)(H_{2^m}/√2^m
      ⊗ Q_q) with Q_q a random orthogonal q×q matrix: still dense and orthogonal, and a one-hot
      x has max_j |y_j| ≤ √q·RMS(y) (QuaRot uses tabulated Hadamard matrices of order q instead).

    R depends only on (kind, seed, d): fitting reads the dimension (and counts the rows) only,
    so ``Rotation().fit(torch.empty(0, d))`` builds one without data. R is stored in the file.
    (The rotation's kind is ``.rotation``; the class attribute ``kind`` names the file kind.)"""

    kind = "rotation"
    _order = 0
    _tensors = ("matrix",)

    def __init__(self, kind: Literal["random", "hadamard"] = "random", seed: int = 0) -> None:
        super().__init__()
        if kind not in ("random", "hadamard"):
            raise ConfigError(f"Rotation kind must be 'random' or 'hadamard', got {kind!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"Rotation seed must be an integer, got {seed!r}")
        self.rotation, self.seed = kind, seed

    @property
    def params(self) -> dict:
        return {"kind": self.rotation, "seed": self.seed}

    def _solve(self, m: _Moments) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed)
        d = m.dim
        if self.rotation == "random":
            return {"matrix": random_orthogonal(d, g)}
        p = d & -d  # the largest power of two dividing d
        signs = torch.randint(0, 2, (d,), generator=g).to(torch.float64) * 2 - 1
        r = hadamard(p) if p == d else torch.kron(hadamard(p), random_orthogonal(d // p, g))
        return {"matrix": signs[:, None] * r}

    def _build_forward(self):
        return None, self._require_fitted()["matrix"]

    def _backward(self):
        return self._require_fitted()["matrix"].T, None

    def _check_state(self, state, dim):
        r = state["matrix"]
        if r.shape != (dim, dim) or not torch.allclose(r.T @ r, torch.eye(dim, dtype=torch.float64), atol=1e-10):
            raise ValueError(f"matrix must be a ({dim}, {dim}) orthogonal matrix")

    @property
    def matrix(self) -> torch.Tensor:
        """R, (d, d) float64."""
        return self._require_fitted()["matrix"]




TRANSFORMS.update({c.kind: c for c in (Centering, Whitening, AllButTheTop, Rotation)})
"""File kind -> class, for `Transform.load`."""


BY_NAME: dict[str, Callable[[], Transform]] = {
    "centering": Centering,
    "whitening": Whitening,
    "zca": lambda: Whitening(zca=True),
    "all_but_the_top": AllButTheTop,
    "abtt": AllButTheTop,
    "rotation": Rotation,
    "hadamard": lambda: Rotation(kind="hadamard"),
}
"""The names ``aniso report --postprocess`` accepts -> an unfitted transform with defaults."""


WITH_K: dict[str, Callable[[int], Transform]] = {
    "whitening": lambda k: Whitening(k=k),
    "all_but_the_top": lambda k: AllButTheTop(D=k),
    "abtt": lambda k: AllButTheTop(D=k),
}
"""The names that take a number of directions `k`: whitening keeps k, all-but-the-top removes k."""


def make_transform(name: str, k: int | None = None) -> Transform:
    """The unfitted transform called `name` (`BY_NAME`; case and ``-``/``_`` ignored), with `k`
    directions where it takes them (`WITH_K`)."""
    key = name.strip().lower().replace("-", "_")
    if key not in BY_NAME:
        raise ConfigError(f"unknown post-processing {name!r}: expected one of {', '.join(sorted(BY_NAME))}")
    if k is None:
        return BY_NAME[key]()
    if key not in WITH_K:
        raise ConfigError(f"--k {k}: only whitening (directions kept) and all_but_the_top (directions removed) take --k")
    return WITH_K[key](k)


def load_transform(path: str | os.PathLike) -> Transform:
    """`Transform.load`: the transform saved at `path`, of the class its header names."""
    return Transform.load(path)


__all__ = [
    "AllButTheTop",
    "BY_NAME",
    "Centering",
    "DEFAULT_EPS",
    "Rotation",
    "TRANSFORMS",
    "WITH_K",
    "Transform",
    "TransformModule",
    "Whitening",
    "hadamard",
    "load_transform",
    "make_transform",
    "outlier_stats",
    "random_orthogonal",
]
