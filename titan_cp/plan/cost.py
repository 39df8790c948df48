"""Time per step: compute, transfers, and the ring's exposure, over frozen dataclasses.

For one candidate mesh (:class:`~titan_cp.plan.search.Candidate`) and one microbatch on the
straggler rank of the largest pipeline stage:

- **compute** (:class:`Compute`): the matmuls, ``6 x`` the stage's parameters per token (the
  forward again for checkpointed blocks), at the device's matmul fraction times the stack's
  ``matmul_speedup``; attention at the kernel's own measured rate
  (:mod:`titan_cp.plan.kernels`) for the visible pairs of each ring step, from the attention's
  own mask plans on the document mix, plus each step's elementwise merge traffic at HBM
  bandwidth (the bytes per element of :class:`RingImpl`).
- **transfers** (:class:`Transfer`): bytes per rank and link kind of every collective: CP from
  the strategy's cost object's ``min_bytes_by_axis`` (the forward twice under full AC), FSDP's
  all-gathers (compute dtype) and fp32 reduce-scatter, HSDP's all-reduce, TP's four
  sequence-parallel collectives per block and pass, PP's activations.
- **linear layers** (a hybrid model's, :mod:`titan_cp.plan.linear`): each linear layer's kernel over the
  straggler's pieces, its convolution and gated norm, the kernel work CP adds (Gated DeltaNet's later
  pieces at ``d_k`` more columns, Mamba2's summaries), and its exchange (the summaries and the convolution's halos), exposed whole (``cp_linear``); the attention
  above counts the attention layers only.
- **experts** (:mod:`titan_cp.plan.moe`): the matmuls count the experts a token runs; with expert parallelism
  each MoE layer's token dispatch and combine (``ep``, :func:`expert_transfers`), exposed whole, and FSDP
  gathering a block's experts over ``efsdp = dp_shard x cp x tp / ep`` ranks, ``1 / ep`` of them each.
  Multi-head latent attention's kernel runs at ``max(E, E_v)`` (V padded), its bytes at V's own size.
- **ring exposure** (:class:`RingExposure`): per ring step, the transfer that must arrive
  during the step against the step's compute (``exposed = max(0, transfer - compute)``), for
  the way the ring runs (:class:`RingImpl`). Collectives the attention waits for (all-gather,
  Ulysses' all-to-alls), TP's (unless the stack overlaps them), PP's and HSDP's are exposed
  whole; FSDP's beyond the compute they overlap.

A step is ``(compute + exposed) x (microbatches + bubble) x accumulation``, the 1F1B bubble
being ``pp - 1`` microbatches (``(pp - 1) / 2`` for schedules with two stages per rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from titan_cp.attention.pricing import AttentionCall, AxisBytes, cost_of
from titan_cp.attention.strategy import LOCAL_SCHEDULE, attention_schedule
from titan_cp.attention.tiling import CAUSAL, causal_counts, zigzag_counts
from titan_cp.families.llama3.model import ModelArgs
from titan_cp.layout import DEFAULT_BALANCE, SequenceLayout, get_layout
from titan_cp.plan import linear as lin
from titan_cp.plan import moe as mx
from titan_cp.plan.devices import Device
from titan_cp.plan.kernels import BWD_FLOPS_PER_PAIR_DIM, FWD_FLOPS_PER_PAIR_DIM
from titan_cp.plan.memory import (
    RankModel,
    Stage,
    head_offloaded,
    stage_blocks,
    stage_layer_params,
    stage_param_count,
    unit_inputs,
)
from titan_cp.plan.problem import Candidate, Workload, pipeline

FP32 = 4


@dataclass(frozen=True)
class RingImpl:
    """How a ring's steps run: what travels, and the elementwise traffic around each kernel call.

    expand_kv: K/V travel at the query head count (GQA expanded before attention).
    gather_kv: K/V are all-gathered once per pass (waited on before the second step) instead
        of being passed on step by step; dK/dV still travel one step at a time.
    needed_only: only the K/V rows another rank's queries can see travel, and each step's merge
        touches only the query rows its plan reaches (titan_cp's engine); else every row, every step.
    merge_fwd, merge_bwd: HBM bytes read and written outside the kernel per element of a
        ``(B, H, S_local, E)`` query-shaped tensor in one forward / backward step (merging the
        output; accumulating dq); kv_fwd, kv_bwd: the same per element of K (V alike, counted
        in) as the K/V travel (copies to send; accumulating dK, dV).
    """

    name: str
    expand_kv: bool = False
    gather_kv: bool = False
    needed_only: bool = False
    merge_fwd: float = 10.0
    merge_bwd: float = 10.0
    kv_fwd: float = 0.0
    kv_bwd: float = 20.0


# titan_cp's ring: per step one vectorised log-sum-exp merge of the block into fp32 accumulators
# (read acc 4 + write 4 + read the block's output 2); the backward scatter-adds dq into fp32
# (10) and dK, dV into fp32 accumulators (10 each per K element); K/V at their own heads. An upper
# bound: the engine merges a group of steps at once where the memory allows (titan_cp.attention.fold:
# 2 per element per step and one write where a group holds all of a row's steps).
# Only the K/V rows another rank can see travel (needed_only), and a step's merge touches only
# the query rows its plan reaches (the merge bytes scale with those rows).
TITAN_CP_RING = RingImpl("titan_cp", needed_only=True)

# torch's 2024 context parallel (torch.distributed.tensor.experimental._attention, as
# torchtitan's December 2024 benchmark ran it): SDPA per ring step (step 0 causal on the two
# local zigzag chunks, then the non-causal halves), K/V expanded to the query heads by the
# model (repeat_kv) before SDPA, K/V all-gathered (rotate method "allgather"), dK/dV in fp32
# passed on by all_to_all every step. Bytes per element from its code, forward step:
# out.to(fp32) 6, out - block_out 12, sigmoid(.) * (.) 8, out - (.) 12, the partial update's
# cat on half the steps 4 (42); per K element: cat of K and V to send 8. Backward step:
# grad_q += 10, 13 with the partial update (11.5); per K element: cat of K and V 8, grad_k and
# grad_v += 20, 26 with the partial update (23), cat of grad_k and grad_v to send 16 (47).
TORCH_2024_RING = RingImpl(
    "torch 2024 CP", expand_kv=True, gather_kv=True, merge_fwd=42.0, merge_bwd=11.5, kv_fwd=8.0, kv_bwd=47.0
)


@dataclass(frozen=True)
class Stack:
    """The software that runs, beyond the device: what the device constants cannot say.

    matmul_speedup: matmul time divided by this (float8 linears + torch.compile against bf16
        eager; torchtitan's Table 1 measures 1.48 on Llama 3.1 8B).
    async_tp: TP's collectives overlap the matmuls they feed (torchtitan's AsyncTP).
    """

    name: str = "titan_cp"
    matmul_speedup: float = 1.0
    async_tp: bool = False
    ring: RingImpl = TITAN_CP_RING


@dataclass(frozen=True)
class Transfer:
    """One collective of a rank: bytes sent and seconds exposed, per pipeline microbatch slot
    (``per_microbatch``: CP, TP, PP) or per optimizer step (FSDP, HSDP), and its link kind."""

    nbytes: int
    link: str
    exposed: float
    per_microbatch: bool = True


@dataclass(frozen=True)
class RingExposure:
    """The straggler's ring steps of one microbatch: compute per step and the transfers they hide."""

    compute_fwd: tuple[float, ...]
    compute_bwd: tuple[float, ...]
    wait_fwd: tuple[float, ...]  # seconds of transfer each forward step must hide
    wait_bwd: tuple[float, ...]
    tail: float  # transfer after the last backward step (nothing left to hide it)
    forward_passes: float

    @property
    def exposed(self) -> float:
        fwd = sum(max(0.0, t - c) for t, c in zip(self.wait_fwd, self.compute_fwd))
        bwd = sum(max(0.0, t - c) for t, c in zip(self.wait_bwd, self.compute_bwd))
        return self.forward_passes * fwd + bwd + self.tail

    @property
    def ratio(self) -> float | None:
        """The hiding condition: the smallest compute / transfer over the steps with a transfer."""
        pairs = [(c, t) for c, t in zip(self.compute_fwd + self.compute_bwd, self.wait_fwd + self.wait_bwd) if t > 0]
        return min(c / t for c, t in pairs) if pairs else None


@dataclass(frozen=True)
class Compute:
    """Seconds of compute of one microbatch on the straggler rank."""

    dense: float
    attention: float  # kernels and their merges, all steps and passes
    linear: float = 0.0  # a hybrid's linear layers: kernels, CP's kernel work, convolutions and norms

    @property
    def total(self) -> float:
        return self.dense + self.attention + self.linear


@dataclass(frozen=True)
class AttentionWork:
    """Visible (query, key) pairs per head of the straggler, per ring step, for all local rows."""

    steps: tuple[int, ...]  # max over ranks (or Ulysses groups) of the pairs at each step
    total: int  # every visible pair of the rows
    kernel_len: float  # sequence length the kernel calls run at (for the rate tables)
    touched: tuple[float, ...] = ()  # max over ranks of the fraction of local query rows each step reaches


@lru_cache(maxsize=256)
def attention_work(seq_len: int, cp: int, ring: int, ulysses: int, balance: str, rows: tuple) -> AttentionWork:
    """Pairs per ring step of ``ring`` groups of ``ulysses`` ranks (each group's queries: the union of
    its members' shards). A strategy whose ring and Ulysses sizes do not cover the cp ranks gathers
    K/V: each rank attends its own queries to the whole row, in one step."""
    layout = get_layout(seq_len, cp, balance, [list(r) for r in rows])
    b = len(rows)
    total = causal_counts(layout, None, None, b)[0]
    eff_len = 2 * total / (seq_len * b)  # a causal document of L tokens has L^2 / 2 pairs: L
    if ring * ulysses != cp:
        steps = (max(causal_counts(layout, (r,), None, b)[0] for r in range(cp)),)
        return AttentionWork(steps, total, min(eff_len, seq_len), (1.0,))
    group_rows = b * layout.local_len * ulysses  # the query rows of one ring group
    if layout.zigzag_chunk() is not None:  # every pair of groups alike: closed form (tiling.zigzag_counts)
        own = zigzag_counts(layout, 0, 0, ulysses, b)
        other = zigzag_counts(layout, 1, 0, ulysses, b) if ring > 1 else own  # a later group's queries: most rows
        pairs = [own[0]] + [other[0]] * (ring - 1)
        touched = [own[1] / group_rows] + [other[1] / group_rows] * (ring - 1)
        return AttentionWork(tuple(pairs), total, min(eff_len, seq_len // ring), tuple(touched))
    groups = [tuple(range(g * ulysses, (g + 1) * ulysses)) for g in range(ring)]
    # step s: group g's queries on the keys of group g - s (the ring's order, titan_cp.attention.ring.ring_step_tiles)
    counts = [[causal_counts(layout, groups[g], groups[(g - s) % ring], b) for g in range(ring)] for s in range(ring)]
    pairs = [max(c[0] for c in step) for step in counts]
    touched = [max(c[1] for c in step) / group_rows for step in counts]
    return AttentionWork(tuple(pairs), total, min(eff_len, seq_len // ring), tuple(touched))


@dataclass(frozen=True)
class Cost:
    """One candidate's time per optimizer step, by part (seconds)."""

    compute: Compute  # one microbatch
    transfers: dict[str, Transfer] = field(default_factory=dict)
    ring: RingExposure | None = None
    microbatches: int = 1
    bubble: float = 0.0  # extra microbatch slots of the pipeline schedule
    accum: int = 1
    schedule: str = LOCAL_SCHEDULE  # the schedule the attention runs (Setting.schedule)

    def _exposed(self, per_microbatch: bool) -> float:
        return sum(t.exposed for t in self.transfers.values() if t.per_microbatch == per_microbatch)

    @property
    def step(self) -> float:
        slot = self.compute.total + self._exposed(True)
        return (slot * (self.microbatches + self.bubble) + self._exposed(False)) * self.accum

    @property
    def compute_seconds(self) -> float:
        return self.compute.total * self.microbatches * self.accum

    @property
    def exposed_seconds(self) -> float:
        return (self._exposed(True) * self.microbatches + self._exposed(False)) * self.accum

    def bytes_per_step(self, t: Transfer) -> int:
        return t.nbytes * (self.microbatches if t.per_microbatch else 1) * self.accum


def cp_bytes_per_rank(
    args: ModelArgs,
    seq_len: int,
    rows: int,
    strategy: str,
    cp: int,
    tp: int = 1,
    ulysses: int = 1,
    layers: int | None = None,
    ac: str = "none",
    act_bytes: int = 2,
    doc_rows: Sequence[Sequence[int]] | None = None,
    balance: str = DEFAULT_BALANCE,
    rank: int | None = None,
) -> int:
    """Bytes one rank hands to CP communication in one forward + backward (+ the forward again under
    full AC) of ``layers`` blocks, from the strategy's cost object (``min_bytes``) on the local shapes, elements
    of ``act_bytes``: with ``doc_rows`` (one list of document lengths per row) the rank sending most under
    ``balance`` (only what other ranks can see travels; ``rank``: that cp rank's), else every row to every rank."""
    if cp == 1:
        return 0
    layout = None if doc_rows is None else get_layout(seq_len, cp, balance, [list(r) for r in doc_rows])
    call = AttentionCall(
        cp,
        args.n_heads // tp,
        args.kv_heads // tp,
        args.head_dim,
        ulysses,
        rows,
        seq_len // cp,
        act_bytes,
        layout,
        v_head_dim=mx.v_head_dim(args),
    )
    cost = cost_of(strategy)
    per = cost.min_bytes(call, True, rank)
    if ac == "full":  # the checkpointed forward runs again
        per += cost.min_bytes(call, False, rank)
    return per * (args.n_layers if layers is None else layers)


# ---------------------------------------------------------------------------- one candidate


@dataclass(frozen=True)
class Setting:
    """What one candidate's cost is computed from (kept together so no function takes ten arguments)."""

    c: Candidate
    w: Workload
    dev: Device
    stack: Stack
    stage: Stage  # the largest pipeline stage

    @property
    def m(self) -> RankModel:
        return self.w.rank_model(self.c)

    @property
    def microbatches(self) -> int:
        return self.w.microbatches(self.c.pp)

    @property
    def rows(self) -> int:
        """Rows of one microbatch."""
        return self.w.rows_per_microbatch(self.c.pp)

    @property
    def tokens(self) -> int:
        """Local tokens of one microbatch."""
        return self.w.seq_len // self.c.cp * self.rows

    @property
    def forward_passes(self) -> float:
        """Forwards per backward: 1, plus the checkpointed blocks' recomputation (:meth:`RankModel.recomputed`)."""
        return 1 + self.m.recomputed(self.stage.layers) / self.stage.layers

    @property
    def layout(self) -> SequenceLayout | None:
        """The layout of one microbatch's rows where the stack sends only what the other ranks need
        (``None`` without CP, or for a ring that sends every K/V row to every rank)."""
        if self.c.cp == 1 or not self.stack.ring.needed_only:
            return None
        return get_layout(self.w.seq_len, self.c.cp, self.w.balance, [list(r) for r in self.w.rows[: self.rows]])

    @property
    def call(self) -> AttentionCall:
        """One layer's attention call of one microbatch on this rank, as the strategy's cost object prices it
        (the documents: :attr:`layout`'s)."""
        h, k, _ = self.m.heads
        local = self.w.seq_len // self.c.cp
        a = self.w.args
        return AttentionCall(
            self.c.cp,
            h,
            k,
            a.head_dim,
            self.c.ulysses,
            self.rows,
            local,
            self.w.act_bytes,
            self.layout,
            v_head_dim=mx.v_head_dim(a),
        )

    @property
    def schedule(self) -> str:
        """The schedule the attention runs on :attr:`layout` (causal;
        :func:`~titan_cp.attention.strategy.attention_schedule`), as its bytes are counted."""
        return attention_schedule(self.c.strategy, self.c.cp, self.layout, CAUSAL, self.rows)


def dense_seconds(s: Setting) -> float:
    """The stage's matmuls on one microbatch: ``2 x params`` FLOPs per token forward, twice that backward,
    the forward again for checkpointed blocks (the embedding is a lookup, not a matmul; an MoE block's params
    those a token runs), and with tiles the feed-forward's once more."""
    args, tp = s.w.args, s.c.tp
    blocks = stage_layer_params(args, tp, s.stage, active=True)
    matmul_params = blocks + (args.vocab_size * args.dim // tp) * s.stage.last
    flops = 2 * s.tokens * (3 * matmul_params + s.m.recomputed(s.stage.layers) * blocks / max(1, s.stage.layers))
    if s.w.host.tile_tokens:  # each tile's feed-forward runs once more, in its own backward (an MoE one's experts)
        moe = mx.stage_moe_layers(args, s.stage.layers, s.stage.first, s.stage.last) * mx.ffn_delta(args, True)
        flops += 2 * s.tokens * (s.stage.layers * 3 * args.dim * args.ffn_hidden_dim + moe) // tp
    return flops / (s.dev.matmul_flops * s.stack.matmul_speedup)


def _heads(s: Setting) -> tuple[int, int]:
    """``(query heads, K/V heads)`` of one kernel call (per Ulysses shard; K/V as the ring moves them)."""
    call = s.call
    kv = s.c.cost.attention_kv_heads(call)
    q = call.q_heads // s.c.ulysses_size
    return q, q if s.stack.ring.expand_kv else kv


def _ring_steps(s: Setting, work: AttentionWork) -> tuple[list[float], list[float]]:
    """Compute seconds of each ring step of one layer and microbatch, forward and backward:
    the kernel calls at the measured rates and the step's merge traffic at HBM bandwidth."""
    impl, e = s.stack.ring, mx.kernel_head_dim(s.w.args)
    heads, kv_heads = _heads(s)
    tokens = s.tokens * s.c.ulysses_size  # a Ulysses group attends the union of its members' shards
    merges = len(work.steps) > 1
    q_elems, kv_elems = tokens * heads * e, tokens * kv_heads * e
    fwd, bwd = [], []
    for step, pairs in enumerate(work.steps):
        kf, kb = s.dev.attention.seconds(pairs / s.microbatches * heads * e, work.kernel_len, step == 0)
        rows = work.touched[step] if impl.needed_only and work.touched else 1.0  # the query rows merged
        mf = (impl.merge_fwd * q_elems + impl.kv_fwd * kv_elems) * rows / s.dev.hbm_bandwidth if merges else 0.0
        mb = (impl.merge_bwd * q_elems + impl.kv_bwd * kv_elems) * rows / s.dev.hbm_bandwidth if merges else 0.0
        fwd.append(kf + mf)
        bwd.append(kb + mb)
    return fwd, bwd


def _ring_exposure(
    s: Setting, ring: AxisBytes, fwd_bytes: int, link: str, fwd: list[float], bwd: list[float]
) -> tuple[RingExposure, float]:
    """The per-step hiding condition of one layer's ring (see :class:`RingImpl`) and the bytes it sends."""
    steps, passes = ring.size - 1, s.forward_passes
    block = fwd_bytes / steps  # one K/V block at the heads the strategy sends
    dkv = (ring.nbytes - fwd_bytes) / steps - block  # its gradient, fp32
    _, kv_heads = _heads(s)
    if s.stack.ring.expand_kv:  # at the query heads instead
        own = s.c.cost.attention_kv_heads(s.call)
        block, dkv = block * kv_heads / own, dkv * kv_heads / own
    if s.stack.ring.gather_kv:  # gathered once per pass, waited on before the second step; dK/dV step by step
        gather, t_dkv = s.dev.seconds(steps * block, link), s.dev.seconds(dkv, link)
        wait_fwd, wait_bwd, tail = (gather,) + (0.0,) * steps, (gather,) + (t_dkv,) * steps, t_dkv
    else:  # the next block during each step (backward: with the dK/dV riding one step behind)
        t_fwd, t_bwd = s.dev.seconds(block, link), s.dev.seconds(block + dkv, link)
        wait_fwd, wait_bwd, tail = (t_fwd,) * steps + (0.0,), (t_bwd,) * steps + (0.0,), 0.0
    exposure = RingExposure(tuple(fwd), tuple(bwd), wait_fwd, wait_bwd, tail, passes)
    return exposure, steps * (block * (passes + 1) + dkv)


def attention_cost(s: Setting) -> tuple[float, dict[str, Transfer], RingExposure | None]:
    """``(compute seconds, CP transfers, ring)`` of the stage's attention layers on one microbatch."""
    c, w, layers = s.c, s.w, stage_blocks(s.m, s.stage, s.stage.layers)[0]
    if not layers:
        return 0.0, {}, None
    work = attention_work(w.seq_len, c.cp, c.ring_size, c.ulysses_size, w.balance, w.rows)
    fwd, bwd = _ring_steps(s, work)
    compute = layers * (s.forward_passes * sum(fwd) + sum(bwd))
    if c.cp == 1:
        return compute, {}, None
    call = s.call
    fwd_axes = c.cost.min_bytes_by_axis(call, False)
    transfers, ring = {}, None
    inner = c.tp
    for axis, fwd_axis in reversed(list(zip(c.cost.min_bytes_by_axis(call, True), fwd_axes))):
        inner *= axis.size  # axes outermost first: a group of this axis spans the axes inside it
        name = "cp" if len(fwd_axes) == 1 else axis.axis
        nbytes = int(layers * (axis.nbytes + (s.forward_passes - 1) * fwd_axis.nbytes))
        link = s.dev.link(inner)
        if axis.ring:
            ring, per_layer = _ring_exposure(s, axis, fwd_axis.nbytes, link, fwd, bwd)
            transfers[name] = Transfer(int(layers * per_layer), link, ring.exposed * layers)
        else:
            transfers[name] = Transfer(nbytes, link, s.dev.seconds(nbytes, link))
    return compute, transfers, ring


def linear_cost(s: Setting) -> tuple[float, dict[str, Transfer]]:
    """``(compute seconds, CP transfers)`` of the stage's linear layers on one microbatch (module docstring):
    the straggler rank's (the most seconds), its exchange exposed whole, on the cp axis' link."""
    shapes, _ = lin.linear_shapes(s.w.args)
    layers = stage_blocks(s.m, s.stage, s.stage.layers)[1]
    if shapes is None or not layers:
        return 0.0, {}
    link, passes, a = s.dev.link(s.c.span("cp")), s.forward_passes, s.w.act_bytes
    times = [(lin.linear_time(shapes, w, s.dev, link, a), w) for w in s.w.linear_works(s.c.cp, s.c.pp)]
    t, work = max(times, key=lambda tw: tw[0].total(passes))
    compute = layers * (t.total(passes) - t.exchange) / s.c.tp  # heads split over tp
    if s.c.cp == 1:
        return compute, {}
    recompute = not shapes.gated_delta or s.dev.name == "cpu"
    once = sum(lin.exchange_bytes(shapes, work, a, recompute))
    nbytes = layers * (once + (passes - 1) * lin.forward_exchange_bytes(shapes, work, a)) / s.c.tp
    return compute, {"cp_linear": Transfer(int(nbytes), link, s.dev.seconds(nbytes, link))}


def collective_transfers(s: Setting, dense: float, compute_step: float) -> dict[str, Transfer]:
    """FSDP, HSDP, TP and PP bytes of one rank and what they leave exposed (module docstring)."""
    c, w, dev, out = s.c, s.w, s.dev, {}
    params = stage_param_count(w.args, c.tp, s.stage)
    f, a = c.fsdp, w.act_bytes
    if f > 1:  # gathered for the forward and again for the backward, unless kept gathered
        gathers = 2 if (w.reshard and c.pp == 1) else 1
        nbytes = int(fsdp_gathered(s, params) * (a * gathers + FP32))
        link = dev.link(c.span("dp_shard"))
        out["fsdp"] = Transfer(nbytes, link, max(0.0, dev.seconds(nbytes, link) - compute_step), False)
    if c.dp_replicate > 1:
        nbytes = int(2 * params * FP32 / f * (c.dp_replicate - 1) / c.dp_replicate)
        link = dev.link(c.span("dp_replicate"))
        out["dp_replicate"] = Transfer(nbytes, link, dev.seconds(nbytes, link), False)
    if c.tp > 1:  # two all-gathers and two reduce-scatters of the block's activations per pass
        passes = s.stage.layers * 2 + s.m.recomputed(s.stage.layers)
        nbytes = int(4 * passes * (c.tp - 1) * s.tokens * w.args.dim * a / c.tp)
        link = dev.link(c.span("tp"))
        t = dev.seconds(nbytes, link)
        out["tp"] = Transfer(nbytes, link, max(0.0, t - dense) if s.stack.async_tp else t)
    if c.pp > 1:  # the stage's output forward, its gradient backward (sequence-sharded under TP)
        nbytes = int(2 * s.tokens * w.args.dim * a / c.tp)
        link = dev.link(c.span("pp"))
        out["pp"] = Transfer(nbytes, link, dev.seconds(nbytes, link))
    return out


def fsdp_gathered(s: Setting, params: int) -> float:
    """Parameters of the stage (``params`` on one TP rank) one rank receives when FSDP gathers them all once: the
    others' shards, ``(F - 1) / F``; with expert parallelism the routed experts are the rank's ``1 / ep`` of them,
    gathered over ``efsdp = F tp / ep`` ranks (:mod:`titan_cp.plan.moe`)."""
    c, f = s.c, s.c.fsdp
    if c.ep == 1:
        return params * (f - 1) / f
    experts = mx.stage_expert_params(s.w.args, s.stage.layers, s.stage.first, s.stage.last)
    efsdp = f * c.tp // c.ep
    dense = params - experts // c.tp
    return dense * (f - 1) / f + experts / (c.tp * c.ep) * (efsdp - 1) / efsdp


def expert_transfers(s: Setting) -> dict[str, Transfer]:
    """Expert parallelism's token dispatch and combine of the stage's MoE layers on one microbatch
    (:func:`~titan_cp.plan.moe.all_to_all_bytes`), exposed whole, on the link of ``ep`` consecutive ranks."""
    c, w = s.c, s.w
    layers = mx.stage_moe_layers(w.args, s.stage.layers, s.stage.first, s.stage.last)
    nbytes = mx.all_to_all_bytes(w.args, s.tokens, c.ep, w.act_bytes, layers, s.forward_passes)
    if not nbytes:
        return {}
    link = s.dev.link(c.ep)
    return {"ep": Transfer(nbytes, link, s.dev.seconds(nbytes, link))}


# host <-> GPU bytes/s per GPU and direction: PCIe Gen5 x16 (H100, H200 SXM), NVLink-C2C (GH200)
HOST_LINK_BW = {"h100": 50e9, "h200": 50e9, "gh200": 400e9}
DEFAULT_HOST_LINK_BW = 25e9  # PCIe Gen4 x16
CPU_ADAM_PARAMS_PER_S = 1e9  # AdamW over fp32 shards on the host CPU, per rank (a measured order of magnitude)


def host_transfers(s: Setting, compute: float) -> dict[str, Transfer]:
    """The offloads' host copies and what they leave exposed: checkpointed inputs (to the host in the
    forward, back in the backward, each hidden behind its pass: a quarter of a fully checkpointed
    microbatch's compute is its forward) and FSDP's offload (fp32 shards in for every pass, gradients
    out, hidden behind the step's compute; the optimizer step on the CPU, exposed whole)."""
    out, host = {}, s.w.host
    bw = HOST_LINK_BW.get(s.dev.name, DEFAULT_HOST_LINK_BW)
    units = unit_inputs(s.m, s.m.checkpointed(s.stage.layers))[1] + head_offloaded(s.m, s.stage)
    if units:
        nbytes = int(units * s.w.act_bytes * s.w.args.dim / s.c.tp * s.tokens)
        copy = nbytes / bw
        exposed = max(0.0, copy - compute / 4) + max(0.0, copy - 3 * compute / 4)
        out["host_activations"] = Transfer(2 * nbytes, "host", exposed)
    if host.fsdp_offload and s.c.fsdp > 1:
        shard = stage_param_count(s.w.args, s.c.tp, s.stage) * FP32 // s.c.fsdp
        nbytes = 3 * shard  # in for the forward and the backward, gradients out
        step = compute * s.microbatches * s.w.accum
        exposed = max(0.0, nbytes / bw - step) + shard / FP32 / CPU_ADAM_PARAMS_PER_S
        out["host_fsdp"] = Transfer(nbytes, "host", exposed, False)
    return out


def causal_pairs(rows: Sequence[Sequence[int]]) -> int:
    """Every visible (query, key) pair of ``rows`` (document lengths) under the causal mask: ``L (L + 1) / 2``
    a document, wherever the layout puts it (``attention_work(...).total`` without a layout)."""
    return sum(n * (n + 1) // 2 for row in rows for n in row)


def attention_floor(s: Setting, pairs: int) -> float:
    """Seconds of one layer's attention kernels on one microbatch at the least any strategy can take: an even
    share of the ``pairs`` of every local row (``1 / cp`` of them, times the local query heads) at the
    kernel's fastest rate, forward passes and backward, no merge (:func:`_ring_steps` counts the slowest
    rank's pairs of each step at the rate of its length, and the merges)."""
    share = pairs / s.microbatches * s.m.heads[0] / s.c.cp * mx.kernel_head_dim(s.w.args)
    rates = s.dev.attention
    return s.forward_passes * FWD_FLOPS_PER_PAIR_DIM * share / rates.peak(False) + (
        BWD_FLOPS_PER_PAIR_DIM * share / rates.peak(True)
    )


def linear_floor(s: Setting) -> float:
    """Seconds of one linear layer on one microbatch at the least any plan takes: the kernel over an even
    share of the tokens in whole chunks, no summaries, the convolution and gated norm (0 for a model without
    linear layers)."""
    shapes, _ = lin.linear_shapes(s.w.args)
    if shapes is None:
        return 0.0
    forward, backward = lin.call_flops(shapes, s.tokens // shapes.chunk, shapes.d_v)
    kernel = (s.forward_passes * forward + backward) / lin.kernel_rate(shapes, s.dev) / s.c.tp
    return kernel + lin.elementwise_bytes_per_token(shapes, s.w.act_bytes) * s.tokens / s.c.tp / s.dev.hbm_bandwidth


def step_lower_bound(s: Setting, pairs: int) -> float:
    """A lower bound of :func:`step_cost`'s step, from closed forms alone (no layout, no mask tiles): the
    matmuls, :func:`attention_floor` (``pairs``: :func:`causal_pairs` of the workload's rows), no CP transfer
    exposed, and FSDP's, HSDP's, TP's, PP's and the host copies as :func:`step_cost` counts them. Each of
    those exposes its transfer less the compute it hides behind, so the step grows with the compute: less
    compute, and less CP exposure, bound it from below. A plan whose bound is slower than another's step
    needs no estimate (:func:`titan_cp.plan.search.plan`)."""
    dense = dense_seconds(s)
    attention_layers, linear_layers = stage_blocks(s.m, s.stage, s.stage.layers)
    compute = Compute(dense, attention_layers * attention_floor(s, pairs), linear_layers * linear_floor(s))
    transfers = collective_transfers(s, dense, compute.total * s.microbatches)
    transfers.update(host_transfers(s, compute.total))
    transfers.update(expert_transfers(s))
    bubble = pipeline(s.w.schedule, s.microbatches, s.c.pp).bubble
    return Cost(compute, transfers, None, s.microbatches, bubble, s.w.accum).step


def step_cost(s: Setting) -> Cost:
    """The candidate's :class:`Cost`: one microbatch's compute and transfers, the pipeline's slots."""
    dense = dense_seconds(s)
    attention, transfers, ring = attention_cost(s)
    linear, linear_transfers = linear_cost(s)
    transfers.update(linear_transfers)
    compute = Compute(dense, attention, linear)
    transfers.update(collective_transfers(s, dense, compute.total * s.microbatches))
    transfers.update(host_transfers(s, compute.total))
    transfers.update(expert_transfers(s))
    bubble = pipeline(s.w.schedule, s.microbatches, s.c.pp).bubble
    return Cost(compute, transfers, ring, s.microbatches, bubble, s.w.accum, s.schedule)
