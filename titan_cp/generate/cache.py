"""The KV cache of one cp rank: the K/V of its own tokens only, never the whole sequence.

After the prefill each rank holds the K/V of the prompt tokens the layout gave it; every new
token's K/V is appended to one rank, its *owner*. Owners are planned at the prefill for every
token that may be generated (:func:`plan_owners`): each goes to the rank holding the fewest
tokens in all (then the fewest of its prompt, then the lowest rank). Greedy least-loaded
placement keeps every rank within ``ceil(tokens / cp)`` at every step, so the longest prompt
that fits grows linearly with cp. Knowing the plan, every rank allocates its cache once, exactly.

Storage, per layer, token-major: ``k, v (capacity, K, E)``. Each prompt has a region of its
own, ``[offset_b, offset_b + capacity_b)``: its prefill tokens sorted by position, then its
generated tokens as they come, so the positions in a region increase and what a query sees
(its whole prompt, the last ``window`` positions, its chunk) is a contiguous range of it.
Positions live on the host: the key ranges of a decode step are computed without the device.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from torch import Tensor

from titan_cp.layout import spans


def plan_owners(held: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """``owners[b][t]``: the rank that stores the K/V of token ``t`` fed for prompt ``b`` in decode
    (tokens appended step by step, prompt by prompt), given ``held[b][r]``, the tokens of prompt
    ``b`` rank ``r`` holds after the prefill. Each goes to the rank with the fewest tokens, then
    the fewest of that prompt, then the lowest rank."""
    per_prompt = [list(row) for row in held]
    cp = len(per_prompt[0]) if per_prompt else 1
    total = [sum(row[r] for row in per_prompt) for r in range(cp)]
    owners: list[list[int]] = [[] for _ in per_prompt]
    for _ in range(new_tokens):
        for b, row in enumerate(per_prompt):
            r = min(range(cp), key=lambda j: (total[j], row[j], j))
            owners[b].append(r)
            total[r] += 1
            row[r] += 1
    return owners


class ShardedKVCache:
    """This rank's K/V for ``n_layers`` layers, on ``device``.

    ``positions[b]``: the positions of prompt ``b`` this rank holds after the prefill, sorted;
    ``extra[b]``: the generated tokens of prompt ``b`` it will store (its share of the plan).
    """

    def __init__(
        self, n_layers: int, positions: Sequence[Sequence[int]], extra: Sequence[int], device: torch.device | str
    ) -> None:
        caps = [len(p) + n for p, n in zip(positions, extra)]
        self.offsets = [sum(caps[:b]) for b in range(len(caps) + 1)]
        self.capacity = self.offsets[-1]
        self.positions: list[list[int]] = [list(p) for p in positions]
        self.device = device
        # allocated by the first write of each layer (the prefill's), at the K/V's heads and dtype
        self.k: list[Tensor | None] = [None] * n_layers
        self.v: list[Tensor | None] = [None] * n_layers

    @property
    def tokens_held(self) -> int:
        """Tokens whose K/V this rank holds now (prefill and generated)."""
        return sum(len(p) for p in self.positions)

    def prefill_rows(self, prompt_of_slot: Tensor, position_of_slot: Tensor) -> tuple[Tensor, Tensor]:
        """``(local slots, cache rows)``: where each of the rank's prefill tokens goes, given the prompt
        (-1 for padding) and position of each local slot ``(S_local,)`` int64 on the host. The rows
        follow :attr:`positions` (each prompt's tokens sorted by position, prompt by prompt)."""
        mine = torch.nonzero(prompt_of_slot >= 0).flatten()
        key = prompt_of_slot[mine] * (int(position_of_slot.max()) + 1) + position_of_slot[mine]
        slots = mine[torch.argsort(key)]
        lengths = [len(p) for p in self.positions]
        rows = spans(self.offsets[:-1], lengths)
        assert position_of_slot[slots].tolist() == [p for held in self.positions for p in held]
        return slots, rows

    def write(self, layer: int, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """Store ``k (n, K, E)``, ``v (n, K, Ev)`` at cache ``rows (n,)`` of ``layer`` (allocating the layer's
        ``(capacity, K, E)`` and ``(capacity, K, Ev)`` buffers, each in its own dtype, at its first write; v's
        head dim may differ from k's: multi-head latent attention)."""
        k_layer, v_layer = self.k[layer], self.v[layer]
        if k_layer is None or v_layer is None:
            k_layer = self.k[layer] = k.new_zeros((self.capacity, *k.shape[1:]), device=self.device)
            v_layer = self.v[layer] = v.new_zeros((self.capacity, *v.shape[1:]), device=self.device)
        k_layer.index_copy_(0, rows, k)
        v_layer.index_copy_(0, rows, v)

    def nbytes(self) -> int:
        """Bytes of the K/V buffers allocated on this rank."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)

    def append(self, prompt: int, position: int) -> int:
        """Reserve the next row of ``prompt``'s region for the token at ``position``; its row."""
        held = self.positions[prompt]
        row = self.offsets[prompt] + len(held)
        assert row < self.offsets[prompt + 1], f"prompt {prompt}'s region is full: the owner plan was not followed"
        assert not held or position > held[-1], (prompt, position, held[-1:])
        held.append(position)
        return row

    def key_range(self, prompt: int, position: int, window: int | None, chunk: int | None) -> tuple[int, int]:
        """The cache rows ``[start, end)`` the query of ``prompt`` at ``position`` sees on this rank:
        every held position ``<= position`` that is within the last ``window`` positions (a sliding
        window) and in the query's ``chunk``-sized piece of the prompt."""
        held = self.positions[prompt]
        low = 0
        if window is not None:
            low = max(low, position - window + 1)
        if chunk is not None:
            low = max(low, position - position % chunk)
        start = bisect.bisect_left(held, low)
        end = bisect.bisect_right(held, position)
        return self.offsets[prompt] + start, self.offsets[prompt] + end
