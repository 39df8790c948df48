"""benchmarks.recall_probe (what scripts/recall_probe.py prints): its documents ask exactly the
planted facts, the shared packer marks their answers, and a short run reports the fields its
summary promises."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import recall_probe as rp
from titan_cp.data.packing import IGNORE_INDEX, Packer


@pytest.mark.parametrize("facts,gap", [(1, 0), (8, 16), (12, 100)])
def test_document_answers_are_the_planted_values(facts, gap):
    source = rp.ProbeDocuments(facts, gap, seed=facts + gap)
    doc = source.document(3)
    tokens = doc.tokens
    assert tokens == source.document(3).tokens  # a document depends only on (seed, index)
    assert tokens[0] == rp.TOKENIZER.bos_id and len(doc.answer_spans) == facts
    planted = {tokens[1 + 3 * i]: tokens[2 + 3 * i] for i in range(facts)}
    assert len(planted) == facts and set(planted) <= set(rp.KEYS)
    assert tokens[1 + 3 * facts : 1 + 3 * facts + gap] == [rp.FILLER] * gap
    asked = []
    for (a, e), distance in zip(doc.answer_spans, doc.answer_distances):
        assert e == a + 1 and tokens[a - 2] == rp.QUESTION
        assert tokens[a] == planted[tokens[a - 1]]  # the answer is the value planted for the key
        assert tokens[a - distance] == tokens[a] and tokens[a - distance - 1] == tokens[a - 1]  # its fact
        asked.append(tokens[a - 1])
    assert sorted(asked) == sorted(planted)  # every fact asked once


def test_packed_rows_mark_exactly_the_answers():
    S = 300
    packer = Packer(rp.ProbeDocuments(facts=5, gap=40), S)
    for _ in range(4):
        row = packer.next_row()
        tokens, labels, marked = row.tokens, row.labels, row.recall_distance > 0
        assert marked.any() and (labels[marked] != IGNORE_INDEX).all()
        # each marked position holds a key right after a question mark, its label a value
        at = marked.nonzero().squeeze(1)
        assert (at > 0).all() and (tokens[at - 1] == rp.QUESTION).all()
        assert torch.isin(tokens[at], torch.tensor(rp.KEYS)).all()
        assert torch.isin(labels[at], torch.tensor(rp.VALUES)).all()
        # and every question whose fact lies in the same piece is marked
        starts = torch.tensor([0] + row.doc_lens[:-1]).cumsum(0)
        for i in (labels != IGNORE_INDEX).nonzero().squeeze(1).tolist():
            piece = int(starts[starts <= i].max())
            if i > piece and tokens[i - 1] == rp.QUESTION:
                fact = [j for j in range(piece, i - 1) if tokens[j] == tokens[i] and tokens[j + 1] == labels[i]]
                assert bool(marked[i]) == bool(fact), i


def test_short_run_reports_and_summary():
    lines = []
    settings = rp.ProbeSettings(steps=6, every=2, seq_len=256, gap=8)
    records = rp.run(settings, emit=lines.append)
    parsed = [json.loads(line) for line in lines]
    assert [r["step"] for r in parsed[:-1]] == [2, 4, 6] and parsed[:-1] == records
    for r in records:
        assert 0.0 <= r["recall"] <= 1.0 and r["chance"] == round(1 / 36, 4) and r["loss"] > 0
        assert r["answers"] > 0
    summary = parsed[-1]
    assert summary["steps"] == 6 and summary["gap"] == 8
    assert summary["final_recall"] == records[-1]["recall"]
    assert "steps_to_2x_chance" in summary


def test_steps_to_recall_pools_answers():
    rec = lambda step, recall, answers: {"step": step, "recall": recall, "answers": answers}  # noqa: E731
    # one lucky row of 50 answers does not count; a pooled 1000 answers at 0.06 does
    few = [rec(20 * i, 0.2 if i == 3 else 0.02, 50) for i in range(1, 10)]
    assert rp.steps_to_recall(few, 0.0556) is None
    many = [rec(20, 0.02, 500), rec(40, 0.02, 500), rec(60, 0.09, 500), rec(80, 0.09, 500)]
    assert rp.steps_to_recall(many, 0.0556) == 80  # at 60 the pool is 0.02·500 + 0.09·500 -> 0.055
    assert rp.steps_to_recall([rec(20, 0.5, 999)], 0.1) is None  # too few answers to judge


def test_bad_settings_name_the_setting():
    with pytest.raises(ValueError, match="facts must be in 1..12"):
        rp.ProbeSettings(facts=13)
    with pytest.raises(ValueError, match="gap must be >= 0"):
        rp.ProbeSettings(gap=-1)
    with pytest.raises(ValueError, match="every must be >= 1"):
        rp.ProbeSettings(every=0)


def test_answers_only_trains_on_the_answers():
    """``answers_only``: the packed rows' only targets are the answers."""
    row = Packer(rp.ProbeDocuments(facts=6, gap=10, answers_only=True), 300).next_row()
    targets = row.labels != IGNORE_INDEX
    assert targets.any() and torch.equal(targets, row.recall_distance > 0)
    assert (Packer(rp.ProbeDocuments(facts=6, gap=10), 300).next_row().labels != IGNORE_INDEX).sum() > targets.sum()
