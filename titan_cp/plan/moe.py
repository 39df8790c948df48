"""Multi-head latent attention and mixtures of experts in the planner: what a layer holds, saves and sends.

**MLA** (DeepSeek V3, Kimi K2; :class:`~titan_cp.integrations.hf_shapes.MLAShapes`). The CP engine attends the
heads the model makes after its up-projection: q and k of ``E = qk_nope + qk_rope`` a head, v of its own ``E_v``
(every head its own K/V: as many K/V heads as query heads). So a layer's attention call is an ordinary one with
``v_head_dim = E_v``: its K/V bytes sent and kept are ``H (E + E_v)`` elements a token, the output and its
gradient at ``E_v`` (:class:`~titan_cp.attention.pricing.AttentionCall`). A pair costs ``2 E + 2 E_v`` FLOPs
forward (``QK^T``, ``PV``); the kernels that take one head dim (FlashAttention on a GPU) run V padded to ``E``,
so the planner times the kernel at ``max(E, E_v)`` (:func:`kernel_head_dim`) and counts the model's FLOPs at
``E + E_v`` (:meth:`~titan_cp.integrations.hf_shapes.HFShapes.pair_flops`). Its projections' parameters are
:meth:`~titan_cp.integrations.hf_shapes.MLAShapes.params`; beyond what a GQA block saves (the projections'
input ``a D``, the attention's q, k, v, out, lse) a block saves per token (:func:`mla_saved_per_token`)::

    q_a's output, normalised      an RMSNorm over r_q (its input and rstd) and q_b's input (a r_q)
    kv_a's output, normalised     an RMSNorm over r_kv and kv_b's input (a r_kv)
    RoPE's inputs                 q's and k's rotated parts (a rope (H + 1))

**Experts** (:class:`~titan_cp.integrations.hf_shapes.MoEShapes`; ``X`` routed experts of width ``F``, ``k`` a
token, shared experts of width ``F_s``, MoE layers ``L_moe``). Held: every expert's weights, ``3 D F X`` a
layer, with the router ``D X`` and the shared ``3 D F_s``; a token's matmuls run ``3 D (k F + F_s) + D X``
(:meth:`~titan_cp.integrations.hf_shapes.MoEShapes.active_params`), which is what the compute counts.

Expert parallelism (torchtitan's ``expert_parallel_degree``, ``ep``): ``ep`` divides ``dp_shard x cp x tp``
(torchtitan 0.3's ``ParallelismConfig``: the sparse mesh ``efsdp x ep`` covers the dense region's ranks, ``efsdp
= dp_shard x cp x tp / ep``) and the routed experts, which it splits over its ``ep`` ranks (``X / ep`` each),
FSDP sharding them over ``efsdp``. A rank stores ``1 / (dp_shard x cp x tp)`` of the experts either way (master
weights, AdamW); what ``ep`` changes is what FSDP gathers (a block's ``3 D F X / ep``, :func:`gathered_layer_params`)
and sends (``efsdp`` ranks), and the token exchange: each MoE layer sends each local token's ``k`` copies to
their experts' ranks and back (dispatch and combine, ``all_to_all_single``), ``(ep - 1) / ep`` of them off the
rank under even routing, and the backward sends their gradients the same way (:func:`all_to_all_bytes`)::

    a2a bytes per rank = L_moe x 2 T k D a (ep - 1) / ep x (forward passes + 1)

exposed whole (the experts wait for their tokens), on the link of ``ep`` consecutive ranks (the innermost axes).

Saved per local token of an MoE layer's feed-forward (:func:`moe_saved_per_token`), in place of a dense one's::

    router     its input (a D, the shared experts' too), its scores (fp32 X), the top-k indices and weights (8 k + a k)
    routed     each of the k copies: the gathered input (a D), w1 x, w3 x, silu(w1 x) and w2's input (4 a F),
               the expert's output before its weight (a D), its token's index (8) and weight (fp32)
    shared     w1 x, w3 x, silu(w1 x), w2's input (4 a F_s)

A formula over what any implementation keeps, not a count of one: transformers' DeepSeek V3 MoE layer (its
experts in a loop, group-limited routing, fp32, D 64, F 32, 4 experts, 2 a token, one shared) saves 1,136 to 1,152
bytes a token beyond a dense layer of the same model (``benchmarks.memory.SavedTensorCounter``; a few per-expert
tensors follow the routing), where this says 1,088 (4-6% less: its routing masks, a copy's indices in three tensors).
"""

from __future__ import annotations

from titan_cp.families.llama3.model import ModelArgs
from titan_cp.integrations.hf_shapes import HFShapes, MLAShapes, MoEShapes
from titan_cp.plan import linear as lin

FP32 = 4
INT64 = 8


def mla_shapes(args: ModelArgs) -> MLAShapes | None:
    """A model's multi-head latent attention (``None`` for another attention)."""
    return args.mla if isinstance(args, HFShapes) else None


