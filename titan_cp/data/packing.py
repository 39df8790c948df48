"""Pack a document stream into rows of ``seq_len`` tokens (``S``), keeping document boundaries.

Two packers (``training.packing``) produce the same row format:

``stream`` (:class:`Packer`): row ``r`` holds tokens ``[r*S, (r+1)*S)`` of the concatenated
stream, so no token is padding. A document that does not fit in the room left is cut: its tail
opens the next row and counts there as a new document (positions restart at 0, and it can no
longer see its head).

``best_fit`` (:class:`BestFitPacker`): a document no longer than ``S`` is never cut. Documents are
read into a lookahead buffer of ``lookahead`` pieces; a row first takes, oldest first and while
they fit, the pieces that have waited too long (read more than ``2 * lookahead`` documents ago, so
no document waits for ever), then the longest buffered piece that fits the room left (the oldest
among equal lengths), refilling the buffer after every take, until no buffered piece fits. What is
left of the row is one padding document (``pad_id`` tokens, positions from 0, no loss; it attends
only to itself like any document). ``scripts/bench_packing.py`` measures the padding: with 512
pieces of lookahead it stays under 0.2% on the mixes of ``titan_cp.data.lengths``.

A document longer than ``S`` is split into windows: its first ``floor(L / S)`` windows of ``S``
tokens are rows of their own, in order, ahead of the next best-fit row, and its last ``L mod S``
tokens (if any) are one buffered piece like a short document. Reading pauses while windows are
pending, so a long document's windows are the next rows after it is read; at the start of a run,
while the buffer first fills, that puts the windows of the long documents among the first
``lookahead`` ahead of the first best-fit row. The state is the next document index, the buffered
pieces and the pending windows, so a resumed run reads exactly the rows the straight run would
have.

Per row, with ``pieces`` the document pieces in it (lengths ``doc_lens``, summing to ``S``)::

    tokens[i]     the token
    labels[i]     tokens[i+1] if i+1 is in the same piece and is a training target (its
                  document's ``loss_mask``, e.g. an assistant turn of a chat record), else -100
    positions[i]  i - start of its piece
    recall_distance[i]   the answer's distance (tokens back to its fact) when labels[i] is an
                  answer token whose fact lies in the same piece, else 0 (an answer cut
                  off from its fact by a row boundary cannot be recalled, so is not asked)

Without loss masks a row with ``n`` pieces has ``S - n`` loss-bearing tokens (a padding piece has
none).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

import torch

from titan_cp.data.document import Document, DocumentSource

IGNORE_INDEX = -100

# (document index, document, start, end): tokens [start, end) of one document; padding is
# (-1, None, 0, length).
Piece = tuple[int, "Document | None", int, int]


@dataclass
class PackedRow:
    """One row of ``S`` tokens; all tensors ``(S,)`` int64, ``doc_lens`` sums to ``S``.

    ``padding``: padding tokens in the row (its last piece when nonzero); ``source_tokens``: tokens
    per mixture source (documents outside a mixture are not counted).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    recall_distance: torch.Tensor
    doc_lens: list[int]
    padding: int = 0
    source_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def num_valid_tokens(self) -> int:
        """Tokens with a label (``labels != -100``)."""
        return int((self.labels != IGNORE_INDEX).sum())


@dataclass
class RowSummary:
    """What the loader needs of a row it does not train on: ``doc_lens``, loss-bearing tokens,
    padding, tokens per source, and its pieces as ``(document index, start, end)`` (index -1 for
    padding)."""

    doc_lens: list[int]
    valid_tokens: int
    padding: int
    source_tokens: dict[str, int]
    pieces: list[tuple[int, int, int]]


def _piece_targets(doc: Document | None, start: int, end: int) -> int:
    """Loss-bearing tokens of a piece: targets among its tokens after the first."""
    if doc is None:
        return 0
    if doc.loss_mask is None:
        return end - start - 1
    return sum(doc.loss_mask[start + 1 : end])


def summarize(pieces: list[Piece]) -> RowSummary:
    sources: dict[str, int] = {}
    for _, doc, a, b in pieces:
        if doc is not None and doc.source:
            sources[doc.source] = sources.get(doc.source, 0) + b - a
    return RowSummary(
        doc_lens=[b - a for _, _, a, b in pieces],
        valid_tokens=sum(_piece_targets(doc, a, b) for _, doc, a, b in pieces),
        padding=sum(b - a for _, doc, a, b in pieces if doc is None),
        source_tokens=sources,
        pieces=[(i, a, b) for i, _, a, b in pieces],
    )


