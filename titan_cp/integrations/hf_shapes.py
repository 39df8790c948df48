"""The planner's shapes of a Hugging Face model (``model.name = "hf"``), read from its ``config.json``.

Only the JSON is read (no ``transformers``, no weights): hidden size, layers, query and KV heads,
head size (``head_dim``, which need not be ``hidden / heads``), the MLP width, the vocabulary and
whether the head is tied, and each layer's attention (``layer_types``: full, sliding window,
chunked; gpt-oss's sinks). A hybrid model's linear-attention layers (``linear_attention``, or Bamba's
``attn_layer_indices``) are :class:`LinearShapes`: Gated DeltaNet from ``linear_num_key_heads``,
``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``
(Qwen3.5, Qwen3-Next), Mamba2 from the ``mamba_*`` fields (Bamba, Granite 4), which the planner prices
as linear layers (:mod:`titan_cp.plan.linear`), never as attention. Tensor and pipeline parallelism are
not built for these models, so the planner lists meshes without them.

Multi-head latent attention (DeepSeek V3, Kimi K2: ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
``qk_rope_head_dim``, ``v_head_dim``) is :class:`MLAShapes`: q and k of ``qk_nope + qk_rope`` a head, v of
``v_head_dim``, as the model hands them to the attention after its up-projection (every head its own K/V).
A mixture of experts (DeepSeek V3 / Kimi K2's ``n_routed_experts``, Qwen3-MoE's and Qwen3.5-MoE's
``num_experts``, Mixtral's and gpt-oss's ``num_local_experts``) is :class:`MoEShapes`: the routed experts'
weights are held, ``num_experts_per_tok`` of them (and the shared experts) run on each token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from titan_cp.families.llama3.model import ModelArgs

_KINDS = {"full_attention": "F", "sliding_attention": "W", "chunked_attention": "C", "attention": "F"}
LINEAR = ("linear_attention", "mamba")  # layer_types of linear-attention layers (``mamba``: the legacy name)
LINEAR_KINDS = ("gated_delta", "mamba2")
GATED_ATTENTION = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
"""``model_type`` of models whose attention's ``q_proj`` also makes a gate per head (``2 x heads x head_dim``)."""
QK_NORM = ("qwen3", "qwen3_moe", "qwen3_next", *GATED_ATTENTION[:4])
"""``model_type`` of models whose attention normalises each query and key head (a ``head_dim`` weight each)."""
FP32 = 4


@dataclass(frozen=True)
class LinearShapes:
    """A hybrid model's linear-attention layers (every one alike), as the planner prices them.

    kind: ``"gated_delta"`` (Gated DeltaNet: Qwen3.5, Qwen3-Next) or ``"mamba2"`` (Mamba2's SSD: Bamba, Granite 4).
    k_heads, v_heads: Gated DeltaNet's q/k heads and value heads; Mamba2's B/C groups and heads.
    d_k, d_v: the two dims of a head's state, ``d_k x d_v``: Gated DeltaNet's key and value head dims; Mamba2's
        ``d_state`` and ``head_dim``.
    conv: the short convolution's taps (over ``2 k_heads d_k + v_heads d_v`` channels: q, k, v; x, B, C).
    chunk: the kernel's chunk length (``fla``'s 64 for Gated DeltaNet; the config's ``chunk_size`` for Mamba2).
    """

    kind: str
    k_heads: int
    v_heads: int
    d_k: int
    d_v: int
    conv: int = 4
    chunk: int = 64

    def __post_init__(self) -> None:
        if self.kind not in LINEAR_KINDS:
            raise ValueError(f"linear layer kind must be one of {LINEAR_KINDS}, got {self.kind!r}")

    @property
    def gated_delta(self) -> bool:
        return self.kind == LINEAR_KINDS[0]

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.d_k + self.v_heads * self.d_v

    @property
    def value_dim(self) -> int:
        """The layer's inner width (``v_heads x d_v``): the gate ``z``, the kernel's output, ``out_proj``'s input."""
        return self.v_heads * self.d_v

    def params(self, dim: int) -> int:
        """Parameters of one layer's mixer: projections ``dim x (2 k_heads d_k + 2 value_dim + gates)`` (q, k, v, z,
        and per head Gated DeltaNet's ``b, a`` or Mamba2's ``dt``), ``out_proj`` ``value_dim x dim``, the
        convolution's taps (Mamba2's with a bias), per head ``A_log, dt_bias`` (Mamba2 also ``D``) and the gated
        norm's weight."""
        gates = 2 * self.v_heads if self.gated_delta else self.v_heads
        per_head = 2 if self.gated_delta else 3
        norm = self.d_v if self.gated_delta else self.value_dim
        proj = dim * (2 * self.k_heads * self.d_k + 2 * self.value_dim + gates) + self.value_dim * dim
        conv = self.conv_channels * (self.conv + (not self.gated_delta))
        return proj + conv + per_head * self.v_heads + norm

    @property
    def state_bytes(self) -> int:
        """One state of one piece, every head, fp32: ``v_heads x d_k x d_v x 4``."""
        return self.v_heads * self.d_k * self.d_v * FP32

    @property
    def summary_bytes(self) -> int:
        """One summary, fp32, as the ops exchange it: Gated DeltaNet's ``[B | M]`` (``v_heads x d_k x (d_v + d_k)``),
        Mamba2's ``[B | m]`` (``heads x head_dim x (d_state + 1)``)."""
        if self.gated_delta:
            return self.v_heads * self.d_k * (self.d_v + self.d_k) * FP32
        return self.v_heads * self.d_v * (self.d_k + 1) * FP32


