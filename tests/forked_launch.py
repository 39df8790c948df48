"""Several programs in one launch of N ranks, each in a fresh process of its own (for the tests that
launch ``examples/`` and torchtitan's trainer; not collected by pytest).

    python tests/forked_launch.py --nproc-per-node N PLAN.json

Importing torch, transformers, TRL or torchtitan is most of such a launch's time on a CPU. The launch
imports them once (``PLAN["preload"]``: module names, or ``module:function`` to import and call; and
the top-level imports of every script step), then forks its N workers, each with the environment
``torchrun --nproc-per-node N`` gives its ranks (:func:`torchrun_env`), and each runs the steps one after
another, each in a child forked from it, so that a step starts as a program does under its own
``torchrun``: nothing of it ran before, its own process group and accelerate state. A worker that fails
stops the others, as torchrun stops them. ``PLAN["steps"]``, in order:

- ``{"name", "argv"}``: ``argv`` is what follows ``torchrun [options]`` on a command line: a
  script and its arguments, or ``-m MODULE`` and its arguments; run as ``__main__``. Its process
  group meets on a port its rank 0 picks free when the step starts (``PLAN["markers"]/NAME.port`` tells
  its other ranks), with rank 0 hosting the store: a port picked when the plan is written may be taken
  by the time a later step starts;
- ``"nproc": N`` (a program step, N below the launch's size): run by local ranks 0 to N - 1 alone, as under
  ``torchrun --nproc-per-node N`` (world size N); the other ranks wait for it to end. One launch then runs a
  page's 1-, 2- and 4-process lines, paying the imports of its workers once;
- ``"first_rank": R`` (either kind): the step runs on local ranks R to R + N - 1 (N its ``nproc``, 1 for a shell
  line), rank R its rank 0, and the other ranks do not wait for it: they go on to their next step, so that steps
  on other ranks run at the same time (a step's rank 0 sleeping at its end, or loading, leaves the CPU to
  another). What a step needs of another is its ``"after"``;
- ``{"name", "shell"}``: a bash command line, run by local rank 0 only (its ``first_rank`` if placed);
- ``"after": [names]`` (either kind): wait until those steps, of this launch or another, have
  finished (the rank that ran one as its rank 0 writes ``PLAN["markers"]/NAME.ok``, or ``NAME.failed``, when it
  ends: a collective save has finished everywhere by then);
- ``"status": N`` (either kind): the exit status the step must end with (default 0: a command refusing
  bad input ends with 2).

Rank 0 prints ``== NAME`` before each step's output, on stdout and on stderr (:func:`sections` splits
either). With ``PLAN["logs"]`` (a folder) each step's processes write their stdout and stderr to ``NAME.out`` and
``NAME.err`` there instead, every rank of the step appending (:func:`step_logs` reads them): placed steps running
at once keep their lines apart. A failed step (another status than its own) skips the steps after it on its ranks,
and those that wait for it, and the launch exits 1.
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
import signal
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
    """``python tests/forked_launch.py --nproc-per-node <nproc> <plan_path>`` (``plan`` written there) from
    ``cwd``, with ``env``; stdout and stderr piped, as text."""
    plan_path.write_text(json.dumps(plan))
    argv = [sys.executable, str(Path(__file__).resolve()), "--nproc-per-node", str(nproc), str(plan_path)]
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def torchrun_env(local_rank: int, nproc: int, port: int) -> dict[str, str]:
    """What ``torchrun --nproc-per-node <nproc>`` (one node, no restarts) sets for its rank ``local_rank``."""
    ranks = dict(RANK=local_rank, LOCAL_RANK=local_rank, GROUP_RANK=0, ROLE_RANK=local_rank)
    sizes = dict(WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc, GROUP_WORLD_SIZE=1, ROLE_WORLD_SIZE=nproc)
    elastic = dict(TORCHELASTIC_RESTART_COUNT=0, TORCHELASTIC_MAX_RESTARTS=0, TORCHELASTIC_USE_AGENT_STORE=False)
    env = {k: str(v) for k, v in {**ranks, **sizes, **elastic}.items()}
    env.update(ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="none")
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    return env


def sections(out: str) -> dict[str, str]:
    """A launch's rank-0 output by step name, in order."""
    return dict(re.findall(r"^== (\S+)\n(.*?)(?=^== |\Z)", out, re.S | re.M))


def step_logs(logs: Path, names: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """The stdout and stderr of each step ``names`` of a launch with ``PLAN["logs"] = logs`` (empty if it wrote none)."""
    read = {kind: {n: (logs / f"{n}.{kind}").read_text() if (logs / f"{n}.{kind}").exists() else "" for n in names}
            for kind in ("out", "err")}  # fmt: skip
    return read["out"], read["err"]


def _script_imports(path: str) -> None:
    """Execute the top-level imports of the script ``path`` (those inside an ``if`` / ``try`` aside)."""
    tree = ast.parse(Path(path).read_text(), path)
    nodes = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), {"__name__": "__imports__"})


def _ranks(step: dict, size: int) -> range:
    """The local ranks that run ``step``: its ``first_rank`` and on, or the first ``nproc`` (a shell line: one)."""
    first = step.get("first_rank", 0)
    return range(first, first + (1 if "shell" in step else step.get("nproc", size)))


