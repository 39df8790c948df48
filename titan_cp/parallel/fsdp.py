"""FSDP2 (``fully_shard``) per transformer block, then the root; HSDP on a 2-D mesh.

Gradients are SUMMED over the data-parallel mesh, never averaged: the loss of each rank
is already ``sum of its token losses / global token count`` (the loader counts tokens over
dp x cp x grad-accumulation), so the sum of the ranks' gradients is the gradient of the
global mean. FSDP would otherwise divide by the mesh size.

  forward   w = all_gather(w_shard)                    (per block, just in time)
  backward  g_shard = reduce_scatter_sum(g)            (over the shard axis)
            g_shard = all_reduce_sum(g_shard)          (HSDP: over the replicate axis)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titan_cp.parallel.adapter import adapter_of


def set_gradient_sum(model: nn.Module) -> None:
    """Make every FSDP unit in ``model`` sum gradients: divide factor 1 with plain SUM
    collectives (``force_sum_reduction_for_comms`` avoids ``PREMUL_SUM``, which gloo lacks)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def offload_policy(cpu_offload: bool, mesh: DeviceMesh) -> OffloadPolicy:
    """FSDP2's ``CPUOffloadPolicy`` (pinned host memory on CUDA) with ``cpu_offload``, else no offload."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    mp_param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    hsdp: bool = False,
    cpu_offload: bool = False,
) -> None:
    """Shard ``model`` in place over ``mesh`` (1-D: FSDP over the flattened ``dp_shard x cp`` ranks;
    2-D ``(replicate, shard)``: HSDP), whatever its family (:func:`~titan_cp.parallel.adapter.adapter_of`):
    the embedding on its own, each block, the tail (final norm and head, kept gathered after the
    forward: the backward starts with them), then the root; gradients summed (module docstring).

    mp_param_dtype: dtype for compute (e.g. bf16); None keeps the parameters' dtype.
    reduce_dtype: dtype of gradient reduction (fp32 by default).
    reshard_after_forward: free gathered weights after forward (False for pipeline
        parallelism, which would otherwise all-gather again for every microbatch).
    hsdp: the caller expects hybrid sharding; ``mesh`` must then be 2-D.
    cpu_offload: shards, gradients and optimizer state in host memory (``CPUOffloadPolicy``; the
        model must then be materialised on the CPU).
    Parts a pipeline stage deleted are absent from the adapter.
    """
    if hsdp and mesh.ndim != 2:
        raise ValueError(
            f"HSDP needs a 2-D (dp_replicate, dp_shard) mesh, got {mesh.ndim}-D: set "
            "parallelism.data_parallel_replicate_degree > 1"
        )
    adapter = adapter_of(model)
    mp_policy = MixedPrecisionPolicy(param_dtype=mp_param_dtype, reduce_dtype=reduce_dtype)
    offload = offload_policy(cpu_offload, mesh)

    def shard(module: nn.Module | list[nn.Module], reshard: bool) -> None:
        fully_shard(module, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=reshard)

    if adapter.embedding is not None:
        shard(adapter.embedding, reshard_after_forward)
    for _, block in adapter.block_items():
        shard(block, reshard_after_forward)
    if adapter.tail:
        shard(adapter.tail, False)
    shard(adapter.root, reshard_after_forward)
    set_gradient_sum(adapter.root)
