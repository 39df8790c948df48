"""Choosing the next token: greedy, or sampled with temperature and nucleus (top-p), seeded per prompt.

Sampling runs on the host, in fp64, from one uniform draw per token of a generator seeded by
``(seed, prompt index)``: the draw does not depend on the mesh, the batch or the device, so the
same seed gives the same tokens on every mesh (the logits agree to ~1e-6 across meshes; a draw
falls on another token only if it lands that close to a boundary of the cumulative distribution)::

    p = softmax(logits / temperature)
    keep the most probable tokens whose mass before them is below top_p (the first always)
    token = the first kept token (by descending p) whose cumulative renormalised mass exceeds u ~ U[0, 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

_PROMPT_STRIDE = 1_000_003  # seeds of two prompts never meet for seeds below it


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0: greedy (argmax); above 0: sampled, from the ``top_p`` nucleus, seeded by ``seed``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generators(self, prompt_indices: Sequence[int]) -> list[torch.Generator | None]:
        """One host generator per prompt (``None`` for greedy), seeded by ``(seed, prompt index)``."""
        if self.greedy:
            return [None] * len(prompt_indices)
        return [torch.Generator().manual_seed(self.seed + _PROMPT_STRIDE * int(i)) for i in prompt_indices]


def nucleus(probs: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """``(p, ids)``: the smallest set of most probable tokens whose mass reaches ``top_p``, by
    descending probability, renormalised. ``probs`` ``(V,)``."""
    p, ids = probs.sort(descending=True, stable=True)
    before = p.cumsum(0) - p
    keep = int((before < top_p).sum().clamp(min=1))
    p = p[:keep]
    return p / p.sum(), ids[:keep]


def sample_next(logits: Tensor, sampling: Sampling, generators: list) -> list[int]:
    """The next token of each row of ``logits (B, V)`` (``generators[b]`` for row ``b``)."""
    if sampling.greedy:
        return logits.argmax(-1).tolist()
    probs = torch.softmax(logits.detach().to("cpu", torch.float64) / sampling.temperature, dim=-1)
    tokens = []
    for row, gen in zip(probs, generators):
        p, ids = nucleus(row, sampling.top_p)
        u = torch.rand((), generator=gen, dtype=torch.float64)
        j = int(torch.searchsorted(p.cumsum(0), u, right=True).clamp(max=len(p) - 1))
        tokens.append(int(ids[j]))
    return tokens
