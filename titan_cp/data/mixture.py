"""A weighted mixture of document sources: deterministic, random-access, resumable by index alone.

Mixture index ``i`` lies in block ``b = i // W`` (``W = block`` draws, 1024 by default). The ``W``
sources of block ``b`` are drawn with replacement, with probability proportional to the weights,
from a random stream seeded by ``(seed, b)`` alone; the ``k``-th draw of a source overall is that
source's document ``k`` (each source walks through its own documents in order and wraps around by
itself). So document ``i`` depends only on ``(seed, weights, i)``: a packer's position in the
mixture is one integer, and a resumed run (on any mesh) reads the same documents. Finding the
per-source counts before block ``b`` replays the ``b`` earlier blocks' draws once (about a second
per ten million documents), then is cached.

Each document comes back with ``source`` set to its source's name, so the loader can count the
tokens drawn from each source.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from titan_cp.data.document import Document, DocumentSource


class Mixture:
    """``sources``: ``(name, source, weight)`` triples; weights ``>= 0`` with a positive sum."""

    def __init__(self, sources: Sequence[tuple[str, DocumentSource, float]], seed: int = 0, block: int = 1024) -> None:
        if not sources:
            raise ValueError("training.mixture is empty: list at least one source")
        names = [name for name, _, _ in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"training.mixture: source names must be unique, got {names}")
        for name, _, weight in sources:
            if not weight >= 0:  # also catches NaN
                raise ValueError(f"training.mixture[{name!r}].weight = {weight}: weights must be >= 0")
        if sum(w for _, _, w in sources) <= 0:
            raise ValueError(f"training.mixture: the weights sum to zero ({[w for _, _, w in sources]})")
        self.names = names
        self.sources = [s for _, s, _ in sources]
        self.weights = [float(w) for _, _, w in sources]
        self.seed, self.block = seed, block
        self._starts: list[list[int]] = [[0] * len(sources)]  # per block: draws of each source before it
        self._cache: dict[int, tuple[list[int], list[int]]] = {}

    def _draws(self, b: int) -> tuple[list[int], list[int]]:
        """Block ``b``'s source per slot, and each slot's ordinal among its source's draws in the block."""
        if b not in self._cache:
            rng = random.Random(f"mixture/{self.seed}/{b}")
            choice = rng.choices(range(len(self.sources)), weights=self.weights, k=self.block)
            seen = [0] * len(self.sources)
            ordinal = []
            for s in choice:
                ordinal.append(seen[s])
                seen[s] += 1
            if len(self._cache) >= 4:
                self._cache.pop(next(iter(self._cache)))
            self._cache[b] = (choice, ordinal)
        return self._cache[b]

    def _start(self, b: int) -> list[int]:
        while len(self._starts) <= b:
            c = len(self._starts) - 1
            counts = list(self._starts[c])
            for s in self._draws(c)[0]:
                counts[s] += 1
            self._starts.append(counts)
        return self._starts[b]

    def document(self, index: int) -> Document:
        b, j = divmod(index, self.block)
        choice, ordinal = self._draws(b)
        s = choice[j]
        doc = self.sources[s].document(self._start(b)[s] + ordinal[j])
        return dataclasses.replace(doc, source=self.names[s])
