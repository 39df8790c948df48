"""Attention masks as tiles: causal and packed-document masks without a dense ``S x S`` matrix.

The query buffer and the key buffer are each described by *runs* (see
:mod:`titan_cp.layout`): stretches of consecutive global positions inside one document.
A query at global position ``i`` of document ``d`` sees a key at position ``j`` of document
``e`` iff ``d == e`` and (``j <= i`` when causal). For one query run against one key run
of the same document, the visible set splits into at most three rectangles::

        keys:   [ks ........ qs ..... ke)        q run = [qs, qe), k run = [ks, ke)
               +-------------+---------+
      qs       |   full      | \\ diag  |        full: keys before the q run, all rows
       ...     |   (all      |   \\     |        diag: the square where key and query
      qe       |    rows)    |  full'  |              spans overlap, top-left causal
               +-------------+---------+        full': rows past the overlap see all of it

Every causal tile is square and aligned on its diagonal, so kernels that align causal
masks top-left (PyTorch's) and bottom-right (flash-attn) agree. Query/key pairs in
different documents, and keys after the query, produce no tile at all: empty blocks are
skipped, never computed and masked. Full tiles of one query range whose key ranges touch
are coalesced into one kernel call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from titan_cp.layout import Runs


@dataclass(frozen=True)
class Tile:
    """One kernel call: query rows ``[q0, q1)`` against key rows ``[k0, k1)`` of the local buffers.

    ``causal`` tiles are square (``q1 - q0 == k1 - k0``) with the diagonal at the top-left.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs in the tile: the attention work it carries."""
        n, m = self.q1 - self.q0, self.k1 - self.k0
        return n * (n + 1) // 2 if self.causal else n * m


def _coalesce(full: list[tuple[int, int, int, int]]) -> list[Tile]:
    """Merge full tiles whose key ranges touch (same query rows), then whose query ranges touch (same keys)."""
    merged: list[list[int]] = []
    for q0, q1, k0, k1 in sorted(full):
        last = merged[-1] if merged else None
        if last is not None and last[0] == q0 and last[1] == q1 and last[3] == k0:
            last[3] = k1
        else:
            merged.append([q0, q1, k0, k1])
    out: list[list[int]] = []
    for q0, q1, k0, k1 in sorted(merged, key=lambda t: (t[2], t[3], t[0])):
        last = out[-1] if out else None
        if last is not None and last[2] == k0 and last[3] == k1 and last[1] == q0:
            last[1] = q1
        else:
            out.append([q0, q1, k0, k1])
    return [Tile(q0, q1, k0, k1, False) for q0, q1, k0, k1 in out]


@functools.lru_cache(maxsize=4096)
def plan_tiles(q_runs: Runs, k_runs: Runs, causal: bool) -> tuple[Tile, ...]:
    """The tiles that compute exact (document-)masked attention of a query buffer on a key buffer."""
    by_doc: dict[int, list] = {}
    for kr in k_runs:
        by_doc.setdefault(kr.doc, []).append(kr)
    full: list[tuple[int, int, int, int]] = []
    diag: list[Tile] = []
    for qr in q_runs:
        qs, qe = qr.start, qr.start + qr.length
        for kr in by_doc.get(qr.doc, ()):
            ks, ke = kr.start, kr.start + kr.length
            if not causal:
                full.append((qr.local, qr.local + qr.length, kr.local, kr.local + kr.length))
                continue
            a, b = ks, min(ke, qs)  # keys before the query run: visible to every row
            if a < b:
                full.append((qr.local, qr.local + qr.length, kr.local + a - ks, kr.local + b - ks))
            a, b = max(ks, qs), min(ke, qe)  # keys inside the query run's span
            if a < b:
                q0, k0 = qr.local + a - qs, kr.local + a - ks
                diag.append(Tile(q0, q0 + b - a, k0, k0 + b - a, True))
                if b < qe:  # rows after the overlap see all of it
                    full.append((qr.local + b - qs, qr.local + qr.length, k0, k0 + b - a))
    return tuple(diag + _coalesce(full))


def visible_pairs(tiles: tuple[Tile, ...]) -> int:
    """Exact count of visible (query, key) pairs covered by ``tiles``."""
    return sum(t.pairs for t in tiles)
