"""Run the CPU benchmarks at short settings and write the figures of docs/benchmarks.md under docs/.

    python scripts/report.py                 # a few minutes on a small machine
    python scripts/report.py --out docs --skip attention

Writes (each from the benchmark's own JSON lines, which are kept beside it as ``*.jsonl``):

    docs/balance.png      max/mean rank work per layout and document mix (scripts/bench_balance.py)
    docs/memory.png       saved and peak bytes per rank against CP, debug model (scripts/bench_memory.py),
                          with the planner's prediction of both (titan_cp.plan.step_peak_bytes)
    docs/efficiency.png   forward+backward efficiency per CP strategy on gloo ranks (scripts/bench_attention.py;
                          one thread per rank: on a machine with fewer cores than ranks, compare strategies only)

and prints the planner's estimates next to torchtitan's published runs (Markdown): Llama 3.1 8B
FSDP x CP, and the held-out 70B and 405B runs (titan_cp.plan.published).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from titan_cp import plan as P
from titan_cp.families.llama3 import model_args

ROOT = Path(__file__).resolve().parents[1]

BENCH = {
    "balance": [
        "bench_balance.py",
        "--seq-len",
        "16384",
        "--cps",
        "2",
        "4",
        "8",
        "--rows",
        "1",
        "--balances",
        "contiguous",
        "zigzag",
        "doc_zigzag",
        "doc_local",
        "torch_head_tail",
        "torch_per_doc_head_tail_padded",
        "greedy_doc",
    ],
    "memory": ["bench_memory.py", "--seq-len", "2048", "--cps", "1", "2", "4"],
    "attention": ["bench_attention.py", "--seq-len", "4096", "--worlds", "2", "4", "--cases", "docs", "--iters", "2"],
}


def _run(name: str, out: Path, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "scripts" / BENCH[name][0]), *BENCH[name][1:], *extra]
    print("#", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    recs = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def memory_figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args = model_args("debugmodel_gqa", vocab_size=259)
    cps = [r["cp"] for r in rows]
    pred = [P.step_peak_bytes(args, r["local_tokens"], 4, act_bytes=4, cp=r["cp"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    mib = 2**20
    ax.plot(
        cps, [r["saved_bytes_per_rank"] / mib for r in rows], "o-", color="C0", label="saved for backward (measured)"
    )
    ax.plot(cps, [p["saved"] / mib for p in pred], "x", color="k", ms=9, label="saved (planner)")
    ax.plot(cps, [r["peak_bytes_per_rank"] / mib for r in rows], "o-", color="C1", label="peak (allocator)")
    ax.plot(cps, [p["peak"] / mib for p in pred], "+", color="C3", ms=11, label="peak (planner)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(cps, [str(c) for c in cps])
    ax.set_xlabel("cp degree (ring, doc_zigzag)")
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"debugmodel_gqa, seq {rows[0]['seq_len']}, fp32, no AC")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def efficiency_figure(recs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in recs))
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False, sharey=True)
    for ax, case in zip(axes[0], cases):
        for i, s in enumerate(dict.fromkeys(r["strategy"] for r in recs)):
            got = [r for r in recs if r["case"] == case and r["strategy"] == s and r["world"] > 1]
            ax.plot([r["world"] for r in got], [r["efficiency"] for r in got], "o-", color=f"C{i}", label=s)
        ax.axhline(1.0, color="grey", ls=":", lw=1)
        ax.set_title(f"{case}, seq {recs[0]['seq_len']}")
        ax.set_xlabel("gloo ranks (one thread each)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("t(1 rank) / (ranks x t(ranks))")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def published_table(runs=P.LLAMA3_8B_CP) -> str:
    """``runs`` as published, as the planner predicts them as they ran there (float8 + compile, torch's
    2024 CP ring, AsyncTP where used) and as titan_cp would run the same mesh (bf16, eager)."""
    lines = [
        "| run | seq | published tok/s/GPU | planner, as run | planner / published | titan_cp bf16 "
        "| published GiB | planner GiB | fits 96 GB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for got, own in zip(P.compare(runs), P.compare(runs, P.Stack())):
        run = got.run
        name = f"{run.flavor} {run.label}" + (" + AsyncTP" if run.async_tp else "")
        lines.append(
            f"| {name} | {run.seq_len // 1024}K | {run.tokens_per_second_per_gpu:,.0f} "
            f"| {got.tokens_per_second_per_gpu:,.0f} | {got.ratio:.2f} | {own.tokens_per_second_per_gpu:,.0f} "
            f"| {run.memory_gib:.1f} | {got.memory_gib:.1f} | {'yes' if got.fits else 'no'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "docs"))
    p.add_argument("--skip", nargs="*", default=[], choices=list(BENCH))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "balance" not in args.skip:
        _run("balance", out, ["--plot", str(out / "balance.png")])
    if "memory" not in args.skip:
        memory_figure(_run("memory", out, []), out / "memory.png")
    if "attention" not in args.skip:
        efficiency_figure(_run("attention", out, []), out / "efficiency.png")
    print(published_table(P.LLAMA3_8B_CP))
    print()
    print(published_table(P.HELD_OUT))


if __name__ == "__main__":
    main()
