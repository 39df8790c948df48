"""Attention of a query buffer on a key buffer under a mask plan, merged in fp32.

This is the arithmetic every strategy shares: the strategies decide *which* key buffer
a rank holds at each moment; :func:`block_forward` and :func:`block_backward` compute its
contribution for the tiles of a :class:`Plan` (see :mod:`titan_cp.attention.masks`).

Buffers are token-major, the layout the model produces and the flash kernels take::

    q, out, dout:  (B*Sq, H, E)       k, v: (B*Sk, K, E)       lse: (H, B*Sq) fp32

(a ``(B, H, S, E)`` attention tensor that is a transposed view of ``(B, S, H, E)`` flattens
to this without a copy). Row ``b`` of the batch holds rows ``[b*S, (b+1)*S)``.

Host work per call is constant in the number of documents. A plan is built once per
microbatch (the layout caches it) and turned, once per device, into a :class:`PlanIndex`
of device-resident index tensors. Then, for one key buffer:

- a kernel with native variable-length support gets one call per causal flag: the tiles'
  rows are packed with one gather per tensor, and the results are merged with one
  vectorised log-sum-exp merge (:func:`~titan_cp.attention.merge.merge_segments_`); the
  backward scatter-adds each gradient with one ``index_add_``;
- any other kernel gets one call per tile (plain slices, no copies), and the results of
  all tiles are concatenated and merged, or scatter-added, in one go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_cp.attention.kernels import AttentionKernel, Segments
from titan_cp.attention.masks import Tile, plan_tiles
from titan_cp.attention.merge import merge_segments_
from titan_cp.layout import SequenceLayout, _spans, to_device


@dataclass(frozen=True)
class RowTiles:
    """The tiles of the batch rows ``rows`` (``None``: every row), which share one document structure."""

    rows: tuple[int, ...] | None
    tiles: tuple[Tile, ...]


@dataclass(frozen=True)
class VarlenCall:
    """One variable-length kernel call: the packed rows to gather and the segment offsets."""

    causal: bool
    segments: Segments
    q_rows: torch.Tensor  # (total_q,) int64: rows of the token-major query buffer, packed order
    k_rows: torch.Tensor  # (total_k,) int64: rows of the token-major key buffer


@dataclass(frozen=True)
class PlanIndex:
    """A plan's index tensors for one batch size on one device (built once, reused by every layer)."""

    calls: tuple[VarlenCall, ...]  # native varlen: one per causal flag present
    q_dest: torch.Tensor  # (sum of total_q,) int64: accumulator row of each packed output row
    slices: tuple[tuple[slice, tuple[Tile, ...]], ...]  # per-tile kernels: (batch rows, tiles) in order
    tile_q_dest: torch.Tensor  # per-tile kernels: accumulator row of each concatenated output row
    tile_k_dest: torch.Tensor  # per-tile kernels: key row of each concatenated dk/dv row


def _contiguous_slices(rows: tuple[int, ...] | None, batch: int) -> list[slice]:
    rows = tuple(range(batch)) if rows is None else rows
    slices, start = [], rows[0]
    for prev, cur in zip(rows, rows[1:]):
        if cur != prev + 1:
            slices.append(slice(start, prev + 1))
            start = cur
    slices.append(slice(start, rows[-1] + 1))
    return slices


