"""Moving values between the device and the host without stalling a training step.

A read of a device tensor on the host (``.item()``, ``.cpu()``, ``.numpy()``) waits for every kernel
queued before it and leaves the GPU idle while the host catches up. `HostCopy` starts the copy on
the device's stream into pinned host memory and returns at once; `HostCopy.result` waits for that
copy alone (a CUDA event), normally long finished when it is read a step later. `to_device` is the
other direction: a host array into pinned memory, copied asynchronously. On a CPU device both are
plain copies; under PyTorch's `FakeTensorMode` (the fake ``cuda`` device of the tests, shapes only)
they stand in zeros for the values.
"""

from __future__ import annotations

import numpy as np
import torch


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.float32: np.float32,
          torch.float64: np.float64}


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a `FakeTensorMode` tensor (shapes, dtypes and devices only)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(tensor)


def _fake_mode_active() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


class HostCopy:
    """`tensor`'s values on the host, copied without waiting for the device: ``result()`` is a
    NumPy array (waiting only for this copy's event on CUDA)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        self._event = None
        self._array: np.ndarray | None = None
        if is_fake(tensor):  # FakeTensorMode (shapes only): zeros stand for the values it does not have
            self._array = np.zeros(tuple(tensor.shape), dtype=_NUMPY[tensor.dtype])
        elif tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor.to("cpu", copy=True)

    def result(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if self._array is None:
            self._array, self._host = self._host.numpy(), None
        return self._array

    @property
    def nbytes(self) -> int:
        return self._array.nbytes if self._array is not None else self._host.nbytes


def to_device(values: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host values (an array, or a CPU tensor) as a tensor on `device`: from pinned memory without
    a blocking copy on CUDA (the caching host allocator keeps the pinned block until the copy is
    done); under `FakeTensorMode` a fake tensor of their shape."""
    device = torch.device(device)
    if not isinstance(values, torch.Tensor):
        if _fake_mode_active():
            return torch.zeros(values.shape, dtype=torch.from_numpy(np.zeros(0, values.dtype)).dtype, device=device)
        values = torch.from_numpy(np.ascontiguousarray(values))
    if values.device == device:
        return values
    if device.type == "cuda" and values.device.type == "cpu" and not is_fake(values):
        values = values.pin_memory()
    return values.to(device, non_blocking=True)


__all__ = ["HostCopy", "is_fake", "to_device"]
