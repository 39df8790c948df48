"""Merging partial attention results through their log-sum-exp, in fp32.

For one query row, attention over the union of disjoint key blocks ``j`` with partial
results ``(o_j, lse_j)`` (``o_j`` normalised over block ``j`` alone) is::

    lse = log(sum_j exp(lse_j))
    o   = sum_j exp(lse_j - lse) * o_j

Rows that see no key in a block carry ``lse_j = -inf`` and weigh nothing; a row that sees
no key at all keeps ``o = 0, lse = -inf``.

:func:`merge_segments_` folds a whole step at once: the results of many segments
(a query may appear in several of them, e.g. a causal diagonal and the full tile of the
keys before it) are scattered into the accumulators with a constant number of tensor
operations, whatever the number of segments::

    m    = max(lse_acc, max_{j -> i} lse_j)             scatter-reduce (amax)
    a    = exp(lse_acc - m)        w_j = exp(lse_j - m_i)
    s    = a + sum_{j -> i} w_j                         index-add
    o    = (a * o_acc + sum_{j -> i} w_j * o_j) / s     index-add
    lse  = m + log(s)
"""

from __future__ import annotations

import torch


def merge_segments_(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dest: torch.Tensor
) -> None:
    """Fold packed partial results into token-major fp32 accumulators, in place.

    Shapes: ``out_acc (N, heads, head_dim)`` fp32, ``lse_acc (heads, N)`` fp32;
    ``out (T, heads, head_dim)`` in any dtype, ``lse (heads, T)``; ``dest (T,)`` int64:
    the accumulator row of each packed row (repeats allowed).
    """
    heads, t = lse.shape
    lse = lse.float()
    m = lse_acc.scatter_reduce(1, dest.expand(heads, t), lse, reduce="amax", include_self=True)
    m = torch.where(torch.isneginf(m), 0.0, m)  # rows that see nothing yet: any finite base
    a = torch.exp(lse_acc - m)
    w = torch.exp(lse - m.index_select(1, dest))
    s = a.index_add(1, dest, w)
    out_acc.mul_(a.t().unsqueeze(-1))
    out_acc.index_add_(0, dest, out.float() * w.t().unsqueeze(-1))
    out_acc.div_(torch.where(s > 0, s, 1.0).t().unsqueeze(-1))
    lse_acc.copy_(m + torch.log(s))
