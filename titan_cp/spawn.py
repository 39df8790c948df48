"""Moved to :mod:`titan_cp.testing.pool`; re-exported here so older imports keep working."""

from titan_cp.testing.pool import DistPool, PoolCache, RankError

__all__ = ["DistPool", "PoolCache", "RankError"]
