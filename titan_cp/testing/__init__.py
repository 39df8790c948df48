"""Helpers shared by the tests and the benchmarks: a gloo process pool (:mod:`.pool`),
document-length rows and mixes (:mod:`.docs`), packed microbatches and CP meshes (:mod:`.batches`)."""

from titan_cp.testing.batches import cp_mesh, doc_lens_tensor, labels_and_positions, packed_batch
from titan_cp.testing.docs import ROW_MIXES, fill_row, lognormal_doc_lens, make_rows, proportional_doc_lens
from titan_cp.testing.pool import DistPool, PoolCache, RankError

__all__ = [
    "DistPool",
    "PoolCache",
    "ROW_MIXES",
    "RankError",
    "cp_mesh",
    "doc_lens_tensor",
    "fill_row",
    "labels_and_positions",
    "lognormal_doc_lens",
    "make_rows",
    "packed_batch",
    "proportional_doc_lens",
]
