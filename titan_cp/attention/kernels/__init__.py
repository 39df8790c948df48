"""Local attention kernels behind one interface (:mod:`.base`), one module per backend.

=============  ============  ===============  ==============================================
name           device        dtypes           head_dim
=============  ============  ===============  ==============================================
``math``       any           any float        any (plain fp32 reference, S x S scores)
``cpu_flash``  cpu           fp32/fp64/bf16/  any (ATen's CPU flash kernel, one call per tile)
                             fp16
``cpu_varlen`` cpu           fp32/fp64/bf16/  any (the CPU default: packed segments in one call;
                             fp16             short ones batched, long ones ATen's CPU flash)
``cuda_flash`` cuda          fp16/bf16        multiple of 8, at most 256 (ATen's CUDA flash
                                              kernel, variable-length, GQA native; the default)
``flash_attn`` cuda          fp16/bf16        multiple of 8, at most 256 (the flash-attn
                                              package, where installed; only when named)
=============  ============  ===============  ==============================================

Every kernel takes a value head dim of its own (multi-head latent attention: q/k 192, v 128); the
flash kernels (``cpu_flash``, ``cpu_varlen``'s long segments, ``cuda_flash``, ``flash_attn``), whose
backends need one head dim, pad the smaller side with zeros and slice the results back
(:func:`~.base.common_head_dim`); their head_dim column is then the larger of the two.

:func:`check_kernel` turns a kernel name (or ``None`` for the default) into a kernel and
raises ``ValueError`` for a combination it cannot run; :func:`register_kernel` adds one.
"""

from titan_cp.attention.kernels.base import (
    AttentionKernel,
    Segments,
    check_kernel,
    default_kernel_name,
    get_kernel,
    register_kernel,
)
from titan_cp.attention.kernels.cpu import CPUFlashKernel, CPUVarlenKernel
from titan_cp.attention.kernels.cuda_flash import CUDAFlashKernel
from titan_cp.attention.kernels.flashattn import FlashAttnKernel, flash_attn_available, flash_attn_problem
from titan_cp.attention.kernels.math_kernel import MathKernel

for _kernel in (MathKernel, CPUFlashKernel, CPUVarlenKernel, CUDAFlashKernel, FlashAttnKernel):
    register_kernel(_kernel.name, _kernel)

__all__ = [
    "AttentionKernel",
    "CPUFlashKernel",
    "CPUVarlenKernel",
    "CUDAFlashKernel",
    "FlashAttnKernel",
    "MathKernel",
    "Segments",
    "check_kernel",
    "default_kernel_name",
    "flash_attn_available",
    "flash_attn_problem",
    "get_kernel",
    "register_kernel",
]
