"""Apply every parallelism to a Llama model, in torchtitan's order, on the named world mesh.

Per model part (a whole model, or one pipeline stage)::

    tensor parallel (tp)  ->  context parallel (cp)  ->  activation checkpointing
        ->  torch.compile  ->  FSDP2 over dp_shard x cp (HSDP with dp_replicate)

CP ranks shard the weights too (FSDP's mesh includes the cp axis): they hold different
tokens of the same rows, so their gradients must be summed exactly like data-parallel
ranks' — FSDP's reduce-scatter does that, with the division set to 1 (see ``loss.py``).

``build_parallel_model`` does it all from the model's shapes, as torchtitan does: build on
``meta`` (no memory), cut this rank's pipeline stages from it, parallelize each, then
``to_empty`` on the device (each rank allocates only its shards) and initialise in place
with values that do not depend on the mesh (``titan_cp.model.init``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from titan_cp.mesh import ParallelDims
from titan_cp.model.llama import ModelArgs, Transformer
from titan_cp.parallel import apply_ac, apply_compile, apply_fsdp, apply_tp, pipeline_llama
from titan_cp.parallel.cp import apply_cp
from titan_cp.parallel.tiled_mlp import apply_tiled_mlp


@dataclass
class ParallelizeOptions:
    """How to parallelize beyond the mesh degrees (from ``[parallelism]``, ``[activation_checkpoint]``, ``[compile]``)."""

    cp_strategy: str = "ring"
    cp_balance: str = "doc_local"
    cp_kernel: str | None = None
    ac_mode: str = "none"
    ac_every: int = 1
    ac_cpu_offload: bool = False
    ac_blocks_per_checkpoint: int = 1
    tile_tokens: int = 0
    fsdp_cpu_offload: bool = False
    compile: bool = False
    compile_backend: str = "inductor"
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
    apply_tiled_mlp(model, options.tile_tokens)
    if options.ac_mode != "none":
        apply_ac(model, options.ac_mode, options.ac_every, options.ac_cpu_offload, options.ac_blocks_per_checkpoint)
    if options.compile:
        apply_compile(model, backend=options.compile_backend)
    if parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled:
        mesh = parallel_dims.fsdp_mesh()  # kept flattened views, never sliced from the root (deprecated)
        apply_fsdp(
            model,
            mesh,
            mp_param_dtype=options.mp_param_dtype,
            reshard_after_forward=options.reshard_after_forward and not parallel_dims.pp_enabled,
            hsdp=parallel_dims.dp_replicate_enabled,
            cpu_offload=options.fsdp_cpu_offload,
        )
    elif options.fsdp_cpu_offload:
        raise ValueError(
            "training.enable_cpu_offload = true offloads FSDP's shards: it needs FSDP (parallelism.data_parallel_shard_"
            "degree x context_parallel_degree > 1, or data_parallel_replicate_degree > 1)"
        )


def materialize(model: Transformer, device: torch.device | str, seed: int | None = None) -> None:
    """Allocate ``model``'s parameters (this rank's shards, when parallelized) on ``device``
    and initialise them in place (``Transformer.init_weights``: the same values on any mesh)."""
    model.to_empty(device=device)
    model.init_weights(seed)


@dataclass
class ModelParts:
    """This rank's model: its parts (the whole model, or its pipeline stages) and, with a
    pipeline, the schedule and whether this rank holds the first / last stage."""

    parts: list[Transformer]
    schedule: Any = None
    has_first: bool = True
    has_last: bool = True


def build_parallel_model(
    args: ModelArgs,
    parallel_dims: ParallelDims,
    options: ParallelizeOptions,
    device: torch.device | str,
    seed: int | None = None,
    loss_fn: Callable | None = None,
    pp_microbatches: int = 1,
    pp_schedule: str = "1F1B",
) -> ModelParts:
    """Build ``args``' model on ``meta``, cut this rank's pipeline stages, parallelize, and
    materialise on ``device`` with weights that depend on ``seed`` only (not on the mesh).

    Nothing larger than a rank's shards (plus one init block) is ever allocated.
    loss_fn, pp_microbatches, pp_schedule: the pipeline schedule's (pipeline parallelism only).
    """
    with torch.device("meta"):
        model = Transformer(args)

    def prepare(part: Transformer) -> None:
        parallelize_llama(part, parallel_dims, options)
        materialize(part, "cpu" if options.fsdp_cpu_offload else device, seed)  # offloaded shards live on the host

    if parallel_dims.pp_enabled:
        schedule, parts, first, last = pipeline_llama(
            model,
            parallel_dims.get_mesh("pp"),
            pp_microbatches,
            pp_schedule,
            loss_fn,
            device=device,
            parallelize_fn=prepare,
        )
        return ModelParts(parts, schedule, first, last)
    prepare(model)
    return ModelParts([model])
