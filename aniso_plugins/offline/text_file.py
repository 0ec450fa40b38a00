"""Reading a text file for the report: UTF-8 only, binary files refused with the offending offset."""

from __future__ import annotations

import os
from pathlib import Path

from aniso_plugins.offline.errors import ReportError


def read_text(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of `path`; `ReportError` naming `what` for an unreadable, binary (a NUL
    byte) or non-UTF-8 file, with the byte offset."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ReportError(f"cannot read the {what} {path}: {e.strerror or e}") from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise ReportError(f"the {what} {path} is binary (a NUL byte at offset {nul}); give a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReportError(f"the {what} {path} is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                          "convert it, e.g. iconv -t UTF-8") from None


__all__ = ["read_text"]
