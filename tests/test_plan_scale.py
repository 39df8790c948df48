"""The planner's compact layout arithmetic against the per-token definitions it replaces: a layout's
runs computed from its ranks' spans and the documents (``SequenceLayout.runs``) equal the runs of
the per-token positions (``layout._runs``), and a mask's tiles' key / query row counts from its tiles
equal the lengths of its per-token row sets; for every balance, cp degree, document mix, chunked
and windowed masks."""

from __future__ import annotations

import random

import torch

from titan_cp.attention.tiling import Mask, tile_mask
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
                    tiles = tile_mask(layout, (i,), None if j is None else (j,), mask)
                    assert tiles.key_row_count(2) == len(tiles.key_rows(2))
                    assert tiles.query_row_count(2) == len(tiles.query_rows(2))
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


def test_max_seq_estimates_time_once_per_plan_that_can_matter(monkeypatch):
    """The longest row is bisected on memory alone (whether a plan fits never depends on its time): each
    plan's time is estimated once, at the length found, and only for the plans that fit there (at the start:
    4,928 estimates on 64 GPUs, every plan at every escalation level of 16 lengths; then 88, every plan once),
    and the answer is the one it was. 64 GPUs on one node here: on 8 nodes of 8 (the default) each node's
    host memory serves 8 ranks' offloads, and the longest row is the cap, 2**24."""
    from titan_cp.config import load_config  # noqa: PLC0415
    from titan_cp.plan import search  # noqa: PLC0415

    calls = []
    evaluate = search.evaluate
    monkeypatch.setattr(search, "evaluate", lambda c, *a: calls.append(c) or evaluate(c, *a))
    argv = ["--model.flavor", "8B", "--training.local_batch_size", "1", "--training.global_batch_size", "1"]
    cfg = load_config([*argv, "--activation_checkpoint.mode", "full"])
    n, result = search.max_seq_len(cfg, 64, "h100", nnodes=1)
    c = result.best.candidate
    assert (n, c.strategy, c.cp, c.dp_shard, c.tp, c.pp) == (12_124_160, "ring", 64, 1, 1, 1)
    assert len(calls) == len(set(calls)) == len(result.estimates) == 12
    assert result.skipped.no_fit == 10 and result.skipped.bounded == 0
    assert search.max_seq_len(cfg, 64, "h100")[0] == 2**24


def test_causal_counts_in_closed_form_equal_the_plans():
    from titan_cp.attention.tiling import CAUSAL, causal_counts  # noqa: PLC0415

    checked = 0
    for layout in _layouts():
        cp = layout.cp_size
        groups = [None, *((r,) for r in range(cp)), tuple(range(cp))]
        for q in groups:
            for k in groups:
                tiles = tile_mask(layout, q, k, CAUSAL)
                want = (tiles.pairs(2), tiles.query_row_count(2), tiles.key_row_count(2))
                assert causal_counts(layout, q, k, 2) == want, (layout.balance, cp, q, k)
                checked += 1
    assert checked > 200


# ---- closed forms of the one-document zigzag (the planner at tens of thousands of ranks) -----------------


