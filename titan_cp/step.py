"""One microbatch through a parallelized model: shard by the layout, forward, loss, backward.

Shared by the trainer and the composition tests, so both run exactly the same path::

    rows of this dp rank ──layout.shard(cp rank)──> tokens, labels, positions (local)
    model(tokens, positions, doc_lens, labels) ──> sum CE (local, chunked) / global count ──> backward

The model computes the summed token cross-entropy itself, from its last hidden states and
output weight chunk by chunk (``titan_cp.loss``), so whole logits never exist in training.

``doc_lens`` stays whole (every cp rank needs the documents of the full rows to mask its
shard); everything per-token is sharded with the same permutation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_cp.attention.handle import CPHandle, register_sharder
from titan_cp.layout import SequenceLayout
from titan_cp.loss import GlobalTokenLoss

if TYPE_CHECKING:  # types only: torch.distributed.pipelining imports torch._dynamo (0.7 s)
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle


@dataclass
class Microbatch:
    """Packed rows: ``tokens, labels, positions`` ``(B, S)`` int64; ``doc_lens`` ``(B, max_docs)`` zero-padded
    host tensor (the documents); once sharded (:meth:`shard`), ``layout``: the
    :class:`~titan_cp.layout.SequenceLayout` the tokens were cut by, for the attention, the metrics and
    validation alike, and ``cp_rank``: whose tokens these are."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    doc_lens: torch.Tensor | None = None
    layout: SequenceLayout | None = None
    cp_rank: int = 0

    def shard(self, cp: CPHandle, microbatches: int = 1) -> Microbatch:
        """This cp rank's tokens of every per-token tensor (the same permutation for all), by the layout
        of the documents under the handle's balance (:meth:`CPHandle.register`). The model gets the
        layout's documents tensor, by which every attention layer finds that layout; on one rank the
        tokens stay in order. ``microbatches``: the pipeline schedule's microbatch count (its row
        chunks' layouts are registered too). ``cp.shard(microbatch)`` is this method."""
        layout, doc_lens = cp.register(self.tokens.shape[1], self.doc_lens, microbatches)
        if cp.size == 1:
            return replace(self, layout=layout, cp_rank=0)
        tokens, labels, positions = (layout.shard(t, 1, cp.rank) for t in (self.tokens, self.labels, self.positions))
        return Microbatch(tokens, labels, positions, doc_lens=doc_lens, layout=layout, cp_rank=cp.rank)

    def sharded_by(self) -> SequenceLayout:
        """The layout this (sharded) microbatch was cut by."""
        if self.layout is None:
            raise ValueError("a microbatch's layout is known once it is sharded (Microbatch.shard)")
        return self.layout

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of another per-token ``(B, S)`` tensor of the same rows (sharded microbatch)."""
        assert self.layout is not None, "local() is for a sharded microbatch"
        return x if self.layout.cp_size == 1 else self.layout.shard(x, 1, self.cp_rank)

    def to(self, device: torch.device | str) -> Microbatch:
        """The per-token tensors on ``device``; ``doc_lens`` stays on the host, where the attention
        reads it once per microbatch to build its tiles (read from a GPU it would synchronise every layer)."""
        return Microbatch(
            self.tokens.to(device),
            self.labels.to(device),
            self.positions.to(device),
            doc_lens=self.doc_lens,
            layout=self.layout,
            cp_rank=self.cp_rank,
        )


def forward_backward(
    model_parts: Sequence[nn.Module],
    local: Microbatch,
    loss_fn: GlobalTokenLoss,
    schedule: PipelineScheduleSingle | PipelineScheduleMulti | None = None,
    has_first: bool = True,
    has_last: bool = True,
) -> torch.Tensor:
    """Run one (cp-sharded) microbatch; return this rank's loss contribution (0 where no last stage).

    Without a pipeline ``model_parts`` is ``[model]``. With one, ``schedule.step`` splits the
    rows into pipeline microbatches and carries ``positions``, ``doc_lens`` and ``labels`` to every stage.
    """
    kwargs: dict[str, Any] = dict(positions=local.positions, doc_lens=local.doc_lens, labels=local.labels)
    if schedule is None:
        loss_sum = model_parts[0](local.tokens, **kwargs)
        loss = loss_fn(loss_sum, local.labels)
        loss.backward()
        return loss.detach()
    losses: list[torch.Tensor] = []
    target = local.labels if has_last else None
    # return_outputs=False: the last stage's outputs are 0-dim loss sums, which the schedule cannot concatenate
    if has_first:
        schedule.step(local.tokens, target=target, losses=losses, return_outputs=False, **kwargs)
    else:
        schedule.step(target=target, losses=losses, return_outputs=False, **kwargs)
    if has_last:
        return torch.stack(losses).sum().detach()
    return torch.zeros((), device=local.tokens.device)


register_sharder(Microbatch, lambda cp, mb, **options: mb.shard(cp, **options))
