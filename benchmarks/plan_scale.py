"""The planner's cost at scale: process CPU time and peak resident memory of one planner command.

Each command runs as its own child process (``python -m titan_cp.plan ...``); ``os.wait4`` returns that
child's own resource usage (user + system CPU seconds and its peak RSS, ``ru_maxrss``), so the numbers
are the planner's alone, and CPU time, unlike wall time, is little disturbed by other work on the
machine. A command that has used ``timeout`` seconds of CPU is killed (``RLIMIT_CPU``; after three times
that of wall time, whatever it used) and reported as such (``answered: false``), with the CPU time it had
used. ``cwd``: the checkout whose ``titan_cp`` runs (``python -m`` imports it from there: an earlier
commit's tree, for a before-and-after).

    python scripts/bench_plan.py                  # the rows of benchmarks/results/2026-12-05-planner-any-scale.md
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

WORLDS = (1024, 4096, 65536)
MODELS = {
    "8B": ["--model.flavor", "8B"],
    "8B 128K config": ["--job.config_file", "train_configs/llama3_8b_128k.toml"],
}


@dataclass(frozen=True)
class PlannerRun:
    """One planner command: its arguments, exit status, CPU seconds, peak RSS and its last line."""

    argv: tuple[str, ...]
    answered: bool  # exited before the timeout
    returncode: int | None
    cpu_seconds: float
    peak_rss_mb: float
    wall_seconds: float
    last_line: str


def run_planner(argv: list[str], timeout: float = 120.0, cwd: str | None = None) -> PlannerRun:
    """Run ``python -m titan_cp.plan *argv`` in a child process and measure it (module docstring)."""
    start = time.monotonic()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (int(timeout), int(timeout) + 1))

    child = subprocess.Popen(
        [sys.executable, "-m", "titan_cp.plan", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        text=True,
        start_new_session=True,
        preexec_fn=limit,
    )
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        os.killpg(child.pid, signal.SIGKILL)

    timer = threading.Timer(3 * timeout, kill)
    timer.start()
    assert child.stdout is not None
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    timer.cancel()
    signalled = os.WIFSIGNALED(status)  # killed: by the CPU limit (SIGXCPU, SIGKILL) or the wall clock
    lines = [line for line in out.splitlines() if line.strip()]
    return PlannerRun(
        tuple(argv),
        not (signalled or killed.is_set()),
        None if signalled else os.waitstatus_to_exitcode(status),
        usage.ru_utime + usage.ru_stime,
        usage.ru_maxrss / 1024,  # kilobytes on Linux
        time.monotonic() - start,
        lines[-1][:200] if lines else "",
    )


def rows(timeout: float = 120.0, worlds: tuple[int, ...] = WORLDS, cwd: str | None = None) -> Iterator[dict]:
    """Every model of :data:`MODELS` on every world of ``worlds`` (the planner of the checkout ``cwd``),
    one record each, as each is measured."""
    for label, model in MODELS.items():
        for n in worlds:
            run = run_planner([*model, "--ngpu", str(n)], timeout, cwd)
            yield {"model": label, "ngpu": n, **asdict(run)}
