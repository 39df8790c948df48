"""Apply every parallelism to a model of any family, in torchtitan's order, on the named world mesh.

Per model part (a whole model, or one pipeline stage)::

    tensor parallel (tp)  ->  context parallel (cp)  ->  tiled MLP  ->  activation checkpointing
        ->  torch.compile  ->  FSDP2 over dp_shard x cp (HSDP with dp_replicate)

CP ranks shard the weights too (FSDP's mesh includes the cp axis): they hold different
tokens of the same rows, so their gradients must be summed exactly like data-parallel
ranks' — FSDP's reduce-scatter does that, with the division set to 1 (see ``loss.py``).

``build_parallel_model`` does it all from the model's shapes, as torchtitan does: build on
``meta`` (no memory), cut this rank's pipeline stages from it, parallelize each, then
``to_empty`` on the device (each rank allocates only its shards) and initialise in place
with values that do not depend on the mesh (``titan_cp.families.init``).

What differs between families is a :class:`ModelBuilder`: how the model is built on ``meta``,
split into pipeline stages, split over tp, made context-parallel and materialised (each family's beside
its model: the Llama's in :mod:`titan_cp.families.llama3.parallelize`, Hugging Face models' in
:mod:`titan_cp.integrations.hf_folder`).
Activation checkpointing, compile and FSDP are the same ``apply_*`` functions for every family
(:mod:`titan_cp.parallel.adapter`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_cp.attention.handle import CPHandle
from titan_cp.attention.strategy import DEFAULT_STRATEGY
from titan_cp.layout import DEFAULT_BALANCE
from titan_cp.mesh import ParallelDims
from titan_cp.parallel import apply_ac, apply_compile, apply_fsdp
from titan_cp.parallel.cp import apply_cp
from titan_cp.parallel.pp import LossFn, Schedule
from titan_cp.parallel.tiled_mlp import apply_tiled_mlp


@dataclass
class ParallelizeOptions:
    """How to parallelize beyond the mesh degrees (from ``[parallelism]``, ``[activation_checkpoint]``, ``[compile]``)."""

    cp_strategy: str = DEFAULT_STRATEGY
    cp_balance: str = DEFAULT_BALANCE
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


def cp_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """The mesh CP attention runs on: 1-D ``cp``, or 2-D ``(cp_ring, cp_ulysses)`` for hybrid."""
    return parallel_dims.hybrid_cp_mesh() if parallel_dims.hybrid_cp else parallel_dims.get_mesh("cp")


class ModelBuilder:
    """What :func:`build_parallel_model` asks of a family's model beyond the shared ``apply_*``."""

    def meta(self) -> nn.Module:
        """The whole model on ``meta``."""
        raise NotImplementedError

    def pipeline(
        self,
        model: nn.Module,
        pp_mesh: DeviceMesh,
        microbatches: int,
        schedule: str,
        loss_fn: LossFn | None,
        device: torch.device | str,
        prepare: Callable[[nn.Module], object],
    ) -> tuple[Schedule, list[nn.Module], bool, bool]:
        """``(schedule, parts, has_first, has_last)``: this rank's stages, each passed to ``prepare``."""
        raise ValueError(f"{type(self).__name__}: pipeline parallelism is not built for this model")

    def tensor_parallel(self, model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
        raise ValueError(f"{type(self).__name__}: tensor parallelism is not built for this model")

    def context_parallel(self, model: nn.Module, handle: CPHandle) -> nn.Module:
        """Make the attention cores context-parallel by ``handle`` (no mesh: one device); returns the
        module the rest applies to (the model, or a wrapper around it)."""
        apply_cp(model, handle)
        return model

    def materialize(self, model: nn.Module, device: torch.device | str, seed: int | None) -> None:
        """Allocate ``model``'s parameters (this rank's shards) on ``device`` and initialise them in place."""
        raise NotImplementedError


def parallelize(
    builder: ModelBuilder,
    model: nn.Module,
    parallel_dims: ParallelDims,
    options: ParallelizeOptions,
    fsdp: bool = True,
    handle: CPHandle | None = None,
) -> nn.Module:
    """Parallelize ``model`` (or a pipeline stage of it) in place, in the module docstring's order;
    returns the module to train (the model, or the wrapper its family's CP step made).
    ``fsdp`` false: no FSDP whatever the mesh (generation keeps the weights whole). ``handle``: the
    CP handle to bind (every stage of a pipeline shares one; ``None``: :func:`cp_handle` of the options)."""
    if parallel_dims.tp_enabled:
        builder.tensor_parallel(model, parallel_dims.get_mesh("tp"), options.loss_parallel)
    model = builder.context_parallel(model, handle or cp_handle(parallel_dims, options))
    apply_tiled_mlp(model, options.tile_tokens)
    apply_ac(model, options.ac_mode, options.ac_every, options.ac_cpu_offload, options.ac_blocks_per_checkpoint)
    if options.compile:
        apply_compile(model, backend=options.compile_backend)
    if fsdp and (parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled):
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh(),  # kept flattened views, never sliced from the root (deprecated)
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
    return model


def cp_handle(parallel_dims: ParallelDims, options: ParallelizeOptions) -> CPHandle:
    """The CP handle of this mesh and these options (no mesh when CP is off)."""
    mesh = cp_mesh(parallel_dims) if parallel_dims.cp_enabled else None
    return CPHandle(mesh, options.cp_strategy, options.cp_balance, options.cp_kernel)


def buffers_to(model: nn.Module, device: torch.device | str) -> None:
    """Move every buffer of ``model`` to ``device`` in place (parameters stay where they are)."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None:
                setattr(module, name, buf.to(device))


@dataclass
class ModelParts:
    """This rank's model: its parts (the whole model, or its pipeline stages), the CP handle they run
    by (batches are sharded with it), and, with a pipeline, the schedule and whether this rank holds
    the first / last stage."""

    parts: list[nn.Module]
    cp: CPHandle
    schedule: Any = None
    has_first: bool = True
    has_last: bool = True


def build_parallel_model(
    builder: ModelBuilder,
    parallel_dims: ParallelDims,
    options: ParallelizeOptions,
    device: torch.device | str,
    seed: int | None = None,
    loss_fn: LossFn | None = None,
    pp_microbatches: int = 1,
    pp_schedule: str = "1F1B",
    fsdp: bool = True,
    cp: CPHandle | None = None,
) -> ModelParts:
    """Build the model of ``builder`` (its family's :class:`ModelBuilder`) on ``meta``, cut
    this rank's pipeline stages, parallelize, and materialise on ``device`` with weights that depend
    on ``seed`` only (not on the mesh).

    Nothing larger than a rank's shards (plus one init block) is ever allocated.
    loss_fn, pp_microbatches, pp_schedule: the pipeline schedule's (pipeline parallelism only).
    fsdp: false for no FSDP whatever the mesh. cp: the CP handle to bind (default: one of the mesh
    and ``options``), which :attr:`ModelParts.cp` holds: every batch is sharded with it.
    """
    whole = builder.meta()
    handle = cp or cp_handle(parallel_dims, options)

    def prepare(part: nn.Module) -> nn.Module:
        part = parallelize(builder, part, parallel_dims, options, fsdp, handle)
        host = options.fsdp_cpu_offload  # FSDP's CPU offload: the shards live on the host
        builder.materialize(part, "cpu" if host else device, seed)
        if host:
            buffers_to(part, device)  # buffers (RoPE frequencies) are not sharded: they compute on the device
        return part

    if parallel_dims.pp_enabled:
        pp_mesh = parallel_dims.get_mesh("pp")
        schedule, parts, first, last = builder.pipeline(
            whole, pp_mesh, pp_microbatches, pp_schedule, loss_fn, device, prepare
        )
        return ModelParts(parts, handle, schedule, first, last)
    return ModelParts([prepare(whole)], handle)
