"""Sequence layouts: shard/unshard round trips, the zigzag chunk rule, document balance,
positions and document ids, and clear errors for bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import doc_row, layout_shape
from titan_cp import SequenceLayout, doc_local
from titan_cp.layout import get_layout


@st.composite
def layouts(draw):
    cp, balance, seq_len = layout_shape(draw, max_cp=8, max_chunks=12)
    docs = [doc_row(draw, seq_len) for _ in range(draw(st.integers(1, 3)))] if draw(st.booleans()) else None
    return SequenceLayout(seq_len, cp, balance, docs)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_shard_unshard_round_trip_and_partition(layout):
    batch = layout.batch_size or 2
    x = torch.arange(batch * layout.seq_len * 3).view(batch, layout.seq_len, 3)
    shards = [layout.shard(x, 1, r) for r in range(layout.cp_size)]
    assert all(s.shape == (batch, layout.local_len, 3) for s in shards)
    assert torch.equal(layout.unshard(shards, 1), x)
    # every position is held by exactly one rank
    for b in range(batch):
        held = torch.cat([layout.positions(r)[b if layout.batch_size else 0] for r in range(layout.cp_size)])
        assert sorted(held.tolist()) == list(range(layout.seq_len))


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_positions_and_doc_ids_follow_the_tokens(layout):
    rows = layout.doc_lens or [(layout.seq_len,)]
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])
    doc_pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    ranks = range(layout.cp_size)
    for r in ranks:
        pos = layout.positions(r)
        assert torch.equal(layout.doc_ids(r), ids.gather(1, pos))
        assert torch.equal(layout.doc_positions(r), doc_pos.gather(1, pos))
    # shard -> unshard gives back the original positions and document ids
    assert torch.equal(layout.unshard([layout.positions(r) for r in ranks], 1)[0], torch.arange(layout.seq_len))
    assert torch.equal(layout.unshard([layout.doc_positions(r) for r in ranks], 1), doc_pos)
    assert torch.equal(layout.unshard([layout.doc_ids(r) for r in ranks], 1), ids)


def test_zigzag_rank_holds_chunks_r_and_2n_minus_1_minus_r():
    layout = SequenceLayout(16, 4, "zigzag")
    assert layout.index(0).tolist() == [0, 1, 14, 15]
    assert layout.index(1).tolist() == [2, 3, 12, 13]
    assert layout.index(3).tolist() == [6, 7, 8, 9]
    assert SequenceLayout(8, 2, "contiguous").index(1).tolist() == [4, 5, 6, 7]


def test_doc_zigzag_splits_each_document_head_tail_without_padding():
    layout = SequenceLayout(24, 2, "doc_zigzag", [[16, 5, 3]])
    # 16 tokens -> 4 pieces of 4: rank 0 gets pieces 0 and 3, rank 1 pieces 1 and 2
    assert layout.index(0)[:8].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert layout.index(1)[:8].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # documents shorter than 2N still land somewhere, and each rank holds exactly S/N tokens
    assert layout.index(0).numel() == layout.index(1).numel() == 12


@pytest.mark.parametrize(
    "args,match",
    [
        ((10, 4, "contiguous"), "not divisible by 4"),
        ((12, 4, "zigzag"), "not divisible by 8"),
        ((8, 0, "zigzag"), "cp_size"),
        ((8, 2, "stripes"), "unknown load balancer .stripes.; choose one of"),
        ((8, 2, "doc_zigzag", [[4, 3]]), "row 0 sums to 7, but seq_len is 8"),
        ((8, 2, "doc_zigzag", [[4, 4], [8, 0]]), "row 1 has a document of length 0"),
        ((8, 2, "doc_zigzag", [[4, 5, -1]]), "length -1"),
        ((8, 2, "doc_zigzag", []), "got no rows"),
        ((8, 2, "doc_zigzag", [4, 4]), r"one list of document lengths per batch row \(e.g. \[\[3, 5\]\]\); row 0 is 4"),
        ((8, 2, "doc_zigzag", torch.tensor([[4.0, 4.0]])), "must hold integers"),
        ((8, 2, "doc_zigzag", torch.tensor([[4, 0, 4]])), "zero-length document before its last document"),
        ((8, 2, "doc_zigzag", [[4, 3.5, 0.5]]), "length 3.5"),
    ],
)
def test_bad_layouts(args, match):
    with pytest.raises(ValueError, match=match):
        SequenceLayout(*args)


def test_shard_and_unshard_errors():
    layout = SequenceLayout(8, 2, "doc_zigzag", [[3, 5], [8]])
    with pytest.raises(ValueError, match="batch size 3 does not match the layout's 2 doc_lens rows"):
        layout.shard(torch.zeros(3, 8), 1, 0)
    with pytest.raises(ValueError, match="cannot shard dim 1 of size 6"):
        layout.shard(torch.zeros(2, 6), 1, 0)
    with pytest.raises(ValueError, match="needs 2 local tensors"):
        layout.unshard([torch.zeros(2, 4)], 1)
    with pytest.raises(ValueError, match="out of range"):
        layout.index(2)
    with pytest.raises(ValueError, match=r"dim 5 is out of range for a 2-D tensor"):
        layout.shard(torch.zeros(2, 8), 5, 0)
    with pytest.raises(ValueError, match=r"dim -3 is out of range"):
        layout.unshard([torch.zeros(2, 4)] * 2, -3)


def test_get_layout_takes_doc_lens_from_the_host_only():
    """A device tensor would be read (a device synchronisation) in every layer."""
    with pytest.raises(ValueError, match="doc_lens must be a CPU tensor, got one on meta"):
        get_layout(8, 2, "doc_zigzag", torch.zeros(1, 2, dtype=torch.long, device="meta"))
    rows = torch.tensor([[3, 5]])
    assert get_layout(8, 2, "doc_zigzag", rows) is get_layout(8, 2, "doc_zigzag", rows)
    rows[0, 0], rows[0, 1] = 5, 3  # changed in place: recognised by its version, not its identity
    assert get_layout(8, 2, "doc_zigzag", rows).doc_lens == ((5, 3),)


def test_doc_lens_tensor_form_matches_lists():
    rows = [[3, 5], [8]]
    padded = torch.tensor([[3, 5], [8, 0]])
    a, b = SequenceLayout(8, 2, "doc_zigzag", rows), SequenceLayout(8, 2, "doc_zigzag", padded)
    assert torch.equal(a.index(1), b.index(1))


@pytest.mark.parametrize("cp", [2, 3, 4, 5, 6, 7, 8])
def test_doc_local_balances_every_mix(cp):
    """doc_local keeps each rank's causal work within 5% of the mean on every mix of bench_balance."""
    from benchmarks.balance import rank_pairs
    from titan_cp.data.row_mixes import BALANCE_MIXES, make_rows

    seq = 16384 - 16384 % cp
    for mix in BALANCE_MIXES:
        for row in make_rows(mix, seq, 2):
            work = rank_pairs(SequenceLayout(seq, cp, "doc_local", [row])).double()
            assert work.max() / work.mean() <= 1.05, (mix, cp, row)


