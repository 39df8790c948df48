"""The planner's shapes of a Hugging Face model (``model.name = "hf"``), read from its ``config.json``.

Only the JSON is read (no ``transformers``, no weights): hidden size, layers, query and KV heads,
head size (``head_dim``, which need not be ``hidden / heads``), the MLP width, the vocabulary and
whether the head is tied, and each layer's attention (``layer_types``: full, sliding window,
chunked; gpt-oss's sinks). A hybrid model's linear-attention layers (``linear_attention``, or Bamba's
``attn_layer_indices``) are :class:`LinearShapes`: Gated DeltaNet from ``linear_num_key_heads``,
``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``
(Qwen3.5, Qwen3-Next), Mamba2 from the ``mamba_*`` fields (Bamba, Granite 4), which the planner prices
as linear layers (:mod:`titan_cp.plan.linear`), never as attention. Tensor and pipeline parallelism are
not built for these models, so the planner lists meshes without them. A mixture of experts is refused
(its weights and its compute per token differ, which the planner's dense model cannot hold both of).
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


@dataclass
class HFShapes(ModelArgs):
    """:class:`ModelArgs` with the shapes a Hugging Face config sets on its own: ``hf_head_dim``,
    ``hf_ffn`` (the MLP width, ``intermediate_size``), ``tied`` (head = embedding), ``q_gate`` (the attention's
    output gate: ``q_proj`` twice as wide, :data:`GATED_ATTENTION`); a hybrid model's ``linear`` layers
    (:class:`LinearShapes`) at the indices ``linear_layers`` (their letters in ``attention_pattern`` stand for
    nothing: the planner prices them as linear layers)."""

    hf_head_dim: int = 128
    hf_ffn: int = 14336
    tied: bool = False
    name: str = "hf"
    q_gate: bool = False
    linear: LinearShapes | None = None
    linear_layers: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hf_head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hf_ffn

    @property
    def attention_layers(self) -> int:
        """Layers with attention (the others are linear)."""
        return self.n_layers - len(self.linear_layers)

    @property
    def attention_params(self) -> int:
        """One attention layer's projections: q (and its gate), k, v, o."""
        return self.dim * self.head_dim * (self.n_heads * (2 + self.q_gate) + self.kv_heads * 2)

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count (one embedding when the head is tied to it)."""
        d, f = self.dim, self.hf_ffn
        attention = self.attention_params
        mixers = self.attention_layers * attention
        if self.linear is not None:
            mixers += len(self.linear_layers) * self.linear.params(d)
        n = mixers + self.n_layers * (3 * d * f + 2 * d) + d + (0 if self.tied else d * self.vocab_size)
        return n + (self.vocab_size * d if include_embedding else 0)

    def num_flops_per_token(self, seq_len: int) -> int:
        """:meth:`ModelArgs.num_flops_per_token` with ``QK^T`` and ``PV`` in the attention layers only."""
        n = self.num_params(include_embedding=False)
        return 6 * n + 12 * self.attention_layers * self.n_heads * self.head_dim * seq_len

    def training_flops(self, num_tokens: int, attention_pairs: int) -> int:
        """:meth:`ModelArgs.training_flops` with the attention pairs in the attention layers only (a linear
        layer's kernel is priced by the planner, :mod:`titan_cp.plan.linear`)."""
        n = self.num_params(include_embedding=False)
        return 6 * n * num_tokens + 12 * self.attention_layers * self.n_heads * self.head_dim * attention_pairs


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
    experts = c.get("num_local_experts") or c.get("num_experts")
    if experts and int(experts) > 1:
        raise ValueError(
            f"model.hf_assets_path = {folder!r} is a mixture of experts (config.json {experts} experts): the "
            "planner models dense MLPs only; plan a dense model of the same attention shapes instead"
        )
    width = int(c.get("intermediate_size") or 4 * dim)
    letters, window, chunk, linear = _pattern(c, layers)
    where = f"model.hf_assets_path = {folder!r}"
    return HFShapes(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=int(c.get("num_key_value_heads") or heads),
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
        linear=_linear_shapes(c, dim, where) if linear else None,
        linear_layers=linear,
    )
