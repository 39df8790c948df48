"""The multi-process harness itself: results come back, errors carry their rank and
traceback, and a dead rank or a collective that never completes fails in bounded time."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.conftest import own_cores
from titan_cp.testing.pool import DistPool, RankError

# the failing pools below fork their workers from the forkserver (started once), but one that spawns them,
# as the benchmarks' pools do
FORKED = dict(preload=["titan_cp.testing.pool"])


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_one(rank, world_size):
    if rank == world_size - 1:
        raise ValueError("boom on the last rank")
    t = torch.zeros(1)
    dist.all_reduce(t)  # never completes: the last rank is gone
    return rank


def _die(rank, world_size):
    if rank == 0:
        os._exit(3)
    time.sleep(60)


def _hang(rank, world_size):
    if rank == 0:
        time.sleep(60)
    return rank


def test_results_come_back_by_rank(dist_pools):
    assert dist_pools.run(3, _sum_ranks) == [3.0, 3.0, 3.0]


def test_exception_names_rank_and_traceback():
    pool = DistPool(2, collective_timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 raised.*boom on the last rank"):
        pool.run(_raise_on_one, grace=0.5)
    assert time.monotonic() - t0 < 20
    assert not pool.alive


def test_dead_rank_fails_fast():
    pool = DistPool(2, **FORKED)
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 0 died"):
        pool.run(_die, grace=0.5)
    assert time.monotonic() - t0 < 20


def test_timeout_fails_instead_of_hanging():
    pool = DistPool(2, **FORKED)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] never finished"):
        pool.run(_hang, timeout=1.0)
    assert time.monotonic() - t0 < 20


def _mesh_groups(rank, world_size):
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("a", "b"))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group("b"))
    return len(c10d._world.pg_map), t.item()


def test_meshes_share_process_groups_between_calls(dist_pools):
    """A new mesh over the same ranks reuses the worker's groups: their count stays put
    (each gloo group keeps its connections and threads for the worker's life)."""
    first = dist_pools.run(2, _mesh_groups)
    assert dist_pools.run(2, _mesh_groups) == first
    assert [total for _, total in first] == [1.0, 1.0]


def _groups_and_pollers(rank, world_size, timeouts):
    """New groups over every rank (their own timeouts: groups of their own, not shared ones), a sum on each;
    the sums and the rank's gloo device pollers (gloo names each device's thread ``gloo_tcp_loop``)."""
    import datetime

    groups = [dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=s)) for s in timeouts]
    sums = []
    for group in groups:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        sums.append(t.item())
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sums, names.count("gloo_tcp_loop")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the threads' names in /proc (Linux)")
def test_a_ranks_gloo_groups_share_one_device(dist_pools):
    """Each gloo group on a device of its own polls its sockets every 10 ms for the worker's life; a pool's
    ranks run every group, the default one and four more, on one device, and the sums are the same."""
    assert dist_pools.run(2, _groups_and_pollers, [601, 602, 603, 604]) == [([3.0] * 4, 1)] * 2


def test_the_test_processes_share_the_cores_out():
    assert [own_cores([0, 1], f"gw{i}", 2) for i in range(2)] == [[0], [1]]  # the 2-core machine
    assert [own_cores(list(range(8)), f"gw{i}", 2) for i in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [own_cores([0, 1], f"gw{i}", 3) for i in range(3)] == [[0], [1], [0]]  # more workers than cores
    assert own_cores([4, 5], "gw0", 1) == [4, 5]


def _cores(rank, world_size):
    return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(
    "PYTEST_XDIST_WORKER" not in os.environ or not hasattr(os, "sched_setaffinity"),
    reason="under pytest-xdist, on Linux (tests/conftest.py)",
)
def test_a_test_process_and_its_ranks_run_on_its_share_of_the_cores(dist_pools):
    session = sorted(os.sched_getaffinity(os.getppid()))  # pytest-xdist's controller: the session's cores
    mine = own_cores(session, os.environ["PYTEST_XDIST_WORKER"], int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    assert sorted(os.sched_getaffinity(0)) == mine
    assert dist_pools.run(2, _cores) == [mine, mine]  # the pools' ranks inherit it
