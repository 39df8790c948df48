"""Global-token loss: every rank sums its token losses and divides by the step's global count.

With ``n`` the number of loss-bearing tokens over all data-parallel ranks, cp ranks and
gradient-accumulation microbatches of a step (counted by the loader)::

    loss_rank = sum_{local valid tokens t} CE(t) / n
    sum over ranks and microbatches of loss_rank = mean CE over the global batch

so gradients are *summed* over ``dp x cp`` (FSDP's division set to 1), never averaged.
Averaging per rank instead would weight a token by 1/(its rank's count): ranks whose shard
holds fewer valid tokens (document ends, masked prompts) would count for more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over tokens whose label is not ``IGNORE_INDEX``, in fp32.

    logits: (batch, seq, vocab) (a vocab-sharded DTensor under loss parallel); labels: (batch, seq).
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum")


class GlobalTokenLoss:
    """``loss_fn(logits, labels) = token_loss_sum / global_valid_tokens``; set the count every step.

    One object serves a pipeline schedule (whose ``loss_fn`` is fixed when it is built) and
    the plain training step alike.
    """

    def __init__(self) -> None:
        self.global_valid_tokens: int | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not self.global_valid_tokens:
            raise ValueError("GlobalTokenLoss.global_valid_tokens must be set to the step's positive token count")
        return token_loss_sum(logits, labels) / self.global_valid_tokens
