import gc
import os
import sys

import pytest

# What every pool worker imports anyway, and the heavy libraries a collected test module imports (it has
# imported them in this process by the time the first pool starts): the workers fork from one process
# that imported these once (PoolCache's preload), instead of each importing them after it starts.
_HEAVY = {"transformers": "transformers.trainer", "trl": "trl.trainer.sft_trainer"}

# Inductor on a CPU compiles C++ with gcc. Before its first kernel it probes which vector ISAs the compiler
# and the CPU support: six compiles (7 s on a clean machine, more than the kernels of the two tests that
# compile through inductor). Scalar kernels lower the same graphs: the tests check titan_cp's graphs, not
# inductor's vectoriser (on a GPU inductor writes Triton instead).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# Its kernels compiled in the test process: a pool of compile workers (a process importing torch, then its
# workers) costs more CPU than the few kernels a test compiles, on cores both test processes already use.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Each module compiled once: the suite writes Python's bytecode caches (``__pycache__``, ignored by git) even
# where PYTHONDONTWRITEBYTECODE is set, as on the machines it is sized for. Otherwise each of its processes
# (the test processes, their forkservers, every launched rank) compiles titan_cp and rewrites the test modules
# again: ~3 s of each test process's collection, and a fraction of a second of each launch's ranks.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def own_cores(cores: list[int], worker: str, count: int) -> list[int]:
    """The cores of pytest-xdist's test process ``worker`` (``gw<i>``) of ``count``, of the ``cores`` the session
    may use: worker ``i`` takes cores ``i``, ``i + count``, ... (one each on the 2-core machine; where the workers
    outnumber the cores, one each, shared)."""
    return cores[int(worker.removeprefix("gw")) % len(cores) :: count]


# Under pytest-xdist (``-n 2``: one test process per core) each test process computes on one thread,
# keeps fewer idle pool workers alive, and runs, with every process it starts (its pools' ranks, the
# programs it launches: they inherit it), on its own share of the cores (:func:`own_cores`). Left free to run
# on either core, the two processes' ranks took 629-638 CPU seconds for the tests where they take 537-594 each
# on its own core (benchmarks/results/2026-12-06-suite-cpu.md).
_XDIST = "PYTEST_XDIST_WORKER" in os.environ
if _XDIST:  # torch only here and in the fixture: pytest-xdist's controller, which runs no test, loads this too
    import torch

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):  # Linux
        _cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(
            0, own_cores(_cores, os.environ["PYTEST_XDIST_WORKER"], int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        )
    gc.disable()  # while the test modules import what they need: all of it lives on (see below)


# The files that take longest, longest first (wall seconds on a 2-core machine, 2026-12-05): the two test
# processes take files in collection order (--no-loadscope-reorder), so the long ones start first and the
# short ones fill in behind them, and neither process is left alone at the end with a long one.
_LONGEST_FIRST = (  # summed wall seconds of each file's tests in a full run here, 2026-12-05
    "test_torchtitan.py",  # 93: one forked launch of the page's blocks
    "test_train.py",  # 62
    "test_gpu_model.py",  # 37
    "test_hf_integration.py",  # 34
    "test_plan.py",  # 30
    "test_hot_path.py",  # 22
    "test_long_context.py",  # 21
    "test_errors.py",  # 18
    "test_documents.py",  # 18
    "test_composition.py",  # 18
    "test_hf_hybrid.py",  # 17
    "test_examples.py",  # 17
    "test_generate.py",  # 14
    "test_docs.py",  # 13
)


def pytest_collection_modifyitems(session, config, items):
    """Items grouped by file, the files of :data:`_LONGEST_FIRST` first in its order, the others by their number
    of tests (most first: xdist's own default order), each file's items in their own order."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.path.name, []).append(item)
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    order = sorted(files, key=lambda name: (rank.get(name, len(rank)), -len(files[name])))
    items[:] = [item for name in order for item in files[name]]


def pytest_collection_finish(session):
    """The test modules and what they import (torch, transformers, TRL, torchtitan: ~0.5M objects) live as
    long as this process: frozen, the full collections while the tests run scan only what the tests make."""
    gc.freeze()
    gc.enable()


def pytest_unconfigure(config):
    gc.unfreeze()  # collected at exit again (triton's nanobind bindings report what they see leaked)


@pytest.fixture(scope="session")
def dist_pools():
    """Live gloo process pools keyed by world size: ``dist_pools.run(world, fn, *args)``."""
    from titan_cp.testing.pool import PoolCache  # noqa: PLC0415 - see the imports

    # torch._dynamo: titan_cp does not import it (1.5 s), the trainer's pipelining and every compiled test do.
    # A worker imports the test module of each function it runs (pytest, the shared helpers): of a session's
    # ~60 workers most import pytest and these (0.3 s a worker), so the forkserver imports them once.
    preload = [
        "titan_cp.testing.pool",
        "torch._dynamo",
        "pytest",
        "tests.dist_utils",
        "titan_cp.train",
        "titan_cp.parallel",
        "titan_cp.integrations.hf_family",
        *(heavy for lib, heavy in _HEAVY.items() if lib in sys.modules),
    ]
    cache = PoolCache(max_processes=10 if _XDIST else 18, preload=preload)
    yield cache
    cache.close()
