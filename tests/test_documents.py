"""Packed documents under CP: every strategy and balance against the fp64-computed dense
reference with the document mask, on random document layouts (hypothesis), at world
sizes 1, 2, 3, 4; and no leakage: changing one document changes nothing in any other.

Tolerance as in test_attention.py: fp32 summation order only, 5e-5.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.dist_utils import cp_mesh, make_inputs, max_errors, run_case
from titan_cp import SequenceLayout, cp_attention
from titan_cp.attention import CPHandle
from titan_cp.attention.ring import merged_query_rows
from titan_cp.attention.tiling import CAUSAL, Mask
from titan_cp.attention.ulysses import stays_home

SEQ = 48
TOL = 5e-5
BALANCES = ("contiguous", "zigzag", "doc_zigzag", "doc_local")
HEADS = {1: (4, 2), 2: (4, 2), 3: (6, 3), 4: (8, 2)}  # (q heads, kv heads) that every strategy takes


@st.composite
def doc_row(draw, world):
    """One row of document lengths summing to SEQ, from the shapes that break CP masks."""
    kind = draw(st.sampled_from(["random", "tiny", "one_spanning", "shorter_than_2n", "single_tokens"]))
    if kind == "one_spanning":
        return [SEQ]
    if kind == "single_tokens":
        head = draw(st.integers(1, 8))
        return [1] * head + [SEQ - head]
    cap = {"random": SEQ, "tiny": 3, "shorter_than_2n": max(1, 2 * world - 1)}[kind]
    row, left = [], SEQ
    while left:
        n = draw(st.integers(1, min(cap, left)))
        row.append(n)
        left -= n
    return row


def _check(rank, world, cases):
    return [max_errors(*run_case(case, world)) for case in cases]


def _cases(strategy, world, ulysses, rows, causal, kernel=None):
    heads, kv_heads = HEADS[world]
    return [
        dict(
            strategy=strategy,
            ulysses=ulysses,
            seq=SEQ,
            batch=len(rows),
            heads=heads,
            kv_heads=kv_heads,
            causal=causal,
            balance=balance,
            doc_lens=rows,
            seed=len(rows[0]),
            kernel=kernel,
        )
        for balance in BALANCES
    ]


def _run_property(dist_pools, strategy, world, ulysses=1, kernel=None):
    @settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(rows=st.lists(doc_row(world), min_size=1, max_size=2), causal=st.booleans())
    def prop(rows, causal):
        cases = _cases(strategy, world, ulysses, rows, causal, kernel)
        for r, results in enumerate(dist_pools.run(world, _check, cases)):
            for case, errs in zip(cases, results):
                assert all(e <= TOL for e in errs.values()), (r, case, errs)

    prop()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_documents_match_dense_reference(dist_pools, strategy, world):
    _run_property(dist_pools, strategy, world)


@pytest.mark.parametrize("world,ulysses", [(2, 2), (3, 1), (4, 2)])
def test_documents_hybrid(dist_pools, world, ulysses):
    _run_property(dist_pools, "hybrid", world, ulysses)


@pytest.mark.parametrize("strategy,world", [("ring", 2), ("allgather", 3), ("ulysses", 4)])
def test_documents_through_the_packed_varlen_route(dist_pools, strategy, world):
    """The packing of all tiles into one variable-length call (flash-attn's route on CUDA)."""
    _run_property(dist_pools, strategy, world, kernel="cpu_varlen_loop")


def _leakage(rank, world, strategy, ulysses, balance):
    """Perturb document 1 of row 0; outputs and grads of every other document must not move at all."""
    rows = [[5, 17, 1, 25], [48]]
    mesh = cp_mesh(strategy, world, ulysses)
    r = CPHandle(mesh, strategy).rank
    layout = SequenceLayout(SEQ, world, balance, rows)
    heads, kv_heads = HEADS[world]
    q, k, v, dout = make_inputs(3, 2, heads, kv_heads, SEQ, 8)
    results = []
    for perturb in (False, True):
        qq, kk, vv = q.clone(), k.clone(), v.clone()
        if perturb:
            for t in (qq, kk, vv):
                t[0, :, 5:22] += 10.0 * torch.randn_like(t[0, :, 5:22])
        ql, kl, vl = (layout.shard(x, 2, r).requires_grad_() for x in (qq, kk, vv))
        out = cp_attention(ql, kl, vl, mesh, layout, strategy=strategy)
        grads = torch.autograd.grad(out, (ql, kl, vl), layout.shard(dout, 2, r))
        results.append([out, *grads])
    untouched = layout.doc_ids(r) != 1
    untouched[1] = True  # row 1 is all one other document
    moved = [(a - b).abs().amax(dim=(1, 3))[untouched].max().item() for a, b in zip(*results)]
    changed = [
        (a - b).abs().amax(dim=(1, 3))[~untouched].max().item() if (~untouched).any() else 1.0 for a, b in zip(*results)
    ]
    return moved, changed


@pytest.mark.parametrize(
    "strategy,world,ulysses", [("ring", 3, 1), ("allgather", 4, 1), ("ulysses", 2, 1), ("hybrid", 4, 2)]
)
@pytest.mark.parametrize("balance", ["zigzag", "doc_zigzag"])
def test_no_leakage_across_documents(dist_pools, strategy, world, ulysses, balance):
    any_changed = False
    for moved, changed in dist_pools.run(world, _leakage, strategy, ulysses, balance):
        assert moved == [0.0, 0.0, 0.0, 0.0], moved  # bit-identical outside the perturbed document
        any_changed |= min(changed) > 0
    assert any_changed  # and the perturbation did reach the document it touched


# ---------------------------------------------------------------------------- head exchanges with documents
HEAD_EXCHANGES = [("ulysses", 1, 1), ("ulysses", 2, 1), ("ulysses", 3, 1), ("ulysses", 4, 1), ("hybrid", 2, 2)]
HEAD_EXCHANGES += [("hybrid", 3, 1), ("hybrid", 4, 2)]
SCHEDULE_CASES = [  # (doc rows, balance, mask): short documents, one spanning the row, two rows, masks
    ([[5, 17, 3, 9, 14]], "doc_local", dict(causal=True, sinks=True)),
    ([[48]], "zigzag", dict(causal=True)),
    ([[30, 18], [7, 7, 34]], "doc_zigzag", dict(causal=False)),
    ([[20, 28]], "doc_local", dict(causal=True, window=6)),
    ([[48]], "doc_local", dict(causal=True, chunk=10, sinks=True)),
]


def _schedules(rank, world, strategy, ulysses, home_merges):
    """Every case under ``HOME_MERGES = home_merges`` (-1: the head exchange always, inf: the ring's
    schedule always, None: as the layout decides); the schedule each took, and the errors."""
    from titan_cp.attention import ulysses as module

    saved = module.HOME_MERGES
    if home_merges is not None:
        module.HOME_MERGES = home_merges
    try:
        heads, kv_heads = HEADS[world]
        results = []
        for i, (rows, balance, mask) in enumerate(SCHEDULE_CASES):
            case = dict(strategy=strategy, ulysses=ulysses, seq=SEQ, batch=len(rows), heads=heads, kv_heads=kv_heads)
            case.update(balance=balance, doc_lens=rows, seed=i, **mask)
            layout = SequenceLayout(SEQ, world, balance, rows)
            tile_mask_of_case = Mask(mask["causal"], mask.get("window"), mask.get("chunk"))
            results.append(
                (module.stays_home(layout, tile_mask_of_case, len(rows)), max_errors(*run_case(case, world)))
            )
        return results
    finally:
        module.HOME_MERGES = saved


@pytest.mark.parametrize("strategy,world,ulysses", HEAD_EXCHANGES)
def test_head_exchanges_with_documents_match_the_reference_on_either_schedule(dist_pools, strategy, world, ulysses):
    """Ulysses and hybrid with documents run the ring's schedule where documents stay home and exchange
    heads elsewhere (keeping only a ring's tensors, the head shards sent again in the backward): each
    schedule, forced and as the layout chooses, matches the fp64 reference, forward and every gradient
    (the sinks' included), on short documents, two rows, windows and chunks; a row of one document
    (``doc_lens`` one column wide) runs the plain head exchange, and matches it too."""
    for home_merges, expect in ((-1.0, False), (float("inf"), True), (None, None)):
        for results in dist_pools.run(world, _schedules, strategy, ulysses, home_merges):
            for (home, errs), case in zip(results, SCHEDULE_CASES):
                assert all(e <= TOL for e in errs.values()), (home_merges, case, errs)
                assert expect is None or home == expect, (home_merges, case)


def test_the_layout_chooses_the_schedule_by_what_the_ring_would_merge():
    """Short documents kept whole by ``doc_local`` stay home; one document over four ranks (each query
    merging two or three ranks' partials) exchanges heads; a split document over two ranks stays home."""
    short = SequenceLayout(4096, 4, "doc_local", [[64] * 64])
    long = SequenceLayout(4096, 4, "zigzag", [[4096]])
    pair = SequenceLayout(4096, 2, "zigzag", [[4096]])
    assert stays_home(short, CAUSAL, 1) and not stays_home(long, CAUSAL, 1) and stays_home(pair, CAUSAL, 1)
    assert sum(merged_query_rows(long, r, CAUSAL, 1) for r in range(4)) == 9 * 4096 // 4  # 18 of 8 pieces


def _saved_form(rank, world, strategy, ulysses, rows):
    """What the op saves for the backward on ``rows`` (the number of tensors beyond q, k, v, out)."""
    from titan_cp.attention import api

    mesh = cp_mesh(strategy, world, ulysses)
    layout = SequenceLayout(SEQ, world, "doc_local", rows)
    heads, kv_heads = HEADS[world]
    cp = CPHandle(mesh, strategy, layout.balance)
    q, k, v, _ = (layout.shard(x, 2, cp.rank) for x in make_inputs(0, len(rows), heads, kv_heads, SEQ, 8))
    _, doc_lens = cp.register(SEQ, layout.doc_lens)
    ctx, module = api._context(cp.id, q, k.shape[1], doc_lens, True, 0.35)
    return len(module.forward(ctx, q, k, v)[1]), module.kept(ctx.documents)


@pytest.mark.parametrize("strategy,ulysses", [("ulysses", 1), ("hybrid", 2)])
def test_one_document_a_row_keeps_the_head_shards(dist_pools, strategy, ulysses):
    """A ``doc_lens`` of one document a row is the causal row itself: the head exchange keeps its head
    shards (nothing sent again in the backward, no copy of q, k, v, out kept), as without ``doc_lens``;
    with several documents a row it keeps what a ring keeps."""
    for rows, form in (([[SEQ]], (4, ())), ([[SEQ], [SEQ]], (4, ())), ([[20, 28]], (1, ("q", "k", "v", "out")))):
        for saved, kept in dist_pools.run(4, _saved_form, strategy, ulysses, rows):
            assert (saved, kept) == form, (rows, saved, kept)
