"""Document-length mixes and packing quality, for ``scripts/bench_packing.py`` and the tests.

Mixes of one document's length per draw (:data:`DOC_LENGTH_MIXES`; document ``i``'s length
depends only on ``(mix, seed, i)``):

    lognormal_2k   log-normal, mean 2048 tokens, sigma 1
    lognormal_8k   log-normal, mean 8192 tokens, sigma 1
    agent          agent-like: 98% short turns (log-normal, mean 1024, sigma 1) and 2% long
                   trajectories, uniform in [64K, 192K] tokens

Quality of ``rows`` packed rows (:func:`measure_packing`):

    docs_cut_fraction   of the documents no longer than seq_len that appear in those rows, the
                        fraction not kept whole in one piece (cut by a row boundary)
    padding_fraction    padding tokens / all tokens of those rows
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from titan_cp.data.document import Document

if TYPE_CHECKING:
    from titan_cp.data.packing import _RowPacker


def _lognormal(rng: random.Random, mean: float, sigma: float = 1.0) -> int:
    return max(2, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)))


DOC_LENGTH_MIXES = {
    "lognormal_2k": lambda rng: _lognormal(rng, 2048),
    "lognormal_8k": lambda rng: _lognormal(rng, 8192),
    "agent": lambda rng: rng.randint(65536, 196608) if rng.random() < 0.02 else _lognormal(rng, 1024),
}


class LengthSource:
    """A ``DocumentSource`` of documents of ``mix``'s lengths (every token 0: only lengths matter)."""

    def __init__(self, mix: str, seed: int = 0) -> None:
        if mix not in DOC_LENGTH_MIXES:
            raise ValueError(f"unknown mix {mix!r}; mixes are {sorted(DOC_LENGTH_MIXES)}")
        self.mix, self.seed = mix, seed

    def length(self, index: int) -> int:
        return DOC_LENGTH_MIXES[self.mix](random.Random(f"{self.mix}/{self.seed}/{index}"))

    def document(self, index: int) -> Document:
        return Document([0] * self.length(index))


def measure_packing(packer: _RowPacker, rows: int, length: Callable[[int], int]) -> dict[str, float | int]:
    """Pack ``rows`` rows with ``packer`` (``skip_row``); ``length(i)``: document ``i``'s length."""
    pieces: defaultdict[int, list[int]] = defaultdict(list)
    padding = 0
    for _ in range(rows):
        for i, a, b in packer.skip_row().pieces:
            if i < 0:
                padding += b - a
            else:
                pieces[i].append(b - a)
    short = {i: p for i, p in pieces.items() if length(i) <= packer.seq_len}
    cut = sum(1 for i, p in short.items() if len(p) > 1 or sum(p) < length(i))
    return {
        "rows": rows,
        "docs": len(pieces),
        "docs_le_seq_len": len(short),
        "docs_cut_fraction": cut / max(1, len(short)),
        "padding_fraction": padding / (rows * packer.seq_len),
    }
