"""All-gather attention (the Llama 3 recipe): every rank gets the K/V it can see, attends its local queries.

Each rank ``j`` exports ``E_j``, the rows of its K/V that some query of another rank can see
(from the layout and the mask, known to every rank, so no size is exchanged), and one
collective hands every rank every other rank's exported rows (an all-to-all with uneven
sizes: what an all-gather of the ``E_j`` gives, without padding). K/V travel at their own head
count (GQA is never expanded before the collective). The key buffer is the rank's own K/V
followed by the received rows, the collective writing straight into it; one plan (the local
queries on the whole row) reads it::

    keys       = [kv_local, gather_j!=r kv_j[E_j]]             (N-1) * |E_r| rows out of each rank
    forward    out_r = attn(q_r, keys)
    backward   dkv_local[E_r] += the dual collective of dkeys[received]  (fp32, each peer's share)
               dkv_local      += dkeys[own part];  dq_r = dattn_q(q_r, keys)

Without documents every rank needs nearly everything and this is the classic all-gather; under
``doc_local`` a document whole on one rank is never sent; with a sliding window only the rows
another rank's window reaches. The key buffer is kept for the backward (instead of the whole
row's K/V), so the backward moves only the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_cp.attention.comm import all_to_all_uneven
from titan_cp.attention.context import CPContext
from titan_cp.attention.fold import Fold, fold_backward, fold_forward, make_fold, new_accumulators
from titan_cp.attention.merge import apply_sinks_, sinks_grad
from titan_cp.attention.plans import CAUSAL, Mask, PlanIndex, head_major, make_plan, token_major
from titan_cp.attention.strategy import Strategy, register_strategy
from titan_cp.layout import SequenceLayout, to_device


def exported_rows(layout: SequenceLayout, rank: int, mask: Mask, batch: int) -> torch.Tensor:
    """Rows of ``rank``'s token-major buffer that some query of another rank sees (host, sorted)."""
    parts = [make_plan(layout, (i,), (rank,), mask).key_rows(batch) for i in range(layout.cp_size) if i != rank]
    return torch.unique(torch.cat(parts)) if parts else torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class Gather:
    """One rank's exchange, planned once per microbatch.

    ``send``: device rows of my buffer sent to each other rank, in rank order (``E_r`` repeated);
    ``send_splits``/``recv_splits``: rows to and from each rank (0 to and from myself);
    ``mine``: device rows ``E_r``, each peer's gradients of them arriving in the same order;
    ``active``: whether any rank exports anything (the collective runs on every rank, or on none).
    """

    send: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    mine: torch.Tensor
    index: PlanIndex
    fold: Fold
    active: bool

    @property
    def received(self) -> int:
        return sum(self.recv_splits)


def gather_plan(layout: SequenceLayout, rank: int, mask: Mask, batch: int, device: torch.device) -> Gather:
    """The :class:`Gather` of ``rank`` (cached on the layout)."""

    def build() -> Gather:
        n, local = layout.cp_size, batch * layout.local_len
        exported = [exported_rows(layout, j, mask, batch) for j in range(n)]
        key_map = torch.full((batch * layout.seq_len,), -1, dtype=torch.int64)  # natural row -> key buffer row
        key_map[_natural_rows(layout, rank, batch)] = torch.arange(local)
        offset = local
        for j in range(n):
            if j != rank:
                key_map[_natural_rows(layout, j, batch)[exported[j]]] = offset + torch.arange(len(exported[j]))
                offset += len(exported[j])
        plan = make_plan(layout, (rank,), None, mask)
        index = plan.index(batch, device, (("gathered", rank), key_map))
        fold = make_fold(plan.q_dest(batch), torch.zeros(local, dtype=torch.bool), device)
        mine = exported[rank]
        send_splits = [0 if j == rank else len(mine) for j in range(n)]
        recv_splits = [0 if j == rank else len(exported[j]) for j in range(n)]
        send = mine.repeat(n - 1)
        active = any(len(e) for e in exported)
        return Gather(to_device(send, device), send_splits, recv_splits, to_device(mine, device), index, fold, active)

    return layout.memo(("gather", rank, mask, batch, torch.device(device)), build)


def _natural_rows(layout: SequenceLayout, rank: int, batch: int) -> torch.Tensor:
    """The natural token-major row (``b * seq_len + position``) of each row of ``rank``'s buffer."""
    index = layout.index(rank)
    index = index.expand(batch, -1) if index.dim() == 1 else index
    return (index + layout.seq_len * torch.arange(batch).unsqueeze(1)).reshape(-1)


