"""Hybrid attention: Ulysses inside a group, ring across groups, on a 2-D cp sub-mesh.

The cp ranks form a ``ring x ulysses`` grid; cp rank ``r = ring_rank * U + ulysses_rank``.
An all-to-all inside each Ulysses group turns ``U`` sequence shards into head shards of
their union; those unions then run the ring among the ``R`` groups::

    q_h, kv_h = all_to_all over ulysses (scatter heads, gather seq)
    out_h     = ring over the ring axis (group g's buffer = shards g*U .. g*U+U-1)
    out       = all_to_all over ulysses (scatter seq, gather heads)
    backward: the ring's backward between the dual all-to-alls

With documents that mostly lie whole on one rank the call runs the ring's schedule over every cp
rank instead, as Ulysses does (:meth:`~titan_cp.attention.ulysses.HeadExchange.schedule`): each rank attends
its own queries over every head, addressing the other cp ranks by their global ranks.

Ulysses needs fast links (it moves every activation once) and caps at the head count;
the ring needs only neighbour bandwidth and scales past it. The usual placement is
Ulysses inside a node and the ring across nodes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from titan_cp.attention.comm import PeerComm
from titan_cp.attention.context import CPContext
from titan_cp.attention.ring import (
    RingGroup,
    RingSteps,
    ring_backward,
    ring_forward,
    ring_steps,
)
from titan_cp.attention.strategy import register_strategy
from titan_cp.attention.ulysses import (
    HeadExchange,
    Heads,
    concat_to_stacked,
    head_index,
    stacked_to_concat,
)


def hybrid_dims(mesh: DeviceMesh) -> tuple[int, int]:
    """``(ring_dim, ulysses_dim)`` of a 2-D cp mesh: by the names ``cp_ring``/``cp_ulysses``, else (0, 1)."""
    names = mesh.mesh_dim_names or ()
    if "cp_ring" in names and "cp_ulysses" in names:
        return names.index("cp_ring"), names.index("cp_ulysses")
    return 0, 1


def hybrid_rank(mesh: DeviceMesh) -> int:
    """This rank's cp rank in the layout: ``ring_rank * ulysses_size + ulysses_rank``."""
    ring_dim, uly_dim = hybrid_dims(mesh)
    return mesh.get_local_rank(ring_dim) * mesh.size(uly_dim) + mesh.get_local_rank(uly_dim)


@functools.lru_cache(maxsize=8)
def layout_peers(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global rank of each cp rank of a 2-D mesh, in layout order (:func:`hybrid_rank`)."""
    grid = mesh.mesh.tolist()  # [d0][d1]
    if hybrid_dims(mesh) == (1, 0):
        grid = [list(col) for col in zip(*grid)]
    return tuple(r for row in grid for r in row)


def _axes(
    ctx: CPContext, batch: int, device: torch.device
) -> tuple[dist.ProcessGroup, dist.ProcessGroup, int, int, RingSteps]:
    mesh = ctx.mesh
    if mesh is None:
        raise RuntimeError("the hybrid strategy runs on a 2-D cp mesh; one device runs the ring's one step")
    ring_dim, uly_dim = hybrid_dims(mesh)
    ring_size, uly_size = mesh.size(ring_dim), mesh.size(uly_dim)
    ring_rank = mesh.get_local_rank(ring_dim)
    steps = ring_steps(ctx.layout_and_kernel()[0], ring_rank, ring_size, _members(uly_size), ctx.mask, batch, device)
    return mesh.get_group(ring_dim), mesh.get_group(uly_dim), uly_size, mesh.get_local_rank(uly_dim), steps


def _members(u: int) -> Callable[[int], tuple[int, ...]]:
    """The cp ranks of ring rank ``g``'s Ulysses group, in layout order."""
    return lambda g: tuple(range(g * u, (g + 1) * u))


class Hybrid(HeadExchange[tuple[RingGroup, RingSteps]]):
    """Ulysses inside each group of the ``cp_ulysses`` axis, the ring across ``cp_ring`` (module docstring)."""

    name = "hybrid"
    mesh_ndim = 2

    def ulysses_size(self, cp: int, ulysses_degree: int = 1) -> int:
        return ulysses_degree

    def ring_size(self, cp: int, ulysses_degree: int = 1) -> int:
        return cp // ulysses_degree

    def takes_ulysses_degree(self) -> bool:
        return True

    def check_degrees(self, cp: int, ulysses_degree: int = 1) -> None:
        if ulysses_degree < 1 or cp % ulysses_degree:
            raise ValueError(f"the hybrid strategy's ulysses degree ({ulysses_degree}) must divide its cp size ({cp})")

    def mesh_dims(self, cp: int, ulysses_degree: int = 1) -> tuple[tuple[str, int], ...]:
        return (("cp_ring", cp // ulysses_degree), ("cp_ulysses", ulysses_degree))

    def layout_rank(self, mesh: DeviceMesh) -> int:
        return hybrid_rank(mesh)

    def mesh_ulysses_degree(self, mesh: DeviceMesh) -> int:
        return mesh.size(hybrid_dims(mesh)[1])

    def heads(self, ctx: CPContext, batch: int, device: torch.device) -> Heads[tuple[RingGroup, RingSteps]]:
        ring_group, uly_group, u, part, steps = _axes(ctx, batch, device)
        kv = head_index(ctx.layout_and_kernel()[0], ctx.q_heads, ctx.kv_heads, u, device)
        return Heads(
            u,
            uly_group,
            part,
            kv,
            lambda x: stacked_to_concat(x, batch),
            lambda x: concat_to_stacked(x, batch, u),
            (ring_group, steps),
        )

    def attend(
        self,
        ctx: CPContext,
        x: Heads[tuple[RingGroup, RingSteps]],
        q_h: Tensor,
        k_h: Tensor,
        v_h: Tensor,
        batch: int,
        sinks: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        ring_group, steps = x.attend
        return ring_forward(q_h, k_h, v_h, ring_group, steps, ctx.layout_and_kernel()[1], ctx.scale, sinks)

    def attend_backward(
        self,
        ctx: CPContext,
        x: Heads[tuple[RingGroup, RingSteps]],
        dout_h: Tensor,
        q_h: Tensor,
        k_h: Tensor,
        v_h: Tensor,
        out_h: Tensor,
        lse_h: Tensor,
        batch: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        ring_group, steps = x.attend
        kernel = ctx.layout_and_kernel()[1]
        return ring_backward(dout_h, q_h, k_h, v_h, out_h, lse_h, ring_group, steps, kernel, ctx.scale)

    def ring_group(self, ctx: CPContext) -> RingGroup:
        """Every cp rank of the 2-D mesh in layout order, addressed by its global rank in the default group
        (no group is created: the op may run on some stages of a pipeline only)."""
        return None if ctx.cp_size == 1 or ctx.mesh is None else PeerComm(None, layout_peers(ctx.mesh))


HYBRID = register_strategy(Hybrid())
