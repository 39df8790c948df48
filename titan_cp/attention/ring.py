"""Ring attention: each rank attends its own queries while the K/V it needs arrive, one peer per step.

Step ``s`` of ``N``: rank ``r`` holds what it needs of the K/V of rank ``r - s`` (its own at step
0), received directly from that rank, and folds its attention into the results (log-sum-exp
merges, a group of steps at a time: :mod:`titan_cp.attention.fold`); meanwhile the next step's
K/V are already on their way (double buffering: the buffer being read and the one arriving are
different tensors), so the transfer hides behind the computation::

    forward    out_r = merge_s attn(q_r, kv_{r-s}[need(r, r-s)])    and sends kv_r[need(r+s, r)] to r+s
    backward   dq_r  = sum_s dattn_q(q_r, kv_{r-s}[need(r, r-s)])    the same K/V sent again
               dkv_r[need(r+s, r)] += dattn_kv from rank r+s         each gradient goes straight home

``need(i, j)``: the rows of rank ``j``'s K/V that some query of rank ``i`` can see, from the
layout and the mask (every rank computes every ``need``, so no size is ever exchanged). Only
those rows travel, and their gradients go home in the input dtype where each row is read by one
packed key row of its step (that one kernel output: exact), in fp32 where several are summed.
Without documents under ``zigzag`` a rank needs all of a later rank's K/V and
half of an earlier one's; under ``doc_local`` a document whole on one rank never leaves it; with
a sliding window only the rows a neighbour's window reaches. A step with nothing to receive
computes nothing, one with nothing to send sends nothing.

Saves only the local q, k, v, out and lse: remote K/V are sent again in the backward. One rank
(``N = 1``) is plain local attention. For the hybrid strategy a "rank" of this ring is a whole
Ulysses group, and its buffer the concatenation of the group members' shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor

from titan_cp.attention.comm import NOTHING, Exchange, PeerComm
from titan_cp.attention.context import CPContext
from titan_cp.attention.fold import (
    Folds,
    Grads,
    Results,
    attend_backward,
    fold_forward,
    make_folds,
)
from titan_cp.attention.kernels import AttentionKernel
from titan_cp.attention.merge import sinks_grad
from titan_cp.attention.strategy import BackwardGrads, Strategy, kept_input, register_strategy
from titan_cp.attention.tiling import (
    CAUSAL,
    Mask,
    MaskTiles,
    Rows,
    TileIndex,
    causal_counts,
    head_major,
    tile_mask,
    token_major,
)
from titan_cp.layout import SequenceLayout

RingGroup: TypeAlias = dist.ProcessGroup | PeerComm | None
"""A ring's transport: a process group whose ranks are the ring's (``None``: the default group), or a
:class:`~titan_cp.attention.comm.PeerComm` that numbers them itself."""
Members = Callable[[int], Sequence[int]]
"""The cp ranks (layout order) of each ring rank: one each, or a Ulysses group's under hybrid."""


@dataclass(frozen=True)
class RingStep:
    """Step ``s`` of one rank's ring: my queries on what I need of ring rank ``src``'s K/V.

    ``recv``: rows of ``src``'s buffer received (0: nothing, the step is skipped), ``grads``: where the
    packed keys' gradients of each call go in the buffer of those rows sent back; ``send``: the rows of my buffer
    ``dst`` needs (``None``: nothing to send; their gradients return, a partial of my key gradients).
    ``grad_dtype`` / ``home_dtype``: whether the gradients of the rows received / sent travel in the input
    dtype (``"input"``: every such row is read by one packed key row of the step, so its gradient is that one
    kernel output, already in the input dtype) or in fp32 (``"fp32"``: several contributions summed).
    """

    src: int
    dst: int
    tiles: MaskTiles
    index: TileIndex
    recv: int
    grads: Folds | None
    send: Rows | None
    grad_dtype: str = "fp32"
    home_dtype: str = "fp32"

    def dtype(self, which: str, like: torch.Tensor) -> torch.dtype:
        """The dtype of the gradients of the rows received (``which="grad"``) or sent (``"home"``)."""
        return like.dtype if getattr(self, f"{which}_dtype") == "input" else torch.float32


@dataclass(frozen=True)
class RingSteps:
    """One rank's ring, built once per microbatch: its steps, where the results and the own K/V's
    gradients go (:mod:`titan_cp.attention.fold`; ``keys``: step 0's packed key rows, then at each later
    step the rows sent, whose gradients return)."""

    steps: tuple[RingStep, ...]
    folds: Folds
    keys: Folds

    def __len__(self) -> int:
        return len(self.steps)


