"""Context-parallel attention: strategies, local kernels, masks and the log-sum-exp merge."""

from titan_cp.attention.api import cp_attention, local_attention, min_bytes_per_rank
from titan_cp.attention.handle import CPHandle, register_sharder
from titan_cp.attention.kernels import AttentionKernel, Segments, check_kernel, get_kernel, register_kernel
from titan_cp.attention.strategy import Strategy, attention_schedule, get_strategy, register_strategy, strategy_names

__all__ = [
    "AttentionKernel",
    "CPHandle",
    "Segments",
    "Strategy",
    "attention_schedule",
    "check_kernel",
    "cp_attention",
    "get_kernel",
    "get_strategy",
    "local_attention",
    "min_bytes_per_rank",
    "register_kernel",
    "register_sharder",
    "register_strategy",
    "strategy_names",
]
