"""Attention of a query buffer on one key buffer under its mask's tiles, folded into the results.

This is the arithmetic every strategy shares: the strategies decide *which* key buffer a rank
holds at each moment (its own, a compact slice another rank sent, a gathered one);
:func:`fold_forward` and :func:`fold_backward` compute its contribution for those tiles
(:mod:`titan_cp.attention.tiling`). Token-major shapes::

    q: (B*Sq, H, E)     out, dout: (B*Sq, H, Ev)     k: (B*Sk, K, E)     v: (B*Sk, K, Ev)     lse: (H, B*Sq) fp32

(``Ev``: v's head dim, which may differ from q/k's ``E``: multi-head latent attention)

Host work per call is constant in the number of documents: the kernel gets one call per causal
flag, its rows read as views where they are consecutive, else with one gather per tensor.

Where its results go is worked out once per microbatch over all the steps of a strategy
(:func:`make_folds`). A row that exactly one segment of one step reaches (a query of a document
whole on its rank) is *final*: the kernel's output and lse are written into the result, in the
input dtype, and never touch fp32. The other rows merge: the steps are taken in *groups* of
consecutive steps, as large as hold at most a quarter of the query buffer more than a merge per
step held (one step's output and an fp32 slot for every merged row); the group's packed
partials are kept until its last step and merged then in one operation (fused on CUDA,
:mod:`titan_cp.attention.fused`), each row read once per partial and written once: straight into
the result where the group brings a row's last contributions, else into an fp32 accumulator slot
(only rows reached again in a later group have one), which the later group reads back. Where every
step fits one group (a document split over few ranks) nothing is accumulated in fp32 at all: a
merged row costs a read of each partial and one write, where a merge per step read and wrote an
fp32 row each time. Every gradient takes the same route (:class:`Grads`): the queries', and the keys'
(the packed key rows of each call; what peers send back of the rows they read is one more partial,
at the step it returns): a key row only one segment reads gets its gradient copied once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from titan_cp.attention.fused import add_into, merge_into, write_rows
from titan_cp.attention.kernels import AttentionKernel
from titan_cp.attention.merge import apply_sinks_
from titan_cp.attention.tiling import MaskTiles, Rows, TileIndex
from titan_cp.layout import to_device


@dataclass(frozen=True)
class Part:
    """Some of a step's packed rows (``src``; ``None``: all of them, in order) and their targets ``dst``."""

    src: Rows | None
    dst: torch.Tensor

    def take(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return x if self.src is None else self.src.take(x, dim)


@dataclass(frozen=True)
class Flush:
    """One merge at the end of a group of steps (module docstring): rows ``dst`` (device) of the result
    (``to_acc`` false: the group brings their last contributions) or fp32 accumulator slots (true: later
    groups reach them again); ``prior``: each row's slot holding an earlier group's partial (-1: none;
    ``None``: no row has one); ``lanes``: ``(step, call, src, place)`` per kernel call of the group, its
    packed rows ``src`` merged into place ``place`` among ``dst`` (device int64)."""

    to_acc: bool
    dst: torch.Tensor
    prior: torch.Tensor | None
    lanes: tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...]

    def inputs(self, pending: dict) -> tuple[list, list, list]:
        """``(tensors, srcs, places)`` of the lanes, ``pending[(step, call)]`` each call's packed tensor."""
        return [pending[(s, c)] for s, c, _, _ in self.lanes], [x[2] for x in self.lanes], [x[3] for x in self.lanes]


@dataclass(frozen=True)
class Folds:
    """A strategy call's map of where query results go (module docstring): per step, per kernel call,
    the ``final`` rows written straight into the result (a :class:`Part`, or ``None``) and whether the
    call's packed rows are ``kept`` for a merge; per step, the :class:`Flush` es run after it (its group's
    last step); ``slots``: the fp32 accumulator rows; ``adopt``: the ``(step, call)`` whose packed rows are
    the whole buffer in order (its output *is* the result: nothing copied), or ``None``; ``unseen``: rows
    no call reaches (device; ``None``: none), which see no key (output and gradient 0, lse -inf)."""

    final: tuple[tuple[Part | None, ...], ...]
    kept: tuple[tuple[bool, ...], ...]
    flushes: tuple[tuple[Flush, ...], ...]
    slots: int
    adopt: tuple[int, int] | None = None
    unseen: torch.Tensor | None = None
    peak_rows: int = 0  # the most rows held at once: kept partials, and two for each fp32 slot


