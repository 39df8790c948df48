"""The search: every mesh and CP strategy the trainer runs on ``ngpu`` GPUs, the estimates that can
matter, and the recommendation (of the plans that fit within 2% of the fastest, the one with the most
memory to spare, in 2 GB steps, then the fastest).

- **What runs is the trainer's to say.** Every mesh ``pp x dp_replicate x dp_shard x cp x tp`` of the
  nodes (:func:`meshes`: TP inside a node) with every strategy its heads allow (:func:`strategies_for`) is
  a plan; its config keys are set on the job config and put through the trainer's own checks
  (:class:`~titan_cp.plan.checks.TrainerChecks`), and a plan the trainer refuses is never estimated.
- **Only what can matter is estimated** (branch and bound). Whether a plan fits is known from its shapes
  (:func:`stage_memories`), and a lower bound of its step in closed form
  (:func:`~titan_cp.plan.cost.step_lower_bound`: no layout, no mask tiles). Plans that fit are estimated
  in the order of their bounds; once a plan's bound is more than 2% slower than the fastest estimate, it
  and every plan after it can be neither the fastest nor within 2% of it, so none is estimated
  (:class:`Skipped` counts them). ``exhaustive`` estimates every plan the trainer runs, fitting or not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from titan_cp.ac_modes import ac_mode_and_every
from titan_cp.attention.strategy import get_strategy, strategy_names
from titan_cp.config.training import MAX_SEQ_LEN
from titan_cp.data.row_mixes import make_rows
from titan_cp.errors import plural
from titan_cp.families import get_family
from titan_cp.families.llama3.model import ModelArgs
from titan_cp.layout import get_layout
from titan_cp.plan import moe as mx
from titan_cp.plan.checks import Keys, TrainerChecks, with_keys
from titan_cp.plan.cost import Cost, Setting, Stack, attention_work, causal_pairs, step_cost, step_lower_bound
from titan_cp.plan.devices import GB, HEADROOM, Device, device, node_count
from titan_cp.plan.linear import model_flops as linear_model_flops
from titan_cp.plan.memory import HostOptions, RankMemory, Sharding, pipeline_stages, rank_memory
from titan_cp.plan.problem import LOCAL, Candidate, Workload, pipeline
from titan_cp.preflight import check_model

if TYPE_CHECKING:
    from titan_cp.config import JobConfig

NEAR_FASTEST = 0.98  # plans within 2% of the fastest are ranked by memory to spare
MEMORY_STEP = 2 * GB


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return small + [n // i for i in reversed(small) if i * i != n]


def strategies_for(cp: int, q_heads: int, kv_heads: int) -> list[tuple[str, int]]:
    """``(strategy, ulysses degree)`` of every CP strategy the local heads allow on ``cp`` ranks
    (a strategy that takes a Ulysses degree: each proper divisor of ``cp``)."""
    if cp == 1:
        return [(LOCAL.name, 1)]
    out = []
    for name in strategy_names():
        s = get_strategy(name)
        for u in _divisors(cp)[1:-1] if s.takes_ulysses_degree() else [1]:
            try:
                s.check_degrees(cp, u)
                s.check_heads(q_heads, kv_heads, cp, u)
            except ValueError:
                continue
            out.append((name, u))
    return out


def meshes(ngpu: int, nnodes: int) -> Iterator[Candidate]:
    """Every mesh ``pp x dp_replicate x dp_shard x cp x tp`` of ``ngpu`` GPUs on ``nnodes`` nodes, with the
    ring on its cp axis (TP inside a node; HSDP replicates over the nodes, or nothing). What the trainer
    runs of them is its checks' to say (:func:`candidates`)."""
    for tp in _divisors(ngpu // nnodes):
        for pp in _divisors(ngpu // tp):
            rest = ngpu // (tp * pp)
            for rep in sorted({1, nnodes}):
                if rest % rep == 0:
                    for cp in _divisors(rest // rep):
                        yield Candidate(LOCAL.name, rest // rep // cp, rep, cp, tp, pp)


def candidates(
    checks: TrainerChecks,
    w: Workload,
    ngpu: int,
    nnodes: int,
    runs: Callable[[Candidate], bool],
    expert_parallel: bool = False,
) -> list[Candidate]:
    """Every mesh (:func:`meshes`) and CP strategy (:func:`strategies_for`) the trainer runs with ``w``'s
    options, as ``checks`` says, and ``runs`` (a given model's trainer) takes; with ``expert_parallel`` (a trainer
    that runs torchtitan's EP) each of them at every expert-parallel degree of a model with experts
    (:func:`~titan_cp.plan.moe.ep_degrees`). A mesh is checked with the ring, which splits no heads, before its
    other strategies: one the trainer refuses then has none."""
    out = []
    for mesh in meshes(ngpu, nnodes):
        if not (runs(mesh) and checks.runs(mesh, w)):
            continue
        heads, kv_heads = w.args.n_heads // mesh.tp, w.args.kv_heads // mesh.tp
        eps = mx.ep_degrees(w.args, mesh.dp_shard, mesh.cp, mesh.tp) if expert_parallel else [1]
        for strategy, u in strategies_for(mesh.cp, heads, kv_heads):
            for ep in eps:
                c = dataclasses.replace(mesh, strategy=strategy, ulysses=u, ep=ep)
                if c == mesh or (runs(c) and checks.runs(c, w)):
                    out.append(c)
    return out


@dataclass(frozen=True)
class Estimate:
    """One candidate's memory and time per rank."""

    candidate: Candidate
    workload: Workload
    device: Device
    stages: tuple[RankMemory, ...]  # the first and the last pipeline stage (one without a pipeline)
    cost: Cost
    keys: Keys = field(default_factory=dict)  # the config keys that run it (titan_cp.plan.checks.plan_keys)

    @property
    def memory(self) -> RankMemory:
        """The rank that holds the most."""
        return max(self.stages, key=lambda r: r.total)

    @property
    def host_bytes(self) -> int:
        """Host bytes of the rank that holds the most there (offloads)."""
        return max(r.host for r in self.stages)

    @property
    def fits(self) -> bool:
        return plan_fits(self.stages, self.candidate, self.workload, self.device)

    @property
    def headroom_bytes(self) -> int:
        return int((1 - HEADROOM) * self.device.memory_bytes - self.memory.total)

    @property
    def global_tokens(self) -> int:
        return global_tokens(self.candidate, self.workload)

    @property
    def model_flops(self) -> int:
        """``ModelArgs.training_flops`` of the step over every data-parallel rank (the MFU numerator), a hybrid's
        linear kernels over its documents added (:func:`~titan_cp.plan.linear.model_flops`)."""
        w, c = self.workload, self.candidate
        total = attention_work(w.seq_len, c.cp, c.ring_size, c.ulysses_size, w.balance, w.rows).total
        flops = w.args.training_flops(w.seq_len * len(w.rows), total) + linear_model_flops(w.args, w.rows)
        return flops * c.dp_shard * c.dp_replicate * w.accum

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.global_tokens / self.cost.step / self.candidate.ngpu

    @property
    def mfu(self) -> float:
        return self.model_flops / self.cost.step / self.candidate.ngpu / self.device.peak_flops


def global_tokens(c: Candidate, w: Workload) -> int:
    """Tokens of one optimizer step of ``c`` over every data-parallel rank."""
    return w.seq_len * len(w.rows) * c.dp_shard * c.dp_replicate * w.accum


def stage_memories(c: Candidate, w: Workload) -> tuple[RankMemory, ...]:
    """Memory of the first and the last pipeline stage of ``c`` (one without a pipeline): shapes only, no
    layout and no time, so whether a plan fits is known before any candidate's time is estimated."""
    m = w.rank_model(c)
    stages = pipeline_stages(w.args, c.pp)
    pipe = pipeline(w.schedule, w.microbatches(c.pp), c.pp)
    sharding = Sharding(c.fsdp, c.pp > 1, w.reshard)
    rows, local = w.rows_per_microbatch(c.pp), w.seq_len // c.cp
    flight = ((pipe.in_flight_first, pipe.grads_held_first), (pipe.in_flight_last, pipe.grads_held_last))
    return tuple(
        rank_memory(m, stage, sharding, local, w.docs_per_row, rows, in_flight, held)
        for stage, (in_flight, held) in zip(stages, flight)
    )


def plan_fits(stages: tuple[RankMemory, ...], c: Candidate, w: Workload, dev: Device) -> bool:
    """The rank holding the most within the device's memory and a node's ranks' host bytes within its
    host memory, each less :data:`HEADROOM` (:attr:`Estimate.fits`)."""
    host_per_node = max(r.host for r in stages) * min(dev.gpus_per_node, c.ngpu)
    host_fits = host_per_node <= (1 - HEADROOM) * w.host.host_bytes_per_node
    return max(r.total for r in stages) <= (1 - HEADROOM) * dev.memory_bytes and host_fits


def evaluate(c: Candidate, w: Workload, dev: Device, stack: Stack, keys: Keys | None = None) -> Estimate:
    """Memory (the worse of the first and the last pipeline stage) and time (the largest stage) of ``c``;
    ``keys``: the config keys that run it."""
    return Estimate(c, w, dev, stage_memories(c, w), step_cost(_setting(c, w, dev, stack)), dict(keys or {}))


def _setting(c: Candidate, w: Workload, dev: Device, stack: Stack) -> Setting:
    """``c``'s :class:`~titan_cp.plan.cost.Setting` on its largest pipeline stage (the time's)."""
    return Setting(c, w, dev, stack, max(pipeline_stages(w.args, c.pp), key=lambda s: s.layers))


def speed_bound(c: Candidate, w: Workload, dev: Device, stack: Stack, pairs: int) -> float:
    """An upper bound of ``c``'s tokens/s per GPU: its step's lower bound (:func:`~titan_cp.plan.cost.step_lower_bound`;
    ``pairs``: :func:`~titan_cp.plan.cost.causal_pairs` of the rows)."""
    return global_tokens(c, w) / step_lower_bound(_setting(c, w, dev, stack), pairs) / c.ngpu


@dataclass(frozen=True)
class Context:
    """Where the plans were made (printed with every record)."""

    gpu: str
    ngpu: int
    nnodes: int
    doc_mix: str
    ac: str
    flavor: str
    balance: str
    configured: Candidate | None = None  # the config's own degrees and strategy (dp_shard free)


@dataclass(frozen=True)
class Skipped:
    """The plans not estimated, by why: ``refused`` by the trainer's checks (``refusal``: the most frequent
    error), ``no_fit`` (their memory, known from shapes, exceeds the device's while others fit), ``bounded``
    (the lower bound of their step is more than 2% slower than the fastest estimate)."""

    refused: int = 0
    refusal: str | None = None
    no_fit: int = 0
    bounded: int = 0

    def line(self, estimated: int) -> str:
        """One line saying what was estimated and what not, and why."""
        parts = [f"{plural(self.no_fit, 'plan')} that do not fit"] * (self.no_fit > 0)
        parts += [f"{plural(self.bounded, 'plan')} whose step's lower bound is over 2% slower than the fastest"] * (
            self.bounded > 0
        )
        parts += [f"{plural(self.refused, 'plan')} the trainer refuses (most often: {self.refusal})"] * (
            self.refused > 0
        )
        return f"estimated {plural(estimated, 'plan')}; not estimated: " + ("; ".join(parts) or "none")


@dataclass(frozen=True)
class PlanResult:
    """The estimated plans, the recommended one first, and what was not estimated (:class:`Skipped`)."""

    estimates: tuple[Estimate, ...]
    context: Context
    reason: str
    recommended: bool = False
    skipped: Skipped = Skipped()

    @property
    def best(self) -> Estimate:
        return self.estimates[0]

    def is_configured(self, e: Estimate) -> bool:
        want, c = self.context.configured, e.candidate
        if want is None:
            return False
        same = all(getattr(c, k) == getattr(want, k) for k in ("pp", "dp_replicate", "cp", "tp", "ep"))
        return same and (c.cp == 1 or (c.strategy, c.ulysses) == (want.strategy, want.ulysses))


def _rank(estimates: list[Estimate]) -> list[Estimate]:
    """Fitting first, then by speed; among those that fit within 2% of the fastest, the most headroom first."""
    ranked = sorted(estimates, key=lambda e: (not e.fits, -e.tokens_per_second_per_gpu, e.memory.total))
    fastest = ranked[0].tokens_per_second_per_gpu
    near = [e for e in ranked if e.fits and e.tokens_per_second_per_gpu >= NEAR_FASTEST * fastest]
    if near:
        first = min(near, key=lambda e: (e.memory.total // MEMORY_STEP, -e.tokens_per_second_per_gpu))
        ranked.remove(first)
        ranked.insert(0, first)
    return ranked


NOTHING_FITS = "nothing fits, even with activations, optimizer and shards on the host: raise cp or tp, or shorten rows"


def reason(e: Estimate, nothing_fits: str = NOTHING_FITS) -> str:
    """Why ``e`` is recommended (or ``nothing_fits``)."""
    if not e.fits:
        return nothing_fits
    why = (
        f"least memory within 2% of the fastest that fits: {e.tokens_per_second_per_gpu:,.0f} tokens/s/GPU, "
        f"{e.memory.total / GB:.1f} of {e.device.memory_bytes / GB:.0f} GB"
    )
    ratio = e.cost.ring.ratio if e.cost.ring is not None else None
    if ratio is not None:
        hidden = "hides" if ratio >= 1 else "cannot hide"
        why += f"; the ring {hidden} its K/V transfer (compute/transfer {ratio:.1f}x)"
    elif e.candidate.cp > 1:
        why += f"; {e.candidate.strategy} exposes {e.cost.exposed_seconds * 1e3:.1f} ms of communication per step"
    return why


def workload_of(
    job_config: JobConfig,
    gpu: str,
    doc_mix: str,
    seed: int,
    host_gb: float = 2000.0,
    given: GivenModel | None = None,
) -> tuple[Workload, str]:
    """The config's :class:`Workload` (of ``given``'s model when given) and the activation checkpointing
    it is planned with (op-level selective checkpointing is planned as full: an upper bound on memory and time)."""
    t, p = job_config.training, job_config.parallelism
    mode, every = ac_mode_and_every(
        job_config.activation_checkpoint.mode, job_config.activation_checkpoint.selective_ac_option
    )
    if mode == "op" or (mode == "selective" and every == 1):
        mode, every = "full", 1
    rows = tuple(tuple(r) for r in make_rows(doc_mix, t.seq_len, t.local_batch_size, seed))
    w = Workload(
        args=given.shapes if given is not None else check_model(job_config).planner_args(job_config),
        seq_len=t.seq_len,
        rows=rows,
        balance=p.context_parallel_load_balancer,
        ac=mode,
        ac_every=every,
        act_bytes=4 if (t.mixed_precision_param == "float32" or gpu == "cpu") else 2,
        accum=max(1, t.gradient_accumulation_steps),
        microbatch_rows=p.pipeline_parallel_microbatch_size,
        schedule=p.pipeline_parallel_schedule,
        reshard=p.fsdp_reshard_after_forward != "never",
        host=host_options(job_config, host_gb),
        fused_norm=gpu != "cpu",
    )
    return w, mode


def host_options(job_config: JobConfig, host_gb: float = 2000.0) -> HostOptions:
    """The config's long-context memory options and ``host_gb`` of host memory per node."""
    ac = job_config.activation_checkpoint
    return HostOptions(
        cpu_offload=ac.cpu_offload,
        blocks_per_checkpoint=ac.blocks_per_checkpoint,
        tile_tokens=ac.tile_tokens,
        fsdp_offload=job_config.training.enable_cpu_offload,
        host_bytes_per_node=host_gb * GB,
    )


# what the planner turns on, in this order, when nothing fits as configured (each level adds to the last):
# full AC, the checkpointed inputs on the host, the feed-forward in tiles, FSDP's shards and AdamW on the
# host, then two blocks per checkpoint (halves the host bytes of the inputs)
TILE_TOKENS = 8192
ESCALATION: tuple[dict[str, Any], ...] = (
    dict(ac="full"),
    dict(cpu_offload=True),
    dict(tile_tokens=TILE_TOKENS),
    dict(fsdp_offload=True),
    dict(blocks_per_checkpoint=2),
)


def escalate(w: Workload, level: int) -> Workload:
    """``w`` with the first ``level`` steps of :data:`ESCALATION` on (options already on stay on)."""
    host, ac = w.host, w.ac
    for step in ESCALATION[:level]:
        ac = step.get("ac", ac)
        fields = {k: v for k, v in step.items() if k != "ac" and getattr(host, k) in (False, 0, 1)}
        host = dataclasses.replace(host, **fields)
    return dataclasses.replace(w, ac=ac, ac_every=1 if ac == "full" else w.ac_every, host=host)


def _any_candidate(c: Candidate) -> bool:
    return True


@dataclass(frozen=True)
class GivenModel:
    """A model planned as given rather than by the config's family (``model.name``): a torchtitan 0.3
    config function's (:mod:`titan_cp.plan.torchtitan`). ``shapes`` as a family's ``planner_args``,
    ``label`` its name in the plan, ``runs`` the candidates its trainer runs, ``escalation`` how many
    options of :data:`ESCALATION` it has (the first: full activation checkpointing), ``nothing_fits`` the
    reason printed when none fits, ``expert_parallel`` whether its trainer runs expert parallelism (its plans
    then take each EP degree, :func:`candidates`; ``ep`` the configured one)."""

    shapes: ModelArgs
    label: str
    runs: Callable[[Candidate], bool] = _any_candidate
    escalation: int = len(ESCALATION)
    nothing_fits: str = NOTHING_FITS
    expert_parallel: bool = False
    ep: int = 1


@dataclass(frozen=True)
class Search:
    """What a plan is searched from: the device, the workload as configured (``base``), the nodes, the
    trainer's checks and the plans it runs with the configured options (``cands``), and how many it refused."""

    dev: Device
    base: Workload
    nnodes: int
    checks: TrainerChecks
    cands: list[Candidate]
    refused: int


def _setup(
    job_config: JobConfig,
    ngpu: int,
    gpu: str,
    nnodes: int | None,
    doc_mix: str,
    hbm_gb: float | None,
    seed: int,
    host_gb: float,
    given: GivenModel | None = None,
) -> Search:
    """The :class:`Search` of a plan: the checks :func:`plan` makes before estimating anything (``nnodes``:
    ``None`` for whole nodes of the device; ``given``: a :class:`GivenModel`, whose trainer's plans alone
    are listed). ``ValueError`` with the trainer's most frequent refusal when it runs no plan at all."""
    if ngpu < 1:
        raise ValueError(f"--ngpu must be positive, got {ngpu}")
    nnodes = node_count(gpu, ngpu, nnodes)
    dev = device(gpu, hbm_gb, nnodes, ngpu)
    job_config.parallel_dims(ngpu)  # the configured degrees must lay out on ngpu (names the key)
    w, _ = workload_of(job_config, gpu, doc_mix, seed, host_gb, given)
    label = given.label if given is not None else get_family(job_config.model.name).plan_label(job_config, w.args)
    checks = TrainerChecks(job_config, ngpu, w.args, label, w, family=given is None)
    runs, ep = (given.runs, given.expert_parallel) if given is not None else (_any_candidate, False)
    cands = candidates(checks, w, ngpu, nnodes, runs, ep)
    if not cands:
        raise ValueError(
            f"no mesh of {plural(ngpu, 'GPU')} passes the trainer's checks; most often: {checks.most_refused()}"
        )
    return Search(dev, w, nnodes, checks, cands, sum(checks.refusals.values()))


def _escalated(s: Search, levels: int = len(ESCALATION)) -> tuple[Workload, str, bool]:
    """``(workload, note, fits)``: the configured workload with the first levels of :data:`ESCALATION` (at
    most ``levels``) on that make some plan the trainer runs fit (all of them when none does), the note
    naming them, and whether one fits. Memory only: whether a plan fits never depends on its time, so no
    time is estimated at a level where nothing fits."""
    w, note = s.base, ""
    for level in range(levels + 1):
        if level:
            w = escalate(s.base, level)
            note = "nothing fits as configured; with " + options_text(w) + ": "
        if any(plan_fits(stage_memories(c, w), c, w, s.dev) and s.checks.runs(c, w) for c in s.cands):
            return w, note, True
    return w, note, False


MAX_COUNTED_CP = 256
"""The most cp ranks whose layout the planner counts pair of ranks by pair (seconds a plan; 1,024 ranks take
minutes: the counts are quadratic in cp). Rows of one document held as the even zigzag are counted in closed
form at any cp (``SequenceLayout.zigzag_chunk``)."""


def countable(c: Candidate, w: Workload) -> bool:
    """Whether ``c``'s layout is counted in seconds: at most :data:`MAX_COUNTED_CP` cp ranks, or rows of one
    document held as the even zigzag (the closed form needs one document a row, so rows of several are not
    laid out to ask)."""
    if c.cp <= MAX_COUNTED_CP:
        return True
    if w.docs_per_row > 1:
        return False
    return get_layout(w.seq_len, c.cp, w.balance, [list(r) for r in w.rows]).zigzag_chunk() is not None


def _estimates(plans: list[Candidate], w: Workload, s: Search, stack: Stack, exhaustive: bool) -> list[Estimate]:
    """The estimates of ``plans`` that can matter (module docstring: those that fit, or all when none does,
    in the order of their speed's upper bound, until that bound is more than 2% below the fastest
    estimate); every plan's with ``exhaustive``. A plan that can matter but is not :func:`countable` is a
    ``ValueError`` saying what narrows the search."""
    keys = {c: s.checks.keys(c, w) for c in plans}
    pairs = causal_pairs(w.rows)
    pool = plans if exhaustive else [c for c in plans if plan_fits(stage_memories(c, w), c, w, s.dev)] or plans
    bounds = sorted(((speed_bound(c, w, s.dev, stack, pairs), i, c) for i, c in enumerate(pool)), reverse=True)
    out: list[Estimate] = []
    fastest, uncounted = 0.0, []
    for bound, _, c in bounds:
        if bound < NEAR_FASTEST * fastest and not exhaustive:
            break
        if not countable(c, w):
            uncounted.append((bound, c))
            continue
        out.append(evaluate(c, w, s.dev, stack, keys[c]))
        fastest = max(fastest, out[-1].tokens_per_second_per_gpu)
    matter = [c for bound, c in uncounted if exhaustive or bound >= NEAR_FASTEST * fastest]
    if matter:
        cp = min(c.cp for c in matter)
        raise ValueError(
            f"{plural(len(matter), 'plan')} that may be the fastest put {cp:,} or more cp ranks on a layout with no "
            "closed form (rows of several documents, or other than the even zigzag of one), which the planner counts "
            f"pair of ranks by pair up to {MAX_COUNTED_CP} ranks: narrow the search with --doc-mix causal and a "
            "zigzag or doc_local balance, a larger training.global_batch_size (more data-parallel ranks, fewer cp), "
            "or fewer --ngpu"
        )
    return out


def plan(
    job_config: JobConfig,
    ngpu: int,
    gpu: str = "h100",
    nnodes: int | None = None,
    doc_mix: str = "causal",
    hbm_gb: float | None = None,
    matmul_speedup: float = 1.0,
    seed: int = 0,
    stack: Stack | None = None,
    host_gb: float = 2000.0,
    given: GivenModel | None = None,
    exhaustive: bool = False,
) -> PlanResult:
    """The estimates that can matter for ``job_config`` on ``ngpu`` GPUs (module docstring; every plan the
    trainer runs with ``exhaustive``), the recommended one first. When nothing fits as configured, the options
    of :data:`ESCALATION` are turned on one by one until something does (the rows then carry the options; the
    reason says so). ``nnodes``: ``None`` for whole nodes of the device (:func:`~titan_cp.plan.devices.node_count`);
    ``given``: the model and the trainer planned (:class:`GivenModel`), when not the config's family's."""
    s = _setup(job_config, ngpu, gpu, nnodes, doc_mix, hbm_gb, seed, host_gb, given)
    stack = stack or Stack(matmul_speedup=matmul_speedup)
    w, note, _ = _escalated(s, given.escalation if given is not None else len(ESCALATION))
    plans = [c for c in s.cands if s.checks.runs(c, w)]  # with the options turned on
    ranked = _rank(_estimates(plans, w, s, stack, exhaustive))
    fitting = sum(plan_fits(stage_memories(c, w), c, w, s.dev) for c in plans)
    no_fit = len(plans) - fitting if fitting and not exhaustive else 0
    refused = s.refused + len(s.cands) - len(plans)
    skipped = Skipped(refused, s.checks.most_refused(), no_fit, len(plans) - no_fit - len(ranked))
    p = job_config.parallelism
    takes = get_strategy(p.context_parallel_strategy).takes_ulysses_degree()
    configured = Candidate(
        p.context_parallel_strategy,
        p.data_parallel_shard_degree,
        p.data_parallel_replicate_degree,
        p.context_parallel_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.context_parallel_ulysses_degree if takes else 1,
        given.ep if given is not None else 1,
    )
    context = Context(gpu, ngpu, s.nnodes, doc_mix, w.ac, s.checks.label, p.context_parallel_load_balancer, configured)
    why = reason(ranked[0], given.nothing_fits if given is not None else NOTHING_FITS)
    return PlanResult(tuple(ranked), context, note + why, ranked[0].fits, skipped)


def options_text(w: Workload) -> str:
    """The options of ``w`` that are on, as config keys."""
    h, keys = w.host, [f"activation_checkpoint.mode = {w.ac!r}"]
    keys += ["activation_checkpoint.cpu_offload = true"] * h.cpu_offload
    keys += [f"activation_checkpoint.blocks_per_checkpoint = {h.blocks_per_checkpoint}"] * (h.blocks_per_checkpoint > 1)
    keys += [f"activation_checkpoint.tile_tokens = {h.tile_tokens}"] * (h.tile_tokens > 0)
    keys += ["training.enable_cpu_offload = true"] * h.fsdp_offload
    return ", ".join(keys)


SEQ_GRANULE = 65536


def max_seq_len(
    job_config: JobConfig,
    ngpu: int,
    gpu: str,
    nnodes: int | None = None,
    doc_mix: str = "causal",
    hbm_gb: float | None = None,
    matmul_speedup: float = 1.0,
    host_gb: float = 2000.0,
    given: GivenModel | None = None,
) -> tuple[int, PlanResult | None]:
    """The longest ``training.seq_len`` (a multiple of :data:`SEQ_GRANULE`, at most 2**24) whose plan fits
    (options escalated as :func:`plan` does), and that plan; ``(0, None)`` when not even one granule fits."""
    levels = given.escalation if given is not None else len(ESCALATION)

    def config(n: int) -> JobConfig:
        return with_keys(job_config, {"training.seq_len": n})

    def fitting(n: int) -> bool:  # as plan(...).recommended, from memory alone (no time estimated)
        return _escalated(_setup(config(n), ngpu, gpu, nnodes, doc_mix, hbm_gb, 0, host_gb, given), levels)[2]

    lo, hi = 0, MAX_SEQ_LEN // SEQ_GRANULE + 1  # in granules: lo fits, hi does not
    step = 1
    while step < hi and fitting(step * SEQ_GRANULE):  # doubling, then bisection
        lo, step = step, step * 2
    hi = min(hi, step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fitting(mid * SEQ_GRANULE) else (lo, mid)
    if not lo:
        return 0, None
    return lo * SEQ_GRANULE, plan(
        config(lo * SEQ_GRANULE), ngpu, gpu, nnodes, doc_mix, hbm_gb, matmul_speedup, host_gb=host_gb, given=given
    )
