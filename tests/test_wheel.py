"""The wheel holds the library: the packages ``pyproject.toml`` installs are ``titan_cp`` and its
subpackages, without the measurement code (``benchmarks/``, once ``titan_cp/tools/``), and nothing
in them imports ``benchmarks`` (which an installed package could not find).

Read with setuptools' own ``find_packages`` and the ``[tool.setuptools.packages.find]`` table, as a
build reads them (a wheel build is too slow for the suite)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from setuptools import find_packages

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _installed() -> list[str]:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return find_packages(str(ROOT), include=find.get("include", ("*",)), exclude=find.get("exclude", ()))


def test_the_wheel_installs_the_library_only():
    packages = _installed()
    assert "titan_cp" in packages and "titan_cp.selfcheck" in packages  # python -m titan_cp.selfcheck
    shipped = [p for p in packages if p != "titan_cp" and not p.startswith("titan_cp.")]
    assert not shipped, f"the wheel would install {shipped}"
    assert "titan_cp.tools" not in packages and (ROOT / "benchmarks" / "__init__.py").exists()


def test_no_installed_module_imports_benchmarks():
    """``benchmarks`` is not installed: a module of the package that imports it breaks in a wheel."""
    found = []
    for path in (ROOT / "titan_cp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not found, found
