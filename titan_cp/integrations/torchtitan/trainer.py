"""torchtitan 0.3's ``Trainer`` with titan_cp's packed-document context parallelism.

:class:`TitanCPTrainer` is torchtitan's ``Trainer`` (its loop, loss, optimizer, checkpoints,
logging, launch) with these changes:

- its ``Config`` has a ``titan_cp`` section (:class:`TitanCPConfig`: ``--titan_cp.strategy``,
  ``--titan_cp.balance``, ``--titan_cp.kernel``, ``--titan_cp.ulysses_degree`` on torchtitan's command
  line), checked with its agreement with torchtitan's own settings (:func:`check_run`: the cp degree,
  the heads, ``seq_len``, the backend, pipeline and validator, TP / EP beside Gated DeltaNet layers) when
  the Trainer is built, before any process group or model, each mistake one ``ValueError`` naming the flag;
- once torchtitan's meshes exist it builds the run's one :class:`~titan_cp.attention.handle.CPHandle`
  from that section (:func:`~.parallelize.cp_handle`), logs the CP that runs
  (:func:`~.parallelize.describe`) and binds it to the model's ``parallelize_fn``, whose CP step binds
  it to every :class:`~.attention.TitanCPAttention` (and Qwen3.5's Gated DeltaNet layers);
- :meth:`TitanCPTrainer.post_dataloading_process` turns each batch's ``positions`` (0 at each
  document start, as torchtitan's dataloaders yield them) into titan_cp's documents, builds the
  layout with that handle (the ``titan_cp.balance``) and shards inputs, labels and positions by it
  (:meth:`titan_cp.step.Microbatch.shard`, titan_cp's own trainer's sharding), instead of
  torchtitan's head-tail split; the layout's documents tensor goes to every layer as
  ``attention_masks`` (Qwen3.5: under both of its mask keys, :func:`.linear.model_inputs`); a batch with
  inputs the layout does not shard (images) is refused;
- under CP the loss its forward-backward returns to torchtitan's metrics is each dp rank's whole
  (:func:`~.reporting.loss_for_metrics`), so ``global_max_loss`` is the max over dp ranks of their
  rows' mean loss, not of a cp shard's share; and torchtitan's INFO lines come from rank 0 alone
  (:func:`~.reporting.log_info_on_rank0`).

torchtitan's labels are already next-token targets inside each document, so sharding them with
the tokens keeps every target; the loss stays torchtitan's (local summed CE over the step's
global valid-token count, gradients summed over ``dp x cp`` by FSDP), equal to the unsharded run's.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from titan_cp.attention.handle import CPHandle
from titan_cp.attention.kernels import get_kernel
from titan_cp.attention.strategy import DEFAULT_STRATEGY, get_strategy, strategy_names
from titan_cp.balance import balance_names
from titan_cp.errors import did_you_mean
from titan_cp.integrations.hf_batch import _from_positions
from titan_cp.integrations.torchtitan.attention import TitanCPAttention
from titan_cp.integrations.torchtitan.parallelize import TitanCPParallelize, cp_handle, describe
from titan_cp.integrations.torchtitan.reporting import log_info_on_rank0, loss_for_metrics
from titan_cp.layout import DEFAULT_BALANCE, seq_len_multiple
from titan_cp.step import Microbatch

SPMD_BACKEND = "partial_dtensor"  # torchtitan's backend whose CP step is a function titan_cp replaces
CP_FLAG = "--parallelism.context_parallel_degree"


@dataclass(kw_only=True, slots=True)
class TitanCPConfig:
    """The ``titan_cp`` section of a torchtitan run (the CP size is torchtitan's own
    ``--parallelism.context_parallel_degree``). Checked by :meth:`check` (with torchtitan's settings by
    :func:`check_run`) when the Trainer is built, not when parsed: torchtitan's parser would print a
    mistake found while parsing in a box of its own, on every rank."""

    strategy: str = DEFAULT_STRATEGY
    """CP attention strategy: ring, allgather, ulysses, hybrid (with ulysses_degree) or any registered."""
    balance: str = DEFAULT_BALANCE
    """Sequence layout: doc_local, doc_zigzag, zigzag, contiguous or any registered."""
    kernel: str | None = None
    """titan_cp's local attention kernel; None for the fastest on the device and dtype."""
    ulysses_degree: int = 1
    """hybrid only: ranks of each Ulysses group inside the cp axis (the cp degree / it make the ring)."""

    def check(self) -> None:
        """``ValueError`` naming the flag: a strategy, balance or kernel titan_cp does not have (with the
        close names), or a Ulysses degree the strategy does not take."""
        for key, plural, value, names in (
            ("strategy", "strategies", self.strategy, strategy_names()),
            ("balance", "balances", self.balance, balance_names()),
        ):
            if value not in names:
                raise ValueError(
                    f"--titan_cp.{key} {value!r} is not one of titan_cp's {plural}{did_you_mean(value, names)} "
                    f"(choose one of {', '.join(names)})"
                )
        if self.kernel is not None:
            try:
                get_kernel(self.kernel, torch.device("cpu"), torch.float32)  # a named kernel: the name and its package
            except ValueError as e:
                raise ValueError(f"--titan_cp.kernel {self.kernel!r}: {e}") from None
        strategy = get_strategy(self.strategy)
        if strategy.takes_ulysses_degree() != (self.ulysses_degree > 1) or self.ulysses_degree < 1:
            want = "a --titan_cp.ulysses_degree of 2 or more" if strategy.takes_ulysses_degree() else "none"
            raise ValueError(
                f"--titan_cp.strategy {self.strategy!r} takes {want}, got --titan_cp.ulysses_degree "
                f"{self.ulysses_degree}"
            )


