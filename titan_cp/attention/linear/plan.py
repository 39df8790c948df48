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


Ref = tuple[bool, int]
"""Where a summary is on this rank: ``(False, i)``: row ``i`` of the summaries it computed;
``(True, i)``: row ``i`` of the summaries it received."""


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
class StatePlan:
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
    """

    runs: tuple[tuple[int, int], ...]
    summarize: tuple[int, ...]
    middle: tuple[bool, ...]
    send: dict[int, tuple[int, ...]]
    recv: dict[int, int]
    chains: tuple[tuple[Ref, ...], ...]
    crosses: bool
    device: dict = field(default_factory=dict, compare=False, repr=False)  # on_device's cache

    def send_index(self, device: torch.device) -> torch.Tensor:
        """:func:`rows_index` of :attr:`send` on ``device``."""
        return on_device(self.device, "send", lambda: rows_index(self.send), device)

    def index_on(self, name: str, values: list[int], device: torch.device) -> torch.Tensor:
        """``values`` as an int64 tensor on ``device``, made once per plan, ``name`` and device."""
        return on_device(self.device, name, lambda: torch.tensor(values, dtype=torch.int64), device)

    def grouped(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(*groups, inverse)`` on ``device``: the flat tokens of each of :attr:`groups`' pieces, each in order,
        and the permutation back (``cat([x[g] for g in groups])[inverse] == x``)."""
        host = self._grouped_host
        return tuple(on_device(self.device, ("grouped", i), lambda t=t: t, device) for i, t in enumerate(host))  # type: ignore[misc]

    @functools.cached_property
    def _grouped_host(self) -> tuple[torch.Tensor, ...]:
        def tokens(pieces: tuple[int, ...]) -> torch.Tensor:
            spans = [self.runs[j] for j in pieces]
            return torch.cat([torch.arange(a, a + n) for a, n in spans]) if spans else torch.zeros(0, dtype=torch.int64)

        groups = [tokens(pieces) for pieces in self.groups]
        return (*groups, torch.argsort(torch.cat(groups)))

    @functools.cached_property
    def groups(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The pieces (indices into :attr:`runs`, in flat order) by what they start from: ``(first, middle,
        last)``. *First*: they start their document (from zero). *Middle*: a piece before them and one after
        them on another rank (or later on this one): the pieces after them need their summary before their own
        state is known. *Last*: a piece before them and none after: they can start from the state the pieces
        before them leave, once it is composed."""
        first: list[int] = []
        middle: list[int] = []
        last: list[int] = []
        summarized = set(self.summarize)
        for j, chain in enumerate(self.chains):
            if not chain:
                first.append(j)
            else:
                (middle if j in summarized else last).append(j)
        return tuple(first), tuple(middle), tuple(last)

    @property
    def received(self) -> int:
        return sum(self.recv.values())

    def exchanges(self) -> bool:
        """Whether any summary crosses a rank boundary (into or out of this rank)."""
        return bool(self.received or any(self.send.values()))


def state_plan(layout: SequenceLayout, rank: int, batch: int) -> StatePlan:
    """This ``rank``'s :class:`StatePlan` for ``batch`` rows under ``layout`` (memoised on the layout)."""
    return layout.memo(("linear_state", rank, batch), lambda: _state_plan(layout, rank, batch))


def _state_plan(layout: SequenceLayout, rank: int, batch: int) -> StatePlan:
    pieces = _pieces(layout, batch)
    mine = pieces[rank]
    key = lambda p: (p.row, p.doc, p.index)  # noqa: E731 - a piece's name on every rank
    summarize = [i for i, p in enumerate(mine) if p.index < p.count - 1]
    local_row = {key(mine[i]): j for j, i in enumerate(summarize)}
    # what each peer needs of this rank's summaries, and what this rank needs of each peer's
    needs: dict[int, set[tuple[int, int, int]]] = defaultdict(set)  # rank -> keys of pieces before its pieces
    for r, theirs in pieces.items():
        for p in theirs:
            needs[r].update((p.row, p.doc, i) for i in range(p.index))
    send = {r: tuple(local_row[k] for k in sorted(needs[r] & local_row.keys())) for r in pieces if r != rank}
    owner = {key(p): r for r, theirs in pieces.items() for p in theirs}
    recv_keys = {r: sorted(k for k in needs[rank] if owner[k] == r) for r in pieces if r != rank}
    recv_row, at = {}, 0
    for r in sorted(recv_keys):
        for k in recv_keys[r]:
            recv_row[k] = at
            at += 1
    chains = []
    for p in mine:
        chain = []
        for i in range(p.index):
            k = (p.row, p.doc, i)
            chain.append((False, local_row[k]) if k in local_row else (True, recv_row[k]))
        chains.append(tuple(chain))
    return StatePlan(
        runs=tuple((p.flat, p.length) for p in mine),
        summarize=tuple(summarize),
        middle=tuple(mine[i].index > 0 for i in summarize),
        send=send,
        recv={r: len(k) for r, k in recv_keys.items()},
        chains=tuple(chains),
        crosses=any(len({owner[(row, doc, i)] for i in range(n)}) > 1 for row, doc, n in _docs(pieces)),
    )


def _docs(pieces: dict[int, list[Piece]]) -> set[tuple[int, int, int]]:
    """``(row, doc, pieces)`` of every document."""
    return {(p.row, p.doc, p.count) for theirs in pieces.values() for p in theirs}


@dataclass(frozen=True)
class HaloPlan:
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

    def send_index(self, device: torch.device) -> torch.Tensor:
        """:func:`rows_index` of :attr:`send` on ``device``."""
        return on_device(self.device, "send", lambda: rows_index(self.send), device)

    def index_on(self, name: str, values: list[int], device: torch.device) -> torch.Tensor:
        """``values`` as an int64 tensor on ``device``, made once per plan, ``name`` and device."""
        return on_device(self.device, name, lambda: torch.tensor(values, dtype=torch.int64), device)

    def edge_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """:attr:`edge` and :attr:`edge_taps` on ``device``."""
        return (
            on_device(self.device, "edge", lambda: self.edge, device),
            on_device(self.device, "edge_taps", lambda: self.edge_taps, device),
        )

    @property
    def received(self) -> int:
        return sum(self.recv.values())


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
