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

from collections.abc import Mapping

import numpy as np
import torch


HOST_COPY_MARK = "_aniso_host_copy"
"""Attribute set on the host tensors `to_host` returns and `HostCopy` holds (tests/device_discipline.py's
`HostSyncs` does not count reads of them, nor of what is computed from them alone: host memory)."""

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
        if self._array is None:
            setattr(self._host, HOST_COPY_MARK, True)  # host memory: reading it waits for nothing but `_event`

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


__all__ = ["HOST_COPY_MARK", "HostCopy", "is_fake", "read_values", "to_device", "to_host"]


def read_values(tree):
    """`tree` (nested dicts of 0-d tensors and Python numbers) with every tensor read back as a
    float in one transfer: the tensors stacked in float64 on the device of the first and copied to
    the host once (one read where there would be one per value)."""
    leaves: list[torch.Tensor] = []

    def collect(node):
        if isinstance(node, dict):
            for value in node.values():
                collect(value)
        elif isinstance(node, torch.Tensor):
            leaves.append(node)

    collect(tree)
    values = iter(torch.stack([t.detach().to(leaves[0].device, torch.float64).reshape(()) for t in leaves]).tolist()
                  if leaves else [])

    def rebuild(node):
        if isinstance(node, dict):
            return {key: rebuild(value) for key, value in node.items()}
        return next(values) if isinstance(node, torch.Tensor) else node

    return rebuild(tree)



def to_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` copied to host memory in one transfer (one wait for the device instead of one per
    value read from them): their bytes in one buffer (widest elements first, so that every
    part stays aligned), copied at once, each returned as a host tensor of its dtype and shape.
    A measurement finishes its metrics from these with plain tensor code."""
    items = sorted(((k, t.detach()) for k, t in tensors.items()), key=lambda kv: -kv[1].element_size())
    if not items:
        return {}
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for _, t in items]
    host = torch.cat(parts).cpu()
    out, start = {}, 0
    for (name, t), part in zip(items, parts):
        value = host[start : start + part.numel()].view(t.dtype).reshape(t.shape)
        setattr(value, HOST_COPY_MARK, True)
        out[name] = value
        start += part.numel()
    return out
