"""Run a function on N gloo processes on this CPU, and fail (never hang) when it goes wrong.

Used by the distributed tests and the benchmarks (``torchrun`` is the launcher for training).

A :class:`DistPool` keeps ``world_size`` worker processes alive, each with a gloo process
group already initialised, so that the many small distributed tests of the suite pay the
start-up cost (importing torch, rendezvous) once per world size instead of once per test.

Workers start by ``spawn`` (each imports torch and titan_cp: seconds apiece) or, with ``preload``
(module names), fork from a ``multiprocessing`` forkserver that imported those modules once: the
workers of every pool then start in a fraction of a second with them already imported. The
forkserver is one per process, started with the first pool that asks for it: the first ``preload``
given is the one it keeps.

``pool.run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on every rank and returns the
list of per-rank results. ``fn`` must be importable by name (a module-level function), and
its arguments and results picklable.

Failure handling, the reason this file exists:
- a rank that raises sends back its exception and traceback; ``run`` re-raises it as
  :class:`RankError` naming the rank, with the remote traceback in the message;
- the other ranks may then be stuck in a collective that will never complete: after
  ``grace`` seconds the whole pool is killed and a fresh one starts on the next call;
- a rank that dies (segfault, ``os._exit``) or a call that exceeds ``timeout`` seconds
  kills the pool and raises, so a test fails within a bounded time instead of hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

_CTX = mp.get_context("spawn")
_FORKSERVER = mp.get_context("forkserver")


class RankError(RuntimeError):
    """An exception raised on one rank of a distributed test, with its remote traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, conn, collective_timeout_s: float, threads: int) -> None:
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        _one_gloo_device()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        _share_process_groups()
        # What the worker holds now (torch and the preloaded modules: ~0.5M objects) lives as long as
        # it does: frozen, the full collections of the calls to come (a measurement's gc.collect(), and
        # the automatic ones) scan only what the calls made, not the whole heap (0.2 s a pass).
        gc.freeze()
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            result = fn(rank, world_size, *args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - reported to the parent
            conn.send(("error", traceback.format_exc()))
    # Exit without tearing the default group down: that waits on the other ranks and would cost
    # seconds per pool at the end of every test session. Nothing is left to flush.
    conn.close()
    os._exit(0)


def _one_gloo_device() -> None:
    """Make every gloo group this worker creates (the default one, each mesh's) run on one gloo device.

    torch gives each gloo group a device of its own, and each device a thread that polls its sockets every 10 ms
    whether or not the group has work: ~0.1% of a core per group, for as long as the worker lives (a rank of a
    4-rank pool holds a dozen groups; the suite's pools, ~40). One device serves any number of groups (gloo's
    device carries every pair of every context on it): the groups' collectives are the same, their one poller
    wakes for all of them. The class torch builds groups with is replaced by a subclass taking that device,
    under which torch's ``isinstance`` checks of the backends it made still hold.
    """
    import datetime

    from torch.distributed import distributed_c10d as c10d

    gloo = c10d.ProcessGroupGloo
    device = gloo.create_default_device()

    class _Gloo(type(gloo)):  # type: ignore[misc]
        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, gloo)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, gloo)

    class OneDeviceGloo(gloo, metaclass=_Gloo):  # type: ignore[misc, valid-type]
        def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta = c10d.default_pg_timeout):
            options = gloo._Options()  # type: ignore[attr-defined]
            options._devices = [device]
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = OneDeviceGloo  # type: ignore[misc]


