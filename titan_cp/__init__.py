"""titan_cp: context parallelism for PyTorch, native to DeviceMesh, DTensor and ParallelStyle."""

from titan_cp.attention import cp_attention, local_attention
from titan_cp.layout import SequenceLayout

__all__ = ["SequenceLayout", "cp_attention", "local_attention"]
