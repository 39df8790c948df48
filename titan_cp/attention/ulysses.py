"""Ulysses attention: trade the sequence split for a head split with two all-to-alls.

Each rank sends head group ``j`` of its sequence shard to rank ``j`` and receives every
rank's shard of its own head group, attends over the full sequence for those heads, and
sends the result back::

    forward    q_h   = all_to_all(q,  scatter heads, gather seq)    (B*S, H/N, E)
               kv_h  = all_to_all(kv, scatter heads, gather seq)    at their own head count, a head's K
                                                                    and V side by side (E + Ev)
               out_h = attn(q_h, kv_h)
               out   = all_to_all(out_h, scatter seq, gather heads)  (B, H, S/N, Ev)
    backward   the same three exchanges in the other direction (the dual)

Query heads must divide by N. K/V heads either divide by N (each rank gets its own
slice) or divide N, in which case each destination gets exactly the one K/V head its
query heads use: heads are replicated only as much as needed, never expanded to the
query head count; the backward sums the replicas' gradients.

The head shards are kept for the backward (the same bytes as the local q, k, v, out
they replace), so the backward moves only ``dout`` in and the gradients out.

With packed documents most of them lie whole on one rank under ``doc_local``, and such a
document needs nothing from another rank: exchanging its heads would copy every token in and
out of the exchange's buffers for no key it lacks. Where the layout keeps documents so
(:func:`stays_home`, priced from the layout alone) the call runs the ring's schedule instead,
each rank attending its own queries over every head while only the split documents' K/V travel.
:meth:`HeadExchange.schedule` (shared with hybrid) says which schedule a call runs; the op branches
on it, and the per-step metrics and the planner report it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

import torch
import torch.distributed as dist
from torch import Tensor

from titan_cp.attention.comm import all_to_all
from titan_cp.attention.context import CPContext
from titan_cp.attention.fold import tiles_backward, tiles_forward
from titan_cp.attention.merge import sinks_grad
from titan_cp.attention.ring import (
    RING,
    RingGroup,
    merged_query_rows,
    ring_attention,
    ring_attention_backward,
)
from titan_cp.attention.strategy import (
    BackwardGrads,
    Strategy,
    kept_input,
    kv_head_map,
    kv_heads_per_shard,
    register_strategy,
)
from titan_cp.attention.tiling import CAUSAL, Mask, MaskTiles, head_major, split_kv, tile_mask, token_major
from titan_cp.layout import SequenceLayout, to_device

Group = dist.ProcessGroup | None
A = TypeVar("A")


def scatter_heads(x_t: torch.Tensor, n: int, group: Group) -> torch.Tensor:
    """``(T, H, ...)`` token-major -> ``(N, T, H/N, ...)`` received: chunk ``j`` is rank ``j``'s tokens of my head group."""
    t, h = x_t.shape[:2]
    x = x_t.reshape(t, n, h // n, *x_t.shape[2:]).transpose(0, 1)
    return all_to_all(x, group)


def gather_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Inverse of :func:`scatter_heads`: ``(N, T, H/N, ...)`` (chunk ``j`` bound for rank ``j``) -> ``(T, H, ...)``."""
    y = all_to_all(x, group)  # chunk j: my tokens of head group j
    n, t = y.shape[:2]
    return y.transpose(0, 1).reshape(t, n * y.shape[2], *y.shape[3:])


def head_index(
    layout: SequenceLayout, q_heads: int, kv_heads: int, n: int, device: torch.device
) -> torch.Tensor | None:
    """The K/V head each of ``n`` destinations needs, on ``device`` (``None`` when K/V heads split
    evenly): built once per microbatch with the layout's tiles, so no layer copies it to the device."""
    heads = kv_head_map(q_heads, kv_heads, n)
    if heads is None:
        return None
    key = ("ulysses_heads", q_heads, kv_heads, n, torch.device(device))
    return layout.memo(key, lambda: to_device(torch.tensor(heads), torch.device(device)))


def kv_to_heads(k_t: Tensor, v_t: Tensor, heads: torch.Tensor | None, n: int, group: Group) -> torch.Tensor:
    """``(N, T, K', E + Ev)``: every rank's tokens of the K/V heads my query heads use (K' = max(1, K/N)), each
    head's K and V side by side in its last dim (:func:`split_kv`), whatever V's head dim.

    ``heads``: :func:`head_index` (``None`` when the K/V heads split evenly over the ``n`` ranks).
    """
    if heads is not None:
        kv = torch.cat([k_t, v_t], dim=-1).index_select(1, heads)  # (T, N, E + Ev): one head per destination
        return scatter_heads(kv, n, group)
    t, kv_heads, e = k_t.shape
    kv = k_t.new_empty((n, t, kv_heads // n, e + v_t.shape[-1]))  # the send buffer, head groups first
    for part, x in zip(split_kv(kv, e), (k_t, v_t)):  # one copy each into it: a head carries its K and V
        part.copy_(x.reshape(t, n, kv_heads // n, x.shape[-1]).transpose(0, 1))
    return all_to_all(kv, group)


def kv_from_heads(dkv_h: torch.Tensor, heads: torch.Tensor | None, kv_heads: int, group: Group) -> torch.Tensor:
    """Dual of :func:`kv_to_heads`: ``(N, T, K', E + Ev)`` gradients bound for each rank -> mine ``(T, K, E + Ev)``."""
    dkv = gather_heads(dkv_h, group)  # (T, N*K', E + Ev)
    if heads is None:
        return dkv
    out = dkv.new_zeros((dkv.shape[0], kv_heads) + tuple(dkv.shape[2:]))
    return out.index_add_(1, heads, dkv)  # replicas' gradients summed


MERGED_SHARE = 0.25  # most rows reached by several segments for which the shards' order is kept


def stacked_to_concat(x: torch.Tensor, batch: int) -> torch.Tensor:
    """``(U, B*S, ...)`` stacked by member -> ``(B*U*S, ...)``: each row holds the members' shards in order
    (a view for one row)."""
    u, n = x.shape[:2]
    return x.reshape(u, batch, n // batch, *x.shape[2:]).transpose(0, 1).reshape(u * n, *x.shape[2:])


def concat_to_stacked(x: torch.Tensor, batch: int, u: int) -> torch.Tensor:
    """Inverse of :func:`stacked_to_concat`."""
    n = x.shape[0] // u
    return x.reshape(batch, u, n // batch, *x.shape[1:]).transpose(0, 1).reshape(u, n, *x.shape[1:])


def _row_tiles(ctx: CPContext, batch: int) -> tuple[MaskTiles, Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """``(tiles, inward, outward)``: the mask's tiles over the full row and the maps from the all-to-all's
    stacked shards to its buffer and back. The buffer is the shards in rank order (no reordering) when
    at most :data:`MERGED_SHARE` of its rows are then reached by several segments (documents mostly whole
    on their rank, as ``doc_local`` keeps them: only the split ones merge); else the natural order, one
    gather in and one scatter out, where every document is one run."""
    layout, _ = ctx.layout_and_kernel()
    n = layout.cp_size
    ranks = tuple(range(n))
    concat = tile_mask(layout, ranks, ranks, ctx.mask)
    merged = layout.memo(("ulysses_merged", ctx.mask, batch), lambda: _merged_rows(concat, batch))
    if merged <= MERGED_SHARE * batch * layout.seq_len:
        return concat, (lambda x: stacked_to_concat(x, batch)), (lambda x: concat_to_stacked(x, batch, n))
    return (
        tile_mask(layout, None, None, ctx.mask),
        lambda x: layout.stacked_to_natural(x, batch),
        lambda x: layout.natural_to_stacked(x, batch),
    )


def _merged_rows(tiles: MaskTiles, batch: int) -> int:
    """Query rows of ``tiles`` that several segments reach (host)."""
    rows = torch.cat(tiles.q_dest(batch)) if tiles.q_dest(batch) else torch.zeros(0, dtype=torch.int64)
    return int((torch.bincount(rows) > 1).sum()) if len(rows) else 0


@overload
def head_slice(sinks: torch.Tensor, part: int, parts: int) -> torch.Tensor: ...
@overload
def head_slice(sinks: None, part: int, parts: int) -> None: ...
def head_slice(sinks: torch.Tensor | None, part: int, parts: int) -> torch.Tensor | None:
    """The sink logits of head group ``part`` of ``parts`` (the heads :func:`scatter_heads` sends there)."""
    if sinks is None:
        return None
    n = sinks.shape[0] // parts
    return sinks[part * n : (part + 1) * n]


def head_slice_grad(grad: torch.Tensor, sinks: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    """``grad`` of head group ``part``'s sinks placed in a zero gradient of all the sinks: summed over the
    ranks (as FSDP sums every gradient over cp), the groups make up the whole."""
    full = torch.zeros(sinks.shape, dtype=torch.float32, device=grad.device)
    n = sinks.shape[0] // parts
    full[part * n : (part + 1) * n] = grad
    return full


def head_shards_like(q: Tensor, k: Tensor, v: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Empty ``(q_h, kv_h, out_h, lse_h)`` as an all-to-all over ``n`` ranks leaves them (the fake op's outputs)."""
    b, h, s, e = q.shape
    q_h = q.new_empty((b * s * n, h // n, e))
    return (
        q_h,
        k.new_empty((b * s * n, kv_heads_per_shard(h, k.shape[1], n), e + v.shape[-1])),
        q.new_empty((b * s * n, h // n, v.shape[-1])),
        q.new_empty((h // n, b * s * n), dtype=torch.float32),
    )


@dataclass(frozen=True)
class Heads(Generic[A]):
    """How one call exchanges heads: over ``group`` of ``n`` ranks (this one ``part``), K/V heads picked by
    ``kv`` (:func:`head_index`), the received shards put in the attention's buffer order by ``inward`` and
    back by ``outward``; ``attend``: what the strategy attends with (its tiles, or its ring)."""

    n: int
    group: Group
    part: int
    kv: torch.Tensor | None
    inward: Callable[[Tensor], Tensor]
    outward: Callable[[Tensor], Tensor]
    attend: A


HOME_MERGES = 1.6
"""Query rows merged with another rank's partial in the ring's schedule, summed over the ranks, per token of
the row, up to which that schedule moves less around the kernel than the head exchange: beyond it long
documents split over many ranks gather their tiles at every ring step, while the head exchange moves the
same bytes for any documents. Set from the counting model's rows in
``benchmarks/results/2026-12-02-home-schedule.md``."""


def stays_home(layout: SequenceLayout, mask: Mask, batch: int) -> bool:
    """Whether ``layout``'s documents mostly stay whole on their ranks (at most :data:`HOME_MERGES` remote
    partials merged a token), so that the ring's schedule over every cp rank (each rank attends its own
    queries, only the split documents' K/V travel) moves less around the kernel than the head exchange
    (every token's heads exchanged): the layout's half of :meth:`HeadExchange.schedule`. Host only, the
    same on every rank, cached on the layout."""

    def build() -> bool:
        merged = sum(merged_query_rows(layout, r, mask, batch) for r in range(layout.cp_size))
        return merged <= HOME_MERGES * batch * layout.seq_len

    return layout.memo(("stays_home", mask, batch), build)


class HeadExchange(Strategy, Generic[A]):
    """A strategy that attends on head shards: Ulysses, and hybrid's Ulysses groups.

    Without documents (or one a row) every token's heads are exchanged and the head shards are kept
    for the backward. With documents (``doc_lens`` of several a row) a document whole on one rank
    needs nothing from any other, so where the layout keeps most documents whole (:func:`stays_home`,
    ``doc_local``'s packed rows) the call runs the ring's schedule over every cp rank instead
    (:meth:`schedule`): each rank attends its own queries over every head, and only the split
    documents' K/V travel. Either
    way the op then keeps its own q, k, v, out and the log-sum-exp (what it keeps may depend on the
    ``doc_lens`` tensor's width, known when the op is traced, not on the lengths), and the head
    exchange sends q, K/V and out again in the backward.
    """

    def kept(self, documents: bool) -> tuple[str, ...]:
        return ("q", "k", "v", "out") if documents else ()

    # ------------------------------------------------------------------ the strategy's part
    def heads(self, ctx: CPContext, batch: int, device: torch.device) -> Heads[A]:
        """The exchange of one call on ``ctx``'s layout."""
        raise NotImplementedError

    def attend(
        self, ctx: CPContext, x: Heads[A], q_h: Tensor, k_h: Tensor, v_h: Tensor, batch: int, sinks: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """``(out_h, lse_h)`` on the head shards."""
        raise NotImplementedError

    def attend_backward(
        self,
        ctx: CPContext,
        x: Heads[A],
        dout_h: Tensor,
        q_h: Tensor,
        k_h: Tensor,
        v_h: Tensor,
        out_h: Tensor,
        lse_h: Tensor,
        batch: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq_h, dk_h, dv_h)`` on the head shards."""
        raise NotImplementedError

    def ring_group(self, ctx: CPContext) -> RingGroup:
        """The transport of a ring over every cp rank in layout order: a process group or a
        :class:`~titan_cp.attention.comm.PeerComm`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the op
    def schedule(
        self,
        layout: SequenceLayout | None,
        mask: Mask = CAUSAL,
        batch: int | None = None,
        documents: bool | None = None,
    ) -> str:
        """``"ring"`` (the ring's schedule over every cp rank) where the call has several documents a row and
        the layout keeps them mostly whole on their ranks (:func:`stays_home`); else this strategy's own head
        exchange (its name). Without a layout, the head exchange."""
        if layout is None:
            return self.name
        documents = layout.packs_documents if documents is None else documents
        rows = batch if batch is not None else (layout.batch_size or 1)
        return RING.name if documents and stays_home(layout, mask, rows) else self.name

    def _runs_ring(self, ctx: CPContext, batch: int) -> bool:
        """Whether this call runs the ring's schedule (:meth:`schedule`, on the call's own ``doc_lens`` width)."""
        return self.schedule(ctx.layout_and_kernel()[0], ctx.mask, batch, ctx.documents) == RING.name

    def _to_heads(self, x: Heads[A], q_t: Tensor, k_t: Tensor, v_t: Tensor) -> tuple[Tensor, Tensor]:
        return x.inward(scatter_heads(q_t, x.n, x.group)), x.inward(kv_to_heads(k_t, v_t, x.kv, x.n, x.group))

    def forward(self, ctx: CPContext, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        batch = q.shape[0]
        if self._runs_ring(ctx, batch):
            return ring_attention(ctx, q, k, v, self.ring_group(ctx), self._layout_rank(ctx))
        x = self.heads(ctx, batch, q.device)
        q_h, kv_h = self._to_heads(x, token_major(q), token_major(k), token_major(v))
        sinks = head_slice(ctx.sinks, x.part, x.n)
        out_h, lse_h = self.attend(ctx, x, q_h, *split_kv(kv_h, q.shape[-1]), batch, sinks)
        out = head_major(gather_heads(x.outward(out_h), x.group), batch)
        if ctx.documents:  # kept as the (H, B*S) tensor the op declares: the same numbers, not moved
            return out, (lse_h.view(-1, lse_h.shape[1] // x.n),)
        return out, (q_h, kv_h, out_h, lse_h)

    def _layout_rank(self, ctx: CPContext) -> int:
        if ctx.mesh is None:
            raise RuntimeError(f"strategy {self.name!r} runs on a cp mesh; one device runs the ring's one step")
        return self.layout_rank(ctx.mesh)

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
        batch = dout.shape[0]
        if self._runs_ring(ctx, batch):
            q, k, v, out = (kept_input(t, n, self.name) for t, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out")))
            return ring_attention_backward(ctx, dout, q, k, v, out, saved, self.ring_group(ctx), self._layout_rank(ctx))
        x = self.heads(ctx, batch, dout.device)
        if ctx.documents:  # the head shards were not kept: sent again
            q, k, v, out = (kept_input(t, n, self.name) for t, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out")))
            q_h, kv_h = self._to_heads(x, token_major(q), token_major(k), token_major(v))
            out_h = x.inward(scatter_heads(token_major(out), x.n, x.group))
            lse_h = saved[0].view(-1, saved[0].shape[1] * x.n)
        else:
            q_h, kv_h, out_h, lse_h = saved
        dout_h = x.inward(scatter_heads(token_major(dout), x.n, x.group))
        e = q_h.shape[-1]
        dq_h, dk_h, dv_h = self.attend_backward(ctx, x, dout_h, q_h, *split_kv(kv_h, e), out_h, lse_h, batch)
        dq = gather_heads(x.outward(dq_h), x.group)
        dkv = kv_from_heads(x.outward(torch.cat([dk_h, dv_h], dim=-1)), x.kv, ctx.kv_heads, x.group)
        dsinks = None
        if ctx.sinks is not None:
            grad = sinks_grad(dout_h, out_h, lse_h, head_slice(ctx.sinks, x.part, x.n))
            dsinks = head_slice_grad(grad, ctx.sinks, x.part, x.n)
        dk, dv = split_kv(dkv, e)
        return head_major(dq, batch), head_major(dk, batch), head_major(dv, batch), dsinks

    def qk_head_dim(self, q: Tensor | None, k: Tensor | None, saved: Sequence[Tensor]) -> int:
        """Without documents neither q nor k is kept: the head shard of q (``saved[0]``) has their head dim."""
        return saved[0].shape[-1] if q is None and k is None else super().qk_head_dim(q, k, saved)

    def saved_like(self, ctx: CPContext, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        if ctx.documents:
            return (q.new_empty((q.shape[1], q.shape[0] * q.shape[2]), dtype=torch.float32),)
        if ctx.mesh is None:
            raise RuntimeError(f"strategy {self.name!r} runs on a cp mesh; one device runs the ring's one step")
        return head_shards_like(q, k, v, self.ulysses_size(ctx.cp_size, self.mesh_ulysses_degree(ctx.mesh)))


class Ulysses(HeadExchange[MaskTiles]):
    """All-to-all from sequence shards to head shards and back (module docstring)."""

    name = "ulysses"

    def ulysses_size(self, cp: int, ulysses_degree: int = 1) -> int:
        return cp

    def heads(self, ctx: CPContext, batch: int, device: torch.device) -> Heads[MaskTiles]:
        layout, _ = ctx.layout_and_kernel()
        n = layout.cp_size
        tiles, inward, outward = _row_tiles(ctx, batch)
        kv = head_index(layout, ctx.q_heads, ctx.kv_heads, n, device)
        return Heads(n, ctx.group, ctx.rank, kv, inward, outward, tiles)

    def attend(
        self,
        ctx: CPContext,
        x: Heads[MaskTiles],
        q_h: Tensor,
        k_h: Tensor,
        v_h: Tensor,
        batch: int,
        sinks: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        return tiles_forward(q_h, k_h, v_h, batch, x.attend, ctx.layout_and_kernel()[1], ctx.scale, sinks)

    def attend_backward(
        self,
        ctx: CPContext,
        x: Heads[MaskTiles],
        dout_h: Tensor,
        q_h: Tensor,
        k_h: Tensor,
        v_h: Tensor,
        out_h: Tensor,
        lse_h: Tensor,
        batch: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return tiles_backward(
            dout_h, q_h, k_h, v_h, out_h, lse_h, batch, x.attend, ctx.layout_and_kernel()[1], ctx.scale
        )

    def ring_group(self, ctx: CPContext) -> RingGroup:
        return ctx.group if ctx.cp_size > 1 else None


ULYSSES = register_strategy(Ulysses())
