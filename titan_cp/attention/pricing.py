"""What a CP strategy's call costs: one cost object per strategy, beside the strategy that runs.

A :class:`~titan_cp.attention.strategy.Strategy` runs (forward, backward, the shapes it saves, its mesh);
its :class:`StrategyCost` prices a call of it, for the planner, the op's FLOP formula and the benchmarks.
Everything a price depends on is one small frozen :class:`AttentionCall`::

    call = AttentionCall(cp=8, q_heads=32, kv_heads=8, head_dim=128, ulysses=2, batch=1, local_len=16384,
                         act_bytes=2, layout=layout)     # v_head_dim=128 for MLA's q/k 192, v 128
    cost = cost_of("hybrid")                 # or cost_of(handle.strategy_impl)
    cost.min_bytes(call)                     bytes this rank sends, forward + backward
    cost.min_bytes_by_axis(call)             the same per axis of the cp sub-mesh (the planner's links)
    cost.saved_bytes_per_token(call)         what the op keeps for backward, per local token
    cost.buffer_bytes(call)                  receive buffers alive while the op runs
    cost.local_head_pairs(call, rank)        (query, key) pairs x heads this rank's kernels compute
    cost.attention_kv_heads(call)            K/V heads of the buffers the local kernel attends with

Bytes sent are counted as the transports count them (:func:`titan_cp.attention.comm.count_comm`): with a
layout, only the rows another rank can see under it travel (every rank computes every ``need``), for the
rank sending most unless a ``rank`` is named; without, the dense case (every rank needs every other
rank's K/V). A new strategy's class registers its cost class with :func:`register_cost`; a subclass of a
built-in strategy is priced as the built-in unless it registers its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from torch import Tensor

from titan_cp.attention.allgather import AllGather
from titan_cp.attention.hybrid import Hybrid
from titan_cp.attention.ring import RING, Ring, read_once, rows_seen
from titan_cp.attention.strategy import Strategy, get_strategy, kv_head_map, kv_heads_per_shard
from titan_cp.attention.tiling import CAUSAL, Mask, tile_mask, zigzag_counts
from titan_cp.attention.ulysses import HeadExchange, Ulysses
from titan_cp.layout import SequenceLayout

S = TypeVar("S", bound=Strategy)


@dataclass(frozen=True)
class AttentionCall:
    """One CP attention call as it is priced: this rank's shapes and the cp sub-mesh it runs on.

    cp: ranks of the cp sub-mesh; ulysses: hybrid's Ulysses degree (1 for the others).
    q_heads, kv_heads, head_dim: the local heads (after TP) and q/k's size; act_bytes: bytes of an element.
    batch: rows; local_len: tokens of a row on this rank (``q, k`` are ``(batch, heads, local_len, head_dim)``).
    layout, mask: what the ranks need of each other (``None``: the dense case).
    documents: whether a row holds several documents (what Ulysses and hybrid keep, and send again in the
        backward, depend on it); ``None``: the layout's ``packs_documents`` (no documents without a layout).
    v_head_dim: v's head size (and so out's, dout's): multi-head latent attention's own (DeepSeek V3: q/k 192,
        v 128); ``None``: ``head_dim``. Every byte of V, the output and their gradients is counted at it.
    """

    cp: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ulysses: int = 1
    batch: int = 1
    local_len: int = 1
    act_bytes: int = 2
    layout: SequenceLayout | None = None
    mask: Mask = CAUSAL
    documents: bool | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.documents is None:
            object.__setattr__(self, "documents", self.layout is not None and self.layout.packs_documents)
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    @classmethod
    def of(
        cls,
        q: Tensor,
        k: Tensor,
        cp: int,
        ulysses: int = 1,
        layout: SequenceLayout | None = None,
        mask: Mask = CAUSAL,
        v: Tensor | None = None,
    ) -> AttentionCall:
        """The call on local shards shaped ``q (B, H, S, E)``, ``k (B, K, S, E)`` and ``v (B, K, S, Ev)`` (``None``:
        shaped like ``k``; meta tensors serve)."""
        b, h, s, e = q.shape
        v_dim = e if v is None else v.shape[-1]
        return cls(cp, h, k.shape[1], e, ulysses, b, s, k.element_size(), layout, mask, v_head_dim=v_dim)

    @property
    def v_dim(self) -> int:
        """v's head size (:attr:`v_head_dim`, filled in)."""
        assert self.v_head_dim is not None
        return self.v_head_dim

    @property
    def tokens(self) -> int:
        """Local tokens of the call (``batch x local_len``)."""
        return self.batch * self.local_len

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K and V (each at its own head size)."""
        return self.kv_heads * (self.head_dim + self.v_dim) * self.act_bytes

    def qo_bytes(self, tokens: int) -> int:
        """Bytes of ``tokens`` tokens' q and output (or ``dq`` and ``dout``) at every query head."""
        return self.q_heads * (self.head_dim + self.v_dim) * tokens * self.act_bytes


