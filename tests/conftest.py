import sys

import pytest

from titan_cp.testing.pool import PoolCache

# What every pool worker imports anyway, and the heavy libraries a collected test module imports (it has
# imported them in this process by the time the first pool starts): the workers fork from one process
# that imported these once (PoolCache's preload), instead of each importing them after it starts.
_HEAVY = {"transformers": "transformers.trainer", "trl": "trl.trainer.sft_trainer"}


@pytest.fixture(scope="session")
def dist_pools():
    """Live gloo process pools keyed by world size: ``dist_pools.run(world, fn, *args)``."""
    preload = ["titan_cp.testing.pool", *(heavy for lib, heavy in _HEAVY.items() if lib in sys.modules)]
    cache = PoolCache(preload=preload)
    yield cache
    cache.close()
