"""Rows to the ranks that need them, and their gradients back: the one transport of linear attention.

::

    forward    recv = the rows of every peer's ``sent`` this rank needs     (plan.send / plan.recv)
    backward   d_sent[rows sent to p] += d_recv[rows received from p]      (the same exchange, reversed)

One ``all_to_all`` with uneven splits carries every rank's rows (a rank with nothing to send sends zero
rows); where nothing crosses a rank boundary anywhere (every document whole on one rank) no rank
calls it at all: every rank knows that from the layout, as it knows every size.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_cp.attention.comm import all_to_all_uneven
from titan_cp.attention.hybrid import layout_peers
from titan_cp.attention.linear.plan import rows_index


class Transport:
    """The cp ranks of a mesh as one process group, with each layout rank's rank in it."""

    def __init__(self, group: dist.ProcessGroup, group_rank: tuple[int, ...]) -> None:
        self.group, self.group_rank = group, group_rank

    def splits(self, rows: dict[int, int]) -> list[int]:
        """Per group rank, the rows of ``rows`` (keyed by layout rank; absent: zero)."""
        out = [0] * len(self.group_rank)
        for rank, n in rows.items():
            out[self.group_rank[rank]] = n
        return out


@functools.lru_cache(maxsize=8)
def transport(mesh: DeviceMesh | None) -> Transport | None:
    """The :class:`Transport` of a cp ``mesh`` (a 2-D hybrid mesh flattened, its ranks numbered in layout
    order: ring x ulysses); ``None`` on one device."""
    if mesh is None or mesh.size() == 1:
        return None
    if mesh.ndim == 1:
        group = mesh.get_group()
        return Transport(group, tuple(range(mesh.size())))
    group = mesh._flatten().get_group()
    return Transport(group, tuple(dist.get_group_rank(group, g) for g in layout_peers(mesh)))


def _blocks(x: torch.Tensor, rows: dict[int, int], order: list[int]) -> torch.Tensor:
    """``x``'s blocks of ``rows[r]`` rows, laid out in layout-rank order, put in ``order``."""
    at, block = 0, {}
    for r in sorted(rows):
        block[r] = (at, rows[r])
        at += rows[r]
    keys = [r for r in order if r in block]
    if keys == sorted(block):
        return x
    return torch.cat([x[block[r][0] : block[r][0] + block[r][1]] for r in keys])


def _exchange(comm: Transport, x: torch.Tensor, send: dict[int, int], recv: dict[int, int]) -> torch.Tensor:
    """``x`` holds the rows for each layout rank in layout-rank order (``send`` of them each); the result,
    the rows from each, in layout-rank order (``recv`` of them each). ``all_to_all`` numbers peers by
    group rank: blocks are put in that order for the call and back in layout order after it."""
    by_group = sorted(range(len(comm.group_rank)), key=lambda r: comm.group_rank[r])
    out = x.new_empty((sum(recv.values()), *x.shape[1:]))
    got = all_to_all_uneven(_blocks(x, send, by_group), comm.splits(send), comm.splits(recv), comm.group, out)
    if by_group == sorted(by_group):
        return got
    at, block = 0, {}
    for r in by_group:
        block[r] = got[at : at + recv.get(r, 0)]
        at += recv.get(r, 0)
    return torch.cat([block[r] for r in sorted(block)])


def send_rows(
    comm: Transport | None,
    sent: torch.Tensor,
    send: dict[int, tuple[int, ...]],
    recv: dict[int, int],
    crosses: bool,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(sum(recv), *sent.shape[1:])``: the rows each peer sends this rank, in layout-rank order; this
    rank sends ``sent[send[p]]`` to each peer ``p`` (``index``: those rows, peers in order, on ``sent``'s
    device, :func:`.plan.rows_index`). ``crosses``: whether any row crosses anywhere."""
    if comm is None or not crosses:
        return sent.new_empty((0, *sent.shape[1:]))
    index = rows_index(send).to(sent.device) if index is None else index
    return _exchange(comm, sent.index_select(0, index), {p: len(v) for p, v in send.items()}, recv)


def return_rows(
    comm: Transport | None,
    d_recv: torch.Tensor,
    d_sent: torch.Tensor,
    send: dict[int, tuple[int, ...]],
    recv: dict[int, int],
    crosses: bool,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`send_rows`' backward: each received row's gradient goes back to the peer it came from and
    is added into ``d_sent`` (in place) at the rows sent there."""
    if comm is None or not crosses:
        return d_sent
    back = _exchange(comm, d_recv, recv, {p: len(v) for p, v in send.items()})
    index = rows_index(send).to(d_sent.device) if index is None else index
    return d_sent.index_add_(0, index, back)
