"""What a linear-attention layer exchanges under a sequence layout: pieces, summaries and halos.

A *piece* is a run of the layout (:class:`~titan_cp.layout.Run`): a stretch of one rank's local buffer
holding consecutive positions of one document. A document cut by the layout is a chain of pieces in
position order, held by one or several ranks; a document wholly on one rank is one piece.

A recurrence whose state after a piece is an affine function of the state before it
(``S_out = M S_in + B``: the gated delta rule, Mamba2's SSD) needs, for each piece, only the
*summaries* ``(M, B)`` of the pieces before it in its document::

    S_in(piece j) = B_{j-1} + M_{j-1} (B_{j-2} + M_{j-2} ( ... B_0))     (S_in(piece 0) = 0)

so a rank computes a summary for each of its pieces that some later piece follows, sends each
summary to the ranks holding later pieces of the same document (never to itself; nothing at all for
a document it holds whole) and composes the ``S_in`` of each piece from the summaries before it.
Sizes are known on every rank from the layout, so no size is ever exchanged.

A short causal convolution of ``kernel`` taps needs, for each piece that does not start its
document, the ``kernel - 1`` positions before it in the document (its *halo*): from the pieces
before it, on whichever ranks hold them (several, where pieces are shorter than the halo).

Token indices are *flat*: token ``j`` of batch row ``b`` of a rank's ``(batch, local_len, ...)``
buffer is ``b * local_len + j``.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from titan_cp.layout import SequenceLayout, to_device


def on_device(cache: dict, key: Hashable, host: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """``host()`` on ``device``, made once per plan and device (a pinned, non-blocking copy to a GPU: the
    layers of a microbatch reuse it, and the host never waits for the device)."""
    if (key, device) not in cache:
        cache[(key, device)] = to_device(host(), device)
    return cache[(key, device)]


def rows_index(send: dict[int, tuple[int, ...]]) -> torch.Tensor:
    """The rows sent to each peer, peers in layout order, as one int64 host tensor."""
    return torch.tensor([i for p in sorted(send) for i in send[p]], dtype=torch.int64)


Ref = tuple[int, int]
"""Where a summary is on this rank: ``(0, i)``: row ``i`` of the summaries it computed; ``(1, i)``: row ``i``
of the summaries it received. A chain may start instead from a state (:attr:`StatePlan.second`): ``(2, i)``,
row ``i`` of the states this rank's late middle pieces leave; ``(3, i)``: row ``i`` of those it received."""


def consecutive(pieces: list[int] | tuple[int, ...]) -> bool:
    """Whether the pieces (indices into a rank's runs, in order) follow each other: one span of its buffer (the
    runs tile it in order)."""
    return all(b == a + 1 for a, b in zip(pieces, pieces[1:]))


class Rows:
    """What an exchange's plan holds and reads (:class:`StateRows`, :class:`StatePlan`, :class:`HaloPlan`): per
    peer rank, the rows of this rank it sends there (``send``) and how many arrive from it (``recv``); its device
    tensors, made once (``device``, :func:`on_device`'s cache)."""

    send: dict[int, tuple[int, ...]]
    recv: dict[int, int]
    device: dict

    def send_index(self, device: torch.device) -> torch.Tensor:
        """:func:`rows_index` of :attr:`send` on ``device``."""
        return on_device(self.device, "send", lambda: rows_index(self.send), device)

    def index_on(self, name: str, values: list[int], device: torch.device) -> torch.Tensor:
        """``values`` as an int64 tensor on ``device``, made once per plan, ``name`` and device."""
        return on_device(self.device, name, lambda: torch.tensor(values, dtype=torch.int64), device)

    @property
    def received(self) -> int:
        return sum(self.recv.values())


@dataclass(frozen=True)
class StateRows(Rows):
    """The second exchange of a state-passing plan (:attr:`StatePlan.second`): the states (not summaries) of
    the late middle pieces, to the ranks holding the pieces after them. ``send``, ``recv``, ``crosses`` as
    :class:`StatePlan`'s."""

    send: dict[int, tuple[int, ...]]
    recv: dict[int, int]
    crosses: bool
    device: dict = field(default_factory=dict, compare=False, repr=False)  # on_device's cache


