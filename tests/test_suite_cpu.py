"""The suite's CPU accounting (:mod:`titan_cp.testing.suite_cpu`, ``scripts/suite_cpu.py``): a test's CPU seconds take
in what the processes it starts spend, alive or reaped; the plugin writes a record per test, and refuses to run
without the file its records go to. Each bound below is CPU seconds a child spent by its own count, not a timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pluggy
import pytest

from titan_cp.testing import suite_cpu
from titan_cp.testing.suite_cpu import ENV, summarize, tree_cpu_seconds

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="counts CPU seconds from /proc")

# A child spending 0.3 CPU seconds by its own count, then saying so and waiting to be told to end.
BURN = "import sys, time\nwhile time.process_time() < 0.3: pass\nprint('spent', flush=True)\nsys.stdin.read()"
# What /proc shows of it at least: /proc counts user and system time apart, each in whole clock ticks (10 ms),
# so up to two ticks under the child's own count (a run here read 0.29 less a rounding error for the 0.3).
SEEN = 0.3 - 2 / os.sysconf("SC_CLK_TCK") - 1e-6


def test_a_childs_cpu_seconds_count_while_it_runs_and_once_reaped():
    before = tree_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "spent\n"
    alive = tree_cpu_seconds()
    child.communicate("")  # it ends; this process reaps it
    reaped = tree_cpu_seconds()
    assert alive - before >= SEEN and reaped - before >= SEEN, (before, alive, reaped)
    assert tree_cpu_seconds(child.pid) == 0.0  # gone: nothing of it is counted twice


def test_the_plugin_records_what_a_tests_children_spent(tmp_path, monkeypatch):
    """The hook as pytest calls it (its name and arguments checked against pytest's own hook specifications)
    around a test that starts a busy child, then one that does nothing."""
    import _pytest.hookspec  # noqa: PLC0415

    specs = pluggy.PluginManager("pytest")
    specs.add_hookspecs(_pytest.hookspec)
    specs.register(suite_cpu)  # a misnamed hook or argument raises here
    log = tmp_path / "records.jsonl"
    monkeypatch.setenv(ENV, str(log))
    for name, body in [
        ("busy", lambda: subprocess.run([sys.executable, "-c", BURN], input="")),
        ("idle", lambda: None),
    ]:
        around = suite_cpu.pytest_runtest_protocol(SimpleNamespace(nodeid=f"test_x.py::{name}"), None)
        next(around)
        body()
        with pytest.raises(StopIteration):
            next(around)
    busy, idle = (json.loads(line) for line in log.read_text().splitlines())
    assert busy["test"] == "test_x.py::busy" and busy["cpu_s"] >= SEEN, busy
    assert idle["test"] == "test_x.py::idle" and idle["cpu_s"] < busy["cpu_s"], idle
    assert busy["worker"] == idle["worker"] == os.environ.get("PYTEST_XDIST_WORKER", "main")
    *tests, file, total = summarize([idle, busy], top=2)
    assert [t["test"] for t in tests] == [busy["test"], idle["test"]]  # most CPU seconds first
    assert file == dict(file="test_x.py", tests=2, cpu_s=round(busy["cpu_s"] + idle["cpu_s"], 2),
                        wall_s=round(busy["wall_s"] + idle["wall_s"], 2))  # fmt: skip
    assert total["tests"] == 2 and total["cpu_s"] == file["cpu_s"]


def test_without_the_records_file_the_plugin_refuses_in_one_line(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(pytest.UsageError, match=f"set {ENV} to the file its records go to"):
        suite_cpu.pytest_configure(None)
