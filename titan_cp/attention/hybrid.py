"""Hybrid attention: Ulysses inside a group, ring across groups, on a 2-D cp sub-mesh.

The cp ranks form a ``ring x ulysses`` grid; cp rank ``r = ring_rank * U + ulysses_rank``.
An all-to-all inside each Ulysses group turns ``U`` sequence shards into head shards of
their union; those unions then run the ring among the ``R`` groups::

    q_h, kv_h = all_to_all over ulysses (scatter heads, gather seq)
    out_h     = ring over the ring axis (group g's buffer = shards g*U .. g*U+U-1)
    out       = all_to_all over ulysses (scatter seq, gather heads)

Ulysses needs fast links (it moves every activation once) and caps at the head count;
the ring needs only neighbour bandwidth and scales past it. The usual placement is
Ulysses inside a node and the ring across nodes.
"""

from __future__ import annotations

import torch

from titan_cp.attention.ring import RingAttention, ring_plans
from titan_cp.attention.ulysses import heads_to_seq, kv_to_heads, seq_to_heads
from titan_cp.layout import SequenceLayout


def hybrid_dims(mesh) -> tuple[int, int]:
    """``(ring_dim, ulysses_dim)`` of a 2-D cp mesh: by the names ``cp_ring``/``cp_ulysses``, else (0, 1)."""
    names = mesh.mesh_dim_names or ()
    if "cp_ring" in names and "cp_ulysses" in names:
        return names.index("cp_ring"), names.index("cp_ulysses")
    return 0, 1


def hybrid_rank(mesh) -> int:
    """This rank's cp rank in the layout: ``ring_rank * ulysses_size + ulysses_rank``."""
    ring_dim, uly_dim = hybrid_dims(mesh)
    return mesh.get_local_rank(ring_dim) * mesh.size(uly_dim) + mesh.get_local_rank(uly_dim)


def hybrid_attention(q, k, v, mesh, layout: SequenceLayout, causal: bool, scale: float, kernel) -> torch.Tensor:
    """Hybrid attention on a 2-D ``(ring, ulysses)`` cp mesh."""
    ring_dim, uly_dim = hybrid_dims(mesh)
    ring_size, uly_size = mesh.size(ring_dim), mesh.size(uly_dim)
    uly_group, ring_group = mesh.get_group(uly_dim), mesh.get_group(ring_dim)
    q_h = seq_to_heads(q, uly_group)
    k_h, v_h = kv_to_heads(k, v, q.shape[1], uly_group)
    members = lambda g: tuple(range(g * uly_size, (g + 1) * uly_size))  # noqa: E731
    plans = ring_plans(layout, mesh.get_local_rank(ring_dim), ring_size, members, causal)
    out = RingAttention.apply(q_h, k_h, v_h, ring_group, plans, kernel, scale)
    return heads_to_seq(out, uly_group)
