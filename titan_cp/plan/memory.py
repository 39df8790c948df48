"""Memory per rank: one model, for the planner's estimate and for one step's peak.

Per rank (bytes), :func:`rank_memory`; ``P`` the parameters of this rank's largest pipeline
stage after TP, ``F = dp_shard x cp`` the FSDP shards::

    params       fp32 master weights / F
    optimizer    AdamW's two fp32 moments / F
    comm_buffers FSDP without PP: two blocks' gathered weights (compute dtype) + one block's
                 unsharded fp32 gradient (the reduce-scatter's input); with PP (weights stay
                 gathered between a stage's microbatches): the stage's gathered weights;
                 CP: the strategy's receive buffers (its cost object's ``buffer_bytes``) of one microbatch
    activations, gradients, loss, recompute
                 the step's peak above its start (:func:`step_peak`), the larger of the first
                 stage (most microbatches in flight) and the last (the loss)

The step's peak (what ``scripts/bench_memory.py`` measures: parameters allocated, nothing
else) is at the start of the backward without AC -- everything saved, the loss's gradient
chunk, the first gradients -- or, under full AC, during the first block's backward -- its
recomputed tensors and every gradient but the embedding's. Under pipeline parallelism
``in_flight`` microbatches are saved at once (1F1B: ``min(microbatches, pp)`` on the first
stage, 1 on the last; GPipe: all), and after the first backward every gradient of the stage
is held: FSDP defers its reduce-scatter to the step's last microbatch, so they are held
unsharded in fp32.

Saved for backward per block and local token, :func:`saved_bytes_per_token` (``a`` the
activation dtype's bytes; ``D`` the model dim; ``H, K, F`` query heads, K/V heads, SwiGLU
width over ``tp``; sequence parallelism shards the norms' tensors and a block's input over
``tp``; the linears' inputs are gathered)::

    attention_norm   input, output (a D / tp each), rstd (a / tp)       ffn_norm: the same
    wq               its input (a D; wk and wv share it)
    attention        the strategy's own figure (its cost object's saved_bytes_per_token):
                     ring: q, out (a H E each), k, v (a K E each), lse (4 H); Ulysses and
                     hybrid the same with several documents a row, else their head shards
    feed_forward     w1 x, w3 x, silu(w1 x) (a F each); w1 input (a D); w2 input (a F)
  + once per token: tokens (8, first stage), RoPE cos and sin (2 x 4 E/2), final norm
    (a (2 D + 1) / tp), output input (a D), labels (8), loss lse (4) (last stage)

Under full AC a block keeps only its input (a D / tp), and the checkpoint also holds cos, sin
and ``doc_lens`` (8 bytes per document per row). These equal, byte for byte, what
``benchmarks.memory.SavedTensorCounter`` counts on the debug model with CP, TP and PP
(``tests/test_plan.py``).

A hybrid model's linear-attention block (:mod:`titan_cp.plan.linear`) saves its norms and feed-forward as
an attention block does, and its mixer's figure in place of ``wq``'s input and the attention's: per token
(:func:`~titan_cp.plan.linear.saved_per_token`), plus what the rank keeping the most keeps beyond it (its
later tokens' wider copies and its states, :func:`linear_extra_bytes`): never a function of ``tokens^2``.

Multi-head latent attention and experts (:mod:`titan_cp.plan.moe`): an MLA block's attention is priced at its
value head dim of its own (:attr:`RankModel.attention_call`) and saves its low-rank projections' norms and inputs
besides (:func:`~titan_cp.plan.moe.mla_saved_per_token`); an MoE layer's feed-forward saves
:func:`~titan_cp.plan.moe.moe_saved_per_token` in place of a dense one's, holds every expert (``params``,
``optimizer`` over ``F``, as FSDP shards them with or without expert parallelism), and FSDP gathers a block's
experts' ``1 / ep`` (:func:`layer_params`); with ``ep > 1`` the token exchange's buffer (the ``k`` copies of
the local tokens received beside those sent) is ``k T D a`` among ``comm_buffers`` (:func:`a2a_buffer_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from titan_cp.attention.pricing import AttentionCall, StrategyCost, cost_of
from titan_cp.attention.ring import RING as LOCAL  # attention on one rank: the ring's one-device path
from titan_cp.attention.strategy import DEFAULT_STRATEGY, Strategy, get_strategy
from titan_cp.families.llama3.model import ModelArgs
from titan_cp.integrations.hf_shapes import HFShapes
from titan_cp.loss import LOSS_CHUNK_BYTES
from titan_cp.parallel.pp import layers_per_stage
from titan_cp.plan import linear as lin
from titan_cp.plan import moe as mx

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class HostOptions:
    """The long-context memory options (``[activation_checkpoint]`` ``cpu_offload``,
    ``blocks_per_checkpoint``, ``tile_tokens``; ``training.enable_cpu_offload``) and the host memory
    they may use (bytes per node). See :func:`unit_inputs`, :func:`ffn_saved_per_token`, :func:`host_bytes`."""

    cpu_offload: bool = False
    blocks_per_checkpoint: int = 1
    tile_tokens: int = 0
    fsdp_offload: bool = False
    host_bytes_per_node: float = 2000e9
    prefetch: int = 1

    @property
    def any(self) -> bool:
        return self.cpu_offload or self.blocks_per_checkpoint > 1 or self.tile_tokens > 0 or self.fsdp_offload


@dataclass(frozen=True)
class RankModel:
    """The model as one rank holds it: TP-sharded widths, the CP strategy, activation dtype, AC.

    ac: ``none``, ``full`` or ``selective`` (every ``ac_every``-th block fully checkpointed).
    """

    args: ModelArgs
    strategy: str = DEFAULT_STRATEGY
    cp: int = 1
    tp: int = 1
    ulysses: int = 1
    act_bytes: int = 4
    ac: str = "none"
    ac_every: int = 1
    host: HostOptions = HostOptions()
    fused_norm: bool = False  # RMSNorm as the GPU's fused kernel (:func:`norm_saved_per_token`)
    documents: bool = True  # several documents a row (what Ulysses and hybrid keep depends on it)
    linear_work: lin.LinearWork | None = None  # a hybrid's linear layers on the rank that keeps the most
    ep: int = 1  # expert parallelism (torchtitan's): the routed experts split over ep ranks

    @property
    def attention(self) -> Strategy:
        return get_strategy(self.strategy) if self.cp > 1 else LOCAL

    @property
    def cost(self) -> StrategyCost:
        """The cost object of :attr:`attention` (:mod:`titan_cp.attention.pricing`)."""
        return cost_of(self.attention)

    def attention_call(self, tokens: int = 1) -> AttentionCall:
        """One layer's attention call on this rank, over ``tokens`` local tokens, as its cost object prices it."""
        h, k, _ = self.heads
        a = self.args
        return AttentionCall(
            self.cp,
            h,
            k,
            a.head_dim,
            self.ulysses,
            1,
            tokens,
            self.act_bytes,
            documents=self.documents,
            v_head_dim=mx.v_head_dim(a),
        )

    def checkpointed(self, layers: int) -> int:
        """Blocks of ``layers`` fully checkpointed (selective: blocks 0, k, 2k, ...)."""
        if self.ac == "full":
            return layers
        return math.ceil(layers / self.ac_every) if self.ac == "selective" else 0

    def recomputed(self, layers: int) -> int:
        """Block forwards the backward runs again over ``layers`` blocks: one per checkpointed block,
        plus, in a unit of ``s > 1`` blocks (``titan_cp.parallel.units``), ``s - 1`` more (the unit's
        recomputation runs its first ``s - 1`` blocks for their inputs, each block's own checkpoint all
        ``s``): ``2 layers - units`` under full AC."""
        if self.ac != "full":
            return self.checkpointed(layers)
        return 2 * layers - math.ceil(layers / self.host.blocks_per_checkpoint)

    @property
    def heads(self) -> tuple[int, int, int]:
        """``(query heads, K/V heads, SwiGLU width)`` on this rank."""
        a = self.args
        return a.n_heads // self.tp, a.kv_heads // self.tp, a.ffn_hidden_dim // self.tp


