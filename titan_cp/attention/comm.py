"""Communication for the strategies: ring exchange and differentiable collectives.

Every byte a strategy hands to a communication call is counted in :data:`COMM_COUNTER`
(``bytes_sent``: the bytes that leave this rank), so benchmarks can compare what was
actually sent with each strategy's theoretical minimum.

The collectives are differentiable; each backward is the *dual* collective of its
forward::

    forward                               backward
    y = all_gather(x)        along dim    dx = reduce_scatter(dy)  along dim
    y = all_to_all(x)  scatter a, gather b   dx = all_to_all(dy)  scatter b, gather a
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommCounter:
    """Bytes this rank handed to communication calls, bound for other ranks."""

    bytes_sent: int = 0
    calls: int = 0

    def add(self, nbytes: int) -> None:
        self.bytes_sent += int(nbytes)
        self.calls += 1

    def reset(self) -> None:
        self.bytes_sent = 0
        self.calls = 0

    @contextlib.contextmanager
    def measure(self):
        """``with COMM_COUNTER.measure() as c: ...`` counts from zero inside the block."""
        self.reset()
        yield self


COMM_COUNTER = CommCounter()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Exchange:
    """One in-flight ring step: a send to the next rank and a receive from the previous one."""

    def __init__(self, reqs, recv: torch.Tensor):
        self._reqs, self._recv = reqs, recv

    def wait(self) -> torch.Tensor:
        for req in self._reqs:
            req.wait()
        self._reqs = []
        return self._recv


class RingComm:
    """Point-to-point transport to the ring neighbours of this rank in ``group``.

    ``send_recv(t)`` posts ``isend(t -> next)`` and ``irecv(prev -> buffer)`` together and
    returns at once; computation proceeds while the transfer is in flight, and
    ``Exchange.wait()`` hands over the received buffer (double buffering: the buffer in
    use and the one arriving are different tensors). ``tag`` keeps two concurrent
    streams (K/V and their gradients) apart.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = (self.rank + 1) % self.world
        self.prev = (self.rank - 1) % self.world

    def send_recv(self, send: torch.Tensor, tag: int = 0) -> Exchange:
        send = send.contiguous()
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, group=self.group, group_peer=self.next, tag=tag),
            dist.P2POp(dist.irecv, recv, group=self.group, group_peer=self.prev, tag=tag),
        ]
        COMM_COUNTER.add(_nbytes(send))
        return Exchange(dist.batch_isend_irecv(ops), recv)


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((n,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    COMM_COUNTER.add((n - 1) * _nbytes(x))
    dist.all_gather_into_tensor(out.view(n * x.shape[0], *x.shape[1:]), x, group=group)
    return torch.cat(out.unbind(0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    chunks = torch.stack(x.chunk(n, dim=dim)).contiguous()  # (n, ...): chunk j is rank j's
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    COMM_COUNTER.add(_nbytes(chunks) * (n - 1) // n)
    dist.reduce_scatter_tensor(out, chunks.view(-1, *chunks.shape[2:]), group=group)
    return out


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    chunks = torch.stack(x.chunk(n, dim=scatter_dim)).contiguous()  # chunk j goes to rank j
    out = torch.empty_like(chunks)
    COMM_COUNTER.add(_nbytes(chunks) * (n - 1) // n)
    dist.all_to_all_single(out, chunks, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)  # chunk j came from rank j


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter(dy, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, dy):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(dy, gather_dim, scatter_dim, ctx.group), None, None, None


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); backward: reduce-scatter."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllGather.apply(x, dim % x.dim(), group)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim``, send chunk j to rank j, concatenate what arrives along ``gather_dim``.

    Backward: the same exchange with the two dims swapped.
    """
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, scatter_dim % x.dim(), gather_dim % x.dim(), group)
