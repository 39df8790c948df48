"""Pack a document stream into rows of ``seq_len`` tokens, keeping document boundaries.

Row ``r`` holds tokens ``[r*S, (r+1)*S)`` of the concatenated stream (``S = seq_len``), so no token
is padding. A document that does not fit in the room left is cut: its tail opens the next row and
counts there as a new document (positions restart at 0). Per row, with ``pieces`` the document
pieces in it (lengths ``doc_lens``, summing to ``S``)::

    tokens[i]     the token
    labels[i]     tokens[i+1] if i+1 is in the same piece, else -100 (each piece's last token)
    positions[i]  i - start of its piece
    recall_distance[i]   the answer's distance (tokens back to its fact) when labels[i] is an
                  answer token whose fact lies in the same piece, else 0 (an answer cut
                  off from its fact by a row boundary cannot be recalled, so is not asked)

A row with ``n`` pieces has ``S - n`` loss-bearing tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_cp.data.datasets import Document, DocumentSource

IGNORE_INDEX = -100


@dataclass
class PackedRow:
    """One row of ``S`` tokens; all tensors ``(S,)`` int64, ``doc_lens`` sums to ``S``."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    recall_distance: torch.Tensor
    doc_lens: list[int]

    @property
    def num_valid_tokens(self) -> int:
        """Tokens with a label (``labels != -100``): one fewer than each piece's length."""
        return len(self.tokens) - len(self.doc_lens)


class Packer:
    """Cuts ``source``'s documents ``0, 1, 2, ...`` into consecutive rows of ``seq_len`` tokens.

    The state is the stream position: ``(doc_index, doc_offset)``, the next token to pack.
    """

    def __init__(self, source: DocumentSource, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"training.seq_len must be positive, got {seq_len}")
        self.source, self.seq_len = source, seq_len
        self.doc_index, self.doc_offset = 0, 0
        self._cached: tuple[int, Document] | None = None

    def _document(self) -> Document:
        if self._cached is None or self._cached[0] != self.doc_index:
            self._cached = (self.doc_index, self.source.document(self.doc_index))
        return self._cached[1]

    def _take(self) -> list[tuple[Document, int, int]]:
        """Advance one row; return its pieces as ``(document, start, end)`` token ranges."""
        pieces = []
        room = self.seq_len
        while room:
            doc = self._document()
            end = min(len(doc.tokens), self.doc_offset + room)
            if end > self.doc_offset:
                pieces.append((doc, self.doc_offset, end))
                room -= end - self.doc_offset
            self.doc_offset = end
            if end == len(doc.tokens):
                self.doc_index, self.doc_offset = self.doc_index + 1, 0
        return pieces

    def skip_row(self) -> list[int]:
        """Advance one row without building it; return its ``doc_lens``."""
        return [end - start for _, start, end in self._take()]

    def next_row(self) -> PackedRow:
        """The next row."""
        pieces = self._take()
        doc_lens = [end - start for _, start, end in pieces]
        tokens = torch.tensor([t for doc, a, b in pieces for t in doc.tokens[a:b]], dtype=torch.int64)
        lens = torch.tensor(doc_lens, dtype=torch.int64)
        ends = lens.cumsum(0)
        starts = ends - lens
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[:-1] = tokens[1:]
        labels[ends - 1] = IGNORE_INDEX
        positions = torch.arange(self.seq_len) - starts.repeat_interleave(lens)
        recall_distance = torch.zeros_like(tokens)
        for (doc, a, b), row_start in zip(pieces, starts.tolist()):
            for (s, e), distance in zip(doc.answer_spans, doc.answer_distances):
                # position p predicts token p+1: answer tokens [s, e) are predicted from [s-1, e-1),
                # and p, p+1 must both lie in the piece [a, b), as must the fact (at s - distance).
                lo, hi = max(s - 1, a), min(e - 1, b - 1)
                if lo < hi and s - distance >= a:
                    recall_distance[row_start + lo - a : row_start + hi - a] = distance
        return PackedRow(tokens, labels, positions, recall_distance, doc_lens)

    def state_dict(self) -> dict[str, int]:
        return {"doc_index": self.doc_index, "doc_offset": self.doc_offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.doc_index, self.doc_offset = int(state["doc_index"]), int(state["doc_offset"])