@dataclass(frozen=True)
class AxisBytes:
    """Bytes one rank sends on one axis of a strategy's cp sub-mesh (see :meth:`StrategyCost.min_bytes_by_axis`).

    ``ring``: sent as ``size - 1`` ring steps per pass, each overlapping a step of attention;
    otherwise in collectives the attention waits for.
    """

    axis: str
    size: int
    nbytes: int
    ring: bool


class StrategyCost(Generic[S]):
    """Prices calls of :attr:`strategy` (module docstring); subclasses implement the formulas. The sizes and
    the schedule a call runs are asked of the strategy itself (``ulysses_size``, ``mesh_dims``, ``schedule``)."""

    def __init__(self, strategy: S) -> None:
        self.strategy = strategy

    def min_bytes(self, call: AttentionCall, backward: bool = True, rank: int | None = None) -> int:
        """Bytes this rank (``rank``; ``None``: the one sending most) sends for one forward (+ backward)."""
        raise NotImplementedError

    def min_bytes_by_axis(
        self, call: AttentionCall, backward: bool = True, rank: int | None = None
    ) -> tuple[AxisBytes, ...]:
        """:meth:`min_bytes` split over the axes of the strategy's ``mesh_dims`` (outermost first)."""
        ((axis, size),) = self.strategy.mesh_dims(call.cp, call.ulysses)
        ring = self.strategy.ring_size(call.cp, call.ulysses) > 1
        return (AxisBytes(axis, size, self.min_bytes(call, backward, rank), ring),)

    def saved_bytes_per_token(self, call: AttentionCall) -> float:
        """Bytes the op keeps for backward per local token: its kept inputs/outputs and ``saved``. When the
        op does not keep ``out``, the output projection saves its input instead; that is counted here too,
        so every strategy's figure covers the same tensors."""
        raise NotImplementedError

    def buffer_bytes(self, call: AttentionCall) -> int:
        """Receive buffers alive while the op runs (beyond what it saves), for the call's tokens."""
        return 0

    def local_head_pairs(self, call: AttentionCall, rank: int) -> int:
        """Visible (query, key) pairs this rank's kernels compute under the call's layout and mask, summed
        over the heads they run (``call.q_heads``: local query heads before any exchange). Summed over the
        cp ranks it is the whole layer's pairs times the heads: the work is split, never repeated."""
        return tile_mask(_layout(call), (rank,), None, call.mask).pairs(call.batch) * call.q_heads

    def attention_kv_heads(self, call: AttentionCall) -> int:
        """K/V heads of the buffers the local kernel attends with (after any all-to-all)."""
        u = self.strategy.ulysses_size(call.cp, call.ulysses)
        return call.kv_heads if u == 1 else kv_heads_per_shard(call.q_heads, call.kv_heads, u)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self.strategy.name!r}>"


def _layout(call: AttentionCall) -> SequenceLayout:
    if call.layout is None:
        raise ValueError("the pairs a rank computes need the call's layout (AttentionCall.layout)")
    return call.layout


# ---------------------------------------------------------------------------- rows the ring moves


def _members(g: int, u: int) -> tuple[int, ...]:
    """The cp ranks of ring rank ``g`` when each ring rank is a group of ``u`` consecutive cp ranks."""
    return tuple(range(g * u, (g + 1) * u))


