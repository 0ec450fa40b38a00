"""The machinery of `aniso_plugins.offline.postprocess`: the reducible statistics a transform is
fitted from (row count, Σ x_i, the d×d Gram, float64, summed over the ranks under
torch.distributed), the affine application ``y = (x − shift) @ matrix``, its `nn.Module` form,
and the `Transform` base class (fit, function form, inverse, in-place rewrite, files). The
concrete transforms are in `aniso_plugins.offline.postprocess`, which also fills `TRANSFORMS`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import ClassVar, NamedTuple, TypeVar, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from aniso_plugins.core.errors import ConfigError, StateError
from aniso_plugins.core.version import __version__
from aniso_plugins.numerics.distributed import is_distributed, local_rows
from aniso_plugins.numerics.linalg import ROW_BLOCK, GramStats, covariance, eigh_gram, gram_stats_blocked
from aniso_plugins.numerics.reduce import Stat, reduce_stats

FORMAT = "aniso_plugins.transform"
FORMAT_VERSION = 1
DEFAULT_EPS = 1e-8
"""Relative variance floor: a principal direction with variance s_i ≤ eps·s_max is *null*
(no variance in the fit data, e.g. the d − n + 1 directions a fit on n ≤ d rows cannot see,
or a constant coordinate). Null directions are dropped, never floored (docs/methods.md §5.1)."""

Array = Union[torch.Tensor, np.ndarray]
FitData = Union[torch.Tensor, np.ndarray, Iterable[Union[torch.Tensor, np.ndarray]]]
T = TypeVar("T", bound="Transform")


# ----------------------------------------------------------------------------- statistics


class _Moments(NamedTuple):
    dim: int
    count: int
    stats: GramStats  # gram / row_sum are None where the transform does not need them


def _as_tensor(x: object, what: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "biuf":
            raise ValueError(f"{what}: numpy dtype {x.dtype} is not numeric; pass a float array")
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, torch.Tensor):
        if x.dtype.is_complex:
            raise ValueError(f"{what}: complex dtype {x.dtype} is not supported; pass a real tensor")
        return x
    raise ValueError(f"{what} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def _fit_rows(batch: object, index: int, distributed: bool) -> torch.Tensor:
    what = f"fit data (batch {index})"
    rows = _as_tensor(batch, what)
    if rows.dim() != 2:
        raise ValueError(f"{what} must be 2-D (n, d), got shape {tuple(rows.shape)}; reshape it with x.reshape(-1, d)")
    if rows.shape[1] == 0:
        raise ValueError(f"{what} has d = 0 columns")
    from torch.distributed.tensor import DTensor

    if isinstance(rows, DTensor):
        if not distributed and rows.device_mesh.size() > 1:
            raise ConfigError("a DTensor is fitted through its local shard: call fit(..., distributed=True)")
        rows = local_rows(rows).rows
    return rows.detach()


def _batches(data: FitData, distributed: bool) -> Iterator[torch.Tensor]:
    if isinstance(data, (torch.Tensor, np.ndarray)):
        yield _fit_rows(data, 0, distributed)
        return
    if isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise ValueError(
            f"fit data must be a tensor, a numpy array or an iterable of (n, d) batches, got {type(data).__name__}"
        )
    for i, batch in enumerate(data):
        yield _fit_rows(batch, i, distributed)


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _moments(data: FitData, order: int, distributed: bool) -> _Moments:
    """Count (order 0), + Σ x (order 1), + Σ x xᵀ (order 2) of all rows, float64, summed over
    the ranks when torch.distributed is initialized and `distributed` is True."""
    dim, count, gram, row_sum = None, 0, None, None
    for i, rows in enumerate(_batches(data, distributed)):
        if dim is None:
            dim = rows.shape[1]
            gram = torch.zeros(dim, dim, dtype=torch.float64, device=rows.device) if order >= 2 else None
            row_sum = torch.zeros(dim, dtype=torch.float64, device=rows.device) if order >= 1 else None
        elif rows.shape[1] != dim:
            raise ValueError(f"fit data: batch {i} has dimension {rows.shape[1]}, earlier batches {dim}")
        count += rows.shape[0]
        if order >= 2:
            s = gram_stats_blocked(rows)
            gram += s.gram.to(gram.device)
            row_sum += s.row_sum.to(row_sum.device)
        elif order == 1:
            for block in rows.split(ROW_BLOCK):
                row_sum += block.to(torch.float64).sum(0).to(row_sum.device)
    if distributed and is_distributed():
        device = _collective_device()
        big = 2**62
        probe = reduce_stats({
            "dmax": Stat(torch.tensor([dim or -1], device=device), "max"),
            "dmin": Stat(torch.tensor([dim or big], device=device), "min"),
        })
        dmax, dmin = int(probe["dmax"]), int(probe["dmin"])
        if dmax == -1:
            raise ValueError("fit data: no batches on any rank")
        if dmin != dmax:
            raise ValueError(f"fit data: the ranks' rows have different dimensions (between {dmin} and {dmax})")
        dim = dmax
        stats = {"count": Stat(torch.tensor([float(count)], dtype=torch.float64, device=device))}
        if order >= 1:
            stats["sum"] = Stat(torch.zeros(dim, dtype=torch.float64) if row_sum is None else row_sum)
        if order >= 2:
            stats["gram"] = Stat(torch.zeros(dim, dim, dtype=torch.float64) if gram is None else gram)
        stats = {k: Stat(v.value.to(device), v.op) for k, v in stats.items()}
        reduced = reduce_stats(stats)
        count = int(reduced["count"].item())
        row_sum, gram = reduced.get("sum"), reduced.get("gram")
    if dim is None:
        raise ValueError("fit data: no batches (an empty iterator)")
    cpu = torch.device("cpu")
    row_sum = None if row_sum is None else row_sum.to(cpu)
    gram = None if gram is None else gram.to(cpu)
    for name, t in (("Σ x", row_sum), ("Σ x xᵀ", gram)):
        if t is not None and not bool(torch.isfinite(t).all()):
            raise ValueError(f"fit data contains NaN or inf ({name} is not finite); clean or drop those rows")
    return _Moments(dim, count, GramStats(gram, row_sum, torch.tensor(float(count), dtype=torch.float64)))


def _principal(m: _Moments, eps: float, needed: int | None, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Eigen-decomposition Σ = U diag(s) Uᵀ of the sample covariance
    Σ = (Σ x xᵀ − n μμᵀ)/(n − 1) (numpy's ``np.cov``, as Su et al.'s code), s descending, and r,
    the number of non-null directions (s_i > eps·s_max). `needed` directions must be non-null."""
    if m.count < 2:
        raise ValueError(f"{name} needs at least 2 rows to estimate a covariance, got n={m.count}")
    s, u = eigh_gram(covariance(m.stats, center=True) / (m.count - 1))
    r = int((s > eps * s[0]).sum()) if s[0] > 0 else 0
    if r == 0:
        raise ValueError(f"{name}: the fit data has no variance (all {m.count} rows are equal)")
    if needed is not None and needed > r:
        raise ValueError(
            f"{name}: {needed} directions requested but only r={r} of d={m.dim} have variance above "
            f"eps·s_max (eps={eps:g}; n={m.count} rows span at most n − 1 = {m.count - 1}); "
            f"ask for at most {r} or fit on more (or less degenerate) rows"
        )
    return s, u, r


