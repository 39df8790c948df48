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

from dataclasses import dataclass

import torch

from titan_cp.layout import get_layout
from titan_cp.loss import GlobalTokenLoss


def shard_tokens(x: torch.Tensor, doc_lens, cp_size: int, cp_rank: int, balance: str) -> torch.Tensor:
    """This cp rank's tokens of a per-token ``(B, S)`` tensor under the layout of ``doc_lens``."""
    if cp_size == 1:
        return x
    return get_layout(x.shape[1], cp_size, balance, doc_lens).shard(x, 1, cp_rank)


@dataclass
class Microbatch:
    """Packed rows: ``tokens, labels, positions`` ``(B, S)`` int64; ``doc_lens`` ``(B, max_docs)`` zero-padded."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    doc_lens: torch.Tensor | None = None

    def shard(self, cp_size: int, cp_rank: int, balance: str) -> Microbatch:
        """This cp rank's tokens of every per-token tensor (the same permutation for all)."""
        if cp_size == 1:
            return self
        return Microbatch(
            *(
                shard_tokens(t, self.doc_lens, cp_size, cp_rank, balance)
                for t in (self.tokens, self.labels, self.positions)
            ),
            doc_lens=self.doc_lens,
        )

    def to(self, device) -> Microbatch:
        """The per-token tensors on ``device``; ``doc_lens`` stays on the host, where the attention
        reads it once per microbatch to build its plans (read from a GPU it would synchronise every layer)."""
        return Microbatch(*(t.to(device) for t in (self.tokens, self.labels, self.positions)), doc_lens=self.doc_lens)


def forward_backward(
    model_parts, local: Microbatch, loss_fn: GlobalTokenLoss, schedule=None, has_first=True, has_last=True
) -> torch.Tensor:
    """Run one (cp-sharded) microbatch; return this rank's loss contribution (0 where no last stage).

    Without a pipeline ``model_parts`` is ``[model]``. With one, ``schedule.step`` splits the
    rows into pipeline microbatches and carries ``positions``, ``doc_lens`` and ``labels`` to every stage.
    """
    kwargs = dict(positions=local.positions, doc_lens=local.doc_lens, labels=local.labels)
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
