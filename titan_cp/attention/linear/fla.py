"""The gated delta rule on CUDA through ``fla`` (flash-linear-attention), where it is installed.

``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` runs variable-length pieces (``cu_seqlens``) each
from a state of its own (``initial_state``: ``(pieces, v_heads, d_k, width)``, the layout of
:mod:`.gated_delta`'s state) and returns their final states; grouped value heads, the q/k
normalisation and the scale are its own arguments. It is an autograd function, so the op's backward
runs through it as through the torch kernel. Each piece runs once, per rank and layer at most three calls
(:func:`.gated_delta.scan`'s arithmetic, :attr:`.plan.StatePlan.groups`)::

    before   the pieces that start their document, from zero at v's own width (outputs final; the
             final state is the offset B a later piece needs)
    wide     the middle pieces (a piece before them, and one after them whose rank needs their summary)
             and the last pieces placed before the exchange, v widened to [v | 0] from [0 | I]: outputs
             [o | r] (from zero, and the query carried through the transitions: the composed state's
             share r^T S_in is added after the exchange) and final states [B | M]
    after    after the exchange, the last pieces (and the late middle ones) from the states the pieces
             before them leave, and the documents held whole placed there from zero, at v's own width
             (what they cost alone); a late middle's final state goes by a second exchange to the
             ranks whose wide pieces after it it corrects

(:func:`.plan.piece_calls` places the whole documents and the last pieces.)

The import is never needed at titan_cp's import: :func:`available` looks for the package; the op picks
this backend for CUDA tensors when it is there (``"auto"``), and the torch chunked kernel otherwise.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from titan_cp.attention.linear.plan import on_device


@functools.cache
def available() -> bool:
    """Whether ``fla`` is importable (checked once, without importing it)."""
    return importlib.util.find_spec("fla") is not None


def _kernel() -> Callable[..., Any]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: PLC0415 - optional dependency

    return chunk_gated_delta_rule


@dataclass(frozen=True)
class Prepared:
    """The call's tokens, flat: ``q, k`` ``(tokens, k_heads, d_k)``, ``v`` ``(tokens, v_heads, d_v)``,
    ``g, beta`` ``(tokens, v_heads)``; the settings passed to ``fla``."""

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    scale: float
    qk_l2norm: bool


_DEVICE: dict = {}  # on_device's cache: the pieces' cumulative lengths and token indices, by their values


def _cu(lengths: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    cpu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    if len(_DEVICE) > 256:
        _DEVICE.clear()
    return on_device(_DEVICE, ("cu", tuple(lengths)), lambda: cpu, device), cpu


def _call(p: Prepared, v: Tensor, lengths: list[int], initial: Tensor | None) -> tuple[Tensor, Tensor]:
    """``fla`` over ``p``'s tokens (``v`` in place of ``p.v``) cut into pieces of ``lengths``, each from its
    ``initial`` state (``None``: every piece from zero): ``(o, final states)``."""
    cu, cu_cpu = _cu(lengths, p.q.device)
    o, final = _kernel()(
        p.q[None], p.k[None], v[None], p.g[None], p.beta[None],
        scale=p.scale, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=p.qk_l2norm,
        cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
    )  # fmt: skip
    return o[0], final


def scan(
    p: Prepared, lengths: list[int], wide: bool, starts: list[Tensor | None] | None = None
) -> tuple[Tensor, Tensor]:
    """:func:`.gated_delta.scan` through one ``fla`` call: ``p`` holds the pieces' tokens one after another,
    ``lengths`` theirs; outputs ``(sum(lengths), v_heads, width)`` and final states ``(len(lengths), v_heads,
    d_k, width)``; each piece from zero, or from ``starts`` (one fp32 ``(v_heads, d_k, d_v)`` state a piece,
    ``None`` for zero: where every piece starts from zero, ``fla`` is given no initial state);
    ``wide``: ``v`` widened by ``d_k`` zero columns from ``[0 | I]`` (a ``cat``, whose backward is a view: a pad's
    would copy)."""
    h, dk, dv = p.v.shape[1], p.q.shape[-1], p.v.shape[-1]
    width = dv + dk * wide
    if not lengths:
        return p.v.new_zeros(0, h, width), torch.zeros(0, h, dk, width, device=p.q.device)
    if starts is not None and any(s is not None for s in starts):
        zero = torch.zeros(h, dk, dv, device=p.q.device)
        return _call(p, p.v, lengths, torch.stack([zero if s is None else s for s in starts]))
    if not wide:
        return _call(p, p.v, lengths, None)
    initial = torch.zeros(len(lengths), h, dk, width, device=p.q.device)
    initial[..., dv:] = torch.eye(dk, device=p.q.device)
    return _call(p, torch.cat([p.v, p.v.new_zeros(*p.v.shape[:2], dk)], -1), lengths, initial)


def split(p: Prepared, sizes: list[int]) -> list[Prepared]:
    """``p``'s tokens cut into consecutive parts of ``sizes`` (views)."""
    q, k, v, g, beta = (x.split(sizes) for x in (p.q, p.k, p.v, p.g, p.beta))
    return [Prepared(q[i], k[i], v[i], g[i], beta[i], p.scale, p.qk_l2norm) for i in range(len(sizes))]
