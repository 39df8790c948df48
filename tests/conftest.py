import pytest

from titan_cp.testing.pool import PoolCache


@pytest.fixture(scope="session")
def dist_pools():
    """Live gloo process pools keyed by world size: ``dist_pools.run(world, fn, *args)``."""
    cache = PoolCache()
    yield cache
    cache.close()
