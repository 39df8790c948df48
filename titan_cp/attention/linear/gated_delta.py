"""The gated delta rule over pieces, chunked, in torch: each piece from a state of its own.

Per value head, with ``S`` the ``(d_k, d_v)`` state, ``a_t = exp(g_t)`` and ``b_t = beta_t``::

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T          o_t = S_t^T q_t

``S`` after a piece is affine in ``S`` before it: ``S_out = M S_in + B`` (``M``: ``(d_k, d_k)``, the
product of the piece's ``a_t (I - b_t k_t k_t^T)``; ``B``: the state the piece leaves from zero).

Chunked form (chunks of ``C`` tokens; within a chunk ``c_t`` is the cumulative log-decay, ``D`` the
``C x C`` matrix ``exp(c_i - c_j)`` on and below the diagonal, 0 above; the UT transform
``T = (I + strict_lower((b k) k^T * D))^{-1}``)::

    U = T (b v)        W = T (b k exp(c))                         per chunk, all chunks at once
    v' = U - W S       o = (q exp(c)) S + ((q k^T) * D) v'       then S <- exp(c_C) S + (k exp(c_C - c))^T v'

Run with ``S = [0 | I]`` and ``v`` widened by ``d_k`` zero columns, the same recurrence gives, in one pass
over a piece, its outputs from zero ``o_t``, its query carried through the transitions ``r_t = M_t^T q_t``
(``M_t``: the product up to ``t``) in the last ``d_k`` output columns, and its summary ``[B | M]`` as the
final state; from the state ``S_in`` the pieces before it leave, the piece's output is then
``o_t + S_in^T r_t`` (exactly: ``S_t = M_t S_in + S_t^0``). Everything is fp32 and differentiable by
autograd (the op's backward recomputes through it, :mod:`.op`).

Shapes: ``q, k`` ``(tokens, heads, d_k)``, ``v`` ``(tokens, heads, d_v)``, ``g, beta`` ``(tokens, heads)``
with value heads (grouped q/k already repeated).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from titan_cp.attention.linear.chunks import Chunks


@dataclass(frozen=True)
class Prepared:
    """Per chunk, all chunks at once: ``(chunks, heads, C, .)``; ``gamma`` ``(chunks, heads)``."""

    qd: Tensor  # q exp(c)
    kd: Tensor  # k exp(c_C - c)
    w: Tensor
    u: Tensor
    intra: Tensor  # (q k^T) * D, (chunks, heads, C, C)
    gamma: Tensor


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the normalisation of q and k in the kernel)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare(chunks: Chunks, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Prepared:
    """The intra-chunk quantities of every chunk (padding: zero k, v, beta and log-decay)."""
    q, k, v = (chunks.gather(x).transpose(1, 2) for x in (q, k, v))  # (N, H, C, .)
    g, beta = (chunks.gather(x).transpose(1, 2) for x in (g, beta))  # (N, H, C)
    c = g.cumsum(-1)
    size = chunks.size
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta.unsqueeze(-1)
    ut = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(ut, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, kb * c.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    last = c[..., -1:]
    return Prepared(q * c.exp().unsqueeze(-1), k * (last - c).exp().unsqueeze(-1), w, u, intra, last[..., 0].exp())


def _step(p: Prepared, i: int, s: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Chunk ``i`` from state ``s`` ``(H, d_k, cols)``: ``(v', next state)``."""
    v_new = u - p.w[i] @ s
    return v_new, s * p.gamma[i].view(-1, 1, 1) + p.kd[i].transpose(-1, -2) @ v_new


def scan(
    chunks: Chunks,
    runs: tuple[tuple[int, int], ...],
    p: Prepared,
    pieces: tuple[int, ...],
    wide: bool,
    starts: list[Tensor | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """Each piece of ``pieces`` (indices into ``runs``, ``(flat start, length)``) from a zero state, or from
    ``starts`` (one ``(heads, d_k, d_v)`` state a piece, ``None`` for zero): its outputs, ``(sum of the pieces' lengths, heads,
    width)`` (the pieces one after another), and its final state, ``(len(pieces), heads, d_k, width)``.
    ``wide``: ``d_k`` more value columns, zero, from the state ``[0 | I]``: the outputs are ``[o | r]`` (``o``
    from zero, ``r_t = M_t^T q_t`` the query carried through the transitions so far) and the final state
    ``[B | M]`` (module docstring)."""
    h, dk, dv = p.u.shape[1], p.w.shape[-1], p.u.shape[-1]
    width = dv + dk * wide
    start = p.u.new_zeros(h, dk, width)
    if wide:
        start[..., dv:] = torch.eye(dk, dtype=p.u.dtype, device=p.u.device)
    pad = p.u.new_zeros(h, p.u.shape[2], dk)
    outs, finals = [], []
    for at, j in enumerate(pieces):
        first, n = chunks.spans[j]
        given = None if starts is None else starts[at]
        s, chunk_outs = start if given is None else given.to(p.u.dtype), []
        for i in range(first, first + n):
            u = torch.cat([p.u[i], pad], -1) if wide else p.u[i]
            v_new, s_next = _step(p, i, s, u)
            chunk_outs.append(p.qd[i] @ s + p.intra[i] @ v_new)  # (H, C, width)
            s = s_next
        outs.append(torch.stack(chunk_outs).transpose(1, 2).reshape(n * chunks.size, h, width)[: runs[j][1]])
        finals.append(s)
    if not outs:
        return p.u.new_zeros(0, h, width), p.u.new_zeros(0, h, dk, width)
    return torch.cat(outs), torch.stack(finals)


def apply(summary: Tensor, s: Tensor | None) -> Tensor:
    """The state after a piece of ``summary`` ``[B | M]`` from ``s`` (``None``: zero): ``M s + B``."""
    dv = summary.shape[-1] - summary.shape[-2]
    b, m = summary[..., :dv], summary[..., dv:]
    return b if s is None else m @ s + b
