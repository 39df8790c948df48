"""Document-length rows: one helper that fills a row, and the named document mixes.

Every row is a list of document lengths summing to exactly ``seq_len``. :func:`fill_row` is
the one place that draws lengths until the row is full (the last document is cut to fit);
the mixes only say how one length is drawn. Each row is deterministic given
``(mix, seed, row)``.

Mixes (:data:`ROW_MIXES`, as the planner's ``--doc-mix`` and ``scripts/bench_balance.py`` name them):

    causal               one document filling the row (plain causal attention)
    uniform_short        lengths uniform in [128, 2048]
    lognormal_long_tail  log-normal, median 4096, sigma 1.5
    one_huge             one document of 50-80% of the row at a random place, the rest uniform [64, 1024]
    code_repo            source-file token counts: log-normal body (median 350, sigma 1.2)
                         with an 8% Pareto tail (alpha 1.1, from 2000 tokens), files packed in order

The random mixes draw with numpy's ``default_rng([seed, mix, row])``; numpy is imported only
when a row draws (``causal`` draws nothing), so the planner runs without it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any


def fill_row(draw: Callable[[], float], seq_len: int) -> list[int]:
    """Draw document lengths with ``draw()`` until they fill ``seq_len`` tokens; the last one is
    cut to fit and every length is at least 1."""
    lens, left = [], seq_len
    while left:
        n = max(1, min(left, int(draw())))
        lens.append(n)
        left -= n
    return lens


def lognormal_doc_lens(total: int, mean: float, seed: int = 0, sigma: float = 1.0) -> list[int]:
    """Log-normal document lengths with mean ``mean`` (rounded), filling ``total`` tokens."""
    rng = random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2
    return fill_row(lambda: round(rng.lognormvariate(mu, sigma)), total)


def proportional_doc_lens(seq_len: int, docs: int) -> list[int]:
    """``docs`` documents with lengths proportional to ``docs, docs-1, ..., 1`` filling ``seq_len``."""
    if docs < 1 or docs > seq_len:
        raise ValueError(f"docs must be in [1, seq_len = {seq_len}], got {docs}")
    weights = list(range(docs, 0, -1))
    lens = [seq_len * w // sum(weights) for w in weights]
    lens[-1] += seq_len - sum(lens)
    return lens


class _RowDraws:
    """numpy's ``default_rng(key)`` for one row, made on first use (a mix that draws nothing needs no numpy)."""

    def __init__(self, key: list[int], mix: str) -> None:
        self._key, self._mix = key, mix
        self._rng: Any = None  # numpy's Generator, made on first use

    def __getattr__(self, name: str) -> Any:
        if self._rng is None:
            try:
                import numpy as np
            except ImportError as e:
                raise ValueError(f"document mix {self._mix!r} draws with numpy, which is not installed") from e
            self._rng = np.random.default_rng(self._key)
        return getattr(self._rng, name)


def _causal(rng, seq_len: int) -> list[int]:
    return [seq_len]


def _uniform_short(rng, seq_len: int) -> list[int]:
    return fill_row(lambda: rng.integers(128, 2049), seq_len)


def _lognormal_long_tail(rng, seq_len: int) -> list[int]:
    return fill_row(lambda: rng.lognormal(math.log(4096), 1.5), seq_len)


def _one_huge(rng, seq_len: int) -> list[int]:
    huge = int(seq_len * rng.uniform(0.5, 0.8))
    small = fill_row(lambda: rng.integers(64, 1025), seq_len - huge)
    small.insert(int(rng.integers(0, len(small) + 1)), huge)
    return small


def _code_repo(rng, seq_len: int) -> list[int]:
    def file_tokens() -> float:
        if rng.random() < 0.08:
            return 2000 * (1 + rng.pareto(1.1))
        return rng.lognormal(math.log(350), 1.2)

    return fill_row(file_tokens, seq_len)


ROW_MIXES: dict[str, Callable[..., list[int]]] = {
    "uniform_short": _uniform_short,
    "lognormal_long_tail": _lognormal_long_tail,
    "one_huge": _one_huge,
    "code_repo": _code_repo,
    "causal": _causal,
}
BALANCE_MIXES = ("uniform_short", "lognormal_long_tail", "one_huge", "code_repo")  # bench_balance's default


def make_rows(mix: str, seq_len: int, rows: int, seed: int = 0) -> list[list[int]]:
    """``rows`` document-length lists of ``mix``, each summing to ``seq_len``."""
    if mix not in ROW_MIXES:
        raise ValueError(f"unknown document mix {mix!r}; choose one of {sorted(ROW_MIXES)}")
    mix_id = list(ROW_MIXES).index(mix)
    return [ROW_MIXES[mix](_RowDraws([seed, mix_id, row], mix), seq_len) for row in range(rows)]