class Plan:
    """Mask plan of a query buffer of ``q_len`` tokens per row on a key buffer of ``k_len``.

    ``groups``: the tiles of each group of rows with one document structure. An empty plan
    (nothing visible) is falsy and costs nothing.
    """

    def __init__(self, groups: tuple[RowTiles, ...], q_len: int, k_len: int):
        self.groups, self.q_len, self.k_len = groups, q_len, k_len
        self._index: dict[tuple, PlanIndex] = {}

    def __bool__(self) -> bool:
        return bool(self.groups)

    @property
    def num_tiles(self) -> int:
        """Tiles over the row groups (a group of rows shares its tiles)."""
        return sum(len(g.tiles) for g in self.groups)

    def pairs(self, batch: int = 1) -> int:
        """Visible (query, key) pairs per head, summed over the batch."""
        return sum((batch if g.rows is None else len(g.rows)) * sum(t.pairs for t in g.tiles) for g in self.groups)

    def index(self, batch: int, device: torch.device) -> PlanIndex:
        """Device-resident index tensors for a batch of ``batch`` rows (cached)."""
        key = (batch, device)
        if key not in self._index:
            self._index[key] = self._build_index(batch, device)
        return self._index[key]

    def _build_index(self, batch: int, device: torch.device) -> PlanIndex:
        sq, sk = self.q_len, self.k_len
        per_row = [(b, t) for g in self.groups for b in (range(batch) if g.rows is None else g.rows) for t in g.tiles]
        calls, dests = [], []
        for causal in (True, False):
            items = [(b, t) for b, t in per_row if t.causal == causal]
            if not items:
                continue
            q_rows = _spans([b * sq + t.q0 for b, t in items], [t.q1 - t.q0 for _, t in items])
            k_rows = _spans([b * sk + t.k0 for b, t in items], [t.k1 - t.k0 for _, t in items])
            lq = [t.q1 - t.q0 for _, t in items]
            lk = [t.k1 - t.k0 for _, t in items]
            host_q = tuple(torch.tensor([0] + lq).cumsum(0).tolist())
            host_k = tuple(torch.tensor([0] + lk).cumsum(0).tolist())
            seg = Segments(
                cu_q=to_device(torch.tensor(host_q, dtype=torch.int32), device),
                cu_k=to_device(torch.tensor(host_k, dtype=torch.int32), device),
                max_q=max(lq),
                max_k=max(lk),
                host_q=host_q,
                host_k=host_k,
            )
            calls.append(VarlenCall(causal, seg, to_device(q_rows, device), to_device(k_rows, device)))
            dests.append(q_rows)
        slices, tq, tk = [], [], []
        for g in self.groups:
            for rs in _contiguous_slices(g.rows, batch):
                slices.append((rs, g.tiles))
                for b in range(rs.start, rs.stop):  # output rows come row by row, tile after tile
                    tq += [(b * sq + t.q0, b * sq + t.q1) for t in g.tiles]
                    tk += [(b * sk + t.k0, b * sk + t.k1) for t in g.tiles]
        empty = torch.zeros(0, dtype=torch.int64)
        return PlanIndex(
            calls=tuple(calls),
            q_dest=to_device(torch.cat(dests) if dests else empty, device),
            slices=tuple(slices),
            tile_q_dest=to_device(_spans([a for a, _ in tq], [b - a for a, b in tq]), device),
            tile_k_dest=to_device(_spans([a for a, _ in tk], [b - a for a, b in tk]), device),
        )


def make_plan(layout: SequenceLayout, q_ranks, k_ranks, causal: bool) -> Plan:
    """Tiles for the query buffer ``cat(shards of q_ranks)`` on the key buffer ``cat(shards of k_ranks)``.

    ``None`` for either side means the whole row in natural order. Cached on the layout,
    so every layer of a microbatch reuses one plan (and its device indices).
    """
    q_ranks = None if q_ranks is None else tuple(q_ranks)
    k_ranks = None if k_ranks is None else tuple(k_ranks)

    def build() -> Plan:
        groups = []
        for rows in layout.row_groups():
            row = rows[0] if rows else None
            tiles = plan_tiles(layout.runs(q_ranks, row), layout.runs(k_ranks, row), causal)
            if tiles:
                groups.append(RowTiles(rows or None, tiles))
        n = lambda ranks: layout.seq_len if ranks is None else layout.local_len * len(ranks)  # noqa: E731
        return Plan(tuple(groups), n(q_ranks), n(k_ranks))

    return layout.memo(("plan", q_ranks, k_ranks, causal), build)


# ---------------------------------------------------------------------------- layouts
def token_major(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, S, E)`` -> ``(B*S, H, E)``; a view when ``x`` is a transposed ``(B, S, H, E)`` tensor."""
    b, h, s, e = x.shape
    return x.transpose(1, 2).reshape(b * s, h, e)


def head_major(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of :func:`token_major`: ``(B*S, H, E)`` -> ``(B, H, S, E)`` view."""
    n, h, e = x.shape
    return x.view(batch, n // batch, h, e).transpose(1, 2)


def lse_head_major(lse: torch.Tensor, batch: int) -> torch.Tensor:
    """``(H, B*S)`` -> ``(B, H, S)`` view."""
    h, n = lse.shape
    return lse.view(h, batch, n // batch).transpose(0, 1)


def new_accumulators(q_t: torch.Tensor):
    """fp32 token-major ``(out, lse)`` accumulators for ``q_t`` ``(N, H, E)``: zeros and ``-inf``."""
    n, h, e = q_t.shape
    out = torch.zeros(n, h, e, dtype=torch.float32, device=q_t.device)
    lse = torch.full((h, n), float("-inf"), dtype=torch.float32, device=q_t.device)
    return out, lse


# ---------------------------------------------------------------------------- forward / backward
def block_forward(
    q_t, k_t, v_t, batch: int, plan: Plan, kernel: AttentionKernel, scale: float, out_acc, lse_acc
) -> None:
    """Fold attention of ``q_t`` on ``(k_t, v_t)`` under ``plan`` into the fp32 accumulators, in place.

    Token-major shapes (module docstring); ``batch`` rows in each buffer.
    """
    if not plan:
        return
    idx = plan.index(batch, q_t.device)
    if kernel.native_varlen:
        outs, lses = [], []
        for call in idx.calls:
            out, lse = kernel.varlen_forward(
                q_t.index_select(0, call.q_rows),
                k_t.index_select(0, call.k_rows),
                v_t.index_select(0, call.k_rows),
                call.segments,
                call.causal,
                scale,
            )
            outs.append(out)
            lses.append(lse)
        out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses, dim=1))
        merge_segments_(out_acc, lse_acc, out, lse, idx.q_dest)
        return
    q, k, v = (head_major(x, batch) for x in (q_t, k_t, v_t))
    outs, lses = [], []
    for rs, tiles in idx.slices:
        o, s = [], []
        for t in tiles:
            out, lse = kernel.forward(
                q[rs, :, t.q0 : t.q1], k[rs, :, t.k0 : t.k1], v[rs, :, t.k0 : t.k1], t.causal, scale
            )
            o.append(out)
            s.append(lse)
        out, lse = (o[0], s[0]) if len(o) == 1 else (torch.cat(o, dim=2), torch.cat(s, dim=2))
        outs.append(token_major(out))
        lses.append(lse.transpose(0, 1).reshape(lse.shape[1], -1))
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses, dim=1))
    merge_segments_(out_acc, lse_acc, out, lse, idx.tile_q_dest)


