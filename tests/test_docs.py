"""The docs cannot go stale: every ``bash`` / ``python`` / ``toml`` block of README.md and docs/*.md says
how it is checked, in an HTML comment on the line before it, and is checked so:

- ``<!-- doc-test: run -->``: run as it is, from the repository root (python in a fresh interpreter,
  bash with this interpreter's folder first on ``PATH``), and it must exit 0;
- ``<!-- doc-test: ci -->``: the README's two set-up commands: the test command is ``.ci/run``'s, and
  the main job's training arguments load (``load_config``);
- ``<!-- doc-test: parse (why it is not run) -->``: a command that needs GPUs, a cluster or files a user
  brings: every titan_cp command line in it loads with ``load_config`` (keys, values, cross-section
  checks) and passes its model family's checks (``preflight.check_model``), and every config file it names exists; a TOML block loads as a config file;
- ``<!-- doc-test: excerpt PATH -->``: every line of the block but ``...`` / ``...,`` (lines left out) is a line of
  ``PATH``, in order, indentation aside (the file itself runs in its own test);
- ``<!-- doc-test: tested TEST -->``: run as it is by the test file ``TEST``, which names this page;
- ``<!-- doc-test: sketch -->``: an API outline with placeholders: it compiles, its imports resolve, and
  every call of an imported titan_cp function or class binds to that function's signature.

A block without a marker fails, naming its file and line.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from titan_cp.config import load_config
from titan_cp.preflight import check_model

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(
    r"(?:<!-- doc-test: (?P<kind>[a-z]+)(?P<arg>[^>]*?) -->\n)?```(?P<lang>bash|python|toml)\n(?P<body>.*?)```", re.S
)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    kind: str | None
    arg: str
    body: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("lang")) + 1
            out.append(Block(path, line, m["lang"], m["kind"], (m["arg"] or "").strip(), m["body"]))
    return out


BLOCKS = _blocks()


def _of(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind]


def test_every_block_says_how_it_is_checked():
    unmarked = [str(b) for b in BLOCKS if b.kind not in ("run", "ci", "parse", "excerpt", "tested", "sketch")]
    assert not unmarked, f"blocks without a <!-- doc-test: ... --> marker (or with an unknown one): {unmarked}"
    assert all(b.arg for b in _of("parse") + _of("excerpt") + _of("tested")), (
        "parse needs its reason, excerpt and tested a file"
    )


def _commands(body: str) -> list[list[str]]:
    """The command lines of a bash block: continuation lines joined, comments and ``#!`` dropped, optional
    arguments (``[--key value ...]``) taken as given."""
    text = re.sub(r"\[(--[^\]]*)\]", r"\1", re.sub(r"\\\n\s*", " ", body))
    lines = [line.split(" #", 1)[0].strip() for line in text.splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


def _titan_cp_argv(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(module, its arguments)`` of a ``-m titan_cp.<train|generate>`` command line, else ``None``."""
    for i, word in enumerate(argv[:-1]):
        if word == "-m" and argv[i + 1] in ("titan_cp.train", "titan_cp.generate"):
            return argv[i + 1], argv[i + 2 :]
    return None


def _loads(block: Block, argv: list[str]) -> None:
    config = argv[argv.index("--job.config_file") + 1] if "--job.config_file" in argv else None
    if config is not None:
        assert (ROOT / config).is_file(), f"{block}: names {config}, which is not in the repository"
        argv = [a if a != config else str(ROOT / config) for a in argv]
    check_model(load_config(argv, warn_adjustments=False))


@pytest.mark.parametrize("block", _of("parse"), ids=str)
def test_parse_blocks_load(block, tmp_path):
    if block.lang == "toml":
        config = tmp_path / "block.toml"
        config.write_text(block.body)
        load_config(["--job.config_file", str(config)], warn_adjustments=False)
        return
    found = [cmd for cmd in map(_titan_cp_argv, _commands(block.body)) if cmd]
    for _, argv in found:
        _loads(block, argv)
    if block.lang == "bash" and "titan_cp." in block.body:
        assert found, f"{block}: names titan_cp but no '-m titan_cp.train/generate' command was found"


def test_ci_blocks_are_the_ci_command_and_the_main_job():
    main_job, tests = (b.body.strip() for b in _of("ci"))
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert tests == ci, "the README's test command and .ci/run differ"
    runs = [cmd for cmd in (_titan_cp_argv(shlex.split(part)) for part in main_job.split("&&")) if cmd]
    assert [module for module, _ in runs] == ["titan_cp.train"], main_job
    _loads(_of("ci")[0], runs[0][1])


@pytest.mark.parametrize("block", _of("tested"), ids=str)
def test_tested_blocks_name_their_test(block):
    test = ROOT / block.arg
    assert test.is_file(), f"{block}: no test file {block.arg}"
    page = str(block.path.relative_to(ROOT))
    assert page in test.read_text(), f"{block}: {block.arg} does not name {page}, the page whose block it runs"


@pytest.mark.parametrize("block", _of("excerpt"), ids=str)
def test_excerpts_are_lines_of_their_file(block):
    lines = iter((ROOT / block.arg).read_text().splitlines())
    for want in (line.strip() for line in block.body.splitlines() if line.strip() not in ("", "...", "...,")):
        assert any(line.strip() == want for line in lines), f"{block}: {want!r} is not (in order) a line of {block.arg}"


def _imported(tree: ast.Module) -> dict[str, object]:
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


@pytest.mark.parametrize("block", _of("sketch"), ids=str)
def test_sketches_name_the_api_as_it_is(block):
    tree = ast.parse(block.body)
    names = _imported(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            target = names[node.func.id]
            if not getattr(target, "__module__", "").startswith("titan_cp"):
                continue
            args = [None] * len(node.args)
            kwargs = {k.arg: None for k in node.keywords if k.arg}
            inspect.signature(target).bind(*args, **kwargs)  # a renamed or removed argument fails here


@pytest.mark.parametrize("block", _of("run"), ids=str)
def test_run_blocks_exit_0(block, tmp_path):
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    # torchrun's --standalone: its rendezvous store binds a port of its own choosing, where a free port picked
    # here could be taken by the other test process's pools before torchrun binds it
    env["PET_STANDALONE"] = "1"
    if block.lang == "python":
        argv = [sys.executable, "-c", block.body]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", block.body]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{block} exited {done.returncode}:\n{done.stderr[-3000:]}"
