"""Merging partial attention results through their log-sum-exp, in fp32.

For one query row, attention over the union of disjoint key blocks ``j`` with partial
results ``(o_j, lse_j)`` (``o_j`` normalised over block ``j`` alone) is::

    lse = log(sum_j exp(lse_j))
    o   = sum_j exp(lse_j - lse) * o_j

Rows that see no key in a block carry ``lse_j = -inf`` and weigh nothing; a row that sees
no key at all keeps ``o = 0, lse = -inf``.

:func:`merge_rows_` folds a step's packed results into the accumulator rows they touch, and
only those (a query may appear in several segments, e.g. a causal diagonal and the full tile
of the keys before it), with a constant number of tensor operations::

    a, l  = acc_out[rows], acc_lse[rows]                gathered once
    m     = max(l, max_{j -> i} lse_j)                  scatter-reduce (amax)
    s     = exp(l - m) + sum_{j -> i} exp(lse_j - m_i)  index-add
    o     = (exp(l - m) a + sum_{j -> i} exp(lse_j - m_i) o_j) / s
    acc_out[rows], acc_lse[rows] = o, m + log(s)        written back once

Attention sinks (a learned logit ``z_h`` per head that joins every row's softmax denominator
and carries no value) are folded in once, at the end (:func:`apply_sinks_`)::

    lse' = log(exp(lse) + exp(z_h))          o' = exp(lse - lse') o
    dz_h = - sum_i exp(z_h - lse'_i) D_i     with D_i = rowsum(dout_i * o'_i)

The kernels' backward, fed ``(o', lse')``, is then exact for the keys (the sink is one more
softmax entry whose value is zero).
"""

from __future__ import annotations

import torch


def merge_rows_(
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: torch.Tensor,
    local: torch.Tensor,
) -> None:
    """Fold packed partial results into the accumulator rows ``rows``, in place.

    Shapes: ``out_acc (N, heads, head_dim)`` fp32, ``lse_acc (heads, N)`` fp32; ``out (T, heads,
    head_dim)`` in any dtype, ``lse (heads, T)``; ``rows (R,)`` int64 distinct accumulator rows;
    ``local (T,)`` int64: the place in ``rows`` of each packed row (repeats allowed).
    """
    heads, t = lse.shape
    lse = lse.float()
    acc_lse = lse_acc.index_select(1, rows)
    m = acc_lse.scatter_reduce(1, local.expand(heads, t), lse, reduce="amax", include_self=True)
    m = torch.where(torch.isneginf(m), 0.0, m)  # rows that see nothing yet: any finite base
    a = torch.exp(acc_lse - m)
    w = torch.exp(lse - m.index_select(1, local))
    s = a.index_add(1, local, w)
    acc_out = out_acc.index_select(0, rows).mul_(a.t().unsqueeze(-1))
    acc_out.index_add_(0, local, out.float() * w.t().unsqueeze(-1))
    acc_out.div_(torch.where(s > 0, s, 1.0).t().unsqueeze(-1))
    out_acc.index_copy_(0, rows, acc_out)
    lse_acc.index_copy_(1, rows, m + torch.log(s))


def apply_sinks_(out_acc: torch.Tensor, lse_acc: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold per-head sink logits ``sinks (heads,)`` into the final fp32 ``(out_acc, lse_acc)``, in place."""
    lse = torch.logaddexp(lse_acc, sinks.float().unsqueeze(1))
    out_acc.mul_(torch.exp(lse_acc - lse).t().unsqueeze(-1))
    lse_acc.copy_(lse)


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``dz (heads,)`` fp32 for :func:`apply_sinks_`'s ``(out, lse)`` (token-major ``(N, heads, head_dim)``, ``(heads, N)``)."""
    d = (dout.float() * out.float()).sum(-1)  # (N, heads)
    return -(torch.exp(sinks.float().unsqueeze(1) - lse) * d.t()).sum(1)