@dataclass(frozen=True)
class MLAShapes:
    """Multi-head latent attention (DeepSeek V3, Kimi K2), every layer alike.

    q_lora_rank: the query's low rank (``q_a_proj``, its norm, ``q_b_proj``); 0: ``q_proj`` from the hidden state.
    kv_lora_rank: the compressed K/V (``kv_a_proj_with_mqa`` makes it and the shared RoPE key, ``kv_b_proj`` the
        heads' K (no RoPE part) and V from it, after its norm).
    qk_nope, qk_rope: a query / key head's dims without and with RoPE; v_head_dim: a value head's.
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope + self.qk_rope

    def params(self, dim: int, heads: int) -> int:
        """One layer's attention parameters, ``H`` heads, ``r_q, r_kv`` the ranks::

        q      D r_q + r_q (norm) + r_q H (nope + rope)      (r_q = 0: D H (nope + rope))
        kv_a   D (r_kv + rope) + r_kv (norm)
        kv_b   r_kv H (nope + v)
        o      H v D
        """
        qk, rq, rkv = self.qk_head_dim, self.q_lora_rank, self.kv_lora_rank
        q = dim * rq + rq + rq * heads * qk if rq else dim * heads * qk
        kv = dim * (rkv + self.qk_rope) + rkv + rkv * heads * (self.qk_nope + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * dim


@dataclass(frozen=True)
class MoEShapes:
    """A mixture-of-experts feed-forward (every MoE layer alike), SwiGLU experts of three ``D x F`` matrices.

    experts: the routed experts; top_k: those each token runs (``num_experts_per_tok``); hidden: a routed expert's
    width ``F``; shared_hidden: the shared experts' width together (DeepSeek V3's ``n_shared_experts x F``,
    Qwen's ``shared_expert_intermediate_size``; 0 without); shared_gate: the shared expert's sigmoid gate
    (Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE: a ``D x 1`` linear). The router is one ``D x experts`` linear.
    """

    experts: int
    top_k: int
    hidden: int
    shared_hidden: int = 0
    shared_gate: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.experts} (the experts), got {self.top_k}")

    def expert_params(self, dim: int) -> int:
        """The routed experts' weights, ``3 D F x experts``: what expert parallelism shards."""
        return 3 * dim * self.hidden * self.experts

    def dense_params(self, dim: int) -> int:
        """What every rank of an expert-parallel group holds alike: the router ``D x experts``, the shared experts
        ``3 D F_shared`` and their gate."""
        return dim * self.experts + 3 * dim * self.shared_hidden + dim * self.shared_gate

    def params(self, dim: int) -> int:
        """One MoE layer's feed-forward parameters (:meth:`expert_params` + :meth:`dense_params`)."""
        return self.expert_params(dim) + self.dense_params(dim)

    def active_params(self, dim: int) -> int:
        """The parameters a token's matmuls run through: ``top_k`` routed experts, the shared ones, the router."""
        return 3 * dim * self.hidden * self.top_k + self.dense_params(dim)

    def routed_width(self) -> int:
        """A token's routed experts' width together (``top_k x F``)."""
        return self.top_k * self.hidden


