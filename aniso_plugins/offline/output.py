"""Where the report goes: the output folder checked before any work, and written atomically
(a temporary folder beside it, renamed at the end), so an interrupted run leaves nothing that
looks finished and a re-used folder keeps no file of an earlier run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from aniso_plugins.offline.errors import ReportError

REPORT_FILES = ("report.json", "report.md")
"""A folder holding one of these, and only them, `UNDER_TRAINED_CSV` and PNGs, is a report
folder that a new report may replace."""
UNDER_TRAINED_CSV = "under_trained.csv"
"""The report's file of every suspected under-trained token (`aniso_plugins.offline.under_trained`)."""


def _is_report_folder(path: Path) -> bool:
    return all(p.name in (*REPORT_FILES, UNDER_TRAINED_CSV) or p.suffix == ".png" for p in path.iterdir()) and any(
        (path / f).exists() for f in REPORT_FILES
    )


def check_output_dir(path: str | os.PathLike) -> Path:
    """`path` as the output folder, or `ReportError` (before any work) if it is a file, holds
    files that are not an earlier report, or its parent cannot be written."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out}: exists and is not a folder; choose another path")
    if out.is_dir() and any(out.iterdir()) and not _is_report_folder(out):
        raise ReportError(
            f"--out {out}: the folder holds files that are not an aniso report; choose a new or empty folder"
        )
    parent = out.resolve().parent
    existing = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ReportError(f"--out {out}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ReportError(f"--out {out}: cannot write into {existing} (permission denied)")
    return out


_WATCHERS: list[list[Path]] = []
"""The lists of `watch_commits` blocks now running."""


@contextlib.contextmanager
def watch_commits() -> Iterator[list[Path]]:
    """Yield a list that receives every folder `atomic_directory` renames into place while the
    block runs: once it is there, that folder holds the new output in full (the CLI's exit
    code after a Ctrl-C)."""
    committed: list[Path] = []
    _WATCHERS.append(committed)
    try:
        yield committed
    finally:
        _WATCHERS.remove(committed)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """A Ctrl-C (SIGINT) that lands in the block is delivered at its end (main thread only:
    elsewhere Python runs no signal handler anyway; nor where a handler outside Python is set)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def _commit(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out` (an earlier `out` moved aside, then removed), a
    Ctrl-C held back until the folders are consistent; tell the `watch_commits` lists."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    with _sigint_deferred():
        try:
            if out.exists():
                os.replace(out, old)
            os.replace(tmp, out)
        finally:
            if tmp.exists() and old.exists() and not out.exists():  # not renamed: the earlier one back
                os.replace(old, out)
            if not tmp.exists():
                for watcher in _WATCHERS:
                    watcher.append(out)
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path`; when the block ends without an error it
    becomes `path` (an earlier report there is replaced as a whole; `watch_commits` sees it),
    otherwise it is removed."""
    out = check_output_dir(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _commit(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # left only when the rename failed


__all__ = ["REPORT_FILES", "UNDER_TRAINED_CSV", "atomic_directory", "check_output_dir", "watch_commits"]