@dataclass(frozen=True)
class Piece:
    """A run of ``rank``'s buffer: ``length`` positions from ``start`` of document ``doc`` of batch row
    ``row``, at flat token ``flat`` of that rank's buffer; ``index``-th of its document's ``count`` pieces."""

    rank: int
    row: int
    flat: int
    start: int
    length: int
    doc: int
    doc_start: int
    index: int
    count: int


def _pieces(layout: SequenceLayout, batch: int) -> dict[int, list[Piece]]:
    """Every rank's pieces, by rank, in local (flat) order."""
    n, local = layout.cp_size, layout.local_len
    by_doc: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = defaultdict(list)
    doc_start: dict[tuple[int, int], int] = {}
    for row in range(batch):
        whole = layout.runs(None, row if layout.doc_lens is not None else None)
        for run in whole:
            doc_start[(row, run.doc)] = run.start
        for rank in range(n):
            for run in layout.runs([rank], row if layout.doc_lens is not None else None):
                by_doc[(row, run.doc)].append((run.start, rank, row * local + run.local, run.length, row))
    out: dict[int, list[Piece]] = {r: [] for r in range(n)}
    for (row, doc), runs in by_doc.items():
        runs.sort()
        for i, (start, rank, flat, length, _) in enumerate(runs):
            out[rank].append(Piece(rank, row, flat, start, length, doc, doc_start[(row, doc)], i, len(runs)))
    for pieces in out.values():
        pieces.sort(key=lambda p: p.flat)
    return out