def _part(src: torch.Tensor, dst: torch.Tensor, n: int, device) -> Part | None:
    if not len(src):
        return None
    whole = len(src) == n  # every packed row, in order
    return Part(None if whole else Rows.of(src, device), to_device(dst, device))


def _is_whole(d: torch.Tensor, size: int) -> bool:
    """Whether packed rows ``d`` are rows ``0 .. size-1`` in order."""
    return len(d) == size and bool((d == torch.arange(size)).all())


def _whole_call(dests: list[list[torch.Tensor]], size: int) -> tuple[int, int] | None:
    return next(((s, c) for s, ds in enumerate(dests) for c, d in enumerate(ds) if _is_whole(d, size)), None)


def _at(mask: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``mask`` at rows ``d`` (host), false where ``d`` is -1 (a packed row whose result goes elsewhere)."""
    if not len(mask):
        return torch.zeros(d.shape, dtype=torch.bool)
    return mask[d.clamp(min=0)] & (d >= 0)


def _groups(held_rows: list[int], budget: int) -> list[list[int]]:
    """Consecutive steps in groups of at most ``budget`` held packed rows (a step alone may exceed it);
    a group's merges run after its last step that has a kernel call (a strategy skips the others)."""
    groups: list[list[int]] = []
    held = 0
    for s, n in enumerate(held_rows):
        if not groups or held + n > budget:
            groups.append([])
            held = 0
        groups[-1].append(s)
        held += n
    return groups


def _flush(dests, group: list[int], gi: int, sel, first, slot, size: int, to_acc: bool, device) -> Flush:
    """The :class:`Flush` of group ``gi`` (steps ``group``) into rows ``sel`` (host)."""
    place_of = torch.full((size,), -1, dtype=torch.int64)
    place_of[sel] = torch.arange(len(sel))
    lanes = []
    for s in group:
        for c, d in enumerate(dests[s]):
            keep = torch.nonzero(_at(place_of >= 0, d)).flatten()
            if len(keep):
                lanes.append((s, c, to_device(keep, device), to_device(place_of[d[keep]], device)))
    prior = torch.where(first[sel] < gi, slot[sel], -1)
    dst = slot[sel] if to_acc else sel
    return Flush(to_acc, to_device(dst, device), to_device(prior, device) if (prior >= 0).any() else None, tuple(lanes))


def _reach(dests, groups, single, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and last group reaching each row that merges (host)."""
    first = torch.full((size,), len(groups), dtype=torch.int64)
    last = torch.full((size,), -1, dtype=torch.int64)
    for gi, group in enumerate(groups):
        for d in (d for s in group for d in dests[s]):
            rows = d[_at(~single, d)]
            first[rows] = torch.minimum(first[rows], torch.tensor(gi))
            last[rows] = gi
    return first, last


HELD_EXTRA = 0.25  # the rows a group may hold beyond a merge per step's, as a share of the query buffer


def _fold_groups(dests, single, count, size: int, budget: int | None):
    """``(groups, first, last, again, peak)``: the largest groups whose memory stays within a merge per
    step's and :data:`HELD_EXTRA`.

    A group holds its kept calls' packed outputs (every row of each; the adopted call's output is the
    result, nothing more) and the fp32 slots of the rows a later group reaches again (two rows' bytes
    each); a merge per step held one step's output and a slot for every row that merges. Budgets (packed
    rows a group holds) are tried from all steps at once down to one step a group (never more than a
    merge per step), and the first whose ``peak`` (in rows) is at most :data:`HELD_EXTRA` of the buffer
    above a merge per step's is kept; ``budget``: that one."""
    adopt = _whole_call(dests, size)  # that call's output is the result itself: it costs nothing held

    def rows(s: int, c: int, d: torch.Tensor) -> int:
        return 0 if (s, c) == adopt else len(d)

    held = [sum(rows(s, c, d) for c, d in enumerate(ds) if _at(~single, d).any()) for s, ds in enumerate(dests)]
    step_out = max((sum(rows(s, c, d) for c, d in enumerate(ds)) for s, ds in enumerate(dests)), default=0)
    old_peak = 2 * int(((~single) & (count > 0)).sum()) + step_out
    for b in [budget] if budget is not None else [sum(held), 4 * size, 2 * size, size, size // 2, 1]:
        groups = _groups(held, max(1, b))
        first, last = _reach(dests, groups, single, size)
        again = (~single) & (count > 0) & (first < last)  # rows a later group reaches again: a slot each
        peak = 2 * int(again.sum()) + max(sum(held[s] for s in g) for g in groups)
        if peak <= old_peak + HELD_EXTRA * size:
            break
    return groups, first, last, again, peak


def make_folds(dests: list[list[torch.Tensor]], size: int, device: torch.device, budget: int | None = None) -> Folds:
    """:class:`Folds` of steps whose calls' packed rows go to result rows ``dests[s][c]`` (host int64; -1: a
    packed row whose result goes elsewhere) of ``size`` rows; a group of steps holds at most ``budget``
    packed rows of its kept calls (by default as many as :func:`_fold_groups` allows)."""
    count = torch.zeros(size, dtype=torch.int64)
    for d in (d for ds in dests for d in ds):
        count += torch.bincount(d[d >= 0], minlength=size)
    single = count == 1
    groups, first, last, again, peak = _fold_groups(dests, single, count, size, budget)
    slot = torch.full((size,), -1, dtype=torch.int64)
    slot[again] = torch.arange(int(again.sum()))
    flushes: list[tuple[Flush, ...]] = [() for _ in dests]
    for gi, group in enumerate(groups):
        reached = [d[_at(~single, d)] for s in group for d in dests[s]]
        touched = torch.unique(torch.cat(reached)) if reached else torch.zeros(0, dtype=torch.int64)
        parts = [touched[(last[touched] > gi) == to_acc] for to_acc in (False, True)]
        end = max((s for s in group if dests[s]), default=group[-1])  # a step with no call may be skipped
        flushes[end] = tuple(
            _flush(dests, group, gi, sel, first, slot, size, to_acc, device)
            for sel, to_acc in zip(parts, (False, True))
            if len(sel)
        )
    final = tuple(
        tuple(_part(f, d[f], len(d), device) for d in ds for f in [torch.nonzero(_at(single, d)).flatten()])
        for ds in dests
    )
    kept = tuple(tuple(bool(_at(~single, d).any()) for d in ds) for ds in dests)
    unseen = torch.nonzero(count == 0).flatten()
    unseen_rows = to_device(unseen, device) if len(unseen) else None
    return Folds(final, kept, tuple(flushes), int(again.sum()), _whole_call(dests, size), unseen_rows, peak)


# ---------------------------------------------------------------------------- results
def _adoptable(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether a kernel's packed output can serve as the result buffer itself (dense, of ``shape`` and
    ``dtype``)."""
    return out.is_contiguous() and tuple(out.shape) == shape and out.dtype == dtype


class Results:
    """The forward's results being built: ``out`` (input dtype) and ``lse`` (fp32) of every row, and the
    fp32 accumulator slots of :class:`Folds`. Where one call's packed rows are the whole buffer in order
    (``folds.adopt``), its output is taken as the result. ``out`` is ``(B*Sq, H, v_dim)``: v's head dim
    (``None``: q's)."""

    def __init__(self, q_t: torch.Tensor, folds: Folds, v_dim: int | None = None) -> None:
        n, h, e = q_t.shape
        e = e if v_dim is None else v_dim
        self.folds, self._q, self._shape = folds, q_t, (n, h, e)
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self.acc_out = torch.empty(folds.slots, h, e, dtype=torch.float32, device=q_t.device)
        self.acc_lse = torch.empty((h, folds.slots), dtype=torch.float32, device=q_t.device)
        self._pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _alloc(self) -> tuple[Tensor, Tensor]:
        """``(out, lse)``, allocated on first use (the two are always set together)."""
        if self.out is None or self.lse is None:
            n, h, _ = self._shape
            self.out = self._q.new_empty(self._shape)
            self.lse = torch.empty((h, n), dtype=torch.float32, device=self._q.device)
        return self.out, self.lse

    def fold(self, step: int, packed: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fold step ``step``'s packed ``(out, lse)`` of each call in (see the module docstring)."""
        for c, (final, (out, lse)) in enumerate(zip(self.folds.final[step], packed)):
            if self.folds.adopt == (step, c) and self.out is None and _adoptable(out, self._shape, self._q.dtype):
                self.out, self.lse = out, lse.contiguous()
            elif final is not None:
                res_out, res_lse = self._alloc()
                res_out.index_copy_(0, final.dst, final.take(out))
                res_lse.index_copy_(1, final.dst, final.take(lse, 1))
            if self.folds.kept[step][c]:
                self._pending[(step, c)] = (out, lse)
        for flush in self.folds.flushes[step]:
            pairs, srcs, places = flush.inputs(self._pending)
            outs, lses = [p[0] for p in pairs], [p[1] for p in pairs]
            if flush.to_acc:  # an earlier partial of a row is in its own slot
                merge_into(self.acc_out, self.acc_lse, flush.dst, None, None, flush.prior, outs, lses, srcs, places)
            else:
                res_out, res_lse = self._alloc()
                acc = (self.acc_out, self.acc_lse)
                merge_into(res_out, res_lse, flush.dst, *acc, flush.prior, outs, lses, srcs, places)
        if self.folds.flushes[step]:
            self._pending.clear()

    def finish(self, sinks: Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of every row, the sinks folded in."""
        res_out, res_lse = self._alloc()
        if self.folds.unseen is not None:
            res_out.index_fill_(0, self.folds.unseen, 0.0)
            res_lse.index_fill_(1, self.folds.unseen, float("-inf"))
        if sinks is not None:
            out = res_out.float()
            apply_sinks_(out, res_lse, sinks)
            res_out.copy_(out)
        return res_out, res_lse


class Grads:
    """A gradient being built on the map of :class:`Folds` (module docstring; the queries', or the keys' of
    one all-gather step), into ``out`` if given (e.g. an fp32 buffer to send), in ``dtype`` (by default
    ``like``'s): final rows copied
    once (input dtype), the others summed per group of steps, straight into the result where the group
    brings their last contributions; the ``adopt`` call's packed gradient is taken as the result."""

    def __init__(
        self, like: torch.Tensor, folds: Folds, out: torch.Tensor | None = None, dtype: torch.dtype | None = None
    ) -> None:
        self.like, self.folds, self.dtype = like, folds, dtype or like.dtype
        self.final: torch.Tensor | None = out  # where to write the gradient (``None``: a new tensor or adopted)
        self.acc = torch.empty((folds.slots,) + tuple(like.shape[1:]), dtype=torch.float32, device=like.device)
        self._pending: dict[tuple[int, int], torch.Tensor] = {}

    def add(self, step: int, grads: list[torch.Tensor]) -> None:
        """Step ``step``'s packed gradient of each call in."""
        for c, (final, grad) in enumerate(zip(self.folds.final[step], grads)):
            if (
                self.folds.adopt == (step, c)
                and self.final is None
                and _adoptable(grad, tuple(self.like.shape), self.dtype)
            ):
                self.final = grad
            elif final is not None:
                dest = self._alloc()
                rows = final.take(grad)
                if rows.dtype == dest.dtype:
                    dest.index_copy_(0, final.dst, rows)
                else:  # an fp32 buffer of gradients to send: converted as they are written
                    write_rows(dest, final.dst, rows)
            if self.folds.kept[step][c]:
                self._pending[(step, c)] = grad
        for flush in self.folds.flushes[step]:
            tensors, srcs, places = flush.inputs(self._pending)
            if flush.to_acc:
                add_into(self.acc, flush.dst, None, flush.prior, tensors, srcs, places)
            else:
                add_into(self._alloc(), flush.dst, self.acc, flush.prior, tensors, srcs, places)
        if self.folds.flushes[step]:
            self._pending.clear()

    @classmethod
    def summed(
        cls,
        like: torch.Tensor,
        folds: Folds,
        grads: list[Tensor],
        out: Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The gradient of a one-step map: its calls' packed ``grads`` summed, finished."""
        g = cls(like, folds, out, dtype)
        g.add(0, grads)
        return g.finish()

    def _alloc(self) -> Tensor:
        """The gradient being written, allocated on first use."""
        if self.final is None:
            self.final = self.like.new_empty(self.like.shape, dtype=self.dtype)
        return self.final

    def finish(self) -> torch.Tensor:
        """The gradient of every row (rows no call reaches: 0)."""
        final = self._alloc()
        if self.folds.unseen is not None:
            final.index_fill_(0, self.folds.unseen, 0.0)
        return final


# ---------------------------------------------------------------------------- one key buffer
def attend(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, idx: TileIndex, kernel: AttentionKernel, scale: float
) -> list[tuple[Tensor, Tensor]]:
    """Packed ``(out, lse)`` of each of the tiles' calls, in order."""
    return [
        kernel.varlen_forward(
            call.q_rows.take(q_t),
            call.k_rows.take(k_t),
            call.k_rows.take(v_t),
            call.segments,
            call.causal,
            scale,
            **_window(call),
        )
        for call in idx.calls
    ]


def _window(call: Any) -> dict[str, int]:
    """The window keyword of a call whose tiles the kernel windows itself (none otherwise: every kernel
    takes the plain call)."""
    return {} if call.window is None else {"window": call.window}


def fold_forward(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    idx: TileIndex,
    kernel: AttentionKernel,
    scale: float,
    results: Results,
    step: int,
) -> None:
    """Fold attention of ``q_t`` on ``(k_t, v_t)`` under the tiles' ``idx`` into ``results`` as step ``step``."""
    results.fold(step, attend(q_t, k_t, v_t, idx, kernel, scale))


def attend_backward(
    dout_t: Tensor,
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    out_t: Tensor,
    lse: Tensor,
    idx: TileIndex,
    kernel: AttentionKernel,
    scale: float,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Packed ``(dq, dk, dv)`` of each of the tiles' calls, in order (like :meth:`MaskTiles.q_dest` and
    :meth:`~titan_cp.attention.tiling.MaskTiles.k_dest`), as three lists. ``out_t, lse`` are the final results."""
    grads = []
    for call in idx.calls:
        qr, kr = call.q_rows, call.k_rows
        grads.append(
            kernel.varlen_backward(
                qr.take(dout_t),
                qr.take(q_t),
                kr.take(k_t),
                kr.take(v_t),
                qr.take(out_t),
                qr.take(lse, 1),
                call.segments,
                call.causal,
                scale,
                **_window(call),
            )
        )
    if not grads:
        return [], [], []
    dqs, dks, dvs = (list(g) for g in zip(*grads))
    return dqs, dks, dvs


# ---------------------------------------------------------------------------- one key buffer, whole
def single_step(
    tiles: MaskTiles,
    batch: int,
    device: torch.device,
    key_size: int | None = None,
    key_map: tuple[object, Tensor] | None = None,
) -> tuple[TileIndex, Folds, Folds]:
    """Tiles run alone: their index, query folds and key folds (cached with the tiles); ``key_map``: a name
    and, for each row of the full key buffer, its place among the rows held (-1: not held)."""

    def build() -> tuple[TileIndex, Folds, Folds]:
        index = tiles.index(batch, device, key_map)
        folds = make_folds([tiles.q_dest(batch)], batch * tiles.q_len, device)
        k_rows = tiles.k_dest(batch, None if key_map is None else key_map[1])
        size = batch * tiles.k_len if key_size is None else key_size
        return index, folds, make_folds([k_rows], size, device)

    name = None if key_map is None else key_map[0]
    return tiles._memo(("single", batch, torch.device(device), key_size, name), build)


def tiles_forward(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    batch: int,
    tiles: MaskTiles,
    kernel: AttentionKernel,
    scale: float,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out_t, lse)`` of ``q_t`` on one key buffer: out ``(B*Sq, H, v_dim)`` in the input dtype, lse
    ``(H, B*Sq)`` fp32."""
    index, folds, _ = single_step(tiles, batch, q_t.device)
    results = Results(q_t, folds, v_t.shape[-1])
    fold_forward(q_t, k_t, v_t, index, kernel, scale, results, 0)
    return results.finish(sinks)


def tiles_backward(
    dout_t: Tensor,
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    out_t: Tensor,
    lse: Tensor,
    batch: int,
    tiles: MaskTiles,
    kernel: AttentionKernel,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq_t, dk_t, dv_t)`` in the input dtype for :func:`tiles_forward`."""
    index, folds, key_folds = single_step(tiles, batch, q_t.device)
    dqs, dks, dvs = attend_backward(dout_t, q_t, k_t, v_t, out_t, lse, index, kernel, scale)
    return Grads.summed(q_t, folds, dqs), Grads.summed(k_t, key_folds, dks), Grads.summed(v_t, key_folds, dvs)
