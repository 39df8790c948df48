"""Attention of a query buffer on one key buffer under a mask plan, folded into fp32 accumulators.

This is the arithmetic every strategy shares: the strategies decide *which* key buffer a rank
holds at each moment (its own, a compact slice another rank sent, a gathered one);
:func:`fold_forward` and :func:`fold_backward` compute its contribution for the plan's tiles
(:mod:`titan_cp.attention.plans`). Token-major shapes::

    q, out, dout:  (B*Sq, H, E)       k, v: (B*Sk, K, E)       lse: (H, B*Sq) fp32

Host work per call is constant in the number of documents: the kernel gets one call per causal
flag, its rows packed with one gather per tensor. Its results enter the accumulators by a
:class:`Fold`, planned once per microbatch: a row that this step's plan reaches through one
segment and no earlier step touched is *written* (one ``index_copy_``: a whole document on its
own rank is never merged at all); the other rows are *merged* through their log-sum-exp, the
accumulator rows they touch read and written once (:func:`~titan_cp.attention.merge.merge_rows_`).
The backward scatter-adds each gradient with one ``index_add_``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_cp.attention.kernels import AttentionKernel
from titan_cp.attention.merge import apply_sinks_, merge_rows_
from titan_cp.attention.plans import MaskPlan, PlanIndex
from titan_cp.layout import to_device


@dataclass(frozen=True)
class Fold:
    """How one step's packed results enter the accumulators (device index tensors).

    ``write``: ``(packed rows or None for all of them in order, accumulator rows)`` written straight in;
    ``merge``: ``(packed rows, distinct accumulator rows touched, place of each packed row among them)``.
    """

    write: tuple[torch.Tensor | None, torch.Tensor] | None
    merge: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def make_fold(q_dest: torch.Tensor, seen: torch.Tensor, device: torch.device) -> Fold:
    """The :class:`Fold` of a step whose packed rows go to accumulator rows ``q_dest`` (host int64),
    ``seen`` (host bool over the accumulator rows) marking rows earlier steps wrote; updates ``seen``."""
    if not len(q_dest):
        return Fold(None, None)
    count = torch.bincount(q_dest, minlength=len(seen))
    fresh = (count[q_dest] == 1) & ~seen[q_dest]
    write = merge = None
    if fresh.any():
        src = torch.nonzero(fresh).flatten()
        everything = bool(fresh.all())
        write = (None if everything else to_device(src, device), to_device(q_dest[src], device))
    if not fresh.all():
        src = torch.nonzero(~fresh).flatten()
        rows, local = torch.unique(q_dest[src], return_inverse=True)
        merge = (to_device(src, device), to_device(rows, device), to_device(local, device))
    seen[q_dest] = True
    return Fold(write, merge)


def new_accumulators(q_t: torch.Tensor):
    """fp32 token-major ``(out, lse)`` accumulators for ``q_t`` ``(N, H, E)``: zeros and ``-inf``."""
    n, h, e = q_t.shape
    out = torch.zeros(n, h, e, dtype=torch.float32, device=q_t.device)
    lse = torch.full((h, n), float("-inf"), dtype=torch.float32, device=q_t.device)
    return out, lse


def _attend(q_t, k_t, v_t, idx: PlanIndex, kernel: AttentionKernel, scale: float):
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
    return (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses, dim=1))


def fold_forward(
    q_t, k_t, v_t, idx: PlanIndex, fold: Fold, kernel: AttentionKernel, scale: float, out_acc, lse_acc
) -> None:
    """Fold attention of ``q_t`` on ``(k_t, v_t)`` under a plan's ``idx`` into the fp32 accumulators, in place."""
    if not idx.calls:
        return
    out, lse = _attend(q_t, k_t, v_t, idx, kernel, scale)
    if fold.write is not None:
        src, dst = fold.write
        o, s = (out, lse) if src is None else (out.index_select(0, src), lse.index_select(1, src))
        out_acc.index_copy_(0, dst, o.float())
        lse_acc.index_copy_(1, dst, s.float())
    if fold.merge is not None:
        src, rows, local = fold.merge
        merge_rows_(out_acc, lse_acc, out.index_select(0, src), lse.index_select(1, src), rows, local)


def fold_backward(
    dout_t, q_t, k_t, v_t, out_t, lse, idx: PlanIndex, kernel: AttentionKernel, scale: float, dq_acc, dk_acc, dv_acc
) -> None:
    """Add this key buffer's share of the gradients to the fp32 token-major ``dq_acc, dk_acc, dv_acc``, in place.

    ``out_t`` and ``lse`` ``(H, B*Sq)`` are the final results for ``q_t`` (``out_t`` in the input dtype).
    """
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


# ---------------------------------------------------------------------------- one key buffer, whole
def single_step(plan: MaskPlan, batch: int, device: torch.device) -> tuple[PlanIndex, Fold]:
    """A plan run alone on empty accumulators: its index and fold (cached with the plan)."""

    def build():
        seen = torch.zeros(batch * plan.q_len, dtype=torch.bool)
        return plan.index(batch, device), make_fold(plan.q_dest(batch), seen, device)

    return plan._memo(("single", batch, torch.device(device)), build)


def plan_forward(q_t, k_t, v_t, batch: int, plan: MaskPlan, kernel: AttentionKernel, scale: float, sinks=None):
    """``(out_t, lse)`` of ``q_t`` on one key buffer: out in the input dtype, lse ``(H, B*Sq)`` fp32."""
    index, fold = single_step(plan, batch, q_t.device)
    out_acc, lse = new_accumulators(q_t)
    fold_forward(q_t, k_t, v_t, index, fold, kernel, scale, out_acc, lse)
    if sinks is not None:
        apply_sinks_(out_acc, lse, sinks)
    return out_acc.to(q_t.dtype), lse


def plan_backward(dout_t, q_t, k_t, v_t, out_t, lse, batch: int, plan: MaskPlan, kernel: AttentionKernel, scale):
    """``(dq_t, dk_t, dv_t)`` in the input dtype for :func:`plan_forward`."""
    index, _ = single_step(plan, batch, q_t.device)
    dq = torch.zeros(q_t.shape, dtype=torch.float32, device=q_t.device)
    dk = torch.zeros(k_t.shape, dtype=torch.float32, device=k_t.device)
    dv = torch.zeros(v_t.shape, dtype=torch.float32, device=v_t.device)
    fold_backward(dout_t, q_t, k_t, v_t, out_t, lse, index, kernel, scale, dq, dk, dv)
    return dq.to(q_t.dtype), dk.to(k_t.dtype), dv.to(v_t.dtype)
