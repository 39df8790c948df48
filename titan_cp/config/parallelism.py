"""``[parallelism]``: the mesh degrees, the pipeline schedule, and how CP attention runs.

What depends on the CP strategy (whether it reads a Ulysses degree, how many ranks split the
heads, which head counts it can split) is asked of its :class:`~titan_cp.attention.strategy.Strategy`;
this module only names the config keys in the errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from titan_cp.attention.strategy import DEFAULT_STRATEGY, Strategy, get_strategy, strategy_names
from titan_cp.balance import balance_names
from titan_cp.config.values import OneOf, Positive, PositiveOrAuto, Section
from titan_cp.errors import plural
from titan_cp.layout import DEFAULT_BALANCE

ULYSSES_KEY = "parallelism.context_parallel_ulysses_degree"
CP_KEY = "parallelism.context_parallel_degree"


@dataclass
class Parallelism(Section, name="parallelism"):
    data_parallel_replicate_degree: Annotated[int, Positive] = 1
    """Replicas of the weights (DDP, or HSDP with data_parallel_shard_degree > 1). 1: off."""

    data_parallel_shard_degree: Annotated[int, PositiveOrAuto] = -1
    """FSDP sharding degree. -1: the ranks left after every other degree."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP ``reshard_after_forward``: ``default`` and ``always`` free the gathered weights after
    each block's forward (gathering them again for the backward), except under pipeline
    parallelism, where they stay gathered between a stage's microbatches; ``never`` keeps them."""

    tensor_parallel_degree: Annotated[int, Positive] = 1
    """Tensor-parallel degree. 1: off."""

    pipeline_parallel_degree: Annotated[int, Positive] = 1
    """Pipeline-parallel degree (ranks, not stages). 1: off."""

    pipeline_parallel_schedule: Literal[
        "1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = "1F1B"
    """``torch.distributed.pipelining`` schedule."""

    pipeline_parallel_microbatch_size: Annotated[int, Positive] = 1
    """Rows per pipeline microbatch; must divide ``training.local_batch_size``, into as many microbatches as the
    schedule takes (:meth:`Parallelism.check_microbatches`: 1F1B and DualPipeV at least one per stage)."""

    context_parallel_degree: Annotated[int, Positive] = 1
    """Context-parallel degree: ranks that split one sequence. 1: off."""

    context_parallel_strategy: Annotated[str, OneOf(strategy_names)] = DEFAULT_STRATEGY
    """How attention exchanges data on the ``cp`` axis: a registered strategy's name
    (:func:`~titan_cp.attention.strategy.register_strategy`). Built in: ``ring`` (K/V blocks passed
    around a ring, overlapped with compute), ``allgather`` (all-gather K/V), ``ulysses`` (all-to-all,
    sequence to heads), ``hybrid`` (Ulysses inside, ring across)."""

    context_parallel_load_balancer: Annotated[str, OneOf(balance_names)] = DEFAULT_BALANCE
    """Sequence layout over cp ranks: ``contiguous`` (rank r holds chunk r), ``zigzag`` (rank r holds
    chunks r and 2*cp-1-r), ``doc_zigzag`` (zigzag within each packed document), ``doc_local``
    (documents whole on one rank where the causal balance allows, only long ones split: the least
    communication; the default), or any balance registered since
    (:func:`~titan_cp.balance.register_balance`). torchtitan's ``headtail`` is read as ``zigzag``."""

    context_parallel_ulysses_degree: Annotated[int, Positive] = 1
    """For ``hybrid``: size of the inner Ulysses axis (``cp_ulysses``); the ring axis
    (``cp_ring``) has ``context_parallel_degree / context_parallel_ulysses_degree`` ranks."""

    def strategy(self) -> Strategy:
        return get_strategy(self.context_parallel_strategy)

    def check(self) -> None:
        """The Ulysses degree must fit the strategy: a divisor of the cp degree where the strategy
        reads one, 1 everywhere else."""
        s, cp, u = self.strategy(), self.context_parallel_degree, self.context_parallel_ulysses_degree
        try:
            s.check_degrees(cp, u)
        except ValueError:
            if s.takes_ulysses_degree():
                raise ValueError(f"{ULYSSES_KEY} ({u}) must divide {CP_KEY} ({cp})") from None
            readers = " or ".join(repr(n) for n in strategy_names() if get_strategy(n).takes_ulysses_degree())
            raise ValueError(
                f"{ULYSSES_KEY} is only used with parallelism.context_parallel_strategy = {readers}; got strategy "
                f"{s.name!r}: leave the degree at 1 or set the strategy to {readers}"
            ) from None

    def pipeline_stages(self) -> int:
        """Pipeline stages: one per rank for ``1F1B`` and ``GPipe``, two for the others
        (``titan_cp.parallel.pp.build_pipeline``'s default)."""
        single = self.pipeline_parallel_schedule in ("1F1B", "GPipe")
        return self.pipeline_parallel_degree * (1 if single else 2)

    def check_microbatches(self, local_batch_size: int) -> None:
        """The schedule must take the step's microbatches, ``local_batch_size / pipeline_parallel_microbatch_size``
        (as the trainer builds it; divisibility is checked before): ``torch.distributed.pipelining``'s own
        rules, refused here before any process group instead of by the schedule's constructor."""
        pp, schedule, rows = (
            self.pipeline_parallel_degree,
            self.pipeline_parallel_schedule,
            self.pipeline_parallel_microbatch_size,
        )
        if pp == 1:
            return
        n = local_batch_size // rows
        count = (
            f"{n} microbatch{'es' if n != 1 else ''} (training.local_batch_size {local_batch_size} / "
            f"parallelism.pipeline_parallel_microbatch_size {rows})"
        )
        stages = self.pipeline_stages()
        if schedule in ("1F1B", "DualPipeV") and n < stages:
            raise ValueError(
                f"parallelism.pipeline_parallel_schedule = {schedule!r} needs at least as many microbatches as its "
                f"{stages} pipeline stages, got {count}: raise training.local_batch_size to {stages * rows} or more"
                + (" or lower parallelism.pipeline_parallel_microbatch_size" if rows > 1 else "")
            )
        rounds = max(1, n // pp)
        if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and n % rounds:
            low, high = pp * (n // pp), pp * -(-n // pp)  # multiples of pp: as many microbatches in every round
            raise ValueError(
                f"parallelism.pipeline_parallel_schedule = {schedule!r} needs the microbatches to be a multiple of "
                f"its rounds ({n} // parallelism.pipeline_parallel_degree {pp} = {rounds}), got {count}: set "
                f"training.local_batch_size to {low * rows} or {high * rows}"
            )

    def check_model(self, flavor: str, n_heads: int, n_kv_heads: int, n_layers: int) -> None:
        """Degrees the flavor's heads and layers can take (TP splits heads; the strategy may split
        each TP shard's heads again; pipeline stages need at least one layer each)."""
        tp = self.tensor_parallel_degree
        for what, count in (("heads", n_heads), ("KV heads", n_kv_heads)):
            if count % tp:
                raise ValueError(
                    f"parallelism.tensor_parallel_degree ({tp}) must divide the {what} of "
                    f"model.flavor = {flavor!r} ({count})"
                )
        q, kv = n_heads // tp, n_kv_heads // tp
        s, cp, u = self.strategy(), self.context_parallel_degree, self.context_parallel_ulysses_degree
        try:
            s.check_heads(q, kv, cp, u)
        except ValueError:
            key = ULYSSES_KEY if s.takes_ulysses_degree() else CP_KEY
            raise ValueError(
                f"{key} ({s.ulysses_size(cp, u)}) must divide the query heads per tensor-parallel rank of "
                f"model.flavor = {flavor!r} ({n_heads} / tp {tp} = {q}), and divide or be a multiple of its KV "
                f"heads per rank ({kv})"
            ) from None
        stages = self.pipeline_stages()
        if self.pipeline_parallel_degree > 1 and n_layers < stages:
            raise ValueError(
                f"parallelism.pipeline_parallel_degree ({self.pipeline_parallel_degree}) with schedule "
                f"{self.pipeline_parallel_schedule!r} makes {stages} stages, more than the {plural(n_layers, 'layer')} "
                f"of model.flavor = {flavor!r}"
            )
