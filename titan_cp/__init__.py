"""titan_cp: context parallelism for PyTorch, native to DeviceMesh, DTensor and ParallelStyle."""

from typing import Any

from titan_cp.attention import CPHandle, cp_attention, local_attention
from titan_cp.layout import SequenceLayout

__all__ = ["CPHandle", "SequenceLayout", "apply_cp", "cp_attention", "handle_of", "local_attention"]


def __getattr__(name: str) -> Any:
    """``apply_cp`` and ``handle_of`` (:mod:`titan_cp.parallel`), imported when first asked for: importing
    a part of titan_cp (the config, say) never loads the model stack."""
    if name in ("apply_cp", "handle_of"):
        import titan_cp.parallel as parallel  # noqa: PLC0415

        return getattr(parallel, name)
    raise AttributeError(f"module 'titan_cp' has no attribute {name!r}")
