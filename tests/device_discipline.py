"""What a GPU charges that a CPU never shows, made checkable on the CPU (docs/performance.md, "What
the GPU pays").

- `HostSyncs`: a `TorchDispatchMode` that counts, by kind, the aten ops that read a device value back
  to the host on CUDA (each one drains the launch queue and idles the GPU): ``.item()`` /
  ``int(t)`` / ``bool(t)`` (``aten._local_scalar_dense``), ops whose output shape depends on the
  data (``nonzero``, ``unique``, ``masked_select``, boolean-mask indexing, ``repeat_interleave``
  without ``output_size``), and ``bincount`` (CUDA reads the ids' range back, also with
  ``minlength``). Run the same window of training steps with and without a method and subtract.
  Copies to the host (``.cpu()``, ``.tolist()``, ``.numpy()``) count one each, whatever their size;
  reads of host copies (`aniso_plugins.numerics.host_copy.to_host`, and what is computed from
  them alone) are not counted: the copy itself is the one read.
- `fake_cuda`: PyTorch's `FakeTensorMode` with a fake ``cuda`` device on this CPU-only machine: ops
  compute shapes, dtypes and devices only, and raise where they would read a value back
  (``DataDependentOutputException``, ``DynamicOutputShapeException``) or where a host tensor meets
  a device tensor (``FakeTensorDeviceMismatchError``).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aniso_plugins.numerics.host_copy import HOST_COPY_MARK

aten = torch.ops.aten

_SHAPE_FROM_DATA = {
    aten.nonzero: "nonzero",
    aten.nonzero_static: None,  # a static size: no read back
    aten.masked_select: "masked_select",
    aten._unique2: "unique",
    aten.unique_dim: "unique",
    aten.unique_consecutive: "unique",
    aten._unique: "unique",
    aten.bincount: "bincount",
}


def _is_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices if i is not None)


_OURS = ("/aniso_plugins/", "/integrations/")


class HostSyncs(TorchDispatchMode):
    """Counts the ops of the code run inside it that read a value back to the host on CUDA, by
    kind (``counts``; ``total``), and with ``where=True`` by the line that asked (``sites``: the
    innermost frame outside torch; "(not ours)" where it is not this package's, e.g. the
    trainer's own)."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()
        self._where = where
        self._patched: list[tuple[str, object]] = []

    def __enter__(self):
        # a copy to the host is a read too (one per call, whatever its size); it does not reach
        # the dispatcher where the tensor is on the CPU already, so the methods are wrapped
        for name in ("tolist", "cpu", "numpy"):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                if not getattr(tensor, HOST_COPY_MARK, False) and tensor.device.type != "meta":
                    self._count(_name)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
            self._patched.append((name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in reversed(self._patched):
            setattr(torch.Tensor, name, original)
        self._patched = []
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _count(self, kind: str) -> None:
        self.counts[kind] += 1
        if self._where:
            import traceback

            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                      and not f.filename.endswith("device_discipline.py")]
            caller = frames[-1] if frames else None  # the innermost frame outside torch: who asked
            ours = caller is not None and any(part in caller.filename for part in _OURS)
            site = f"{caller.filename.split('/')[-1]}:{caller.lineno} {caller.name}" if caller else "?"
            self.sites[f"{kind} @ {site}" + ("" if ours else " (not ours)")] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and all(getattr(t, HOST_COPY_MARK, False) for t in tensors):  # host memory (`to_host`)
            out = func(*args, **kwargs)
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    setattr(t, HOST_COPY_MARK, True)
            return out
        if packet is aten._local_scalar_dense:
            self._count("item")
        elif packet in _SHAPE_FROM_DATA:
            if _SHAPE_FROM_DATA[packet] is not None:
                self._count(_SHAPE_FROM_DATA[packet])
        elif packet in (aten.index, aten._unsafe_index) and len(args) > 1 and _is_bool_index(args[1]):
            self._count("bool_index")
        elif packet in (aten.index_put, aten.index_put_, aten._index_put_impl_) and _is_bool_index(args[1]):
            self._count("bool_index_put")
        elif packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self._count("repeat_interleave")
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda() -> Iterator[torch._subclasses.fake_tensor.FakeTensorMode]:
    """A `FakeTensorMode` whose tensors may live on a fake ``cuda`` device (no CUDA needed); build the
    inputs inside it: ``with fake_cuda(): x = torch.randn(4, 8, device="cuda")``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        yield mode




TRAINING_METHODS: dict[str, dict] = {
    "agg": dict(method="agg", alpha=0.5, window=50),
    "agg_unfused": dict(method="agg", alpha=0.5, window=50, fused_loss=False),
    "agg_rare_fraction": dict(method="agg", rare_fraction=0.05, window=50),
    "agg_alpha_tokens": dict(method="agg", alpha=0.5, alpha_tokens=64, window=50),
    "agg_no_g1": dict(method="agg", alpha=0.5, window=50, agg_g1=False),
    "agg_freeze": dict(method="agg", alpha=0.5, window=50, agg_freeze_rare=True),
    "agg_static": dict(method="agg", alpha=0.5, window=50, agg_static_after=1),
    "mle_fused": dict(fused_loss=True),
    "cosreg": dict(method="cosreg"),
    "hinge": dict(method="hinge"),
    "hinge_sampled": dict(method="hinge", hinge_sample=16),
    "spectrum": dict(method="spectrum"),
    "untie": dict(head="untie"),
    "lowrank": dict(head="lowrank", lowrank_rank=4),
    "agg_lowrank": dict(method="agg", alpha=0.5, window=50, head="lowrank", lowrank_rank=4),
    "simctg": dict(method="simctg"),
    "uniformity": dict(method="uniformity"),
    "uniformity_sampled": dict(method="uniformity", uniformity_sample=16),
    "uniformity_hidden": dict(method="uniformity", uniformity_on="hidden"),
    "agg_simctg": dict(method=("agg", "simctg"), alpha=0.5, window=50),
    "frequency_metric": dict(metrics=("frequency",), metrics_every=1000),
    "coupled_adam": dict(method="coupled_adam"),
    "mu_centering": dict(method="mu_centering"),
    "mu_loss": dict(method="mu_loss"),
}
"""Every training method and head (with its ablations and a metric that counts in every step), as
`AnisoConfig` keywords: window 50, no measurement in the first few steps."""


class StepWindow:
    """Counts `HostSyncs` over optimizer steps `steps` (1-based) of a trainer, between its step's
    begin and end events (forward, backward, optimizer step): ``open(step)`` / ``close()`` from the
    trainer's callbacks; ``counts`` by kind, ``sites`` by line of this package, ``per_step``."""

    def __init__(self, steps: range) -> None:
        self.steps = steps
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()
        self._mode: HostSyncs | None = None

    def open(self, step: int) -> None:
        if step in self.steps and self._mode is None:
            self._mode = HostSyncs(where=True)
            self._mode.__enter__()

    def close(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.counts.update(self._mode.counts)
            self.sites.update(self._mode.sites)
            self._mode = None

    @property
    def per_step(self) -> float:
        return sum(self.counts.values()) / len(self.steps)

    def ours(self) -> dict[str, float]:
        """The sites in this package, per step."""
        return {site: n / len(self.steps) for site, n in self.sites.items() if not site.endswith("(not ours)")}


def hf_window(window: StepWindow):
    """A `transformers.TrainerCallback` that counts `window`'s steps."""
    from transformers import TrainerCallback

    class Counting(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            window.open(state.global_step + 1)

        def on_step_end(self, args, state, control, **kwargs):
            window.close()

    return Counting()


def lightning_window(window: StepWindow):
    """A Lightning callback that counts `window`'s optimizer steps (accumulation 1: one batch a step)."""
    import lightning.pytorch as pl

    class Counting(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            window.open(trainer.global_step + 1)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            window.close()

    return Counting()


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op inside it makes (``largest``), of `dtype` only where
    given: a memory bound on the temporaries of the code run inside."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype, self.largest = dtype, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and (self.dtype is None or t.dtype == self.dtype):
                self.largest = max(self.largest, t.numel())
        return out


__all__ = ["TRAINING_METHODS", "HostSyncs", "LargestTensor", "StepWindow", "fake_cuda", "hf_window", "lightning_window"]
