"""What is planned: the workload (model, rows, checkpointing, dtype) and one candidate mesh + CP strategy."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining.schedules import PipelineScheduleSingle, ScheduleGPipe, get_schedule_class

from titan_cp.attention.pricing import StrategyCost, cost_of
from titan_cp.attention.ring import RING as LOCAL  # attention on one rank: the ring's one-device path
from titan_cp.attention.strategy import Strategy, get_strategy
from titan_cp.families.llama3.model import ModelArgs
from titan_cp.layout import DEFAULT_BALANCE
from titan_cp.plan import linear as lin
from titan_cp.plan.memory import HostOptions, RankModel


@dataclass(frozen=True)
class Candidate:
    """One mesh ``pp x dp_replicate x dp_shard x cp x tp`` and the CP strategy on its ``cp`` axis; ``ep``: expert
    parallelism's degree (torchtitan's), over ``ep`` consecutive ranks of ``dp_shard x cp x tp``
    (:mod:`titan_cp.plan.moe`)."""

    strategy: str
    dp_shard: int
    dp_replicate: int
    cp: int
    tp: int
    pp: int
    ulysses: int = 1  # the hybrid strategy's Ulysses degree
    ep: int = 1

    @property
    def attention(self) -> Strategy:
        """The strategy's object (plain local attention without CP)."""
        return get_strategy(self.strategy) if self.cp > 1 else LOCAL

    @property
    def cost(self) -> StrategyCost:
        """The strategy's cost object (:mod:`titan_cp.attention.pricing`)."""
        return cost_of(self.attention)

    @property
    def ngpu(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def fsdp(self) -> int:
        """Ranks FSDP shards the weights over (``dp_shard x cp``)."""
        return self.dp_shard * self.cp

    @property
    def ulysses_size(self) -> int:
        return self.attention.ulysses_size(self.cp, self.ulysses)

    @property
    def ring_size(self) -> int:
        return self.attention.ring_size(self.cp, self.ulysses)

    @property
    def degrees(self) -> dict[str, int]:
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
            "ep": self.ep,
        }

    def span(self, axis: str) -> int:
        """Consecutive ranks a group of ``axis`` spans (axes innermost first: tp, cp, dp_shard, dp_replicate, pp)."""
        order = ("tp", "cp", "dp_shard", "dp_replicate", "pp")
        span = 1
        for name in order[: order.index(axis) + 1]:
            span *= self.degrees[name]
        return span


@dataclass(frozen=True)
class Workload:
    """The model and the step the mesh must run.

    rows: each local row's document lengths (``training.local_batch_size`` rows).
    ac, ac_every: activation checkpointing as :class:`~titan_cp.plan.memory.RankModel` takes it.
    microbatch_rows: rows per pipeline microbatch; schedule: the pipeline schedule's name.
    reshard: FSDP frees a block's gathered weights after its forward (never under PP).
    """

    args: ModelArgs
    seq_len: int
    rows: tuple[tuple[int, ...], ...]
    balance: str = DEFAULT_BALANCE
    ac: str = "none"
    ac_every: int = 1
    act_bytes: int = 2
    accum: int = 1
    microbatch_rows: int = 1
    schedule: str = "1F1B"
    reshard: bool = True
    host: HostOptions = HostOptions()  # the long-context memory options, host memory per node
    fused_norm: bool = False  # on a GPU: RMSNorm as its fused kernel (titan_cp.plan.memory.norm_saved_per_token)

    @property
    def docs_per_row(self) -> int:
        return max(len(r) for r in self.rows)

    def microbatches(self, pp: int) -> int:
        """Pipeline microbatches per step (the whole local batch is one without a pipeline)."""
        return len(self.rows) // self.microbatch_rows if pp > 1 else 1

    def rows_per_microbatch(self, pp: int) -> int:
        return len(self.rows) // self.microbatches(pp)

    def rank_model(self, c: Candidate) -> RankModel:
        return RankModel(
            self.args,
            c.strategy,
            c.cp,
            c.tp,
            c.ulysses,
            self.act_bytes,
            self.ac,
            self.ac_every,
            self.host,
            self.fused_norm,
            self.docs_per_row > 1,
            self.linear_work(c.cp, c.pp),
            c.ep,
        )

    def linear_works(self, cp: int, pp: int) -> tuple[lin.LinearWork, ...]:
        """Every cp rank's share of one microbatch's linear layers (a hybrid model's; ``()`` for others)."""
        shapes, _ = lin.linear_shapes(self.args)
        if shapes is None:
            return ()
        rows = self.rows[: self.rows_per_microbatch(pp)]
        return lin.linear_work(self.seq_len, cp, self.balance, rows, shapes.conv, late=shapes.gated_delta)

    def linear_work(self, cp: int, pp: int) -> lin.LinearWork | None:
        """:meth:`linear_works` of the rank that keeps the most (``None`` without linear layers)."""
        shapes, _ = lin.linear_shapes(self.args)
        works = self.linear_works(cp, pp)
        return lin.heaviest(shapes, works, self.act_bytes) if shapes is not None and works else None


@dataclass(frozen=True)
class Pipeline:
    """What a schedule keeps in flight and how long it idles, on the first and the last stage."""

    in_flight_first: int
    in_flight_last: int
    grads_held_first: bool  # a later backward runs while an earlier one's gradients are held
    grads_held_last: bool
    bubble: float  # idle microbatch slots per step


def pipeline(schedule: str, microbatches: int, pp: int) -> Pipeline:
    """1F1B: ``min(microbatches, pp)`` forwards in flight on the first stage, one on the last;
    GPipe: all of them everywhere. The bubble: ``pp - 1`` slots, ``(pp - 1) / 2`` for the
    schedules with two stages per rank (their in-flight count is planned as 1F1B's)."""
    if pp == 1:
        return Pipeline(1, 1, False, False, 0.0)
    cls = get_schedule_class(schedule)
    bubble = float(pp - 1) if issubclass(cls, PipelineScheduleSingle) else (pp - 1) / 2
    if cls is ScheduleGPipe:
        return Pipeline(microbatches, microbatches, False, False, bubble)
    first = min(microbatches, pp)
    return Pipeline(first, 1, microbatches > first, microbatches > 1, bubble)
