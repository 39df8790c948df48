"""The ``doc_local`` balance: packed documents stay whole on one rank wherever the balance allows.

``doc_zigzag`` balances a row exactly by cutting *every* document into 2N pieces, so every rank
needs every other rank's K/V and the kernel sees small tiles. ``doc_local`` keeps most documents
whole, so most K/V are needed by their own rank only (the strategies send only what another rank
can see), and splits only what the balance needs. Every rank holds exactly ``C = S/N`` tokens;
the causal work of a piece of ``m`` tokens at offset ``o`` in its document is
``m*o + m(m+1)/2`` (its queries see the document's earlier keys), and ``share`` is the row's work
over N. Deterministic from ``doc_lens`` alone, so every rank computes the same layout::

    1. big documents (work > beta * share), heaviest first, are split head-tail over the m ranks
       with the least work and room for them: 2m pieces, the k-th of those ranks takes pieces
       k and 2m-1-k (equal work and tokens on each), m = max(2, work / (gamma * share), L / C)
       rounded up, at most N, for a spread ``gamma >= beta``;
    2. the other documents, longest first, go whole to the rank with the most work still to
       take per token of room, (share - work_r) / room_r, among those with room for them;
    3. a document that fits nowhere whole is cut into contiguous parts over the ranks with
       room, in the same order (its later parts see the earlier ones' keys).

``beta`` and ``gamma`` run over :data:`BETAS` (fewest documents split, over fewest ranks, first);
of the results that keep every rank's work within :data:`BALANCE` of the mean, the one whose
slowest rank costs least is kept (:func:`_choose`): a rank's cost is its causal work plus what its
split pieces move, in pairs of work (:data:`MERGE_PAIRS` per query token merged with one more
rank's results, :data:`SEND_PAIRS` per key token sent to one more rank); the last beta, 0, splits
every document over all ranks as ``doc_zigzag`` does.
Within a rank, whole documents come first and the pieces of split ones after them, so what other
ranks see of a rank, and the rows whose results merge, are one span of its buffer. One document
longer than a rank is split over all ranks: on one document the layout is ``zigzag`` and sends
what it sends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

BALANCE = 1.05  # most causal work of a rank over the mean, where reachable
BETAS = (float("inf"), 2.0, 1.0, 0.5, 0.25, 0.12, 0.06, 0.03, 0.0)
LOOK_FURTHER = 2  # betas tried after the first balanced one, for splits that move less
# What a split moves, in pairs of causal work (the kernel's 14 H E FLOPs a pair, forward and backward,
# at 60% of an H100's or H200's peak, against HBM bytes at their bandwidth: one byte per element of a
# token's H x E is about 9 pairs). A query token whose document has earlier pieces on one more rank
# gets one more partial result: about 40 bytes per element around the kernel (its rows gathered for
# the kernel in the forward and the backward, its partial merged, its dq summed) and smaller kernel
# tiles. A key token read by one more rank is sent and its gradient added home: about a third of that
# with grouped K/V heads.
MERGE_PAIRS = 360
SEND_PAIRS = 120


def work(length: int, offset: int = 0) -> int:
    """Visible causal pairs of ``length`` consecutive queries at ``offset`` in their document."""
    return length * offset + length * (length + 1) // 2


class _Fill:
    """An assignment in progress: the pieces, room and causal work of each rank."""

    def __init__(self, doc_lens: Sequence[int], n: int):
        self.n, self.capacity = n, sum(doc_lens) // n
        self.room, self.work = [self.capacity] * n, [0] * n
        self.share = sum(work(length) for length in doc_lens) / n
        self.pieces: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self.docs: dict[int, list[tuple[int, int, int]]] = {}  # document start: (rank, offset, length)

    def give(self, r: int, start: int, length: int, offset: int) -> None:
        """Rank ``r`` takes global positions ``[start, start + length)``, at ``offset`` in their document."""
        self.pieces[r].append((start, length))
        self.docs.setdefault(start - offset, []).append((r, offset, length))
        self.room[r] -= length
        self.work[r] += work(length, offset)

    def hungriest(self, ranks) -> int:
        """The rank with the most work still to take per token of room (ties: the lowest rank)."""
        return max(ranks, key=lambda r: ((self.share - self.work[r]) / self.room[r], -r))

    def cut_into_room(self, start: int, offset: int, length: int) -> None:
        """Positions ``[start, start + length)`` (``offset`` in their document) as contiguous parts, hungriest first."""
        while length:
            r = self.hungriest([r for r in range(self.n) if self.room[r]])
            m = min(length, self.room[r])
            self.give(r, start, m, offset)
            start, offset, length = start + m, offset + m, length - m

    def rank_costs(self) -> list[float]:
        """Each rank's causal work plus what its pieces of split documents move (module docstring): a
        piece's queries merge with every other rank holding earlier tokens of its document, and its keys
        are sent to every other rank holding later ones."""
        cost = [float(w) for w in self.work]
        for pieces in (p for p in self.docs.values() if len({r for r, _, _ in p}) > 1):
            for r, offset, length in pieces:
                earlier = {q for q, o, _ in pieces if q != r and o < offset + length}
                later = {q for q, o, n in pieces if q != r and o + n > offset}
                cost[r] += length * (MERGE_PAIRS * len(earlier) + SEND_PAIRS * len(later))
        return cost

    def imbalance(self) -> float:
        mean = sum(self.work) / self.n
        return max(self.work) / mean if mean else 1.0


def _zigzag_pieces(length: int, m: int) -> list[tuple[int, int, int]]:
    """``(slot, offset, size)`` of a document cut into 2m head-tail pieces, extra tokens to the first."""
    base, extra = divmod(length, 2 * m)
    out, offset = [], 0
    for slot in range(2 * m):
        size = base + (slot < extra)
        if size:
            out.append((slot, offset, size))
        offset += size
    return out


def _split_over_ranks(fill: _Fill, start: int, length: int, gamma: float) -> None:
    """Step 1 for one document: head-tail over the least-loaded ranks with room, as many as its work
    over ``gamma`` shares (all of them for ``gamma = 0``)."""
    n = fill.n
    m = n if gamma == 0 else min(n, max(2, math.ceil(work(length) / (gamma * fill.share)), -(-length // fill.capacity)))
    ranks = sorted((r for r in range(n) if fill.room[r] >= -(-length // m)), key=lambda r: (fill.work[r], r))
    while len(ranks) < m and m < n:
        m += 1
        ranks = sorted((r for r in range(n) if fill.room[r] >= -(-length // m)), key=lambda r: (fill.work[r], r))
    ranks = ranks[:m] if len(ranks) >= m else sorted(range(n), key=lambda r: (-fill.room[r], r))[:m]
    for slot, offset, size in _zigzag_pieces(length, m):
        r = ranks[min(slot, 2 * m - 1 - slot)]
        take = min(size, fill.room[r])
        if take:
            fill.give(r, start + offset, take, offset)
        if take < size:  # no room left there: the rest where there is
            fill.cut_into_room(start + offset + take, offset + take, size - take)


def _fill(doc_lens: Sequence[int], n: int, beta: float, gamma: float | None = None) -> _Fill:
    fill = _Fill(doc_lens, n)
    starts = [0]
    for length in doc_lens[:-1]:
        starts.append(starts[-1] + length)
    order = sorted(range(len(doc_lens)), key=lambda d: (-doc_lens[d], d))
    big = {d for d in order if beta == 0 or work(doc_lens[d]) > beta * fill.share}
    for d in (d for d in order if d in big):
        _split_over_ranks(fill, starts[d], doc_lens[d], beta if gamma is None else gamma)
    leftovers = []
    for d in (d for d in order if d not in big):
        fits = [r for r in range(n) if fill.room[r] >= doc_lens[d]]
        if fits:
            fill.give(fill.hungriest(fits), starts[d], doc_lens[d], 0)
        else:
            leftovers.append(d)
    for d in leftovers:
        fill.cut_into_room(starts[d], 0, doc_lens[d])
    assert not any(fill.room), fill.room
    return fill


def _choose(doc_lens: list[int], n: int) -> _Fill:
    """The assignment to keep. For each ``beta`` (which documents are split) the spreads ``gamma >= beta``
    of :data:`BETAS` (how many ranks each split takes: fewer for a larger ``gamma``) are tried; of the
    assignments within :data:`BALANCE`, found at the first balanced ``beta`` and the :data:`LOOK_FURTHER`
    after it, the one whose costliest rank (:meth:`_Fill.rank_costs`: work and what its splits move)
    costs least. Where none is within :data:`BALANCE`, the best balanced."""
    best, cheapest, left = None, None, None
    for beta in BETAS:
        for gamma in [g for g in BETAS if g >= beta and (g > 0 or beta == 0)][::-1]:
            fill = _fill(doc_lens, n, beta, gamma)
            if best is None or fill.imbalance() < best.imbalance():
                best = fill
            if fill.imbalance() <= BALANCE:
                cost = max(fill.rank_costs())
                if cheapest is None or cost < cheapest[0]:
                    cheapest = (cost, fill)
        left = LOOK_FURTHER if cheapest is not None and left is None else left
        if left is not None:
            if not left:
                break
            left -= 1
    return cheapest[1] if cheapest else best


def _buffer_order(pieces: list[tuple[int, int]], whole: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """A rank's pieces in buffer order: its whole documents first, then the pieces of split documents,
    each group by position. The rows other ranks see (and whose results merge) are then one span of
    the buffer, read as a view, and the whole documents a span whose results need no merge."""
    return sorted(p for p in pieces if p in whole) + sorted(p for p in pieces if p not in whole)


def doc_local_pieces(doc_lens: Sequence[int], cp_size: int) -> list[list[tuple[int, int]]]:
    """The ``(start, length)`` pieces of global positions each rank holds, in buffer order: whole
    documents, then pieces of split ones, each by position (module docstring)."""
    best = _choose(list(doc_lens), cp_size)
    starts = [0]
    for length in doc_lens[:-1]:
        starts.append(starts[-1] + length)
    whole = set(zip(starts, doc_lens))
    return [_buffer_order(p, whole) for p in best.pieces]
