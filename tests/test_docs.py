"""The docs cannot go stale: every ``bash`` / ``python`` / ``toml`` block of README.md and docs/*.md says
how it is checked, in an HTML comment on the line before it, and is checked so:

- ``<!-- doc-test: run -->``: run as it is, from the repository root (python in a fresh interpreter,
  bash with this interpreter's folder first on ``PATH``), and it must exit 0;
- ``<!-- doc-test: ci -->``: the README's two set-up commands: the test command is ``.ci/run``'s, and
  the main job's training arguments load (``load_config``) and its install pulls none of the test tools;
- ``<!-- doc-test: parse (why it is not run) -->``: a command that needs GPUs, a cluster or files a user
  brings: every titan_cp command line in it (train, generate, plan) loads with ``load_config`` (keys, values,
  cross-section checks for training) and passes its model family's checks (``preflight.check_model``), every
  config file it names exists, and every other file or folder it reads that the repository lacks is named
  in the page's text before it; a TOML block loads as a config file;
  a torchtitan 0.3 launcher line (``-m torchtitan.train``) loads with torchtitan's ``ConfigManager`` and
  passes the torchtitan door's checks (``check_run``);
- ``<!-- doc-test: excerpt PATH -->``: every line of the block but ``...`` / ``...,`` (lines left out) is a line of
  ``PATH``, in order, indentation aside (the file itself runs in its own test);
- ``<!-- doc-test: tested TEST -->``: run as it is by the test file ``TEST``, which names this page;
- ``<!-- doc-test: sketch -->``: an API outline with placeholders: it compiles, its imports resolve, and
  every call of an imported titan_cp function or class binds to that function's signature.

A block without a marker fails, naming its file and line, and so does a command where these checks cannot
see it: in a fence without a language, or in an indented block. A line is taken as pasted: a bracketed
``[--key value]`` is not an optional part but two arguments, and fails.
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

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from titan_cp.config import JobConfig, load_config
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
    """The command lines of a bash block: continuation lines joined, comments and ``#!`` dropped (a line
    pasted as it is: ``[--key value]`` is two arguments that load as no key)."""
    text = re.sub(r"\\\n\s*", " ", body)
    lines = [line.split(" #", 1)[0].strip() for line in text.splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


def _titan_cp_argv(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(module, its arguments)`` of a ``-m titan_cp.<train|generate|plan>`` command line, else ``None``."""
    for i, word in enumerate(argv[:-1]):
        if word == "-m" and argv[i + 1] in ("titan_cp.train", "titan_cp.generate", "titan_cp.plan"):
            return argv[i + 1], argv[i + 2 :]
    return None


def _config_argv(module: str, argv: list[str]) -> list[str]:
    """A titan_cp command line's config arguments: the planner's own options checked (``check_args``) and
    left out."""
    if module != "titan_cp.plan":
        return argv
    from titan_cp.plan.cli import check_args, parser  # noqa: PLC0415

    args, rest = parser().parse_known_args(argv)
    check_args(args)
    return rest


def _torchtitan_argv(argv: list[str]) -> list[str] | None:
    """The arguments of a ``-m torchtitan.train`` command line (torchtitan 0.3's launcher), else ``None``."""
    for i, word in enumerate(argv[:-1]):
        if word == "-m" and argv[i + 1] == "torchtitan.train":
            return argv[i + 2 :]
    return None


def _loads_in_torchtitan(argv: list[str]) -> None:
    pytest.importorskip("torchtitan", reason="torchtitan 0.3 is in the dev extra (Python >= 3.11)")
    from torchtitan.config import ConfigManager  # noqa: PLC0415

    from titan_cp.integrations.torchtitan import check_run  # noqa: PLC0415

    check_run(ConfigManager().parse_args(argv))


def _loads(block: Block, argv: list[str], training: bool = True) -> JobConfig:
    """The config of a command line (``training=False``: generation's, as ``titan_cp.generate`` loads it)."""
    config = argv[argv.index("--job.config_file") + 1] if "--job.config_file" in argv else None
    if config is not None:
        assert (ROOT / config).is_file(), f"{block}: names {config}, which is not in the repository"
        argv = [a if a != config else str(ROOT / config) for a in argv]
    cfg = load_config(argv, warn_adjustments=False, training=training)
    check_model(cfg)
    return cfg


