"""Sequence layouts: which tokens of a sequence each context-parallel rank holds.

A layout is one permutation of the ``seq_len`` token slots of every batch row into
``cp_size`` equal shards. The same permutation shards every per-token tensor (tokens,
labels, positions, document ids, loss masks) and :meth:`SequenceLayout.unshard` inverts it.
The attention strategies read the document structure and each shard's global positions
from the layout, so masks stay exact wherever a document's tokens land.

Balances (N = ``cp_size``, S = ``seq_len``; registered objects, :mod:`titan_cp.balance`)::

    contiguous   rank r holds [r*S/N, (r+1)*S/N)                           needs S % N == 0
    zigzag       split S into 2N chunks; rank r holds chunks r and 2N-1-r  needs S % 2N == 0
    doc_zigzag   every document is split into 2N pieces as evenly as it     needs S % N == 0
                 allows; rank r holds pieces r and 2N-1-r of each document
    doc_local    documents stay whole on one rank where the balance allows; needs S % N == 0
                 only long ones are split as doc_zigzag splits them

Under causal attention the work of a chunk grows with its position, so pairing chunk
``r`` with chunk ``2N-1-r`` gives every rank the same work. With packed documents the
causal mask restarts at every document, so ``zigzag`` over the whole row no longer
balances; ``doc_zigzag`` applies the head-tail pairing inside each document instead.
A document of length ``L = 2N*q + e`` gives ``q`` tokens to each of its 2N pieces plus one
extra token to ``e`` of them. The extras are dealt round-robin over the 2N piece slots,
continuing across documents, so every rank ends up with exactly ``S/N`` tokens and no
document needs padding, whatever its length (1 token, fewer than 2N, longer than a shard).

``doc_zigzag`` balances every row exactly, but at a price on a GPU: every document is cut
into 2N pieces, so every rank needs every other rank's K/V and the kernel sees small tiles.
``doc_local`` (:mod:`titan_cp.doc_local`) keeps documents whole on one rank wherever the
causal balance allows and splits only what it needs, so most K/V are needed by their own
rank only (the strategies send only what another rank can see).

Vocabulary: a *run* is a maximal stretch of a rank's local buffer whose tokens are
consecutive global positions of one document; masks are computed on runs, never on a
dense ``S x S`` matrix.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from titan_cp.balance import Spans, get_balance

T = TypeVar("T")
DocLens = Sequence[Sequence[int]] | torch.Tensor
"""Packed documents: one list of document lengths per batch row, or a zero-padded ``(batch, max_docs)``
host tensor."""
Device = torch.device | str | None


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without synchronising the host with a CUDA stream (pinned, non-blocking)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


DEFAULT_BALANCE = "doc_local"  # what the config, ContextParallel, apply_cp, shard_batch and the planner use


def seq_len_multiple(balance: str, cp_size: int) -> int:
    """What ``seq_len`` must be a multiple of for ``balance`` over ``cp_size`` ranks (its
    :meth:`~titan_cp.balance.LoadBalancer.chunks`: ``2 * cp_size`` for ``zigzag``, ``cp_size`` for the others)."""
    return get_balance(balance).chunks(cp_size)


@dataclass(frozen=True)
class Run:
    """``length`` tokens at local offset ``local`` holding global positions ``[start, start+length)`` of document ``doc``."""

    local: int
    start: int
    length: int
    doc: int


Runs = tuple[Run, ...]


def _tensor_rows(doc_lens: torch.Tensor) -> list[list[int]]:
    """Rows of a zero-padded ``(batch, max_docs)`` integer tensor, padding dropped."""
    if doc_lens.dim() != 2:
        raise ValueError(f"doc_lens tensor must be (batch, max_docs), got shape {tuple(doc_lens.shape)}")
    if doc_lens.dtype.is_floating_point or doc_lens.dtype.is_complex or doc_lens.dtype == torch.bool:
        raise ValueError(f"doc_lens tensor must hold integers (int32/int64), got {doc_lens.dtype}")
    rows = []
    for b, row in enumerate(doc_lens.tolist()):
        n = len(row)
        while n and row[n - 1] == 0:
            n -= 1
        if 0 in row[:n]:
            raise ValueError(
                f"doc_lens row {b} has a zero-length document before its last document: {row}; "
                "a tensor row is zero-padded on the right only"
            )
        rows.append(row[:n])
    return rows


def _normalize_doc_lens(seq_len: int, doc_lens: DocLens | None) -> tuple[tuple[int, ...], ...] | None:
    if doc_lens is None:
        return None
    if isinstance(doc_lens, torch.Tensor):
        rows = _tensor_rows(doc_lens)
    else:
        given = list(doc_lens)
        for b, row in enumerate(given):
            if not isinstance(row, (list, tuple)):
                raise ValueError(
                    f"doc_lens must hold one list of document lengths per batch row (e.g. [[3, 5]]); row {b} is {row!r}"
                )
        rows = [list(row) for row in given]
    if not rows:
        raise ValueError("doc_lens must hold one list of document lengths per batch row; got no rows")
    out = []
    for b, row in enumerate(rows):
        if not row:
            raise ValueError(f"doc_lens row {b} is empty; each row must hold the lengths of its documents")
        for n in row:
            if isinstance(n, bool) or not isinstance(n, (int, float)) or int(n) != n or n <= 0:
                raise ValueError(f"doc_lens row {b} has a document of length {n!r}; lengths must be positive integers")
        if sum(row) != seq_len:
            raise ValueError(f"doc_lens row {b} sums to {sum(row)}, but seq_len is {seq_len}")
        out.append(tuple(int(n) for n in row))
    return tuple(out)


def spans(starts: Sequence[int] | torch.Tensor, lengths: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n)`` as one int64 tensor, without a Python loop over positions."""
    s = torch.as_tensor(starts, dtype=torch.int64)
    n = torch.as_tensor(lengths, dtype=torch.int64)
    if not len(s):
        return s
    return torch.arange(int(n.sum())) + torch.repeat_interleave(s - (torch.cumsum(n, 0) - n), n)