# ----------------------------------------------------------------------------- application


def _last_dim(x: torch.Tensor) -> int | str:
    return x.shape[-1] if x.dim() else "none (a scalar)"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point and dtype != torch.float64 else torch.float64


def _affine(x: torch.Tensor, shift: torch.Tensor | None, matrix: torch.Tensor | None,
            post: torch.Tensor | None = None) -> torch.Tensor:
    """((x − shift) @ matrix) + post, computed in float64 for float64 (and integer) inputs and
    in float32 otherwise; returned in the input's floating dtype (integer inputs: float64)."""
    ct = _compute_dtype(x.dtype)
    y = x.to(ct)
    if shift is not None:
        y = y - shift.to(y.device, ct)
    if matrix is not None:
        y = y @ matrix.to(y.device, ct)
    if post is not None:
        y = y + post.to(y.device, ct)
    return y.to(x.dtype if x.is_floating_point() else torch.float64)


class TransformModule(nn.Module):
    """A fitted transform as a module: ``forward(x) = (x − shift) @ matrix`` over the last
    dimension, with `shift` and `matrix` as (persistent, float64) buffers, so ``.to(device)``
    moves them and the model's ``state_dict`` holds them. Dtypes as the function form."""

    def __init__(self, kind: str, shift: torch.Tensor | None, matrix: torch.Tensor | None, dim: int, out_dim: int):
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, dim, out_dim
        self.register_buffer("shift", None if shift is None else shift.detach().clone())
        self.register_buffer("matrix", None if matrix is None else matrix.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self.kind}: input has last dimension {_last_dim(x)}, the transform was fitted on dimension "
                f"{self.in_features}"
            )
        return _affine(x, self.shift, self.matrix)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, in_features={self.in_features}, out_features={self.out_features}"


# ----------------------------------------------------------------------------- transforms


