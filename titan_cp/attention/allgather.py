"""All-gather attention (the Llama 3 recipe): gather K/V, attend the local queries.

K/V are gathered at their own head count (GQA is never expanded before the collective)
and reordered into natural token order, so each local query run needs one full tile
(everything before it in its document) and one causal tile::

    forward    kv      = all_gather(kv_local)              (N-1) local K/V out of each rank
               out_r   = attn(q_r, kv)
    backward   dkv_loc = reduce_scatter(dattn_kv(q_r, kv))  the dual collective
               dq_r    = dattn_q(q_r, kv)

Memory: each rank holds the full K/V of the sequence for the duration of the layer (and
keeps it for the backward), which is cheap with GQA (kv_heads << q_heads) and buys a
single collective per pass.
"""

from __future__ import annotations

import torch

from titan_cp.attention.block import head_major, make_plan, plan_backward, plan_forward, token_major
from titan_cp.attention.comm import all_gather, reduce_scatter
from titan_cp.attention.context import CPContext
from titan_cp.attention.strategy import Strategy, register_strategy


def _plan(ctx: CPContext):
    return make_plan(ctx.layout, (ctx.rank,), None, ctx.causal)


class AllGather(Strategy):
    """Gather K/V at their own head count, attend the local queries (module docstring)."""

    name = "allgather"
    keeps = ("q", "out")

    def forward(self, ctx: CPContext, q, k, v):
        batch = q.shape[0]
        kv = torch.stack([token_major(k), token_major(v)], dim=1)  # (B*S, 2, K, E)
        kv = ctx.layout.stacked_to_natural(all_gather(kv, ctx.group), batch)  # (B*S_full, 2, K, E), natural order
        out_t, lse = plan_forward(token_major(q), kv[:, 0], kv[:, 1], batch, _plan(ctx), ctx.kernel, ctx.scale)
        return head_major(out_t, batch), (lse, kv)

    def backward(self, ctx: CPContext, dout, q, k, v, out, saved):
        lse, kv = saved
        batch = q.shape[0]
        dq, dk, dv = plan_backward(
            token_major(dout),
            token_major(q),
            kv[:, 0],
            kv[:, 1],
            token_major(out),
            lse,
            batch,
            _plan(ctx),
            ctx.kernel,
            ctx.scale,
        )
        # (N, B*S, 2, K, E): chunk j is rank j's
        dkv = ctx.layout.natural_to_stacked(torch.stack([dk, dv], dim=1), batch)
        dkv = reduce_scatter(dkv, ctx.group)  # (B*S, 2, K, E)
        return head_major(dq, batch), head_major(dkv[:, 0], batch), head_major(dkv[:, 1], batch)

    def saved_like(self, ctx: CPContext, q, k, v):
        b, h, s, e = q.shape
        n = ctx.cp_size
        return q.new_empty((h, b * s), dtype=torch.float32), k.new_empty((b * n * s, 2, k.shape[1], e))

    def min_bytes(self, q, k, cp: int, ulysses_degree: int = 1, backward: bool = True) -> int:
        """Every rank's K/V must reach the N-1 others; in the backward their gradients come back once."""
        kv = 2 * k.numel() * k.element_size()
        return (cp - 1) * kv * (2 if backward else 1)

    def saved_bytes_per_token(self, act_bytes, q_heads, kv_heads, head_dim, cp, ulysses_degree=1) -> float:
        """Local q, out and lse, and the whole row's gathered K/V (``cp`` tokens per local token)."""
        a, h, e = act_bytes, q_heads, head_dim
        return 2 * a * h * e + 4 * h + cp * 2 * a * kv_heads * e


ALLGATHER = register_strategy(AllGather())
