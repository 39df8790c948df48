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
       k and 2m-1-k (equal work and tokens on each; or cut at whole kernel blocks of 128 tokens, the
       last piece taking the rest), m = max(2, work / (gamma * share), L / C) rounded up, at most N,
       for a spread ``gamma >= beta``;
    2. the other documents, longest first, go whole to the rank with the most work still to
       take per token of room, (share - work_r) / room_r, among those with room for them;
    3. a document that fits nowhere whole is cut into contiguous parts over the ranks with
       room, in the same order (its later parts see the earlier ones' keys).

``beta`` and ``gamma`` run over :data:`BETAS` (fewest documents split, over fewest ranks, first),
each with even and block cuts; of the results that keep every rank's work within :data:`BALANCE`
of the mean, the one whose slowest rank costs least is kept (:func:`_choose`): a rank's cost is its
causal work plus what its split pieces move, in pairs of work (:data:`MERGE_PAIRS` per query token
merged with one more rank's results, :data:`SEND_PAIRS` per key token sent to one more rank), and
the pairs of the kernel's blocks the pieces' edges leave partly empty. Results are kept only where
no rank then sends more under causal masks than under the even cut measured against: of the even
cuts costing within :data:`NEAR` of the cheapest (by that cost without the blocks), the one sending
nearest the least under every mask of :data:`REACHES`. Of the results kept and costing within
:data:`NEAR` of the cheapest, the cheapest sending no more under those windows either (the layout is
made before any layer's mask is known). The last beta, 0, splits every document over all ranks as
``doc_zigzag`` does.
Within a rank, whole documents come first and the pieces of split ones after them, so what other
ranks see of a rank, and the rows whose results merge, are one span of its buffer. One document
longer than a rank is split over all ranks: on one document the layout is ``zigzag`` and sends
what it sends.
"""

from __future__ import annotations

import functools
import itertools
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
BLOCK = 128  # the flash kernels' tile of queries and of keys: split points fall on its multiples
# The masks whose sends a layout is checked under (it is built from the documents alone, before any layer's
# mask is known): causal, and sliding windows of every power of two from 128 to 65,536 keys
REACHES = (None,) + tuple(2**k for k in range(7, 17))
NEAR = 1.01  # costs this close are one to the cost model: of them, one sending no more under any window


def work(length: int, offset: int = 0) -> int:
    """Visible causal pairs of ``length`` consecutive queries at ``offset`` in their document."""
    return length * offset + length * (length + 1) // 2


class _Fill:
    """An assignment in progress: the pieces, room and causal work of each rank."""

    def __init__(self, doc_lens: Sequence[int], n: int) -> None:
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

    def hungriest(self, length: int = 1) -> int | None:
        """Of the ranks with room for ``length`` tokens, the one with the most work still to take per token
        of room (ties: the lowest rank; ``None``: none has room), in one pass (every whole document of
        every candidate assignment asks it)."""
        best, key = None, 0.0
        for r, room in enumerate(self.room):
            if room >= length and (best is None or (self.share - self.work[r]) / room > key):
                best, key = r, (self.share - self.work[r]) / room
        return best

    def cut_into_room(self, start: int, offset: int, length: int) -> None:
        """Positions ``[start, start + length)`` (``offset`` in their document) as contiguous parts, hungriest first."""
        while length:
            r = self.hungriest()
            if r is None:  # the fill gives out exactly the tokens the ranks have room for
                raise RuntimeError(f"doc_local: no rank has room left for {length} tokens at position {start}")
            m = min(length, self.room[r])
            self.give(r, start, m, offset)
            start, offset, length = start + m, offset + m, length - m

    def _split(self):
        """``(rank, offset, length, pieces, later)`` of every piece of a split document; ``later``: the other
        ranks holding later tokens of it (those its keys are sent to)."""
        for pieces in (p for p in self.docs.values() if len({r for r, _, _ in p}) > 1):
            for r, offset, length in pieces:
                later = {q for q, o, n in pieces if q != r and o + n > offset}
                yield r, offset, length, pieces, later

    def rank_costs(self, blocks: bool = True) -> list[float]:
        """Each rank's causal work plus what its pieces of split documents cost beyond their pairs
        (module docstring): merges with every other rank holding earlier tokens of the document, sends to
        every other rank holding later ones, and (``blocks``) the kernel's partly empty blocks at the
        pieces' edges (:func:`block_work`, against the pairs themselves)."""
        cost = [float(w) for w in self.work]
        for r, offset, length, pieces, later in self._split():
            earlier = {q for q, o, _ in pieces if q != r and o < offset + length}
            cost[r] += length * (MERGE_PAIRS * len(earlier) + SEND_PAIRS * len(later))
            if blocks:
                cost[r] += block_work(length, [n for _, o, n in pieces if o < offset]) - work(length, offset)
        return cost

    def sends(self, reach: int | None = None) -> tuple[int, int]:
        """What the rank sending most sends, in K/V rows: its tokens to each other rank holding later tokens of
        their document, those of them that rank's queries can see (``reach``: a sliding window of that many
        keys; ``None``: causal), and the gradients of the tokens it reads from other ranks back. Counted with
        the gradients at one row each, and at two (the all-gather's, in fp32 against 16-bit K/V: exactly
        what it sends). The ring sends its rows again in the backward; its count is left at one row each:
        what a blocked cut saves in kernel blocks outweighs the few rows it moves between ranks."""
        sent, read = [0] * self.n, [0] * self.n
        for pieces in (p for p in self.docs.values() if len({r for r, _, _ in p}) > 1):
            first: dict[int, int] = {}  # rank: its earliest piece after the one at hand
            for r, offset, length in sorted(pieces, key=lambda p: -p[1]):
                for q, later in first.items():
                    if q != r:
                        rows = length if reach is None else min(length, max(0, offset + length - later + reach - 1))
                        sent[r], read[q] = sent[r] + rows, read[q] + rows
                first[r] = offset
        return max(map(sum, zip(sent, read))), max(s + 2 * g for s, g in zip(sent, read))

    def imbalance(self) -> float:
        mean = sum(self.work) / self.n
        return max(self.work) / mean if mean else 1.0


def block_work(length: int, earlier: Sequence[int] = ()) -> int:
    """The pairs the kernel computes for a piece of ``length`` tokens whose document has pieces of lengths
    ``earlier`` before it: its causal square and its full tiles on each of them, in whole
    :data:`BLOCK` x :data:`BLOCK` blocks (a tile of ``n`` queries is ``ceil(n / BLOCK)`` block rows)."""
    b = -(-length // BLOCK)
    return (b * (b + 1) // 2 + b * sum(-(-n // BLOCK) for n in earlier)) * BLOCK * BLOCK


CUTS = ("even", "pieces", "pairs")  # how a split document is cut (:func:`_zigzag_pieces`)


def _zigzag_pieces(length: int, m: int, cut: str) -> list[tuple[int, int, int]]:
    """``(slot, offset, size)`` of a document cut into 2m head-tail pieces: ``even`` (equal lengths, extra
    tokens to the first), or at whole kernel blocks (:data:`BLOCK` tokens): ``pieces``, each of those but
    the last cut down to whole blocks; ``pairs``, each pair k, 2m-1-k that one rank takes cut down to
    whole blocks and shared as evenly as blocks allow, the first piece cut down too; the last piece
    takes what they leave. Every tile between two blocked pieces covers whole blocks, as one call over
    the document does, where pieces of any length each end in a partly empty block (a document of
    20,588 tokens in 16 pieces: 19% more blocks). No rank holds more of the document than evenly but
    the last piece's, which holds up to a block per piece (``pieces``: no rank sends more) or per pair
    (``pairs``: nearer the even balance) more of its latest tokens, sent to no one."""
    sizes = [length // (2 * m) + (slot < length % (2 * m)) for slot in range(2 * m)]
    if cut == "pieces":
        sizes[:-1] = [n // BLOCK * BLOCK for n in sizes[:-1]]
    elif cut == "pairs":
        for k in range(1, m):
            pair = (sizes[k] + sizes[2 * m - 1 - k]) // BLOCK
            sizes[k], sizes[2 * m - 1 - k] = pair // 2 * BLOCK, (pair - pair // 2) * BLOCK
        sizes[0] = sizes[0] // BLOCK * BLOCK
    sizes[-1] = length - sum(sizes[:-1])
    offsets = list(itertools.accumulate(sizes[:-1], initial=0))
    return [(slot, offsets[slot], size) for slot, size in enumerate(sizes) if size]


def _split_over_ranks(fill: _Fill, start: int, length: int, gamma: float, cut: str) -> None:
    """Step 1 for one document: head-tail over the least-loaded ranks with room, as many as its work
    over ``gamma`` shares (all of them for ``gamma = 0``)."""
    n = fill.n
    m = n if gamma == 0 else min(n, max(2, math.ceil(work(length) / (gamma * fill.share)), -(-length // fill.capacity)))
    ranks = sorted((r for r in range(n) if fill.room[r] >= -(-length // m)), key=lambda r: (fill.work[r], r))
    while len(ranks) < m and m < n:
        m += 1
        ranks = sorted((r for r in range(n) if fill.room[r] >= -(-length // m)), key=lambda r: (fill.work[r], r))
    ranks = ranks[:m] if len(ranks) >= m else sorted(range(n), key=lambda r: (-fill.room[r], r))[:m]
    for slot, offset, size in _zigzag_pieces(length, m, cut):
        r = ranks[min(slot, 2 * m - 1 - slot)]
        take = min(size, fill.room[r])
        if take:
            fill.give(r, start + offset, take, offset)
        if take < size:  # no room left there: the rest where there is
            fill.cut_into_room(start + offset + take, offset + take, size - take)


def _fill(doc_lens: Sequence[int], n: int, beta: float, gamma: float | None = None, cut: str = "even") -> _Fill:
    fill = _Fill(doc_lens, n)
    starts = [0]
    for length in doc_lens[:-1]:
        starts.append(starts[-1] + length)
    order = sorted(range(len(doc_lens)), key=lambda d: (-doc_lens[d], d))
    big = {d for d in order if beta == 0 or work(doc_lens[d]) > beta * fill.share}
    for d in (d for d in order if d in big):
        _split_over_ranks(fill, starts[d], doc_lens[d], beta if gamma is None else gamma, cut)
    leftovers = []
    for d in (d for d in order if d not in big):
        r = fill.hungriest(doc_lens[d])
        if r is not None:
            fill.give(r, starts[d], doc_lens[d], 0)
        else:
            leftovers.append(d)
    for d in leftovers:
        fill.cut_into_room(starts[d], 0, doc_lens[d])
    assert not any(fill.room), fill.room
    return fill


def _choose(doc_lens: list[int], n: int) -> _Fill:
    """The assignment to keep. For each ``beta`` (which documents are split) the spreads ``gamma >= beta``
    of :data:`BETAS` (how many ranks each split takes: fewer for a larger ``gamma``) are tried, each with
    split documents cut evenly and at whole kernel blocks; the assignments within :data:`BALANCE` are
    those found at the first ``beta`` balanced with even cuts and the :data:`LOOK_FURTHER` after it.
    Of the evenly cut ones whose costliest rank (:meth:`_Fill.rank_costs` without the blocks' edges: work
    and what its splits move) costs within :data:`NEAR` of the least, the one sending nearest the least
    under every mask (:func:`_least_regret`) sets how much may be sent (:meth:`_Fill.sends`). Of all those
    sending no more under causal masks, the one whose costliest rank costs least, the blocks' edges
    counted; or, of those costing within :data:`NEAR` of it, the cheapest sending no more under any
    window of :data:`REACHES` either. Where no evenly cut one is within :data:`BALANCE`, the best
    balanced of those."""
    best, balanced, left = None, [], None  # (cut, fill) within BALANCE; betas left after the first even one
    for beta in BETAS:
        gammas = [g for g in BETAS if g >= beta and (g > 0 or beta == 0)][::-1]
        cuts = CUTS if beta < float("inf") else CUTS[:1]  # blocked cuts need a split document
        for gamma, cut in ((g, c) for g in gammas for c in cuts):
            fill = _fill(doc_lens, n, beta, gamma, cut)
            if cut == "even" and (best is None or fill.imbalance() < best.imbalance()):
                best = fill
            if fill.imbalance() <= BALANCE:
                balanced.append((cut, fill))
        left = LOOK_FURTHER if any(c == "even" for c, _ in balanced) and left is None else left
        if left is not None:
            if not left:
                break
            left -= 1
    if not any(c == "even" for c, _ in balanced):
        if best is None:  # every search tries the even cut
            raise RuntimeError("doc_local: no even assignment was tried")
        return best
    evens = sorted((f for cut, f in balanced if cut == "even"), key=lambda f: max(f.rank_costs(blocks=False)))
    low = max(evens[0].rank_costs(blocks=False))
    even = _least_regret([f for f in evens if max(f.rank_costs(blocks=False)) <= NEAR * low])
    cap = {reach: even.sends(reach) for reach in REACHES}
    no_more = lambda f, reaches: all(a <= b for w in reaches for a, b in zip(f.sends(w), cap[w]))  # noqa: E731
    ranked = sorted((f for _, f in balanced if no_more(f, REACHES[:1])), key=lambda f: max(f.rank_costs()))
    near = [f for f in ranked if max(f.rank_costs()) <= NEAR * max(ranked[0].rank_costs())]
    return next((f for f in near if no_more(f, REACHES[1:])), ranked[0])


def _least_regret(fills: list[_Fill]) -> _Fill:
    """Of ``fills`` (costing alike), the one whose sends under its worst mask of :data:`REACHES` come nearest
    the least any of them sends under that mask (ties: the first)."""
    sends = [[f.sends(w) for w in REACHES] for f in fills]
    least = [list(map(min, zip(*at))) for at in zip(*sends)]  # under each mask, each figure's least
    regret = [max(a / max(b, 1) for row, low in zip(s, least) for a, b in zip(row, low)) for s in sends]
    return fills[regret.index(min(regret))]


def _buffer_order(pieces: list[tuple[int, int]], whole: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """A rank's pieces in buffer order: its whole documents first, then the pieces of split documents,
    each group by position. The rows other ranks see (and whose results merge) are then one span of
    the buffer, read as a view, and the whole documents a span whose results need no merge."""
    return sorted(p for p in pieces if p in whole) + sorted(p for p in pieces if p not in whole)


def doc_local_pieces(doc_lens: Sequence[int], cp_size: int) -> list[list[tuple[int, int]]]:
    """The ``(start, length)`` pieces of global positions each rank holds, in buffer order: whole
    documents, then pieces of split ones, each by position (module docstring). A row of at most
    :data:`MEMO_DOCS` documents over at most :data:`MEMO_RANKS` ranks is kept by value (the last
    :data:`MEMO_ROWS` of them): the search tries up to a hundred assignments, and a process meets the
    same rows again (an evaluation set each time it is scored, the planner's searches, a test's cases)."""
    key = tuple(doc_lens)
    small = len(key) <= MEMO_DOCS and cp_size <= MEMO_RANKS  # a kept row holds at most a few hundred KB
    return [list(rank) for rank in (_kept_pieces if small else _pieces)(key, cp_size)]


MEMO_ROWS, MEMO_DOCS, MEMO_RANKS = 128, 4096, 64


def _pieces(doc_lens: tuple[int, ...], cp_size: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    if len(doc_lens) == 1 and cp_size > 1 and doc_lens[0] % (2 * cp_size) == 0:
        return tuple(map(tuple, _one_document(doc_lens[0], cp_size)))
    best = _choose(list(doc_lens), cp_size)
    starts = [0]
    for length in doc_lens[:-1]:
        starts.append(starts[-1] + length)
    whole = set(zip(starts, doc_lens))
    return tuple(tuple(_buffer_order(p, whole)) for p in best.pieces)


_kept_pieces = functools.lru_cache(maxsize=MEMO_ROWS)(_pieces)


def _one_document(length: int, n: int) -> list[list[tuple[int, int]]]:
    """What :func:`_choose` keeps for one document of ``length`` tokens, a multiple of ``2 n``, in buffer
    order, without trying its assignments (each costs ``n^2``; the planner asks at ``n`` in the tens of
    thousands): the even zigzag, rank ``r`` holding pieces ``r`` and ``2n - 1 - r`` of ``c = length / 2n``.
    Every ``beta`` but the first splits the document (its work is ``n`` shares) over ``m = n`` ranks (its
    length is ``n`` ranks' room), all empty, so ranks ``0 .. n-1`` in order; where the pieces are whole
    blocks every cut is the even one, and where they are not, the blocked cuts (pieces cut down to whole
    blocks, the last taking the rest) load a rank beyond the even cut's balance or send more; the first
    ``beta`` keeps it whole, cut contiguously, outside :data:`BALANCE`. Equal to :func:`_choose` in the tests
    (``tests/test_plan_scale.py``: pieces of one token to several blocks)."""
    c = length // (2 * n)
    return [[(r * c, c), ((2 * n - 1 - r) * c, c)] for r in range(n)]
