"""What torchtitan 0.3's log and metrics say of a run under titan_cp's context parallelism.

- **Each line once.** torchtitan logs through the root logger on every rank, so an ``N``-rank run
  prints every line ``N`` times. :func:`log_info_on_rank0` keeps torchtitan's records below
  ``WARNING`` on global rank 0 only; warnings and errors still come from every rank (torchrun's
  ``--local-ranks-filter 0`` would hide other ranks' tracebacks too).
- **Loss metrics per data-parallel rank.** torchtitan reduces the loss a step's forward-backward
  returns (``local loss sum / global valid tokens``) over its ``loss`` mesh (``dp x cp``):
  ``global_avg_loss`` sums it, ``global_max_loss`` is the max of ``loss x global / local`` tokens,
  with ``local`` the valid tokens of the rank's rows counted *before* CP shards them. Under CP each
  cp rank holds only its shard's share of its rows' loss, so that max is one share (half the loss at
  CP 2). :func:`loss_for_metrics` gives torchtitan the loss of a dp rank's rows whole, summed over
  its cp group, from cp rank 0 and ``0`` from the others::

      returned_r  = sum over cp of loss_r      (cp rank 0)        0    (other cp ranks)
      global_avg  = sum over dp x cp of returned = sum over dp x cp of loss       (unchanged)
      global_max  = max over dp of (sum over cp of loss) x global / local         (each dp rank's mean)

  A cross-entropy is never negative, so the zeros never raise the max; a non-finite share reaches cp
  rank 0's sum and torchtitan's finiteness check.

Nothing here imports torchtitan (the CPU launcher sets the filter before torchtitan is imported).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import Tensor


class _InfoOnRank0(logging.Filter):
    """Records below ``WARNING`` pass on global rank 0 only (``RANK``, as torchrun sets it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or os.environ.get("RANK", "0") == "0"


def log_info_on_rank0() -> None:
    """torchtitan's log lines below ``WARNING`` from global rank 0 only (module docstring). The filter sits
    on the root logger, torchtitan's, which torchtitan's ``init_logger`` does not reset; once per process."""
    root = logging.getLogger()
    if not any(isinstance(f, _InfoOnRank0) for f in root.filters):
        root.addFilter(_InfoOnRank0())


def loss_for_metrics(loss: Tensor, cp_group: dist.ProcessGroup, cp_rank: int) -> Tensor:
    """What a step's forward-backward returns to torchtitan's loss metrics under CP (module docstring):
    ``loss`` (this cp rank's share, a scalar; a DTensor's local value) summed over ``cp_group`` on cp
    rank 0, zero on the others. Collective over ``cp_group``; no gradient."""
    local = loss.to_local() if hasattr(loss, "to_local") else loss
    total = local.detach().clone()
    dist.all_reduce(total, group=cp_group)
    return total if cp_rank == 0 else torch.zeros_like(total)