def _key_rows_seen(
    layout: SequenceLayout, q_ranks: Sequence[int], k_ranks: Sequence[int], mask: Mask, batch: int
) -> int:
    """Rows of ``k_ranks``' keys that ``q_ranks``' queries see."""
    return rows_seen(layout, q_ranks, k_ranks, mask, batch)[1]


def exchanged_rows(
    layout: SequenceLayout, ring_rank: int, ring_size: int, u: int, mask: Mask, batch: int
) -> tuple[int, int]:
    """``(rows sent, rows received)`` of K/V by ring rank ``ring_rank`` over one pass of a ring of ``ring_size``
    groups of ``u`` consecutive cp ranks (1: the ring over every rank; hybrid's Ulysses groups) (host only;
    cached on the layout: the planner asks it for every candidate mesh and strategy sharing the layout; in
    closed form on the even zigzag of one document a row, :func:`~titan_cp.attention.tiling.zigzag_counts`)."""

    def build() -> tuple[int, int]:
        if mask == CAUSAL and layout.zigzag_chunk() is not None and ring_size > 1:  # a later group sees u c rows
            by_later, by_earlier = zigzag_counts(layout, 1, 0, u, batch)[2], zigzag_counts(layout, 0, 1, u, batch)[2]
            earlier, later = ring_rank, ring_size - 1 - ring_rank
            return later * by_later + earlier * by_earlier, earlier * by_later + later * by_earlier
        mine, sent, recv = _members(ring_rank, u), 0, 0
        for s in range(1, ring_size):
            src, dst = (ring_rank - s) % ring_size, (ring_rank + s) % ring_size
            recv += _key_rows_seen(layout, mine, _members(src, u), mask, batch)
            sent += _key_rows_seen(layout, _members(dst, u), mine, mask, batch)
        return sent, recv

    return layout.memo(("exchanged_rows", ring_rank, ring_size, u, mask, batch), build)


def fp32_returned_rows(layout: SequenceLayout, ring_rank: int, ring_size: int, u: int, mask: Mask, batch: int) -> int:
    """Rows ring rank ``ring_rank`` (of groups of ``u`` consecutive cp ranks, :func:`exchanged_rows`) receives
    whose gradients go home in fp32 (read by several packed key rows of their step,
    :func:`~titan_cp.attention.ring.read_once`); the others' go home in the input dtype (host; cached; in
    closed form on the even zigzag of one document a row)."""

    def build() -> int:
        if mask == CAUSAL and layout.zigzag_chunk() is not None:
            if ring_size == 1:
                return 0
            _, _, later_rows, later_fp32 = zigzag_counts(layout, 0, 1, u, batch)  # each later group's keys read
            _, _, earlier_rows, earlier_fp32 = zigzag_counts(layout, 1, 0, u, batch)
            later = later_rows if later_fp32 else 0  # two different groups: the flag is always given
            earlier = earlier_rows if earlier_fp32 else 0
            return (ring_size - 1 - ring_rank) * later + ring_rank * earlier
        mine, total = _members(ring_rank, u), 0
        for s in range(1, ring_size):
            tiles = tile_mask(layout, mine, _members((ring_rank - s) % ring_size, u), mask)
            total += tiles.key_row_count(batch) if read_once(tiles, batch) == "fp32" else 0
        return total

    return layout.memo(("fp32_returned_rows", ring_rank, ring_size, u, mask, batch), build)


def ring_bytes(
    call: AttentionCall, sent: int, recv: int, backward: bool, resend: bool = True, fp32: int | None = None
) -> int:
    """Bytes a rank sends: its K/V rows (forward, and again in the backward when they are not kept:
    ``resend``), and the gradients of the rows it received: ``fp32`` of them (all by default) in fp32, the
    rest in the input dtype (rows of ``call.row_bytes``)."""
    row, elems = call.row_bytes, call.row_bytes // call.act_bytes
    fp32 = recv if fp32 is None else fp32
    total = sent * row
    if backward:
        total += sent * row * resend + fp32 * elems * 4 + (recv - fp32) * row
    return total


