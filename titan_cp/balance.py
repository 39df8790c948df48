"""What a load balancer is: one object per kind, answering how a row's tokens are dealt to the ranks.

:class:`~titan_cp.layout.SequenceLayout`, the config (``parallelism.context_parallel_load_balancer``),
``apply_cp`` / ``shard_batch``, the Trainer factory and the planner never compare a balance's name;
they look it up here and ask its :class:`LoadBalancer`::

    b = get_balance("zigzag")
    b.chunks(cp_size=4)                 8: seq_len must be a multiple of it (two chunks per rank)
    b.follows_documents                 False: one permutation for every row, whatever its documents
    b.spans(seq_len, cp_size, doc_lens) the (start, length) spans of global positions each rank
                                        holds, in its buffer's order, for one row

The built-ins (N = ``cp_size``; :mod:`titan_cp.layout`'s docstring says why each balances)::

    contiguous   rank r holds [r*S/N, (r+1)*S/N)
    zigzag       S cut into 2N chunks; rank r holds chunks r and 2N-1-r
    doc_zigzag   every document cut into 2N pieces; rank r holds pieces r and 2N-1-r of each
    doc_local    documents whole on one rank where the balance allows (:mod:`titan_cp.doc_local`)

A fifth balance is one subclass and one :func:`register_balance` call; the layout checks that its
spans deal every position to exactly one rank, ``S/N`` to each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from titan_cp.doc_local import doc_local_pieces
from titan_cp.errors import did_you_mean

Spans = list[list[tuple[int, int]]]  # per rank, the (start, length) spans of global positions it holds, in order


class LoadBalancer:
    """One way of dealing a row's ``seq_len`` tokens to ``cp_size`` ranks. Subclasses set :attr:`name`
    (and :attr:`follows_documents` when the permutation depends on the row's documents) and implement
    :meth:`spans`."""

    name: ClassVar[str]
    follows_documents: ClassVar[bool] = False
    """Whether the permutation follows each row's documents (rows with different documents are then
    permuted differently, and the batch must be dim 0 of what is sharded)."""

    def chunks(self, cp_size: int) -> int:
        """Equal chunks a row is cut into: ``seq_len`` must be a multiple of it (``cp_size``: a shard a rank)."""
        return cp_size

    def spans(self, seq_len: int, cp_size: int, doc_lens: Sequence[int] | None) -> Spans:
        """The ``(start, length)`` spans of global positions each rank holds, in local (buffer) order, for
        one row of ``seq_len`` tokens; ``doc_lens`` its document lengths (``None``: one document)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class Contiguous(LoadBalancer):
    """Rank r holds ``[r*S/N, (r+1)*S/N)``."""

    name = "contiguous"

    def spans(self, seq_len: int, cp_size: int, doc_lens: Sequence[int] | None) -> Spans:
        s = seq_len // cp_size
        return [[(r * s, s)] for r in range(cp_size)]


class Zigzag(LoadBalancer):
    """The row cut into 2N chunks; rank r holds chunks r and 2N-1-r (equal causal work on one document)."""

    name = "zigzag"

    def chunks(self, cp_size: int) -> int:
        return 2 * cp_size

    def spans(self, seq_len: int, cp_size: int, doc_lens: Sequence[int] | None) -> Spans:
        n = cp_size
        c = seq_len // (2 * n)
        return [[(r * c, c), ((2 * n - 1 - r) * c, c)] for r in range(n)]


def _pieces(doc_lens: Sequence[int], cp_size: int) -> list[list[tuple[int, int]]]:
    """doc_zigzag: for each of the 2N slots, the (start, length) pieces it holds, document by document."""
    slots = 2 * cp_size
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(slots)]
    start, cursor = 0, 0
    for length in doc_lens:
        base, extra = divmod(length, slots)
        offset = start
        for k in range(slots):
            n = base + (1 if (k - cursor) % slots < extra else 0)
            if n:
                pieces[k].append((offset, n))
            offset += n
        cursor = (cursor + extra) % slots
        start += length
    return pieces


class DocZigzag(LoadBalancer):
    """Every document cut into 2N pieces as evenly as it allows; rank r holds pieces r and 2N-1-r of each
    (the extra tokens dealt round-robin across documents, so no document needs padding)."""

    name = "doc_zigzag"
    follows_documents = True

    def spans(self, seq_len: int, cp_size: int, doc_lens: Sequence[int] | None) -> Spans:
        n = cp_size
        pieces = _pieces(doc_lens if doc_lens is not None else (seq_len,), n)
        # document-major order: each document's head piece, then its tail piece
        return [sorted(pieces[r] + pieces[2 * n - 1 - r]) for r in range(n)]


class DocLocal(LoadBalancer):
    """Documents whole on one rank wherever the causal balance allows; only long ones split
    (:mod:`titan_cp.doc_local`)."""

    name = "doc_local"
    follows_documents = True

    def spans(self, seq_len: int, cp_size: int, doc_lens: Sequence[int] | None) -> Spans:
        return [list(p) for p in doc_local_pieces(doc_lens if doc_lens is not None else (seq_len,), cp_size)]


_REGISTRY: dict[str, LoadBalancer] = {}


def register_balance(balance: LoadBalancer) -> LoadBalancer:
    """Make ``balance`` selectable by its name everywhere a balance is named."""
    if not isinstance(balance, LoadBalancer):
        raise TypeError(f"register_balance takes a LoadBalancer instance, got {balance!r}")
    _REGISTRY[balance.name] = balance
    return balance


def balance_names() -> tuple[str, ...]:
    """The registered balances' names, in registration order."""
    return tuple(_REGISTRY)


def get_balance(name: str) -> LoadBalancer:
    """The balance called ``name``; ``ValueError`` naming the choices for an unknown one."""
    if not isinstance(name, str) or name not in _REGISTRY:
        names = balance_names()
        raise ValueError(f"unknown load balancer {name!r}; choose one of {names}{did_you_mean(name, names)}")
    return _REGISTRY[name]


for _builtin in (Contiguous(), Zigzag(), DocZigzag(), DocLocal()):
    register_balance(_builtin)