class AllGather(Strategy):
    """Gather what other ranks can see of each rank's K/V, attend the local queries (module docstring)."""

    name = "allgather"
    keeps = ("q", "out")

    def forward(self, ctx: CPContext, q, k, v):
        batch = q.shape[0]
        g = gather_plan(ctx.layout, ctx.rank, ctx.mask, batch, q.device)
        k_t, v_t = token_major(k), token_major(v)
        keys = k_t.new_empty((k_t.shape[0] + g.received, 2) + tuple(k_t.shape[1:]))  # (B*S + received, 2, K, E)
        torch.stack([k_t, v_t], dim=1, out=keys[: k_t.shape[0]])
        if g.active:
            kv = keys[: k_t.shape[0]]
            all_to_all_uneven(kv.index_select(0, g.send), g.send_splits, g.recv_splits, ctx.group, keys[k_t.shape[0] :])
        q_t = token_major(q)
        out_acc, lse = new_accumulators(q_t)
        fold_forward(q_t, keys[:, 0], keys[:, 1], g.index, g.fold, ctx.kernel, ctx.scale, out_acc, lse)
        if ctx.sinks is not None:
            apply_sinks_(out_acc, lse, ctx.sinks)
        return head_major(out_acc.to(q.dtype), batch), (lse, keys)

    def backward(self, ctx: CPContext, dout, q, k, v, out, saved):
        lse, keys = saved
        batch = q.shape[0]
        g = gather_plan(ctx.layout, ctx.rank, ctx.mask, batch, q.device)
        dout_t, q_t, out_t = token_major(dout), token_major(q), token_major(out)
        dq = torch.zeros(q_t.shape, dtype=torch.float32, device=q.device)
        dkeys = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
        fold_backward(
            dout_t,
            q_t,
            keys[:, 0],
            keys[:, 1],
            out_t,
            lse,
            g.index,
            ctx.kernel,
            ctx.scale,
            dq,
            dkeys[:, 0],
            dkeys[:, 1],
        )
        local = q_t.shape[0]
        dkv = dkeys[:local]
        if g.active:
            home = dkeys.new_empty((len(g.send),) + tuple(dkeys.shape[1:]))
            all_to_all_uneven(dkeys[local:], g.recv_splits, g.send_splits, ctx.group, home)
            dkv.index_add_(0, g.send, home)
        dsinks = None if ctx.sinks is None else sinks_grad(dout_t, out_t, lse, ctx.sinks)
        dk, dv = (head_major(dkv[:, i].to(keys.dtype), batch) for i in (0, 1))
        return head_major(dq.to(q.dtype), batch), dk, dv, dsinks

    def saved_like(self, ctx: CPContext, q, k, v):
        """The key buffer's length depends on the documents (what other ranks can see): a dynamic size."""
        b, h, s, e = q.shape
        rows = torch.library.get_ctx().new_dynamic_size()
        return q.new_empty((h, b * s), dtype=torch.float32), k.new_empty((rows, 2, k.shape[1], e))

    def min_bytes(self, q, k, cp, ulysses_degree=1, backward=True, layout=None, rank=None, mask=CAUSAL) -> int:
        """A rank's exported rows reach the N-1 others; in the backward it sends each peer the fp32
        gradients of the rows it received from it. Without a layout every row is exported."""
        b, kv_heads, s, e = k.shape
        row = 2 * kv_heads * e
        exported = [s * b] * cp if layout is None else [len(exported_rows(layout, j, mask, b)) for j in range(cp)]

        def sent(r: int) -> int:
            fwd = (cp - 1) * exported[r] * row * k.element_size()
            return fwd + ((sum(exported) - exported[r]) * row * 4 if backward else 0)

        return max(sent(r) for r in (range(cp) if rank is None else (rank,)))

    def saved_bytes_per_token(self, act_bytes, q_heads, kv_heads, head_dim, cp, ulysses_degree=1) -> float:
        """Local q, out and lse, and the key buffer: at most ``cp`` tokens' K/V per local token (all of them
        when every row is seen by another rank; fewer under ``doc_local`` or a window)."""
        a, h, e = act_bytes, q_heads, head_dim
        return 2 * a * h * e + 4 * h + cp * 2 * a * kv_heads * e


ALLGATHER = register_strategy(AllGather())
