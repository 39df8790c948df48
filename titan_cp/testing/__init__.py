"""Helpers shared by the tests and the benchmarks: a gloo process pool (:mod:`.pool`), packed
microbatches and CP meshes (:mod:`.batches`). Document-length rows and mixes live in the package,
:mod:`titan_cp.data.row_mixes`."""

from titan_cp.testing.batches import doc_lens_tensor, labels_and_positions, packed_batch, strategy_mesh
from titan_cp.testing.pool import DistPool, PoolCache, RankError

__all__ = [
    "DistPool",
    "PoolCache",
    "RankError",
    "strategy_mesh",
    "doc_lens_tensor",
    "labels_and_positions",
    "packed_batch",
]
