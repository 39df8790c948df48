"""Attention load balance of each sequence layout over packed-document mixes, counted exactly.

For every (document mix, cp, balance) prints one JSON line with the visible (query, key) pairs
of each CP rank (``max_over_mean``), the synchronous ring's critical path
(``ring_critical_over_ideal``), their whole-batch versions and the most kernel calls of one
rank (``max_tiles``). What is counted and how, and the balances compared (titan_cp's layouts,
torch's load balancers, the ``greedy_doc`` prototype): :mod:`benchmarks.balance`. Mixes:
:mod:`titan_cp.data.row_mixes`.

    python scripts/bench_balance.py                               # 131072 tokens, cp 2 4 8 16, 3 rows/mix
    python scripts/bench_balance.py --seq-len 32768 --cps 2 4 --rows 1 --plot balance.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed: the checkout's

from benchmarks.balance import ALL_BALANCES, BALANCE_MIXES, ROW_MIXES, run  # noqa: E402


def plot(records: list[dict], path: str) -> None:
    """max_over_mean by cp, one panel per mix, one line per balance (null points skipped).

    titan_cp balances are solid, torch's dashed, prototypes dotted; the target 1.05 is grey.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = list(dict.fromkeys(r["mix"] for r in records))
    balances = list(dict.fromkeys(r["balance"] for r in records))
    style = {"titan_cp": "-", "torch": "--", "prototype": ":"}
    markers = "osD^v<>ph*"
    fig, axes = plt.subplots(1, len(mixes), figsize=(4.2 * len(mixes), 4.6), squeeze=False, sharey=True)
    for ax, mix in zip(axes[0], mixes):
        for i, b in enumerate(balances):
            got = [r for r in records if r["mix"] == mix and r["balance"] == b and r["max_over_mean"] is not None]
            if got:
                ax.plot(
                    [r["cp"] for r in got],
                    [r["max_over_mean"] for r in got],
                    style[got[0]["source"]],
                    marker=markers[i % len(markers)],
                    ms=4,
                    color=f"C{i}",
                    label=b,
                )
        cps = sorted({r["cp"] for r in records})
        ax.set_xscale("log", base=2)
        ax.set_xticks(cps, [str(c) for c in cps])
        ax.set_yscale("log")
        ax.axhline(1.05, color="grey", ls=":", lw=1)
        ax.set_title(mix)
        ax.set_xlabel("cp")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("max rank work / mean rank work (worst row)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--rows", type=int, default=3, help="rows (independent draws) per mix")
    p.add_argument("--mixes", nargs="+", default=list(BALANCE_MIXES), choices=list(ROW_MIXES))
    p.add_argument("--balances", nargs="+", default=list(ALL_BALANCES), choices=list(ALL_BALANCES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--greedy-alpha",
        type=float,
        default=0.02,
        help="greedy_doc keeps a document whole when its work is <= this fraction of a rank's ideal work",
    )
    p.add_argument("--plot", metavar="PATH", help="write a PNG of max_over_mean by cp")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # small vectors; threads only contend
    t0 = time.perf_counter()
    records = []
    for rec in run(args.mixes, args.cps, args.balances, args.seq_len, args.rows, args.seed, args.greedy_alpha):
        records.append(rec)
        print(json.dumps(rec), flush=True)
    if args.plot:
        plot(records, args.plot)
    print(f"# {len(records)} records in {time.perf_counter() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
