"""Communication for the strategies: point-to-point exchanges and three collectives.

The strategies write their backward by hand (the attention is one custom op, see
:mod:`titan_cp.attention.api`), each collective's backward being its *dual*::

    forward                                  backward
    y = all_gather(x)                        dx = reduce_scatter(dy)
    y = all_to_all(x)  (chunk j -> rank j)   dx = all_to_all(dy)  (the same exchange, reversed)

Counting is opt-in: inside ``with count_comm() as c:`` every call adds the bytes that
leave this rank to ``c.bytes_sent`` (benchmarks and tests compare them with each
strategy's minimum); outside, nothing is counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.distributed as dist

Message: TypeAlias = torch.Tensor | tuple[torch.Tensor, ...] | None
"""What one exchange sends or receives: nothing, one tensor, or a tuple of them (in order)."""


@dataclass
class CommCounter:
    """Bytes this rank handed to communication calls, bound for other ranks."""

    bytes_sent: int = 0
    calls: int = 0


_COUNTER: CommCounter | None = None


@contextlib.contextmanager
def count_comm() -> Iterator[CommCounter]:
    """``with count_comm() as c: ...``: ``c.bytes_sent`` and ``c.calls`` count from zero inside the block."""
    global _COUNTER
    outer, _COUNTER = _COUNTER, CommCounter()
    try:
        yield _COUNTER
    finally:
        _COUNTER = outer


def _count(nbytes: int) -> None:
    if _COUNTER is not None:
        _COUNTER.bytes_sent += int(nbytes)
        _COUNTER.calls += 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Exchange:
    """One in-flight exchange: a send to one peer and a receive from another (either may be absent)."""

    def __init__(self, reqs: Sequence[dist.Work], recv: Message) -> None:
        self._reqs, self._recv = reqs, recv

    def wait(self) -> Message:
        """The received buffer or tuple of buffers (``None`` when nothing was to be received), once the
        transfers are done."""
        for req in self._reqs:
            req.wait()
        self._reqs = []
        return self._recv


NOTHING = Exchange([], None)


def _parts(x: Message) -> tuple[torch.Tensor, ...]:
    """A message's tensors: ``None`` (nothing), one tensor, or a tuple of them (sent in order)."""
    return () if x is None else (x,) if isinstance(x, torch.Tensor) else tuple(x)


class PeerComm:
    """Point-to-point transport between the ranks of ``group``.

    ``exchange(send, dst, recv, src)`` posts ``isend(send -> dst)`` and ``irecv(src -> recv)``
    (an empty buffer of the expected shape) together and returns at once (a message may be a tuple
    of tensors, e.g. K rows and V rows as views where they lie, sent and received in order);
    computation proceeds while the transfer is in flight, and ``Exchange.wait()`` hands over the received buffer (double
    buffering: the buffer in use and the one arriving are different tensors). Either side may be
    absent (``send=None``, ``recv=None``): what to send and receive is known on both ends
    from the layout, so no size is ever exchanged. ``tag`` keeps two concurrent streams (K/V and
    their gradients) apart; every rank posts its operations in the same order, as NCCL requires.

    ``peers``: where the ranks a strategy numbers (``dst``, ``src``) are not ``group``'s own, each one's
    rank in ``group`` (e.g. every cp rank of a 2-D mesh in layout order, its global rank, with
    ``group=None``: the default group, which holds them all and needs no group created).
    """

    def __init__(self, group: dist.ProcessGroup | None, peers: tuple[int, ...] | None = None) -> None:
        self.group, self.peers = group, peers

    def _peer(self, rank: int) -> int:
        return rank if self.peers is None else self.peers[rank]

    def exchange(self, send: Message, dst: int, recv: Message, src: int, tag: int = 0) -> Exchange:
        ops = []
        for t in _parts(send):
            t = t.contiguous()
            ops.append(dist.P2POp(dist.isend, t, group=self.group, group_peer=self._peer(dst), tag=tag))
            _count(_nbytes(t))
        for t in _parts(recv):
            ops.append(dist.P2POp(dist.irecv, t, group=self.group, group_peer=self._peer(src), tag=tag))
        if not ops:
            return NOTHING
        return Exchange(dist.batch_isend_irecv(ops), recv)


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(N, *x.shape)``: every rank's ``x``, stacked by rank (into ``out`` if given, a contiguous tensor
    of that shape). Backward: :func:`reduce_scatter`."""
    n = dist.get_world_size(group)
    x = x.contiguous()
    if out is None:
        out = torch.empty((n,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    _count((n - 1) * _nbytes(x))
    dist.all_gather_single(out.view(n * x.shape[0], *x.shape[1:]) if x.dim() else out, x, group=group)
    return out


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` ``(N, ...)``: chunk ``j`` summed over ranks lands on rank ``j``. Backward: :func:`all_gather`."""
    n = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    _count(_nbytes(x) * (n - 1) // n)
    dist.reduce_scatter_tensor(out, x.view(-1, *x.shape[2:]), group=group)
    return out


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` ``(N, ...)``: chunk ``j`` goes to rank ``j``; the result's chunk ``j`` came from rank ``j``.

    Self-dual: the backward is the same exchange applied to the gradient.
    """
    n = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty_like(x)
    _count(_nbytes(x) * (n - 1) // n)
    dist.all_to_all_single(out, x, group=group)
    return out


def all_to_all_uneven(
    x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None, out: torch.Tensor
) -> torch.Tensor:
    """``x`` holds ``send[j]`` rows (dim 0) for each rank ``j`` in order; ``out`` receives ``recv[j]`` rows
    from each rank ``j`` in order (sizes known on both sides). Self-dual, with the sizes swapped."""
    me = dist.get_rank(group)
    row = _nbytes(x[:1]) if x.shape[0] else 0
    _count(row * (sum(send) - send[me]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out
