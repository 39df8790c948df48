"""titan_cp: context parallelism for PyTorch, native to DeviceMesh, DTensor and ParallelStyle."""

from titan_cp.attention import CPHandle, cp_attention, local_attention
from titan_cp.layout import SequenceLayout
from titan_cp.parallel import apply_cp, handle_of

__all__ = ["CPHandle", "SequenceLayout", "apply_cp", "cp_attention", "handle_of", "local_attention"]
