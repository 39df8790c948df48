"""Attention masks as tiles: causal, packed-document and sliding-window masks without a dense ``S x S`` matrix.

The query buffer and the key buffer are each described by *runs* (see
:mod:`titan_cp.layout`): stretches of consecutive global positions inside one document.
A query at global position ``i`` of document ``d`` sees a key at position ``j`` of document
``e`` iff ``d == e`` and, when causal, ``j <= i``, and, with a window ``w``, ``j > i - w``
(at most ``w - 1`` positions back). For one query run against one key run of the same
document, without a window, the visible set splits into at most three rectangles::

        keys:   [ks ........ qs ..... ke)        q run = [qs, qe), k run = [ks, ke)
               +-------------+---------+
      qs       |   full      | \\ diag  |        full: keys before the q run, all rows
       ...     |   (all      |   \\     |        diag: the square where key and query
      qe       |    rows)    |  full'  |              spans overlap, top-left causal
               +-------------+---------+        full': rows past the overlap see all of it

A window adds a lower edge ``j > i - w``: where the edge slides, the rows see an *upper*
triangle (``j >= i`` on a square, the diagonal included), and where both edges slide (a row
sees exactly its last ``w`` keys) the band is cut into blocks of ``w`` rows, each a causal
square and the upper square of the ``w - 1`` keys before it. So every tile is a full
rectangle, a causal square or an upper square; an upper square is a causal square with its
rows and keys in reverse order, which is how the kernels run it (:mod:`.block`).

Every causal tile is square and aligned on its diagonal, so kernels that align causal
masks top-left (PyTorch's) and bottom-right (flash-attn) agree. The one exception is a kernel
that takes the window itself (``native_window``: flash's ``window_size_left``): for it a query
run on the keys of its own run is one *windowed* tile, bottom-right aligned (the last query on
the last key), each row seeing its last ``window`` keys of the tile, so a band of any length is
one segment and no row meets two. Query/key pairs in
different documents, and keys after the query or out of the window, produce no tile at
all: empty blocks are skipped, never computed and masked. Full tiles of one query range
whose key ranges touch are coalesced into one kernel call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from titan_cp.layout import Runs


@dataclass(frozen=True)
class Tile:
    """One kernel call: query rows ``[q0, q1)`` against key rows ``[k0, k1)`` of the local buffers.

    ``causal`` tiles are square (``q1 - q0 == k1 - k0``): row ``i`` sees keys ``j <= i``, or with
    ``upper`` keys ``j >= i`` (the diagonal included both ways).
    """

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    upper: bool = False
    window: int | None = None  # a windowed tile: bottom-right aligned, each row its last ``window`` keys

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs in the tile: the attention work it carries."""
        n, m = self.q1 - self.q0, self.k1 - self.k0
        if self.window is not None:
            return window_pairs(n, m, self.window)
        return n * (n + 1) // 2 if self.causal else n * m


def window_pairs(n: int, m: int, window: int) -> int:
    """Pairs of ``n`` queries on ``m >= n`` keys, bottom-right aligned, each row seeing at most its last
    ``window`` keys: row ``i`` sees ``min(i + m - n + 1, window)``."""
    off = m - n
    t = max(0, min(n, window - off))  # rows that see every key up to theirs
    return t * off + t * (t + 1) // 2 + (n - t) * window


def _coalesce(full: list[tuple[int, int, int, int]]) -> list[Tile]:
    """Merge full tiles whose key ranges touch (same query rows), then whose query ranges touch (same keys)."""
    merged: list[list[int]] = []
    for q0, q1, k0, k1 in sorted(full):
        last = merged[-1] if merged else None
        if last is not None and last[0] == q0 and last[1] == q1 and last[3] == k0:
            last[3] = k1
        else:
            merged.append([q0, q1, k0, k1])
    out: list[list[int]] = []
    for q0, q1, k0, k1 in sorted(merged, key=lambda t: (t[2], t[3], t[0])):
        last = out[-1] if out else None
        if last is not None and last[2] == k0 and last[3] == k1 and last[1] == q0:
            last[1] = q1
        else:
            out.append([q0, q1, k0, k1])
    return [Tile(q0, q1, k0, k1, False) for q0, q1, k0, k1 in out]


def _breaks(qs: int, qe: int, ks: int, ke: int, window: int | None) -> list[int]:
    """Query positions in ``[qs, qe)`` where the visible key interval changes shape."""
    cuts = {qs, qe, ks, ke}
    if window is not None:
        cuts |= {ks + window - 1, ke + window - 1}
    return sorted(p for p in cuts if qs <= p <= qe)