def ring_step_tiles(
    layout: SequenceLayout, ring_rank: int, ring_size: int, members: Members, mask: Mask
) -> list[MaskTiles]:
    """The mask's tiles at each ring step: my queries against the K/V of ring rank ``ring_rank - step`` (full numbering)."""
    mine = tuple(members(ring_rank))
    return [tile_mask(layout, mine, tuple(members((ring_rank - s) % ring_size)), mask) for s in range(ring_size)]


def _key_map(rows: torch.Tensor, size: int) -> torch.Tensor:
    """For each row of a full buffer of ``size`` rows, its place among ``rows`` (-1 where not held)."""
    out = torch.full((size,), -1, dtype=torch.int64)
    out[rows] = torch.arange(len(rows))
    return out


def read_once(tiles: MaskTiles, batch: int) -> str:
    """``"input"`` when every key row ``tiles`` reads is read by one packed key row of one call (its
    gradient is one kernel output, exact in the input dtype), else ``"fp32"`` (host, from the tiles)."""
    return "input" if tiles.packed_key_count(batch) == tiles.key_row_count(batch) else "fp32"


def _step(
    layout: SequenceLayout,
    mine: tuple[int, ...],
    src: int,
    dst: int,
    s: int,
    members: Members,
    mask: Mask,
    batch: int,
    device: torch.device,
    size: int,
) -> tuple[RingStep, Tensor | None]:
    """Step ``s``'s tiles, their device index and what it exchanges (host rows sent, for the key folds)."""
    tiles = tile_mask(layout, mine, tuple(members(src)), mask)
    if s == 0:
        return RingStep(src, dst, tiles, tiles.index(batch, device), 0, None, None), None
    need = tiles.key_rows(batch)
    key_map = (("recv", s), _key_map(need, size))
    index = tiles.index(batch, device, key_map)
    grads = make_folds([tiles.k_dest(batch, key_map[1])], len(need), device)
    peer = tile_mask(layout, tuple(members(dst)), mine, mask)  # dst's step s: the same tiles on both ends
    rows = peer.key_rows(batch)
    send = Rows.of(rows, device) if len(rows) else None
    step = RingStep(src, dst, tiles, index, len(need), grads, send, read_once(tiles, batch), read_once(peer, batch))
    return step, rows


def ring_steps(
    layout: SequenceLayout,
    ring_rank: int,
    ring_size: int,
    members: Members,
    mask: Mask,
    batch: int,
    device: torch.device,
) -> RingSteps:
    """Ring rank ``ring_rank``'s :class:`RingSteps` (cached on the layout: once per microbatch)."""

    def build() -> RingSteps:
        mine = tuple(members(ring_rank))
        size = batch * layout.local_len * len(mine)
        steps, sent = [], []
        for s in range(ring_size):
            src, dst = (ring_rank - s) % ring_size, (ring_rank + s) % ring_size
            step, rows = _step(layout, mine, src, dst, s, members, mask, batch, device, size)
            steps.append(step)
            sent.append(rows)
        folds = make_folds([st.tiles.q_dest(batch) for st in steps], size, device)
        returned = [[rows] if rows is not None and len(rows) else [] for rows in sent[1:]]
        keys = make_folds([steps[0].tiles.k_dest(batch)] + returned, size, device)
        return RingSteps(tuple(steps), folds, keys)

    return layout.memo(("ring_steps", ring_rank, ring_size, tuple(members(ring_rank)), mask, batch, device), build)