@dataclass(frozen=True)
class Stage:
    """The blocks of one pipeline stage and whether it holds the embedding / the output."""

    layers: int
    first: bool = True
    last: bool = True


def pipeline_stages(args: ModelArgs, pp: int) -> tuple[Stage, ...]:
    """The first and the last stage (one stage without a pipeline): the first takes the extra layers."""
    if pp == 1:
        return (Stage(args.n_layers),)
    split = layers_per_stage(args.n_layers, pp)
    return Stage(len(split[0]), True, False), Stage(len(split[-1]), False, True)


# ---------------------------------------------------------------------------- saved for backward


def ffn_saved_per_token(m: RankModel) -> float:
    """The feed-forward's saved bytes per local token: w1 x, w3 x, silu(w1 x), w2's input (a F each) and
    w1's input (a D); tiled (``tile_tokens``), only the tiles' inputs (views of w1's input, a D)."""
    a, d = m.act_bytes, m.args.dim
    f = m.heads[2]
    return a * d if m.host.tile_tokens else 3 * a * f + a * d + a * f


def tile_transient_bytes(m: RankModel, tokens: int) -> int:
    """One tile's recomputed intermediates and their gradients (``2 x 4 a F`` per tile token; an MoE layer's,
    ``2 x`` :func:`~titan_cp.plan.moe.moe_saved_per_token`, where larger), 0 untiled."""
    t = min(m.host.tile_tokens, tokens)
    moe, _ = mx.moe_shapes(m.args)
    per: float = 4 * m.act_bytes * m.heads[2]
    if moe is not None:
        per = max(per, mx.moe_saved_per_token(moe, m.args.dim, m.act_bytes, m.tp))
    return int(2 * per * t)


