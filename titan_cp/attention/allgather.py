"""All-gather attention (the Llama 3 recipe): every rank gets the K/V it can see, attends its local queries.

Rank ``r`` needs ``need(r, j)`` of rank ``j``'s K/V: the rows some query of ``r`` can see (from the
layout and the mask, known to every rank, so no size is exchanged). One collective, an
all-to-all with uneven sizes, hands every rank at once what it needs of every other rank: what
an all-gather gives, without the rows nobody there reads. K/V travel at their own head count
(GQA is never expanded before the collective). The key buffer is the rank's own K/V followed by
the received rows, the collective writing straight into it; one set of tiles (the local queries on the
whole row) reads it::

    keys       = [kv_r, kv_j[need(r, j)] for j != r]            sum_i |need(i, r)| rows out of rank r
                 (a row: its K and V side by side, each at its own head dim)
    forward    out_r = attn(q_r, keys)
    backward   dkv_r = dkeys[own part] + the dual collective of dkeys[received]  (fp32, each peer's share)
               dq_r  = dattn_q(q_r, keys)

Each gradient is summed in one pass (:func:`titan_cp.attention.fused.add_into`): the received rows'
straight into the buffer the dual collective sends, the own rows' from the kernel's packed output
and what the peers sent back, written once; a row only one packed row reads is copied.

Without documents every rank needs nearly all of the earlier ranks' K/V, as the classic all-gather
moves them; under
``doc_local`` a document whole on one rank is never sent; with a sliding window only the rows
another rank's window reaches. The key buffer is kept for the backward (instead of the whole
row's K/V), so the backward moves only the gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from titan_cp.attention.comm import all_to_all_uneven
from titan_cp.attention.context import CPContext
from titan_cp.attention.fold import (
    Folds,
    Grads,
    Results,
    attend_backward,
    fold_forward,
    make_folds,
)
from titan_cp.attention.merge import sinks_grad
from titan_cp.attention.strategy import BackwardGrads, Strategy, kept_input, register_strategy
from titan_cp.attention.tiling import Mask, TileIndex, head_major, split_kv, tile_mask, token_major
from titan_cp.layout import SequenceLayout, to_device


@dataclass(frozen=True)
class Gather:
    """One rank's exchange, built once per microbatch.

    ``send``: device rows of my buffer sent to the other ranks, what each needs, in rank order;
    ``send_splits``/``recv_splits``: rows to and from each rank (0 to and from myself);
    ``folds``: where the queries' results go; ``own``: where the gradients of my K/V rows come from (the
    packed key rows of each call, then the rows the peers send back, in ``send`` order);
    ``received_folds``: where those of the received rows come from (the packed key rows of each call);
    ``active``: whether any rank exports anything (the collective runs on every rank, or on none).
    """

    send: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    index: TileIndex
    folds: Folds
    own: Folds
    received_folds: Folds
    active: bool

    @property
    def received(self) -> int:
        return sum(self.recv_splits)


def gather_exchange(layout: SequenceLayout, rank: int, mask: Mask, batch: int, device: torch.device) -> Gather:
    """The :class:`Gather` of ``rank`` (cached on the layout)."""

    def build() -> Gather:
        n, local = layout.cp_size, batch * layout.local_len
        need = lambda i, j: tile_mask(layout, (i,), (j,), mask).key_rows(batch)  # noqa: E731 - rows of j i sees
        wanted = {j: need(rank, j) for j in range(n) if j != rank}
        key_map = torch.full((batch * layout.seq_len,), -1, dtype=torch.int64)  # natural row -> key buffer row
        key_map[_natural_rows(layout, rank, batch)] = torch.arange(local)
        offset = local
        for j, rows in wanted.items():
            key_map[_natural_rows(layout, j, batch)[rows]] = offset + torch.arange(len(rows))
            offset += len(rows)
        tiles = tile_mask(layout, (rank,), None, mask)
        index = tiles.index(batch, device, (("gathered", rank), key_map))
        folds = make_folds([tiles.q_dest(batch)], local, device)
        given = [need(i, rank) if i != rank else torch.zeros(0, dtype=torch.int64) for i in range(n)]
        send = torch.cat(given)
        keys = tiles.k_dest(batch, key_map)
        minus = torch.tensor(-1)
        own = make_folds([[torch.where(d < local, d, minus) for d in keys] + [send]], local, device)
        received = make_folds([[torch.where(d >= local, d - local, minus) for d in keys]], offset - local, device)
        send_splits = [len(g) for g in given]
        recv_splits = [0 if j == rank else len(wanted[j]) for j in range(n)]
        active = any(len(need(i, j)) for i in range(n) for j in range(n) if i != j)
        return Gather(to_device(send, device), send_splits, recv_splits, index, folds, own, received, active)

    return layout.memo(("gather", rank, mask, batch, torch.device(device)), build)


def key_buffer(k_t: Tensor, v_t: Tensor, received: int) -> Tensor:
    """``(B*S + received, K, E + Ev)``: my K/V rows first, each row's K then its V along the last dim (one
    buffer the collective writes the received rows into, however V's head dim compares with K's), then
    room for the ``received`` rows."""
    n = k_t.shape[0]
    keys = k_t.new_empty((n + received, k_t.shape[1], k_t.shape[-1] + v_t.shape[-1]))
    torch.cat([k_t, v_t], dim=-1, out=keys[:n])
    return keys


def _natural_rows(layout: SequenceLayout, rank: int, batch: int) -> torch.Tensor:
    """The natural token-major row (``b * seq_len + position``) of each row of ``rank``'s buffer."""
    index = layout.index(rank)
    index = index.expand(batch, -1) if index.dim() == 1 else index
    return (index + layout.seq_len * torch.arange(batch).unsqueeze(1)).reshape(-1)


