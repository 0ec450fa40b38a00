"""The built wheel holds the whole tree: every module of ``aniso_plugins/`` and of
``integrations/`` (installed as ``aniso_plugins.integrations``), found by setuptools rather than
listed, plus py.typed, the license and the ``aniso`` command. The wheel is built from a copy of
the project with one new package folder added to each tree, so a folder nobody listed anywhere
must arrive too. (`.ci/run` also installs the wheel in a fresh environment and runs it:
tests/installed_smoke.py.)"""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from aniso_plugins.core.version import __version__

ROOT = Path(__file__).resolve().parents[1]
TREES = {"aniso_plugins": "aniso_plugins", "integrations": "aniso_plugins/integrations"}
"""Source folder -> where its files sit in the wheel."""
NEW = ("aniso_plugins/methods/brand_new", "integrations/brand_new")


def _tree_modules(root: Path) -> set[str]:
    """Every .py file of the two trees, as its path inside the wheel."""
    out = set()
    for src, dst in TREES.items():
        for path in (root / src).rglob("*.py"):
            if "__pycache__" not in path.parts:
                out.add(f"{dst}/{path.relative_to(root / src).as_posix()}")
    return out


def _package_folders_without_init(root: Path) -> list[str]:
    """Folders holding .py files but no __init__.py: setuptools' discovery would skip them."""
    return sorted(
        str(d.relative_to(root))
        for src in TREES
        for d in [root / src, *(p for p in (root / src).rglob("*") if p.is_dir())]
        if "__pycache__" not in d.parts and any(d.glob("*.py")) and not (d / "__init__.py").exists()
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, zipfile.ZipFile]:
    """A copy of the project with the two `NEW` folders, and the wheel built from it."""
    copy = tmp_path_factory.mktemp("project")
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, copy / name)
    for src in TREES:
        shutil.copytree(ROOT / src, copy / src, ignore=shutil.ignore_patterns("__pycache__"))
    for folder in NEW:
        (copy / folder).mkdir()
        (copy / folder / "__init__.py").write_text('"""A folder no configuration file names."""\n')
        (copy / folder / "module.py").write_text("VALUE = 1\n")
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(out), str(copy)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return copy, zipfile.ZipFile(wheel)


def test_every_module_of_the_tree_is_in_the_wheel_new_folders_included(built):
    copy, wheel = built
    names = set(wheel.namelist())
    modules = _tree_modules(copy)
    assert {f"{TREES['aniso_plugins']}/methods/brand_new/module.py", "aniso_plugins/integrations/brand_new/module.py"} <= modules
    assert sorted(modules - names) == []
    assert sorted(n for n in names if n.endswith(".py")) == sorted(modules)  # nothing else (no tests, no setup.py)


def test_every_package_folder_has_an_init_so_discovery_finds_it():
    assert _package_folders_without_init(ROOT) == []


def test_the_wheel_has_py_typed_the_license_the_command_and_the_version(built):
    _, wheel = built
    names = set(wheel.namelist())
    info = f"aniso_plugins-{__version__}.dist-info"
    assert "aniso_plugins/py.typed" in names
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert wheel.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    meta = email.message_from_bytes(wheel.read(f"{info}/METADATA"))
    assert (meta["Version"], meta["License-Expression"]) == (__version__, "Apache-2.0")
    entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    assert "aniso = aniso_plugins.offline.cli:main" in entry_points
    assert "[axolotl.plugins]\naniso = aniso_plugins.integrations.axolotl:AnisoPlugin" in entry_points
    assert "aniso_plugins/integrations/axolotl.py" in names
    assert meta["Requires-Python"] == ">=3.11"


def test_aniso_version_prints_the_package_version():
    proc = subprocess.run([sys.executable, "-m", "aniso_plugins.offline.cli", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"aniso {__version__}")


def test_the_lower_bounds_are_the_tested_floor():
    """pyproject.toml's lower bound of every dependency that .ci/floor installs at its floor is that
    floor (.ci/floor.txt), in every extra that names it but torchtitan's (its own torch pin); the
    others are the main suite's versions."""
    import tomllib

    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parent.parent
    floor = {}
    for line in (root / ".ci" / "floor.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            floor[name.strip().lower()] = version.strip()
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    requirements += [Requirement(r) for name, extra in project["optional-dependencies"].items() for r in extra
                     if not r.startswith("aniso-plugins") and name != "torchtitan"]  # torchtitan 0.3.0 pins torch 2.14
    checked = set()
    for req in requirements:
        if req.name.lower() in floor:
            lower = [s.version for s in req.specifier if s.operator == ">="]
            assert lower == [floor[req.name.lower()]], f"{req}: the floor tested in .ci/floor is {floor[req.name.lower()]}"
            checked.add(req.name.lower())
    assert checked == set(floor)  # every floor pin is a dependency of the package
    trl = [s.version for r in requirements if r.name == "trl" for s in r.specifier if s.operator == ">="]
    from aniso_plugins.integrations.hf.trl import TRL_FLOOR  # the adapter's refusal names the same floor

    assert trl == [".".join(map(str, TRL_FLOOR)) + ".0"]
    assert project["requires-python"] == ">=3.11"
