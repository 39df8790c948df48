"""The unit every data source produces and every packer consumes: one tokenized document."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Document:
    """One tokenized document (text: BOS first and EOS last; a chat record: its rendered template).

    ``loss_mask[j]``: whether token ``j`` is a training target (predicted from the tokens before
    it); ``None`` means every token is. A chat record masks out everything but the turns of the
    roles that carry loss.

    ``answer_spans[k] = (start, end)``: token span (end exclusive) of the k-th answer;
    ``answer_distances[k]``: tokens from the start of the fact that holds that answer to the start
    of the answer (how far back the model must look to produce it).

    ``source``: the name of the mixture source it was drawn from (``""`` outside a mixture).
    """

    tokens: list[int]
    answer_spans: list[tuple[int, int]] = field(default_factory=list)
    answer_distances: list[int] = field(default_factory=list)
    loss_mask: list[bool] | None = None
    source: str = ""


class DocumentSource(Protocol):
    """Maps a document index ``i >= 0`` to a :class:`Document`; deterministic and random-access
    (finite sources wrap around), so a packer's position is just an index."""

    def document(self, index: int) -> Document: ...
