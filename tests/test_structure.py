"""The package's shape, read from its source: no import circle, registries that are the one source
of their names, the default balance spelled once, no function over 80 lines, and a file map
(docs/code_layout.md) that lists every module and only modules that exist.

Each test parses ``titan_cp``'s modules (``ast``; nothing is imported) and prints what breaks its rule.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import titan_cp
from titan_cp.attention.strategy import strategy_names
from titan_cp.families import family_names
from titan_cp.integrations import hf_family  # noqa: F401 - registers model.name = 'hf'

ROOT = Path(titan_cp.__file__).parent
MAX_FUNCTION_LINES = 80

# Registries own their names: comparing against them there is the point.
REGISTRIES = {"families/base.py", "families/llama3/family.py", "integrations/hf_family.py", "attention/strategy.py"}
# The same words meaning something else, compared where they mean that: (module, word, what it is there).
OTHER_MEANINGS = {
    ("data/datasets.py", "hf"): "training.dataset = 'hf', a dataset saved by the datasets library",
    ("preflight.py", "hf"): "training.dataset = 'hf': its path must be a save_to_disk folder",
    ("families/llama3/hf_checkpoint.py", "llama3"): "config.json's rope_scaling.rope_type = 'llama3'",
    ("selfcheck/__init__.py", "ring"): "the name of a section of the GPU self-check's report",
}


@cache
def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _owner(name: str) -> str | None:
    """The module ``name`` is, or the nearest package or module that defines it (``pkg.mod.attr`` -> ``pkg.mod``)."""
    modules = _modules()
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, path: Path, package: bool) -> set[str]:
    """The titan_cp modules ``module`` imports anywhere in its source (module level, in functions, under
    ``TYPE_CHECKING``): ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``."""
    here = module if package else module.rpartition(".")[0]
    edges = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            edges |= {_owner(a.name) for a in node.names if a.name.split(".")[0] == "titan_cp"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.split(".")[0] != "titan_cp":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                edges.add(full if full in _modules() else _owner(base))
    edges.discard(None)
    edges.discard(module)
    return edges


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first repeated at the end), or ``None``."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_among_the_packages_modules():
    graph = {m: _imported(m, path, package) for m, (path, package) in _modules().items()}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the finder finds one
    assert "titan_cp.attention.strategy" in graph["titan_cp.attention.ring"]  # the walker sees module-level imports
    assert "titan_cp.integrations.hf_folder" in graph["titan_cp.integrations.hf_family"]  # ... and lazy ones
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _words(node: ast.AST) -> set[str]:
    """The string constants of ``node``: itself, or the items of a tuple / list / set display."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}


def test_no_family_or_strategy_name_is_compared_outside_its_registry():
    names = set(family_names()) | set(strategy_names())
    found = []
    for path, _ in _modules().values():
        rel = path.relative_to(ROOT).as_posix()
        if rel in REGISTRIES:
            continue
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Compare):
                continue
            for word in set().union(*(_words(n) for n in [node.left, *node.comparators])) & names:
                if (rel, word) not in OTHER_MEANINGS:
                    found.append(f"{rel}:{node.lineno} compares {word!r}: ask the registry's object instead")
    assert not found, "\n".join(found)


def test_the_defaults_are_spelled_once():
    """Signatures and fields default to ``DEFAULT_BALANCE`` / ``DEFAULT_STRATEGY`` / ``DEFAULT_FAMILY``,
    never to the names themselves; each default is assigned once."""
    spelled = {"doc_local": "DEFAULT_BALANCE", "ring": "DEFAULT_STRATEGY", "llama3": "DEFAULT_FAMILY"}
    found, assigned = [], []
    for path, _ in _modules().values():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(_tree(path)):
            defaults = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
            elif isinstance(node, ast.ClassDef):
                defaults = [s.value for s in node.body if isinstance(s, ast.AnnAssign) and s.value is not None]
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) in spelled.values() for t in node.targets):
                assigned.append((rel, node.targets[0].id))
            found += [f"{rel}:{d.lineno} defaults to {d.value!r}" for d in defaults if _words(d) & set(spelled)]
    assert not found, "spell the default as its constant:\n" + "\n".join(found)
    assert sorted(assigned) == sorted(
        [
            ("layout.py", "DEFAULT_BALANCE"),
            ("attention/strategy.py", "DEFAULT_STRATEGY"),
            ("config/sections.py", "DEFAULT_FAMILY"),
        ]
    ), assigned


def test_no_function_is_longer_than_80_lines():
    long = []
    for path, _ in _modules().values():
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)


# ---------------------------------------------------------------------------- docs/code_layout.md
CODE_LAYOUT = ROOT.parent / "docs" / "code_layout.md"
COMPLETE = ("titan_cp/", "benchmarks/")
"""The folders the map lists in full: every module in them has its line."""


def layout_entries(text: str) -> list[str]:
    """The paths of the map's one fenced block, one entry a line: ``name  description``, indented two
    spaces a level under the folder (``name/``) that holds it."""
    block = text.split("```")[1]
    folders: list[tuple[int, str]] = []  # (indent, path) of the folders enclosing the line
    entries = []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = (folders[-1][1] if folders else "") + line.split()[0]
        entries.append(path)
        if path.endswith("/"):
            folders.append((indent, path))
    return entries


def tree_entries(folder: str) -> set[str]:
    """Every module and package folder under ``folder`` (a folder's ``__init__``/``__main__`` is its line)."""
    base = ROOT.parent / folder
    found = {folder}
    for path in base.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT.parent).as_posix()
        found.add(rel.rpartition("/")[0] + "/" if path.stem in ("__init__", "__main__") else rel)
    return found


def test_the_code_layout_lists_every_module_and_only_what_exists():
    assert layout_entries("```\na/\n  b.py  x\n  c/  y\n    d.py  z\ne.py  w\n```") == [
        "a/",
        "a/b.py",
        "a/c/",
        "a/c/d.py",
        "e.py",
    ]
    listed = layout_entries(CODE_LAYOUT.read_text())
    twice = sorted({p for p in listed if listed.count(p) > 1})
    missing = sorted(p for p in listed if not (ROOT.parent / p).exists())
    unlisted = sorted(set().union(*(tree_entries(f) for f in COMPLETE)) - set(listed))
    assert not (twice or missing or unlisted), (
        f"docs/code_layout.md: listed twice {twice}; listed but not in the tree {missing}; "
        f"modules without a line {unlisted}"
    )