def build_row(pieces: list[Piece], seq_len: int, pad_id: int = 0) -> PackedRow:
    """The tensors of one row from its pieces (see the module docstring)."""
    summary = summarize(pieces)
    doc_lens = summary.doc_lens
    tokens = torch.tensor(
        [t for _, doc, a, b in pieces for t in (doc.tokens[a:b] if doc is not None else [pad_id] * (b - a))],
        dtype=torch.int64,
    )
    lens = torch.tensor(doc_lens, dtype=torch.int64)
    ends = lens.cumsum(0)
    starts = ends - lens
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:-1] = tokens[1:]
    if any(doc is None or doc.loss_mask is not None for _, doc, _, _ in pieces):
        target = torch.tensor(
            [
                m
                for _, doc, a, b in pieces
                for m in (
                    [False] * (b - a)
                    if doc is None
                    else [True] * (b - a)
                    if doc.loss_mask is None
                    else doc.loss_mask[a:b]
                )
            ],
            dtype=torch.bool,
        )
        labels[:-1][~target[1:]] = IGNORE_INDEX
    labels[ends - 1] = IGNORE_INDEX
    positions = torch.arange(seq_len) - starts.repeat_interleave(lens)
    recall_distance = torch.zeros_like(tokens)
    for (_, doc, a, b), row_start in zip(pieces, starts.tolist()):
        if doc is None:
            continue
        for (s, e), distance in zip(doc.answer_spans, doc.answer_distances):
            # position p predicts token p+1: answer tokens [s, e) are predicted from [s-1, e-1),
            # and p, p+1 must both lie in the piece [a, b), as must the fact (at s - distance).
            lo, hi = max(s - 1, a), min(e - 1, b - 1)
            if lo < hi and s - distance >= a:
                recall_distance[row_start + lo - a : row_start + hi - a] = distance
    recall_distance[labels == IGNORE_INDEX] = 0  # only loss-bearing answers are scored
    return PackedRow(tokens, labels, positions, recall_distance, doc_lens, summary.padding, summary.source_tokens)


class _RowPacker:
    """Shared row building; subclasses implement ``_take`` (advance one row, return its pieces)."""

    source: DocumentSource
    seq_len: int
    pad_id: int = 0

    def _take(self) -> list[Piece]:
        raise NotImplementedError

    def skip_row(self) -> RowSummary:
        """Advance one row without building its tensors."""
        return summarize(self._take())

    def next_row(self) -> PackedRow:
        """The next row."""
        return build_row(self._take(), self.seq_len, self.pad_id)


def _check_seq_len(seq_len: int) -> None:
    if seq_len < 1:
        raise ValueError(f"training.seq_len must be positive, got {seq_len}")


