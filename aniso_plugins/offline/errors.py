"""The report's one error type, shared by its modules."""

from __future__ import annotations

from aniso_plugins.core.errors import AnisoError


class ReportError(AnisoError):
    """A bad input (missing file, no weights, corrupt file, no embeddings, text without a
    tokenizer): the CLI prints it as one line and exits non-zero."""


def one_line(e: BaseException) -> str:
    """``Type: first line of the message`` of an exception, for a one-line `ReportError`."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def install_hint(extra: str) -> str:
    """How to add the package's extra `extra` today: from a clone (it is not on PyPI)."""
    return f'in a clone of aniso-plugins: pip install -e ".[{extra}]"'


__all__ = ["ReportError", "install_hint", "one_line"]
