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

# Under pytest-xdist (``-n 2``: one test process per core) each test process computes on one thread and
# keeps fewer idle pool workers alive: the two share the cores and the memory.
_XDIST = "PYTEST_XDIST_WORKER" in os.environ
if _XDIST:  # torch only here and in the fixture: pytest-xdist's controller, which runs no test, loads this too
    import torch

    torch.set_num_threads(1)
    gc.disable()  # while the test modules import what they need: all of it lives on (see below)


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