def norm_saved_per_token(m: RankModel) -> float:
    """An RMSNorm's saved bytes per token: on a GPU (``fused_norm``: ``aten._fused_rms_norm``'s kernel) its
    input (``a D / tp``) and the fp32 ``rstd``; in the composite form (a CPU) also the normalised input
    before the weight (``a (2 D + 1) / tp``). Its output is saved by the linear that reads it."""
    a, d = m.act_bytes, m.args.dim
    return (a * d + FP32) / m.tp if m.fused_norm else (2 * a * d + a) / m.tp


def block_saved_per_token(m: RankModel) -> float:
    """Bytes one block saves per local token without checkpointing (module docstring), a dense feed-forward's."""
    a, d = m.act_bytes, m.args.dim
    norm = norm_saved_per_token(m)
    attn = m.cost.saved_bytes_per_token(m.attention_call())
    mla = mx.mla_shapes(m.args)
    if mla is not None:
        attn += mx.mla_saved_per_token(mla, m.heads[0], a, m.fused_norm)
    return norm + a * d + attn + ffn_saved_per_token(m) + norm


def moe_delta_saved_per_token(m: RankModel) -> float:
    """What an MoE layer's feed-forward saves per local token beyond a dense one's (0 for a dense model, and in
    tiles, ``tile_tokens``: a tiled feed-forward, MoE or dense, keeps only its input)."""
    moe, _ = mx.moe_shapes(m.args)
    if moe is None or m.host.tile_tokens:
        return 0.0
    return mx.moe_saved_per_token(moe, m.args.dim, m.act_bytes, m.tp) - ffn_saved_per_token(m)


def largest_block_saved_per_token(m: RankModel) -> float:
    """:func:`block_saved_per_token` of the block that saves the most (an MoE block's where it saves more)."""
    return block_saved_per_token(m) + max(0.0, moe_delta_saved_per_token(m))


def stage_moe_blocks(m: RankModel, stage: Stage, count: int) -> int:
    """MoE blocks among ``count`` of ``stage``'s (in proportion, as :func:`stage_blocks`)."""
    moe = mx.stage_moe_layers(m.args, stage.layers, stage.first, stage.last)
    return round(moe * count / stage.layers) if stage.layers else 0


def linear_block_saved_per_token(m: RankModel) -> float:
    """Bytes a linear-attention block saves per local token (its mixer's widths over ``tp``, its input whole)."""
    shapes, _ = lin.linear_shapes(m.args)
    assert shapes is not None, "a linear block of a model with linear layers"
    a, d = m.act_bytes, m.args.dim
    mixer = (lin.saved_per_token(shapes, d, a) - a * d) / m.tp + a * d
    return 2 * norm_saved_per_token(m) + mixer + ffn_saved_per_token(m)


