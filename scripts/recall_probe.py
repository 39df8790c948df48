"""How many optimizer steps a model needs before it learns associative recall at all.

The synthetic corpus asks for facts thousands of tokens after they were planted. Answering
needs an in-context lookup circuit (an induction-style pair of heads: one carries "the token
before me" forward, the next matches the question's key against it and copies the value).
Such circuits appear after a plateau of many optimizer steps. This script measures that
plateau in the easiest form of the task, so that the step budget a recall run needs can be
stated as a number rather than guessed.

Each document packs ``--facts`` facts, ``--gap`` filler tokens and then every key asked once,
in byte-tokenizer ids::

    <BOS>#q $7 @c ... <filler> ?$7 ?#q ?@c ...

keys are distinct symbols of ``#$%&*+<>@^|~``, values random letters or digits (chance is
1/36), so a value is recallable only from its fact, ``gap`` + a few tokens back. Rows of
``--seq-len`` tokens hold as many documents as fit (document-masked attention, per-document
positions; a document cut by a row boundary continues in the next row, and answers cut off
from their facts are not asked). The model trains on one row per step (single process:
context parallelism does not change the math, the tests hold every strategy to the
single-process result). Every ``--every`` steps one JSON line::

    {"step": 400, "loss": 1.31, "recall": 0.06, "answers": 896, "chance": 0.0278, "seconds": 110.2}

``recall`` is the accuracy of the next-token prediction on the answer tokens of that step's
row, computed before the update on the row's fresh documents (never trained on), over
``answers`` answer tokens. The last line is the summary: ``steps_to_2x_chance``, the first
report at which the recall pooled over the latest reports holding at least 1000 answers
reached twice chance (null if it never did; pooling keeps one lucky row from counting when
documents are long and answers few).

    python scripts/recall_probe.py                       # tiny model, gap 16, 1200 steps
    python scripts/recall_probe.py --gap 2048 --plot /tmp/recall_probe.png
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_cp.data import IGNORE_INDEX, ByteTokenizer, Document, Packer  # noqa: E402
from titan_cp.data.datasets import _KEYS, _VALUE_CHARS  # noqa: E402
from titan_cp.metrics import recall_counts  # noqa: E402
from titan_cp.model import build_model  # noqa: E402

TOKENIZER = ByteTokenizer()
KEYS = [ord(c) for c in _KEYS]
VALUES = [ord(c) for c in _VALUE_CHARS]
FILLER = ord(".")
QUESTION = ord("?")
SPACE = ord(" ")


class ProbeDocuments:
    """A ``DocumentSource``: document ``i`` plants ``facts`` key -> value facts, ``gap`` filler
    tokens, then asks every key once; depends only on ``(seed, i)``."""

    def __init__(self, facts: int, gap: int, seed: int = 0):
        self.facts, self.gap, self.seed = facts, gap, seed

    def document(self, index: int) -> Document:
        rng = random.Random(f"recall_probe/{self.seed}/{index}")
        keys = rng.sample(KEYS, self.facts)
        value = {k: rng.choice(VALUES) for k in keys}
        tokens, value_at = [TOKENIZER.bos_id], {}
        for k in keys:
            value_at[k] = len(tokens) + 1
            tokens += [k, value[k], SPACE]
        tokens += [FILLER] * self.gap
        spans, distances = [], []
        for k in rng.sample(keys, self.facts):
            tokens += [QUESTION, k]
            spans.append((len(tokens), len(tokens) + 1))
            distances.append(len(tokens) - value_at[k])
            tokens += [value[k], SPACE]
        return Document(tokens, spans, distances)


def run(args: argparse.Namespace, emit=print) -> list[dict]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    packer = Packer(ProbeDocuments(args.facts, args.gap, args.seed), args.seq_len)
    model = build_model(args.flavor, vocab_size=TOKENIZER.vocab_size, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    chance = 1 / len(VALUES)
    records, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        row = packer.next_row()
        doc_lens = torch.tensor([row.doc_lens])
        logits = model(row.tokens[None], row.positions[None], doc_lens)[0]
        loss = F.cross_entropy(logits, row.labels, ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.every == 0:
            ((correct, answers),) = recall_counts(logits.argmax(-1), row.labels, row.recall_distance, []).tolist()
            record = {
                "step": step,
                "loss": round(loss.item(), 4),
                "recall": round(correct / max(answers, 1), 4),
                "answers": int(answers),
                "chance": round(chance, 4),
                "seconds": round(time.perf_counter() - start, 1),
            }
            records.append(record)
            emit(json.dumps(record))
    reached = steps_to_recall(records, 2 * chance)
    summary = {
        "flavor": args.flavor,
        "gap": args.gap,
        "facts": args.facts,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "steps": args.steps,
        "steps_to_2x_chance": reached,
        "final_recall": records[-1]["recall"] if records else None,
    }
    emit(json.dumps(summary))
    return records


def steps_to_recall(records: list[dict], level: float, min_answers: int = 1000) -> int | None:
    """First report step at which recall pooled over the latest reports (back until they hold
    ``min_answers`` answers, or all reports so far) reaches ``level``."""
    for i in range(len(records)):
        correct = total = 0
        for r in reversed(records[: i + 1]):
            correct += r["recall"] * r["answers"]
            total += r["answers"]
            if total >= min_answers:
                break
        if total >= min_answers and correct / total >= level:
            return records[i]["step"]
    return None


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--facts", type=int, default=8, help="facts per document (at most 12)")
    p.add_argument("--gap", type=int, default=16, help="filler tokens between facts and questions")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", default=None, help="write a PNG of recall against steps here")
    args = p.parse_args(argv)
    if not 1 <= args.facts <= len(KEYS):
        p.error(f"--facts must be in 1..{len(KEYS)}")
    if args.gap < 0 or args.seq_len < 1 or args.steps < 1 or args.every < 1:
        p.error("--gap must be >= 0, --seq-len, --steps and --every >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    records = run(args)
    if args.plot and records:
        plot(records, args.plot)


if __name__ == "__main__":
    main()
