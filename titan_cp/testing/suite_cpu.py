"""The CPU seconds of each test, its process pools, forkservers and launched programs included: a pytest plugin.

    python -m pytest -p titan_cp.testing.suite_cpu ...   # a JSON line per test appended to $TITAN_CP_SUITE_CPU
    python scripts/suite_cpu.py                          # the suite run so: per test, per file, in all

pytest's ``--durations`` gives each test's wall seconds. On a machine whose cores the two test processes share,
those mix in the other's work, and they miss what a test costs where it waits (a pool's ranks, a launched
program): the suite's time is its CPU seconds over the cores. A test's CPU seconds here are those of its test
process and every process below it (``/proc/PID/stat``: user and system time, its own and that of the children it
reaped), after the test less before: a pool's worker started for one test and kept for the next counts where it
runs, a process that ended counts once its parent reaped it (a forkserver reaps its workers). Linux only.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ENV = "TITAN_CP_SUITE_CPU"
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: str) -> tuple[int, float] | None:
    """``pid``'s parent and CPU seconds (its own and its reaped children's), or ``None`` if it has gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[1]), sum(int(f) for f in fields[11:15]) / _TICKS  # ppid; utime, stime, cutime, cstime


def tree_cpu_seconds(pid: int | None = None) -> float:
    """The CPU seconds of process ``pid`` (this one by default) and of every process below it that is alive or
    was reaped by one of them."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (found := _stat(entry)) is not None:
            children.setdefault(found[0], []).append(int(entry))
            cpu[int(entry)] = found[1]
    total, todo = cpu.get(root, 0.0), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            total += cpu[child]
            todo.append(child)
    return total


def machine_busy_seconds() -> float:
    """The CPU seconds every core of this machine has been busy since it started (``/proc/stat``: user, nice and
    system time)."""
    user, nice, system = Path("/proc/stat").read_text().split()[1:4]
    return (int(user) + int(nice) + int(system)) / _TICKS


def summarize(records: list[dict], top: int = 30) -> list[dict]:
    """The records of a run (:func:`pytest_runtest_protocol`'s): the ``top`` tests by CPU seconds, then every file
    by its tests' CPU seconds, most first, then the run's sum (``{"tests": N, "cpu_s": ..., "wall_s": ...}``: wall
    seconds summed over the test processes)."""
    files: dict[str, dict] = {}
    for r in records:
        row = files.setdefault(
            r["test"].split("::")[0], dict(file=r["test"].split("::")[0], tests=0, cpu_s=0.0, wall_s=0.0)
        )
        row["tests"] += 1
        row["cpu_s"] += r["cpu_s"]
        row["wall_s"] += r["wall_s"]
    tests = sorted(records, key=lambda r: -r["cpu_s"])[:top]
    by_file = sorted(files.values(), key=lambda row: -row["cpu_s"])
    for row in by_file:
        row["cpu_s"], row["wall_s"] = round(row["cpu_s"], 2), round(row["wall_s"], 2)
    total = dict(
        tests=len(records),
        cpu_s=round(sum(r["cpu_s"] for r in records), 2),
        wall_s=round(sum(r["wall_s"] for r in records), 2),
    )
    return [*({"test": r["test"], "cpu_s": r["cpu_s"], "wall_s": r["wall_s"]} for r in tests), *by_file, total]


def pytest_configure(config: pytest.Config | None) -> None:
    if not Path("/proc/self/stat").exists():
        raise pytest.UsageError("titan_cp.testing.suite_cpu reads /proc: it counts CPU seconds on Linux only")
    if not os.environ.get(ENV):
        raise pytest.UsageError(f"titan_cp.testing.suite_cpu: set {ENV} to the file its records go to")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[Any]:
    """The test run (setup, call, teardown) between two counts; its record appended to ``$TITAN_CP_SUITE_CPU``."""
    cpu, wall = tree_cpu_seconds(), time.monotonic()
    yield
    record = dict(
        test=item.nodeid,
        cpu_s=round(tree_cpu_seconds() - cpu, 2),
        wall_s=round(time.monotonic() - wall, 2),
        worker=os.environ.get("PYTEST_XDIST_WORKER", "main"),
    )
    with open(os.environ[ENV], "a") as f:  # one short write a record: the two test processes' lines stay whole
        f.write(json.dumps(record) + "\n")