class Packer(_RowPacker):
    """The ``stream`` packer: cuts ``source``'s documents ``0, 1, 2, ...`` into consecutive rows of
    ``seq_len`` tokens.

    The state is the stream position: ``(doc_index, doc_offset)``, the next token to pack.
    """

    def __init__(self, source: DocumentSource, seq_len: int) -> None:
        _check_seq_len(seq_len)
        self.source, self.seq_len = source, seq_len
        self.doc_index, self.doc_offset = 0, 0
        self._cached: tuple[int, Document] | None = None

    def _document(self) -> Document:
        if self._cached is None or self._cached[0] != self.doc_index:
            self._cached = (self.doc_index, self.source.document(self.doc_index))
        return self._cached[1]

    def _take(self) -> list[Piece]:
        pieces: list[tuple[int, Document | None, int, int]] = []
        room = self.seq_len
        while room:
            doc = self._document()
            end = min(len(doc.tokens), self.doc_offset + room)
            if end > self.doc_offset:
                pieces.append((self.doc_index, doc, self.doc_offset, end))
                room -= end - self.doc_offset
            self.doc_offset = end
            if end == len(doc.tokens):
                self.doc_index, self.doc_offset = self.doc_index + 1, 0
        return pieces

    def state_dict(self) -> dict[str, int]:
        return {"doc_index": self.doc_index, "doc_offset": self.doc_offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.doc_index, self.doc_offset = int(state["doc_index"]), int(state["doc_offset"])


class BestFitPacker(_RowPacker):
    """The ``best_fit`` packer (see the module docstring): documents no longer than ``seq_len`` are
    never cut; the rest of a row is one padding document of ``pad_id`` tokens.

    ``lookahead``: buffered pieces to choose from (more: tighter rows, documents read further
    ahead of where they are trained on). The state: ``next_doc`` (the next document to read),
    ``buffer`` and ``windows`` (pending pieces as ``[doc_index, start, end]``).
    """

    def __init__(self, source: DocumentSource, seq_len: int, lookahead: int = 512, pad_id: int = 0) -> None:
        _check_seq_len(seq_len)
        if lookahead < 1:
            raise ValueError(f"training.packing_lookahead must be positive, got {lookahead}")
        self.source, self.seq_len, self.lookahead, self.pad_id = source, seq_len, lookahead, pad_id
        self.max_wait = 2 * lookahead
        self.next_doc = 0
        self._keys: list[tuple[int, int]] = []  # (length, -doc_index), sorted: the buffer's order
        self._buffer: dict[int, Piece] = {}  # doc_index -> its buffered piece, in reading order
        self._windows: deque[Piece] = deque()  # full-row windows of long documents, in order

    def _add(self, index: int, doc: Document, start: int, end: int) -> None:
        """Queue what is left of document ``index`` from ``start``: full windows, then a piece."""
        S = self.seq_len
        while end - start > S:
            self._windows.append((index, doc, start, start + S))
            start += S
        if end > start:
            bisect.insort(self._keys, (end - start, -index))
            self._buffer[index] = (index, doc, start, end)

    def _refill(self) -> None:
        """Read documents until the buffer holds ``lookahead`` pieces or windows are pending."""
        while len(self._keys) < self.lookahead and not self._windows:
            doc = self.source.document(self.next_doc)
            self._add(self.next_doc, doc, 0, len(doc.tokens))
            self.next_doc += 1

    def _take(self) -> list[Piece]:
        self._refill()
        if self._windows:
            return [self._windows.popleft()]
        pieces: list[Piece] = []
        room = self.seq_len
        while self._buffer:  # overdue pieces first, oldest first, while they fit
            index = next(iter(self._buffer))
            _, _, a, b = self._buffer[index]
            if self.next_doc - index <= self.max_wait or b - a > room:
                break
            self._keys.pop(bisect.bisect_left(self._keys, (b - a, -index)))
            pieces.append(self._buffer.pop(index))
            room -= b - a
        while room:
            self._refill()
            k = bisect.bisect_right(self._keys, (room, 0)) - 1  # the longest that fits; oldest of equals
            if k < 0:
                break
            length, neg_index = self._keys.pop(k)
            pieces.append(self._buffer.pop(-neg_index))
            room -= length
        if room:
            pieces.append((-1, None, 0, room))
        return pieces

    def state_dict(self) -> dict:
        return {
            "next_doc": self.next_doc,
            "buffer": [[i, a, b] for _, neg in self._keys for i, _, a, b in [self._buffer[-neg]]],
            "windows": [[i, a, b] for i, _, a, b in self._windows],
        }

    def load_state_dict(self, state: dict) -> None:
        self.next_doc = int(state["next_doc"])
        self._keys, self._buffer, self._windows = [], {}, deque()
        docs: dict[int, Document] = {}

        def doc(i: int) -> Document:
            if i not in docs:
                docs[i] = self.source.document(i)
            return docs[i]

        for i, a, b in state["windows"]:
            self._windows.append((i, doc(i), a, b))
        for i, a, b in sorted(state["buffer"]):  # reading order
            bisect.insort(self._keys, (b - a, -i))
            self._buffer[i] = (i, doc(i), a, b)


def make_packer(
    source: DocumentSource, seq_len: int, packing: str = "stream", lookahead: int = 512, pad_id: int = 0
) -> Packer | BestFitPacker:
    """The packer named by ``training.packing``."""
    if packing == "stream":
        return Packer(source, seq_len)
    if packing == "best_fit":
        return BestFitPacker(source, seq_len, lookahead, pad_id)
    raise ValueError(f"training.packing must be 'stream' or 'best_fit', got {packing!r}")