class Transform:
    """Base class: ``fit`` / ``transform`` (also ``__call__``) / ``inverse`` / ``as_module`` /
    ``apply_`` / ``save`` / ``load``. A transform is affine, y = (x − shift) @ matrix; the
    subclasses say how the two are fitted."""

    kind: ClassVar[str]
    _order: ClassVar[int]  # statistics fit needs: 0 count, 1 + Σ x, 2 + Σ x xᵀ
    _tensors: ClassVar[tuple[str, ...]]

    def __init__(self) -> None:
        self._state: dict[str, torch.Tensor] | None = None
        self._affine_parts: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
        self._dim = 0
        self._count = 0

    # -- what a subclass provides
    @property
    def params(self) -> dict:
        """The constructor's arguments (JSON-serialisable; written into the file header)."""
        raise NotImplementedError

    def _solve(self, m: _Moments) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _build_forward(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(shift, matrix) of y = (x − shift) @ matrix from the fitted state."""
        raise NotImplementedError

    def _backward(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(matrix, post) of the inverse x = y @ matrix + post; raises ConfigError if none."""
        raise NotImplementedError

    def _check_state(self, state: dict[str, torch.Tensor], dim: int) -> None:
        raise NotImplementedError

    # -- fitted state
    @property
    def fitted(self) -> bool:
        return self._state is not None

    def _require_fitted(self) -> dict[str, torch.Tensor]:
        if self._state is None:
            raise StateError(f"{type(self).__name__} is not fitted: call .fit(data) first (or Transform.load(path))")
        return self._state

    @property
    def dim(self) -> int:
        """Input dimension d of the fit data."""
        self._require_fitted()
        return self._dim

    @property
    def out_dim(self) -> int:
        """Output dimension (d except for a PCA whitening that keeps k or r < d directions)."""
        return self.dim

    def _forward(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self._require_fitted()
        if self._affine_parts is None:  # built once per fit / load (ZCA's matrix costs O(d³))
            self._affine_parts = self._build_forward()
        return self._affine_parts

    def _set_state(self, state: dict[str, torch.Tensor], dim: int, count: int) -> None:
        self._state = {k: v.to(torch.float64).contiguous() for k, v in state.items()}
        self._dim, self._count, self._affine_parts = dim, count, None

    @property
    def count(self) -> int:
        """Rows the transform was fitted on (summed over ranks)."""
        self._require_fitted()
        return self._count

    def fit(self: T, data: FitData, *, distributed: bool = True) -> T:
        """Fit on `data`: an (n, d) tensor or numpy array, or an iterable of them (streamed: only
        the float64 statistics are kept). Replaces any earlier fit; returns self.

        With torch.distributed initialized (more than one rank) and ``distributed=True``, `data`
        is this rank's share of the rows and the statistics are summed over the default group
        (collective: every rank must call fit; a rank may have no rows). An FSDP2 DTensor is
        read through its local shard. For a DDP-replicated weight (every rank holds all rows)
        pass ``distributed=False``: each rank then fits the same transform on its copy."""
        m = _moments(data, self._order, distributed)
        self._set_state(self._solve(m), m.dim, m.count)
        return self

    # -- function form
    def _check_input(self, x: torch.Tensor, dim: int, what: str) -> None:
        if x.dim() == 0 or x.shape[-1] != dim:
            side = "input dimension d (of the fit data)" if what == "transform" else "output dimension"
            raise ValueError(
                f"{type(self).__name__}.{what}: input has last dimension {_last_dim(x)}, "
                f"expected {dim}, the transform's {side}"
            )

    def transform(self, x: Array) -> Array:
        """y = (x − shift) @ matrix over the last dimension of `x` (..., d). Torch in, torch out
        (differentiable); numpy in, numpy out. Floating dtypes are kept (float64 computed in
        float64, others in float32); integer inputs give float64."""
        t = _as_tensor(x, "input")
        self._check_input(t, self.dim, "transform")
        y = _affine(t, *self._forward())
        return y.detach().cpu().numpy() if isinstance(x, np.ndarray) else y

    __call__ = transform

    def inverse(self, y: Array) -> Array:
        """x = y @ matrix⁻¹ + shift where the transform is invertible (Centering, Rotation,
        Whitening keeping all d directions); ConfigError naming why otherwise."""
        t = _as_tensor(y, "input")
        matrix, post = self._backward()
        self._check_input(t, self.out_dim, "inverse")
        x = _affine(t, None, matrix, post)
        return x.detach().cpu().numpy() if isinstance(y, np.ndarray) else x

    def as_module(self) -> TransformModule:
        """The transform as an `nn.Module` (buffers are copies: a later fit does not change it),
        e.g. to append after a sentence-embedding model's pooling."""
        shift, matrix = self._forward()
        return TransformModule(self.kind, shift, matrix, self.dim, self.out_dim)

    def apply_(self, target: nn.Module | torch.Tensor) -> torch.Tensor:
        """Rewrite the rows of a (V, d) weight in place, w_i ← transform(w_i), under no_grad and
        in blocks of `ROW_BLOCK` rows; returns the weight. `target` is a tensor / Parameter or a
        module with a ``.weight`` (nn.Linear head, nn.Embedding). An FSDP2 DTensor is rewritten
        shard by shard. Needs out_dim == dim (ConfigError otherwise). A tied head and input
        embedding share the matrix: rewriting one rewrites both (see `Centering`)."""
        weight = target.weight if isinstance(target, nn.Module) else target
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"apply_ needs a 2-D floating-point (V, d) weight, got {type(weight).__name__} "
                             f"{tuple(getattr(weight, 'shape', ()))}")
        if self.out_dim != self.dim:
            raise ConfigError(
                f"{self!r} maps dimension {self.dim} to {self.out_dim}: a (V, {self.dim}) weight cannot be "
                "rewritten in place; keep all directions (k=None on full-rank data, or zca=True)"
            )
        if weight.shape[1] != self.dim:
            raise ValueError(f"apply_: weight has rows of dimension {weight.shape[1]}, the transform {self.dim}")
        from torch.distributed.tensor import DTensor

        shift, matrix = self._forward()
        with torch.no_grad():
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            for block in local.split(ROW_BLOCK):
                block.copy_(_affine(block, shift, matrix))
        return weight

    # -- files
    def save(self, path: str | os.PathLike) -> None:
        """Write the fitted tensors to a safetensors file (atomically: temp file + rename) with a
        JSON header: format, version, kind, params, dim, out_dim, count."""
        from safetensors.torch import save_file

        state = self._require_fitted()
        meta = {
            "format": FORMAT, "version": str(FORMAT_VERSION), "package": __version__, "kind": self.kind,
            "params": json.dumps(self.params), "dim": str(self.dim), "out_dim": str(self.out_dim),
            "count": str(self.count),
        }
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        save_file({k: v.contiguous() for k, v in state.items()}, tmp, metadata=meta)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Transform:
        """Read a file written by `save`; returns the class its header names (``Transform.load``)
        or refuses another kind (``Whitening.load`` of a Centering file). StateError for an
        unreadable, corrupt or foreign file, naming the path."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = os.fspath(path)
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(path)
        except Exception as e:  # safetensors' errors, OSError: all mean "cannot read it"
            raise StateError(
                f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); it is missing, truncated or "
                "corrupt: fit the transform again and save it with .save(path)"
            ) from e
        if meta.get("format") != FORMAT:
            raise StateError(
                f"{path}: not an aniso_plugins transform file (format={meta.get('format')!r}; a transform file has "
                f"format={FORMAT!r}): pass a file written by Transform.save"
            )
        if meta.get("version") != str(FORMAT_VERSION):
            raise StateError(
                f"{path}: transform file version {meta.get('version')}, this package reads {FORMAT_VERSION}"
            )
        kind = meta.get("kind")
        klass = TRANSFORMS.get(kind)
        if klass is None:
            raise StateError(f"{path}: unknown transform kind {kind!r} (known: {sorted(TRANSFORMS)})")
        if not issubclass(klass, cls):
            raise StateError(f"{path} holds a {klass.__name__}, not a {cls.__name__}: load it with Transform.load")
        try:
            obj = klass(**json.loads(meta["params"]))
            dim, count = int(meta["dim"]), int(meta["count"])
            if set(tensors) != set(klass._tensors):
                raise ValueError(f"tensors {sorted(tensors)}, expected {sorted(klass._tensors)}")
            state = {k: v.to(torch.float64) for k, v in tensors.items()}
            for name, t in state.items():
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"tensor {name!r} has NaN or inf entries")
            obj._check_state(state, dim)
        except (ConfigError, KeyError, TypeError, ValueError) as e:
            raise StateError(f"{path}: inconsistent {kind} transform file ({type(e).__name__}: {e})") from e
        obj._set_state(state, dim, count)
        if obj.out_dim != int(meta.get("out_dim", -1)):
            raise StateError(f"{path}: header out_dim {meta.get('out_dim')} but the tensors give {obj.out_dim}")
        return obj

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        fit = f"; fitted {self._dim} -> {self.out_dim} on {self._count} rows" if self.fitted else "; not fitted"
        return f"{type(self).__name__}({args}{fit})"



TRANSFORMS: dict[str, type[Transform]] = {}
"""File kind -> class, for `Transform.load` (filled by `aniso_plugins.offline.postprocess`)."""


__all__ = ["DEFAULT_EPS", "FORMAT", "FORMAT_VERSION", "TRANSFORMS", "Transform", "TransformModule"]