@dataclass
class HFShapes(ModelArgs):
    """:class:`ModelArgs` with the shapes a Hugging Face config sets on its own: ``hf_head_dim``,
    ``hf_ffn`` (the MLP width, ``intermediate_size``), ``tied`` (head = embedding), ``q_gate`` (the attention's
    output gate: ``q_proj`` twice as wide, :data:`GATED_ATTENTION`), ``qk_norm`` (:data:`QK_NORM`); ``mla``
    (:class:`MLAShapes`), ``moe`` (:class:`MoEShapes`) at the layers ``moe_layers`` (the others dense); a hybrid model's ``linear`` layers
    (:class:`LinearShapes`) at the indices ``linear_layers`` (their letters in ``attention_pattern`` stand for
    nothing: the planner prices them as linear layers)."""

    hf_head_dim: int = 128
    hf_ffn: int = 14336
    tied: bool = False
    name: str = "hf"
    q_gate: bool = False
    linear: LinearShapes | None = None
    linear_layers: tuple[int, ...] = ()
    qk_norm: bool = False
    mla: MLAShapes | None = None
    moe: MoEShapes | None = None
    moe_layers: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        """The query / key head dim (MLA's ``qk_nope + qk_rope``)."""
        return self.mla.qk_head_dim if self.mla is not None else self.hf_head_dim

    @property
    def v_head_dim(self) -> int:
        """A value head's dim (MLA's own; else the query's)."""
        return self.mla.v_head_dim if self.mla is not None else self.head_dim

    def ffn_params(self, layer_moe: bool) -> int:
        """One layer's feed-forward parameters: a dense layer's ``3 D F``, an MoE layer's :meth:`MoEShapes.params`."""
        return self.moe.params(self.dim) if layer_moe and self.moe is not None else 3 * self.dim * self.hf_ffn

    def expert_params(self) -> int:
        """Every MoE layer's routed experts' weights (what expert parallelism shards; 0 without experts)."""
        return len(self.moe_layers) * self.moe.expert_params(self.dim) if self.moe is not None else 0

    def active_params(self, include_embedding: bool = True) -> int:
        """:meth:`num_params` with each MoE layer's experts as a token runs them (:meth:`MoEShapes.active_params`)."""
        n = self.num_params(include_embedding)
        if self.moe is None:
            return n
        return n - len(self.moe_layers) * (self.moe.params(self.dim) - self.moe.active_params(self.dim))

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hf_ffn

    @property
    def attention_layers(self) -> int:
        """Layers with attention (the others are linear)."""
        return self.n_layers - len(self.linear_layers)

    @property
    def attention_params(self) -> int:
        """One attention layer's projections: q (and its gate), k, v, o; MLA's (:meth:`MLAShapes.params`)."""
        if self.mla is not None:
            return self.mla.params(self.dim, self.n_heads)
        norms = 2 * self.head_dim * self.qk_norm
        return self.dim * self.head_dim * (self.n_heads * (2 + self.q_gate) + self.kv_heads * 2) + norms

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count (one embedding when the head is tied to it; every expert's weights)."""
        d = self.dim
        attention = self.attention_params
        mixers = self.attention_layers * attention
        if self.linear is not None:
            mixers += len(self.linear_layers) * self.linear.params(d)
        ffn = sum(self.ffn_params(i in self.moe_layers) for i in range(self.n_layers))
        n = mixers + ffn + self.n_layers * 2 * d + d + (0 if self.tied else d * self.vocab_size)
        return n + (self.vocab_size * d if include_embedding else 0)

    def pair_flops(self) -> int:
        """Training FLOPs of one visible (query, key) pair in one head: ``QK^T`` and ``PV`` forward
        (``2 E + 2 E_v``), twice that backward: ``6 (E + E_v)`` (``12 E`` where ``E_v = E``)."""
        return 6 * (self.head_dim + self.v_head_dim)

    def num_flops_per_token(self, seq_len: int) -> int:
        """:meth:`ModelArgs.num_flops_per_token` with ``QK^T`` and ``PV`` in the attention layers only, the matmuls
        of the parameters a token runs through (:meth:`active_params`)."""
        n = self.active_params(include_embedding=False)
        return 6 * n + self.attention_layers * self.n_heads * self.pair_flops() * seq_len

    def training_flops(self, num_tokens: int, attention_pairs: int) -> int:
        """:meth:`ModelArgs.training_flops` with the attention pairs in the attention layers only (a linear
        layer's kernel is priced by the planner, :mod:`titan_cp.plan.linear`), a value head dim of its own and the
        experts a token runs (:meth:`active_params`)."""
        n = self.active_params(include_embedding=False)
        return 6 * n * num_tokens + self.attention_layers * self.n_heads * self.pair_flops() * attention_pairs


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def _layer_types(c: dict, layers: int) -> list[str]:
    """Each layer's type: ``layer_types``; else Bamba's ``attn_layer_indices``, or a Gated DeltaNet model's
    ``full_attention_interval`` (every ``n``-th layer attention, as ``transformers`` fills them in); else every
    layer attention (sliding where the config says so)."""
    types = c.get("layer_types")
    if types:
        return list(types[:layers])
    if "attn_layer_indices" in c:
        return ["full_attention" if i in (c["attn_layer_indices"] or ()) else LINEAR[0] for i in range(layers)]
    if "linear_num_value_heads" in c:
        every = int(c.get("full_attention_interval") or 4)
        return [LINEAR[0] if (i + 1) % every else "full_attention" for i in range(layers)]
    sliding = c.get("sliding_window") is not None and c.get("use_sliding_window", True)
    return ["sliding_attention" if sliding else "full_attention"] * layers


def _pattern(c: dict, layers: int) -> tuple[str, int | None, int | None, tuple[int, ...]]:
    """Per-layer letters (F full, W window, C chunked; F for a linear layer), the window, the chunk size and
    the linear layers' indices."""
    types = _layer_types(c, layers)
    unknown = sorted({t for t in types if t not in _KINDS and t not in LINEAR})
    if unknown:
        raise ValueError(f"config.json layer_types {unknown}: the planner knows {sorted([*_KINDS, *LINEAR])}")
    letters = "".join(_KINDS.get(t, "F") for t in types)
    linear = tuple(i for i, t in enumerate(types) if t in LINEAR)
    attention = "".join(x for i, x in enumerate(letters) if i not in linear)
    window = c.get("sliding_window") if "W" in attention else None
    chunk = c.get("attention_chunk_size") if "C" in attention else None
    return letters, window, chunk, linear


def _linear_shapes(c: dict, dim: int, where: str) -> LinearShapes:
    """The :class:`LinearShapes` of a config whose layers include linear ones: Gated DeltaNet's ``linear_*``
    fields, or Mamba2's (``mamba_*``: Bamba, Granite 4; a ``head_dim`` of ``"auto"`` is ``expand x dim / heads``)."""
    if "linear_num_value_heads" in c:
        return LinearShapes(
            LINEAR_KINDS[0],
            int(c.get("linear_num_key_heads") or 16),
            int(c["linear_num_value_heads"]),
            int(c.get("linear_key_head_dim") or 128),
            int(c.get("linear_value_head_dim") or 128),
            int(c.get("linear_conv_kernel_dim") or 4),
        )
    if "mamba_n_heads" in c:
        heads = int(c["mamba_n_heads"])
        head_dim = c.get("mamba_d_head") or "auto"
        head = int(c.get("mamba_expand") or 2) * dim // heads if head_dim == "auto" else int(head_dim)
        groups, state = int(c.get("mamba_n_groups") or 1), int(c.get("mamba_d_state") or 256)
        conv, chunk = int(c.get("mamba_d_conv") or 4), int(c.get("mamba_chunk_size") or 256)
        return LinearShapes(LINEAR_KINDS[1], groups, heads, state, head, conv, chunk)
    raise ValueError(
        f"{where}: config.json has linear-attention layers but neither Gated DeltaNet's linear_num_value_heads nor "
        "Mamba2's mamba_n_heads: the planner prices those two kinds"
    )


def hf_model_args(folder: str) -> HFShapes:
    """The planner's :class:`HFShapes` of the Hugging Face folder ``folder`` (its ``config.json``);
    ``ValueError`` naming ``model.hf_assets_path`` when it cannot be read."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"model.hf_assets_path = {folder!r} holds no config.json: the planner reads the model from it")
    c = _text_config(json.loads(path.read_text()))
    try:
        dim, layers, heads = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
        vocab = int(c["vocab_size"])
    except KeyError as e:
        raise ValueError(f"model.hf_assets_path = {folder!r}: config.json has no {e.args[0]!r}") from None
    width = int(c.get("intermediate_size") or 4 * dim)
    letters, window, chunk, linear = _pattern(c, layers)
    where = f"model.hf_assets_path = {folder!r}"
    mla = _mla_shapes(c)
    moe, moe_layers = _moe_shapes(c, layers, width, where)
    return HFShapes(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=heads if mla is not None else int(c.get("num_key_value_heads") or heads),
        vocab_size=vocab,
        max_seq_len=int(c.get("max_position_embeddings") or 131072),
        attention_pattern=letters,
        window=window,
        chunk=chunk,
        sinks=c.get("model_type") == "gpt_oss",
        hf_head_dim=int(c.get("head_dim") or dim // heads),
        hf_ffn=width,
        tied=bool(c.get("tie_word_embeddings", False)),
        name=f"hf:{c.get('model_type', '?')}",
        q_gate=c.get("model_type") in GATED_ATTENTION,
        qk_norm=c.get("model_type") in QK_NORM,
        linear=_linear_shapes(c, dim, where) if linear else None,
        linear_layers=linear,
        mla=mla,
        moe=moe,
        moe_layers=moe_layers,
    )


def _mla_shapes(c: dict) -> MLAShapes | None:
    """Multi-head latent attention's :class:`MLAShapes` (DeepSeek V3, Kimi K2: ``kv_lora_rank``), else ``None``."""
    if not c.get("kv_lora_rank"):
        return None
    return MLAShapes(
        int(c.get("q_lora_rank") or 0),
        int(c["kv_lora_rank"]),
        int(c.get("qk_nope_head_dim") or 128),
        int(c.get("qk_rope_head_dim") or 64),
        int(c.get("v_head_dim") or 128),
    )


def _moe_layers(c: dict, layers: int) -> tuple[int, ...]:
    """The MoE layers' indices: after DeepSeek V3's ``first_k_dense_replace`` dense ones, every
    ``moe_layer_freq``-th; Qwen's every ``decoder_sparse_step``-th but ``mlp_only_layers``; else every layer."""
    if "first_k_dense_replace" in c or "n_routed_experts" in c:
        first, every = int(c.get("first_k_dense_replace") or 0), int(c.get("moe_layer_freq") or 1)
        return tuple(i for i in range(first, layers) if i % every == 0)
    every, dense = int(c.get("decoder_sparse_step") or 1), set(c.get("mlp_only_layers") or ())
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % every == 0)