def _ring_layout_bytes(
    call: AttentionCall, layout: SequenceLayout, u: int, backward: bool, groups: range | tuple[int, ...]
) -> int:
    """The most any of ``groups`` (ring ranks of groups of ``u`` cp ranks, ``call`` at a group's shapes) sends
    over one pass of the ring under ``layout``."""
    ring, b = call.cp // u, call.batch
    return max(
        ring_bytes(
            call,
            *exchanged_rows(layout, g, ring, u, call.mask, b),
            backward,
            fp32=fp32_returned_rows(layout, g, ring, u, call.mask, b) if backward else None,
        )
        for g in groups
    )


# ---------------------------------------------------------------------------- the strategies


class RingCost(StrategyCost[Strategy]):
    """The ring's K/V rows to the ranks that need them and their gradients home (:mod:`~titan_cp.attention.ring`)."""

    def min_bytes(self, call: AttentionCall, backward: bool = True, rank: int | None = None) -> int:
        """K/V rows sent to the ranks that need them, and the gradients of the rows received sent home
        (:func:`ring_bytes`). Without a layout every rank needs all of every other rank's K/V (their
        gradients counted in fp32: an upper bound)."""
        if call.layout is None:
            rows = (call.cp - 1) * call.tokens
            return ring_bytes(call, rows, rows, backward)
        return _ring_layout_bytes(call, call.layout, 1, backward, range(call.cp) if rank is None else (rank,))

    def saved_bytes_per_token(self, call: AttentionCall) -> float:
        """q, out, k, v as stored locally and the fp32 lse."""
        return call.qo_bytes(1) + call.row_bytes + 4 * call.q_heads

    def buffer_bytes(self, call: AttentionCall) -> int:
        """At most two K/V blocks (the one read, the one arriving) and two fp32 dK/dV blocks."""
        if call.cp == 1:
            return 0
        kvb = call.row_bytes * call.tokens
        return 2 * kvb + 2 * kvb * 4 // call.act_bytes


RING_COST = RingCost(RING)
"""The ring's prices: also those of the ring's schedule that Ulysses and hybrid run where documents stay home."""


class AllGatherCost(StrategyCost[Strategy]):
    """What each peer needs of a rank's K/V in one collective, the gradients back (:mod:`~titan_cp.attention.allgather`)."""

    def min_bytes(self, call: AttentionCall, backward: bool = True, rank: int | None = None) -> int:
        """What each peer needs of this rank's K/V, and in the backward the fp32 gradients of the rows it
        received (the ring's count, in one collective). Without a layout every rank needs everything."""
        if call.layout is None:
            rows = (call.cp - 1) * call.tokens
            return ring_bytes(call, rows, rows, backward, resend=False)
        ranks = range(call.cp) if rank is None else (rank,)
        b = call.batch
        return max(
            ring_bytes(call, *exchanged_rows(call.layout, r, call.cp, 1, call.mask, b), backward, resend=False)
            for r in ranks
        )

    def saved_bytes_per_token(self, call: AttentionCall) -> float:
        """Local q, out and lse, and the key buffer: at most ``cp`` tokens' K/V per local token (all of them
        when every row is seen by another rank; fewer under ``doc_local`` or a window)."""
        return call.qo_bytes(1) + 4 * call.q_heads + call.cp * call.row_bytes


def head_shard_saved_bytes(call: AttentionCall, n: int) -> float:
    """Bytes per local token of the head shards a head exchange over ``n`` ranks keeps: q_h and out_h (the
    bytes of q and out), K/V at the heads each shard needs for ``n`` times the tokens, the lse; and ``wo``'s
    input (the output, at v's head size), since the op keeps no ``out``."""
    a, h = call.act_bytes, call.q_heads
    shard_kv = kv_heads_per_shard(h, call.kv_heads, n) * n * (call.head_dim + call.v_dim) * a
    return call.qo_bytes(1) + shard_kv + 4 * h + a * h * call.v_dim


