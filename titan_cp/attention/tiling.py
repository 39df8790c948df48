"""The tiles a mask visits: those of a query buffer on a key buffer, built once per microbatch on the
host, and their index tensors on the device.

A *buffer* is the concatenation of the local shards of some cp ranks (``ranks``, a tuple), or
the whole row in natural order (``None``). Buffers are token-major over the batch: row
``b * n + j`` is token ``j`` of batch row ``b`` of an ``n``-token buffer, the layout the model's
``(B, H, S, E)`` views flatten to (:func:`token_major`)::

    q, out, dout:  (B*Sq, H, E)       k, v: (B*Sk, K, E)       lse: (H, B*Sq) fp32

:func:`tile_mask` gives a :class:`MaskTiles` (cached on the layout, so every layer of a
microbatch reuses it); :meth:`MaskTiles.index` turns it, once per device, into a
:class:`TileIndex` of device-resident index tensors: one variable-length kernel call per causal
flag (full tiles alone whose query rows are two consecutive groups take two, each read
as a view; causal tiles that cover the query rows once in order but for a few take two, those read
as a view and the few gathered: with full tiles beside them, three calls), its segments in query
order, the packed rows to gather for it, and the accumulator row of each packed output row. An
*upper* tile (keys ``j >= i``, at a window's edge) joins the causal call with its rows and keys
gathered in reverse order, where it is a causal square; a *windowed* tile (for a kernel that takes
the window) carries the window to its call.

A key buffer may arrive *compact*: only the rows some query of the tiles sees
(:meth:`MaskTiles.key_rows`), as the strategies send them; ``index(..., key_map=...)`` numbers
the key rows in the buffer actually held instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, TypeVar

import torch

from titan_cp.attention.kernels import AttentionKernel, Segments
from titan_cp.attention.masks import Tile, tiles_of_runs
from titan_cp.layout import SequenceLayout, spans, to_device

T = TypeVar("T")


@dataclass(frozen=True)
class Mask:
    """What a query may see beyond its document: ``causal`` (keys at or before it), ``window``
    (keys at most ``window - 1`` positions back), ``chunk`` (keys in its own ``chunk``-sized
    piece of the document)."""

    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    native_window: bool = False  # the kernel takes the window: a band is one segment (masks.py)


def kernel_mask(mask: Mask | bool, kernel: AttentionKernel | None) -> Mask:
    """``mask`` (or ``causal`` alone) as tiled for ``kernel``: windowed tiles where it takes the window
    (``native_window``)."""
    mask = mask if isinstance(mask, Mask) else Mask(causal=bool(mask))
    native = mask.window is not None and mask.causal and getattr(kernel, "native_window", False)
    return mask if native == mask.native_window else replace(mask, native_window=native)


CAUSAL = Mask()  # plain causal attention: the default


@dataclass(frozen=True)
class RowTiles:
    """The tiles of the batch rows ``rows`` (``None``: every row), which share one document structure."""

    rows: tuple[int, ...] | None
    tiles: tuple[Tile, ...]


class HostCall(NamedTuple):
    """One variable-length call laid out on the host: packed rows of each buffer and segment offsets."""

    causal: bool
    q_rows: torch.Tensor  # (total_q,) int64 rows of the query buffer, packed order
    k_rows: torch.Tensor  # (total_k,) int64 rows of the key buffer (full numbering)
    host_q: tuple[int, ...]
    host_k: tuple[int, ...]
    window: int | None = None  # the kernel's window (bottom-right causal, each row its last ``window`` keys)


class Rows(NamedTuple):
    """Rows of a token-major buffer: the span ``[start, stop)`` in order (read as a view, no copy) or,
    where they are not one, the device index tensor ``gather`` (read with one gather)."""

    start: int
    stop: int
    gather: torch.Tensor | None

    @classmethod
    def of(cls, rows: torch.Tensor, device: torch.device) -> Rows:
        """``rows`` (host int64) as a span when they are consecutive and ascending, else on ``device``."""
        n = len(rows)
        if n and int(rows[-1]) - int(rows[0]) == n - 1 and bool((rows[1:] > rows[:-1]).all()):
            return cls(int(rows[0]), int(rows[0]) + n, None)
        return cls(0, n, to_device(rows, device))

    def __len__(self) -> int:
        return self.stop - self.start if self.gather is None else len(self.gather)

    def take_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """These rows of ``x`` (dim 0) written into ``out``: one copy, whether a span or gathered."""
        if self.gather is None:
            return out.copy_(x.narrow(0, self.start, self.stop - self.start))
        return torch.index_select(x, 0, self.gather, out=out)

    def take(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """These rows of ``x`` along ``dim``."""
        return (
            x.narrow(dim, self.start, self.stop - self.start)
            if self.gather is None
            else x.index_select(dim, self.gather)
        )


@dataclass(frozen=True)
class VarlenCall:
    """One variable-length kernel call on the device."""

    causal: bool
    segments: Segments
    q_rows: Rows  # (total_q,) rows of the token-major query buffer, packed order
    k_rows: Rows  # (total_k,) rows of the key buffer held
    window: int | None = None  # passed to the kernel where a tile is windowed (its other tiles are shorter)


@dataclass(frozen=True)
class TileIndex:
    """The tiles' index tensors for one batch size on one device (built once, reused by every layer)."""

    calls: tuple[VarlenCall, ...]  # one per causal flag present (two full calls where no causal tile is)