@pytest.mark.parametrize("block", _of("parse"), ids=str)
def test_parse_blocks_load(block, tmp_path):
    if block.lang == "toml":
        config = tmp_path / "block.toml"
        config.write_text(block.body)
        load_config(["--job.config_file", str(config)], warn_adjustments=False)
        return
    commands = _commands(block.body)
    found = [cmd for cmd in map(_titan_cp_argv, commands) if cmd]
    torchtitan = [argv for argv in map(_torchtitan_argv, commands) if argv is not None]
    for module, argv in found:
        _loads(block, _config_argv(module, argv), training=module != "titan_cp.generate")
    for argv in torchtitan:
        _loads_in_torchtitan(argv)
    if block.lang == "bash" and "titan_cp." in block.body:
        assert found or torchtitan, f"{block}: names titan_cp but no '-m titan_cp.train/generate' command was found"


def test_ci_blocks_are_the_ci_command_and_the_main_job():
    main_job, tests = (b.body.strip() for b in _of("ci"))
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert tests == ci, "the README's test command and .ci/run differ"
    runs = [cmd for cmd in (_titan_cp_argv(shlex.split(part)) for part in main_job.split("&&")) if cmd]
    assert [module for module, _ in runs] == ["titan_cp.train"], main_job
    _loads(_of("ci")[0], runs[0][1])
    # the main job installs what it runs (torch, the plot's matplotlib), not the test command's tools
    extras = re.findall(r'-e "\.\[([^\]]*)\]"', main_job)[0].split(",")
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pulled = {re.split(r"[<>=;\[ ]", dep)[0] for extra in extras for dep in optional[extra]}
    assert not pulled & {"pytest", "pytest-xdist", "hypothesis", "ruff", "mypy"}, (extras, pulled)


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


_FENCE = re.compile(r"^```(?P<lang>\S*)\n(?P<body>.*?)^```", re.M | re.S)
_COMMAND = re.compile(r"^ *(python3? |torchrun |pip |accelerate |srun |\.venv/bin/)", re.M)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_command_hides_in_a_block_without_a_language_or_an_indented_one(path):
    """A block the checks above cannot see is unchecked: a command in a fence opened without a language
    (trees and renderings need none) or in a 4-space indented block fails, naming the block."""
    text = path.read_text()
    bare = [
        text.count("\n", 0, m.start()) + 1
        for m in _FENCE.finditer(text)
        if not m["lang"] and _COMMAND.search(m["body"])
    ]
    assert not bare, (
        f"{path.name}: commands in fences without a language (bash, with a doc-test marker) at lines {bare}"
    )
    outside = _FENCE.sub("", text)
    hidden = [m.group(0).strip() for m in re.finditer(r"^ {4,}\S.*", outside, re.M) if _COMMAND.match(m.group(0))]
    assert not hidden, f"{path.name}: commands in indented blocks (fence them, with a doc-test marker): {hidden}"


def _files_a_user_brings(module: str, cfg: JobConfig) -> list[str]:
    """The paths a command's config makes it read (tokenizer, weights, data, prompts; the planner: a Hugging
    Face model's ``config.json``) that the repository lacks."""
    t, v = cfg.training, cfg.validation
    paths = [cfg.model.hf_assets_path, cfg.checkpoint.initial_load_path, t.dataset_path, cfg.generate.prompt_file]
    paths += [s.path for s in t.mixture] + ([v.dataset_path] if v.enable else [])
    if module == "titan_cp.plan":
        paths = [cfg.model.hf_assets_path] if cfg.model.name == "hf" else []
    return [p for p in paths if p and not (ROOT / p).exists()]


@pytest.mark.parametrize("block", [b for b in _of("parse") if b.lang == "bash"], ids=str)
def test_parse_blocks_say_on_the_page_which_files_a_user_brings(block):
    """A command not run for want of files names them in the page's text before it (not only in the
    config file it loads, nor in an HTML comment): ``./assets/hf/Llama-3.1-8B`` of a preset, a data folder."""
    page = block.path.read_text().splitlines()[: block.line - 1]
    before = re.sub(r"<!--.*?-->", "", "\n".join(page), flags=re.S)
    for module, argv in filter(None, map(_titan_cp_argv, _commands(block.body))):
        config = _loads(block, _config_argv(module, argv), training=module != "titan_cp.generate")
        for path in _files_a_user_brings(module, config):
            named = path.removeprefix("./").rstrip("/")
            assert named in before, f"{block}: needs {path}, which the page does not name before the block"