class AllGather(Strategy):
    """Gather what other ranks can see of each rank's K/V, attend the local queries (module docstring)."""

    name = "allgather"
    keeps = ("q", "out")

    def forward(self, ctx: CPContext, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        batch = q.shape[0]
        layout, kernel = ctx.layout_and_kernel()
        g = gather_exchange(layout, ctx.rank, ctx.mask, batch, q.device)
        k_t, v_t, q_t = token_major(k), token_major(v), token_major(q)
        keys = key_buffer(k_t, v_t, g.received)
        if g.active:
            kv = keys[: k_t.shape[0]]
            all_to_all_uneven(kv.index_select(0, g.send), g.send_splits, g.recv_splits, ctx.group, keys[k_t.shape[0] :])
        results = Results(q_t, g.folds, v_t.shape[-1])
        fold_forward(q_t, *split_kv(keys, k_t.shape[-1]), g.index, kernel, ctx.scale, results, 0)
        out_t, lse = results.finish(ctx.sinks)
        return head_major(out_t, batch), (lse, keys)

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
        lse, keys = saved
        q, out = kept_input(q, "q", self.name), kept_input(out, "out", self.name)
        batch = q.shape[0]
        layout, kernel = ctx.layout_and_kernel()
        g = gather_exchange(layout, ctx.rank, ctx.mask, batch, q.device)
        dout_t, q_t, out_t = token_major(dout), token_major(q), token_major(out)
        local, e = q_t.shape[0], q_t.shape[-1]
        dqs, dks, dvs = attend_backward(dout_t, q_t, *split_kv(keys, e), out_t, lse, g.index, kernel, ctx.scale)
        back = keys.new_empty((g.received,) + tuple(keys.shape[1:]), dtype=torch.float32)  # what goes home
        for part, grads in zip(split_kv(back, e), (dks, dvs)):
            Grads.summed(part, g.received_folds, grads, out=part)
        home = back.new_empty((len(g.send),) + tuple(back.shape[1:]))
        if g.active:  # each peer's gradients of the rows it received go back to it
            all_to_all_uneven(back, g.recv_splits, g.send_splits, ctx.group, home)
        dk, dv = (
            Grads.summed(mine, g.own, grads + [peers])
            for mine, peers, grads in zip(split_kv(keys[:local], e), split_kv(home, e), (dks, dvs))
        )
        dq = Grads.summed(q_t, g.folds, dqs)
        dsinks = None if ctx.sinks is None else sinks_grad(dout_t, out_t, lse, ctx.sinks)
        return head_major(dq, batch), head_major(dk, batch), head_major(dv, batch), dsinks

    def saved_like(self, ctx: CPContext, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        """The key buffer's length depends on the documents (what other ranks can see): a dynamic size."""
        b, h, s, e = q.shape
        rows = torch.library.get_ctx().new_dynamic_size()
        return q.new_empty((h, b * s), dtype=torch.float32), k.new_empty((rows, k.shape[1], e + v.shape[-1]))


ALLGATHER = register_strategy(AllGather())
