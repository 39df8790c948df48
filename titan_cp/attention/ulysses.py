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

from titan_cp.attention.block import head_major, make_plan, plan_backward, plan_forward, token_major
from titan_cp.attention.comm import all_to_all
from titan_cp.attention.context import CPContext

KEEPS = ()


def kv_head_map(q_heads: int, kv_heads: int, n: int) -> list[int] | None:
    """The K/V head each of ``n`` head groups needs, or ``None`` when ``kv_heads`` splits evenly."""
    if q_heads % n:
        raise ValueError(f"ulysses needs the query heads ({q_heads}) to be divisible by its cp size ({n})")
    if kv_heads % n == 0:
        return None
    if n % kv_heads:
        raise ValueError(f"ulysses needs the K/V heads ({kv_heads}) to divide, or be divisible by, its cp size ({n})")
    group = q_heads // kv_heads
    return [(j * q_heads // n) // group for j in range(n)]


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


def kv_to_heads(k_t, v_t, q_heads: int, n: int, group) -> torch.Tensor:
    """``(N, T, K', 2, E)``: every rank's tokens of the K/V heads my query heads use (K' = max(1, K/N))."""
    kv = torch.stack([k_t, v_t], dim=2)  # (T, K, 2, E): a head carries its K and V
    heads = kv_head_map(q_heads, k_t.shape[1], n)
    if heads is not None:
        kv = kv.index_select(1, torch.tensor(heads, device=kv.device))  # one head per destination
    return scatter_heads(kv, n, group)


def kv_from_heads(dkv_h: torch.Tensor, q_heads: int, kv_heads: int, n: int, group) -> torch.Tensor:
    """Dual of :func:`kv_to_heads`: ``(N, T, K', 2, E)`` gradients bound for each rank -> mine ``(T, K, 2, E)``."""
    heads = kv_head_map(q_heads, kv_heads, n)
    dkv = gather_heads(dkv_h, group)  # (T, N*K', 2, E)
    if heads is None:
        return dkv
    out = dkv.new_zeros((dkv.shape[0], kv_heads) + tuple(dkv.shape[2:]))
    return out.index_add_(1, torch.tensor(heads, device=dkv.device), dkv)  # replicas' gradients summed


def _plan(ctx: CPContext):
    return make_plan(ctx.layout, None, None, ctx.causal)


def forward(ctx: CPContext, q, k, v):
    batch, group, n, layout = q.shape[0], ctx.group, ctx.layout.cp_size, ctx.layout
    # natural token order: each document is one run, one causal tile
    q_h = layout.stacked_to_natural(scatter_heads(token_major(q), n, group), batch)  # (B*S_full, H/N, E)
    kv_h = layout.stacked_to_natural(kv_to_heads(token_major(k), token_major(v), q.shape[1], n, group), batch)
    k_h, v_h = kv_h[:, :, 0], kv_h[:, :, 1]
    out_h, lse_h = plan_forward(q_h, k_h, v_h, batch, _plan(ctx), ctx.kernel, ctx.scale)
    out = gather_heads(layout.natural_to_stacked(out_h, batch), group)  # (B*S, H, E)
    return head_major(out, batch), (q_h, kv_h, out_h, lse_h)


def backward(ctx: CPContext, dout, q, k, v, out, saved):
    q_h, kv_h, out_h, lse_h = saved
    layout, group, n = ctx.layout, ctx.group, ctx.layout.cp_size
    batch = dout.shape[0]
    dout_h = layout.stacked_to_natural(scatter_heads(token_major(dout), n, group), batch)
    dq_h, dk_h, dv_h = plan_backward(
        dout_h, q_h, kv_h[:, :, 0], kv_h[:, :, 1], out_h, lse_h, batch, _plan(ctx), ctx.kernel, ctx.scale
    )
    dq = gather_heads(layout.natural_to_stacked(dq_h, batch), group)
    dkv = kv_from_heads(
        layout.natural_to_stacked(torch.stack([dk_h, dv_h], dim=2), batch), ctx.q_heads, ctx.kv_heads, n, group
    )
    return head_major(dq, batch), head_major(dkv[:, :, 0], batch), head_major(dkv[:, :, 1], batch)


def saved_like(ctx: CPContext, q, k, v):
    return head_shards_like(q, k, ctx.cp_size)


def head_shards_like(q, k, n: int):
    """Empty ``(q_h, kv_h, out_h, lse_h)`` as an all-to-all over ``n`` ranks leaves them (the fake op's outputs)."""
    b, h, s, e = q.shape
    kv_heads = 1 if kv_head_map(h, k.shape[1], n) is not None else k.shape[1] // n
    q_h = q.new_empty((b * s * n, h // n, e))
    return (
        q_h,
        k.new_empty((b * s * n, kv_heads, 2, e)),
        torch.empty_like(q_h),
        q.new_empty((h // n, b * s * n), dtype=torch.float32),
    )


def ulysses_min_bytes(q: torch.Tensor, k: torch.Tensor, world: int, backward: bool = True) -> int:
    """All-to-all traffic: (N-1)/N of q, of the K/V each rank must ship, and of the output; the
    backward moves the same amounts the other way."""
    if world == 1:
        return 0
    kv_heads = max(k.shape[1], world) if kv_head_map(q.shape[1], k.shape[1], world) else k.shape[1]
    kv = 2 * kv_heads * k[:, :1].numel() * k.element_size()
    qb = q.numel() * q.element_size()
    fwd = (2 * qb + kv) * (world - 1) // world
    return fwd * (2 if backward else 1)
