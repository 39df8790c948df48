"""The planner's compact layout arithmetic against the per-token definitions it replaces: a layout's
runs computed from its ranks' spans and the documents (``SequenceLayout.runs``) equal the runs of
the per-token positions (``layout._runs``), and a mask plan's key / query row counts from its tiles
equal the lengths of its per-token row sets; for every balance, cp degree, document mix, chunked
and windowed masks."""

from __future__ import annotations

import random

import torch

from titan_cp.attention.mask_plans import Mask, make_plan
from titan_cp.balance import balance_names
from titan_cp.layout import SequenceLayout, _runs


def _rows(rng: random.Random, seq: int, batch: int = 2) -> list[list[int]]:
    rows = []
    for _ in range(batch):
        lens, left = [], seq
        while left:
            lens.append(rng.randint(1, min(left, 20)))
            left -= lens[-1]
        rows.append(lens)
    return rows


def _layouts():
    rng = random.Random(0)
    for balance in balance_names():
        for cp in (2, 3, 4):
            seq = 48 if cp != 3 else 36
            for doc_lens in (_rows(rng, seq), None):
                try:
                    yield SequenceLayout(seq, cp, balance, doc_lens)
                except ValueError:
                    continue


def test_runs_from_spans_equal_the_per_token_runs():
    checked = 0
    for layout in _layouts():
        cp, seq = layout.cp_size, layout.seq_len
        for row in (0, 1):
            key = layout._key(row)
            lens = torch.tensor(layout._lens[key])
            doc_of = torch.repeat_interleave(torch.arange(len(lens)), lens)
            offset = torch.arange(seq) - (torch.cumsum(lens, 0) - lens)[doc_of]
            for chunk in (None, 4, 7):
                docs = doc_of if chunk is None else doc_of * (seq // chunk + 1) + offset // chunk
                orders = [None, *((r,) for r in range(cp)), tuple(range(cp)), tuple(reversed(range(cp)))]
                for ranks in orders:
                    pos = torch.arange(seq) if ranks is None else torch.cat([layout._index(key)[r] for r in ranks])
                    assert layout.runs(ranks, row, chunk) == _runs(pos, docs), (layout.balance, cp, ranks, chunk)
                    checked += 1
    assert checked > 200


def test_row_counts_from_tiles_equal_the_row_sets():
    checked = 0
    for layout in _layouts():
        cp = layout.cp_size
        if cp == 3:
            continue
        for mask in (Mask(), Mask(window=5), Mask(chunk=4)):
            for i in range(cp):
                for j in [*range(cp), None]:
                    plan = make_plan(layout, (i,), None if j is None else (j,), mask)
                    assert plan.key_row_count(2) == len(plan.key_rows(2))
                    assert plan.query_row_count(2) == len(plan.query_rows(2))
                    checked += 1
    assert checked > 200


# ---- the long-context options in the planner ---------------------------------------------------------


def test_planner_turns_the_options_on_when_nothing_fits_and_finds_the_longest_row(capsys):
    import json  # noqa: PLC0415

    from titan_cp.config import load_config  # noqa: PLC0415
    from titan_cp.plan.cli import main  # noqa: PLC0415
    from titan_cp.plan.search import plan  # noqa: PLC0415

    argv = ["--model.flavor", "8B", "--training.local_batch_size", "1", "--training.global_batch_size", "1"]
    at_2m = plan(load_config([*argv, "--training.seq_len", str(2**21)]), 8, "h100")
    best = at_2m.best.workload
    assert at_2m.recommended and best.ac == "full" and best.host.cpu_offload
    assert at_2m.best.host_bytes > 0 and "nothing fits as configured" in at_2m.reason
    main(["--ngpu", "8", "--gpu", "h100", "--model.flavor", "8B", "--max-seq"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 2  # the JSON row, then the line a person reads
    row = json.loads(lines[0])
    assert row["max_seq_len"] == row["seq_len"] >= 5_000_000 and row["fits"] and row["cpu_offload"]
    assert row["memory_bytes_per_rank"] <= 0.9 * 80e9 and row["host_bytes_per_node"] <= 0.9 * 2000e9
    # the longest row fits memory but a step takes hours: said plainly, with the step and the throughput
    step, tps = row["step_seconds"], row["tokens_per_second_per_gpu"]
    assert step > 3600 and row["practical"] is False
    assert f"one step takes {step:,.0f} s" in lines[1] and f"{tps:,.0f} tokens/s per GPU" in lines[1]
    assert "IMPRACTICAL" in lines[1] and f"{row['max_seq_len']:,} tokens" in lines[1]
    # less host memory: a shorter longest row, host-bound
    main(["--ngpu", "8", "--gpu", "h100", "--model.flavor", "8B", "--max-seq", "--host-gb", "500"])
    short = json.loads(capsys.readouterr().out.splitlines()[0])
    assert short["max_seq_len"] < row["max_seq_len"] and short["host_bytes_per_node"] <= 0.9 * 500e9


def test_max_seq_estimates_time_once_per_candidate(monkeypatch):
    """The longest row is bisected on memory alone (whether a plan fits never depends on its time): each
    candidate's time is estimated once, at the length found (at the start: 4,928 estimates on 64 GPUs,
    every candidate at every escalation level of 16 lengths), and the answer is the one it was."""
    from titan_cp.config import load_config  # noqa: PLC0415
    from titan_cp.plan import search  # noqa: PLC0415

    calls = []
    evaluate = search.evaluate
    monkeypatch.setattr(search, "evaluate", lambda c, *a: calls.append(c) or evaluate(c, *a))
    argv = ["--model.flavor", "8B", "--training.local_batch_size", "1", "--training.global_batch_size", "1"]
    n, result = search.max_seq_len(load_config([*argv, "--activation_checkpoint.mode", "full"]), 64, "h100")
    c = result.best.candidate
    assert (n, c.strategy, c.cp, c.dp_shard, c.tp, c.pp) == (12_124_160, "ring", 64, 1, 1, 1)  # as at the start
    assert len(calls) == len(set(calls)) == len(result.estimates) == 88


def test_causal_counts_in_closed_form_equal_the_plans():
    from titan_cp.attention.mask_plans import CAUSAL, causal_counts  # noqa: PLC0415

    checked = 0
    for layout in _layouts():
        cp = layout.cp_size
        groups = [None, *((r,) for r in range(cp)), tuple(range(cp))]
        for q in groups:
            for k in groups:
                plan = make_plan(layout, q, k, CAUSAL)
                want = (plan.pairs(2), plan.query_row_count(2), plan.key_row_count(2))
                assert causal_counts(layout, q, k, 2) == want, (layout.balance, cp, q, k)
                checked += 1
    assert checked > 200
