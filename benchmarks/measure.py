"""Device-aware timing, peak memory and memory limits for the benchmark scripts
(docs/performance.md §6.2, §7).

- ``--device cpu|cuda`` and ``--dtype fp32|bf16`` (`add_device_args`): bf16 means float32
  leaves and the step under ``torch.autocast(device, torch.bfloat16)`` (`precision`);
- time (`elapsed`): wall seconds of one call; on CUDA between two CUDA events recorded around
  the call, after a synchronize before it and the end event's synchronize after it;
- peak memory (`PeakMemory`): on CUDA ``torch.cuda.max_memory_allocated()`` after
  ``reset_peak_memory_stats()``, minus the memory allocated before; on the CPU the process's
  peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs``; without that
  reset ``ru_maxrss``, valid only while nothing earlier in the process was larger) minus the
  resident set size before; inputs that exist before the measured call are excluded;
- memory limit (`limit_memory`): ``RLIMIT_AS`` set to the current address space plus the
  limit, so that an allocation beyond it fails inside the process (a ``RuntimeError`` of
  torch's CPU allocator or a ``MemoryError``) instead of the kernel killing the machine's
  processes; `is_oom` recognises those errors and CUDA's ``OutOfMemoryError``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import time
from collections.abc import Callable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory")


def add_device_args(parser: argparse.ArgumentParser, dtypes: str = "fp32", several: bool = False) -> None:
    """The ``--device`` and ``--dtype`` flags every benchmark takes (``several``: a comma-separated
    list of dtypes, checked by `dtype_list`)."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    help_ = "bf16: float32 leaves, the step under bf16 autocast"
    if several:
        parser.add_argument("--dtype", default=dtypes, help=f"comma-separated fp32, bf16; {help_}")
    else:
        parser.add_argument("--dtype", choices=tuple(DTYPES), default=dtypes, help=help_)


def dtype_list(text: str) -> list[str]:
    """The dtypes of a comma-separated ``--dtype``; raises SystemExit on an unknown one."""
    names = text.split(",")
    bad = [n for n in names if n not in DTYPES]
    if bad:
        raise SystemExit(f"--dtype {text!r}: unknown {bad}; expected a comma-separated list of {tuple(DTYPES)}")
    return names


def device_of(args: argparse.Namespace) -> torch.device:
    """The benchmark's device; raises SystemExit when CUDA is asked for and absent."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False on this machine")
    return torch.device(args.device)


def precision(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """The context a measured step runs in: nothing for fp32, bf16 autocast for bf16."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call of `fn` (CUDA: between events, synchronized)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


class PeakMemory:
    """``with PeakMemory(device) as peak: ...``; then ``peak.bytes`` is the peak memory during the
    block above what was held when it began (see the module docstring for the method)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes = 0

    def __enter__(self) -> PeakMemory:  # noqa: PYI034 - typing.Self needs Python 3.11
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            self._hwm = _reset_cpu_peak()
            self._before = rss_bytes()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self._hwm:
            peak = _status_kib("VmHWM") * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.bytes = max(peak - self._before, 0)


def limit_memory(gib: float) -> None:
    """Let this process map at most `gib` GiB more address space than it has now (RLIMIT_AS)."""
    limit = _status_kib("VmSize") * 1024 + int(gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` is an allocation failure (CPU allocator under RLIMIT_AS, or CUDA)."""
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in OOM_MESSAGES)


__all__ = [
    "DTYPES",
    "PeakMemory",
    "add_device_args",
    "device_of",
    "dtype_list",
    "elapsed",
    "is_oom",
    "limit_memory",
    "precision",
    "rss_bytes",
    "synchronize",
]