def exchange_bytes(call: AttentionCall, n: int, backward: bool) -> int:
    """Bytes one rank sends through the head exchange over ``n`` ranks: q, the K/V each rank must ship and
    the output; the backward moves ``dout`` in and the gradients out, and with documents (the head shards
    not kept) q, K/V and out again (each all-to-all keeps ``1/n`` of its buffer)."""
    if n == 1:
        return 0
    kv_heads = max(call.kv_heads, n) if kv_head_map(call.q_heads, call.kv_heads, n) else call.kv_heads
    kv = kv_heads * call.tokens * (call.head_dim + call.v_dim) * call.act_bytes
    one = (call.qo_bytes(call.tokens) + kv) * (n - 1) // n  # q (or dout) and K/V one way, the output (or dq) back
    return one * ((3 if call.documents else 2) if backward else 1)


class HeadExchangeCost(StrategyCost[HeadExchange[Any]]):
    """Ulysses' and hybrid's shared prices: what the call keeps and buffers, and the ring's schedule where
    the call runs it (:meth:`~titan_cp.attention.ulysses.HeadExchange.schedule`)."""

    def saved_bytes_per_token(self, call: AttentionCall) -> float:
        """With documents (several a row) what a ring keeps, whichever schedule runs; without (or one a
        row), the head shards (:func:`head_shard_saved_bytes`)."""
        if call.documents:
            return RING_COST.saved_bytes_per_token(call)
        return head_shard_saved_bytes(call, self.strategy.ulysses_size(call.cp, call.ulysses))

    def exchange_buffer_bytes(self, call: AttentionCall) -> int:
        """The head exchange's buffers alive during the op (its part of :meth:`buffer_bytes`)."""
        raise NotImplementedError

    def buffer_bytes(self, call: AttentionCall) -> int:
        """The head exchange's buffers; with documents the larger of the ring's and those, plus the head
        shards of q, out and dout the backward exchanges again (the bytes of the local q, out and dout)."""
        own = self.exchange_buffer_bytes(call)
        if not call.documents or call.cp == 1:
            return own
        resent = call.act_bytes * call.q_heads * (call.head_dim + 2 * call.v_dim) * call.tokens  # q, out, dout
        return max(own + resent, RING_COST.buffer_bytes(call))

    def runs_ring(self, call: AttentionCall) -> bool:
        """Whether the call runs the ring's schedule over every cp rank (its documents stay home)."""
        return call.layout is not None and self.strategy.schedule(call.layout, call.mask, call.batch) == RING.name

    def ring_schedule_pairs(self, call: AttentionCall, rank: int) -> int | None:
        """The ring schedule's pairs of ``rank`` where the call runs it, else ``None``."""
        return RING_COST.local_head_pairs(call, rank) if self.runs_ring(call) else None

    def ring_schedule_bytes(self, call: AttentionCall, backward: bool, rank: int | None) -> int | None:
        """The ring schedule's bytes where the call runs it, else ``None``."""
        return RING_COST.min_bytes(call, backward, rank) if self.runs_ring(call) else None


class UlyssesCost(HeadExchangeCost):
    """The all-to-alls from sequence shards to head shards and back (:mod:`~titan_cp.attention.ulysses`)."""

    def local_head_pairs(self, call: AttentionCall, rank: int) -> int:
        """The whole row's pairs for 1/N of the heads (or, where the call runs the ring's schedule, the ring's)."""
        home = self.ring_schedule_pairs(call, rank)
        if home is not None:
            return home
        return tile_mask(_layout(call), None, None, call.mask).pairs(call.batch) * call.q_heads // call.cp

    def min_bytes(self, call: AttentionCall, backward: bool = True, rank: int | None = None) -> int:
        """All-to-all traffic (:func:`exchange_bytes`): the layout changes it only where the call runs the
        ring's schedule (its bytes then), or with documents (the backward sends more)."""
        home = self.ring_schedule_bytes(call, backward, rank)
        return home if home is not None else exchange_bytes(call, call.cp, backward)

    def exchange_buffer_bytes(self, call: AttentionCall) -> int:
        """The all-to-all's send and receive copies of the local K/V, and the stacked pair."""
        if call.cp == 1:
            return 0
        return 3 * call.row_bytes * call.tokens


