"""Merging partial attention results through their log-sum-exp, in fp32.

For one query row, attention over the union of disjoint key blocks ``j`` with partial
results ``(o_j, lse_j)`` (``o_j`` normalised over block ``j`` alone) is::

    lse = log(sum_j exp(lse_j))
    o   = sum_j exp(lse_j - lse) * o_j

Rows that see no key in a block carry ``lse_j = -inf`` and weigh nothing; a row that sees
no key at all keeps ``o = 0, lse = -inf``.

:func:`merge_into_` merges several steps' packed results (and an earlier fp32 partial) into the
rows they reach, and only those (a query may appear in several segments, e.g. a causal diagonal
and the full tile of the keys before it), with a constant number of tensor operations per
partial::

    m     = max(l, max_{j -> i} lse_j)                  scatter-reduce (amax)
    s     = exp(l - m) + sum_{j -> i} exp(lse_j - m_i)  index-add
    o     = (exp(l - m) a + sum_{j -> i} exp(lse_j - m_i) o_j) / s
    dst[rows], dst_lse[rows] = o, m + log(s)            written once

Attention sinks (a learned logit ``z_h`` per head that joins every row's softmax denominator
and carries no value) are folded in once, at the end (:func:`apply_sinks_`)::

    lse' = log(exp(lse) + exp(z_h))          o' = exp(lse - lse') o
    dz_h = - sum_i exp(z_h - lse'_i) D_i     with D_i = rowsum(dout_i * o'_i)

The kernels' backward, fed ``(o', lse')``, is then exact for the keys (the sink is one more
softmax entry whose value is zero).
"""

from __future__ import annotations

import torch


def merge_into_(
    dst_out: torch.Tensor,
    dst_lse: torch.Tensor,
    dst_rows: torch.Tensor,
    acc_out: torch.Tensor | None,
    acc_lse: torch.Tensor | None,
    acc_rows: torch.Tensor | None,
    outs: list[torch.Tensor],
    lses: list[torch.Tensor],
    srcs: list[torch.Tensor],
    places: list[torch.Tensor],
) -> None:
    """Several packed partial results merged at once and written to ``dst`` rows ``dst_rows (U,)``.

    Contribution ``i``: packed rows ``srcs[i]`` of ``(outs[i], lses[i])``, each to place ``places[i]`` among
    the ``U`` rows (repeats allowed); and, where ``acc_rows`` (``(U,)``, -1: none) names one, an earlier
    fp32 partial ``(acc_out, acc_lse)`` row (``acc_out=None``: ``dst`` itself). ``dst`` in any dtype
    (the result, or fp32 accumulator slots); the merge runs in fp32 and writes each row once.
    """
    heads, n = dst_lse.shape[0], dst_rows.numel()
    m = torch.full((heads, n), float("-inf"), dtype=torch.float32, device=dst_out.device)
    prior = None
    if acc_rows is not None:
        acc_out, acc_lse = (dst_out, dst_lse) if acc_out is None else (acc_out, acc_lse)
        if acc_lse is None:
            raise ValueError("merge_into_: acc_out given without its acc_lse")
        held = acc_rows >= 0
        rows = acc_rows.clamp(min=0)
        prior_lse = torch.where(held, acc_lse.index_select(1, rows).float(), float("-inf"))
        prior = (acc_out.index_select(0, rows).float(), prior_lse, held)
        m = prior_lse.clone()
    parts = []
    for out, lse, src, place in zip(outs, lses, srcs, places):
        part_lse = lse.index_select(1, src).float()
        m = m.scatter_reduce(1, place.expand(heads, -1), part_lse, reduce="amax", include_self=True)
        parts.append((out, part_lse, src, place))
    m = torch.where(torch.isneginf(m), 0.0, m)  # rows that see nothing: any finite base
    s = torch.zeros_like(m)
    o = torch.zeros((n,) + tuple(dst_out.shape[1:]), dtype=torch.float32, device=dst_out.device)
    if prior is not None:
        a = torch.exp(prior[1] - m)
        s += a
        o += torch.where(prior[2].view(-1, 1, 1), prior[0], 0.0) * a.t().unsqueeze(-1)
    for out, part_lse, src, place in parts:
        w = torch.exp(part_lse - m.index_select(1, place))
        s.index_add_(1, place, w)
        o.index_add_(0, place, out.index_select(0, src).float() * w.t().unsqueeze(-1))
    o.div_(torch.where(s > 0, s, 1.0).t().unsqueeze(-1))
    dst_out.index_copy_(0, dst_rows, o.to(dst_out.dtype))
    dst_lse.index_copy_(1, dst_rows, m + torch.log(s))


def add_into_(
    dst: torch.Tensor,
    dst_rows: torch.Tensor,
    acc: torch.Tensor | None,
    acc_rows: torch.Tensor | None,
    grads: list[torch.Tensor],
    srcs: list[torch.Tensor],
    places: list[torch.Tensor],
) -> None:
    """The gradient's counterpart of :func:`merge_into_`: ``dst[dst_rows] = sum`` of the packed rows
    ``srcs[i]`` of ``grads[i]`` at their ``places[i]`` and of the earlier fp32 partial rows ``acc_rows``
    (``acc=None``: ``dst`` itself), summed in fp32, written once in ``dst``'s dtype."""
    n = dst_rows.numel()
    o = torch.zeros((n,) + tuple(dst.shape[1:]), dtype=torch.float32, device=dst.device)
    if acc_rows is not None:
        acc = dst if acc is None else acc
        held = (acc_rows >= 0).view(-1, *([1] * (dst.dim() - 1)))
        o += torch.where(held, acc.index_select(0, acc_rows.clamp(min=0)).float(), 0.0)
    for grad, src, place in zip(grads, srcs, places):
        o.index_add_(0, place, grad.index_select(0, src).float())
    dst.index_copy_(0, dst_rows, o.to(dst.dtype))


def apply_sinks_(out_acc: torch.Tensor, lse_acc: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold per-head sink logits ``sinks (heads,)`` into the final fp32 ``(out_acc, lse_acc)``, in place."""
    lse = torch.logaddexp(lse_acc, sinks.float().unsqueeze(1))
    out_acc.mul_(torch.exp(lse_acc - lse).t().unsqueeze(-1))
    lse_acc.copy_(lse)


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``dz (heads,)`` fp32 for :func:`apply_sinks_`'s ``(out, lse)`` (token-major ``(N, heads, head_dim)``, ``(heads, N)``)."""
    d = (dout.float() * out.float()).sum(-1)  # (N, heads)
    return -(torch.exp(sinks.float().unsqueeze(1) - lse) * d.t()).sum(1)