def _schedules_take_microbatch_lists() -> bool:
    """Whether this torch's pipeline schedules take the per-microbatch lists torchtitan 0.3 passes."""
    return all(
        "arg_mbs" in inspect.signature(s.step).parameters for s in (PipelineScheduleSingle, PipelineScheduleMulti)
    )


def _check_torchtitan_settings(config: Any) -> None:
    """The spmd backend, validator and pipeline settings titan_cp's Trainer runs with."""
    if config.parallelism.spmd_backend != SPMD_BACKEND:
        raise ValueError(
            f"titan_cp's Trainer runs under --parallelism.spmd_backend {SPMD_BACKEND}, not "
            f"{config.parallelism.spmd_backend!r} (its model sharding all-gathers K/V itself and its batches "
            f"are typed by torchtitan's own sharding): set --parallelism.spmd_backend {SPMD_BACKEND}"
        )
    if config.validator.enable:
        raise ValueError(
            "titan_cp's Trainer does not run torchtitan's validator yet (it shards and masks its batches "
            "torchtitan's way, not by titan_cp's layout): drop --validator.enable"
        )
    if config.parallelism.pipeline_parallel_degree > 1 and not _schedules_take_microbatch_lists():
        raise ValueError(
            f"--parallelism.pipeline_parallel_degree {config.parallelism.pipeline_parallel_degree}: torchtitan "
            "0.3's pipeline step calls the schedule's step(arg_mbs=..., kwarg_mbs=...), which torch "
            f"{torch.__version__}'s torch.distributed.pipelining does not take (it would split the list as a model "
            "argument), with titan_cp or without: drop it (titan_cp's own trainer runs PP x CP)"
        )


def _layers(model_config: Any) -> list[Any]:
    return list(getattr(model_config, "layers", None) or ())


def has_linear_layers(model_config: Any) -> bool:
    """Whether torchtitan's model config has linear-attention layers (Qwen3.5's Gated DeltaNet: a layer config
    with a ``delta_net``), whose kernels titan_cp runs too (:mod:`.linear`)."""
    return any(getattr(layer, "delta_net", None) is not None for layer in _layers(model_config))


def _head_counts(model_spec: Any) -> set[tuple[int, int]]:
    """``(query heads, KV heads)`` of the model's attention layers that run titan_cp's attention (none without a
    model): Llama 3's and Qwen3's GQA, gpt-oss's, Qwen3.5's gated attention, DeepSeek V3's MLA (as many KV heads
    as query heads: it has no ``n_kv_heads``)."""
    attentions = [getattr(layer, "attention", None) for layer in _layers(getattr(model_spec, "model", None))]
    ours: list[Any] = [
        a for a in attentions if isinstance(getattr(a, "inner_attention", None), TitanCPAttention.Config)
    ]
    return {(a.n_heads, getattr(a, "n_kv_heads", None) or a.n_heads) for a in ours}