def moe_shapes(args: ModelArgs) -> tuple[MoEShapes | None, tuple[int, ...]]:
    """A model's experts and their layers' indices (``(None, ())`` for a dense model)."""
    if isinstance(args, HFShapes) and args.moe is not None:
        return args.moe, args.moe_layers
    return None, ()


def v_head_dim(args: ModelArgs) -> int:
    """A value head's dim (MLA's own; else the query's)."""
    return args.v_head_dim if isinstance(args, HFShapes) else args.head_dim


def kernel_head_dim(args: ModelArgs) -> int:
    """The head dim the attention kernel runs at (module docstring): V padded to q/k's where narrower."""
    return max(args.head_dim, v_head_dim(args))


def stage_moe_layers(args: ModelArgs, layers: int, first: bool, last: bool) -> int:
    """How many of a pipeline stage's ``layers`` are MoE layers (:func:`~titan_cp.plan.linear.layers_in_stage`)."""
    return lin.layers_in_stage(moe_shapes(args)[1], args.n_layers, layers, first, last)


# ---------------------------------------------------------------------------- parameters
def ffn_delta(args: ModelArgs, active: bool = False) -> int:
    """What an MoE layer's feed-forward holds (or, ``active``, runs a token through) beyond a dense one's
    ``3 D F`` (0 for a dense model)."""
    moe, _ = moe_shapes(args)
    if moe is None:
        return 0
    held = moe.active_params(args.dim) if active else moe.params(args.dim)
    return held - 3 * args.dim * args.ffn_hidden_dim


def stage_expert_params(args: ModelArgs, stage_layers: int, first: bool, last: bool) -> int:
    """The routed experts' weights of a stage's MoE layers (what expert parallelism shards)."""
    moe, _ = moe_shapes(args)
    return 0 if moe is None else stage_moe_layers(args, stage_layers, first, last) * moe.expert_params(args.dim)


def gathered_layer_params(args: ModelArgs, tp: int, ep: int) -> int:
    """An MoE layer's feed-forward as FSDP gathers it on one rank beyond a dense layer's: its routed experts
    ``3 D F X / (tp ep)`` (EP's share, gathered over ``efsdp``; planned without TP beside EP), its router and
    shared experts ``/ tp``, less the dense layer's ``3 D F / tp`` (0 for a dense model)."""
    moe, _ = moe_shapes(args)
    if moe is None:
        return 0
    d = args.dim
    return moe.expert_params(d) // (tp * ep) + (moe.dense_params(d) - 3 * d * args.ffn_hidden_dim) // tp


# ---------------------------------------------------------------------------- saved for backward
def moe_saved_per_token(moe: MoEShapes, dim: int, act_bytes: int, tp: int = 1) -> float:
    """An MoE layer's feed-forward's saved bytes per local token (module docstring)."""
    a, k = act_bytes, moe.top_k
    router = a * dim + FP32 * moe.experts + (INT64 + a) * k
    routed = k * (2 * a * dim + 4 * a * moe.hidden / tp + INT64 + FP32)
    return router + routed + 4 * a * moe.shared_hidden / tp


def mla_saved_per_token(mla: MLAShapes, heads: int, act_bytes: int, fused_norm: bool) -> float:
    """What an MLA block saves per local token beyond a GQA block's projections' input and attention (module
    docstring), ``heads`` this rank's; an RMSNorm over ``w`` saves ``a w + 4`` fused (a GPU), ``2 a w + a``
    composite (as :func:`titan_cp.plan.memory.norm_saved_per_token`)."""
    a = act_bytes
    widths = [w for w in (mla.q_lora_rank, mla.kv_lora_rank) if w]
    norms = sum(a * w + FP32 if fused_norm else 2 * a * w + a for w in widths)
    return norms + a * sum(widths) + a * mla.qk_rope * (heads + 1)


# ---------------------------------------------------------------------------- the token exchange
def all_to_all_bytes(args: ModelArgs, tokens: int, ep: int, act_bytes: int, moe_layers: int, passes: float) -> int:
    """Bytes one rank sends in the MoE layers' token dispatch and combine over ``moe_layers`` layers of one
    microbatch of ``tokens`` local tokens (module docstring): ``2 T k D a (ep - 1) / ep`` a layer and pass,
    ``passes`` forwards (1, more under activation checkpointing) and the backward; 0 without EP."""
    moe, _ = moe_shapes(args)
    if moe is None or ep == 1:
        return 0
    per_pass = 2 * tokens * moe.top_k * args.dim * act_bytes * (ep - 1) / ep
    return int(moe_layers * per_pass * (passes + 1))


def ep_degrees(args: ModelArgs, dp_shard: int, cp: int, tp: int) -> list[int]:
    """The expert-parallel degrees torchtitan 0.3 takes beside ``dp_shard x cp x tp``: each divisor of that
    product that divides the routed experts too (``[1]`` for a dense model)."""
    moe, _ = moe_shapes(args)
    region = dp_shard * cp * tp
    if moe is None:
        return [1]
    return [ep for ep in range(1, region + 1) if region % ep == 0 and moe.experts % ep == 0]
