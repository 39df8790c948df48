"""Attention of a query buffer on one key buffer under a mask plan, folded into the results.

This is the arithmetic every strategy shares: the strategies decide *which* key buffer a rank
holds at each moment (its own, a compact slice another rank sent, a gathered one);
:func:`fold_forward` and :func:`fold_backward` compute its contribution for the plan's tiles
(:mod:`titan_cp.attention.mask_plans`). Token-major shapes::

    q, out, dout:  (B*Sq, H, E)       k, v: (B*Sk, K, E)       lse: (H, B*Sq) fp32

Host work per call is constant in the number of documents: the kernel gets one call per causal
flag, its rows read as views where they are consecutive, else with one gather per tensor.

Where its results go is planned once per microbatch over all the steps of a strategy
(:func:`make_folds`). A row that exactly one segment of one step reaches (a query of a document
whole on its rank) is *final*: the kernel's output and lse are written into the result, in the
input dtype, and never touch fp32. Only the other rows have fp32 accumulators, one slot each
(compact): the first segment reaching a row is written into its slot, the later ones merged
through their log-sum-exp, reading and writing only the slots they touch; at the end the slots
are written into the result. Each of these row updates is one operation, fused on CUDA
(:mod:`titan_cp.attention.fused`). The backward is the same plan: final rows' gradients are copied, the others added into
fp32 slots. Key rows alike (:class:`KeyFold`): a key row only its own rank's one segment reads
gets its gradient written once; rows read by several segments or other ranks accumulate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_cp.attention.fused import add_rows, merge_rows, write_rows
from titan_cp.attention.kernels import AttentionKernel
from titan_cp.attention.mask_plans import MaskPlan, PlanIndex, Rows
from titan_cp.attention.merge import apply_sinks_
from titan_cp.layout import to_device


@dataclass(frozen=True)
class Part:
    """Some of a step's packed rows (``src``; ``None``: all of them, in order) and their targets ``dst``."""

    src: Rows | None
    dst: torch.Tensor

    def take(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return x if self.src is None else self.src.take(x, dim)


@dataclass(frozen=True)
class StepFold:
    """Where one step's packed rows go: ``final`` rows of the result, ``first`` accumulator slots
    (written), ``merge`` slots (``Part`` of the distinct slots touched and each row's place among them)."""

    final: Part | None
    first: Part | None
    merge: tuple[Part, torch.Tensor] | None


@dataclass(frozen=True)
class Folds:
    """A strategy call's plan of where results go: one :class:`StepFold` per step for the forward,
    one ``(final, slots)`` pair of parts per step for the gradient (every non-final packed row with its
    slot); ``multi``: the result row of each fp32 accumulator slot (device)."""

    steps: tuple[StepFold, ...]
    grad: tuple[tuple[Part | None, Part | None], ...]
    multi: torch.Tensor

    @property
    def slots(self) -> int:
        return len(self.multi)


def _part(src: torch.Tensor, dst: torch.Tensor, n: int, device) -> Part | None:
    if not len(src):
        return None
    whole = len(src) == n  # every packed row, in order
    return Part(None if whole else Rows.of(src, device), to_device(dst, device))


def make_folds(dests: list[torch.Tensor], size: int, device: torch.device) -> Folds:
    """:class:`Folds` of steps whose packed rows go to result rows ``dests[s]`` (host int64) of ``size`` rows."""
    count = sum((torch.bincount(d, minlength=size) for d in dests), torch.zeros(size, dtype=torch.int64))
    single = count == 1
    slot = torch.cumsum(~single, 0) - 1  # accumulator slot of each multi row
    seen = torch.zeros(size, dtype=torch.bool)
    steps, grad = [], []
    for d in dests:
        here = torch.bincount(d, minlength=size)[d] if len(d) else d
        final = single[d]
        first = ~final & ~seen[d] & (here == 1)
        rest = ~final & ~first
        merge = None
        if rest.any():
            src = torch.nonzero(rest).flatten()
            slots, local = torch.unique(slot[d[src]], return_inverse=True)
            merge = (Part(Rows.of(src, device), to_device(slots, device)), to_device(local, device))
        f, fi, acc = (torch.nonzero(m).flatten() for m in (final, first, ~final))
        final_part = _part(f, d[f], len(d), device)
        steps.append(StepFold(final_part, _part(fi, slot[d[fi]], len(d), device), merge))
        grad.append((final_part, _part(acc, slot[d[acc]], len(d), device)))
        seen[d] = True
    return Folds(tuple(steps), tuple(grad), to_device(torch.nonzero(~single).flatten(), device))


@dataclass(frozen=True)
class KeyFold:
    """Where the packed key rows of each step's calls send their gradients: ``final`` rows of the key
    gradient (read once), or ``acc`` fp32 slots; ``slots`` in all, the first ``own`` of them the key
    buffer's own rows ``multi`` (the rest, if any, received rows whose gradients go back)."""

    steps: tuple[tuple[Part | None, Part | None], ...]
    multi: torch.Tensor
    own: int
    slots: int
    multi_rows: torch.Tensor  # ``multi`` on the host

    def slots_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The accumulator slots of own rows ``rows`` (host; each must be a multi row)."""
        slot = torch.full((int(self.multi_rows.max()) + 1 if len(self.multi_rows) else 0,), -1, dtype=torch.int64)
        slot[self.multi_rows] = torch.arange(len(self.multi_rows))
        out = slot[rows]
        assert bool((out >= 0).all()), "a row whose gradient arrives from another rank must have a slot"
        return out


def make_key_folds(
    dests: list[torch.Tensor], own: int, extra: list[torch.Tensor], device, received: int | None = None
) -> KeyFold:
    """Key folds: ``dests[s]`` the key rows of step ``s``'s packed keys, rows ``< own`` the own buffer's
    (final where read once overall), rows ``>= own`` received (always accumulated, in slots after the own
    multi rows; ``received`` of them, by default as many as the keys reach); ``extra``: own rows whose
    gradients also arrive from other ranks (always accumulated)."""
    count = torch.zeros(own, dtype=torch.int64)
    for d in dests:
        count += torch.bincount(d[d < own], minlength=own)
    for rows in extra:
        count[rows] += 2
    single = count == 1
    n_multi = int((~single).sum())
    slot_of = torch.zeros(own + 1, dtype=torch.int64)  # one padding entry, looked up by received rows
    slot_of[:own][~single] = torch.arange(n_multi)
    single = torch.cat([single, torch.zeros(1, dtype=torch.bool)])
    steps, reached = [], 0
    for d in dests:
        mine = d < own
        lookup = torch.where(mine, d, torch.full_like(d, own))
        slot = torch.where(mine, slot_of[lookup], n_multi + d - own)
        to_final = single[lookup]
        f, a = torch.nonzero(to_final).flatten(), torch.nonzero(~to_final).flatten()
        steps.append((_part(f, d[f], len(d), device), _part(a, slot[a], len(d), device)))
        if len(d) and int(d.max()) >= own:
            reached = max(reached, int(d.max()) + 1 - own)
    multi = torch.nonzero(~single[:own]).flatten()
    received = reached if received is None else received
    return KeyFold(tuple(steps), to_device(multi, device), n_multi, n_multi + received, multi)


# ---------------------------------------------------------------------------- results
class Results:
    """The forward's results being built: ``out`` (input dtype) and ``lse`` (fp32) of every row, and
    fp32 accumulators for the rows several segments reach (slots of :class:`Folds`)."""

    def __init__(self, q_t: torch.Tensor, folds: Folds):
        n, h, e = q_t.shape
        self.folds = folds
        self.out = q_t.new_empty((n, h, e))
        self.lse = torch.empty((h, n), dtype=torch.float32, device=q_t.device)
        self.acc_out = torch.zeros(folds.slots, h, e, dtype=torch.float32, device=q_t.device)
        self.acc_lse = torch.full((h, folds.slots), float("-inf"), dtype=torch.float32, device=q_t.device)

    def fold(self, step: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fold step ``step``'s packed ``(out, lse)`` in (see the module docstring)."""
        f = self.folds.steps[step]
        if f.final is not None:
            self.out.index_copy_(0, f.final.dst, f.final.take(out))
            self.lse.index_copy_(1, f.final.dst, f.final.take(lse, 1))
        if f.first is not None:
            write_rows(self.acc_out, f.first.dst, f.first.take(out))
            self.acc_lse.index_copy_(1, f.first.dst, f.first.take(lse, 1))
        if f.merge is not None:
            part, local = f.merge
            merge_rows(self.acc_out, self.acc_lse, part.take(out), part.take(lse, 1), part.dst, local)

    def finish(self, sinks=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of every row: the accumulated rows written in, then the sinks folded in."""
        if self.folds.slots:
            write_rows(self.out, self.folds.multi, self.acc_out)
            self.lse.index_copy_(1, self.folds.multi, self.acc_lse)
        if sinks is not None:
            out = self.out.float()
            apply_sinks_(out, self.lse, sinks)
            self.out.copy_(out)
        return self.out, self.lse


class Grads:
    """A gradient being built: ``final`` rows copied once (input dtype), the others added into fp32 slots."""

    def __init__(self, like: torch.Tensor, multi: torch.Tensor, slots: int):
        self.final = like.new_empty(like.shape)
        self.multi = multi
        self.acc = torch.zeros((slots,) + tuple(like.shape[1:]), dtype=torch.float32, device=like.device)

    def add(self, parts: tuple[Part | None, Part | None], grad: torch.Tensor) -> None:
        final, acc = parts
        if final is not None:
            self.final.index_copy_(0, final.dst, final.take(grad))
        if acc is not None:
            add_rows(self.acc, acc.dst, acc.take(grad))

    def finish(self) -> torch.Tensor:
        if len(self.multi):
            write_rows(self.final, self.multi, self.acc[: len(self.multi)])
        return self.final


# ---------------------------------------------------------------------------- one key buffer
def attend(q_t, k_t, v_t, idx: PlanIndex, kernel: AttentionKernel, scale: float):
    """Packed ``(out, lse)`` of the plan's calls on one key buffer (calls in order), or ``None``."""
    outs, lses = [], []
    for call in idx.calls:
        out, lse = kernel.varlen_forward(
            call.q_rows.take(q_t), call.k_rows.take(k_t), call.k_rows.take(v_t), call.segments, call.causal, scale
        )
        outs.append(out)
        lses.append(lse)
    if not outs:
        return None
    return (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses, dim=1))


def fold_forward(q_t, k_t, v_t, idx: PlanIndex, kernel: AttentionKernel, scale: float, results: Results, step: int):
    """Fold attention of ``q_t`` on ``(k_t, v_t)`` under a plan's ``idx`` into ``results`` as step ``step``."""
    packed = attend(q_t, k_t, v_t, idx, kernel, scale)
    if packed is not None:
        results.fold(step, *packed)


def attend_backward(dout_t, q_t, k_t, v_t, out_t, lse, idx: PlanIndex, kernel: AttentionKernel, scale: float):
    """Packed ``(dq, dk, dv)`` of the plan's calls (calls in order, like :meth:`MaskPlan.q_dest` and
    :meth:`~titan_cp.attention.mask_plans.MaskPlan.k_dest`), or ``None``. ``out_t, lse`` are the final results."""
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
            )
        )
    if not grads:
        return None
    return grads[0] if len(grads) == 1 else tuple(torch.cat(g) for g in zip(*grads))


