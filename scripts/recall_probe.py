"""How many optimizer steps a model needs before it learns associative recall at all.

One JSON line every ``--every`` steps, then a summary line; what is measured and how:
:mod:`benchmarks.recall_probe`.

    python scripts/recall_probe.py                       # tiny model, gap 16, 1200 steps
    python scripts/recall_probe.py --gap 2048 --plot /tmp/recall_probe.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed: the checkout's

from benchmarks.recall_probe import KEYS, ProbeSettings, run  # noqa: E402


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], [r["recall"] for r in records], label="recall")
    ax.axhline(records[0]["chance"], color="gray", linestyle="--", label="chance")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("answer accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> tuple[ProbeSettings, str | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--facts", type=int, default=8, help=f"facts per document (at most {len(KEYS)})")
    p.add_argument("--gap", type=int, default=16, help="filler tokens between facts and questions")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--answers-only", action="store_true", help="loss on the answers alone (as synthetic_lookup)")
    p.add_argument("--plot", default=None, help="write a PNG of recall against steps here")
    args = vars(p.parse_args(argv))
    path = args.pop("plot")
    try:
        return ProbeSettings(**args), path
    except ValueError as e:
        p.error(str(e))


def main(argv: list[str] | None = None) -> None:
    settings, path = parse_args(argv)
    records = run(settings)
    if path and records:
        plot(records, path)


if __name__ == "__main__":
    main()
