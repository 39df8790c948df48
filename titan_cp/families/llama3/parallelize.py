"""The Llama's parallel plan: how the shared ``apply_*`` functions see titan_cp's Llama (its adapter), how its
attention cores become context-parallel (:func:`llama_cp`), and its :class:`LlamaBuilder` for
:func:`~titan_cp.parallel.build.build_parallel_model` (tensor parallel: :mod:`.tp`; pipeline split: :mod:`.pp`).

Importing the room (any of its modules) registers the adapter, so ``apply_cp`` and the other ``apply_*``
functions take a :class:`~titan_cp.families.llama3.model.Transformer` (or a pipeline stage of one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from titan_cp.attention.handle import CPHandle
from titan_cp.families.llama3.model import InnerAttention, ModelArgs, Transformer
from titan_cp.families.llama3.pp import pipeline_llama
from titan_cp.families.llama3.tp import apply_tp
from titan_cp.mesh import ParallelDims
from titan_cp.parallel.adapter import ParallelAdapter, register_adapter
from titan_cp.parallel.build import ModelBuilder, ParallelizeOptions, cp_handle, parallelize
from titan_cp.parallel.cp import ContextParallel
from titan_cp.parallel.pp import LossFn, Schedule


def llama_adapter(model: nn.Module) -> ParallelAdapter | None:
    """The adapter of a :class:`Transformer`: blocks ``model.layers``, its own embedding, tail (final
    norm, output; also the head unit when both are there) and CP plan (:func:`llama_cp`); ``None`` for any other model."""
    if not isinstance(model, Transformer):
        return None
    tail: list[nn.Module] = [m for m in (model.norm, model.output) if m is not None]  # a stage may lack them
    return ParallelAdapter(
        model,
        model.layers,
        lambda handle: llama_cp(model, handle),
        family="llama3",
        embedding=model.tok_embeddings,
        tail=tail,
        head_unit=tail if len(tail) == 2 else [],
        mlp_name="feed_forward",
    )


register_adapter(llama_adapter)


def llama_cp(model: nn.Module, handle: CPHandle) -> None:
    """Make every Llama block's attention core context-parallel by ``handle`` (:class:`ContextParallel`);
    on one device (no mesh) the cores run the local op, masked by document, and only hold the handle."""
    if handle.mesh is None:
        for module in model.modules():
            if isinstance(module, InnerAttention):
                module.cp_handle = handle  # type: ignore[assignment]
        return
    parallelize_module(model, handle.mesh, {"layers.*.attention.inner_attention": ContextParallel(handle=handle)})


@dataclass
class LlamaBuilder(ModelBuilder):
    """titan_cp's Llama of ``args``: every parallelism (TP, CP, PP included)."""

    args: ModelArgs

    def meta(self) -> nn.Module:
        with torch.device("meta"):
            return Transformer(self.args)

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
        return pipeline_llama(
            _llama(model), pp_mesh, microbatches, schedule, loss_fn, device=device, parallelize_fn=prepare
        )

    def tensor_parallel(self, model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
        apply_tp(_llama(model), tp_mesh, loss_parallel=loss_parallel)

    def materialize(self, model: nn.Module, device: torch.device | str, seed: int | None) -> None:
        materialize(_llama(model), device, seed)


def _llama(model: nn.Module) -> Transformer:
    """``model``, which :meth:`LlamaBuilder.meta` built (a ``Transformer`` or a pipeline stage of one)."""
    if not isinstance(model, Transformer):
        raise TypeError(f"the Llama builder builds titan_cp's Transformer, got a {type(model).__name__}")
    return model


def parallelize_llama(model: Transformer, parallel_dims: ParallelDims, options: ParallelizeOptions) -> CPHandle:
    """Parallelize titan_cp's Llama ``model`` (or a pipeline stage of it) in place; returns the CP handle
    its batches are sharded with."""
    handle = cp_handle(parallel_dims, options)
    parallelize(LlamaBuilder(model.args), model, parallel_dims, options, handle=handle)
    return handle


def materialize(model: Transformer, device: torch.device | str, seed: int | None = None) -> None:
    """Allocate ``model``'s parameters (this rank's shards, when parallelized) on ``device``
    and initialise them in place (``Transformer.init_weights``: the same values on any mesh)."""
    model.to_empty(device=device)
    model.init_weights(seed)
