"""The package's shape, checked from its source (docs/design.md "Layout"): no import circle
(function-level imports included), no function over 60 lines, no module over 600 lines, no
built-in method's name inside the generic core or the trainer adapters, and no model library or
model knowledge (aniso_plugins/models/) imported by the core."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from aniso_plugins.core import registry

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "aniso_plugins"
ADAPTERS = ROOT / "integrations"


def _modules() -> dict[str, Path]:
    out = {}
    for base, name in ((PACKAGE, "aniso_plugins"), (ADAPTERS, "aniso_plugins.integrations")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([name, *parts])] = path
    return out


MODULES = _modules()


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs (at module level or in a function), leaving out
    ``if TYPE_CHECKING:`` blocks."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", "")) == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            stack.append(child)
    return found


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package modules an import statement loads (a ``from package import submodule`` loads
    the submodule)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        assert not node.level, f"{module}: relative import (the package imports absolutely)"
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return {n for n in names if n in MODULES and n != module}


def _graph() -> dict[str, set[str]]:
    return {m: set().union(*[_targets(m, n) for n in _runtime_imports(ast.parse(p.read_text()))] or [set()]) for m, p in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (a list of modules, first == last), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_circle_through_a_function_level_import():
    tree = ast.parse("import os\ndef f():\n    from aniso_plugins.core import session\n")
    assert {t for n in _runtime_imports(tree) for t in _targets("aniso_plugins.core.config", n)} == {
        "aniso_plugins.core",
        "aniso_plugins.core.session",
    }
    guarded = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import aniso_plugins.core.session\n")
    assert not [t for n in _runtime_imports(guarded) for t in _targets("aniso_plugins.core.config", n)]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_in_the_package_or_the_adapters():
    graph = _graph()
    assert len(graph) > 60  # every module was read
    assert "aniso_plugins.core.plugins" in graph["aniso_plugins.core.session"]
    # `from aniso_plugins import X` in a submodule is an edge to the package, which imports the core
    assert _cycle(graph) is None


@pytest.mark.parametrize("path", sorted(MODULES.values()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_over_60_lines_and_no_module_over_600(path):
    source = path.read_text()
    assert len(source.splitlines()) <= 600
    long = [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == []


def _string_constants(tree: ast.Module) -> set[str]:
    """String literals that are not docstrings."""
    docstrings = {
        id(body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and (body := node.body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    }
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings}


METHOD_NAMES = {name for name, spec in registry.METHODS.items() if spec is not None}


@pytest.mark.parametrize(
    "module",
    sorted(m for m in MODULES if (m.startswith("aniso_plugins.core.") and m != "aniso_plugins.core.registry")
           or m.startswith("aniso_plugins.integrations.")),
)
def test_no_method_name_in_the_core_or_the_adapters(module):
    """The session and adapters ask the plugins what they do (capability hooks); only the
    registry names methods."""
    assert METHOD_NAMES >= {"agg", "simcse", "simctg"}
    assert _string_constants(ast.parse(MODULES[module].read_text())) & METHOD_NAMES == set()


def test_the_package_imports_its_public_names_on_first_use():
    """``import aniso_plugins`` (and so the ``aniso`` command's start) loads no torch; every name
    of ``__all__`` resolves."""
    import subprocess
    import sys

    probe = "import sys, aniso_plugins, aniso_plugins.offline.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT).stdout.strip() == "False"
    import aniso_plugins

    missing = [n for n in aniso_plugins.__all__ if getattr(aniso_plugins, n, None) is None]
    assert missing == [] and len(aniso_plugins.__all__) > 60
    with pytest.raises(AttributeError, match="no attribute 'nothere'"):
        aniso_plugins.nothere  # noqa: B018


MODEL_KNOWLEDGE = ("transformers", "peft", "aniso_plugins.models")
"""What the trainer-agnostic core must not load: a model library, or the folder of what it knows of one."""


def _loads(node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules an import statement names, a public name of the package face as its home module."""
    import aniso_plugins

    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    names = {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
    if node.module == "aniso_plugins":
        names |= {aniso_plugins._EXPORTS[a.name] for a in node.names if a.name in aniso_plugins._EXPORTS}
    return names


def _model_knowledge(tree: ast.Module) -> list[str]:
    """The import statements of `tree` that load `MODEL_KNOWLEDGE`, as "line N: statement"."""
    return [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in _runtime_imports(tree)
        if any(name == root or name.startswith(root + ".") for name in _loads(node) for root in MODEL_KNOWLEDGE)
    ]


def test_the_model_knowledge_check_sees_every_route():
    tree = ast.parse("import peft.tuners\ndef f():\n    from transformers import Trainer\nfrom aniso_plugins import find_handle\n"
                     "from aniso_plugins import models\nfrom aniso_plugins import ModelHandle\nimport transformers_like\n")
    assert sorted(line.split(":")[0] for line in _model_knowledge(tree)) == ["line 1", "line 3", "line 4", "line 5"]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m == "aniso_plugins.core" or m.startswith("aniso_plugins.core.")))
