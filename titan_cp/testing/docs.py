"""Document-length rows and mixes for the tests and benchmarks: they live in the package,
:mod:`titan_cp.data.row_mixes` (the planner's ``--doc-mix`` uses them too)."""

from titan_cp.data.row_mixes import BALANCE_MIXES, fill_row, lognormal_doc_lens, make_rows, proportional_doc_lens
from titan_cp.data.row_mixes import ROW_MIXES as MIXES

__all__ = ["BALANCE_MIXES", "MIXES", "fill_row", "lognormal_doc_lens", "make_rows", "proportional_doc_lens"]
