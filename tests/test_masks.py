"""The tiles a mask visits reproduce the dense causal/document mask exactly: every visible pair is
covered once, no invisible pair is covered, and no empty tile is emitted."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reference import dense_mask
from tests.strategies import doc_row, layout_shape
from titan_cp import SequenceLayout
from titan_cp.attention.tiling import tile_mask


@st.composite
def cases(draw):
    cp, balance, seq_len = layout_shape(draw, max_cp=6, max_chunks=10)
    docs = [doc_row(draw, seq_len)] if draw(st.booleans()) else None
    causal = draw(st.booleans())
    q_ranks = draw(st.one_of(st.none(), st.lists(st.integers(0, cp - 1), min_size=1, max_size=3, unique=True)))
    k_ranks = draw(st.one_of(st.none(), st.lists(st.integers(0, cp - 1), min_size=1, max_size=3, unique=True)))
    return SequenceLayout(seq_len, cp, balance, docs), causal, q_ranks, k_ranks


def _positions(layout, ranks):
    if ranks is None:
        return torch.arange(layout.seq_len)
    return torch.cat([layout.positions(r)[0] for r in ranks])


@settings(max_examples=300, deadline=None)
@given(cases())
def test_tiles_cover_exactly_the_visible_pairs(case):
    layout, causal, q_ranks, k_ranks = case
    truth = dense_mask(layout.seq_len, layout.doc_lens, causal, 1)[0, 0]
    qp, kp = _positions(layout, q_ranks), _positions(layout, k_ranks)
    want = truth[qp][:, kp].int()
    got = torch.zeros_like(want)
    for group in tile_mask(layout, q_ranks, k_ranks, causal).groups:
        for t in group.tiles:
            n, m = t.q1 - t.q0, t.k1 - t.k0
            assert n > 0 and m > 0
            if t.causal:
                assert n == m
                got[t.q0 : t.q1, t.k0 : t.k1] += torch.ones(n, m, dtype=torch.int).tril()
            else:
                got[t.q0 : t.q1, t.k0 : t.k1] += 1
    assert torch.equal(got, want)
