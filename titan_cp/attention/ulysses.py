"""Ulysses attention: trade the sequence split for a head split with two all-to-alls.

Each rank sends head group ``j`` of its sequence shard to rank ``j`` and receives every
rank's shard of its own head group, attends over the full sequence for those heads, and
sends the result back::

    forward    q_h   = all_to_all(q,  scatter heads, gather seq)    (B*S, H/N, E)
               kv_h  = all_to_all(kv, scatter heads, gather seq)    at their own head count
               out_h = attn(q_h, kv_h)
               out   = all_to_all(out_h, scatter seq, gather heads)  (B, H, S/N, E)
    backward   the same three exchanges in the other direction (the dual)

Query heads must divide by N. K/V heads either divide by N (each rank gets its own
slice) or divide N, in which case each destination gets exactly the one K/V head its
query heads use: heads are replicated only as much as needed, never expanded to the
query head count; the backward sums the replicas' gradients.

The head shards are kept for the backward (the same bytes as the local q, k, v, out
they replace), so the backward moves only ``dout`` in and the gradients out.
"""

from __future__ import annotations

import torch

from titan_cp.attention.comm import all_to_all
from titan_cp.attention.context import CPContext
from titan_cp.attention.fold import plan_backward, plan_forward
from titan_cp.attention.mask_plans import head_major, make_plan, token_major
from titan_cp.attention.merge import sinks_grad
from titan_cp.attention.strategy import Strategy, kv_head_map, kv_heads_per_shard, register_strategy
from titan_cp.layout import SequenceLayout, to_device