def _row_spans(seq_len: int, cp_size: int, balance: str, doc_lens: Sequence[int] | None) -> Spans:
    """The ``(start, length)`` spans of global positions each rank holds, in local (layout) order, for one
    row: ``balance``'s, checked to deal every position to exactly one rank, ``seq_len / cp_size`` to each."""
    spans_ = get_balance(balance).spans(seq_len, cp_size, doc_lens)
    local = seq_len // cp_size
    bad = len(spans_) != cp_size or any(sum(n for _, n in rank) != local for rank in spans_)
    cover = sorted(piece for rank in spans_ for piece in rank if piece[1])
    ends = [0] + [start + n for start, n in cover]  # each piece starts where the one before it ends
    if bad or [start for start, _ in cover] != ends[:-1] or ends[-1] != seq_len:
        raise ValueError(
            f"balance {balance!r} does not deal the {seq_len} positions of a row to {cp_size} ranks, "
            f"{local} each, every position once: fix its spans()"
        )
    return spans_


def _span_runs(pieces: Sequence[tuple[int, int]], doc_starts: Sequence[int], seq_len: int, chunk: int | None) -> Runs:
    """:func:`_runs` of the buffer that holds the positions of ``pieces`` in order, from the pieces and the
    documents' starts alone (no per-token tensor: the planner's layouts at millions of tokens)."""
    bounds = list(doc_starts) + [seq_len]
    out: list[Run] = []
    local = 0
    for a, n in pieces:
        p, end = a, a + n
        while p < end:
            d = bisect.bisect_right(doc_starts, p) - 1
            stop = min(end, bounds[d + 1])
            doc = d
            if chunk is not None:
                piece = (p - bounds[d]) // chunk
                stop = min(stop, bounds[d] + (piece + 1) * chunk)
                doc = d * (seq_len // chunk + 1) + piece
            prev = out[-1] if out else None
            if (
                prev is not None
                and prev.doc == doc
                and prev.start + prev.length == p
                and prev.local + prev.length == local
            ):
                out[-1] = Run(prev.local, prev.start, prev.length + stop - p, doc)
            else:
                out.append(Run(local, p, stop - p, doc))
            local += stop - p
            p = stop
    return tuple(out)


def _runs(positions: torch.Tensor, doc_of: torch.Tensor) -> Runs:
    """Maximal stretches of consecutive positions inside one document, per token (vectorised): the
    definition :func:`_span_runs` computes from spans (``tests/test_layout.py`` checks them equal)."""
    doc = doc_of[positions]
    cut = torch.ones(positions.numel(), dtype=torch.bool)
    cut[1:] = (positions[1:] != positions[:-1] + 1) | (doc[1:] != doc[:-1])
    first = torch.nonzero(cut).flatten()
    lengths = torch.diff(first, append=torch.tensor([positions.numel()]))
    return tuple(
        Run(local=i, start=p, length=n, doc=d)
        for i, p, n, d in zip(first.tolist(), positions[first].tolist(), lengths.tolist(), doc[first].tolist())
    )


def _check_dim(dim: int, x: torch.Tensor) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a {x.dim()}-D tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


class SequenceLayout:
    """How the tokens of each batch row are split over ``cp_size`` ranks.

    Args:
        seq_len: tokens per row, before sharding.
        cp_size: ranks on the ``cp`` mesh axis.
        balance: the name of a registered balance (:func:`titan_cp.balance.balance_names`: ``"contiguous"``,
            ``"zigzag"``, ``"doc_zigzag"``, ``"doc_local"`` and any registered since; module docstring).
        doc_lens: ``None`` (each row is one document), or the packed-document structure:
            one list of document lengths per batch row, each summing to ``seq_len``, or a
            ``(batch, max_docs)`` integer tensor zero-padded on the right.

    Per-token tensors are sharded along ``dim`` with :meth:`shard`; when rows have
    different document structures under a balance that follows documents (``doc_zigzag``, ``doc_local``)
    each row has its own permutation,
    and the batch must then be dim 0 of the tensor.
    """

    def __init__(self, seq_len: int, cp_size: int, balance: str = "zigzag", doc_lens: DocLens | None = None) -> None:
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"cp_size must be a positive integer, got {cp_size!r}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        divisor = seq_len_multiple(balance, cp_size)
        if seq_len % divisor:
            raise ValueError(
                f"seq_len {seq_len} is not divisible by {divisor}, as the {balance!r} layout needs for cp_size {cp_size}"
            )
        self.seq_len = seq_len
        self.cp_size = cp_size
        self.balance = balance
        self.doc_lens = _normalize_doc_lens(seq_len, doc_lens)
        self.documents = self.doc_lens_tensor()
        """``doc_lens`` as one ``(batch, max_docs)`` tensor built with the layout (``None`` without documents):
        what :func:`~titan_cp.attention.cp_attention` hands the op. A tensor held by the layout is an input of a
        graph ``torch.compile`` traces from the layout, so a new batch's documents are new data, not a new graph."""
        self.local_len = seq_len // cp_size
        rows = self.doc_lens if self.doc_lens is not None else (None,)
        # rows with the same documents share everything; keep one entry per distinct row
        self._row_keys = [rows.index(row) for row in rows]
        # per row structure: the ranks' spans and the documents (compact); per-token tensors built when asked
        self._spans: dict[int, list[list[tuple[int, int]]]] = {}
        self._lens: dict[int, tuple[int, ...]] = {}
        for key in set(self._row_keys):
            row = rows[key]
            self._spans[key] = _row_spans(seq_len, cp_size, balance, row)
            self._lens[key] = tuple(row) if row is not None else (seq_len,)
        self._tensor_cache: dict[tuple, torch.Tensor] = {}
        self._runs_cache: dict[tuple, Runs] = {}
        self._memo: dict[tuple, Any] = {}

    def doc_lens_tensor(self) -> torch.Tensor | None:
        """The documents as a zero-padded ``(batch, max_docs)`` int64 host tensor (``None`` without documents)."""
        if self.doc_lens is None:
            return None
        width = max(len(row) for row in self.doc_lens)
        return torch.tensor([list(row) + [0] * (width - len(row)) for row in self.doc_lens], dtype=torch.int64)

    def memo(self, key: tuple, build: Callable[[], T]) -> T:
        """``build()`` once per layout and ``key``: the attention's tiles and their device
        indices are built once per microbatch and reused by every layer."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    # ------------------------------------------------------------------ structure
    @property
    def batch_size(self) -> int | None:
        """Rows described by ``doc_lens``; ``None`` when every row is one document."""
        return None if self.doc_lens is None else len(self.doc_lens)

    @property
    def packs_documents(self) -> bool:
        """Whether some row holds more than one document (``doc_lens`` of one document a row is the
        causal row itself; the attention op tells them apart by the ``doc_lens`` tensor's width)."""
        return self.doc_lens is not None and max(len(row) for row in self.doc_lens) > 1

    @property
    def row_independent(self) -> bool:
        """True when every row uses the same permutation (so any dim may be the batch)."""
        return len(set(self._row_keys)) == 1 or not get_balance(self.balance).follows_documents

    def row_groups(self) -> list[tuple[int, ...]]:
        """Batch rows grouped by identical document structure: masks are planned once per group."""
        if self.doc_lens is None:
            return [()]  # every row; the batch size is not known to the layout
        groups: dict[int, list[int]] = {}
        for b, key in enumerate(self._row_keys):
            groups.setdefault(key, []).append(b)
        return [tuple(rows) for rows in groups.values()]

    def _key(self, row: int | None) -> int:
        return 0 if row is None or self.doc_lens is None else self._row_keys[row]

    def runs(self, ranks: Sequence[int] | None, row: int | None = None, chunk: int | None = None) -> Runs:
        """Runs of the buffer that concatenates the local shards of ``ranks`` in order.

        ``ranks=None`` means the whole row in natural order (the documents themselves).
        ``chunk``: the documents cut into pieces of ``chunk`` positions from each document's
        start (chunked attention sees only its own piece); a run's ``doc`` is then its piece.
        """
        cache_key = (None if ranks is None else tuple(ranks), self._key(row), chunk)
        if cache_key not in self._runs_cache:
            ranks, key, chunk = cache_key
            pieces = [(0, self.seq_len)] if ranks is None else [p for r in ranks for p in self._spans[key][r]]
            self._runs_cache[cache_key] = _span_runs(pieces, self._doc_starts(key), self.seq_len, chunk)
        return self._runs_cache[cache_key]

    def zigzag_chunk(self) -> int | None:
        """``c`` when every row is one document held as the even zigzag: rank ``r`` holds positions
        ``[r c, (r + 1) c)`` and ``[(2N - 1 - r) c, (2N - r) c)`` (``zigzag``, and ``doc_local`` or
        ``doc_zigzag`` on one document of a multiple of 2N tokens; ``doc_local`` where its blocked cuts
        are the even one); else ``None``. The per-pair counts of such a layout come in closed form
        (``attention.tiling.zigzag_counts``): every pair of ranks but one's own sees alike."""

        def build() -> int | None:
            n, c = self.cp_size, self.seq_len // (2 * self.cp_size)
            if n < 2 or self.seq_len % (2 * n) or any(len(lens) != 1 for lens in self._lens.values()):
                return None
            want = lambda r: [(r * c, c), ((2 * n - 1 - r) * c, c)]  # noqa: E731
            return c if all(spans[r] == want(r) for spans in self._spans.values() for r in range(n)) else None

        return self.memo(("zigzag_chunk",), build)

    def _doc_starts(self, key: int) -> list[int]:
        starts, at = [], 0
        for n in self._lens[key]:
            starts.append(at)
            at += n
        return starts

    def _index(self, key: int) -> list[torch.Tensor]:
        """Global positions held by each rank (per-token tensors, built on first use)."""
        return self.memo(
            ("index", key), lambda: [spans([a for a, _ in p], [b for _, b in p]) for p in self._spans[key]]
        )

    def _doc_of(self, key: int) -> torch.Tensor:
        """The document of every position of the row (built on first use)."""
        lens = torch.tensor(self._lens[key], dtype=torch.int64)
        return self.memo(("doc_of", key), lambda: torch.repeat_interleave(torch.arange(len(lens)), lens))

    def _doc_start(self, key: int) -> torch.Tensor:
        return torch.tensor(self._doc_starts(key), dtype=torch.int64)

    # ------------------------------------------------------------------ tensors
    def index(self, rank: int, device: Device = None) -> torch.Tensor:
        """Global positions of ``rank``'s tokens in local order: ``(local_len,)``, or ``(batch, local_len)`` when rows differ."""
        self._check_rank(rank)
        return self._tensor("index", rank, device)

    def positions(self, rank: int, device: Device = None) -> torch.Tensor:
        """Global positions of ``rank``'s tokens, ``(batch, local_len)`` (``(1, local_len)`` without documents)."""
        self._check_rank(rank)
        return self._tensor("positions", rank, device)

    def doc_positions(self, rank: int, device: Device = None) -> torch.Tensor:
        """Position of each of ``rank``'s tokens inside its own document (restarts at 0), ``(batch, local_len)``."""
        self._check_rank(rank)
        return self._tensor("doc_positions", rank, device)

    def doc_ids(self, rank: int, device: Device = None) -> torch.Tensor:
        """Document index (within its row) of each of ``rank``'s tokens, ``(batch, local_len)``."""
        self._check_rank(rank)
        return self._tensor("doc_ids", rank, device)

    def _tensor(self, kind: str, rank: int, device: Device) -> torch.Tensor:
        device = torch.device(device) if device is not None else torch.device("cpu")
        cache_key = (kind, rank, device)
        if cache_key not in self._tensor_cache:
            keys = self._row_keys if self.doc_lens is not None else [0]
            rows = []
            for key in keys:
                idx = self._index(key)[rank]
                if kind in ("index", "positions"):
                    rows.append(idx)
                elif kind == "doc_ids":
                    rows.append(self._doc_of(key)[idx])
                else:
                    rows.append(idx - self._doc_start(key)[self._doc_of(key)[idx]])
            t = torch.stack(rows).to(device)
            if kind == "index" and self.row_independent:
                t = t[0]
            self._tensor_cache[cache_key] = t
        return self._tensor_cache[cache_key]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank {rank} is out of range for cp_size {self.cp_size}")

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """This rank's tokens of ``x`` along ``dim``, in layout order."""
        dim = _check_dim(dim, x)
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"cannot shard dim {dim} of size {x.shape[dim]}: the layout's seq_len is {self.seq_len}")
        index = self.index(rank, x.device)
        if index.dim() == 1:
            return x.index_select(dim, index)
        return self._per_row(x, dim, index, gather=True)

    def unshard(self, locals_: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of :meth:`shard`: every rank's local tensor, by rank, back in natural order."""
        if len(locals_) != self.cp_size:
            raise ValueError(f"unshard needs {self.cp_size} local tensors (one per rank), got {len(locals_)}")
        first = locals_[0]
        dim = _check_dim(dim, first)
        for r, t in enumerate(locals_):
            if t.shape[dim] != self.local_len:
                raise ValueError(
                    f"rank {r}'s tensor has {t.shape[dim]} tokens along dim {dim}; expected {self.local_len}"
                )
        stacked = torch.cat(list(locals_), dim=dim)
        return self.to_natural(stacked, dim)

    def concat_index(self, device: Device = None) -> torch.Tensor:
        """Global position of each slot of the rank-concatenated buffer ``cat(shards)``."""
        cache_key = ("concat", device)
        if cache_key not in self._tensor_cache:
            self._tensor_cache[cache_key] = torch.cat([self.index(r, device) for r in range(self.cp_size)], dim=-1)
        return self._tensor_cache[cache_key]

    def inverse_concat_index(self, device: Device = None) -> torch.Tensor:
        """Slot in ``cat(shards)`` of each global position: ``natural = concat[..., inverse]``."""
        cache_key = ("inverse", device)
        if cache_key not in self._tensor_cache:
            self._tensor_cache[cache_key] = torch.argsort(self.concat_index(device), dim=-1)
        return self._tensor_cache[cache_key]

    def to_natural(self, concat: torch.Tensor, dim: int) -> torch.Tensor:
        """Reorder a tensor holding ``cat(shards)`` along ``dim`` into natural order."""
        inverse = self.inverse_concat_index(concat.device)
        if inverse.dim() == 1:
            return concat.index_select(dim, inverse)
        return self._per_row(concat, dim, inverse, gather=True)

    def _natural_index(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """For each natural token-major row ``b*S + p``: the (rank, ``b*S_local + j``) holding it."""

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            inverse = self.inverse_concat_index()  # concat slot of each natural position
            inverse = inverse.expand(batch, -1) if inverse.dim() == 1 else inverse
            if inverse.shape[0] != batch:
                raise ValueError(f"batch size {batch} does not match the layout's {inverse.shape[0]} doc_lens rows")
            rank, j = inverse // self.local_len, inverse % self.local_len
            slot = j + self.local_len * torch.arange(batch).unsqueeze(1)
            return to_device(rank.reshape(-1), torch.device(device)), to_device(slot.reshape(-1), torch.device(device))

        return self.memo(("natural_index", batch, torch.device(device)), build)

    def stacked_to_natural(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        """``(cp_size, B*S_local, ...)`` (every rank's token-major shard, stacked by rank) ->
        ``(B*seq_len, ...)`` token-major in natural order: one gather."""
        rank, slot = self._natural_index(batch, x.device)
        return x[rank, slot]

    def natural_to_stacked(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        """Inverse of :meth:`stacked_to_natural`: one scatter."""
        rank, slot = self._natural_index(batch, x.device)
        out = x.new_empty((self.cp_size, batch * self.local_len) + tuple(x.shape[1:]))
        out[rank, slot] = x
        return out

    def _per_row(self, x: torch.Tensor, dim: int, index: torch.Tensor, gather: bool) -> torch.Tensor:
        if dim == 0:
            raise ValueError("rows with different documents need the batch on dim 0 and the sequence elsewhere")
        if x.shape[0] != index.shape[0]:
            raise ValueError(f"batch size {x.shape[0]} does not match the layout's {index.shape[0]} doc_lens rows")
        return torch.stack([x[b].index_select(dim - 1, index[b]) for b in range(x.shape[0])])

    def __repr__(self) -> str:
        docs = "None" if self.doc_lens is None else f"<{len(self.doc_lens)} rows>"
        return (
            f"SequenceLayout(seq_len={self.seq_len}, cp_size={self.cp_size}, balance={self.balance!r}, doc_lens={docs})"
        )


_CACHE_SIZE = 16  # get_layout's value-keyed memo: layouts (with their tiles) of recent calls


def cut_at_shards(doc_lens: Sequence[Sequence[int]], seq_len: int, cp_size: int) -> list[list[int]]:
    """Each row's document lengths with every document cut where the ``contiguous`` layout's shards
    meet (at multiples of ``seq_len / cp_size``). Sharded contiguously, a row cut so has no
    document on two ranks: each rank's queries see only the keys of its own shard (the recall
    evaluation's shard-cut mode, ``validation.recall_shard_cut``)."""
    if cp_size < 1 or seq_len % cp_size:
        raise ValueError(f"seq_len ({seq_len}) must be a positive multiple of cp_size ({cp_size})")
    shard = seq_len // cp_size
    rows = []
    for lens in doc_lens:
        cut, start = [], 0
        for n in (int(x) for x in lens):
            end = start + n
            while start < end:
                piece = min(end, (start // shard + 1) * shard) - start
                cut.append(piece)
                start += piece
        if start != seq_len:
            raise ValueError(f"a row's documents hold {start} tokens, not seq_len = {seq_len}")
        rows.append(cut)
    return rows


def doc_lens_key(doc_lens: DocLens | None) -> tuple[tuple[int, ...], ...] | None:
    """A hashable form of ``doc_lens`` (list of rows, or zero-padded host tensor): the rows' values."""
    if doc_lens is None:
        return None
    if isinstance(doc_lens, torch.Tensor):
        if doc_lens.device.type != "cpu":
            raise ValueError(
                f"doc_lens must be a CPU tensor, got one on {doc_lens.device}: reading the documents from the "
                "device would synchronise it in every layer; keep doc_lens on the host"
            )
        return tuple(tuple(row) for row in _tensor_rows(doc_lens))
    for b, row in enumerate(doc_lens):
        if not isinstance(row, (list, tuple)):
            raise ValueError(
                f"doc_lens must hold one list of document lengths per batch row (e.g. [[3, 5]]); row {b} is {row!r}"
            )
    return tuple(tuple(row) for row in doc_lens)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _layout(
    seq_len: int, cp_size: int, balance: str, balancer: object, rows: tuple[tuple[int, ...], ...] | None
) -> SequenceLayout:
    """Keyed by the registered balancer object too: a balance registered again under its name is a new key."""
    return SequenceLayout(seq_len, cp_size, balance, rows)


def get_layout(seq_len: int, cp_size: int, balance: str = "zigzag", doc_lens: DocLens | None = None) -> SequenceLayout:
    """The :class:`SequenceLayout` of these arguments, memoised by value (the last few, with their
    plans): analysis, metrics and one-device attention ask for the same layout repeatedly. Training
    under CP gets its layouts from the CP handle the batch was sharded by
    (:class:`~titan_cp.attention.handle.CPHandle`), never from here."""
    return _layout(seq_len, cp_size, balance, get_balance(balance), doc_lens_key(doc_lens))