def test_the_core_imports_no_model_library_and_no_model_knowledge(module):
    """core/ is what every trainer needs: how a transformers model computes its loss, where its
    head is, how its targets align, PEFT's wrappers live in aniso_plugins/models/, which only the
    adapters use (function-level imports count; ``if TYPE_CHECKING:`` blocks do not)."""
    assert _model_knowledge(ast.parse(MODULES[module].read_text())) == []


def _private_imports(module: str) -> list[str]:
    """The names `module` imports from the package beyond its public face: anything but the
    package's ``__all__``, the ``__all__`` of a module of ``aniso_plugins.models`` (the model
    knowledge that is the adapters' to use) and the adapters' own modules."""
    import importlib

    import aniso_plugins

    out = []
    for node in _runtime_imports(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("aniso_plugins") and not a.name.startswith(ADAPTER_PACKAGE)]
            continue
        home = node.module or ""
        if not home.startswith("aniso_plugins") or home.startswith(ADAPTER_PACKAGE):
            continue
        if home == "aniso_plugins":
            public = set(aniso_plugins.__all__)
        elif home.startswith("aniso_plugins.models."):
            public = set(importlib.import_module(home).__all__)
        else:
            public = set()
        out += [f"{home}.{a.name}" for a in node.names if a.name not in public]
    return out


ADAPTER_PACKAGE = "aniso_plugins.integrations"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(ADAPTER_PACKAGE + ".")))
def test_the_adapters_import_only_public_names(module):
    """An adapter uses the package as any third-party code would (docs/design.md): through
    ``aniso_plugins``'s public names and the model knowledge of ``aniso_plugins.models``."""
    assert _private_imports(module) == []


def test_the_public_name_check_sees_a_private_import(tmp_path, monkeypatch):
    fake = tmp_path / "adapter.py"
    fake.write_text("from aniso_plugins.core.targets import target_rule\nfrom aniso_plugins import target_rule\n"
                    "def f():\n    from aniso_plugins.models.handle import _no_head\n")
    monkeypatch.setitem(MODULES, "aniso_plugins.integrations.fake", fake)
    assert _private_imports("aniso_plugins.integrations.fake") == [
        "aniso_plugins.core.targets.target_rule", "aniso_plugins.models.handle._no_head"]


CHOICE_FIELDS = frozenset(registry.TABLES)
"""The configuration fields that choose plugins (method, head, metrics)."""
METRIC_NAMES = frozenset(registry.METRICS) - {"train", "eval"}
"""Metric names an adapter must not spell: "eval" is also the kind of a measurement, which adapters name."""


def _choices_read(tree: ast.Module) -> list[str]:
    """Where a module compares or filters on the fields that choose plugins (``config.method !=
    ("none",)``, ``self.config.head != "keep"``, ``m in config.metrics``), and metric names it
    spells: a decision that belongs to the plugins (``aniso_refuse_layout``, capability hooks)."""
    found = []
    for node in ast.walk(tree):
        operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else (
            [node.iter] if isinstance(node, ast.comprehension) else [])
        for operand in operands:
            for sub in ast.walk(operand):
                if isinstance(sub, ast.Attribute) and sub.attr in CHOICE_FIELDS and ast.unparse(sub.value).endswith("config"):
                    found.append(f"line {sub.lineno}: {ast.unparse(sub)}")
    return found + sorted(f"metric name {name!r}" for name in _string_constants(tree) & METRIC_NAMES)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(ADAPTER_PACKAGE + ".")))
def test_the_adapters_decide_nothing_on_the_plugins_chosen(module):
    """An adapter says what its trainer's layout is (`ParallelLayout`); each plugin refuses what
    it cannot serve. No adapter compares the method, head or metrics chosen, nor names a metric."""
    assert _choices_read(ast.parse(MODULES[module].read_text())) == []


def test_the_choice_check_sees_each_form():
    source = (
        "def f(self, config):\n"
        "    if self.config.method != ('none',): pass\n"
        "    if config.head != 'keep': pass\n"
        "    split = [m for m in config.metrics if m in ('hidden', 'ethayarajh')]\n"
        "    return '+'.join(self.config.method)\n"  # a read that decides nothing is fine
    )
    found = _choices_read(ast.parse(source))
    assert found == ["line 2: self.config.method", "line 3: config.head", "line 4: config.metrics",
                     "metric name 'ethayarajh'", "metric name 'hidden'"]
