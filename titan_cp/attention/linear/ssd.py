"""Mamba2's state-space dual (SSD) over pieces, chunked, in torch: each piece from a state of its own.

Per head, with ``S`` the ``(P, N)`` state (head dim x state size), ``a_t = dt_t A`` (log-decay, a scalar
per head: the decay is ``exp(a_t) I``) and the input discretised as ``dt_t x_t``::

    S_t = exp(a_t) S_{t-1} + (dt_t x_t) B_t^T           y_t = S_t C_t

After a piece, ``S_out = m S_in + B`` with a scalar ``m = exp(sum a_t)`` per head: the summary of a piece
is ``[B | m]``, ``(P, N + 1)`` per head (``m`` broadcast over ``P``).

Chunked form (``c``: cumulative log-decay in the chunk, ``D = exp(c_i - c_j)`` on and below the
diagonal)::

    y = ((C B^T) * D) (dt x) + exp(c) (C S^T)                    S <- exp(c_C) S + (dt x)^T (B exp(c_C - c))

Shapes: ``x`` ``(tokens, heads, P)``, ``dt`` ``(tokens, heads)`` (after its bias, softplus and limits),
``A`` ``(heads,)``, ``B, C`` ``(tokens, heads, N)`` (groups already repeated to heads). fp32, autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from titan_cp.attention.linear.chunks import Chunks


@dataclass(frozen=True)
class Prepared:
    """Per chunk: ``(chunks, heads, C, .)``; ``gamma`` ``(chunks, heads)``."""

    xd: Tensor  # dt x
    bd: Tensor  # B exp(c_C - c)
    cd: Tensor  # C exp(c)
    intra: Tensor  # (C B^T) * D, (chunks, heads, C, C)
    gamma: Tensor  # exp(c_C)


def prepare(chunks: Chunks, x: Tensor, dt: Tensor, a_log: Tensor, b: Tensor, c: Tensor) -> Prepared:
    """The intra-chunk quantities of every chunk (padding: zero ``dt``, so zero input and no decay).
    ``a_log``: ``A`` per head (negative)."""
    x, b, c = (chunks.gather(t).transpose(1, 2) for t in (x, b, c))  # (N, H, C, .)
    dt = chunks.gather(dt).transpose(1, 2)  # (N, H, C)
    cum = (dt * a_log.view(1, -1, 1)).cumsum(-1)
    size = chunks.size
    lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    last = cum[..., -1:]
    return Prepared(
        x * dt.unsqueeze(-1),
        b * (last - cum).exp().unsqueeze(-1),
        c * cum.exp().unsqueeze(-1),
        (c @ b.transpose(-1, -2)) * decay,
        last[..., 0].exp(),
    )


def _next(p: Prepared, i: int, s: Tensor) -> Tensor:
    return s * p.gamma[i].view(-1, 1, 1) + p.xd[i].transpose(-1, -2) @ p.bd[i]


def outputs(chunks: Chunks, p: Prepared, initial: list[Tensor | None]) -> Tensor:
    """``(tokens, heads, P)``: every piece run from its state in ``initial`` (one ``(heads, P, N)`` state per
    piece; ``None``: zero)."""
    h, dp, n = p.xd.shape[1], p.xd.shape[-1], p.bd.shape[-1]
    out = []
    for j, (first, count) in enumerate(chunks.spans):
        start = initial[j]
        s = p.xd.new_zeros(h, dp, n) if start is None else start
        for i in range(first, first + count):
            out.append(p.intra[i] @ p.xd[i] + p.cd[i] @ s.transpose(-1, -2))
            s = _next(p, i, s)
    return chunks.scatter(torch.stack(out).transpose(1, 2))


def summaries(chunks: Chunks, p: Prepared, pieces: tuple[int, ...], middle: tuple[bool, ...]) -> Tensor:
    """``(len(pieces), heads, P, N + 1)``: ``[B | m]`` of each piece (``middle`` is not needed: ``m`` is a
    scalar per head, always computed)."""
    h, dp, n = p.xd.shape[1], p.xd.shape[-1], p.bd.shape[-1]
    out = []
    for j in pieces:
        first, count = chunks.spans[j]
        s = p.xd.new_zeros(h, dp, n)
        for i in range(first, first + count):
            s = _next(p, i, s)
        m = p.gamma[first : first + count].prod(0).view(h, 1, 1).expand(h, dp, 1)
        out.append(torch.cat([s, m], -1))
    if not out:
        return p.xd.new_zeros(0, h, dp, n + 1)
    return torch.stack(out)


def apply(summary: Tensor, s: Tensor | None) -> Tensor:
    """The state after a piece of ``summary`` ``[B | m]`` from ``s`` (``None``: zero): ``m s + B``."""
    b, m = summary[..., :-1], summary[..., -1:]
    return b if s is None else m * s + b
