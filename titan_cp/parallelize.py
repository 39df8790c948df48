"""Apply every parallelism to a Llama model, in torchtitan's order, on the named world mesh.

Per model part (a whole model, or one pipeline stage)::

    tensor parallel (tp)  ->  context parallel (cp)  ->  activation checkpointing
        ->  torch.compile  ->  FSDP2 over dp_shard x cp (HSDP with dp_replicate)

CP ranks shard the weights too (FSDP's mesh includes the cp axis): they hold different
tokens of the same rows, so their gradients must be summed exactly like data-parallel
ranks' — FSDP's reduce-scatter does that, with the division set to 1 (see ``loss.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_cp.mesh import ParallelDims
from titan_cp.model.llama import Transformer
from titan_cp.parallel import apply_ac, apply_compile, apply_fsdp, apply_tp
from titan_cp.parallel.cp import apply_cp


@dataclass
class ParallelizeOptions:
    """How to parallelize beyond the mesh degrees (from ``[parallelism]``, ``[activation_checkpoint]``, ``[compile]``)."""

    cp_strategy: str = "ring"
    cp_balance: str = "doc_zigzag"
    cp_kernel: str | None = None
    ac_mode: str = "none"
    ac_every: int = 1
    compile: bool = False
    loss_parallel: bool = False
    mp_param_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True


def cp_mesh(parallel_dims: ParallelDims):
    """The mesh CP attention runs on: 1-D ``cp``, or 2-D ``(cp_ring, cp_ulysses)`` for hybrid."""
    return parallel_dims.hybrid_cp_mesh() if parallel_dims.hybrid_cp else parallel_dims.get_mesh("cp")


def parallelize_llama(model: Transformer, parallel_dims: ParallelDims, options: ParallelizeOptions) -> None:
    """Parallelize ``model`` (or a pipeline stage of it) in place."""
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.get_mesh("tp"), loss_parallel=options.loss_parallel)
    if parallel_dims.cp_enabled:
        apply_cp(model, cp_mesh(parallel_dims), options.cp_strategy, options.cp_balance, options.cp_kernel)
    if options.ac_mode != "none":
        apply_ac(model, options.ac_mode, every=options.ac_every)
    if options.compile:
        apply_compile(model)
    if parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled:
        world = parallel_dims.world_mesh
        parallel_dims.get_mesh("dp_shard_cp")  # the flattened axis must exist before slicing it
        if parallel_dims.dp_replicate_enabled:
            mesh = world["dp_replicate", "dp_shard_cp"]
        else:
            mesh = world["dp_shard_cp"]
        apply_fsdp(
            model,
            mesh,
            mp_param_dtype=options.mp_param_dtype,
            reshard_after_forward=options.reshard_after_forward and not parallel_dims.pp_enabled,
            hsdp=parallel_dims.dp_replicate_enabled,
        )
