"""Merging partial attention results through their log-sum-exp, in fp32.

For one query row, attention over the union of disjoint key blocks ``j`` with partial
results ``(o_j, lse_j)`` (``o_j`` normalised over block ``j`` alone) is::

    lse = log(sum_j exp(lse_j))
    o   = sum_j exp(lse_j - lse) * o_j

Rows that see no key in a block carry ``lse_j = -inf`` and weigh nothing; a row that sees
no key at all keeps ``o = 0, lse = -inf``.
"""

from __future__ import annotations

import torch


def merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one block's ``(out, lse)`` into the fp32 accumulators, in place.

    Shapes: ``out_acc, out`` ``(..., seq, head_dim)``; ``lse_acc, lse`` ``(..., seq)``.
    ``out`` may be in any dtype; the arithmetic is fp32.
    """
    new = torch.logaddexp(lse_acc, lse)
    base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    out_acc.mul_(torch.exp(lse_acc - base).unsqueeze(-1))
    out_acc.add_(out.to(out_acc.dtype) * torch.exp(lse.to(base.dtype) - base).unsqueeze(-1))
    lse_acc.copy_(new)
