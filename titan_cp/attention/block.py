"""Attention of a query buffer on a key buffer, tile by tile, merged in fp32.

This is the arithmetic every strategy shares: the strategies decide *which* key buffer
a rank holds at each moment; :func:`block_forward` and :func:`block_backward` compute its
contribution for the tiles of the mask plan (:mod:`titan_cp.attention.masks`).

A plan is a list of ``(rows, tiles)``: ``rows`` is a tuple of batch rows sharing one
document structure (``()`` means every row) and ``tiles`` the kernel calls for them.
"""

from __future__ import annotations

import torch

from titan_cp.attention.kernels import AttentionKernel
from titan_cp.attention.masks import Tile, plan_tiles
from titan_cp.attention.merge import merge_
from titan_cp.layout import SequenceLayout

Plan = list[tuple[tuple[int, ...], tuple[Tile, ...]]]


def make_plan(layout: SequenceLayout, q_ranks, k_ranks, causal: bool) -> Plan:
    """Tiles for the query buffer ``cat(shards of q_ranks)`` on the key buffer ``cat(shards of k_ranks)``.

    ``None`` for either side means the whole row in natural order.
    """
    plan = []
    for rows in layout.row_groups():
        row = rows[0] if rows else None
        tiles = plan_tiles(layout.runs(q_ranks, row), layout.runs(k_ranks, row), causal)
        if tiles:
            plan.append((rows, tiles))
    return plan


def plan_pairs(plan: Plan, batch: int = 1) -> int:
    """Visible (query, key) pairs per head in a plan, summed over the batch."""
    return sum((len(rows) if rows else batch) * sum(t.pairs for t in tiles) for rows, tiles in plan)


def _row_slices(rows: tuple[int, ...]) -> list[slice]:
    """Contiguous slices covering ``rows`` (``()`` is every row)."""
    if not rows:
        return [slice(None)]
    slices, start = [], rows[0]
    for prev, cur in zip(rows, rows[1:]):
        if cur != prev + 1:
            slices.append(slice(start, prev + 1))
            start = cur
    slices.append(slice(start, rows[-1] + 1))
    return slices


def _varlen_groups(plan: Plan, batch: int):
    """Every (row, tile) of the plan, split by the tiles' causal flag: one varlen call each."""
    for causal in (True, False):
        items = [(b, t) for rows, tiles in plan for b in (rows or range(batch)) for t in tiles if t.causal == causal]
        if items:
            cu_q, cu_k = [0], [0]
            for _, t in items:
                cu_q.append(cu_q[-1] + t.q1 - t.q0)
                cu_k.append(cu_k[-1] + t.k1 - t.k0)
            yield causal, items, cu_q, cu_k


def _pack(x, items, use_q: bool):
    """``(total, heads, dim)``: the tiles' rows of ``x`` (batch, heads, seq, dim), segment after segment."""
    return torch.cat([x[b, :, t.q0 : t.q1] if use_q else x[b, :, t.k0 : t.k1] for b, t in items], dim=1).transpose(0, 1)


def _pack_lse(lse, items):
    return torch.cat([lse[b, :, t.q0 : t.q1] for b, t in items], dim=1)


def block_forward(q, k, v, plan: Plan, kernel: AttentionKernel, scale: float, out_acc, lse_acc) -> None:
    """Fold attention of ``q`` on ``(k, v)`` under ``plan`` into the fp32 accumulators, in place.

    q: (batch, q_heads, sq, head_dim); k, v: (batch, kv_heads, sk, head_dim);
    out_acc: (batch, q_heads, sq, head_dim) fp32; lse_acc: (batch, q_heads, sq) fp32.
    Kernels with native variable-length support take all tiles of a causal flag in one call.
    """
    if kernel.native_varlen:
        for causal, items, cu_q, cu_k in _varlen_groups(plan, q.shape[0]):
            out, lse = kernel.varlen_forward(_pack(q, items, True), _pack(k, items, False), _pack(v, items, False), cu_q, cu_k, causal, scale)
            for (b, t), a, e in zip(items, cu_q, cu_q[1:]):
                merge_(out_acc[b, :, t.q0 : t.q1], lse_acc[b, :, t.q0 : t.q1], out[a:e].transpose(0, 1), lse[:, a:e])
        return
    for rows, tiles in plan:
        for rs in _row_slices(rows):
            for t in tiles:
                out, lse = kernel.forward(
                    q[rs, :, t.q0 : t.q1], k[rs, :, t.k0 : t.k1], v[rs, :, t.k0 : t.k1], t.causal, scale
                )
                merge_(out_acc[rs, :, t.q0 : t.q1], lse_acc[rs, :, t.q0 : t.q1], out, lse)


def block_backward(dout, q, k, v, out, lse, plan: Plan, kernel: AttentionKernel, scale: float, dq_acc, dk_acc, dv_acc):
    """Add this key buffer's share of the gradients to ``dq_acc, dk_acc, dv_acc`` (fp32), in place.

    ``out`` and ``lse`` are the final merged results for ``q`` (``out`` in the input dtype).
    """
    if kernel.native_varlen:
        for causal, items, cu_q, cu_k in _varlen_groups(plan, q.shape[0]):
            dq, dk, dv = kernel.varlen_backward(
                _pack(dout, items, True), _pack(q, items, True), _pack(k, items, False), _pack(v, items, False),
                _pack(out, items, True), _pack_lse(lse, items), cu_q, cu_k, causal, scale,
            )
            for (b, t), a, e, c, d in zip(items, cu_q, cu_q[1:], cu_k, cu_k[1:]):
                dq_acc[b, :, t.q0 : t.q1] += dq[a:e].transpose(0, 1)
                dk_acc[b, :, t.k0 : t.k1] += dk[c:d].transpose(0, 1)
                dv_acc[b, :, t.k0 : t.k1] += dv[c:d].transpose(0, 1)
        return
    for rows, tiles in plan:
        for rs in _row_slices(rows):
            for t in tiles:
                qs, ks = slice(t.q0, t.q1), slice(t.k0, t.k1)
                dq, dk, dv = kernel.backward(
                    dout[rs, :, qs], q[rs, :, qs], k[rs, :, ks], v[rs, :, ks], out[rs, :, qs], lse[rs, :, qs],
                    t.causal, scale,
                )
                dq_acc[rs, :, qs] += dq
                dk_acc[rs, :, ks] += dk
                dv_acc[rs, :, ks] += dv


def new_accumulators(q: torch.Tensor):
    """fp32 ``(out, lse)`` accumulators for ``q``: zeros and ``-inf``."""
    b, h, s, d = q.shape
    out = torch.zeros(b, h, s, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


class BlockAttention(torch.autograd.Function):
    """Differentiable attention of ``q`` on one key buffer under a plan (no communication).

    Used on one device, and inside the all-gather and Ulysses strategies after their
    collectives have brought the keys (or the heads) to this rank.
    """

    @staticmethod
    def forward(ctx, q, k, v, plan: Plan, kernel: AttentionKernel, scale: float):
        out_acc, lse = new_accumulators(q)
        block_forward(q, k, v, plan, kernel, scale, out_acc, lse)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.kernel, ctx.scale = plan, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        block_backward(dout.contiguous(), q, k, v, out, lse, ctx.plan, ctx.kernel, ctx.scale, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
