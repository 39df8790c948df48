"""The test suite's CPU seconds by test and by file (:mod:`titan_cp.testing.suite_cpu`), as JSON lines: the ``--top``
tests by CPU seconds, every file, the tests' sum, then the run (its wall seconds, the machine's busy core-seconds
meanwhile, its cores, pytest's lines of the tests that failed). The suite runs as its README command runs it (two
test processes); arguments after ``--`` go to pytest.

    python scripts/suite_cpu.py                        # the whole suite
    python scripts/suite_cpu.py --top 10 -- tests/test_train.py -n 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from titan_cp.testing.suite_cpu import ENV, machine_busy_seconds, summarize

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--top", type=int, default=30, help="how many of the costliest tests to print")
    p.add_argument("pytest_args", nargs="*", help="pytest's arguments (after --)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "records.jsonl"
        env = dict(os.environ, **{ENV: str(log)})
        busy, wall = machine_busy_seconds(), time.monotonic()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "titan_cp.testing.suite_cpu", *args.pytest_args]
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        run = dict(
            run=" ".join(cmd[1:]),
            status=done.returncode,
            outcome=(done.stdout.strip().splitlines() or [""])[-1],
            failed=[line for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))],
            wall_s=round(time.monotonic() - wall, 1),
            busy_core_s=round(machine_busy_seconds() - busy, 1),
            cores=os.cpu_count(),
        )
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    for row in [*summarize(records, args.top), run]:
        print(json.dumps(row), flush=True)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
