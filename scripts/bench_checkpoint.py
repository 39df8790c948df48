"""What the checkpoints' checksums cost at save and at load (benchmarks/checkpoint.py), one JSON line
per model and operation::

    {"model": "100M", "op": "save", "state_bytes": 1189642240, "repeats": 3, "dcp_cpu_s": 1.9,
     "checksum_cpu_s": 2.2, "added_cpu_s": 0.3, "added_cpu_percent": 15.8, "dcp_wall_s": ..., ...}

    python scripts/bench_checkpoint.py                          # both models, 3 repeats, under /tmp
    python scripts/bench_checkpoint.py --models 100M --repeats 5 --dir /scratch
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed: the checkout's

from benchmarks.checkpoint import MODELS, measure  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per writer (medians reported)")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for model in args.models:
            for record in measure(model, Path(folder), args.repeats):
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