def _band(pa: int, pb: int, window: int, tiles: list[tuple[str, int, int, int, int]]) -> None:
    """Rows ``[pa, pb)`` that each see exactly their last ``window`` keys (global positions)."""
    for a in range(pa, pb, window):
        n = min(window, pb - a)
        tiles.append(("causal", a, a + n, a, a + n))
        m = min(n, window - 1)  # row i of the block sees keys [a - window + 1 + i, a)
        if m:
            tiles.append(("upper", a, a + m, a - window + 1, a - window + 1 + m))
        if m < window - 1:  # a short last block: its rows see the rest of those keys whole
            tiles.append(("full", a, a + n, a - window + 1 + m, a))


def run_pair_tiles(
    qs: int, qe: int, ks: int, ke: int, causal: bool, window: int | None, native: bool = False
) -> list[tuple[str, int, int, int, int]]:
    """``(kind, q0, q1, k0, k1)`` in global positions: the visible pairs of query positions
    ``[qs, qe)`` on key positions ``[ks, ke)`` of one document, exactly once. ``native``: the kernel
    takes the window, so the rows inside the key run are one ``"window"`` tile."""
    if not causal:
        return [("full", qs, qe, ks, ke)]
    if native and window is not None:
        a, b = max(qs, ks), min(qe, ke)
        inside = [("window", a, b, max(ks, a - window + 1), b)] if a < b else []
        past = max(qs, ke)  # rows after the key run: the band's edge, as tiles
        return inside + (run_pair_tiles(past, qe, ks, ke, causal, window) if past < qe else [])
    tiles: list[tuple[str, int, int, int, int]] = []
    cuts = _breaks(qs, qe, ks, ke, window)
    win = 0 if window is None else window  # read only where lo_slides holds, i.e. with a window
    for pa, pb in zip(cuts, cuts[1:]):
        if pa == pb:
            continue
        lo_slides = window is not None and pa >= ks + window - 1  # lo(P) = P - window + 1
        hi_slides = pa < ke  # hi(P) = P, else ke - 1
        lo = pa - win + 1 if lo_slides else ks
        if pa < ks or (window is not None and pa >= ke + window - 1):
            continue  # these rows see no key of the run
        if hi_slides and lo_slides:
            _band(pa, pb, win, tiles)
        elif hi_slides:  # keys [ks, P]: the keys before the rows, then the causal square
            if ks < pa:
                tiles.append(("full", pa, pb, ks, pa))
            tiles.append(("causal", pa, pb, pa, pb))
        elif lo_slides:  # keys [P - window + 1, ke): an upper square, then the keys every row sees
            top = min(pb - win + 1, ke)
            if lo < top:
                tiles.append(("upper", pa, pa + top - lo, lo, top))
            if top < ke:
                tiles.append(("full", pa, pb, top, ke))
        else:
            tiles.append(("full", pa, pb, ks, ke))
    return tiles


@functools.lru_cache(maxsize=4096)
def tiles_of_runs(
    q_runs: Runs, k_runs: Runs, causal: bool, window: int | None = None, native: bool = False
) -> tuple[Tile, ...]:
    """The tiles that compute exact (document-, window-)masked attention of a query buffer on a key buffer
    (``native``: for a kernel that takes the window, see the module docstring)."""
    by_doc: dict[int, list] = {}
    for kr in k_runs:
        by_doc.setdefault(kr.doc, []).append(kr)
    full: list[tuple[int, int, int, int]] = []
    squares: list[Tile] = []
    for qr in q_runs:
        qs, qe = qr.start, qr.start + qr.length
        for kr in by_doc.get(qr.doc, ()):
            ks, ke = kr.start, kr.start + kr.length
            for kind, q0, q1, k0, k1 in run_pair_tiles(qs, qe, ks, ke, causal, window, native):
                local = (qr.local + q0 - qs, qr.local + q1 - qs, kr.local + k0 - ks, kr.local + k1 - ks)
                if kind == "full":
                    full.append(local)
                elif kind == "window":
                    squares.append(Tile(*local, causal=True, window=window))
                else:
                    squares.append(Tile(*local, causal=True, upper=kind == "upper"))
    return tuple(squares + _coalesce(full))


def tile_pairs(tiles: tuple[Tile, ...]) -> int:
    """Exact count of visible (query, key) pairs covered by ``tiles``."""
    return sum(t.pairs for t in tiles)
