"""docs/design.md §1 is the one architecture tree: it lists every module of the package, the
adapters, the examples and the benchmarks, each under its folder, and nothing that does not
exist. The parser is checked on a small tree first, so a broken parser cannot pass silently."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
TOP_LEVEL = ("aniso_plugins", "integrations", "examples", "benchmarks")
LISTED = (".py", ".sh")


def tree_block(markdown: str) -> str:
    """The first fenced block after the heading ``## 1. The tree``."""
    section = markdown.split("## 1. The tree", 1)[1]
    match = re.search(r"^```\n(.*?)^```", section, flags=re.S | re.M)
    assert match, "no fenced tree block under '## 1. The tree'"
    return match.group(1)


def tree_paths(block: str) -> tuple[set[str], set[str]]:
    """(files, folders) the tree names, as paths from the project root: two spaces of indent a
    level, folders end in '/', the first word of a line is its name."""
    files, folders, stack = set(), set(), []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 2 == 0, f"odd indent: {line!r}"
        depth, name = indent // 2, line.split()[0]
        assert depth <= len(stack), f"{line!r} is indented below no folder"
        del stack[depth:]
        path = "/".join([*stack, name.rstrip("/")])
        if name.endswith("/"):
            folders.add(path)
            stack.append(name.rstrip("/"))
        else:
            files.add(path)
    return files, folders


def source_paths(root: Path) -> tuple[set[str], set[str]]:
    """(files, package folders) of the four top-level trees, leaving out __init__.py files."""
    files, folders = set(), set()
    for top in TOP_LEVEL:
        for path in (root / top).rglob("*"):
            rel = path.relative_to(root)
            if "__pycache__" in rel.parts:
                continue
            if path.is_dir() and any(path.glob("*.py")):
                folders.add(rel.as_posix())
            elif path.suffix in LISTED and path.name != "__init__.py":
                files.add(rel.as_posix())
        folders.add(top)
    return files, folders


def test_the_parser_reads_nesting_and_the_comparison_sees_a_missing_line():
    block = "pkg/   the package\n  core/   c\n    a.py   x\n    b.py, c.py   y\n  d.py   z\nother/\n  e.sh  w\n"
    files, folders = tree_paths(block)
    assert files == {"pkg/core/a.py", "pkg/core/b.py,", "pkg/d.py", "other/e.sh"}
    assert folders == {"pkg", "pkg/core", "other"}


def test_every_module_is_in_the_design_tree_and_every_line_exists():
    listed_files, listed_folders = tree_paths(tree_block(DESIGN.read_text(encoding="utf-8")))
    files, folders = source_paths(ROOT)
    assert len(files) > 100  # the source was read
    assert sorted(files - listed_files) == [], "modules missing from docs/design.md §1"
    assert sorted(listed_files - files) == [], "lines of docs/design.md §1 naming no file"
    assert sorted(folders ^ listed_folders) == [], "folders of docs/design.md §1 differ from the source"


def test_the_comparison_fails_for_a_module_added_without_its_line(tmp_path):
    for top in TOP_LEVEL:
        (tmp_path / top).mkdir()
        (tmp_path / top / "one.py").write_text("")
    (tmp_path / "aniso_plugins" / "new").mkdir()
    (tmp_path / "aniso_plugins" / "new" / "module.py").write_text("")
    listed, _ = tree_paths("aniso_plugins/\n  one.py x\nintegrations/\n  one.py\nexamples/\n  one.py\nbenchmarks/\n  one.py\n")
    files, folders = source_paths(tmp_path)
    assert files - listed == {"aniso_plugins/new/module.py"} and "aniso_plugins/new" in folders
