"""The multi-process harness lives in :mod:`titan_cp.spawn`; tests import it from here too."""

from titan_cp.spawn import DistPool, PoolCache, RankError  # noqa: F401