def test_doc_local_keeps_short_documents_whole():
    """On documents of mean length 1K at 131072 tokens and CP 8, most documents live on one rank (so
    their K/V never travel), and the layout depends on doc_lens alone."""
    from titan_cp.data.row_mixes import lognormal_doc_lens

    lens = lognormal_doc_lens(131072, 1024, seed=1024)
    layout = SequenceLayout(131072, 8, "doc_local", [lens])
    ranks_of = [set() for _ in lens]
    for r in range(8):
        for d in layout.doc_ids(r)[0].tolist():
            ranks_of[d].add(r)
    whole = sum(len(s) == 1 for s in ranks_of)
    assert whole >= 0.9 * len(lens), (whole, len(lens))
    again = SequenceLayout(131072, 8, "doc_local", [list(lens)])
    assert all(torch.equal(layout.index(r), again.index(r)) for r in range(8))


def test_doc_local_cuts_a_split_document_at_whole_kernel_blocks_where_that_sends_nothing_more():
    """A 20,588-token document among mean-1K ones (seed 8) is split over every rank. Cut evenly, each of
    its 16 pieces ended in a partly empty 128-token block, and every tile between two pieces paid for it
    (the row's kernel blocks 9.4% over one call's); cut at whole blocks, every piece but the last is a
    multiple of 128 and the row's blocks are within 0.2% of one call's. No rank sends more than under
    the cheapest even cut, as the ring and as the all-gather count."""
    from titan_cp.data.row_mixes import lognormal_doc_lens

    lens = lognormal_doc_lens(131072, 1024, seed=8, sigma=1.0)
    fill = doc_local._choose(list(lens), 8)
    (pieces,) = [sorted(p, key=lambda x: x[1]) for p in fill.docs.values() if len(p) == 16]
    assert all(n % doc_local.BLOCK == 0 for _, _, n in pieces[:-1]) and sum(n for _, _, n in pieces) == 20588

    def blocks(pieces_of_each_doc) -> int:  # every piece's tiles on itself and its document's earlier pieces
        return sum(
            doc_local.block_work(n, [m for _, o2, m in doc if o2 < o]) for doc in pieces_of_each_doc for _, o, n in doc
        )

    one_call = sum(doc_local.block_work(n) for n in lens)
    assert blocks(fill.docs.values()) <= 1.002 * one_call
    even = doc_local._fill(list(lens), 8, 0.25, 0.25, "even")
    assert blocks(even.docs.values()) >= 1.05 * one_call  # the even cut of the same assignment
    assert all(a <= b for a, b in zip(fill.sends(), even.sends()))


