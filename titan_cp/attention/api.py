"""Public entry points: :func:`cp_attention` across a cp mesh, :func:`local_attention` on one device.

Shapes (SDPA's)::

    q:   (batch, q_heads,  seq_local, head_dim)
    k,v: (batch, kv_heads, seq_local, head_dim)     q_heads % kv_heads == 0 (GQA)
    out: (batch, q_heads,  seq_local, head_dim)     in q's dtype

``seq_local`` tokens are this rank's shard under ``layout`` (``layout.shard(x, dim=2, rank)``).
The result on every rank equals the matching rows of full-sequence attention with the
causal and document masks; every strategy is differentiable in q, k and v.

Both entry points are opaque to ``torch.compile`` (``torch.compiler.disable``): they are a
Python loop over mask tiles around communication, so a compiled model runs them eagerly
between its compiled pieces.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from titan_cp.attention.allgather import allgather_attention, allgather_min_bytes
from titan_cp.attention.block import BlockAttention, make_plan
from titan_cp.attention.hybrid import hybrid_attention, hybrid_rank
from titan_cp.attention.kernels import get_kernel
from titan_cp.attention.ring import ring_attention, ring_min_bytes
from titan_cp.attention.ulysses import kv_head_map, ulysses_attention, ulysses_min_bytes
from titan_cp.layout import SequenceLayout, get_layout

_ONE_AXIS: dict[str, Callable] = {
    "ring": ring_attention,
    "allgather": allgather_attention,
    "ulysses": ulysses_attention,
}
STRATEGIES: tuple[str, ...] = ("ring", "allgather", "ulysses", "hybrid")

MIN_BYTES: dict[str, Callable] = {
    "ring": ring_min_bytes,
    "allgather": allgather_min_bytes,
    "ulysses": ulysses_min_bytes,
}


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, seq and head_dim"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_layout(q: torch.Tensor, layout: SequenceLayout) -> None:
    if q.shape[2] != layout.local_len:
        raise ValueError(
            f"q has {q.shape[2]} tokens per rank but the layout gives each rank {layout.local_len} "
            f"(seq_len {layout.seq_len} / cp_size {layout.cp_size})"
        )
    if layout.batch_size is not None and layout.batch_size != q.shape[0]:
        raise ValueError(f"batch size {q.shape[0]} does not match the layout's {layout.batch_size} doc_lens rows")


@torch.compiler.disable
def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh,
    layout: SequenceLayout,
    strategy: str = "ring",
    causal: bool = True,
    scale: float | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Exact attention for this rank's query shard, with the K/V of every rank of ``mesh``.

    Args:
        q, k, v: local shards, see the module docstring.
        mesh: the cp :class:`~torch.distributed.device_mesh.DeviceMesh`: 1-D, or 2-D
            ``(ring, ulysses)`` for ``"hybrid"`` (names ``cp_ring``/``cp_ulysses`` are honoured).
            ``None`` runs on one device (``layout.cp_size`` must be 1).
        layout: the :class:`~titan_cp.SequenceLayout` the shards were taken with.
        strategy: ``"ring"``, ``"allgather"``, ``"ulysses"`` or ``"hybrid"``.
        causal: causal mask (inside each document when the layout has documents).
        scale: softmax scale, ``1/sqrt(head_dim)`` by default.
        kernel: local kernel name (``"cpu_flash"``, ``"cuda_flash"``, ``"flash_attn"``, ``"math"``);
            ``None`` picks the fastest for the device and dtype.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown cp attention strategy {strategy!r}; choose one of {STRATEGIES}")
    _check_qkv(q, k, v)
    _check_layout(q, layout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    kern = get_kernel(kernel, q.device, q.dtype)
    if mesh is None:
        if layout.cp_size != 1:
            raise ValueError(f"mesh is None but the layout spreads the sequence over {layout.cp_size} ranks")
        return BlockAttention.apply(q, k, v, make_plan(layout, (0,), (0,), causal), kern, scale)
    want = 2 if strategy == "hybrid" else 1
    if mesh.ndim != want:
        raise ValueError(f"strategy {strategy!r} needs a {want}-D cp mesh, got a {mesh.ndim}-D mesh {mesh.mesh_dim_names}")
    if mesh.size() != layout.cp_size:
        raise ValueError(f"the cp mesh has {mesh.size()} ranks but the layout was built for cp_size {layout.cp_size}")
    if strategy == "hybrid":
        return hybrid_attention(q, k, v, mesh, layout, causal, scale, kern)
    return _ONE_AXIS[strategy](q, k, v, mesh.get_group(), layout, mesh.get_local_rank(), causal, scale, kern)


def cp_rank(mesh, strategy: str = "ring") -> int:
    """This process's rank in the layout for ``mesh`` (the flattened ring x ulysses index for hybrid)."""
    return hybrid_rank(mesh) if strategy == "hybrid" else mesh.get_local_rank()


@torch.compiler.disable
def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_lens=None,
    causal: bool = True,
    scale: float | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Exact single-device attention with causal and packed-document masks.

    ``doc_lens``: ``None``, one list of document lengths per batch row, or a zero-padded
    ``(batch, max_docs)`` integer tensor. GQA K/V are taken as they are.
    """
    _check_qkv(q, k, v)
    layout = get_layout(q.shape[2], 1, "contiguous", doc_lens)
    return cp_attention(q, k, v, None, layout, causal=causal, scale=scale, kernel=kernel)


def min_bytes_per_rank(strategy: str, q: torch.Tensor, k: torch.Tensor, world: int, ulysses_size: int = 1, backward: bool = True) -> int:
    """The strategy's own minimum bytes sent per rank for one forward (+ backward) on these local shapes."""
    if strategy != "hybrid":
        return MIN_BYTES[strategy](q, k, world, backward)
    ring_size = world // ulysses_size
    uly = ulysses_min_bytes(q, k, ulysses_size, backward)
    # after the all-to-all each ring rank holds U times the tokens for 1/U of the heads
    heads = kv_head_map(q.shape[1], k.shape[1], ulysses_size)
    kv_heads = 1 if heads is not None else k.shape[1] // ulysses_size
    b, _, s, d = k.shape
    k_ring = torch.empty(b, kv_heads, s * ulysses_size, d, dtype=k.dtype, device="meta")
    return uly + ring_min_bytes(q, k_ring, ring_size, backward)
