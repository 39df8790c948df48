"""Attention of decode queries against a KV cache sharded over the cp ranks.

During generation each new token's query is computed on every cp rank (it is one token per
prompt); each rank attends to the keys it holds, and the partial results are merged exactly
through their log-sum-exp with one collective per layer::

    rank r:  (o_r, lse_r) = attention(q, K_r, V_r)         over the keys of rank r alone
    gather:  (o_j, lse_j) for every rank j                 one all-gather of (B, H, E + 1) fp32
    merge:   lse = log(sum_j exp(lse_j))     o = sum_j exp(lse_j - lse) o_j

A query that sees no key on a rank contributes ``o_j = 0, lse_j = -inf`` (weight zero). Sinks
(a learned logit per head) join the denominator once, after the merge
(:func:`titan_cp.attention.merge.apply_sinks_`). Only the partial outputs and their
log-sum-exp travel, never the cache: ``(cp - 1) * B * H * (E + 1) * 4`` bytes per rank and layer.

The cache of a rank is token-major, ``k (N, K, E)``, ``v (N, K, Ev)`` (K/V heads at their own count, GQA;
V at its own head dim, multi-head latent attention, the partials then ``(B, H, Ev)``);
query ``b`` sees the keys ``[start_b, end_b)`` of it (:class:`KeyRanges`), the ranges sorted
and disjoint. All of a rank's queries run as one variable-length kernel call: the keys
between two ranges are a segment without queries, so the cache is never copied.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from titan_cp.attention import comm
from titan_cp.attention.kernels import AttentionKernel, Segments
from titan_cp.attention.merge import apply_sinks_


@dataclass(frozen=True)
class KeyRanges:
    """Which cache rows each of ``n_queries`` decode queries sees on this rank, as kernel segments.

    ``rows`` ``(T,)`` int64 (on the device): the queries that see at least one key here, in order;
    ``seg``: their segments over the cache (``None`` when no query sees a key here).
    """

    n_queries: int
    rows: Tensor
    seg: Segments | None

    @classmethod
    def build(cls, ranges: Sequence[tuple[int, int]], device: torch.device | str) -> KeyRanges:
        """``ranges[b] = (start, end)``: query ``b`` sees cache rows ``[start, end)`` (empty when
        ``end <= start``); the non-empty ranges must be sorted and disjoint."""
        host_q, host_k, rows = [0], [0], []
        for b, (start, end) in enumerate(ranges):
            if end <= start:
                continue
            assert start >= host_k[-1], f"key ranges must be sorted and disjoint: {list(ranges)}"
            if start > host_k[-1]:  # the keys before this range: a segment without queries
                host_q.append(host_q[-1])
                host_k.append(start)
            host_q.append(host_q[-1] + 1)
            host_k.append(end)
            rows.append(b)
        seg = Segments.from_offsets(host_q, host_k, device) if rows else None
        return cls(len(ranges), torch.tensor(rows, dtype=torch.int64).to(device), seg)


def decode_partial(
    q: Tensor, k: Tensor, v: Tensor, keys: KeyRanges, kernel: AttentionKernel, scale: float
) -> tuple[Tensor, Tensor]:
    """This rank's partial attention: ``q (B, H, E)`` against the cache ``k (N, K, E)``, ``v (N, K, Ev)``.

    Returns ``(out (B, H, Ev), lse (B, H))`` fp32, ``out`` normalised over this rank's keys alone;
    queries that see no key here get ``out = 0, lse = -inf``.
    """
    b, h, _ = q.shape
    out = q.new_zeros((b, h, v.shape[-1]), dtype=torch.float32)
    lse = q.new_full((b, h), -math.inf, dtype=torch.float32)
    if keys.seg is not None:
        part, part_lse = kernel.varlen_forward(q.index_select(0, keys.rows), k, v, keys.seg, False, scale)
        out.index_copy_(0, keys.rows, part.float())
        lse.index_copy_(0, keys.rows, part_lse.t().float())
    return out, lse


def merge_stacked(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge partial results stacked on dim 0, ``out (N, B, H, E)`` and ``lse (N, B, H)`` fp32, into
    ``(out (B, H, E), lse (B, H))`` (module docstring); rows that see nothing stay ``0, -inf``."""
    m = lse.amax(0)
    m = torch.where(torch.isneginf(m), 0.0, m)
    w = torch.exp(lse - m)
    s = w.sum(0)
    merged = (w.unsqueeze(-1) * out).sum(0) / torch.where(s > 0, s, 1.0).unsqueeze(-1)
    return merged, m + torch.log(s)


def merge_partials(out: Tensor, lse: Tensor, group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """The exact attention over every rank's keys from each rank's ``(out (B, H, E), lse (B, H))``:
    one all-gather of both, packed as ``(B, H, E + 1)`` fp32, then :func:`merge_stacked`. ``group``
    ``None``: one rank, nothing to merge."""
    if group is None:
        return out, lse
    packed = torch.cat((out, lse.unsqueeze(-1)), dim=-1)
    gathered = comm.all_gather(packed, group)  # (N, B, H, E + 1), ranks in group order
    return merge_stacked(gathered[..., :-1], gathered[..., -1])


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keys: KeyRanges,
    group: dist.ProcessGroup | None,
    kernel: AttentionKernel,
    scale: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact attention of the decode queries ``q (B, H, E)`` over the cache of every rank of
    ``group`` (this rank's: ``k (N, K, E)``, ``v (N, K, Ev)`` and ``keys``); ``(B, H, Ev)`` in q's dtype,
    equal on every rank. ``sinks``: ``(H,)`` per-head logits joining each softmax denominator."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = merge_partials(*decode_partial(q, k, v, keys, kernel, scale), group)
    if sinks is not None:
        lse_HB = lse.t().contiguous()
        apply_sinks_(out, lse_HB, sinks)
    return out.to(q.dtype)
