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

For the hybrid strategy a "rank" of this ring is a whole Ulysses group, and its buffer
the concatenation of the group members' shards (``members``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from titan_cp.attention.block import Plan, block_backward, block_forward, make_plan, new_accumulators
from titan_cp.attention.comm import RingComm
from titan_cp.attention.kernels import AttentionKernel
from titan_cp.layout import SequenceLayout


def ring_plans(
    layout: SequenceLayout, ring_rank: int, ring_size: int, members: Callable[[int], Sequence[int]], causal: bool
) -> list[Plan]:
    """Mask plan of each ring step: my queries against the K/V of ring rank ``ring_rank - step``."""
    mine = tuple(members(ring_rank))
    return [
        make_plan(layout, mine, tuple(members((ring_rank - step) % ring_size)), causal) for step in range(ring_size)
    ]


class RingAttention(torch.autograd.Function):
    """``out = attention(q, all K/V of the ring)`` for this rank's queries; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, group, plans: list[Plan], kernel: AttentionKernel, scale: float):
        n = len(plans)
        comm = RingComm(group) if n > 1 else None
        kv = torch.stack([k, v])  # one message per step: (2, batch, kv_heads, seq, head_dim)
        out_acc, lse = new_accumulators(q)
        for step, plan in enumerate(plans):
            inflight = comm.send_recv(kv, tag=0) if step + 1 < n else None
            if plan:
                block_forward(q, kv[0], kv[1], plan, kernel, scale, out_acc, lse)
            if inflight is not None:
                kv = inflight.wait()
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plans, ctx.kernel, ctx.scale = group, plans, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plans, kernel, scale = ctx.plans, ctx.kernel, ctx.scale
        n = len(plans)
        comm = RingComm(ctx.group) if n > 1 else None
        dout = dout.contiguous()
        kv = torch.stack([k, v])
        dq = torch.zeros_like(q, dtype=torch.float32)
        own = None  # gradient of my own K/V computed by me (step 0)
        travelling = None  # in-flight exchange of accumulated dK/dV
        for step, plan in enumerate(plans):
            inflight = comm.send_recv(kv, tag=0) if step + 1 < n else None
            dkv = torch.zeros((2,) + tuple(k.shape), dtype=torch.float32, device=k.device)
            if plan:
                block_backward(dout, q, kv[0], kv[1], out, lse, plan, kernel, scale, dq, dkv[0], dkv[1])
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
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None


def ring_attention(q, k, v, group, layout: SequenceLayout, rank: int, causal: bool, scale: float, kernel) -> torch.Tensor:
    """Ring attention on a 1-D cp group; ``rank`` is this rank's index in ``group`` and ``layout``."""
    n = dist.get_world_size(group)
    plans = ring_plans(layout, rank, n, lambda r: (r,), causal)
    return RingAttention.apply(q, k, v, group, plans, kernel, scale)


def ring_min_bytes(q: torch.Tensor, k: torch.Tensor, world: int, backward: bool = True) -> int:
    """The ring's own minimum traffic per rank: every K/V block must visit the N-1 other
    ranks (forward and again in the backward) and its fp32 gradient must come home."""
    kv = 2 * k.numel() * k.element_size()
    total = (world - 1) * kv
    if backward:
        total += (world - 1) * kv + (world - 1) * 2 * k.numel() * 4
    return total
