"""The planner's CPU time and peak RSS at 1,024 / 4,096 / 65,536 GPUs, one JSON line per command.

What is measured and how: :mod:`benchmarks.plan_scale`.

    python scripts/bench_plan.py                       # every model at every world, 120 s each at most
    python scripts/bench_plan.py --timeout 600 --worlds 65536
    python scripts/bench_plan.py --tree /tmp/before      # another checkout's planner (git archive of a commit)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed: the checkout's

from benchmarks.plan_scale import WORLDS, rows  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=float, default=120.0, help="CPU seconds a command may use before it is killed")
    p.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS), help="--ngpu of each command")
    p.add_argument("--tree", default=None, help="the checkout whose planner runs (default: this one)")
    args = p.parse_args(argv)
    for r in rows(args.timeout, tuple(args.worlds), args.tree):
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