def block_backward(
    dout_t,
    q_t,
    k_t,
    v_t,
    out_t,
    lse,
    batch: int,
    plan: Plan,
    kernel: AttentionKernel,
    scale: float,
    dq_acc,
    dk_acc,
    dv_acc,
) -> None:
    """Add this key buffer's share of the gradients to the fp32 token-major ``dq_acc, dk_acc, dv_acc``, in place.

    ``out_t`` and ``lse`` ``(H, B*Sq)`` are the final merged results for ``q_t`` (``out_t`` in the input dtype).
    """
    if not plan:
        return
    idx = plan.index(batch, q_t.device)
    if kernel.native_varlen:
        for call in idx.calls:
            qr, kr = call.q_rows, call.k_rows
            dq, dk, dv = kernel.varlen_backward(
                dout_t.index_select(0, qr),
                q_t.index_select(0, qr),
                k_t.index_select(0, kr),
                v_t.index_select(0, kr),
                out_t.index_select(0, qr),
                lse.index_select(1, qr),
                call.segments,
                call.causal,
                scale,
            )
            dq_acc.index_add_(0, qr, dq.to(dq_acc.dtype))
            dk_acc.index_add_(0, kr, dk.to(dk_acc.dtype))
            dv_acc.index_add_(0, kr, dv.to(dv_acc.dtype))
        return
    dout, q, k, v, out = (head_major(x, batch) for x in (dout_t, q_t, k_t, v_t, out_t))
    lse_b = lse_head_major(lse, batch)
    dqs, dks, dvs = [], [], []
    for rs, tiles in idx.slices:
        gq, gk, gv = [], [], []
        for t in tiles:
            qs, ks = slice(t.q0, t.q1), slice(t.k0, t.k1)
            dq, dk, dv = kernel.backward(
                dout[rs, :, qs],
                q[rs, :, qs],
                k[rs, :, ks],
                v[rs, :, ks],
                out[rs, :, qs],
                lse_b[rs, :, qs],
                t.causal,
                scale,
            )
            gq.append(dq)
            gk.append(dk)
            gv.append(dv)
        for grads, acc in ((gq, dqs), (gk, dks), (gv, dvs)):
            acc.append(token_major(grads[0] if len(grads) == 1 else torch.cat(grads, dim=2)))
    for grads, acc, dest in (
        (dqs, dq_acc, idx.tile_q_dest),
        (dks, dk_acc, idx.tile_k_dest),
        (dvs, dv_acc, idx.tile_k_dest),
    ):
        acc.index_add_(0, dest, (grads[0] if len(grads) == 1 else torch.cat(grads)).to(acc.dtype))


def plan_forward(q_t, k_t, v_t, batch: int, plan: Plan, kernel: AttentionKernel, scale: float):
    """``(out_t, lse)`` of ``q_t`` on one key buffer: out in the input dtype, lse ``(H, B*Sq)`` fp32."""
    out_acc, lse = new_accumulators(q_t)
    block_forward(q_t, k_t, v_t, batch, plan, kernel, scale, out_acc, lse)
    return out_acc.to(q_t.dtype), lse


def plan_backward(dout_t, q_t, k_t, v_t, out_t, lse, batch: int, plan: Plan, kernel: AttentionKernel, scale: float):
    """``(dq_t, dk_t, dv_t)`` in the input dtype for :func:`plan_forward`."""
    dq = torch.zeros(q_t.shape, dtype=torch.float32, device=q_t.device)
    dk = torch.zeros(k_t.shape, dtype=torch.float32, device=k_t.device)
    dv = torch.zeros(v_t.shape, dtype=torch.float32, device=v_t.device)
    block_backward(dout_t, q_t, k_t, v_t, out_t, lse, batch, plan, kernel, scale, dq, dk, dv)
    return dq.to(q_t.dtype), dk.to(k_t.dtype), dv.to(v_t.dtype)