def _step_port(step: dict, local_rank: int, markers: Path, timeout_s: float = 900.0) -> int | None:
    """The port ``step``'s process group meets on: its rank 0 picks it free now and writes it to
    ``markers/NAME.port``; its other ranks read it there (None: not written in time, or a step failed)."""
    path = markers / f"{step['name']}.port"
    if local_rank == step.get("first_rank", 0):
        markers.mkdir(parents=True, exist_ok=True)
        (markers / f"{step['name']}.port.tmp").write_text(str(port := free_port()))
        (markers / f"{step['name']}.port.tmp").rename(path)
        return port
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if any(markers.glob("*.failed")) or time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return int(path.read_text())


def _run_program(step: dict, local_rank: int, port: int) -> int:
    """The child: ``step``'s program as ``__main__``, its process group on ``port``; its exit status."""
    os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")
    if "nproc" in step or "first_rank" in step:  # a single node's ranks from first_rank: the rank counts from there
        n, rank = str(step.get("nproc", os.environ["LOCAL_WORLD_SIZE"])), str(local_rank - step.get("first_rank", 0))
        os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=n, LOCAL_WORLD_SIZE=n)
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


def _to_logs(logs: str | None, name: str) -> None:
    """This process's stdout and stderr appended to ``logs/name.out`` and ``.err`` (``logs`` None: left as they are)."""
    if logs is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, kind in ((1, "out"), (2, "err")):
        os.dup2(os.open(Path(logs) / f"{name}.{kind}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)


def _fork(step: dict, local_rank: int, logs: str | None, port: int) -> int:
    """``step``'s program in a forked child of this worker (its output to ``logs`` if given); its exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _to_logs(logs, step["name"])
        status = _run_program(step, local_rank, port)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _run_step(step: dict, local_rank: int, logs: str | None, markers: Path) -> int | None:
    """Run ``step`` on this rank, one of its ranks (a shell line: its only one): its exit status (None: its
    ranks never met)."""
    if logs is None and local_rank == step.get("first_rank", 0):
        print(f"== {step['name']}", flush=True)
        print(f"== {step['name']}", file=sys.stderr, flush=True)
    if "shell" not in step:
        port = _step_port(step, local_rank, markers)
        return None if port is None else _fork(step, local_rank, logs, port)
    if logs is None:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", step["shell"]]).returncode
    with open(Path(logs) / f"{step['name']}.out", "a") as out, open(Path(logs) / f"{step['name']}.err", "a") as err:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", step["shell"]], stdout=out, stderr=err).returncode


def _wait(names: list[str], markers: Path, timeout_s: float = 900.0) -> bool:
    """Wait for the steps ``names`` to end; whether all succeeded (and in time)."""
    deadline = time.monotonic() + timeout_s
    for name in names:
        while not (markers / f"{name}.ok").exists():
            if (markers / f"{name}.failed").exists() or time.monotonic() > deadline:
                return False
            time.sleep(0.2)
    return True


def _prepare(plan: dict) -> None:
    """What every step inherits: the plan's preloads (a module, or "module:function": imported, then called) and
    the top-level imports of its scripts, frozen out of the garbage collector's full scans."""
    for name in plan.get("preload", []):
        module, _, function = name.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
    for step in plan["steps"]:
        if "argv" in step and step["argv"][0] != "-m":
            _script_imports(step["argv"][0])
    gc.freeze()  # what every step inherits: its full collections scan only what the step makes


def _worker(plan: dict, local_rank: int, size: int) -> int:
    """Rank ``local_rank`` of ``size``: the plan's steps in order; 1 if one ended with another status than its own."""
    markers, logs = Path(plan["markers"]), plan.get("logs")
    failed = False
    for step in plan["steps"]:
        want, ranks = step.get("status", 0), _ranks(step, size)
        if local_rank not in ranks and "first_rank" in step:
            continue  # placed on other ranks: not waited for
        failed = failed or any(markers.glob("*.failed"))  # a step failed elsewhere: its ranks may not come
        code: int | None = None  # None: not run (an earlier step failed, or a wait timed out)
        if not failed and local_rank not in ranks:  # a step of fewer ranks: the others take its status
            code = want if _wait([step["name"]], markers) else None
        elif not failed and _wait(step.get("after", []), markers):
            code = _run_step(step, local_rank, logs, markers)
            if code != want:
                print(f"{step['name']} exited {code}", file=sys.stderr, flush=True)
        failed = failed or code != want
        if local_rank == ranks[0]:
            markers.mkdir(parents=True, exist_ok=True)
            (markers / f"{step['name']}.{'failed' if code != want else 'ok'}").touch()
    return 1 if failed else 0


def main(nproc: int, plan_path: str) -> int:
    """The plan's preloads once, then its ``nproc`` workers forked from here; 1 if one fails (the others then
    stopped), else 0."""
    plan = json.loads(Path(plan_path).read_text())
    _prepare(plan)
    port, workers = free_port(), {}
    for local_rank in range(nproc):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.environ.update(torchrun_env(local_rank, nproc, port))
            status = _worker(plan, local_rank, nproc)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        workers[pid] = local_rank
    failed = False
    while workers:
        pid, status = os.wait()
        if workers.pop(pid, None) is not None and os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            for other in workers:  # as torchrun stops the other ranks of a failed one
                os.kill(other, signal.SIGTERM)
    return 1 if failed else 0


if __name__ == "__main__":
    assert sys.argv[1] == "--nproc-per-node", sys.argv
    status = main(int(sys.argv[2]), sys.argv[3])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # the steps ran in children: nothing of this process's teardown is needed (seconds of it)