def linear_extra_bytes(m: RankModel) -> int:
    """What one linear block keeps on the rank keeping the most beyond its per-token figure: the later
    tokens' wider copies and the states (:func:`~titan_cp.plan.linear.work_extra_bytes`); 0 without linear layers."""
    shapes, _ = lin.linear_shapes(m.args)
    if shapes is None or m.linear_work is None:
        return 0
    return lin.work_extra_bytes(shapes, m.linear_work, m.act_bytes) // m.tp


def stage_blocks(m: RankModel, stage: Stage, count: int) -> tuple[int, int]:
    """``(attention, linear)`` blocks among ``count`` of ``stage``'s (a hybrid model's linear ones in proportion)."""
    linear = lin.stage_linear_layers(m.args, stage.layers, stage.first, stage.last)
    share = round(linear * count / stage.layers) if stage.layers else 0
    return count - share, share


def blocks_saved_per_token(m: RankModel, stage: Stage, count: int) -> float:
    """Per-token bytes of ``count`` of ``stage``'s blocks, uncheckpointed (:func:`stage_blocks`)."""
    attention, linear = stage_blocks(m, stage, count)
    per = block_saved_per_token(m) * attention + (linear_block_saved_per_token(m) * linear if linear else 0.0)
    return per + moe_delta_saved_per_token(m) * stage_moe_blocks(m, stage, count)


def recomputed_linear_block(m: RankModel, tokens: int) -> float:
    """Bytes of one linear block recomputed over ``tokens`` (0 for a model without linear layers)."""
    if lin.linear_shapes(m.args)[0] is None:
        return 0.0
    return linear_block_saved_per_token(m) * tokens + linear_extra_bytes(m)


def unit_inputs(m: RankModel, checkpointed: int) -> tuple[int, int]:
    """``(on the device, on the host)``: stored checkpoint-unit inputs of ``checkpointed`` blocks --
    one per ``blocks_per_checkpoint`` blocks (selective: one per block); with ``cpu_offload`` all of
    them on the host and at most ``prefetch + 1`` on the device (the unit being recomputed and the
    one prefetched, ``titan_cp.parallel.offload``)."""
    k = m.host.blocks_per_checkpoint if m.ac == "full" else 1
    units = math.ceil(checkpointed / k) if checkpointed else 0
    if not m.host.cpu_offload:
        return units, 0
    return min(units, m.host.prefetch + 1), units


