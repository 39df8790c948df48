"""Draw a run's ``metrics.jsonl`` as a PNG: training and validation loss, and long-range recall.

    python scripts/plot_metrics.py outputs/cpu_main/metrics.jsonl --out docs/main_job.png

Recall is the accuracy of the model's next-token prediction on the answer tokens of the
synthetic corpora (the planted values it must retrieve from far back), with the chance line.
Under CP it is drawn by how many shards back the fact sits, beside the same evaluation with
attention cut at the shard boundaries (``validation.recall_shard_cut``) where the run made it;
otherwise by fact-to-question distance bucket (tokens) and over all answers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no metrics")
    return rows


def plot(rows: list[dict], out: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_recall) = plt.subplots(1, 2, figsize=(13, 4.5))
    trained = [r for r in rows if "loss" in r]  # a skipped step (no loss-bearing token) has no loss
    ax_loss.plot([r["step"] for r in trained], [r["loss"] for r in trained], label="train loss", lw=1)
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    cut = [r for r in val if "val_loss_shard_cut" in r]
    if cut:
        ax_loss.plot(
            [r["step"] for r in cut], [r["val_loss_shard_cut"] for r in cut], "x--", label="validation, shard-cut"
        )
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)

    if any("recall_remote" in r for r in val):
        _recall_by_shards(ax_recall, val)
    else:
        _recall_by_tokens(ax_recall, val)
    chance = next((r["recall_chance"] for r in val if "recall_chance" in r), None)
    if chance is not None:
        ax_recall.axhline(chance, color="gray", ls=":", lw=1.5, label=f"chance ({chance:.3f})")
    ax_recall.set_xlabel("step")
    ax_recall.set_ylabel("recall accuracy (answer tokens)")
    ax_recall.set_ylim(0, 1)
    if any("recall_remote" in r for r in val):  # eight curves and the chance line: beside the axes
        ax_recall.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    else:
        ax_recall.legend(fontsize=8)
    ax_recall.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def _recall_by_tokens(ax, val: list[dict]) -> None:
    """Recall per fact-to-question distance bucket (tokens), and over all answers."""
    keys = sorted(
        {k for r in val for k in r if k.startswith(("recall_le_", "recall_gt_"))},
        key=lambda k: (k.startswith("recall_gt"), int(k.split("_")[-1])),
    )
    for key in keys:
        pts = [(r["step"], r[key]) for r in val if key in r]
        label = key.replace("recall_le_", "distance <= ").replace("recall_gt_", "distance > ")
        ax.plot(*zip(*pts), ".--", lw=1, label=label)
    pts = [(r["step"], r["recall"]) for r in val if "recall" in r]
    if pts:
        ax.plot(*zip(*pts), "o-", color="black", lw=2, label="all answers")


def _recall_by_shards(ax, val: list[dict]) -> None:
    """Recall by how many shards back the fact sits (solid), and the same checkpoints evaluated
    with attention cut at the shard boundaries (dashed: each rank sees only its own shard)."""
    shards = sorted({int(k.split("_")[2]) for r in val for k in r if k.startswith("recall_shards_")})
    colors = ["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink"]
    for k in shards:
        color = colors[k % len(colors)]
        where = "same shard" if k == 0 else f"{k} shard{'s' if k > 1 else ''} back"
        for suffix, style, what in (("", "o-", "full CP"), ("_shard_cut", "x--", "shard-cut")):
            key = f"recall_shards_{k}{suffix}"
            pts = [(r["step"], r[key]) for r in val if key in r]
            if pts:
                ax.plot(*zip(*pts), style, color=color, lw=2 if not suffix else 1, label=f"{where}, {what}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", type=Path, help="metrics.jsonl written by titan_cp.train")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: next to the metrics file)")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    out = args.out or args.metrics.with_suffix(".png")
    plot(load(args.metrics), out, args.title)
    print(json.dumps({"png": str(out)}))


if __name__ == "__main__":
    main()
