"""Pieces cut into fixed-size chunks: the layout every chunked recurrence kernel here runs on.

Each piece (a run of the local buffer, :mod:`.plan`) is cut into chunks of ``size`` tokens, its last
chunk padded at the end; the chunks of all pieces stand one after another. Padding is chosen by each
kernel to leave the state unchanged (zero keys and values, zero log-decay), so a piece's final state
is the state after its last, padded chunk.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from titan_cp.attention.linear.plan import on_device


@dataclass(frozen=True)
class Chunks:
    """``slots``: ``(chunks * size,)`` int64, the flat token in each chunk slot (``tokens``: padding);
    ``spans``: per piece, ``(first chunk, chunks)``; ``token_slot``: ``(tokens,)`` int64, each token's slot."""

    size: int
    tokens: int
    slots: torch.Tensor
    spans: tuple[tuple[int, int], ...]
    token_slot: torch.Tensor
    device: dict = field(default_factory=dict, compare=False, repr=False)  # on_device's cache

    @property
    def count(self) -> int:
        return self.slots.numel() // self.size

    def gather(self, x: torch.Tensor, pad: float = 0.0) -> torch.Tensor:
        """``x`` ``(tokens, *F)`` -> ``(chunks, size, *F)``, padding slots filled with ``pad``."""
        filler = x.new_full((1, *x.shape[1:]), pad)
        slots = on_device(self.device, "slots", lambda: self.slots, x.device)
        return torch.cat([x, filler]).index_select(0, slots).view(self.count, self.size, *x.shape[1:])

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """``(chunks, size, *F)`` -> ``(tokens, *F)``: each token's slot (padding dropped)."""
        token_slot = on_device(self.device, "token_slot", lambda: self.token_slot, y.device)
        return y.reshape(self.count * self.size, *y.shape[2:]).index_select(0, token_slot)


@functools.lru_cache(maxsize=64)
def chunked(runs: tuple[tuple[int, int], ...], tokens: int, size: int) -> Chunks:
    """The :class:`Chunks` of pieces ``runs`` (``(flat start, length)``, tiling ``tokens`` flat tokens)."""
    slots: list[int] = []
    spans: list[tuple[int, int]] = []
    token_slot = torch.empty(tokens, dtype=torch.int64)
    for start, length in runs:
        n = -(-length // size)
        spans.append((len(slots) // size, n))
        token_slot[start : start + length] = torch.arange(len(slots), len(slots) + length)
        slots += list(range(start, start + length)) + [tokens] * (n * size - length)
    return Chunks(size, tokens, torch.tensor(slots, dtype=torch.int64), tuple(spans), token_slot)