def _rows(tiles_rows: Sequence[tuple[int, int, int, bool]]) -> torch.Tensor:
    """Rows ``[a, a + n)`` of each ``(a, n, _, reverse)`` in order, reversed where asked, as one int64 tensor."""
    starts = torch.tensor([a for a, _, _, _ in tiles_rows], dtype=torch.int64)
    lengths = torch.tensor([n for _, n, _, _ in tiles_rows], dtype=torch.int64)
    rows = spans(starts, lengths)
    rev = torch.tensor([r for _, _, _, r in tiles_rows], dtype=torch.bool)
    if rev.any():  # an upper tile: rows a + n - 1 ... a
        seg = torch.repeat_interleave(torch.arange(len(tiles_rows)), lengths)
        flip = rev[seg]
        rows[flip] = (2 * starts[seg] + lengths[seg] - 1)[flip] - rows[flip]
    return rows


def _offsets(lens: list[int]) -> tuple[int, ...]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return tuple(out)


class MaskTiles:
    """The tiles a mask visits of a query buffer of ``q_len`` tokens per row on a key buffer of ``k_len``.

    ``groups``: the tiles of each group of rows with one document structure. Empty tiles
    (nothing visible) are falsy and costs nothing.
    """

    def __init__(self, groups: tuple[RowTiles, ...], q_len: int, k_len: int) -> None:
        self.groups, self.q_len, self.k_len = groups, q_len, k_len
        self._cache: dict[tuple, Any] = {}

    def __bool__(self) -> bool:
        return bool(self.groups)

    @property
    def num_tiles(self) -> int:
        """Tiles over the row groups (a group of rows shares its tiles)."""
        return sum(len(g.tiles) for g in self.groups)

    def pairs(self, batch: int = 1) -> int:
        """Visible (query, key) pairs per head, summed over the batch."""
        return sum((batch if g.rows is None else len(g.rows)) * sum(t.pairs for t in g.tiles) for g in self.groups)

    def _memo(self, key: tuple, build: Callable[[], T]) -> T:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def host_calls(self, batch: int) -> tuple[HostCall, ...]:
        """The packed calls for ``batch`` rows, on the host (cached)."""
        return self._memo(("host", batch), lambda: self._host_calls(batch))

    def _host_calls(self, batch: int) -> tuple[HostCall, ...]:
        sq, sk = self.q_len, self.k_len
        items = [(b, t) for g in self.groups for b in (range(batch) if g.rows is None else g.rows) for t in g.tiles]
        # query order (a call's segments are independent): rows read in order are a view, not a gather
        items.sort(key=lambda bt: (bt[0], bt[1].q0, bt[1].k0))
        causal = [bt for bt in items if bt[1].causal]
        full = [bt for bt in items if not bt[1].causal]
        groups = [(True, part) for part in _split_causal(causal, sq) if part]
        groups += [(False, part) for part in (_split_full(full, sq) if not causal else [full]) if part]
        calls = []
        for is_causal, these in groups:
            lq = [t.q1 - t.q0 for _, t in these]
            lk = [t.k1 - t.k0 for _, t in these]
            q_rows = _rows([(b * sq + t.q0, t.q1 - t.q0, 0, t.upper) for b, t in these])
            k_rows = _rows([(b * sk + t.k0, t.k1 - t.k0, 0, t.upper) for b, t in these])
            window = next((t.window for _, t in these if t.window is not None), None)
            calls.append(HostCall(is_causal, q_rows, k_rows, _offsets(lq), _offsets(lk), window))
        return tuple(calls)

    def packed_key_count(self, batch: int) -> int:
        """Packed key rows over the tiles' calls (a key row counted once per tile reading it), from the
        tiles alone: equal to :meth:`key_row_count` exactly when every key row is read once."""
        return sum(self._batch_rows(g, batch) * sum(t.k1 - t.k0 for t in g.tiles) for g in self.groups)

    def key_row_count(self, batch: int) -> int:
        """``len(key_rows(batch))`` from the tiles alone (a tile's queries see, together, all of its keys):
        the planner's count at any length, no per-token tensor."""
        return sum(self._batch_rows(g, batch) * _union_len([(t.k0, t.k1) for t in g.tiles]) for g in self.groups)

    def query_row_count(self, batch: int) -> int:
        """``len(query_rows(batch))`` from the tiles alone (see :meth:`key_row_count`)."""
        return sum(self._batch_rows(g, batch) * _union_len([(t.q0, t.q1) for t in g.tiles]) for g in self.groups)

    @staticmethod
    def _batch_rows(group: RowTiles, batch: int) -> int:
        return batch if group.rows is None else len(group.rows)

    def key_rows(self, batch: int) -> torch.Tensor:
        """Sorted rows of the key buffer that some query of the tiles sees (host, int64)."""
        return self._memo(("keys", batch), lambda: _unique([c.k_rows for c in self.host_calls(batch)]))

    def query_rows(self, batch: int) -> torch.Tensor:
        """Sorted rows of the query buffer that see some key of the tiles (host, int64)."""
        return self._memo(("queries", batch), lambda: _unique([c.q_rows for c in self.host_calls(batch)]))

    def q_dest(self, batch: int) -> list[torch.Tensor]:
        """The query row of every packed output row, one tensor per call (host, int64)."""
        return [c.q_rows for c in self.host_calls(batch)]

    def k_dest(self, batch: int, key_map: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The key buffer row of every packed key row, one tensor per call (host, int64; through ``key_map``)."""
        return [c.k_rows if key_map is None else key_map[c.k_rows] for c in self.host_calls(batch)]

    def index(self, batch: int, device: torch.device, key_map: tuple[object, torch.Tensor] | None = None) -> TileIndex:
        """Device-resident index tensors for ``batch`` rows (cached).

        ``key_map``: ``(name, host int64 tensor)`` giving, for each row of the full key buffer,
        its row in the buffer actually held (the name keys the cache); ``None``: the full buffer.
        """
        key = ("index", batch, torch.device(device), None if key_map is None else key_map[0])
        return self._memo(key, lambda: self._index(batch, torch.device(device), key_map))

    def _index(self, batch: int, device: torch.device, key_map: tuple[object, torch.Tensor] | None) -> TileIndex:
        calls = []
        for c in self.host_calls(batch):
            k_rows = c.k_rows if key_map is None else key_map[1][c.k_rows]
            assert bool((k_rows >= 0).all()), "the tiles read a key row the buffer does not hold"
            seg = Segments(
                cu_q=to_device(torch.tensor(c.host_q, dtype=torch.int32), device),
                cu_k=to_device(torch.tensor(c.host_k, dtype=torch.int32), device),
                max_q=max(b - a for a, b in zip(c.host_q, c.host_q[1:])),
                max_k=max(b - a for a, b in zip(c.host_k, c.host_k[1:])),
                host_q=c.host_q,
                host_k=c.host_k,
            )
            calls.append(VarlenCall(c.causal, seg, Rows.of(c.q_rows, device), Rows.of(k_rows, device), c.window))
        return TileIndex(tuple(calls))


def _union_len(spans: list[tuple[int, int]]) -> int:
    """Length of the union of the half-open intervals ``spans``."""
    total, end = 0, None
    for a, b in sorted(spans):
        if b <= a:
            continue
        if end is None or a > end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def _split_full(items: list, sq: int) -> list[list]:
    """Full tiles (``(row, tile)`` in query order) of tiles with no causal tile as two calls where their
    query rows are two groups of rows that follow each other (each then read as a view, not one
    gather of both); else one call. Never more than two: the host work per step stays constant."""
    groups: list[list] = []
    end = None
    for b, t in items:
        start = b * sq + t.q0
        if end is None or start > end:
            groups.append([])
        groups[-1].append((b, t))
        end = max(end or 0, b * sq + t.q1)
    return groups if len(groups) == 2 else [items]


def _split_causal(items: list, sq: int) -> list[list]:
    """Causal tiles (``(row, tile)`` in query order) of a mask's tiles as two calls where all but
    a few of them cover their query rows once, in order, as one span (then read as a view, and the
    call's output is the result): those, and the others (an upper tile at a window's edge, a piece's
    tile on an earlier piece of its document held by the same rank), gathered. Else one call."""
    main, rest, end = [], [], None
    for b, t in items:
        start = b * sq + t.q0
        if not t.upper and (end is None or start == end):
            main.append((b, t))
            end = b * sq + t.q1
        else:
            rest.append((b, t))
    if not rest or not main or len(main) < len(rest):
        return [items]
    return [main, rest]


def _unique(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.unique(torch.cat(parts)) if parts else torch.zeros(0, dtype=torch.int64)


def tile_mask(
    layout: SequenceLayout, q_ranks: Sequence[int] | None, k_ranks: Sequence[int] | None, mask: Mask | bool
) -> MaskTiles:
    """Tiles for the query buffer ``cat(shards of q_ranks)`` on the key buffer ``cat(shards of k_ranks)``.

    ``None`` for either side means the whole row in natural order; ``mask`` a :class:`Mask` (or
    ``causal`` alone). Cached on the layout, so every layer of a microbatch reuses one set of tiles (and
    its device indices).
    """
    mask = mask if isinstance(mask, Mask) else Mask(causal=bool(mask))
    q_ranks = None if q_ranks is None else tuple(q_ranks)
    k_ranks = None if k_ranks is None else tuple(k_ranks)

    def build() -> MaskTiles:
        groups = []
        for rows in layout.row_groups():
            row = rows[0] if rows else None
            q_runs, k_runs = layout.runs(q_ranks, row, mask.chunk), layout.runs(k_ranks, row, mask.chunk)
            tiles = tiles_of_runs(q_runs, k_runs, mask.causal, mask.window, mask.native_window)
            if tiles:
                groups.append(RowTiles(rows or None, tiles))
        n = lambda ranks: layout.seq_len if ranks is None else layout.local_len * len(ranks)  # noqa: E731
        return MaskTiles(tuple(groups), n(q_ranks), n(k_ranks))

    return layout.memo(("tiles", q_ranks, k_ranks, mask), build)


# ---------------------------------------------------------------------------- buffers
def token_major(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, S, E)`` -> ``(B*S, H, E)``; a view when ``x`` is a transposed ``(B, S, H, E)`` tensor."""
    b, h, s, e = x.shape
    return x.transpose(1, 2).reshape(b * s, h, e)


def head_major(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of :func:`token_major`: ``(B*S, H, E)`` -> ``(B, H, S, E)`` view."""
    n, h, e = x.shape
    return x.view(batch, n // batch, h, e).transpose(1, 2)


def split_kv(kv: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` views of a buffer holding each row's (or head's) K, its first ``e`` elements, and V side by
    side in its last dim: the buffers that carry K and V together do so whatever V's head dim (MLA: 192 + 128)."""
    return kv.narrow(-1, 0, e), kv.narrow(-1, e, kv.shape[-1] - e)


def _causal_prefix(x: int, n: int) -> int:
    """``sum(min(a, n) for a in range(1, x + 1))`` (0 for ``x <= 0``)."""
    if x <= 0:
        return 0
    if x <= n:
        return x * (x + 1) // 2
    return n * (n + 1) // 2 + (x - n) * n


def _run_counts(q_runs, k_runs) -> tuple[int, int, int]:
    """Visible pairs, query rows that see a key and key rows seen, for plain causal masks within documents."""
    by_doc: dict[int, list] = {}
    for kr in k_runs:
        by_doc.setdefault(kr.doc, []).append(kr)
    first_key = {d: min(r.start for r in runs) for d, runs in by_doc.items()}
    last_query: dict[int, int] = {}
    pairs = queries = keys = 0
    for qr in q_runs:
        qs, qe = qr.start, qr.start + qr.length
        last_query[qr.doc] = max(last_query.get(qr.doc, -1), qe - 1)
        if qr.doc in first_key:
            queries += max(0, qe - max(qs, first_key[qr.doc]))
        for kr in by_doc.get(qr.doc, ()):  # key k is seen by query q when k <= q
            pairs += _causal_prefix(qe - kr.start, kr.length) - _causal_prefix(qs - kr.start, kr.length)
    for kr in k_runs:
        if kr.doc in last_query:
            keys += max(0, min(kr.start + kr.length, last_query[kr.doc] + 1) - kr.start)
    return pairs, queries, keys


def causal_counts(
    layout: SequenceLayout, q_ranks: Sequence[int] | None, k_ranks: Sequence[int] | None, batch: int
) -> tuple[int, int, int]:
    """``(pairs, query_row_count, key_row_count)`` of ``tile_mask(layout, q_ranks, k_ranks, CAUSAL)`` for
    ``batch`` rows, from the layout's runs in closed form (no tiles: the planner's counts over every pair of
    hundreds of ranks)."""
    q_ranks = None if q_ranks is None else tuple(q_ranks)
    k_ranks = None if k_ranks is None else tuple(k_ranks)

    def build() -> tuple[int, int, int]:
        pairs = q_count = k_count = 0
        for rows in layout.row_groups():
            n, row = (len(rows), rows[0]) if rows else (batch, None)
            p, qc, kc = _run_counts(layout.runs(q_ranks, row), layout.runs(k_ranks, row))
            pairs, q_count, k_count = pairs + n * p, q_count + n * qc, k_count + n * kc
        return pairs, q_count, k_count

    return layout.memo(("causal_counts", q_ranks, k_ranks, batch), build)


def zigzag_counts(layout: SequenceLayout, g: int, h: int, u: int, batch: int) -> tuple[int, int, int, bool | None]:
    """``causal_counts(layout, G, H, batch)`` and whether ``G``'s tiles on ``H``'s keys read a key row in more
    than one packed call (its gradients go home in fp32: ``ring._read_once``; ``None`` for ``g == h``, whose
    keys never travel), in closed form, for groups
    ``G``, ``H`` of ``u`` consecutive ranks (``g``-th and ``h``-th) of a layout holding the even zigzag of
    one document a row (:meth:`SequenceLayout.zigzag_chunk` ``c``). Group ``g`` holds the chunks ``g u + i``
    and ``2N - 1 - g u - i`` (``i < u``) of ``c`` tokens: a later group's first chunks come after all of an
    earlier group's and its last chunks before them, so every pair of groups sees ``2 u^2`` whole chunk
    pairs: all of ``G``'s ``2 u c`` query rows see ``u c`` of ``H``'s keys when ``g > h``, ``u c`` of them
    see all ``2 u c`` when ``g < h``; the group's own, ``u (2u - 1)`` chunk pairs and the ``2u`` causal
    chunks. Whether keys are read more than once is the same for every pair of groups in one order: read
    from groups 0 and 1's tiles. Equal to the tiles' own counts for every pair in the tests."""
    c = layout.zigzag_chunk()
    assert c is not None, "zigzag_counts needs a layout holding the even zigzag of one document a row"
    b = mask_rows(layout, batch)
    if g == h:
        return b * (c * c * u * (2 * u - 1) + u * c * (c + 1)), b * 2 * u * c, b * 2 * u * c, None
    near, far = (2 * u * c, u * c) if g > h else (u * c, 2 * u * c)
    # the same for every pair of groups in this order: read on the first two (one set of tiles, built once)
    first, second = (tuple(range(u, 2 * u)), tuple(range(u))) if g > h else (tuple(range(u)), tuple(range(u, 2 * u)))
    tiles = tile_mask(layout, first, second, CAUSAL)
    return b * 2 * u * u * c * c, b * near, b * far, tiles.packed_key_count(batch) != tiles.key_row_count(batch)


def mask_rows(layout: SequenceLayout, batch: int) -> int:
    """Rows the tiles' counts cover: the layout's rows when it holds documents, else ``batch``."""
    return batch if layout.doc_lens is None else len(layout.doc_lens)
