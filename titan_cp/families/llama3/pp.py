"""The Llama's pipeline split: its stages for :func:`~titan_cp.parallel.pp.build_pipeline`.

Splitting follows torchtitan's manual split, without its deep copy: a stage is a
``Transformer`` shell holding the modules it owns, taken from the whole model (the same
module objects, not copies: cut from the model built on ``meta``, before any weight exists)
and the others None (``tok_embeddings``/``norm``/``output``) or absent from the
``ModuleDict`` (layers), so parameter names stay those of the full model and the unchanged
``Transformer.forward`` runs every stage (what each stage takes and returns, and the schedule's
keyword inputs: :mod:`titan_cp.parallel.pp`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_cp.families.llama3.model import Transformer
from titan_cp.parallel.pp import LossFn, Schedule, build_pipeline, layers_per_stage


def split_stage(model: Transformer, stage_id: int, num_stages: int) -> Transformer:
    """Stage ``stage_id`` of ``num_stages``: a ``Transformer`` holding ``model``'s own modules
    for that stage (shared, not copied; the other parts None or absent)."""
    keep = layers_per_stage(len(model.layers), num_stages)[stage_id]
    with torch.device("meta"):  # an empty shell: its own modules are replaced just below
        part = Transformer(dataclasses.replace(model.args, n_layers=0))
    part.args = model.args
    part.layers = nn.ModuleDict({layer_id: model.layers[layer_id] for layer_id in keep})
    part.tok_embeddings = model.tok_embeddings if stage_id == 0 else None
    last = stage_id == num_stages - 1
    part.norm = model.norm if last else None
    part.output = model.output if last else None
    return part


def pipeline_llama(
    model: Transformer,
    pp_mesh: DeviceMesh,
    n_microbatches: int,
    schedule_name: str,
    loss_fn: LossFn | None,
    device: torch.device | str = "cpu",
    parallelize_fn: Callable[[Transformer], object] | None = None,
    stages_per_rank: int | None = None,
) -> tuple[Schedule, list[nn.Module], bool, bool]:
    """:func:`~titan_cp.parallel.pp.build_pipeline` of ``model`` split by :func:`split_stage`: this rank's
    stages and the schedule, ``(schedule, model_parts, has_first_stage, has_last_stage)``.

    schedule_name: any ``torch.distributed.pipelining`` schedule name; stages_per_rank: default 1 for
    single-stage schedules, 2 for multi-stage ones; parallelize_fn: applied in place to each stage's
    module before its ``PipelineStage`` is built.
    """
    return build_pipeline(
        model,
        split_stage,
        pp_mesh,
        n_microbatches,
        schedule_name,
        loss_fn,
        device,
        parallelize_fn,
        stages_per_rank,
    )