def _share_process_groups() -> None:
    """Make ``new_group`` in this worker return the group it made before for the same ranks and
    options, instead of a new one.

    Every mesh a call builds creates its sub-groups, each with its connections to the other ranks and
    its own threads for as long as the worker lives: over a session's hundreds of calls, a pool of 4
    ranks would hold over 300 groups a rank (on devices of their own, their pollers alone would take most
    of a core of a 2-core machine; see :func:`_one_gloo_device`). Sharing is exact: every rank makes the same
    ``new_group`` calls in the same order (the function requires it), so every rank shares the
    same groups, and collectives on a shared group run in the order the program issues them.
    """
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed import distributed_c10d as c10d

    made: dict[tuple, Any] = {}
    make = c10d.new_group

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, **kwargs):
        if pg_options is not None:  # options objects do not compare: make a group of their own
            return make(ranks, timeout, backend, pg_options, **kwargs)
        kwargs.pop("group_desc", None)
        key = (None if ranks is None else tuple(sorted(ranks)), timeout, backend, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = make(ranks, timeout, backend, **kwargs)
        return made[key]

    for module in (dist, c10d, device_mesh):
        # each binds new_group at run time (device_mesh imports it); device_mesh's stub does not export it
        module.new_group = new_group  # type: ignore[attr-defined]


class DistPool:
    """``world_size`` live gloo ranks that run test functions on request (``preload``: see the module's
    docstring)."""

    def __init__(
        self,
        world_size: int,
        collective_timeout_s: float = 120.0,
        start_timeout_s: float = 120.0,
        threads: int = 1,
        preload: Sequence[str] = (),
    ) -> None:
        self.world_size = world_size
        port = _free_port()
        self._conns = []
        self._procs = []
        ctx: Any = _CTX
        if preload:
            _FORKSERVER.set_forkserver_preload(list(preload))
            ctx = _FORKSERVER
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker, args=(rank, world_size, port, child, collective_timeout_s, threads), daemon=True
            )
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        replies = self._collect(start_timeout_s, grace=5.0)
        for rank, (status, payload) in enumerate(replies):
            if status != "ready":
                self.close()
                raise RankError(f"rank {rank} failed to start:\n{payload}")

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _collect(self, timeout: float, grace: float) -> list[tuple[str, Any]]:
        """Wait for one reply per rank; on error, timeout or death, kill the pool and raise."""
        replies: list[tuple[str, Any] | None] = [None] * self.world_size
        deadline = time.monotonic() + timeout
        first_error: tuple[int, str] | None = None
        while any(r is None for r in replies):
            now = time.monotonic()
            pending = [i for i, r in enumerate(replies) if r is None]
            if now > deadline:
                self.close()
                if first_error is not None:
                    rank, tb = first_error
                    raise RankError(f"rank {rank} raised (ranks {pending} then stuck):\n{tb}")
                raise TimeoutError(f"distributed call exceeded {timeout:.0f}s; ranks {pending} never finished")
            # asleep until a pending rank replies or ends, or the deadline (a poll would wake this process, on
            # the cores its ranks compute on, every few milliseconds of a call)
            wait([self._conns[i] for i in pending] + [self._procs[i].sentinel for i in pending], deadline - now)
            for rank in pending:
                conn = self._conns[rank]
                if conn.poll():
                    try:
                        reply = conn.recv()
                    except EOFError:
                        reply = ("error", f"rank {rank} died (exit code {self._procs[rank].exitcode})")
                elif not self._procs[rank].is_alive():
                    reply = ("error", f"rank {rank} died (exit code {self._procs[rank].exitcode})")
                else:
                    continue
                replies[rank] = reply
                if reply[0] == "error" and first_error is None:
                    first_error = (rank, reply[1])
                    deadline = min(deadline, time.monotonic() + grace)
        if first_error is not None:
            self.close()
            rank, tb = first_error
            raise RankError(f"rank {rank} raised:\n{tb}")
        return replies  # type: ignore[return-value]

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, grace: float = 10.0, **kwargs: Any
    ) -> list[Any]:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results by rank."""
        if not self.alive:
            raise RuntimeError("this DistPool was closed after an earlier failure")
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return [payload for _, payload in self._collect(timeout, grace)]

    def close(self) -> None:
        self._ask_to_stop()
        self._reap()

    def _ask_to_stop(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass

    def _reap(self) -> None:
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


class PoolCache:
    """One live :class:`DistPool` per world size, replaced after a failure.

    Starting a pool costs seconds (each worker imports torch), so pools stay alive between tests
    while their workers number at most ``max_processes`` (idle workers cost memory, and little
    CPU since their process groups are shared, see :func:`_share_process_groups`): the
    pools of worlds 1, 2, 3, 4 and 8 fit together. Past that, the least recently used pool closes.
    Every pool starts with ``preload`` (see :class:`DistPool`).
    """

    def __init__(self, max_processes: int = 18, preload: Sequence[str] = ()) -> None:
        self._pools: dict[int, DistPool] = {}
        self._max = max_processes
        self._preload = tuple(preload)

    def get(self, world_size: int) -> DistPool:
        pool = self._pools.pop(world_size, None)
        if pool is not None and pool.alive:
            self._pools[world_size] = pool  # most recently used last
            return pool
        while self._pools and sum(self._pools) + world_size > self._max:
            oldest = next(iter(self._pools))
            self._pools.pop(oldest).close()
        pool = DistPool(world_size, preload=self._preload)
        self._pools[world_size] = pool
        return pool

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self.get(world_size).run(fn, *args, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool._ask_to_stop()  # every pool at once: each rank exits on its own
        for pool in self._pools.values():
            pool._reap()
        self._pools.clear()