def _check_linear(config: Any) -> None:
    """A model with linear-attention layers runs under torchtitan's FSDP and titan_cp's CP, not (yet) TP or EP:
    torchtitan's Qwen3.5 then parallelizes its modules by their sharding configs (TP splits the Gated DeltaNet's
    heads and channels, as DTensors), where titan_cp's linear seams take whole local tensors."""
    if not has_linear_layers(getattr(config.model_spec, "model", None)):
        return
    p = config.parallelism
    for kind, degree in (("tensor", p.tensor_parallel_degree), ("expert", p.expert_parallel_degree)):
        if degree > 1:
            raise ValueError(
                f"--parallelism.{kind}_parallel_degree {degree}: titan_cp's Gated DeltaNet layers (Qwen3.5) do not "
                f"run under torchtitan's {kind} parallelism yet: drop it (FSDP and CP run)"
            )


def _check_cp(config: Any) -> None:
    """The titan_cp section against the cp degree: Ulysses degree, heads, sequence length."""
    section, p = config.titan_cp, config.parallelism
    cp, tp, ulysses = p.context_parallel_degree, p.tensor_parallel_degree, section.ulysses_degree
    if cp <= 1:
        return
    strategy = get_strategy(section.strategy)
    try:
        strategy.check_degrees(cp, ulysses)
    except ValueError as e:
        raise ValueError(f"--titan_cp.ulysses_degree {ulysses} on {CP_FLAG} {cp}: {e}") from None
    for heads, kv_heads in _head_counts(config.model_spec):
        if heads % tp == 0 and kv_heads % tp == 0:
            try:
                strategy.check_heads(heads // tp, kv_heads // tp, cp, ulysses)
            except ValueError as e:
                per_tp = f" (per TP rank of {tp})" if tp > 1 else ""
                raise ValueError(f"--titan_cp.strategy {section.strategy} on {CP_FLAG} {cp}{per_tp}: {e}") from None
    sp = tp if tp > 1 and p.enable_sequence_parallel else 1
    layout = seq_len_multiple(section.balance, cp)
    need = math.lcm(layout, sp * 2 * cp)
    if config.training.seq_len % need:
        raise ValueError(
            f"--training.seq_len {config.training.seq_len} is not a multiple of {need}, as {CP_FLAG} {cp} needs "
            f"(torchtitan's Trainer: 2 x CP{' x TP' if sp > 1 else ''} = {sp * 2 * cp}; titan_cp's "
            f"{section.balance} layout: {layout})"
        )


def check_run(config: Any) -> None:
    """``ValueError`` naming the flag for a run titan_cp's Trainer cannot run as set: its ``titan_cp``
    section (:meth:`TitanCPConfig.check`), torchtitan's backend, validator and pipeline settings, and the
    section against torchtitan's cp degree, model heads and ``training.seq_len``. Reads the config alone."""
    config.titan_cp.check()
    _check_torchtitan_settings(config)
    _check_linear(config)
    _check_cp(config)


def _check_world(parallelism: Any, comm_mode: str) -> None:
    """The parallel degrees against the processes torchrun started (``WORLD_SIZE``)."""
    if comm_mode != "default":
        return  # torchtitan's fake and local-tensor modes read their world size from NGPU
    world, p = int(os.environ.get("WORLD_SIZE", "1")), parallelism
    fixed = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
    fixed *= p.pipeline_parallel_degree
    shard = p.data_parallel_shard_degree
    fits = world % fixed == 0 if shard == -1 else fixed * shard == world
    if not fits:
        shards = "" if shard == -1 else f" x --parallelism.data_parallel_shard_degree {shard}"
        raise ValueError(
            f"the world size {world} (torchrun's --nproc-per-node x nodes) cannot run the parallel degrees set: "
            f"{CP_FLAG} {p.context_parallel_degree} x --parallelism.tensor_parallel_degree "
            f"{p.tensor_parallel_degree} x --parallelism.pipeline_parallel_degree {p.pipeline_parallel_degree} x "
            f"--parallelism.data_parallel_replicate_degree {p.data_parallel_replicate_degree}{shards} = "
            f"{fixed * max(shard, 1)} must {'divide' if shard == -1 else 'equal'} it"
        )


def _documents(positions: torch.Tensor) -> torch.Tensor:
    """The ``(B, max_docs)`` zero-padded host tensor of each row's document lengths, from ``positions``
    that restart at 0 at each document (checked: any other shape of positions is refused)."""
    if positions.dim() != 2:
        raise ValueError(f"the batch's positions must be (batch, seq_len), got shape {tuple(positions.shape)}")
    try:
        rows = _from_positions(positions.cpu())
    except ValueError as e:
        raise ValueError(f"torchtitan's batch positions do not describe packed documents: {e}") from None
    width = max(len(row) for row in rows)
    return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int64)


