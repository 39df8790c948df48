"""What titan_cp asks of a Hugging Face causal LM's structure, read through public attributes only.

- its decoder layers: the ``nn.ModuleList`` whose entries are ``GradientCheckpointingLayer``\\ s
  (or the classes of ``_no_split_modules``), found again after activation checkpointing,
  ``torch.compile`` or FSDP wrapped them;
- its attention modules: in each decoder layer, the modules with ``layer_idx`` and
  ``is_causal`` (the ones that call ``AttentionInterface``); in each ``linear_attention`` layer
  (``config.layer_types``), its linear-attention layer (Gated DeltaNet, Mamba2: :mod:`.hf_linear`);
  ``mlp`` / ``moe`` layers (Nemotron-H) mix no tokens and need neither;
- each layer's mask: plain causal, a sliding window or chunked attention, from its
  ``config.layer_types`` entry (:func:`layer_mask`); attention sinks arrive with the call;
- what its layers use that titan_cp's CP attention does not run yet (logit soft-capping, layer
  types other than full / sliding / chunked attention, query temperature tuning, dropout,
  bidirectional attention): each named by its layer type or its config field, so that such a
  model is refused, never run with the wrong mask;
- whether its output head is the plain ``logits = lm_head(hidden)`` that titan_cp's chunked loss
  can replace (families whose forward rescales or soft-caps the logits keep their own forward).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from torch import nn

from titan_cp.integrations.hf_linear import LINEAR_LAYER_TYPES, check_linear, linear_mixer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# families whose ``ForCausalLM.forward`` computes ``logits = lm_head(hidden_states)`` and nothing
# else (checked in transformers' modeling files; each is tested against its own forward)
PLAIN_HEAD_FAMILIES = frozenset(
    {
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "gemma",
        "gpt_oss",
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "qwen3_next",
        "bamba",
        "deepseek_v3",  # Kimi K2's checkpoints name this architecture too
    }
    | {"nemotron_h"}  # its forward casts the head's logits to fp32: the chunked loss is fp32 too
)
# ... and these when ``config.final_logit_softcapping`` is None (otherwise their forward soft-caps the logits)
SOFTCAP_HEAD_FAMILIES = frozenset({"gemma2", "gemma3_text"})

_MASK_FIELDS = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}
TOKENWISE_LAYER_TYPES = ("mlp", "moe")  # Nemotron-H's layers without a sequence mixer
ATTENTION_LAYER_TYPES = ("full_attention", *_MASK_FIELDS)
RUNNABLE_LAYER_TYPES = (*ATTENTION_LAYER_TYPES, *LINEAR_LAYER_TYPES, *TOKENWISE_LAYER_TYPES)


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (a multimodal model's text config; the config itself otherwise)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside activation-checkpointing and ``torch.compile`` wrappers."""
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None) or getattr(module, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def hf_model_of(module: nn.Module) -> Any:  # a transformers PreTrainedModel (its methods are untyped to mypy)
    """The ``PreTrainedModel`` of ``module``: itself, or the one a :class:`CausalLM` wraps."""
    from transformers import PreTrainedModel  # noqa: PLC0415 - optional dependency

    if isinstance(module, PreTrainedModel):
        return module
    inner = getattr(module, "hf_model", None)
    if isinstance(inner, PreTrainedModel):
        return inner
    raise ValueError(f"expected a transformers PreTrainedModel (or titan_cp's CausalLM of one), got {type(module)}")


def _is_decoder_layer(module: nn.Module, names: set[str]) -> bool:
    from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: PLC0415

    module = unwrap(module)
    return isinstance(module, GradientCheckpointingLayer) or type(module).__name__ in names


def layer_list(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of ``model``'s decoder layers (entries possibly wrapped)."""
    names = set(getattr(hf_model_of(model), "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(_is_decoder_layer(m, names) for m in module):
            return module
    raise ValueError(f"{type(model).__name__} has no list of decoder layers that titan_cp can find")


def mixer_modules(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """``(attention modules, linear-attention layers)`` of every decoder layer, by its ``config.layer_types``
    entry: an attention layer's modules with ``layer_idx`` and ``is_causal``; a ``linear_attention``
    layer's Gated DeltaNet or Mamba2 layer (any other is refused by name); nothing of an ``mlp`` / ``moe``
    layer. ``ValueError`` for a layer that lacks what its type needs."""
    c = text_config(hf_model_of(model).config)
    attention, linear = [], []
    for i, layer in enumerate(layer_list(model)):
        inner = unwrap(layer)
        kind = _layer_type(c, i)
        if kind in TOKENWISE_LAYER_TYPES:
            continue
        if kind in LINEAR_LAYER_TYPES:
            linear.append(_linear_of(inner, i))
            continue
        mine = [m for m in inner.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
        if not mine:
            raise ValueError(
                f"{type(inner).__name__} has no attention module that calls transformers' "
                "AttentionInterface (one with layer_idx and is_causal): titan_cp cannot run it"
            )
        attention += mine
    return attention, linear


def _linear_of(layer: nn.Module, index: int) -> nn.Module:
    """The linear-attention layer inside decoder layer ``layer`` (one titan_cp runs, or ``ValueError``)."""
    known = [m for m in layer.modules() if linear_mixer(m) is not None]
    if len(known) == 1:
        return known[0]
    candidates = [m for m in layer.modules() if hasattr(m, "layer_idx") and m is not layer]
    if candidates and not hasattr(candidates[0], "is_causal"):
        check_linear(candidates[0])  # names the class titan_cp does not run
    held = ", ".join(type(m).__name__ for m in candidates) or "no sequence mixer titan_cp can find"
    raise ValueError(
        f"layer {index}: layers of type 'linear_attention' (config.layer_types) must hold a linear-attention layer "
        f"titan_cp runs; {type(layer).__name__} holds {held}"
    )


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention module(s) of every decoder layer: those with ``layer_idx`` and ``is_causal``
    (:func:`mixer_modules`)."""
    return mixer_modules(model)[0]


def linear_modules(model: nn.Module) -> list[nn.Module]:
    """The linear-attention layer of every ``linear_attention`` decoder layer (:func:`mixer_modules`)."""
    return mixer_modules(model)[1]


def _layer_type(c, layer_idx: int) -> str:
    """``transformers``' name of layer ``layer_idx``'s attention: its ``config.layer_types`` entry, or
    for families without that list, ``sliding_attention`` when ``config.sliding_window`` is set."""
    types = getattr(c, "layer_types", None)
    if types:
        return types[layer_idx]
    return "sliding_attention" if getattr(c, "sliding_window", None) is not None else "full_attention"


def layer_mask(config: PretrainedConfig, layer_idx: int) -> tuple[int | None, int | None]:
    """``(window, chunk)`` of layer ``layer_idx``: ``config.sliding_window`` for a ``sliding_attention``
    layer (a query sees itself and the ``window - 1`` keys before it in its document, as
    ``transformers``' ``kv_idx > q_idx - sliding_window``), ``config.attention_chunk_size`` for a
    ``chunked_attention`` one (chunks counted from each document's start), ``(None, None)`` otherwise."""
    c = text_config(config)
    kind = _layer_type(c, layer_idx)
    field = _MASK_FIELDS.get(kind)
    value = None if field is None else getattr(c, field, None)
    return (value, None) if kind == "sliding_attention" else (None, value)


def _layer_type_features(c) -> list[str]:
    found = []
    kinds = sorted({_layer_type(c, i) for i in range(c.num_hidden_layers)})
    for kind in kinds:
        field = _MASK_FIELDS.get(kind)
        if kind not in RUNNABLE_LAYER_TYPES:
            found.append(f"layers of type {kind!r} (config.layer_types)")
        elif field is not None and not (isinstance(getattr(c, field, None), int) and getattr(c, field) > 0):
            found.append(f"layers of type {kind!r} without a positive config.{field} ({getattr(c, field, None)!r})")
    if not getattr(c, "layer_types", None) and getattr(c, "attention_chunk_size", None) is not None:
        found.append(
            f"chunked attention without config.layer_types naming its layers (config.attention_chunk_size = "
            f"{c.attention_chunk_size!r})"
        )
    return found


def unsupported_features(config: PretrainedConfig) -> list[str]:
    """What the model's layers use that titan_cp's CP attention does not run yet, one phrase each
    (naming the layer type and the config field); empty when every layer is causal attention, full,
    sliding-window or chunked (sinks too: they come with the call)."""
    c = text_config(config)
    found = _layer_type_features(c)
    if getattr(c, "attn_logit_softcapping", None) is not None:
        found.append(f"attention logit soft-capping (config.attn_logit_softcapping = {c.attn_logit_softcapping!r})")
    no_rope = [i for i, rope in enumerate(getattr(c, "no_rope_layers", None) or ()) if not rope]
    if getattr(c, "attn_temperature_tuning", False) and no_rope:
        found.append(
            f"query temperature tuning on the NoPE layers {no_rope} (config.attn_temperature_tuning with "
            "config.no_rope_layers): it scales queries by their index in the local row, not their position"
        )
    if getattr(c, "attention_dropout", 0.0):
        found.append(f"attention dropout (config.attention_dropout = {c.attention_dropout!r}; set it to 0.0)")
    if getattr(c, "is_encoder_decoder", False):
        found.append("an encoder-decoder architecture (config.is_encoder_decoder = True)")
    if not getattr(c, "is_causal", True) or getattr(c, "use_bidirectional_attention", False):
        found.append("bidirectional attention (config.is_causal / config.use_bidirectional_attention)")
    return found


def check_supported(model: nn.Module) -> None:
    """``ValueError`` when titan_cp cannot run ``model``'s attention exactly: a model that does not
    call ``AttentionInterface``, layers that use what :func:`unsupported_features` lists, or a
    linear-attention layer titan_cp does not run."""
    hf = hf_model_of(model)
    name, family = type(hf).__name__, getattr(hf.config, "model_type", "?")
    if getattr(hf, "_supports_attention_backend", False):
        mixer_modules(hf)
    else:
        try:
            attention = mixer_modules(hf)[0]
        except ValueError as e:
            if "linear-attention layer" in str(e):
                raise
            attention = []
        if not attention or not all(_calls_interface(m) for m in attention):
            raise ValueError(
                f"{name} (model_type {family!r}) does not call attention through transformers' AttentionInterface "
                "(its _supports_attention_backend is False, and its attention modules' forward does not look the "
                "function up there), so attn_implementation='titan_cp' cannot reach it; titan_cp supports decoders "
                "that do (Llama, Qwen2, Qwen3, Mistral, Gemma, Qwen3.5, Qwen3-Next, ...)"
            )
    features = unsupported_features(hf.config)
    if features:
        raise ValueError(
            f"{name} (model_type {family!r}) uses attention titan_cp's CP attention does not run yet: "
            + "; ".join(features)
            + ". Refused rather than run with the wrong mask"
        )


def _calls_interface(module: nn.Module) -> bool:
    """Whether ``module``'s class forward dispatches through ``transformers``' ``AttentionInterface``
    (its source looks the function up there): how a model whose class does not declare
    ``_supports_attention_backend`` (Qwen3.5, Qwen3-Next, Bamba, Nemotron-H) is recognised."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS.get_interface(" in source or "ALL_ATTENTION_FUNCTIONS[" in source


def plain_head(model: nn.Module) -> nn.Linear | None:
    """The output head when titan_cp's chunked loss may replace the family's logits (a bias-free
    ``nn.Linear`` of a family in :data:`PLAIN_HEAD_FAMILIES`, or of :data:`SOFTCAP_HEAD_FAMILIES`
    without final soft-capping); ``None`` otherwise."""
    hf = hf_model_of(model)
    head = hf.get_output_embeddings()
    c = text_config(hf.config)
    family = getattr(c, "model_type", None)
    plain = family in PLAIN_HEAD_FAMILIES or (
        family in SOFTCAP_HEAD_FAMILIES and getattr(c, "final_logit_softcapping", None) is None
    )
    if not plain or not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    return head