@pytest.mark.parametrize("mean,sigma,seed,window", [(4096, 1.8, 4, None), (1024, 1.0, 23, 1024), (256, 1.2, 8, 128)])
def test_doc_local_counts_the_rows_the_exchange_sends(mean, sigma, seed, window):
    """The layout's send guard counts exactly the K/V rows the exchanges send, causal and under a window (each
    token to every other rank holding later tokens of its document that it can see), and the gradients
    they send back of the rows they read; the all-gather's gradients go home in fp32, twice the bytes of
    16-bit K/V, and its count is exactly its bytes. On the long-tail row of seed 4, a guard counting those
    gradients once kept a blocked cut whose all-gather sent 2.6% more than the even cut: 1,030,250,496
    bytes against 1,003,683,840 on its busiest rank."""
    from titan_cp.attention.pricing import AttentionCall, exchanged_rows, ring_bytes
    from titan_cp.attention.tiling import Mask
    from titan_cp.data.row_mixes import lognormal_doc_lens

    lens = lognormal_doc_lens(131072, mean, seed=seed, sigma=sigma)
    layout = SequenceLayout(131072, 8, "doc_local", [list(lens)])
    rows = [exchanged_rows(layout, r, 8, 1, Mask(window=window), 1) for r in range(8)]
    q = torch.empty(1, 8, 131072 // 8, 128, dtype=torch.bfloat16, device="meta")
    k = AttentionCall.of(q, q, 8)  # the bytes of one K/V row at these shapes
    gather = max(ring_bytes(k, s, g, True, resend=False) for s, g in rows)
    sends = doc_local._choose(list(lens), 8).sends(window)
    assert sends == (max(s + g for s, g in rows), gather // ring_bytes(k, 1, 0, backward=False))
    if window is None and seed == 4:
        assert gather <= 1_003_683_840


def test_doc_local_of_two_near_costs_keeps_the_one_sending_no_more_under_windows():
    """The layout is made before any layer's mask is known. On mean-1K documents of seed 23, two blocked cuts
    of one assignment cost within 0.3% of each other; the cheaper sent more than the even cut under windows
    of 128 to 1,024 keys (the ring's busiest rank under a 1,024 window: 34,545,664 bytes against
    33,890,304). Of costs that close, the layout keeps the one sending no more under any window
    (33,394,688 bytes), and still no more than the even cut under causal masks."""
    from titan_cp.data.row_mixes import lognormal_doc_lens

    lens = lognormal_doc_lens(131072, 1024, seed=23, sigma=1.0)
    fill, even = doc_local._choose(list(lens), 8), doc_local._fill(list(lens), 8, 0.5, 0.5, "even")
    assert fill.pieces != even.pieces and max(fill.rank_costs()) < max(even.rank_costs())
    for reach in doc_local.REACHES:
        assert all(a <= b for a, b in zip(fill.sends(reach), even.sends(reach))), reach


def test_doc_local_sets_its_send_cap_by_the_even_cut_sending_least_under_windows():
    """On mean-1K documents of seed 3, two even cuts cost within 0.2% of each other; the cheaper sends 1.8x
    the rows of the other under a 1,024 window. Capping sends by it, the ring's busiest rank under that
    window sent 32,608,256 bytes; capped by the even cut nearest the least under every window, 13,963,264,
    under the 18,489,344 the engine of 2026-11-30 sent."""
    from titan_cp.attention.pricing import AttentionCall, exchanged_rows, fp32_returned_rows, ring_bytes
    from titan_cp.attention.tiling import Mask
    from titan_cp.data.row_mixes import lognormal_doc_lens

    layout = SequenceLayout(131072, 8, "doc_local", [lognormal_doc_lens(131072, 1024, seed=3, sigma=1.0)])
    q = torch.empty(1, 8, 131072 // 8, 128, dtype=torch.bfloat16, device="meta")
    k = AttentionCall.of(q, q, 8)  # the bytes of one K/V row at these shapes
    window, ranks = Mask(window=1024), 1
    sent = max(
        ring_bytes(
            k,
            *exchanged_rows(layout, r, 8, ranks, window, 1),
            True,
            fp32=fp32_returned_rows(layout, r, 8, ranks, window, 1),
        )
        for r in range(8)
    )
    assert sent <= 18_489_344, sent


def test_doc_local_rows_kept_by_value_equal_a_fresh_search_and_are_the_callers_to_change():
    lens = [300, 50, 700, 2, 996]
    first = doc_local.doc_local_pieces(lens, 4)
    first[0].append((0, 0))  # a caller's change does not reach the kept row
    fresh = [list(rank) for rank in doc_local._pieces(tuple(lens), 4)]
    assert doc_local.doc_local_pieces(lens, 4) == fresh == [p for p in doc_local.doc_local_pieces(list(lens), 4)]
    big = [1] * (doc_local.MEMO_DOCS + 2)  # past the kept size: searched each time, the same answer
    assert doc_local.doc_local_pieces(big, 2) == [list(rank) for rank in doc_local._pieces(tuple(big), 2)]
