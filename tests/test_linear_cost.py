"""What a Gated DeltaNet layer does under CP, counted at full size (131072 tokens, CP 8, Qwen3-Next's heads, bf16)
on the meta device through titan_cp's own ops and ``fla`` metered (``benchmarks.linear_model``): the ``fla`` calls
(each piece once: those that start their document at ``d_v`` columns, the middle ones at ``d_v + d_k``, the last
ones at ``d_v`` from their composed states), the
bytes each exchange sends, the bytes autograd keeps, no host synchronisation; what crosses is the same at two
row lengths; and every rank of a crossing plan joins the exchange's backward.
Counts only: the time model's seconds are the benchmark's to report, never asserted."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from benchmarks.fake_cuda import HostSyncError
from benchmarks.linear_model import QWEN3_NEXT, FlaCall, critical, mix_rows, phases, simulate
from titan_cp.attention.linear.plan import StatePlan, rows_index
from titan_cp.data.row_mixes import lognormal_doc_lens
from titan_cp.integrations.hf_shapes import LinearShapes
from titan_cp.layout import DEFAULT_BALANCE, SequenceLayout
from titan_cp.plan import linear as lin
from titan_cp.testing.linear import every_late_middle

SEQ, CP, S = 131072, 8, QWEN3_NEXT
WIDE = S.d_v + S.d_k  # the middle pieces' value width: [v | 0] from [0 | I]


def _works(seq: int, cp: int, rows: list[list[int]] | None) -> tuple[lin.LinearWork, ...]:
    return lin.linear_work(seq, cp, DEFAULT_BALANCE, tuple(tuple(r) for r in rows or [[seq]]), S.conv, late=True)


def _expected_calls(work: lin.LinearWork) -> list[FlaCall]:
    """Forward: the pieces that start their document before the exchange at v's width, the middle ones at ``d_v +
    d_k``, then (after the exchange) the last ones and the late documents at v's width (each call where the rank
    has such pieces); backward in reverse."""
    given = any(later and c == 2 for later, c in zip(work.later, work.calls))  # a last piece's state, after it
    groups = ((work.before_lengths, S.d_v, False), (work.wide_lengths, WIDE, True), (work.after_lengths, S.d_v, given))
    calls = [(lengths, width, initial) for lengths, width, initial in groups if lengths]
    return [
        FlaCall(op, lengths, width, initial)
        for op, order in (("forward", 1), ("backward", -1))
        for lengths, width, initial in calls[::order]
    ]


@pytest.mark.parametrize("mix", ["docs_1k", "one_document", "one_document_late"])
def test_the_count_of_a_gated_deltanet_layer_at_full_size(mix):
    """The calls, FLOPs, bytes exchanged, collectives and bytes kept, counted, equal the planner's (``one_document_late``:
    every late middle piece placed: chains of two links and more start from its state)."""
    with every_late_middle() if mix.endswith("_late") else contextlib.nullcontext():
        _count_at_full_size(mix.removesuffix("_late"), late=mix.endswith("_late"))


def _count_at_full_size(mix: str, late: bool) -> None:
    rows = mix_rows(mix, SEQ)
    pairs, works = simulate(S, SEQ, CP, rows), _works(SEQ, CP, rows)  # a host sync would raise here
    if late:
        assert any(w.reads_own2 or w.reads_received2 for w in works)  # chains through a late middle's state
    assert [cp.rank for cp, _ in pairs] == list(range(CP))
    assert any(w.summarized for w in works) and all(sum(w.lengths) == SEQ // CP for w in works)
    assert any(sum(map(bool, (w.before_lengths, w.wide_lengths, w.after_lengths))) > 1 for w in works)  # two calls
    for (cp, alone), work in zip(pairs, works):
        assert cp.calls == _expected_calls(work), cp.rank
        added = cp.kernel_flops(S) - alone.kernel_flops(S)  # the wide pieces' d_k more columns, as priced
        assert added == pytest.approx(sum(lin.cp_flops(S, work)), rel=1e-12)
        assert (added > 0) == bool(work.wide_lengths)
        middles = [c for later, f, c in zip(work.later, work.followed, work.calls) if later and f]
        assert all(c in (1, 2) for c in middles) and middles.count(2) == work.late_middles  # wide, or late
        floor = lin.floor_flops(S, work)  # the least with one exchange (middle pieces' transitions)
        assert (floor[0] > 0) == bool(work.middle_lengths)
        if not any(w.late_middles for w in works):  # a second exchange trades a transition for a wait
            assert all(0 <= f <= a for f, a in zip(floor, lin.cp_flops(S, work)))
        assert alone.calls == [FlaCall(op, work.lengths, S.d_v, False) for op in ("forward", "backward")]
        summaries, halos = lin.exchange_bytes(S, work, 2, recompute=False)  # fla's autograd: no second send
        assert (cp.summary_bytes, cp.halo_bytes) == (summaries, halos) and summaries > 0
        rows = (work.sent + work.received) * WIDE + (work.sent2 + work.received2) * S.d_v  # [B | M]; late states
        assert summaries == rows * S.v_heads * S.d_k * 4  # fp32
        assert alone.summary_bytes == alone.halo_bytes == alone.collectives == 0
        # halos: forward, backward's resend and return; summaries: forward, return; late middles' states alike
        assert cp.collectives == 5 + 2 * any(w.sent2 for w in works)
        tokens = sum(work.lengths)
        assert cp.saved_bytes == lin.ops_saved_per_token(S, 2) * tokens + lin.work_extra_bytes(S, work, 2)
        assert alone.saved_bytes == lin.ops_saved_per_token(S, 2) * tokens  # from zero: no initial state given


def test_the_floor_carries_each_middle_pieces_transition_through_its_chunks():
    """:func:`~titan_cp.plan.linear.floor_flops`: a middle piece's chunks each carry its transition (``W M``, ``K'^T``
    times it: ``4 C K^2``), every value head, twice that backward: at Qwen3-Next's dims half of the wide call's added
    FLOPs forward (``4 C^2 K + 6 C K K``); a first piece and a last one (run from its composed state) nothing;
    Mamba2 has none."""
    # a first piece, a middle one of one chunk (a piece follows it), a last one of two chunks
    work = lin.LinearWork((100, 64, 128), (False, True, True), (True, True, False), 0, 1, 0, 3, calls=(0, 1, 2))
    c, k = S.chunk, S.d_k
    forward = S.v_heads * 4 * c * k * k
    assert lin.floor_flops(S, work) == (forward, 2 * forward)
    wide = S.v_heads * (4 * c * c * k + 6 * c * k * k)
    assert lin.cp_flops(S, work)[0] == pytest.approx(wide) and lin.floor_flops(S, work)[0] / wide == 0.5
    last = dataclasses.replace(work, followed=(True, False, False), calls=(0, 2, 2))  # now it ends its document
    assert lin.floor_flops(S, last) == lin.cp_flops(S, last) == (0, 0)
    with pytest.raises(ValueError, match="Gated DeltaNet's"):
        lin.floor_flops(dataclasses.replace(S, kind="mamba2"), work)


@pytest.mark.parametrize("balance", ["doc_local", "contiguous", "zigzag"])
@pytest.mark.parametrize("mix", ["docs_1k", "one_document"])
def test_the_calls_around_the_exchange_never_lengthen_the_layer(balance, mix):
    """Where each piece runs (:func:`~titan_cp.attention.linear.plan.piece_calls`): the layer's critical path (counted
    FLOPs) is never longer than with every later piece wide before the exchange, and shorter where documents are cut
    in two (``contiguous``, ``zigzag``: their last pieces run from their states, after it, with whole documents
    beside them), and within 2% of what the busiest rank computes."""
    rows = mix_rows(mix, SEQ)
    works = lin.linear_work(SEQ, CP, balance, tuple(tuple(r) for r in rows or [[SEQ]]), S.conv, late=True)
    wide = [dataclasses.replace(w, calls=tuple(int(later) for later in w.later)) for w in works]
    assert critical(S, works) <= critical(S, wide)
    if mix == "docs_1k" and balance != "doc_local":
        assert critical(S, works) < 0.95 * critical(S, wide) and all(w.after_lengths for w in works)
    assert critical(S, works) <= 1.02 * max(sum(phases(S, w)) for w in works)  # within 2% of the busiest rank's work


def test_what_crosses_is_the_same_at_two_row_lengths():
    """One document over CP 8 at 32,768 and 131,072 tokens: each rank sends the same bytes (summaries of
    ``heads x d_k x (d_v + d_k)`` numbers, halos of ``kernel - 1`` tokens), counted and as the planner prices
    them; only the tokens run wide (the middle pieces') grow with the row."""
    short, long = (simulate(S, n, CP) for n in (SEQ // 4, SEQ))
    assert [(a.summary_bytes, a.halo_bytes) for a, _ in short] == [(a.summary_bytes, a.halo_bytes) for a, _ in long]
    for n in (SEQ // 4, SEQ):
        priced = [lin.exchange_bytes(S, w, 2, recompute=False) for w in _works(n, CP, None)]
        assert priced == [(a.summary_bytes, a.halo_bytes) for a, _ in long]
    assert sum(sum(w.wide_lengths) for w in _works(SEQ, CP, None)) == 4 * sum(
        sum(w.wide_lengths) for w in _works(SEQ // 4, CP, None)
    )


def test_a_blocking_copy_in_the_layer_is_caught(monkeypatch):
    """The count runs under the sync detector: the exchange's row index copied from the host in every layer
    (what the eager backward did before its plan's device index) raises."""
    monkeypatch.setattr(StatePlan, "send_index", lambda self, device: rows_index(self.send).to(device))
    with pytest.raises(HostSyncError, match="blocking host-to-device copy"):
        simulate(S, 4096, 4, mix_rows("docs_1k", 4096))


SMALL_ROWS = [lognormal_doc_lens(256, 16, seed=2)]  # at CP 4, rank 3's summary is read only by other ranks


def test_every_rank_of_a_crossing_plan_joins_the_exchange_backward():
    """Where a rank's pieces read no summary it received (or it has none of its own), its backward still
    joins the exchange, a collective, and returns the gradients of what it received; a rank whose summaries
    only others read still gets their gradients (its calls' backward runs)."""
    layout = SequenceLayout(256, 4, DEFAULT_BALANCE, SMALL_ROWS)
    works = _works(256, 4, SMALL_ROWS)
    assert not any(received for chain in _chains(layout, 3) for received, _ in chain) and works[3].summarized
    for (cp, _), work in zip(simulate(S, 256, 4, SMALL_ROWS), works):
        assert cp.collectives == 5 + 2 * any(w.sent2 for w in works) and cp.calls == _expected_calls(work)


def _chains(layout: SequenceLayout, rank: int):
    from titan_cp.attention.linear.plan import state_plan  # noqa: PLC0415

    return state_plan(layout, rank, 1).chains


def fla_error(rank: int, world: int) -> float:
    """The largest difference of this rank's gradients of the gated delta rule on :data:`SMALL_ROWS` through
    ``fla`` (its stand-in on the CPU) from the torch kernel's, relative to the largest gradient."""
    from tests import fla_standin  # noqa: PLC0415
    from tests.dist_utils import cp_mesh  # noqa: PLC0415
    from titan_cp.attention.linear import cp_gated_delta_rule  # noqa: PLC0415

    layout, mesh = SequenceLayout(256, world, DEFAULT_BALANCE, SMALL_ROWS), cp_mesh("ring", world)
    gen = torch.Generator().manual_seed(0)
    shapes = dict(q=(2, 8), k=(2, 8), v=(4, 6), g=(4,), beta=(4,))
    full = {n: torch.randn(1, 256, *s, generator=gen) for n, s in shapes.items()}
    full["g"], full["beta"] = -full["g"].sigmoid(), full["beta"].sigmoid()
    grads = {}
    for backend in ("fla", "torch"):
        local = {n: layout.shard(t, 1, rank).requires_grad_() for n, t in full.items()}
        with fla_standin.installed():
            out = cp_gated_delta_rule(*local.values(), mesh, layout, qk_l2norm=True, backend=backend)
            grads[backend] = torch.cat(
                [g.flatten() for g in torch.autograd.grad(out.square().sum(), list(local.values()))]
            )
    return ((grads["fla"] - grads["torch"]).abs().max() / grads["torch"].abs().max()).item()


def test_the_fla_path_returns_every_summary_gradient(dist_pools):
    """At CP 4 on :data:`SMALL_ROWS` the ``fla`` path's gradients equal the torch kernel's on every rank (before
    the join, rank 3 skipped the exchange's backward: its summary's gradient lost, the others left waiting)."""
    assert max(dist_pools.run(4, fla_error)) < 1e-5


def recomputed_bytes(rank: int, world: int, kind: str) -> int:
    """Bytes this rank sends in one forward + backward of Mamba2's SSD, or of the gated delta rule through the
    torch kernel (both custom ops whose backward recomputes, sending the summaries again), on :data:`SMALL_ROWS`."""
    from tests.dist_utils import cp_mesh  # noqa: PLC0415
    from titan_cp.attention.comm import count_comm  # noqa: PLC0415
    from titan_cp.attention.linear import cp_gated_delta_rule, cp_ssd  # noqa: PLC0415

    layout, mesh = SequenceLayout(256, world, DEFAULT_BALANCE, SMALL_ROWS), cp_mesh("ring", world)
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(1, 256 // world, *s, generator=gen).requires_grad_()  # noqa: E731
    with count_comm() as counted:
        if kind == "ssd":  # 4 heads of dim 3, 2 groups of state 5
            a = -torch.rand(4, generator=gen).requires_grad_()
            out = cp_ssd(r(4, 3), r(4).sigmoid(), a, r(2, 5), r(2, 5), mesh, layout, chunk=16)
        else:  # 2 q/k heads, 4 value heads, d_k 8, d_v 6
            out = cp_gated_delta_rule(r(2, 8), r(2, 8), r(4, 6), -r(4).sigmoid(), r(4).sigmoid(), mesh, layout)
        out.sum().backward()
    return counted.bytes_sent


@pytest.mark.parametrize(
    "kind, shapes",
    [("ssd", LinearShapes("mamba2", 2, 4, 5, 3, 4, 16)), ("gated_delta", LinearShapes("gated_delta", 2, 4, 8, 6))],
)
def test_the_recomputing_ops_send_what_the_planner_prices(dist_pools, kind, shapes):
    """Mamba2's SSD and the torch kernel's gated delta rule at CP 4: each rank's bytes equal the planner's
    summaries (``recompute``: sent forward, sent again by the backward, the received ones' gradients returned)."""
    works = lin.linear_work(256, 4, DEFAULT_BALANCE, tuple(tuple(r) for r in SMALL_ROWS), 4, late=kind == "gated_delta")
    priced = [lin.exchange_bytes(shapes, w, 4, recompute=True)[0] for w in works]
    assert dist_pools.run(4, recomputed_bytes, kind) == priced and max(priced) > 0


def _plans_work(layout: SequenceLayout, rank: int, batch: int, conv: int, late: bool) -> lin.LinearWork:
    """:class:`~titan_cp.plan.linear.LinearWork` read from the ops' own plans of one rank."""
    from titan_cp.attention.linear.plan import halo_plan, state_plan  # noqa: PLC0415

    state, halo = state_plan(layout, rank, batch, late), halo_plan(layout, rank, batch, conv)
    lengths = tuple(n for _, n in state.runs)
    read = {source for chain in state.chains if len(chain) > 1 for source, _ in chain}  # what M s + B keeps
    extended = {chain[:n] for chain in state.chains for n in range(2, len(chain))}  # kept as s by a longer link
    followed = tuple(j in state.summarize or j in state.states2 for j in range(len(lengths)))
    second = state.second
    return lin.LinearWork(
        lengths, tuple(map(bool, state.chains)), followed, sum(map(len, state.send.values())),
        state.received, sum(map(len, halo.send.values())), halo.received,
        len(extended), 0 in read, 1 in read, state.calls,
        0 if second is None else sum(map(len, second.send.values())), 0 if second is None else second.received,
        2 in read, 3 in read,
    )  # fmt: skip


@pytest.mark.parametrize("late", [False, True, "forced"])
@pytest.mark.parametrize("balance", ["contiguous", "zigzag", "doc_zigzag", "doc_local"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_planners_work_is_the_ops_plans(balance, cp, late):
    """The planner's one pass over the documents gives each rank what the ops' plans give it (pieces, which
    of them are later pieces, summaries, rows sent and received, halos, composed states), on two rows of
    packed documents."""
    rows = ((2, 300, 7, 1, 700, 14), tuple(lognormal_doc_lens(1024, 40, seed=cp)))
    # "forced": every late middle piece placed (the second exchange's rows, what it keeps)
    with every_late_middle() if late == "forced" else contextlib.nullcontext():
        layout = SequenceLayout(1024, cp, balance, [list(r) for r in rows])
        want = tuple(_plans_work(layout, r, 2, 4, bool(late)) for r in range(cp))
        got = lin.linear_work(1024, cp, balance, rows, 4, bool(late))
    if late == "forced":
        if cp > 2 or balance.startswith("doc"):  # (at cp 2, contiguous and zigzag cut these documents in two)
            assert any(w.late_middles for w in got) and any(w.sent2 for w in got)
    assert got == want
