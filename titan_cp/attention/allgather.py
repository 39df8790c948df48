"""All-gather attention (the Llama 3 recipe): gather the K/V other ranks can see, attend the local queries.

Each rank contributes ``E_j``, the rows of its K/V that some query of another rank can see
(from the layout and the mask, known to every rank); the gather is padded to the largest
``E_j``. K/V travel at their own head count (GQA is never expanded before the collective). The
key buffer is the rank's own K/V followed by everyone's gathered rows, and one plan (the local
queries on the whole row) reads it::

    forward    gathered = all_gather(kv_local[E_r])                (N-1) * max_j |E_j| rows out of each rank
               out_r    = attn(q_r, [kv_local, gathered])
    backward   dkv_local[E_r] += reduce_scatter(dgathered)       the dual collective, fp32
               dkv_local      += dattn_kv of the own part, dq_r = dattn_q(q_r, keys)

Without documents every rank needs nearly everything and this is the classic all-gather; under
``doc_local`` a document whole on one rank is never gathered; with a sliding window only the
rows another rank's window reaches. The gathered buffer is kept for the backward (instead of
the whole row's K/V), so the backward moves only the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_cp.attention.comm import all_gather, reduce_scatter
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
    """One rank's all-gather, planned once per microbatch.

    ``width``: rows each rank contributes (the largest ``E_j``; 0: nothing to gather);
    ``send``: device rows of my buffer to send, padded to ``width``; ``mine``: how many are real.
    """

    width: int
    send: torch.Tensor | None
    mine: int
    index: PlanIndex
    fold: Fold


def gather_plan(layout: SequenceLayout, rank: int, mask: Mask, batch: int, device: torch.device) -> Gather:
    """The :class:`Gather` of ``rank`` (cached on the layout)."""

    def build() -> Gather:
        n, local = layout.cp_size, batch * layout.local_len
        exported = [exported_rows(layout, j, mask, batch) for j in range(n)]
        width = max(len(e) for e in exported)
        key_map = torch.full((batch * layout.seq_len,), -1, dtype=torch.int64)  # natural row -> key buffer row
        for j in range(n):
            natural = _natural_rows(layout, j, batch)  # natural row of each of rank j's buffer rows
            if j == rank:
                key_map[natural] = torch.arange(local)
            else:
                key_map[natural[exported[j]]] = local + j * width + torch.arange(len(exported[j]))
        plan = make_plan(layout, (rank,), None, mask)
        index = plan.index(batch, device, (("gathered", rank), key_map))
        fold = make_fold(plan.q_dest(batch), torch.zeros(local, dtype=torch.bool), device)
        mine = exported[rank]
        send = torch.cat([mine, torch.zeros(width - len(mine), dtype=torch.int64)]) if width else None
        return Gather(width, None if send is None else to_device(send, device), len(mine), index, fold)

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
        keys = torch.stack([token_major(k), token_major(v)], dim=1)  # (B*S, 2, K, E)
        if g.width:
            gathered = all_gather(keys.index_select(0, g.send), ctx.group)  # (N, width, 2, K, E)
            keys = torch.cat([keys, gathered.flatten(0, 1)])
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
        if g.width:
            home = reduce_scatter(dkeys[local:].view(ctx.cp_size, g.width, *dkeys.shape[1:]), ctx.group)
            dkv.index_add_(0, g.send[: g.mine], home[: g.mine])
        dsinks = None if ctx.sinks is None else sinks_grad(dout_t, out_t, lse, ctx.sinks)
        dk, dv = (head_major(dkv[:, i].to(keys.dtype), batch) for i in (0, 1))
        return head_major(dq.to(q.dtype), batch), dk, dv, dsinks

    def saved_like(self, ctx: CPContext, q, k, v):
        """The key buffer's length depends on the documents (what other ranks can see): a dynamic size."""
        b, h, s, e = q.shape
        rows = torch.library.get_ctx().new_dynamic_size()
        return q.new_empty((h, b * s), dtype=torch.float32), k.new_empty((rows, 2, k.shape[1], e))

    def min_bytes(self, q, k, cp, ulysses_degree=1, backward=True, layout=None, rank=None, mask=CAUSAL) -> int:
        """Every rank's exported rows (padded to the largest) reach the N-1 others; in the backward their
        fp32 gradients come back once. Without a layout every row is exported."""
        b, kv_heads, s, e = k.shape
        width = s * b if layout is None else max(len(exported_rows(layout, j, mask, b)) for j in range(cp))
        row = 2 * kv_heads * e
        total = (cp - 1) * width * row * k.element_size()
        return total + ((cp - 1) * width * row * 4 if backward else 0)

    def saved_bytes_per_token(self, act_bytes, q_heads, kv_heads, head_dim, cp, ulysses_degree=1) -> float:
        """Local q, out and lse, and the local and gathered K/V (at most ``cp`` tokens per local token)."""
        a, h, e = act_bytes, q_heads, head_dim
        return 2 * a * h * e + 4 * h + cp * 2 * a * kv_heads * e


ALLGATHER = register_strategy(AllGather())
