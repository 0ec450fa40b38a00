"""docs/design.md's tables of the hooks (§2) and of the session's calls (§3) name every parameter
as the code has it: each row's ``name(a, b=, ...)`` against ``inspect.signature``, and every hook
and public session method has a row. The parser is tried on a made-up row first."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from aniso_plugins import TrainingSession
from aniso_plugins.core import hookspecs

DESIGN = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
CALL = re.compile(r"`(?:with )?([A-Za-z_]\w*)\(([^`()]*)\)`")


def documented_calls(section: str) -> dict[str, list[str]]:
    """name -> parameter names of every backticked call in the first column of the table rows."""
    calls: dict[str, list[str]] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first_cell = line.split(" | ")[0]
        for name, params in CALL.findall(first_cell):
            calls[name] = [p.split("=")[0].strip() for p in params.split(",") if p.strip()]
    return calls


def _section(number: int) -> str:
    return DESIGN.split(f"## {number}. ", 1)[1].split("\n## ", 1)[0]


def _parameters(function) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


def test_the_parser_reads_a_row():
    row = "| `setup(handle, layout, owns_loss=, why_not=)`; `with evaluating(targets, head_calls=1)` | `not(this)` |\n"
    assert documented_calls(row) == {"setup": ["handle", "layout", "owns_loss", "why_not"],
                                     "evaluating": ["targets", "head_calls"]}


def test_every_hook_has_its_row_with_its_parameters():
    documented = documented_calls(_section(2))
    hooks = {name: _parameters(fn) for name, fn in vars(hookspecs).items() if name.startswith("aniso_") and callable(fn)}
    assert len(hooks) > 15
    rows = {name: params for name, params in documented.items() if name.startswith("aniso_")}
    assert rows == hooks


def test_every_session_call_has_its_row_with_its_parameters():
    documented = documented_calls(_section(3))
    assert documented.pop("TrainingSession") == _parameters(TrainingSession.__init__)
    documented = {name: params for name, params in documented.items() if hasattr(TrainingSession, name)}
    public = {name for name, member in vars(TrainingSession).items()
              if not name.startswith("_") and inspect.isfunction(getattr(member, "__func__", member))}
    named_only = {"state_dict", "load_state_dict", "save", "load"}  # one row names the four, without parameters
    assert public - named_only == set(documented)
    for name, params in documented.items():
        assert params == _parameters(getattr(TrainingSession, name)), name
