"""Ring attention: K/V travel around the ring while each rank attends its own queries.

Step ``s`` of ``N``: rank ``r`` holds the K/V of rank ``r - s`` and folds their attention
into its fp32 accumulators (log-sum-exp merge); meanwhile the same K/V are already on
their way to rank ``r + 1`` (double buffering: the buffer being read and the one being
received are different tensors), so the transfer hides behind the computation::

    forward    out_r  = merge_s  attn(q_r, kv_{r-s})             kv: N-1 sends of the local K/V
    backward   dq_r   = sum_s    dattn_q(q_r, kv_{r-s})           kv: N-1 sends again
               dkv_j  = sum_r    dattn_kv(q_r, kv_j)              dkv: N-1 sends (fp32)

The backward is the forward's ring run again with the gradient of each K/V block riding
one step behind it: rank ``r`` adds its share to the accumulator of block ``r - s`` it just
received and passes it on; after the last step every accumulator has visited all ranks
and arrives home. With the zigzag layouts every step carries the same causal work on
every rank; a step whose mask plan is empty (nothing visible) computes nothing.

Saves only the local q, k, v, out and lse: remote K/V are sent round again in the backward.
One rank (``N = 1``) is plain local attention. For the hybrid strategy a "rank" of this ring
is a whole Ulysses group, and its buffer the concatenation of the group members' shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from titan_cp.attention.block import (
    Plan,
    block_backward,
    block_forward,
    head_major,
    make_plan,
    new_accumulators,
    token_major,
)
from titan_cp.attention.comm import RingComm
from titan_cp.attention.context import CPContext
from titan_cp.attention.strategy import Strategy, register_strategy
from titan_cp.layout import SequenceLayout


def ring_plans(
    layout: SequenceLayout, ring_rank: int, ring_size: int, members: Callable[[int], Sequence[int]], causal: bool
) -> list[Plan]:
    """Mask plan of each ring step: my queries against the K/V of ring rank ``ring_rank - step``."""
    mine = tuple(members(ring_rank))
    return [
        make_plan(layout, mine, tuple(members((ring_rank - step) % ring_size)), causal) for step in range(ring_size)
    ]


def ring_forward(q_t, k_t, v_t, batch: int, group, plans: list[Plan], kernel, scale: float):
    """``(out_t, lse)``: ``(B*S, H, E)`` output in q's dtype and ``(H, B*S)`` fp32 lse.

    Token-major ``q_t (B*S, H, E)``, ``k_t, v_t (B*S, K, E)``; ``plans[s]`` is step ``s``'s mask plan.
    """
    n = len(plans)
    comm = RingComm(group) if n > 1 else None
    kv = torch.stack([k_t, v_t])  # one message per step: (2, B*S, K, E)
    out_acc, lse = new_accumulators(q_t)
    for step, plan in enumerate(plans):
        inflight = comm.send_recv(kv, tag=0) if step + 1 < n else None
        block_forward(q_t, kv[0], kv[1], batch, plan, kernel, scale, out_acc, lse)
        if inflight is not None:
            kv = inflight.wait()
    return out_acc.to(q_t.dtype), lse


def ring_backward(dout_t, q_t, k_t, v_t, out_t, lse, batch: int, group, plans: list[Plan], kernel, scale: float):
    """``(dq_t, dk_t, dv_t)`` token-major in the input dtype; ``lse`` as :func:`ring_forward` returned it."""
    n = len(plans)
    comm = RingComm(group) if n > 1 else None
    kv = torch.stack([k_t, v_t])
    dq = torch.zeros(q_t.shape, dtype=torch.float32, device=q_t.device)
    own = None  # gradient of my own K/V computed by me (step 0)
    travelling = None  # in-flight exchange of accumulated dK/dV
    for step, plan in enumerate(plans):
        inflight = comm.send_recv(kv, tag=0) if step + 1 < n else None
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        block_backward(dout_t, q_t, kv[0], kv[1], out_t, lse, batch, plan, kernel, scale, dq, dkv[0], dkv[1])
        if step == 0:
            own = dkv
        else:
            if travelling is not None:
                dkv += travelling.wait()  # what the ranks before me added for this block
            travelling = comm.send_recv(dkv, tag=1)
        if inflight is not None:
            kv = inflight.wait()
    if travelling is not None:
        own += travelling.wait()  # my block's accumulator, home after visiting every rank
    own = own.to(k_t.dtype)
    return dq.to(q_t.dtype), own[0], own[1]


def _plans(ctx: CPContext) -> list[Plan]:
    n = ctx.layout.cp_size
    key = ("ring_plans", ctx.rank, ctx.causal)
    return ctx.layout.memo(key, lambda: ring_plans(ctx.layout, ctx.rank, n, lambda r: (r,), ctx.causal))


def _group(ctx: CPContext):
    return ctx.group if ctx.layout.cp_size > 1 else None


def kv_block_bytes(act_bytes: int, kv_heads: int, head_dim: int, tokens: int) -> int:
    """Bytes of one K/V block (K and V of ``tokens`` tokens): what one ring step moves."""
    return 2 * kv_heads * head_dim * tokens * act_bytes


class Ring(Strategy):
    """K/V blocks travel around the cp ring (module docstring); also the one-device path."""

    name = "ring"
    keeps = ("q", "k", "v", "out")

    def ring_size(self, cp: int, ulysses_degree: int = 1) -> int:
        return cp

    def forward(self, ctx: CPContext, q, k, v):
        b = q.shape[0]
        out_t, lse = ring_forward(
            token_major(q), token_major(k), token_major(v), b, _group(ctx), _plans(ctx), ctx.kernel, ctx.scale
        )
        return head_major(out_t, b), (lse,)

    def backward(self, ctx: CPContext, dout, q, k, v, out, saved):
        b = q.shape[0]
        grads = ring_backward(
            token_major(dout),
            token_major(q),
            token_major(k),
            token_major(v),
            token_major(out),
            saved[0],
            b,
            _group(ctx),
            _plans(ctx),
            ctx.kernel,
            ctx.scale,
        )
        return tuple(head_major(g, b) for g in grads)

    def saved_like(self, ctx: CPContext, q, k, v):
        b, h, s, _ = q.shape
        return (q.new_empty((h, b * s), dtype=torch.float32),)

    def min_bytes(self, q, k, cp: int, ulysses_degree: int = 1, backward: bool = True) -> int:
        """Every K/V block must visit the N-1 other ranks (forward, and again in the backward)
        and its fp32 gradient must come home."""
        kv = 2 * k.numel() * k.element_size()
        total = (cp - 1) * kv
        if backward:
            total += (cp - 1) * kv + (cp - 1) * 2 * k.numel() * 4
        return total

    def saved_bytes_per_token(self, act_bytes, q_heads, kv_heads, head_dim, cp, ulysses_degree=1) -> float:
        """q, out, k, v as stored locally and the fp32 lse."""
        a, h, e = act_bytes, q_heads, head_dim
        return 2 * a * h * e + 2 * a * kv_heads * e + 4 * h

    def buffer_bytes(self, act_bytes, q_heads, kv_heads, head_dim, local_tokens, cp, ulysses_degree=1) -> int:
        """Two K/V blocks (the one read, the one arriving) and two fp32 dK/dV accumulators."""
        if cp == 1:
            return 0
        kvb = kv_block_bytes(act_bytes, kv_heads, head_dim, local_tokens)
        return 2 * kvb + 2 * kvb * 4 // act_bytes


RING = register_strategy(Ring())