@dataclass(frozen=True)
class StatePlan(Rows):
    """One rank's share of a state-passing recurrence (module docstring).

    runs: ``(flat start, length)`` of this rank's pieces, in flat order (they tile the buffer).
    summarize: indices (into ``runs``) of the pieces some later piece follows: this rank computes their
        summaries, in this order; ``middle[i]``: whether ``summarize[i]`` has a piece before it too (its
        transition ``M`` is needed; a document's first piece needs only its offset ``B``).
    send: per peer rank, the rows of this rank's summaries it sends there (in order); ``recv``: per peer
        rank, how many summaries arrive from it (appended in peer order into one buffer).
    chains: for each run (by index), the summaries of the pieces before it in its document, first piece
        first (empty for a document's first piece): ``S_in`` is composed from them.
    crosses: whether a summary crosses a rank boundary anywhere (on any rank: then every rank takes part
        in the exchange, possibly with nothing; else no rank does).
    calls: for each run (by index), which of the rank's three calls runs it (:func:`piece_calls`): 0, before
        the exchange from zero; 1, before it, wide (its outputs corrected after it); 2, after it, from its
        composed state (zero for a document's first piece).
    states2, second: in a plan with *late middle* pieces (middle pieces run after the exchange from their
        states, :func:`piece_calls` with ``late``): this rank's late middle pieces (indices into ``runs``, in
        order), whose final states a second exchange (``second``) sends to the ranks holding the pieces after
        them; those pieces run wide and their chains start from that state. ``second`` is ``None`` where no
        document has one.
    """

    runs: tuple[tuple[int, int], ...]
    summarize: tuple[int, ...]
    middle: tuple[bool, ...]
    send: dict[int, tuple[int, ...]]
    recv: dict[int, int]
    chains: tuple[tuple[Ref, ...], ...]
    crosses: bool
    calls: tuple[int, ...] = ()
    states2: tuple[int, ...] = ()
    second: StateRows | None = None
    device: dict = field(default_factory=dict, compare=False, repr=False)  # on_device's cache

    def grouped(self, device: torch.device) -> tuple[tuple[int, int] | torch.Tensor, ...]:
        """Where each of :attr:`groups`' tokens are, on ``device``: ``(start, length)`` where its pieces are one
        span of the buffer (consecutive runs), else the flat tokens of its pieces, in order (made once)."""
        return tuple(
            part if isinstance(part, tuple) else on_device(self.device, ("grouped", i), lambda t=part: t, device)  # type: ignore[misc]
            for i, part in enumerate(self._grouped_host)
        )

    @functools.cached_property
    def _grouped_host(self) -> tuple[tuple[int, int] | torch.Tensor, ...]:
        def where(pieces: tuple[int, ...]) -> tuple[int, int] | torch.Tensor:
            spans = [self.runs[j] for j in pieces]
            if consecutive(pieces):  # runs tile the buffer in order
                return (spans[0][0] if spans else 0, sum(n for _, n in spans))
            return torch.cat([torch.arange(a, a + n) for a, n in spans])

        return tuple(where(pieces) for pieces in self.groups)

    @functools.cached_property
    def groups(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The pieces (indices into :attr:`runs`, in flat order) of each of :attr:`calls`: ``(before, wide,
        after)``."""
        return tuple(tuple(j for j, c in enumerate(self.calls) if c == call) for call in range(3))  # type: ignore[return-value]

    def exchanges(self) -> bool:
        """Whether any summary crosses a rank boundary (into or out of this rank)."""
        return bool(self.received or any(self.send.values()))


def state_plan(layout: SequenceLayout, rank: int, batch: int, late: bool = False) -> StatePlan:
    """This ``rank``'s :class:`StatePlan` for ``batch`` rows under ``layout`` (memoised on the layout); ``late``:
    where it makes the layer shorter, a document's longest later piece, if a middle one, runs after the exchange
    from its state (the gated delta rule's plan, :func:`piece_calls`)."""
    return layout.memo(("linear_state", rank, batch, late), lambda: _state_plan(layout, rank, batch, late))


def _state_plan(layout: SequenceLayout, rank: int, batch: int, late: bool) -> StatePlan:
    pieces = _pieces(layout, batch)
    mine = pieces[rank]
    key = lambda p: (p.row, p.doc, p.index)  # noqa: E731 - a piece's name on every rank
    owner = {key(p): r for r, theirs in pieces.items() for p in theirs}
    crosses = crossing(pieces)
    calls = layout_calls(layout, pieces, batch, late)
    base = late_middles(pieces, calls)  # (row, doc) -> index of its late middle piece
    lates = {(row, doc, i) for (row, doc), i in base.items()}

    def after_base(p: Piece) -> int | None:  # the late middle piece a piece's chain starts from, if any
        i = base.get((p.row, p.doc))
        return i if i is not None and i < p.index else None

    summarize = [i for i, p in enumerate(mine) if p.index < p.count - 1 and key(p) not in lates]
    local_row = {key(mine[i]): j for j, i in enumerate(summarize)}
    # what each rank needs of the summaries (those after its pieces' late middle, else all before them) and
    # of the late middles' states
    needs: dict[int, set[tuple[int, int, int]]] = defaultdict(set)
    needs2: dict[int, set[tuple[int, int, int]]] = defaultdict(set)
    for r, theirs in pieces.items():
        for p in theirs:
            b = after_base(p)
            needs[r].update((p.row, p.doc, i) for i in range(0 if b is None else b + 1, p.index))
            if b is not None:
                needs2[r].add((p.row, p.doc, b))
    send, recv_row, recv = _rows(rank, pieces, owner, needs, local_row)
    states2 = [i for i, p in enumerate(mine) if key(p) in lates]
    own2 = {key(mine[i]): j for j, i in enumerate(states2)}
    send2, recv2_row, recv2 = _rows(rank, pieces, owner, needs2, own2)

    def ref(k: tuple[int, int, int]) -> Ref:
        return (0, local_row[k]) if k in local_row else (1, recv_row[k])

    chains = []
    for p in mine:
        b = after_base(p)
        if b is None:
            chains.append(tuple(ref((p.row, p.doc, i)) for i in range(p.index)))
        else:
            k = (p.row, p.doc, b)
            head: Ref = (2, own2[k]) if k in own2 else (3, recv2_row[k])
            chains.append((head, *(ref((p.row, p.doc, i)) for i in range(b + 1, p.index))))
    crosses2 = any(owner[k] != r for r, keys in needs2.items() for k in keys)
    return StatePlan(
        runs=tuple((p.flat, p.length) for p in mine),
        summarize=tuple(summarize),
        middle=tuple(mine[i].index > 0 for i in summarize),
        send=send,
        recv=recv,
        chains=tuple(chains),
        crosses=crosses,
        calls=calls[rank],
        states2=tuple(states2),
        second=StateRows(send2, recv2, crosses2) if base else None,
    )


def _rows(
    rank: int,
    pieces: dict[int, list[Piece]],
    owner: dict[tuple[int, int, int], int],
    needs: dict[int, set[tuple[int, int, int]]],
    local_row: dict[tuple[int, int, int], int],
) -> tuple[dict[int, tuple[int, ...]], dict[tuple[int, int, int], int], dict[int, int]]:
    """One exchange of rows named by pieces: ``(send, recv_row, recv)``: per peer, the rows of this rank's
    (``local_row``) each needs (in the pieces' order); where each row this rank needs from the others lands in
    the received buffer (peers in layout order); per peer, how many rows arrive from it."""
    send = {r: tuple(local_row[k] for k in sorted(needs[r] & local_row.keys())) for r in pieces if r != rank}
    recv_keys = {r: sorted(k for k in needs[rank] if owner[k] == r) for r in pieces if r != rank}
    recv_row, at = {}, 0
    for r in sorted(recv_keys):
        for k in recv_keys[r]:
            recv_row[k] = at
            at += 1
    return send, recv_row, {r: len(k) for r, k in recv_keys.items()}


def late_middles(pieces: dict[int, list[Piece]], calls: dict[int, tuple[int, ...]]) -> dict[tuple[int, int], int]:
    """``(row, doc) -> index`` of each document's late middle piece: a middle piece :func:`piece_calls` runs after
    the exchange."""
    return {
        (p.row, p.doc): p.index
        for r, theirs in pieces.items()
        for i, p in enumerate(theirs)
        if 0 < p.index < p.count - 1 and calls[r][i] == 2
    }


BALANCE_CHUNK = 64
"""The tokens a chunked kernel computes at once (``fla``'s chunk): :func:`piece_calls` prices a piece in them."""


def piece_calls(pieces: dict[int, list[Piece]], crosses: bool, late: bool = False) -> dict[int, tuple[int, ...]]:
    """For every rank, which of its three calls runs each of its pieces (:attr:`StatePlan.calls`).

    A document's first piece runs before the exchange from zero (call 0) and a middle piece (pieces before and
    after it) wide before it (call 1): the ranks after them need their summaries. A last piece (pieces before it,
    none after) runs after the exchange from its composed state (call 2, at what it costs alone), or wide before
    it; a document held whole runs from zero, before it or after it. The exchange is a collective, forward and
    backward: the layer's kernels take the longest of the ranks' work before it plus the longest after it. So
    for each bound on the work before it (from the largest the ranks must do there to the largest they hold),
    each rank runs its whole documents before it while they fit under the bound (largest first), then its last
    pieces wide while they fit (:data:`WIDTH`), the rest after it; the bound whose two longest add up least is
    kept, where it takes :data:`MARGIN` less than the largest (every piece before the exchange, as ``fla``'s wide
    call alone would run them). Work is counted in :data:`BALANCE_CHUNK`-token chunks. Where no document
    crosses a rank boundary there is no exchange: last pieces run after, whole documents before.

    ``late``: each document's longest later piece, where it is a middle one, may run after the exchange from its
    state too (a *late middle*, call 2): the pieces after it then run wide, their outputs corrected from the state
    it leaves, sent by a second exchange. Kept where the layer so placed takes :data:`MARGIN` less."""
    if not crosses:
        return {
            r: tuple(2 if p.index and p.index == p.count - 1 else int(bool(p.index)) for p in theirs)
            for r, theirs in pieces.items()
        }
    took, calls = _placed(pieces, set())
    lates = _longest_middles(pieces) if late else set()
    if lates:
        took_late, calls_late = _placed(pieces, lates)
        if took_late < (1 - MARGIN) * took:
            return calls_late
    return calls


def _longest_middles(pieces: dict[int, list[Piece]]) -> set[tuple[int, int, int]]:
    """``(row, doc, index)`` of each document's longest later piece (the first of equals), where it is a middle one."""
    longest: dict[tuple[int, int], Piece] = {}
    for theirs in pieces.values():
        for p in theirs:
            best = longest.get((p.row, p.doc))
            if p.index and (best is None or (p.length, -p.index) > (best.length, -best.index)):
                longest[(p.row, p.doc)] = p
    return {(p.row, p.doc, p.index) for p in longest.values() if p.index < p.count - 1}


def _placed(pieces: dict[int, list[Piece]], lates: set[tuple[int, int, int]]) -> tuple[int, dict[int, tuple[int, ...]]]:
    """:func:`piece_calls`' placement with the late middle pieces ``lates`` after the exchange (and the pieces after
    them wide): ``(the layer's work as priced, calls by rank)``."""

    def chunks(p: Piece) -> int:
        return -(-p.length // BALANCE_CHUNK)

    base = {(row, doc): i for row, doc, i in lates}
    ranks = {}  # per rank: the calls fixed, their work before and after, the pieces to place, in order
    for r, theirs in pieces.items():
        fixed = {}
        for i, p in enumerate(theirs):
            b = base.get((p.row, p.doc))
            if b is not None and p.index >= b:
                fixed[i] = 2 if p.index == b else 1  # a late middle; the pieces after it wide
            elif p.index < p.count - 1 and p.count > 1:
                fixed[i] = int(p.index > 0)
        load = sum(chunks(theirs[i]) * WIDTH[c] for i, c in fixed.items() if c < 2)
        after = sum(chunks(theirs[i]) * WIDTH[0] for i, c in fixed.items() if c == 2)
        whole = sorted((i for i, p in enumerate(theirs) if p.count == 1), key=lambda i: (-theirs[i].length, i))
        last = sorted(
            (i for i, p in enumerate(theirs) if p.index and p.index == p.count - 1 and i not in fixed),
            key=lambda i: (-theirs[i].length, i),
        )
        place = [(i, 0, chunks(theirs[i])) for i in whole] + [(i, 1, chunks(theirs[i])) for i in last]
        ranks[r] = (fixed, load, after, place)

    def split(bound: int) -> dict[int, tuple[int, int, dict[int, int]]]:
        """Each rank's ``(work before, work after, calls by piece)`` under ``bound``."""
        out = {}
        for r, (fixed, load, late, place) in ranks.items():
            calls = dict(fixed)
            for i, wide, cost in place:
                if load + cost * WIDTH[wide] <= bound:
                    load, calls[i] = load + cost * WIDTH[wide], wide
                else:
                    late, calls[i] = late + cost * WIDTH[0], 2
            out[r] = (load, late, calls)
        return out

    least = max(load for _, load, _, _ in ranks.values())  # what must run before the exchange
    most = max(load + sum(cost * WIDTH[wide] for _, wide, cost in place) for _, load, _, place in ranks.values())
    tried = []
    for bound in [*range(least, most, max(1, (most - least) // BOUNDS)), most]:
        splits = split(bound)
        after = max(b for _, b, _ in splits.values())
        tried.append((max(a for a, _, _ in splits.values()) + after, splits))
        if not after:  # every piece before the exchange: a larger bound changes nothing
            break
    took, splits = min(tried, key=lambda t: t[0])
    if took > (1 - MARGIN) * tried[-1][0]:  # within the work's pricing of running everything it can before it
        took, splits = tried[-1]
    return took, {r: tuple(calls[i] for i in range(len(pieces[r]))) for r, (_, _, calls) in splits.items()}


WIDTH = (4, 7)
"""A chunk's work at v's width and wide, in quarters: the wide call's ``d_v + d_k`` columns cost 1.72 times ``d_v``'s
at ``d_k = d_v = 128`` and 64-token chunks (:func:`titan_cp.plan.linear.chunk_flops`)."""

MARGIN = 0.02
"""How much shorter a split must make the layer (as priced) to be kept over running every piece before the exchange,
which needs no waiting: the chunks' pricing is near, not exact."""

BOUNDS = 64
"""How many bounds on the work before the exchange :func:`piece_calls` tries, at most (evenly spaced)."""


def crossing(pieces: dict[int, list[Piece]]) -> bool:
    """Whether any document's pieces lie on more than one rank (then the ranks exchange)."""
    ranks: dict[tuple[int, int], set[int]] = defaultdict(set)
    for r, theirs in pieces.items():
        for p in theirs:
            ranks[(p.row, p.doc)].add(r)
    return any(len(held) > 1 for held in ranks.values())


def layout_calls(
    layout: SequenceLayout, pieces: dict[int, list[Piece]], batch: int, late: bool
) -> dict[int, tuple[int, ...]]:
    """:func:`piece_calls` for ``layout``'s ``pieces`` (``batch`` rows), memoised on the layout: the ops' plans
    and the planner's work read one placement."""
    return layout.memo(("linear_calls", batch, late), lambda: piece_calls(pieces, crossing(pieces), late))


@dataclass(frozen=True)
class HaloPlan(Rows):
    """One rank's share of a short causal convolution of ``kernel`` taps (module docstring).

    send: per peer rank, the flat tokens of this rank it sends there (in order); ``recv``: per peer rank,
        how many rows arrive from it (appended in peer order); ``crosses``: whether any halo crosses a rank
        boundary anywhere.
    edge: the flat tokens whose taps reach before their own piece (the first ``kernel - 1`` of each piece):
        every other token's inputs are the tokens just before it in the buffer.
    edge_taps: ``(len(edge), kernel)`` int64: for each of them and tap ``j`` (the token ``j`` positions before
        it in its document), where that token is in ``cat([local tokens, received rows, one zero row])``:
        a local flat index, ``tokens + i`` for received row ``i``, or ``tokens + received`` (zero: before
        the document's start).
    """

    send: dict[int, tuple[int, ...]]
    recv: dict[int, int]
    edge: torch.Tensor
    edge_taps: torch.Tensor
    crosses: bool
    device: dict = field(default_factory=dict, compare=False, repr=False)  # on_device's cache

    def edge_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """:attr:`edge` and :attr:`edge_taps` on ``device``."""
        return (
            on_device(self.device, "edge", lambda: self.edge, device),
            on_device(self.device, "edge_taps", lambda: self.edge_taps, device),
        )


def halo_plan(layout: SequenceLayout, rank: int, batch: int, kernel: int) -> HaloPlan:
    """This ``rank``'s :class:`HaloPlan` for a ``kernel``-tap convolution (memoised on the layout)."""
    return layout.memo(("linear_halo", rank, batch, kernel), lambda: _halo_plan(layout, rank, batch, kernel))


def _tails(pieces: dict[int, list[Piece]], h: int) -> dict[tuple[int, int], tuple[int, int]]:
    """``(row, position) -> (rank, flat)`` of the last ``h`` positions of every piece: all a halo of
    ``h`` positions can reach outside its own piece (a halo longer than a piece reaches into the
    pieces before it, whose tails these are too)."""
    out = {}
    for r, theirs in pieces.items():
        for p in theirs:
            for i in range(max(0, p.length - h), p.length):
                out[(p.row, p.start + i)] = (r, p.flat + i)
    return out


def _halo_plan(layout: SequenceLayout, rank: int, batch: int, kernel: int) -> HaloPlan:
    pieces = _pieces(layout, batch)
    h = kernel - 1
    where = _tails(pieces, h)

    def halo(p: Piece) -> list[tuple[int, int]]:  # (row, position) before the piece, in its document
        return [(p.row, x) for x in range(max(p.doc_start, p.start - h), p.start)] if p.index else []

    wanted = {r: sorted({pos for p in theirs for pos in halo(p) if where[pos][0] != r}) for r, theirs in pieces.items()}
    send = {r: tuple(where[pos][1] for pos in wanted[r] if where[pos][0] == rank) for r in pieces if r != rank}
    recv_keys = {r: [pos for pos in wanted[rank] if where[pos][0] == r] for r in pieces if r != rank}
    tokens = batch * layout.local_len
    slot, at = {}, tokens
    for r in sorted(recv_keys):
        for pos in recv_keys[r]:
            slot[pos] = at
            at += 1
    edge, edge_taps = [], []
    for p in pieces[rank]:  # the first h tokens of each piece reach before it: the halo, or zero
        for i in range(min(h, p.length)):
            row = []
            for j in range(kernel):
                x = p.start + i - j
                if x < p.doc_start:
                    row.append(at)
                elif j <= i:
                    row.append(p.flat + i - j)
                else:
                    owner, flat = where[(p.row, x)]
                    row.append(flat if owner == rank else slot[(p.row, x)])
            edge.append(p.flat + i)
            edge_taps.append(row)
    recv = {r: len(k) for r, k in recv_keys.items()}
    return HaloPlan(
        send=send,
        recv=recv,
        edge=torch.tensor(edge, dtype=torch.int64),
        edge_taps=torch.tensor(edge_taps, dtype=torch.int64).view(len(edge), kernel),
        crosses=any(wanted.values()),
    )