def test_doc_local_of_one_document_is_what_choose_keeps():
    """``doc_local`` on one document of a multiple of 2N tokens keeps the even zigzag without trying its
    assignments (each costs N^2 on one document: 65,536 GPUs' layouts never finished, and one of 131,072
    tokens over 1,024 ranks took 9 minutes): equal to ``_choose``, for pieces of whole kernel blocks and not."""
    from titan_cp import doc_local  # noqa: PLC0415

    block = doc_local.BLOCK
    for n in (2, 3, 4, 5, 8, 12, 16, 32):
        for c in (block, 2 * block, 3 * block, 5 * block, 1, 3, block // 2, block - 1, block + 1, 3 * block // 2):
            length = 2 * n * c
            want = [sorted(p) for p in doc_local._choose([length], n).pieces]
            assert doc_local.doc_local_pieces([length], n) == want, (n, length)
            assert SequenceLayout(length, n, "doc_local", [[length]]).zigzag_chunk() == c


def _general(monkeypatch):
    """The general per-pair code: no layout is taken for the closed form's."""
    from titan_cp import layout as layout_module  # noqa: PLC0415
    from titan_cp.plan.cost import attention_work  # noqa: PLC0415

    monkeypatch.setattr(SequenceLayout, "zigzag_chunk", lambda self: None)
    layout_module._layout.cache_clear()
    attention_work.cache_clear()


def test_zigzag_closed_forms_equal_the_general_counts(monkeypatch):
    """On the even zigzag of one document a row every group's counts on every other group come in closed form:
    the pairs, query and key rows of each pair of Ulysses groups and whether its keys' gradients go home in
    fp32 (``zigzag_counts``), what each ring rank sends, receives and gets back in fp32, and the planner's
    pairs and merged rows per ring step equal the mask tiles' (for zigzag, doc_local and doc_zigzag, one
    and two rows, chunks of one token to several blocks)."""
    from titan_cp import layout as layout_module  # noqa: PLC0415
    from titan_cp.attention.pricing import exchanged_rows, fp32_returned_rows  # noqa: PLC0415
    from titan_cp.attention.ring import read_once  # noqa: PLC0415
    from titan_cp.attention.tiling import CAUSAL, causal_counts, tile_mask, zigzag_counts  # noqa: PLC0415
    from titan_cp.plan.cost import attention_work  # noqa: PLC0415

    cases = [("zigzag", n, c, rows) for n in (2, 3, 4, 6, 8) for c in (1, 3, 200) for rows in (None, 1, 2)]
    cases += [
        (b, n, c, rows) for b in ("doc_local", "doc_zigzag") for n in (2, 4, 6) for c in (128, 256) for rows in (1, 2)
    ]
    closed, checked = {}, 0
    for balance, n, c, rows in cases:
        seq = 2 * n * c
        doc_lens = None if rows is None else [[seq]] * rows
        layout = SequenceLayout(seq, n, balance, doc_lens)
        assert layout.zigzag_chunk() == c, (balance, n, c)
        for u in (d for d in range(1, n + 1) if n % d == 0):
            ring, group = n // u, lambda g: tuple(range(g * u, (g + 1) * u))  # noqa: B023
            for g in range(ring):
                for h in range(ring):
                    tiles = tile_mask(layout, group(g), group(h), CAUSAL)
                    fp32 = None if g == h else read_once(tiles, 2) == "fp32"
                    assert zigzag_counts(layout, g, h, u, 2) == (*causal_counts(layout, group(g), group(h), 2), fp32)
                    checked += 1
            key = (balance, n, c, rows, u)
            closed[key] = [
                (exchanged_rows(layout, g, ring, u, CAUSAL, 2), fp32_returned_rows(layout, g, ring, u, CAUSAL, 2))
                for g in range(ring)
            ]
            closed[key].append(attention_work(seq, n, ring, u, balance, ((seq,),) * (rows or 2)))
    assert checked > 1000
    _general(monkeypatch)
    for (balance, n, c, rows, u), want in closed.items():
        layout, ring, seq = (
            SequenceLayout(2 * n * c, n, balance, None if rows is None else [[2 * n * c]] * rows),
            n // u,
            2 * n * c,
        )
        got = [
            (exchanged_rows(layout, g, ring, u, CAUSAL, 2), fp32_returned_rows(layout, g, ring, u, CAUSAL, 2))
            for g in range(ring)
        ]
        got.append(attention_work(seq, n, ring, u, balance, ((seq,),) * (rows or 2)))
        assert got == want, (balance, n, c, rows, u)
    layout_module._layout.cache_clear()
    attention_work.cache_clear()


def test_the_planner_counts_a_one_document_ring_of_4096_ranks_without_a_pair_of_ranks(monkeypatch):
    """The planner's per-pair counts on one document of 2^24 tokens over 4,096 ranks (ring, all-gather and
    hybrid) come from a few pairs, not from every pair of ranks (16.8 million tiles or closed-form counts of
    each strategy), and the layout is made without trying assignments."""
    import torch  # noqa: PLC0415

    from titan_cp import doc_local  # noqa: PLC0415
    from titan_cp.attention import tiling  # noqa: PLC0415
    from titan_cp.attention.pricing import AttentionCall, cost_of  # noqa: PLC0415
    from titan_cp.layout import get_layout  # noqa: PLC0415
    from titan_cp.plan.cost import attention_work  # noqa: PLC0415

    calls = []

    def counted(f):
        def inner(*a, **k):
            calls.append(f.__name__)
            assert len(calls) < 10_000, "a count per pair of ranks"
            return f(*a, **k)

        return inner

    for name in ("tiles_of_runs", "_run_counts"):  # a mask's tiles, a closed-form count: each of a pair of groups
        monkeypatch.setattr(tiling, name, counted(getattr(tiling, name)))

    def choose(*a):
        raise AssertionError("the layout of one document tried its assignments (each N^2)")

    monkeypatch.setattr(doc_local, "_choose", choose)
    seq, n = 2**24, 4096
    attention_work.cache_clear()
    work = attention_work(seq, n, n // 2, 2, "doc_local", ((seq,),))
    assert len(work.steps) == n // 2 and work.total == seq * (seq + 1) // 2
    layout = get_layout(seq, n, "doc_local", [[seq]])
    q = torch.empty(1, 8, seq // n, 128, dtype=torch.bfloat16, device="meta")
    for name, u in (("ring", 1), ("allgather", 1), ("hybrid", 2)):
        assert cost_of(name).min_bytes(AttentionCall.of(q, q, n, u, layout)) > 0
    assert len(calls) <= 8, calls
    attention_work.cache_clear()