def scatter_heads(x_t: torch.Tensor, n: int, group) -> torch.Tensor:
    """``(T, H, ...)`` token-major -> ``(N, T, H/N, ...)`` received: chunk ``j`` is rank ``j``'s tokens of my head group."""
    t, h = x_t.shape[:2]
    x = x_t.reshape(t, n, h // n, *x_t.shape[2:]).transpose(0, 1)
    return all_to_all(x, group)


def gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`scatter_heads`: ``(N, T, H/N, ...)`` (chunk ``j`` bound for rank ``j``) -> ``(T, H, ...)``."""
    y = all_to_all(x, group)  # chunk j: my tokens of head group j
    n, t = y.shape[:2]
    return y.transpose(0, 1).reshape(t, n * y.shape[2], *y.shape[3:])


def head_index(layout: SequenceLayout, q_heads: int, kv_heads: int, n: int, device) -> torch.Tensor | None:
    """The K/V head each of ``n`` destinations needs, on ``device`` (``None`` when K/V heads split
    evenly): built once per microbatch with the layout's plans, so no layer copies it to the device."""
    heads = kv_head_map(q_heads, kv_heads, n)
    if heads is None:
        return None
    key = ("ulysses_heads", q_heads, kv_heads, n, torch.device(device))
    return layout.memo(key, lambda: to_device(torch.tensor(heads), torch.device(device)))


def kv_to_heads(k_t, v_t, heads: torch.Tensor | None, n: int, group) -> torch.Tensor:
    """``(N, T, K', 2, E)``: every rank's tokens of the K/V heads my query heads use (K' = max(1, K/N)).

    ``heads``: :func:`head_index` (``None`` when the K/V heads split evenly over the ``n`` ranks).
    """
    if heads is not None:
        kv = torch.stack([k_t, v_t], dim=2).index_select(1, heads)  # (T, N, 2, E): one head per destination
        return scatter_heads(kv, n, group)
    t, kv_heads = k_t.shape[:2]
    kv = k_t.new_empty((n, t, kv_heads // n, 2) + tuple(k_t.shape[2:]))  # the send buffer, head groups first
    for i, x in enumerate((k_t, v_t)):  # one copy each into it: a head carries its K and V
        kv[:, :, :, i].copy_(x.reshape(t, n, kv_heads // n, *x.shape[2:]).transpose(0, 1))
    return all_to_all(kv, group)


def kv_from_heads(dkv_h: torch.Tensor, heads: torch.Tensor | None, kv_heads: int, group) -> torch.Tensor:
    """Dual of :func:`kv_to_heads`: ``(N, T, K', 2, E)`` gradients bound for each rank -> mine ``(T, K, 2, E)``."""
    dkv = gather_heads(dkv_h, group)  # (T, N*K', 2, E)
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


def _plan(ctx: CPContext, batch: int):
    """``(plan, inward, outward)``: the mask plan over the full row and the maps from the all-to-all's
    stacked shards to its buffer and back. The buffer is the shards in rank order (no reordering) when
    at most :data:`MERGED_SHARE` of its rows are then reached by several segments (documents mostly whole
    on their rank, as ``doc_local`` keeps them: only the split ones merge); else the natural order, one
    gather in and one scatter out, where every document is one run."""
    layout, n = ctx.layout, ctx.layout.cp_size
    ranks = tuple(range(n))
    concat = make_plan(layout, ranks, ranks, ctx.mask)
    merged = layout.memo(("ulysses_merged", ctx.mask, batch), lambda: _merged_rows(concat, batch))
    if merged <= MERGED_SHARE * batch * layout.seq_len:
        return concat, (lambda x: stacked_to_concat(x, batch)), (lambda x: concat_to_stacked(x, batch, n))
    return (
        make_plan(layout, None, None, ctx.mask),
        lambda x: layout.stacked_to_natural(x, batch),
        lambda x: layout.natural_to_stacked(x, batch),
    )


def _merged_rows(plan, batch: int) -> int:
    """Query rows of ``plan`` that several segments reach (host)."""
    rows = torch.cat(plan.q_dest(batch)) if plan.q_dest(batch) else torch.zeros(0, dtype=torch.int64)
    return int((torch.bincount(rows) > 1).sum()) if len(rows) else 0


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


def head_shards_like(q, k, n: int):
    """Empty ``(q_h, kv_h, out_h, lse_h)`` as an all-to-all over ``n`` ranks leaves them (the fake op's outputs)."""
    b, h, s, e = q.shape
    q_h = q.new_empty((b * s * n, h // n, e))
    return (
        q_h,
        k.new_empty((b * s * n, kv_heads_per_shard(h, k.shape[1], n), 2, e)),
        torch.empty_like(q_h),
        q.new_empty((h // n, b * s * n), dtype=torch.float32),
    )


def head_shard_saved_bytes(act_bytes: int, q_heads: int, kv_heads: int, head_dim: int, n: int) -> float:
    """Bytes per local token of the head shards Ulysses keeps: q_h and out_h (the bytes of q and out),
    K/V at the heads each shard needs for ``n`` times the tokens, the lse; and ``wo``'s input, since
    the op keeps no ``out``."""
    a, h, e = act_bytes, q_heads, head_dim
    return 2 * a * h * e + 2 * a * kv_heads_per_shard(h, kv_heads, n) * n * e + 4 * h + a * h * e


class Ulysses(Strategy):
    """All-to-all from sequence shards to head shards and back (module docstring)."""

    name = "ulysses"

    def ulysses_size(self, cp: int, ulysses_degree: int = 1) -> int:
        return cp

    def forward(self, ctx: CPContext, q, k, v):
        batch, group, n, layout = q.shape[0], ctx.group, ctx.layout.cp_size, ctx.layout
        heads = head_index(layout, ctx.q_heads, ctx.kv_heads, n, q.device)
        plan, inward, outward = _plan(ctx, batch)
        q_h = inward(scatter_heads(token_major(q), n, group))  # (B*S_full, H/N, E)
        kv_h = inward(kv_to_heads(token_major(k), token_major(v), heads, n, group))
        k_h, v_h = kv_h[:, :, 0], kv_h[:, :, 1]
        sinks = head_slice(ctx.sinks, ctx.rank, n)
        out_h, lse_h = plan_forward(q_h, k_h, v_h, batch, plan, ctx.kernel, ctx.scale, sinks)
        out = gather_heads(outward(out_h), group)  # (B*S, H, E)
        return head_major(out, batch), (q_h, kv_h, out_h, lse_h)

    def backward(self, ctx: CPContext, dout, q, k, v, out, saved):
        q_h, kv_h, out_h, lse_h = saved
        layout, group, n = ctx.layout, ctx.group, ctx.layout.cp_size
        batch = dout.shape[0]
        heads = head_index(layout, ctx.q_heads, ctx.kv_heads, n, dout.device)
        plan, inward, outward = _plan(ctx, batch)
        dout_h = inward(scatter_heads(token_major(dout), n, group))
        dq_h, dk_h, dv_h = plan_backward(
            dout_h, q_h, kv_h[:, :, 0], kv_h[:, :, 1], out_h, lse_h, batch, plan, ctx.kernel, ctx.scale
        )
        dq = gather_heads(outward(dq_h), group)
        dkv = kv_from_heads(outward(torch.stack([dk_h, dv_h], dim=2)), heads, ctx.kv_heads, group)
        dsinks = None
        if ctx.sinks is not None:
            grad = sinks_grad(dout_h, out_h, lse_h, head_slice(ctx.sinks, ctx.rank, n))
            dsinks = head_slice_grad(grad, ctx.sinks, ctx.rank, n)
        return head_major(dq, batch), head_major(dkv[:, :, 0], batch), head_major(dkv[:, :, 1], batch), dsinks

    def saved_like(self, ctx: CPContext, q, k, v):
        return head_shards_like(q, k, ctx.cp_size)

    def local_head_pairs(self, layout, rank, mask, batch, q_heads, ulysses_degree=1) -> int:
        """The whole row's pairs for 1/N of the heads."""
        return make_plan(layout, None, None, mask).pairs(batch) * q_heads // layout.cp_size

    def min_bytes(self, q, k, cp, ulysses_degree=1, backward=True, layout=None, rank=None, mask=None) -> int:
        """All-to-all traffic: (N-1)/N of q, of the K/V each rank must ship, and of the output; the
        backward moves the same amounts the other way. The layout does not change it (heads move, not rows)."""
        if cp == 1:
            return 0
        kv_heads = max(k.shape[1], cp) if kv_head_map(q.shape[1], k.shape[1], cp) else k.shape[1]
        kv = 2 * kv_heads * k[:, :1].numel() * k.element_size()
        qb = q.numel() * q.element_size()
        fwd = (2 * qb + kv) * (cp - 1) // cp
        return fwd * (2 if backward else 1)

    def saved_bytes_per_token(self, act_bytes, q_heads, kv_heads, head_dim, cp, ulysses_degree=1) -> float:
        return head_shard_saved_bytes(act_bytes, q_heads, kv_heads, head_dim, cp)

    def buffer_bytes(self, act_bytes, q_heads, kv_heads, head_dim, local_tokens, cp, ulysses_degree=1) -> int:
        """The all-to-all's send and receive copies of the local K/V, and the stacked pair."""
        if cp == 1:
            return 0
        return 3 * 2 * kv_heads * head_dim * local_tokens * act_bytes


ULYSSES = register_strategy(Ulysses())
