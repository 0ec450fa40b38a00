"""What a GPU charges that a CPU never shows, made checkable on the CPU (docs/performance.md, "What
the GPU pays").

- `HostSyncs`: a `TorchDispatchMode` that counts, by kind, the aten ops that read a device value back
  to the host on CUDA (each one drains the launch queue and idles the GPU): ``.item()`` /
  ``int(t)`` / ``bool(t)`` (``aten._local_scalar_dense``), ops whose output shape depends on the
  data (``nonzero``, ``unique``, ``masked_select``, boolean-mask indexing, ``repeat_interleave``
  without ``output_size``), and ``bincount`` (CUDA reads the ids' range back, also with
  ``minlength``). Run the same window of training steps with and without a method and subtract.
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


class HostSyncs(TorchDispatchMode):
    """Counts the ops of the code run inside it that read a value back to the host on CUDA, by
    kind (``counts``; ``total``; ``where``: the Python frame of each, for the message of a test)."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()
        self._where = where

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _count(self, kind: str) -> None:
        self.counts[kind] += 1
        if self._where:
            import traceback

            frames = [f for f in traceback.extract_stack()[:-3] if "aniso_plugins" in f.filename or "integrations" in f.filename]
            site = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
            self.sites[f"{kind} @ {site}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
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


__all__ = ["HostSyncs", "fake_cuda"]
