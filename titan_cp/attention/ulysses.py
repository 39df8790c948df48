"""Ulysses attention: trade the sequence split for a head split with two all-to-alls.

Each rank sends head group ``j`` of its sequence shard to rank ``j`` and receives every
rank's shard of its own head group, attends over the full sequence for those heads, and
sends the result back::

    forward    q_h   = all_to_all(q,  scatter heads, gather seq)    (batch, H/N, S, d)
               kv_h  = all_to_all(kv, scatter heads, gather seq)    at their own head count
               out_h = attn(q_h, kv_h)
               out   = all_to_all(out_h, scatter seq, gather heads)  (batch, H, S/N, d)
    backward   the same three exchanges with scatter and gather swapped (the dual)

Query heads must divide by N. K/V heads either divide by N (each rank gets its own
slice) or divide N, in which case each destination gets exactly the one K/V head its
query heads use: heads are replicated only as much as needed, never expanded to the
query head count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_cp.attention.block import BlockAttention, make_plan
from titan_cp.attention.comm import all_to_all
from titan_cp.layout import SequenceLayout


def kv_head_map(q_heads: int, kv_heads: int, n: int) -> list[int] | None:
    """The K/V head each of ``n`` head groups needs, or ``None`` when ``kv_heads`` splits evenly."""
    if q_heads % n:
        raise ValueError(f"ulysses needs the query heads ({q_heads}) to be divisible by its cp size ({n})")
    if kv_heads % n == 0:
        return None
    if n % kv_heads:
        raise ValueError(
            f"ulysses needs the K/V heads ({kv_heads}) to divide, or be divisible by, its cp size ({n})"
        )
    group = q_heads // kv_heads
    return [(j * q_heads // n) // group for j in range(n)]


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``(batch, H, S/N, d)`` sequence shards -> ``(batch, H/N, S, d)`` head shards (rank-concatenated tokens)."""
    return all_to_all(x, scatter_dim=1, gather_dim=2, group=group)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`."""
    return all_to_all(x, scatter_dim=2, gather_dim=1, group=group)


def kv_to_heads(k: torch.Tensor, v: torch.Tensor, q_heads: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V to head shards in one exchange, replicating K/V heads only where ``kv_heads < N``."""
    n = dist.get_world_size(group)
    kv = torch.stack([k, v], dim=2)  # (batch, kv_heads, 2, S/N, d): a head group carries its K and V
    heads = kv_head_map(q_heads, k.shape[1], n)
    if heads is not None:
        kv = kv.index_select(1, torch.tensor(heads, device=kv.device))
    kv = all_to_all(kv, scatter_dim=1, gather_dim=3, group=group)
    return kv[:, :, 0], kv[:, :, 1]


def ulysses_attention(q, k, v, group, layout: SequenceLayout, rank: int, causal: bool, scale: float, kernel) -> torch.Tensor:
    """Ulysses attention on a 1-D cp group."""
    q_h = seq_to_heads(q, group)
    k_h, v_h = kv_to_heads(k, v, q.shape[1], group)
    # natural token order: each document is one run, one causal tile
    q_h, k_h, v_h = (layout.to_natural(x, dim=2) for x in (q_h, k_h, v_h))
    out = BlockAttention.apply(q_h, k_h, v_h, make_plan(layout, None, None, causal), kernel, scale)
    return heads_to_seq(layout.to_concat(out, dim=2), group)


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