class _KV:
    """My K/V as the messages take them: ``k_t (B*S, K, E)``, ``v_t (B*S, K, Ev)``; a message is a pair
    ``(K rows, V rows)``, two views where the rows sent are one span (no copy), else one gather of each into
    a new buffer (:func:`kv_pair`)."""

    def __init__(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        self.k_t, self.v_t = k_t, v_t

    def message(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K rows, V rows)``, ``(len(rows), K, E)`` and ``(len(rows), K, Ev)``."""
        if rows.gather is None:
            n = rows.stop - rows.start
            return self.k_t.narrow(0, rows.start, n), self.v_t.narrow(0, rows.start, n)
        k, v = kv_pair(self.k_t, self.v_t, len(rows))
        rows.take_into(self.k_t, k)
        rows.take_into(self.v_t, v)
        return k, v


def _post_kv(comm: PeerComm | None, kv: _KV, ring: RingSteps, s: int) -> Exchange:
    """Post step ``s``'s K/V exchange, one ``(K rows, V rows)`` message each way: my rows ``dst`` needs out,
    ``src``'s in (``comm``: ``None`` only for a ring of one step, which posts none)."""
    if s >= len(ring):
        return NOTHING
    if comm is None:
        raise RuntimeError("a ring of several steps needs its transport")
    step = ring.steps[s]
    send = None if step.send is None else kv.message(step.send)
    recv = kv_pair(kv.k_t, kv.v_t, step.recv) if step.recv else None
    return comm.exchange(send, step.dst, recv, step.src, tag=0)


def kv_pair(
    k: torch.Tensor, v: torch.Tensor, rows: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two empty contiguous buffers in one allocation, ``(rows, *k.shape[1:])`` and ``(rows, *v.shape[1:])``
    (K's and V's, each at its own head dim), to gather or receive a pair into (``dtype``: by default k's)."""
    k_shape, v_shape = (rows, *k.shape[1:]), (rows, *v.shape[1:])
    n = math.prod(k_shape)
    buf = k.new_empty(n + math.prod(v_shape), dtype=dtype)
    return buf[:n].view(k_shape), buf[n:].view(v_shape)


def _comm(group: RingGroup) -> PeerComm:
    """The ring's transport: ``group`` (a process group whose ranks are the ring's) or a :class:`PeerComm`
    that numbers them itself."""
    return group if isinstance(group, PeerComm) else PeerComm(group)


def ring_forward(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    group: RingGroup,
    ring: RingSteps,
    kernel: AttentionKernel,
    scale: float,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out_t, lse)``: ``(B*S, H, Ev)`` output in q's dtype and ``(H, B*S)`` fp32 lse (sinks folded in).

    Token-major ``q_t (B*S, H, E)``, ``k_t (B*S, K, E)``, ``v_t (B*S, K, Ev)``; ``ring`` from :func:`ring_steps`.
    """
    comm = _comm(group) if len(ring) > 1 else None
    results = Results(q_t, ring.folds, v_t.shape[-1])
    kv = _KV(k_t, v_t)
    pending = _post_kv(comm, kv, ring, 1)
    fold_forward(q_t, k_t, v_t, ring.steps[0].index, kernel, scale, results, 0)
    for s in range(1, len(ring)):
        buf = pending.wait()
        pending = _post_kv(comm, kv, ring, s + 1)
        if buf is not None:
            fold_forward(q_t, buf[0], buf[1], ring.steps[s].index, kernel, scale, results, s)
    return results.finish(sinks)


def ring_backward(
    dout_t: Tensor,
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    out_t: Tensor,
    lse: Tensor,
    group: RingGroup,
    ring: RingSteps,
    kernel: AttentionKernel,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq_t, dk_t, dv_t)`` token-major in the input dtype; ``out_t, lse`` as :func:`ring_forward` returned them."""
    comm = _comm(group) if len(ring) > 1 else None
    dq = Grads(q_t, ring.folds)
    dk, dv = Grads(k_t, ring.keys), Grads(v_t, ring.keys)
    kv = _KV(k_t, v_t)
    pending = _post_kv(comm, kv, ring, 1)
    dqs, dks, dvs = attend_backward(dout_t, q_t, k_t, v_t, out_t, lse, ring.steps[0].index, kernel, scale)
    dq.add(0, dqs)
    dk.add(0, dks)
    dv.add(0, dvs)
    returning = None  # (exchange, step): dK/dV of my rows on their way home from that step's dst
    for s in range(1, len(ring)):
        step = ring.steps[s]
        buf = pending.wait()
        pending = _post_kv(comm, kv, ring, s + 1)
        grad = None
        if buf is not None:
            if step.grads is None:
                raise RuntimeError(f"ring step {s} received K/V rows but has no folds for their gradients")
            dqs, dks, dvs = attend_backward(dout_t, q_t, buf[0], buf[1], out_t, lse, step.index, kernel, scale)
            dq.add(s, dqs)
            grad = received_grads(buf, step.grads, dks, dvs, step.dtype("grad", buf[0]))
        _add_home(dk, dv, returning)
        recv = kv_pair(k_t, v_t, len(step.send), step.dtype("home", k_t)) if step.send else None  # dK, dV dst read
        if comm is None:
            raise RuntimeError("a ring of several steps needs its transport")
        returning = (comm.exchange(grad, step.src, recv, step.dst, tag=1), s)
    _add_home(dk, dv, returning)
    return dq.finish(), dk.finish(), dv.finish()


def received_grads(
    buf: Tensor | Sequence[Tensor],
    folds: Folds,
    dks: list[Tensor],
    dvs: list[Tensor],
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dK, dV)``, ``(R, K, E)`` and ``(R, K, Ev)`` in ``dtype``: the gradients of the ``R`` received K/V rows
    ``buf`` (a pair) from each call's packed ``dks, dvs``, to be sent home, each row summed in one pass (the input
    dtype only where every row has one contribution, :attr:`RingStep.grad_dtype`; then a call whose packed
    keys are the received rows in order is sent as it is)."""
    return Grads.summed(buf[0], folds, dks, dtype=dtype), Grads.summed(buf[1], folds, dvs, dtype=dtype)


def _add_home(dk: Grads, dv: Grads, returning: tuple[Exchange, int] | None) -> None:
    """The gradients of my rows that a peer computed at step ``s`` (``(exchange, s)``), one more partial."""
    if returning is None:
        return
    exchange, s = returning
    grad = exchange.wait()
    if grad is not None:
        dk.add(s, [grad[0]])
        dv.add(s, [grad[1]])


def _steps(ctx: CPContext, rank: int, batch: int, device: torch.device) -> RingSteps:
    layout, _ = ctx.layout_and_kernel()
    return ring_steps(layout, rank, layout.cp_size, _alone, ctx.mask, batch, device)


def _alone(r: int) -> tuple[int, ...]:
    return (r,)


def ring_attention(
    ctx: CPContext, q: Tensor, k: Tensor, v: Tensor, group: RingGroup, rank: int
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The ring strategy's ``(out, (lse,))`` over every cp rank, on ``group`` (or a :class:`PeerComm`), this
    process being layout rank ``rank``."""
    b = q.shape[0]
    steps = _steps(ctx, rank, b, q.device)
    out_t, lse = ring_forward(
        token_major(q), token_major(k), token_major(v), group, steps, ctx.layout_and_kernel()[1], ctx.scale, ctx.sinks
    )
    return head_major(out_t, b), (lse,)


def ring_attention_backward(
    ctx: CPContext,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    saved: Sequence[Tensor],
    group: RingGroup,
    rank: int,
) -> BackwardGrads:
    """The backward of :func:`ring_attention`: ``(dq, dk, dv, dsinks)``."""
    b = q.shape[0]
    dout_t, out_t, lse = token_major(dout), token_major(out), saved[0]
    steps = _steps(ctx, rank, b, q.device)
    grads = ring_backward(
        dout_t,
        token_major(q),
        token_major(k),
        token_major(v),
        out_t,
        lse,
        group,
        steps,
        ctx.layout_and_kernel()[1],
        ctx.scale,
    )
    dsinks = None if ctx.sinks is None else sinks_grad(dout_t, out_t, lse, ctx.sinks)
    return head_major(grads[0], b), head_major(grads[1], b), head_major(grads[2], b), dsinks


def merged_query_rows(layout: SequenceLayout, rank: int, mask: Mask, batch: int) -> int:
    """Query rows of ``rank`` that see another rank's keys, once per rank they see (each one more partial
    to merge and one more dq to sum in the ring over every cp rank; host only, cached on the layout)."""

    def build() -> int:
        n = layout.cp_size
        return sum(rows_seen(layout, (rank,), ((rank - s) % n,), mask, batch)[0] for s in range(1, n))

    return layout.memo(("merged_query_rows", rank, mask, batch), build)


def _group(ctx: CPContext) -> dist.ProcessGroup | None:
    return ctx.group if ctx.layout_and_kernel()[0].cp_size > 1 else None


def rows_seen(
    layout: SequenceLayout, q_ranks: Sequence[int], k_ranks: Sequence[int], mask: Mask, batch: int
) -> tuple[int, int]:
    """``(query rows, key rows)``: ``q_ranks``' queries that see some key of ``k_ranks``, and the keys they
    see (plain causal masks in closed form)."""
    if mask == CAUSAL:
        _, q_rows, k_rows = causal_counts(layout, q_ranks, k_ranks, batch)
        return q_rows, k_rows
    tiles = tile_mask(layout, q_ranks, k_ranks, mask)
    return tiles.query_row_count(batch), tiles.key_row_count(batch)


class Ring(Strategy):
    """K/V rows travel to the ranks that need them, one peer per step (module docstring); also the one-device path."""

    name = "ring"
    keeps = ("q", "k", "v", "out")

    def ring_size(self, cp: int, ulysses_degree: int = 1) -> int:
        return cp

    def forward(self, ctx: CPContext, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        return ring_attention(ctx, q, k, v, _group(ctx), ctx.rank)

    def backward(
        self,
        ctx: CPContext,
        dout: Tensor,
        q: Tensor | None,
        k: Tensor | None,
        v: Tensor | None,
        out: Tensor | None,
        saved: Sequence[Tensor],
    ) -> BackwardGrads:
        q, k, v, out = (kept_input(t, n, self.name) for t, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out")))
        return ring_attention_backward(ctx, dout, q, k, v, out, saved, _group(ctx), ctx.rank)

    def saved_like(self, ctx: CPContext, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        b, h, s, _ = q.shape
        return (q.new_empty((h, b * s), dtype=torch.float32),)


RING = register_strategy(Ring())
