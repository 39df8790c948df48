"""The package's layers point down only (docs/architecture.md).

Every import of every module under ``titan_cp/`` is read with ``ast`` - at module level, inside
functions and under ``if TYPE_CHECKING:`` alike - and mapped to the part it lands in (a top-level
module or subpackage of ``titan_cp``). An arrow from one part to another must land on a lower layer;
so no arrow runs back up and no two parts import each other, even through others.

``python -m tests.test_layers`` prints today's arrows, layer by layer, and the ones that run up.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "titan_cp"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "ac_modes", "doc_local", "optim"),
    ("files", "lock", "run", "balance", "mesh"),
    ("layout",),
    ("attention", "loss"),
    ("config",),
    ("data", "parallel", "step", "profiling"),
    ("families",),
    ("checkpoint",),
    ("metrics",),
    ("integrations",),
    ("preflight",),
    ("plan", "train"),
    ("generate",),
    ("selfcheck", "testing", "__init__"),
]
"""The layers, lowest first (docs/architecture.md); ``__init__`` is the package's own front module."""

LAYER_OF = {part: i for i, layer in enumerate(LAYERS) for part in layer}


def module_name(path: Path) -> str:
    """``titan_cp/config/job.py`` -> ``titan_cp.config.job``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The part a ``titan_cp`` module belongs to: its top-level module or subpackage."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "__init__"


def imported_modules(source: str, module: str, package: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``titan_cp`` module the code ``source`` of ``module`` (``package``:
    an ``__init__.py``) imports, at any depth (functions and ``if TYPE_CHECKING:`` blocks included);
    ``from titan_cp import x`` counts as importing ``titan_cp.x``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if package else module.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            if base == "titan_cp" or not node.module:
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, base))
    return [(line, name) for line, name in found if name.startswith("titan_cp.")]


def arrows() -> dict[tuple[str, str], list[str]]:
    """``(from part, to part)`` -> ``"module:line -> module"`` of every import between two parts."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        for line, target in imported_modules(path.read_text(), source, path.name == "__init__.py"):
            a, b = part_of(source), part_of(target)
            if a != b:
                found[a, b].append(f"{source}:{line} -> {target}")
    return dict(found)


def upward(found: dict[tuple[str, str], list[str]]) -> dict[tuple[str, str], list[str]]:
    """The arrows that do not land on a lower layer (same layer included)."""
    return {(a, b): v for (a, b), v in found.items() if LAYER_OF[b] >= LAYER_OF[a]}


def cycles(found: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The strongly connected sets of parts with more than one part (import circles), Tarjan's."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in found:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    result = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return result


def test_every_part_has_a_layer():
    parts = {part_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert parts - set(LAYER_OF) == set(), "give the new part a layer here and in docs/architecture.md"
    assert set(LAYER_OF) - parts == set(), "a part in LAYERS no longer exists"


def test_no_arrow_runs_up():
    bad = upward(arrows())
    assert bad == {}, "\n".join(f"{a} -> {b}: {', '.join(v)}" for (a, b), v in sorted(bad.items()))


def test_no_import_circles_between_parts():
    assert cycles(arrows()) == []


def test_config_and_families_stay_low():
    """The issue's named arrows: loading a config imports no model stack, the family spec no user of it."""
    found = arrows()
    assert not [b for a, b in found if a == "config" and b in ("parallel", "families")]
    assert not [b for a, b in found if a == "families" and b in ("generate", "integrations", "train")]


def test_the_scan_sees_every_kind_of_import():
    """Function-level, ``TYPE_CHECKING``, relative and ``from titan_cp import x`` imports all count."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from titan_cp.families import ModelFamily\n"
        "def f():\n    from ..generate import engine\n"
        "from titan_cp import train\n"
        "from . import values\n"
    )
    names = sorted(name for _, name in imported_modules(source, "titan_cp.config.probe"))
    assert names == ["titan_cp.config.values", "titan_cp.families", "titan_cp.generate", "titan_cp.train"]


def main() -> None:
    found = arrows()
    for layer in reversed(LAYERS):
        for a in layer:
            outgoing = sorted((LAYER_OF[b], b, len(v)) for (x, b), v in found.items() if x == a)
            print(f"{LAYER_OF[a]:2d} {a:13s} -> " + ", ".join(f"{b} ({n})" for _, b, n in outgoing))
    bad = upward(found)
    print(f"\n{len(found)} arrows between parts; {len(bad)} run up or sideways; circles: {cycles(found)}")
    for (a, b), v in sorted(bad.items()):
        print(f"  {a} -> {b}: " + "; ".join(v))


if __name__ == "__main__":
    main()