# ---------------------------------------------------------------------------- one key buffer, whole
def single_step(plan: MaskPlan, batch: int, device: torch.device, key_size: int | None = None, key_map=None):
    """A plan run alone: its index, query folds and key folds (cached with the plan)."""

    def build():
        index = plan.index(batch, device, key_map)
        folds = make_folds([plan.q_dest(batch)], batch * plan.q_len, device)
        k_rows = plan.k_dest(batch, None if key_map is None else key_map[1])
        size = batch * plan.k_len if key_size is None else key_size
        return index, folds, make_key_folds([k_rows], size, [], device)

    name = None if key_map is None else key_map[0]
    return plan._memo(("single", batch, torch.device(device), key_size, name), build)


def plan_forward(q_t, k_t, v_t, batch: int, plan: MaskPlan, kernel: AttentionKernel, scale: float, sinks=None):
    """``(out_t, lse)`` of ``q_t`` on one key buffer: out in the input dtype, lse ``(H, B*Sq)`` fp32."""
    index, folds, _ = single_step(plan, batch, q_t.device)
    results = Results(q_t, folds)
    fold_forward(q_t, k_t, v_t, index, kernel, scale, results, 0)
    return results.finish(sinks)


def plan_backward(dout_t, q_t, k_t, v_t, out_t, lse, batch: int, plan: MaskPlan, kernel: AttentionKernel, scale):
    """``(dq_t, dk_t, dv_t)`` in the input dtype for :func:`plan_forward`."""
    index, folds, key_folds = single_step(plan, batch, q_t.device)
    dq = Grads(q_t, folds.multi, folds.slots)
    dk, dv = Grads(k_t, key_folds.multi, key_folds.slots), Grads(v_t, key_folds.multi, key_folds.slots)
    packed = attend_backward(dout_t, q_t, k_t, v_t, out_t, lse, index, kernel, scale)
    if packed is not None:
        dq.add(folds.grad[0], packed[0])
        dk.add(key_folds.steps[0], packed[1])
        dv.add(key_folds.steps[0], packed[2])
    return dq.finish(), dk.finish(), dv.finish()
