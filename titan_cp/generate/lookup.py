"""The main job's questions asked through generation: the model's own answers to ``synthetic_lookup``.

The trainer's validation scores recall from the logits at each question (teacher forcing over the
whole row); this asks the same questions one by one. Each held-out document
(:class:`titan_cp.data.datasets.SyntheticLookup`, its ``validation`` split) asks each of its six
facts once; question ``j`` becomes the prompt of the document's tokens up to and including the key
it asks, and the model's answer is the one token greedy decoding gives after it::

    <BOS> F F F F F F .......?#F'.....?$  ->  generated token == the fact of key $ ?
          └ the facts ┘        └ an earlier question, answered as the document answers it

The prompt is the validation row's prefix and attention is causal, so the generated token is the
argmax the validation scores at that position (up to the order of float sums): ``correct`` per
question is the validation's, and recall over the same documents is the same number. Each record
also holds the fact-to-answer distance in tokens (the trainer's ``recall_distance``), from which
:func:`recall_by_shards` gives recall by distance in whole shards, as the main job's plot draws it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from titan_cp.data.datasets import LOOKUP_FACTS, LOOKUP_KEYS, LOOKUP_VALUES, SyntheticLookup
from titan_cp.data.tokenizer import Tokenizer
from titan_cp.generate.engine import Generator
from titan_cp.metrics import recall_counts, shard_edges, shard_recall_metrics


@dataclass(frozen=True)
class Question:
    """Question ``index`` of held-out document ``document``: ``prompt`` (the document's tokens up to the
    key asked), ``answer`` (the token of that key's fact) and ``distance`` (tokens from the fact to the
    answer)."""

    document: int
    index: int
    prompt: list[int]
    answer: int
    distance: int


def fact_name(token: int) -> str | None:
    """``"<key>=<value>"`` of a fact token (``"$=k"``), ``None`` for any other token."""
    if token not in LOOKUP_FACTS:
        return None
    key, value = divmod(LOOKUP_FACTS.index(token), len(LOOKUP_VALUES))
    return f"{LOOKUP_KEYS[key]}={LOOKUP_VALUES[value]}"


def lookup_questions(tokenizer: Tokenizer, seed: int, tokens: int, documents: int) -> list[Question]:
    """The questions of held-out documents ``0 .. documents - 1`` of ``tokens`` tokens each (the
    ``validation`` split of ``seed``), in the order the documents ask them."""
    source = SyntheticLookup(tokenizer, seed=seed, split="validation", tokens=tokens)
    out = []
    for d in range(documents):
        doc = source.document(d)
        for j, ((start, _), distance) in enumerate(zip(doc.answer_spans, doc.answer_distances)):
            out.append(Question(d, j, doc.tokens[:start], doc.tokens[start], distance))
    return out


def lookup_eval(generator: Generator, questions: Sequence[Question]) -> list[dict]:
    """One record per question: its place, key, fact and distance, the token greedy decoding answers
    (and the fact it names, if it is one), and whether it is the answer. One batch per document."""
    records = []
    for d in dict.fromkeys(q.document for q in questions):
        asked = [q for q in questions if q.document == d]
        answers = generator.generate([q.prompt for q in asked], 1)
        for q, a in zip(asked, answers):
            (token,) = a.tokens
            records.append(
                {
                    "document": q.document,
                    "question": q.index,
                    "prompt_tokens": len(q.prompt),
                    "key": chr(q.prompt[-1]),
                    "fact": fact_name(q.answer),
                    "distance": q.distance,
                    "answer_token": q.answer,
                    "generated_token": token,
                    "generated_fact": fact_name(token),
                    "correct": token == q.answer,
                }
            )
    return records


def recall_by_shards(records: Sequence[dict], seq_len: int, cp: int) -> dict[str, float]:
    """``recall`` over all records and, for ``cp > 1``, the trainer's ``recall_shards_<k>`` and
    ``recall_remote`` (:func:`titan_cp.metrics.shard_recall_metrics`) for shards of ``seq_len / cp``."""
    correct = torch.tensor([r["correct"] for r in records])
    distance = torch.tensor([r["distance"] for r in records])
    pred, labels = correct.long(), torch.ones_like(distance)  # a correct answer is one label hit
    out = {"recall": correct.double().mean().item()}
    if cp > 1:
        out.update(shard_recall_metrics(recall_counts(pred, labels, distance, shard_edges(seq_len, cp))))
    return out
