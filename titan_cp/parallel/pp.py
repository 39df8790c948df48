"""Pipeline parallelism with ``torch.distributed.pipelining``: split by layers, run a schedule.

A family splits its model into stages (``split(model, stage_id, num_stages)``: the Llama's
:func:`~titan_cp.families.llama3.pp.split_stage`); :func:`build_pipeline` takes this rank's stages and
builds the schedule around them::

  stage 0       tokens (B, S) int64        -> hidden (B, S, D)
  stage i       hidden (B, S, D)           -> hidden (B, S, D)
  last stage    hidden (B, S, D)           -> token CE sum () fp32 (``labels`` given), else logits

``positions`` (B, S), ``doc_lens`` (B, max_docs) and ``labels`` (B, S) are *keyword* inputs
of every stage: ``schedule.step(tokens, target=labels, positions=..., doc_lens=...,
labels=labels)`` on the rank(s) holding stage 0, ``schedule.step(target=..., ...)``
elsewhere (``target`` only matters where the last stage lives). The schedule chunks every
tensor kwarg along the batch dim into the same microbatches as the tokens and hands each
stage its own microbatch's chunk; only the hidden states travel between ranks. The last
stage computes the summed token cross-entropy from its hidden states chunk by chunk
(``titan_cp.loss``: no whole logits), and the schedule's ``loss_fn(output_mb, labels_mb)``
divides it by the step's global token count (``GlobalTokenLoss``). The schedule is built
with ``scale_grads=False``, so microbatch losses and gradients add up exactly to the full
batch's (no division by the number of microbatches).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:  # torch.distributed.pipelining imports torch._dynamo (0.7 s): only a pipelined run loads it
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

Schedule: TypeAlias = "PipelineScheduleSingle | PipelineScheduleMulti"
"""A built pipeline schedule: one stage per rank, or several."""
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
M = TypeVar("M", bound=nn.Module)
"""A family's model class: its stages are of it too."""


def layers_per_stage(n_layers: int, num_stages: int) -> list[list[str]]:
    """Layer ids of each stage, contiguous, the first stages taking one extra when uneven."""
    if n_layers < num_stages:
        raise ValueError(
            f"model.n_layers={n_layers} is fewer than the {num_stages} pipeline stages "
            "(parallelism.pipeline_parallel_degree x stages per rank)"
        )
    base, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append([str(i) for i in range(start, start + n)])
        start += n
    return out


def stage_ids_of_rank(rank: int, pp: int, stages_per_rank: int, v_style: bool) -> list[int]:
    """Loop style: rank r holds r, r+pp, ...; V style (2 per rank): r and 2pp-1-r."""
    if v_style:
        return [rank, 2 * pp - 1 - rank]
    return [rank + s * pp for s in range(stages_per_rank)]


def build_pipeline(
    model: M,
    split: Callable[[M, int, int], M],
    pp_mesh: DeviceMesh,
    n_microbatches: int,
    schedule_name: str,
    loss_fn: LossFn | None,
    device: torch.device | str = "cpu",
    parallelize_fn: Callable[[M], object] | None = None,
    stages_per_rank: int | None = None,
) -> tuple[Schedule, list[nn.Module], bool, bool]:
    """Split ``model`` into pipeline stages for this rank and build the schedule.

    split: ``split(model, stage_id, num_stages)``, its family's stage ``stage_id`` of ``model``.
    schedule_name: any ``torch.distributed.pipelining`` schedule name ("GPipe", "1F1B",
        "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", ...).
    stages_per_rank: default 1 for single-stage schedules, 2 for multi-stage ones.
    parallelize_fn: applied in place to each stage's module (TP, AC, compile, FSDP, then
        materialisation when ``model`` is on ``meta``) before its ``PipelineStage`` is built.
    Returns ``(schedule, model_parts, has_first_stage, has_last_stage)``; ``model_parts``
    are this rank's stage modules (for the optimizer and checkpoints).
    """
    from torch.distributed.pipelining import PipelineStage  # noqa: PLC0415 - see the imports
    from torch.distributed.pipelining.schedules import (  # noqa: PLC0415
        PipelineScheduleSingle,
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
        get_schedule_class,
    )

    try:
        schedule_class = get_schedule_class(schedule_name)
    except ValueError as e:
        raise ValueError(f"parallelism.pipeline_parallel_schedule: {e}") from None
    single = issubclass(schedule_class, PipelineScheduleSingle)
    v_style = schedule_class in (ScheduleZBVZeroBubble, ScheduleDualPipeV)
    if stages_per_rank is None:
        stages_per_rank = 1 if single else 2
    if single and stages_per_rank != 1:
        raise ValueError(f"schedule {schedule_name} runs one stage per rank, got stages_per_rank={stages_per_rank}")
    if not single and stages_per_rank < 2:
        raise ValueError(f"schedule {schedule_name} needs >= 2 stages per rank, got {stages_per_rank}")

    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    num_stages = pp * stages_per_rank
    stages: list[PipelineStage] = []
    model_parts: list[nn.Module] = []
    for stage_id in stage_ids_of_rank(rank, pp, stages_per_rank, v_style):
        part = split(model, stage_id, num_stages)
        if parallelize_fn is not None:
            parallelize_fn(part)
        model_parts.append(part)
        stages.append(PipelineStage(part, stage_id, num_stages, torch.device(device), group=pp_mesh.get_group()))

    schedule = schedule_class(
        stages[0] if single else stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False
    )
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    return schedule, model_parts, has_first, has_last