def _moe_shapes(c: dict, layers: int, width: int, where: str) -> tuple[MoEShapes | None, tuple[int, ...]]:
    """A mixture of experts' :class:`MoEShapes` and its layers' indices (``(None, ())`` for a dense model): the
    routed experts (``n_routed_experts``, ``num_experts``, ``num_local_experts``), their width
    (``moe_intermediate_size``; Mixtral's and gpt-oss's ``intermediate_size``), ``num_experts_per_tok``, the shared
    experts (DeepSeek V3's ``n_shared_experts x moe_intermediate_size``, Qwen's ``shared_expert_intermediate_size``
    and its gate)."""
    experts = int(c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0)
    if experts <= 1:
        return None, ()
    if not c.get("num_experts_per_tok"):
        raise ValueError(
            f"{where}: config.json has {experts} experts and no num_experts_per_tok: the planner needs the experts "
            "each token runs"
        )
    hidden = int(c.get("moe_intermediate_size") or width)
    shared = int(c.get("n_shared_experts") or 0) * hidden or int(c.get("shared_expert_intermediate_size") or 0)
    gate = bool(c.get("shared_expert_intermediate_size"))
    moe = MoEShapes(experts, int(c["num_experts_per_tok"]), hidden, shared, gate)
    return moe, _moe_layers(c, layers)
