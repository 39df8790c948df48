"""All-gather attention (the Llama 3 recipe): gather K/V, attend the local queries.

K/V are gathered at their own head count (GQA is never expanded before the collective)
and reordered into natural token order, so each local query run needs one full tile
(everything before it in its document) and one causal tile::

    forward    kv      = all_gather(kv_local)              (N-1) local K/V out of each rank
               out_r   = attn(q_r, kv)
    backward   dkv_loc = reduce_scatter(dattn_kv(q_r, kv))  the dual collective
               dq_r    = dattn_q(q_r, kv)

Memory: each rank holds the full K/V of the sequence for the duration of the layer,
which is cheap with GQA (kv_heads << q_heads) and buys a single collective per pass.
"""

from __future__ import annotations

import torch

from titan_cp.attention.block import BlockAttention, make_plan
from titan_cp.attention.comm import all_gather
from titan_cp.layout import SequenceLayout


def allgather_attention(q, k, v, group, layout: SequenceLayout, rank: int, causal: bool, scale: float, kernel) -> torch.Tensor:
    """All-gather attention on a 1-D cp group."""
    hkv = k.shape[1]
    kv = all_gather(torch.cat([k, v], dim=1), 2, group)  # (batch, 2*kv_heads, seq, head_dim), rank order
    kv = layout.to_natural(kv, dim=2)
    plan = make_plan(layout, (rank,), None, causal)
    return BlockAttention.apply(q, kv[:, :hkv], kv[:, hkv:], plan, kernel, scale)


def allgather_min_bytes(q: torch.Tensor, k: torch.Tensor, world: int, backward: bool = True) -> int:
    """Every rank's K/V must reach the N-1 others; in the backward their gradients come back once."""
    kv = 2 * k.numel() * k.element_size()
    return (world - 1) * kv * (2 if backward else 1)