def shard_by_documents(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor,
    cp: CPHandle,
) -> Microbatch:
    """This cp rank's tokens, labels and positions, sharded by ``cp``'s layout of the documents that
    ``positions`` describe (one rank: nothing moves). The returned ``doc_lens`` is the tensor by which
    the attention finds that layout."""
    return Microbatch(inputs, labels, positions, _documents(positions)).shard(cp)


class TitanCPTrainer(Trainer):
    """torchtitan's ``Trainer`` with titan_cp's context parallelism (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        titan_cp: TitanCPConfig = field(default_factory=TitanCPConfig)

        def __post_init__(self) -> None:
            try:
                check_run(self)
            except ValueError:
                return  # refused in one line when the Trainer is built; torchtitan's checks would name another cause
            Trainer.Config.__post_init__(self)

    def __init__(self, config: Config) -> None:
        check_run(config)
        _check_world(config.parallelism, config.comm.mode)
        if not isinstance(config.model_spec.parallelize_fn, TitanCPParallelize):
            raise ValueError(
                "the model's parallelize_fn is not titan_cp's TitanCPParallelize: build the config with "
                "titan_cp.integrations.torchtitan.with_titan_cp(config_fn)"
            )
        log_info_on_rank0()
        self.cp: CPHandle | None = None  # the run's one handle, built once the cp mesh exists (init_distributed)
        super().__init__(config)

    def init_distributed(self) -> ParallelDims:
        """torchtitan's meshes, then the run's one CP handle, bound to the model's ``parallelize_fn``."""
        parallel_dims = super().init_distributed()
        section, spec = self.config.titan_cp, self.config.model_spec
        self.cp = cp_handle(parallel_dims, section.strategy, section.balance, section.kernel, section.ulysses_degree)
        spec.parallelize_fn = spec.parallelize_fn.bound(self.cp)  # the spec torchtitan's __init__ holds
        logger.info(describe(self.cp))
        return parallel_dims

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """``(inputs, labels, extra_kwargs)`` of this cp rank, sharded by titan_cp's layout; the
        model gets ``positions`` (this rank's) and ``attention_masks`` (the documents tensor). A batch with
        other per-batch inputs (images) is refused: they are not sharded by the layout."""
        extra: dict[str, Any] = {k: v for k, v in input_dict.items() if k != "input"}
        if extra.get("positions") is None:
            raise ValueError(
                "titan_cp's Trainer needs each batch's document positions: the dataloader must yield "
                "({'input': tokens, 'positions': positions}, labels) with positions (batch, seq_len) restarting "
                "at 0 at each document (torchtitan's text dataloaders do)"
            )
        unsharded = sorted(set(extra) - {"positions"})
        if unsharded:
            raise ValueError(
                f"the batch holds {unsharded} besides input and positions, which titan_cp's Trainer does not shard "
                "by its layout (multimodal inputs among them): give it text batches (torchtitan's text dataloaders)"
            )
        assert self.cp is not None, "the CP handle is built with the meshes"
        local = shard_by_documents(input_dict["input"], labels, extra["positions"], self.cp)
        extra["positions"] = local.positions
        extra.update(self._model_inputs(local.doc_lens))
        self.ntokens_seen += local.labels.numel()
        return local.tokens, local.labels, extra

    def _model_inputs(self, doc_lens: torch.Tensor | None) -> dict[str, Any]:
        """What the model takes besides tokens and positions: the documents tensor as ``attention_masks``, in the
        form the model's layers read it (a model with linear-attention layers: :func:`.linear.model_inputs`)."""
        if has_linear_layers(self.config.model_spec.model):
            from titan_cp.integrations.torchtitan.linear import model_inputs  # noqa: PLC0415 - imports Qwen3.5

            return model_inputs(doc_lens)
        return {"attention_masks": doc_lens}

    def forward_backward_step(self, *, input_dict: Any, labels: Any, global_valid_tokens: torch.Tensor) -> torch.Tensor:
        """torchtitan's step; under CP, on a step torchtitan logs, the loss returned for its metrics is the
        dp rank's whole (:func:`~.reporting.loss_for_metrics`)."""
        loss = super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )
        if not self.parallel_dims.cp_enabled or not self.metrics_processor.should_log(self.step):
            return loss
        cp = self.parallel_dims.get_mesh("cp")
        return loss_for_metrics(loss, cp.get_group(), cp.get_local_rank())