def rope_per_token(args: ModelArgs) -> int:
    """RoPE's cos and sin (fp32, ``E/2`` each) per token, shared by every block."""
    return 2 * FP32 * (args.head_dim // 2)


def saved_per_token(m: RankModel, stage: Stage) -> float:
    """Bytes saved for backward per local token by ``stage`` (excludes ``doc_lens``)."""
    a, d = m.act_bytes, m.args.dim
    full = m.checkpointed(stage.layers)
    per: float = INT64 * stage.first + rope_per_token(m.args)
    per += a * d / m.tp * unit_inputs(m, full)[0] + blocks_saved_per_token(m, stage, stage.layers - full)
    if stage.last:
        per += INT64 if head_offloaded(m, stage) else head_saved_per_token(m)
    return per


def head_saved_per_token(m: RankModel) -> float:
    """The head's saved bytes per token: final norm (:func:`norm_saved_per_token`), the output's input
    (``a D``), labels (8) and the loss's lse (4)."""
    a, d = m.act_bytes, m.args.dim
    return norm_saved_per_token(m) + a * d + INT64 + FP32


def head_offloaded(m: RankModel, stage: Stage) -> bool:
    """With ``cpu_offload`` the head (final norm and loss) is a checkpoint unit whose input is on the host
    (``titan_cp.parallel.ac``): recomputed at the start of the backward, before any block's."""
    return stage.last and m.host.cpu_offload and m.checkpointed(stage.layers) > 0


def saved_bytes_per_token(
    args: ModelArgs,
    strategy: str = DEFAULT_STRATEGY,
    cp: int = 1,
    tp: int = 1,
    layers: int | None = None,
    ac: str = "none",
    act_bytes: int = 4,
    ulysses: int = 1,
    first: bool = True,
    last: bool = True,
) -> float:
    """:func:`saved_per_token` of ``layers`` blocks (default all) on the first/last pipeline stage."""
    m = RankModel(args, strategy, cp, tp, ulysses, act_bytes, ac)
    return saved_per_token(m, Stage(args.n_layers if layers is None else layers, first, last))


def saved_bytes(
    args: ModelArgs,
    local_tokens: int,
    docs_per_row: int,
    rows: int = 1,
    strategy: str = DEFAULT_STRATEGY,
    cp: int = 1,
    tp: int = 1,
    layers: int | None = None,
    ac: str = "none",
    act_bytes: int = 4,
    ulysses: int = 1,
    first: bool = True,
    last: bool = True,
) -> int:
    """Bytes saved for backward by one microbatch of ``rows`` rows on one rank (:func:`stage_saved_bytes`)."""
    m = RankModel(args, strategy, cp, tp, ulysses, act_bytes, ac, documents=docs_per_row > 1)
    stage = Stage(args.n_layers if layers is None else layers, first, last)
    return stage_saved_bytes(m, stage, local_tokens, docs_per_row, rows)


def stage_saved_bytes(m: RankModel, stage: Stage, local_tokens: int, docs_per_row: int, rows: int) -> int:
    """One microbatch's saved bytes on ``stage`` (see :func:`saved_bytes`)."""
    full = m.checkpointed(stage.layers)
    total = saved_per_token(m, stage) * local_tokens * rows
    total += stage_blocks(m, stage, stage.layers - full)[1] * linear_extra_bytes(m)
    if full:
        total += INT64 * docs_per_row * rows
    return int(total)


# ---------------------------------------------------------------------------- parameters


def attention_layer_params(args: ModelArgs, tp: int) -> int:
    """Parameters of one attention block on one TP rank (the norms' weights are replicated; a Hugging Face
    model's own attention projections, its output gate included)."""
    d, e = args.dim, args.head_dim
    attention = args.attention_params if isinstance(args, HFShapes) else d * (args.n_heads * 2 + args.kv_heads * 2) * e
    return (attention + 3 * d * args.ffn_hidden_dim) // tp + 2 * d


def linear_layer_params(args: ModelArgs, tp: int) -> int:
    """Parameters of one linear-attention block of a hybrid model on one TP rank (0 for a model without any)."""
    shapes, _ = lin.linear_shapes(args)
    if shapes is None:
        return 0
    return (shapes.params(args.dim) + 3 * args.dim * args.ffn_hidden_dim) // tp + 2 * args.dim


def layer_params(args: ModelArgs, tp: int, ep: int = 1) -> int:
    """Parameters of the largest block on one TP rank, as FSDP gathers it (an MoE block's experts: the rank's
    ``1 / ep`` of them, :func:`~titan_cp.plan.moe.gathered_layer_params`)."""
    largest = max(attention_layer_params(args, tp), linear_layer_params(args, tp))
    return largest + (max(0, mx.gathered_layer_params(args, tp, ep)) if mx.moe_shapes(args)[1] else 0)


def stage_layer_params(args: ModelArgs, tp: int, stage: Stage, active: bool = False) -> int:
    """Parameters of ``stage``'s blocks on one TP rank (a hybrid's linear blocks counted as theirs, an MoE
    block's every expert; ``active``: the experts a token runs, :meth:`~titan_cp.integrations.hf_shapes.MoEShapes.active_params`)."""
    linear = lin.stage_linear_layers(args, stage.layers, stage.first, stage.last)
    blocks = (stage.layers - linear) * attention_layer_params(args, tp) + linear * linear_layer_params(args, tp)
    moe = mx.stage_moe_layers(args, stage.layers, stage.first, stage.last)
    return blocks + moe * mx.ffn_delta(args, active) // tp


def stage_param_count(args: ModelArgs, tp: int, stage: Stage) -> int:
    """Parameters of ``stage`` on one TP rank: its blocks, the embedding (first), the final norm and output (last)."""
    emb = args.vocab_size * args.dim // tp
    return stage_layer_params(args, tp, stage) + emb * stage.first + (emb + args.dim) * stage.last


# ---------------------------------------------------------------------------- one step's peak


@dataclass(frozen=True)
class StepPeak:
    """The peak of one step above its start on one stage, by part (they sum to :attr:`peak`)."""

    saved: int  # one microbatch's saved bytes
    activations: int
    gradients: int
    loss: int
    recompute: int
    grads: int  # every gradient of the stage, as held at the step's end

    @property
    def peak(self) -> int:
        return self.activations + self.gradients + self.loss + self.recompute


def loss_bytes(args: ModelArgs, tp: int, tokens: int) -> int:
    """The chunked loss's transient: one chunk of fp32 logits and its gradient (``titan_cp.loss``)."""
    vocab = args.vocab_size // tp
    chunk = min(tokens, max(1, LOSS_CHUNK_BYTES // (FP32 * vocab)))
    return chunk * vocab * FP32 * 2


def step_peak(
    m: RankModel,
    stage: Stage,
    local_tokens: int,
    docs_per_row: int,
    rows: int = 1,
    grad_shards: int = 1,
    in_flight: int = 1,
    grads_held: bool = False,
) -> StepPeak:
    """The step's peak on ``stage``: ``in_flight`` microbatches of ``rows`` rows saved, gradients
    fp32 / ``grad_shards`` (all of them already held when ``grads_held``).

    The largest of: the backward's start (everything saved, the first gradients; with
    checkpointing the last block recomputed), the loss's chunk (last stage), and with
    checkpointing the first block's backward (its recomputed tensors, the other blocks' saved
    tensors freed, every gradient but the embedding's).
    """
    saved = stage_saved_bytes(m, stage, local_tokens, docs_per_row, rows)
    tokens = local_tokens * rows
    layer_grad = FP32 * layer_params(m.args, m.tp, m.ep) // grad_shards
    emb_grad = FP32 * m.args.vocab_size * m.args.dim // m.tp // grad_shards
    all_grads = FP32 * stage_param_count(m.args, m.tp, stage) // grad_shards
    others = (in_flight - 1) * saved
    held = all_grads if grads_held else 0
    full = m.checkpointed(stage.layers)
    k = m.host.blocks_per_checkpoint if m.ac == "full" else 1
    # a unit of k > 1 blocks recomputes its k block inputs, then one block's internals at a time (units.py;
    # measured by tools/full_step: k inputs beside the stored one, not k - 1)
    inputs = min(k, max(full, 1))
    block = max(largest_block_saved_per_token(m) * tokens, recomputed_linear_block(m, tokens))
    recompute = int(block + m.act_bytes * m.args.dim / m.tp * (inputs if inputs > 1 else 0) * tokens) if full else 0
    recompute += tile_transient_bytes(m, tokens)
    first_grads = held + (layer_grad if grads_held else layer_grad + emb_grad * stage.last)
    moments = [StepPeak(saved, others + saved, first_grads, 0, recompute, all_grads)]
    if stage.last:
        loss = loss_bytes(m.args, m.tp, tokens)
        head = int((head_saved_per_token(m) - INT64) * tokens) if head_offloaded(m, stage) else 0
        moments.append(StepPeak(saved, others + saved, held, loss, head, all_grads))
    if full:
        input_ = m.act_bytes * m.args.dim / m.tp
        blocks = input_ * unit_inputs(m, full)[0] + blocks_saved_per_token(m, stage, stage.layers - full)
        extra = stage_blocks(m, stage, stage.layers - full)[1] * linear_extra_bytes(m)
        left = saved - int((blocks - input_) * tokens) - extra  # block 0's input and what no block owns
        grads = all_grads + layer_grad if grads_held else all_grads - emb_grad * stage.first
        moments.append(StepPeak(saved, others + left, grads, 0, recompute, all_grads))
    return max(moments, key=lambda p: p.peak)


def step_peak_bytes(
    args: ModelArgs,
    local_tokens: int,
    docs_per_row: int,
    rows: int = 1,
    ac: str = "none",
    act_bytes: int = 4,
    strategy: str = DEFAULT_STRATEGY,
    cp: int = 1,
    tp: int = 1,
    ulysses: int = 1,
    grad_shards: int = 1,
) -> dict:
    """``{"saved", "peak", "grads"}`` of one forward + backward of the whole model (:func:`step_peak`)."""
    p = step_peak(
        RankModel(args, strategy, cp, tp, ulysses, act_bytes, ac, documents=docs_per_row > 1),
        Stage(args.n_layers),
        local_tokens,
        docs_per_row,
        rows,
        grad_shards,
    )
    return {"saved": p.saved, "peak": p.peak, "grads": p.grads}


# ---------------------------------------------------------------------------- a rank's total


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak, by part (module docstring)."""

    params: int
    optimizer: int
    comm_buffers: int
    step: StepPeak
    host: int = 0  # bytes in host memory: offloaded checkpoint inputs, FSDP's offloaded shards and optimizer

    @property
    def parts(self) -> dict[str, int]:
        s = self.step
        return {
            "params": self.params,
            "gradients": s.gradients,
            "optimizer": self.optimizer,
            "activations": s.activations,
            "loss": s.loss,
            "comm_buffers": self.comm_buffers,
            "recompute": s.recompute,
        }

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class Sharding:
    """How FSDP holds a stage: over ``fsdp`` ranks; ``pipelined``: weights stay gathered between
    microbatches and gradients are reduce-scattered at the step's end; ``reshard``: gathered
    weights are freed after each block's forward (FSDP's default)."""

    fsdp: int = 1
    pipelined: bool = False
    reshard: bool = True


def rank_memory(
    m: RankModel,
    stage: Stage,
    sharding: Sharding,
    local_tokens: int,
    docs_per_row: int,
    rows: int,
    in_flight: int = 1,
    grads_held: bool = False,
) -> RankMemory:
    """One rank's peak on ``stage`` with microbatches of ``rows`` rows of ``local_tokens`` tokens."""
    params = stage_param_count(m.args, m.tp, stage)
    f = sharding.fsdp
    layer = layer_params(m.args, m.tp, m.ep)
    if f == 1:
        buffers, grad_shards = 0, 1
    elif sharding.pipelined:  # gathered weights kept, gradients accumulated unsharded in fp32
        buffers, grad_shards = m.act_bytes * params, 1
    elif sharding.reshard:  # two blocks gathered (one computing, one prefetched) + one unsharded gradient
        buffers, grad_shards = 2 * m.act_bytes * layer + FP32 * layer, f
    else:
        buffers, grad_shards = m.act_bytes * params + FP32 * layer, f
    buffers += m.cost.buffer_bytes(m.attention_call(local_tokens * rows)) + a2a_buffer_bytes(m, local_tokens * rows)
    step = step_peak(m, stage, local_tokens, docs_per_row, rows, grad_shards, in_flight, grads_held)
    host = host_bytes(m, stage, local_tokens * rows, in_flight, params, f)
    if m.host.fsdp_offload and f > 1:  # shards, gradients and AdamW on the host; a block's gradient in buffers
        return RankMemory(0, 0, buffers, dataclasses.replace(step, gradients=0), host)
    return RankMemory(FP32 * params // f, 2 * FP32 * params // f, buffers, step, host)


def a2a_buffer_bytes(m: RankModel, tokens: int) -> int:
    """Expert parallelism's token exchange of one MoE layer: the ``k`` copies of ``tokens`` local tokens received
    for the rank's experts beside the permuted copy sent (which the routed experts save), ``k T D a`` (0 without
    EP or experts)."""
    moe, _ = mx.moe_shapes(m.args)
    if moe is None or m.ep == 1:
        return 0
    return moe.top_k * tokens * m.args.dim * m.act_bytes


def host_bytes(m: RankModel, stage: Stage, tokens: int, in_flight: int, params: int, fsdp: int) -> int:
    """Host bytes of one rank at their peak: every offloaded unit input (``a D / tp`` per token) and the RoPE
    tables of ``in_flight`` microbatches; with FSDP's offload also the fp32 shards and AdamW's two moments
    (``12 x params / fsdp``), and the shards' fp32 gradients (``4 x params / fsdp``), which the backward
    writes as it frees the unit inputs: the peak is the larger of the inputs and the gradients (measured on
    the whole step by ``benchmarks.full_step``)."""
    _, units = unit_inputs(m, m.checkpointed(stage.layers))
    units += head_offloaded(m, stage)  # the head's input (a D / tp per token, as a block's)
    inputs = 0
    if units:
        inputs = int((m.act_bytes * m.args.dim / m.tp * units + rope_per_token(m.args)) * tokens * in_flight)
    if m.host.fsdp_offload and fsdp > 1:
        return 3 * FP32 * params // fsdp + max(inputs, FP32 * params // fsdp)
    return inputs
