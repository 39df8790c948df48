"""How many optimizer steps a model needs before it learns associative recall at all.

The synthetic corpus asks for facts thousands of tokens after they were planted. Answering
needs an in-context lookup circuit (an induction-style pair of heads: one carries "the token
before me" forward, the next matches the question's key against it and copies the value).
Such circuits appear after a plateau of many optimizer steps. This probe measures that
plateau in the easiest form of the task, so that the step budget a recall run needs can be
stated as a number rather than guessed (``scripts/recall_probe.py`` is its command line).

Each document packs ``facts`` facts, ``gap`` filler tokens and then every key asked once,
in byte-tokenizer ids::

    <BOS>#q $7 @c ... <filler> ?$7 ?#q ?@c ...

keys are distinct symbols of ``#$%&*+<>@^|~``, values random letters or digits (chance is
1/36), so a value is recallable only from its fact, ``gap`` + a few tokens back. Rows of
``seq_len`` tokens hold as many documents as fit (document-masked attention, per-document
positions; a document cut by a row boundary continues in the next row, and answers cut off
from their facts are not asked). The model trains on one row per step (single process:
context parallelism does not change the math, the tests hold every strategy to the
single-process result). Every ``every`` steps one record::

    {"step": 400, "loss": 1.31, "recall": 0.06, "answers": 896, "chance": 0.0278, "seconds": 110.2}

``recall`` is the accuracy of the next-token prediction on the answer tokens of that step's
row, computed before the update on the row's fresh documents (never trained on), over
``answers`` answer tokens. The summary's ``steps_to_2x_chance`` is the first report at which
the recall pooled over the latest reports holding at least 1000 answers reached twice chance
(``None`` if it never did; pooling keeps one lucky row from counting when documents are long
and answers few).

``answers_only`` puts the loss on the answers alone. Then the recall climbs from the first
hundred steps, but to the level of a lookup-free strategy: predicting a value of the document's
facts that was not asked yet (with 8 facts, perfect elimination scores ``H(8)/8 = 0.34``); the
tiny model measured 0.35 after 3000 steps at ``--lr 1e-2``, and 0.04-0.12 on longer documents
(``docs/recall.md``).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titan_cp.data import IGNORE_INDEX, ByteTokenizer, Document, Packer
from titan_cp.data.datasets import _KEYS, _VALUE_CHARS, answers_mask
from titan_cp.families.llama3 import build_model
from titan_cp.metrics import recall_counts

TOKENIZER = ByteTokenizer()
KEYS = [ord(c) for c in _KEYS]
VALUES = [ord(c) for c in _VALUE_CHARS]
FILLER = ord(".")
QUESTION = ord("?")
SPACE = ord(" ")


class ProbeDocuments:
    """A ``DocumentSource``: document ``i`` plants ``facts`` key -> value facts, ``gap`` filler
    tokens, then asks every key once; depends only on ``(seed, i)``. ``answers_only``: the loss
    is on the answers alone (``loss_mask``)."""

    def __init__(self, facts: int, gap: int, seed: int = 0, answers_only: bool = False):
        self.facts, self.gap, self.seed, self.answers_only = facts, gap, seed, answers_only

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
        mask = answers_mask(len(tokens), spans) if self.answers_only else None
        return Document(tokens, spans, distances, loss_mask=mask)


@dataclass(frozen=True)
class ProbeSettings:
    """One probe run: model ``flavor``, rows of ``seq_len`` tokens, documents of ``facts`` facts
    and ``gap`` filler tokens, ``steps`` AdamW steps at ``lr`` (one row each), a report every
    ``every`` steps, on ``threads`` CPU threads; ``answers_only``: the loss on the answers alone.
    ``ValueError`` naming the setting when out of range."""

    flavor: str = "tiny"
    seq_len: int = 8192
    facts: int = 8
    gap: int = 16
    steps: int = 1200
    every: int = 20
    lr: float = 3e-3
    seed: int = 0
    threads: int = 1
    answers_only: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.facts <= len(KEYS):
            raise ValueError(f"facts must be in 1..{len(KEYS)} (one distinct key per fact), got {self.facts}")
        if self.gap < 0:
            raise ValueError(f"gap must be >= 0, got {self.gap}")
        for name in ("seq_len", "steps", "every", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def run(settings: ProbeSettings, emit: Callable[[str], object] = print) -> list[dict]:
    """Train and report (module docstring): ``emit`` gets each record as a JSON line, then the
    summary's; returns the records."""
    s = settings
    torch.manual_seed(s.seed)
    torch.set_num_threads(s.threads)
    packer = Packer(ProbeDocuments(s.facts, s.gap, s.seed, s.answers_only), s.seq_len)
    model = build_model(s.flavor, vocab_size=TOKENIZER.vocab_size, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.1)
    chance = 1 / len(VALUES)
    records, start = [], time.perf_counter()
    for step in range(1, s.steps + 1):
        row = packer.next_row()
        doc_lens = torch.tensor([row.doc_lens])
        logits = model(row.tokens[None], row.positions[None], doc_lens)[0]
        loss = F.cross_entropy(logits, row.labels, ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % s.every == 0:
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
    emit(json.dumps(summary(s, records, chance)))
    return records


def summary(settings: ProbeSettings, records: list[dict], chance: float) -> dict:
    """The last line: the settings that matter, ``steps_to_2x_chance`` and the final recall."""
    return {
        **{k: getattr(settings, k) for k in ("flavor", "gap", "facts", "seq_len", "lr", "steps", "answers_only")},
        "steps_to_2x_chance": steps_to_recall(records, 2 * chance),
        "final_recall": records[-1]["recall"] if records else None,
    }


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
