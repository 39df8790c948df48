"""torchtitan 0.3's ``Trainer`` with titan_cp's packed-document context parallelism.

:class:`TitanCPTrainer` is torchtitan's ``Trainer`` (its loop, loss, optimizer, checkpoints,
logging, launch) with two changes:

- its ``Config`` has a ``titan_cp`` section (:class:`TitanCPConfig`: ``--titan_cp.strategy``,
  ``--titan_cp.balance``, ``--titan_cp.kernel`` on torchtitan's command line), which it binds to
  every :class:`~.attention.TitanCPAttention` of the model before building it;
- :meth:`TitanCPTrainer.post_dataloading_process` turns each batch's ``positions`` (0 at each
  document start, as torchtitan's dataloaders yield them) into titan_cp's documents, builds the
  layout with the model's CP handle (the ``titan_cp.balance``) and shards inputs, labels and
  positions by it (:meth:`titan_cp.step.Microbatch.shard`, titan_cp's own trainer's sharding),
  instead of torchtitan's head-tail split; the layout's documents tensor goes to every layer as
  ``attention_masks``.

torchtitan's labels are already next-token targets inside each document, so sharding them with
the tokens keeps every target; the loss stays torchtitan's (local summed CE over the step's
global valid-token count, gradients summed over ``dp x cp`` by FSDP), equal to the unsharded run's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torchtitan.trainer import Trainer

from titan_cp.attention.api import local_handle
from titan_cp.attention.handle import CPHandle
from titan_cp.attention.strategy import DEFAULT_STRATEGY, get_strategy, strategy_names
from titan_cp.balance import balance_names
from titan_cp.errors import did_you_mean
from titan_cp.integrations.hf_batch import _from_positions
from titan_cp.integrations.torchtitan.attention import TitanCPAttention
from titan_cp.layout import DEFAULT_BALANCE
from titan_cp.parallel import handle_of
from titan_cp.step import Microbatch

SPMD_BACKEND = "partial_dtensor"  # torchtitan's backend whose CP step is a function titan_cp replaces


@dataclass(kw_only=True, slots=True)
class TitanCPConfig:
    """The ``titan_cp`` section of a torchtitan run (the CP size is torchtitan's own
    ``--parallelism.context_parallel_degree``)."""

    strategy: str = DEFAULT_STRATEGY
    """CP attention strategy: ring, allgather, ulysses, hybrid (with ulysses_degree) or any registered."""
    balance: str = DEFAULT_BALANCE
    """Sequence layout: doc_local, doc_zigzag, zigzag, contiguous or any registered."""
    kernel: str | None = None
    """titan_cp's local attention kernel; None for the fastest on the device and dtype."""
    ulysses_degree: int = 1
    """hybrid only: ranks of each Ulysses group inside the cp axis (the cp degree / it make the ring)."""

    def __post_init__(self):
        for key, value, names in (
            ("strategy", self.strategy, strategy_names()),
            ("balance", self.balance, balance_names()),
        ):
            if value not in names:
                raise ValueError(
                    f"--titan_cp.{key} {value!r} is not one of titan_cp's {key}s{did_you_mean(value, names)} "
                    f"(choose one of {', '.join(names)})"
                )
        strategy = get_strategy(self.strategy)
        if strategy.takes_ulysses_degree() != (self.ulysses_degree > 1) or self.ulysses_degree < 1:
            want = "a --titan_cp.ulysses_degree of 2 or more" if strategy.takes_ulysses_degree() else "none"
            raise ValueError(
                f"--titan_cp.strategy {self.strategy!r} takes {want}, got --titan_cp.ulysses_degree "
                f"{self.ulysses_degree}"
            )


def bind_titan_cp(model_config: Any, section: TitanCPConfig) -> int:  # a torchtitan model's Config
    """Set ``section``'s strategy, balance, kernel and Ulysses degree on every ``TitanCPAttention`` config of
    ``model_config``; returns how many there are (``ValueError`` when none)."""
    found = [cfg for _, cfg, _, _ in model_config.traverse(TitanCPAttention.Config)]
    if not found:
        raise ValueError(
            "the model has no TitanCPAttention layer: build the config with "
            "titan_cp.integrations.torchtitan.with_titan_cp(config_fn), which puts it in every layer"
        )
    for cfg in found:
        cfg.strategy, cfg.balance, cfg.kernel = section.strategy, section.balance, section.kernel
        cfg.ulysses_degree = section.ulysses_degree
    return len(found)


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


def _schedules_take_microbatch_lists() -> bool:
    """Whether this torch's pipeline schedules take the per-microbatch lists torchtitan 0.3 passes."""
    return all(
        "arg_mbs" in inspect.signature(s.step).parameters for s in (PipelineScheduleSingle, PipelineScheduleMulti)
    )


class TitanCPTrainer(Trainer):
    """torchtitan's ``Trainer`` with titan_cp's context parallelism (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        titan_cp: TitanCPConfig = field(default_factory=TitanCPConfig)

    def __init__(self, config: Config) -> None:
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
                "torchtitan 0.3's pipeline step calls the schedule's step(arg_mbs=..., kwarg_mbs=...), "
                f"which torch {torch.__version__}'s torch.distributed.pipelining does not take (it would split the "
                "list as a model argument): pipeline parallelism under torchtitan 0.3 needs a torch whose schedules "
                "do; drop --parallelism.pipeline_parallel_degree (titan_cp's own trainer runs PP x CP)"
            )
        bind_titan_cp(config.model_spec.model, config.titan_cp)
        super().__init__(config)
        self.cp: CPHandle = handle_of(self.model_parts[0]) or local_handle()  # what every batch is sharded with

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """``(inputs, labels, extra_kwargs)`` of this cp rank, sharded by titan_cp's layout; the
        model gets ``positions`` (this rank's) and ``attention_masks`` (the documents tensor)."""
        extra: dict[str, Any] = {k: v for k, v in input_dict.items() if k != "input"}
        if extra.get("positions") is None:
            raise ValueError(
                "titan_cp's Trainer needs each batch's document positions: the dataloader must yield "
                "({'input': tokens, 'positions': positions}, labels) with positions (batch, seq_len) restarting "
                "at 0 at each document (torchtitan's text dataloaders do)"
            )
        local = shard_by_documents(input_dict["input"], labels, extra["positions"], self.cp)
        extra["positions"], extra["attention_masks"] = local.positions, local.doc_lens
        self.ntokens_seen += local.labels.numel()
        return local.tokens, local.labels, extra
