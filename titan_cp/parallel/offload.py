"""Checkpointed block inputs in host memory, copied on a side stream and prefetched back.

Under activation checkpointing the only tensors a checkpoint unit leaves in the autograd
graph are its inputs (``torch.utils.checkpoint``'s non-reentrant frame saves them through the
saved-tensor hooks that are active around the checkpoint call; everything inside the unit is
recomputed). :class:`HostActivationStore` is such a pair of hooks
(``torch.autograd.graph.saved_tensors_hooks``), entered around each unit's checkpoint:

  pack    (forward)   a floating-point input ``(B, S_local, D)`` (or RoPE ``cos``/``sin``) is
                      copied into pinned host memory on a side stream; the device tensor is
                      released as soon as the copy is queued (``record_stream`` keeps its memory
                      until the copy has read it). A tensor given to several units (RoPE tables)
                      is stored once. Integer tensors (document lengths) are kept as they are.
  unpack  (backward)  when unit u's recomputation asks for its inputs, they are copied back
                      (already, when prefetched) and the inputs of the ``prefetch`` units before
                      it are queued on the side stream, so that their copies overlap unit u's
                      recomputation and backward; the compute stream waits on an event, the host
                      never.

On a CPU the "device" and the host are the same memory and the copies are ordinary copies; the
bookkeeping (what is stored, what is fetched when) is the same and counted:
:attr:`HostActivationStore.max_device_inputs` is the most units whose inputs were alive outside
the store at once during a backward (device copies handed to autograd or prefetched), at most
``prefetch + 1`` whatever the depth.

``torch.autograd.graph.save_on_cpu`` does the synchronous part of this (pinned copies, no side
stream, no prefetch, every saved tensor); it is not used because it would stall the compute
stream on every copy and could not prefetch.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(eq=False)
class _Entry:
    """One stored tensor: its host copy and, while fetched, its device copy."""

    host: Tensor
    device: torch.device
    unit: int
    units: set[int] = field(default_factory=set)  # the units that saved it (several: a shared RoPE table)
    prefetched: Tensor | None = None  # a device copy queued ahead of the unpack
    ready: torch.cuda.Event | None = None  # the side stream's event after the host -> device copy (CUDA)
    live: weakref.ref[Tensor] | None = None  # the device copy handed to autograd
    alive: int = 0  # tickets (saved-variable handles) still referring to it
    keep: Tensor | None = None  # a shared entry's device copy, kept until its last ticket dies


class _Ticket:
    """What autograd keeps for one saved input: a handle on the entry (freed with the graph)."""

    __slots__ = ("__weakref__", "entry")

    def __init__(self, entry: _Entry) -> None:
        self.entry = entry


class HostActivationStore:
    """Saved-tensor hooks that keep checkpoint units' inputs in (pinned) host memory.

    ``with store.unit(): <run a unit's checkpoint>`` stores what the checkpoint saves, as the next unit
    (units are numbered in call order: the backward meets them in the reverse order, also with
    several microbatches in flight under a pipeline schedule). ``prefetch``: units whose inputs are
    copied back ahead of their backward (1 or 2). Counts: :attr:`host_bytes` (now),
    :attr:`peak_host_bytes`, :attr:`max_device_inputs` (see module doc), :attr:`stored`, :attr:`fetched`.
    """

    def __init__(self, prefetch: int = 1) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.prefetch = prefetch
        self._entries: dict[int, list[_Entry]] = {}  # unit -> the entries it stored first
        self._by_id: dict[int, tuple[weakref.ref, _Entry]] = {}  # device tensor id -> entry (sharing)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._unit, self._next_unit = -1, 0
        self.host_bytes = self.peak_host_bytes = self.max_device_inputs = 0
        self.stored = self.fetched = 0

    @contextlib.contextmanager
    def unit(self) -> Iterator[None]:
        """Store the tensors saved in this context as the next unit's inputs."""
        previous, self._unit = self._unit, self._next_unit
        self._next_unit += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._unit = previous

    def reset_counts(self) -> None:
        self.peak_host_bytes, self.max_device_inputs, self.stored, self.fetched = self.host_bytes, 0, 0, 0

    # -- forward ---------------------------------------------------------------------------------

    def _pack(self, t: Tensor):
        if not t.is_floating_point():
            return t  # document lengths, positions: small, often already on the host
        known = self._by_id.get(id(t))
        if known is not None and known[0]() is t:
            entry = known[1]
        else:
            entry = _Entry(self._to_host(t), t.device, self._unit)
            self._entries.setdefault(self._unit, []).append(entry)
            self._by_id[id(t)] = (weakref.ref(t), entry)
            self.host_bytes += entry.host.numel() * entry.host.element_size()
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
            self.stored += 1
        entry.units.add(self._unit)
        entry.alive += 1
        ticket = _Ticket(entry)
        weakref.finalize(ticket, self._release, entry)
        return ticket

    def _to_host(self, t: Tensor) -> Tensor:
        """``t``'s copy in host memory (pinned, filled on the side stream, when ``t`` is on CUDA)."""
        if t.device.type != "cuda":
            return t.detach().clone()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        side, current = self._side(t.device), torch.cuda.current_stream(t.device)
        side.wait_stream(current)  # t is written
        with torch.cuda.stream(side):
            host.copy_(t.detach(), non_blocking=True)
        t.record_stream(side)  # its memory is not reused before the copy has read it
        return host

    def _side(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    # -- backward --------------------------------------------------------------------------------

    def _unpack(self, ticket) -> Tensor:
        if not isinstance(ticket, _Ticket):
            return ticket
        entry = ticket.entry
        dev = entry.live() if entry.live is not None else None
        if dev is None:
            if entry.prefetched is None:
                self._fetch(entry)
            dev = entry.prefetched
            if dev is None:
                raise RuntimeError("the host activation store queued no device copy of a saved input")
            if entry.ready is not None:
                torch.cuda.current_stream(entry.device).wait_event(entry.ready)
            entry.prefetched, entry.ready, entry.live = None, None, weakref.ref(dev)
            if len(entry.units) > 1:  # a table shared by units (RoPE): one device copy for the whole backward
                entry.keep = dev
            self.fetched += 1
        self._prefetch_before(entry.unit if len(entry.units) == 1 else min(entry.units))
        self._count()
        return dev

    def _fetch(self, entry: _Entry) -> None:
        """Queue ``entry``'s copy back to its device (on the side stream, on CUDA)."""
        if entry.device.type != "cuda":
            entry.prefetched = entry.host.clone()
            return
        current = torch.cuda.current_stream(entry.device)
        dev = torch.empty(entry.host.shape, dtype=entry.host.dtype, device=entry.device)  # on the compute stream
        side = self._side(entry.device)
        side.wait_stream(current)  # the memory is free on the compute stream
        with torch.cuda.stream(side):
            dev.copy_(entry.host, non_blocking=True)
            ready = entry.ready = torch.cuda.Event()
            ready.record(side)
        entry.prefetched = dev

    def _prefetch_before(self, unit: int) -> None:
        """Queue the inputs of the ``prefetch`` units stored before ``unit``."""
        earlier = sorted((u for u in self._entries if u < unit), reverse=True)[: self.prefetch]
        for u in earlier:
            for entry in self._entries[u]:
                if entry.prefetched is None and (entry.live is None or entry.live() is None):
                    self._fetch(entry)

    def _count(self) -> None:
        """Units with inputs alive outside the host store now (shared tables left out)."""
        live = {
            u
            for u, entries in self._entries.items()
            for e in entries
            if len(e.units) == 1 and (e.prefetched is not None or (e.live is not None and e.live() is not None))
        }
        self.max_device_inputs = max(self.max_device_inputs, len(live))

    def _release(self, entry: _Entry) -> None:
        """A saved-variable handle died (its graph was freed): drop the entry with its last one."""
        entry.alive -= 1
        if entry.alive:
            return
        stored = self._entries.get(entry.unit, [])
        if entry in stored:
            stored.remove(entry)
            if not stored:
                del self._entries[entry.unit]
        self._by_id = {k: v for k, v in self._by_id.items() if v[1] is not entry}
        self.host_bytes -= entry.host.numel() * entry.host.element_size()
        entry.prefetched = entry.live = entry.keep = None


def offload_metrics(parts: Iterable[object]) -> dict[str, int]:
    """The host stores' figures since the last call, for a step's metrics record: ``host_activation_peak_bytes``
    (checkpointed inputs in host memory, at most) and ``device_inputs_max`` (units' inputs alive outside
    the store at once in the backward), summed over ``parts`` (modules with an ``activation_store``); {} when
    nothing is offloaded. Resets the counts."""
    stores = [s for s in (getattr(p, "activation_store", None) for p in parts) if s is not None]
    if not stores:
        return {}
    record = {
        "host_activation_peak_bytes": sum(s.peak_host_bytes for s in stores),
        "device_inputs_max": sum(s.max_device_inputs for s in stores),
    }
    for s in stores:
        s.reset_counts()
    return record
