"""Several programs in one ``torchrun`` launch, each in a fresh process of its own (for the tests that
launch ``examples/`` and torchtitan's trainer; not collected by pytest).

    torchrun --nproc-per-node N tests/forked_launch.py PLAN.json

Importing torch, transformers, TRL or torchtitan is most of such a launch's time on a CPU. Each worker
imports them once (``PLAN["preload"]``: module names, or ``module:function`` to import and call; and
the top-level imports of every script step), then runs the steps one after another, each in a child forked from it, so that a step starts
as a program does under its own ``torchrun``: nothing of it ran before, its own process group and
accelerate state. ``PLAN["steps"]``, in order:

- ``{"name", "argv", "port"}``: ``argv`` is what follows ``torchrun [options]`` on a command line: a
  script and its arguments, or ``-m MODULE`` and its arguments; run as ``__main__``. Its process
  group meets on ``port`` (the same in every worker) with rank 0 hosting the store: the launch's
  agent store still holds the previous step's rendezvous keys;
- ``"nproc": N`` (a program step, N below the launch's size): run by local ranks 0 to N - 1 alone, as under
  ``torchrun --nproc-per-node N`` (world size N); the other ranks wait for it to end. One launch then runs a
  page's 1-, 2- and 4-process lines, paying the imports of its workers once;
- ``{"name", "shell"}``: a bash command line, run by local rank 0 only;
- ``"after": [names]`` (either kind): wait until those steps, of this launch or another, have
  finished (local rank 0 of the launch that ran one writes ``PLAN["markers"]/NAME.ok``, or
  ``NAME.failed``, when it ends: a collective save has finished everywhere by then);
- ``"status": N`` (either kind): the exit status the step must end with (default 0: a command refusing
  bad input ends with 2).

Rank 0 prints ``== NAME`` before each step's output, on stdout and on stderr (:func:`sections` splits
either). A failed step (another status than its own) skips the steps after it and the launch exits 1.
:func:`launch` starts such a launch from a test.
"""

from __future__ import annotations

import ast
import gc
import importlib
import json
import os
import re
import runpy
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, plan: dict, plan_path: Path, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """``torchrun --nproc-per-node <nproc> tests/forked_launch.py <plan_path>`` (``plan`` written there) from
    ``cwd``, on a free port, with ``env``; stdout and stderr piped, as text."""
    plan_path.write_text(json.dumps(plan))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    argv += ["--master-port", str(free_port()), str(Path(__file__).resolve()), str(plan_path)]
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def sections(out: str) -> dict[str, str]:
    """A launch's rank-0 output by step name, in order."""
    return dict(re.findall(r"^== (\S+)\n(.*?)(?=^== |\Z)", out, re.S | re.M))


def _script_imports(path: str) -> None:
    """Execute the top-level imports of the script ``path`` (those inside an ``if`` / ``try`` aside)."""
    tree = ast.parse(Path(path).read_text(), path)
    nodes = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), {"__name__": "__imports__"})


def _run_program(step: dict) -> int:
    """The child: ``step``'s program as ``__main__``; its exit status."""
    os.environ.update(MASTER_PORT=str(step["port"]), TORCHELASTIC_USE_AGENT_STORE="False")
    if "nproc" in step:  # a single node's first N ranks: the rank is the local rank
        n = str(step["nproc"])
        os.environ.update(RANK=os.environ["LOCAL_RANK"], WORLD_SIZE=n, LOCAL_WORLD_SIZE=n)
    argv = step["argv"]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported, and the exit status says it failed
        traceback.print_exc()
        return 1
    return 0


def _wait(names: list[str], markers: Path, timeout_s: float = 900.0) -> bool:
    """Wait for the steps ``names`` to end; whether all succeeded (and in time)."""
    deadline = time.monotonic() + timeout_s
    for name in names:
        while not (markers / f"{name}.ok").exists():
            if (markers / f"{name}.failed").exists() or time.monotonic() > deadline:
                return False
            time.sleep(0.2)
    return True


def main(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    markers, local_rank = Path(plan["markers"]), int(os.environ.get("LOCAL_RANK", "0"))
    rank0, size = local_rank == 0, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    for name in plan.get("preload", []):  # a module, or "module:function" (imported, then called)
        module, _, function = name.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
    for step in plan["steps"]:
        if "argv" in step and step["argv"][0] != "-m":
            _script_imports(step["argv"][0])
    gc.freeze()  # what every step inherits: its full collections scan only what the step makes
    failed = False
    for step in plan["steps"]:
        want = step.get("status", 0)
        code: int | None = None  # None: not run (an earlier step failed, or a wait timed out)
        left_out = local_rank >= step.get("nproc", size)  # a step of fewer ranks: the others take its status
        if not failed and left_out:
            code = want if _wait([step["name"]], markers) else None
        elif not failed and _wait(step.get("after", []), markers):
            if os.environ.get("RANK", "0") == "0":
                print(f"== {step['name']}", flush=True)
                print(f"== {step['name']}", file=sys.stderr, flush=True)
            if "shell" in step:
                code = subprocess.run(["bash", "-euo", "pipefail", "-c", step["shell"]]).returncode if rank0 else want
            else:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    status = _run_program(step)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(status)
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if code != want:
                print(f"{step['name']} exited {code}", file=sys.stderr, flush=True)
        failed = failed or code != want
        if rank0:
            markers.mkdir(parents=True, exist_ok=True)
            (markers / f"{step['name']}.{'failed' if code != want else 'ok'}").touch()
    return 1 if failed else 0


if __name__ == "__main__":
    status = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # the steps ran in children: nothing of this process's teardown is needed (seconds of it)