class HybridCost(HeadExchangeCost):
    """Ulysses inside each group, the ring across the groups' unions (:mod:`~titan_cp.attention.hybrid`)."""

    def local_head_pairs(self, call: AttentionCall, rank: int) -> int:
        """The Ulysses group's queries against every key, for 1/U of the heads (or, where the call runs
        the ring's schedule, the ring's)."""
        home = self.ring_schedule_pairs(call, rank)
        if home is not None:
            return home
        u = call.ulysses
        return tile_mask(_layout(call), _members(rank // u, u), None, call.mask).pairs(call.batch) * call.q_heads // u

    def min_bytes(self, call: AttentionCall, backward: bool = True, rank: int | None = None) -> int:
        """The Ulysses all-to-alls inside the group, then the ring among groups on the groups' unions
        (``U`` times the tokens, at the K/V heads of one head shard), only the rows another group needs."""
        return sum(a.nbytes for a in self.min_bytes_by_axis(call, backward, rank))

    def min_bytes_by_axis(
        self, call: AttentionCall, backward: bool = True, rank: int | None = None
    ) -> tuple[AxisBytes, ...]:
        """The ring among groups on ``cp_ring``, the all-to-alls inside a group on ``cp_ulysses``; where the
        call runs the ring's schedule, the ring over every cp rank, on ``cp_ring`` (its neighbours are mostly
        in other groups) unless there is one group."""
        u, groups = call.ulysses, call.cp // call.ulysses
        home = self.ring_schedule_bytes(call, backward, rank)
        if home is not None:
            on_ring = groups > 1
            return AxisBytes("cp_ring", groups, home if on_ring else 0, True), AxisBytes(
                "cp_ulysses", u, 0 if on_ring else home, not on_ring
            )
        union = dataclasses.replace(  # a group's union at the K/V heads of one head shard
            call, kv_heads=kv_heads_per_shard(call.q_heads, call.kv_heads, u), local_len=call.local_len * u
        )
        if call.layout is None:
            ring = RING_COST.min_bytes(dataclasses.replace(union, cp=groups), backward)
        else:
            ring = _ring_layout_bytes(union, call.layout, u, backward, range(groups) if rank is None else (rank // u,))
        uly = exchange_bytes(call, u, backward)
        return AxisBytes("cp_ring", groups, ring, groups > 1), AxisBytes("cp_ulysses", u, uly, False)

    def exchange_buffer_bytes(self, call: AttentionCall) -> int:
        """The ring's two K/V blocks and two fp32 dK/dV accumulators, on the group's union."""
        if call.cp == 1:
            return 0
        kvb = call.row_bytes * call.tokens
        return 2 * kvb * call.ulysses + 2 * kvb * 4 // call.act_bytes


# ---------------------------------------------------------------------------- the registry

_COSTS: dict[type[Strategy], type[StrategyCost[Any]]] = {}


def register_cost(kind: type[Strategy], cost: type[StrategyCost[Any]]) -> None:
    """Price the strategies of class ``kind`` with ``cost``; a subclass of ``kind`` is priced so too unless it
    registers a cost of its own (a strategy that runs another's exchange differently keeps its prices)."""
    _COSTS[kind] = cost


def cost_of(strategy: str | Strategy) -> StrategyCost[Any]:
    """The cost object of ``strategy`` (a registered strategy, or its name): that of the nearest class in its
    ancestry with a registered cost. ``ValueError`` naming the fix when there is none."""
    s = get_strategy(strategy) if isinstance(strategy, str) else strategy
    for kind in type(s).__mro__:
        if kind in _COSTS:
            return _COSTS[kind](s)
    raise ValueError(
        f"CP strategy {s.name!r} has no cost object: register one with titan_cp.attention.pricing.register_cost"
    )


register_cost(Ring, RingCost)
register_cost(AllGather, AllGatherCost)
register_cost(Ulysses, UlyssesCost)
register_cost(Hybrid, HybridCost)
