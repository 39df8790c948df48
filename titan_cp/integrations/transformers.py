"""Hugging Face decoders under context parallelism, through ``transformers``' public interfaces.

::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="titan_cp")
    cp = apply_cp(model, cp_mesh, strategy="ring", balance="doc_local")  # binds the mesh; checks the model
    apply_fsdp(model, fsdp_mesh)                                         # dp_shard x cp, gradients summed
    local = cp.shard(batch, dp_mesh=dp_mesh)   # this rank's tokens by the layout of the documents
    model(**local).loss.backward()     # local summed CE / loss-bearing tokens of the whole step

How it plugs in, without patching any model class:

- ``AttentionInterface.register("titan_cp", titan_cp_attention)``: every layer's attention calls
  :func:`titan_cp_attention` with q ``(B, H, S_local, E)`` and k/v ``(B, K, S_local, E)`` after
  RoPE (GQA at its own head count; v at a head dim of its own under multi-head latent attention,
  DeepSeek V3 and Kimi K2: q/k 192, v 128, unpadded); it runs the ``titan_cp::cp_attention`` custom op
  (every strategy, every kernel, packed documents) and returns ``(B, S_local, H, Ev)``.
- ``AttentionMaskInterface.register("titan_cp", titan_cp_mask)``: builds nothing (``None``): the
  documents reach the attention as the ``cp_doc_lens`` keyword, a ``(B, max_docs)`` host tensor that
  ``cp.shard(batch)`` (:func:`shard_batch`) makes and ``transformers`` hands unchanged to every layer.
- :func:`apply_cp` binds one handle (mesh, strategy, balance, kernel) to each attention module,
  replaces that model's own ``generate`` with a refusal and returns the handle, which shards each
  batch by the layout the attention then finds.

Importing this module registers those two names and changes nothing else in ``transformers``: only
the models :func:`apply_cp` binds are guarded. A model on another implementation (``sdpa``, ``eager``,
flash, flex) ignores ``cp_doc_lens`` and would run a shard as a short sequence of its own.

With the mask function registered, ``transformers`` still looks once per forward (not per layer)
at the local ``position_ids`` for packed rows (``find_packed_sequence_indices``, one small host
read); registering it is what turns a padding ``attention_mask`` into an error instead of a mask
that would be silently dropped.

RoPE needs nothing: each token's position arrives in ``position_ids`` (sharded with the tokens),
and ``transformers`` rotates q and k before calling the attention.

Each layer's mask comes from its config (:func:`.hf_model.layer_mask`): plain causal attention, a
sliding window (``sliding_attention`` layers: Mistral, Qwen2/3 with ``use_sliding_window``, Gemma 3,
gpt-oss) or chunked attention (``chunked_attention``: Llama 4), bound once by :func:`apply_cp`;
attention sinks (gpt-oss) arrive with each call (``s_aux``) and get their gradient. What titan_cp
does not run (logit soft-capping, other layer types, ...) is refused by :func:`apply_cp` naming the
layer type or the config field (:mod:`.hf_model`), never run with the wrong mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn, cast

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from titan_cp.attention.api import attend, check_mask, check_qkv
from titan_cp.attention.handle import CPHandle
from titan_cp.integrations.hf_batch import count_loss_tokens, gather_unshard, shard_batch
from titan_cp.integrations.hf_linear import bind_linear
from titan_cp.integrations.hf_logprobs import hf_token_logprobs
from titan_cp.integrations.hf_model import (
    attention_modules,
    check_supported,
    hf_model_of,
    layer_mask,
    linear_modules,
    text_config,
    unsupported_features,
)
from titan_cp.integrations.hf_parallel import CausalLM, hf_adapter
from titan_cp.integrations.hf_tiny import byte_tokenizer, tiny_qwen3_folder
from titan_cp.parallel import apply_ac, apply_compile, apply_cp, apply_fsdp, handle_of
from titan_cp.parallel.adapter import ParallelAdapter, register_adapter
from titan_cp.parallel.tiled_mlp import apply_tiled_mlp

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CPBinding",
    "CausalLM",
    "apply_ac",
    "apply_compile",
    "apply_cp",
    "apply_fsdp",
    "apply_tiled_mlp",
    "byte_tokenizer",
    "check_supported",
    "context_parallel_trainer",
    "count_loss_tokens",
    "handle_of",
    "shard_batch",
    "titan_cp_attention",
    "titan_cp_mask",
    "tiny_qwen3_folder",
    "gather_unshard",
    "hf_token_logprobs",
    "unsupported_features",
]

ATTN_IMPLEMENTATION = "titan_cp"
BINDING = "titan_cp_binding"  # the attribute apply_cp sets on each attention module


@dataclass(frozen=True)
class CPBinding:
    """What one attention module runs: the CP ``handle`` (mesh, strategy, balance, kernel) and its
    layer's mask (``window``, ``chunk``: ``None`` for plain causal attention)."""

    handle: CPHandle
    window: int | None = None
    chunk: int | None = None

    @property
    def cp_size(self) -> int:
        return self.handle.size


def _autocast_dtype(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Under autocast, q, k, v of mixed dtypes (e.g. fp32 q/k from Qwen3's q/k norms, bf16 v from its
    projection) run at the autocast dtype, as SDPA would run them; outside autocast they must agree."""
    kind = query.device.type
    if len({query.dtype, key.dtype, value.dtype}) == 1 or not torch.is_autocast_enabled(kind):
        return query, key, value
    dtype = torch.get_autocast_dtype(kind)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _check_layout_size(query: Tensor, binding: CPBinding, doc_lens: Tensor | None) -> None:
    """The batch's documents (``doc_lens``, summed over a row) must fill ``S_local x cp`` tokens of the
    mesh ``apply_cp`` bound: another sum means ``shard_batch`` ran over a mesh of another size (not
    checked inside ``torch.compile``'d layers, where reading the host tensor would break the graph)."""
    if doc_lens is None or torch.compiler.is_compiling():
        return
    total, local = int(doc_lens[0].sum()), query.shape[2]
    if total != local * binding.cp_size:
        raise ValueError(
            f"the batch's rows hold {total} tokens but this rank has {local} of them under the cp size "
            f"{binding.cp_size} that apply_cp bound: the batch was sharded for a cp size of {total / local:g}; "
            "shard it with the handle apply_cp returned (cp.shard(batch))"
        )


def _cp_attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    binding: CPBinding,
    doc_lens: Tensor | None,
    scale: float,
    sinks: Tensor | None,
) -> Tensor:
    """The one call of the CP attention op: causal inside each document of ``doc_lens``, with the
    layer's window or chunks, and ``sinks`` ``(H,)`` (per-head logits in every softmax denominator).
    q ``(B, H, S_local, E)``, k ``(B, K, S_local, E)``, v ``(B, K, S_local, Ev)`` -> ``(B, H, S_local, Ev)``
    (token-major storage)."""
    query, key, value = _autocast_dtype(query, key, value)
    check_qkv(query, key, value)
    mask = check_mask(True, binding.window, binding.chunk, sinks, query.shape[1])
    return attend(query, key, value, binding.handle.id, doc_lens, True, scale, mask.window, mask.chunk, sinks)


def _where(module: nn.Module) -> str:
    return f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"


def _binding(module: nn.Module) -> CPBinding:
    """What :func:`apply_cp` bound to ``module``; ``ValueError`` if it bound nothing."""
    binding = getattr(module, BINDING, None)
    if binding is None:
        raise ValueError(
            f"{_where(module)} runs attn_implementation='titan_cp' but no CP mesh is bound to it: call "
            "titan_cp.integrations.transformers.apply_cp(model, cp_mesh) first (cp_mesh=None on one device)"
        )
    return binding


def _check_call(
    module: nn.Module,
    binding: CPBinding,
    query: Tensor,
    key: Tensor,
    attention_mask: Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> None:
    where = _where(module)
    if attention_mask is not None:
        raise ValueError(
            f"{where} got an attention_mask: titan_cp attention reads the documents from shard_batch "
            "(cp_doc_lens), never a dense mask; drop attention_mask (pad with a document of its own instead)"
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{where}: titan_cp attention trains and scores whole rows, without a KV cache; to generate from a "
            "model that apply_cp bound, use titan_cp's generation (python -m titan_cp.generate, "
            "titan_cp.generate.hf_runner), not model.generate()"
        )
    if binding.cp_size > 1 and "cp_doc_lens" not in kwargs:  # None is given on purpose: one document a row
        raise ValueError(
            f"{where} runs under CP {binding.cp_size} but the batch did not come through the layout (no "
            "cp_doc_lens): shard each batch with the handle apply_cp returned (local = cp.shard(batch)) and "
            "call model(**local)"
        )
    if isinstance(getattr(module, "sinks", None), nn.Parameter) and kwargs.get("s_aux") is None:
        raise ValueError(f"{where} has attention sinks but did not pass them (s_aux): titan_cp cannot run it")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{where} asks for logit soft-capping (the softcap argument), which titan_cp does not run")
    window = kwargs.get("sliding_window")
    if window != binding.window:  # both ways: a window the config names must be one the layer asks for
        raise ValueError(
            f"{where} asks for sliding window {window} but apply_cp bound {binding.window} from the config "
            "(config.layer_types / config.sliding_window): refused rather than run with the wrong mask; call "
            "apply_cp again after changing the config"
        )
    if dropout and module.training:
        raise ValueError(f"{where}: attention dropout {dropout} is not supported; set config.attention_dropout = 0.0")


def titan_cp_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``transformers``' attention-function contract, run as titan_cp's CP attention.

    query ``(B, H, S_local, E)``, key ``(B, K, S_local, E)``, value ``(B, K, S_local, Ev)`` (``Ev``: its own
    head dim under multi-head latent attention): this rank's tokens in layout order, RoPE applied; ``scaling``
    the model's (DeepSeek's YaRN mscale in it), else ``1/sqrt(E)``. ``kwargs["cp_doc_lens"]``: the
    ``(B, max_docs)`` host tensor of :func:`shard_batch` (absent: every row is one document). Returns
    ``(out (B, S_local, H, Ev), None)`` (no attention weights are ever formed).
    """
    binding = _binding(module)
    _check_call(module, binding, query, key, attention_mask, dropout, kwargs)
    doc_lens = kwargs.get("cp_doc_lens")
    if doc_lens is not None and not isinstance(doc_lens, Tensor):
        raise ValueError("cp_doc_lens must be the (batch, max_docs) host tensor that cp.shard(batch) returns")
    _check_layout_size(query, binding, doc_lens)
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    out = _cp_attend(query, key, value, binding, doc_lens, scale, kwargs.get("s_aux"))
    return out.transpose(1, 2), None


def titan_cp_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> None:
    """``transformers``' mask-function contract: builds nothing (``None``). The causal and document
    masks are the CP op's own, computed on runs of the layout, never as a dense matrix."""
    if attention_mask is not None:
        raise ValueError(
            "attn_implementation='titan_cp' takes no attention_mask: the documents come from shard_batch "
            "(cp_doc_lens); drop attention_mask (make padding a document of its own, labels -100)"
        )
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, titan_cp_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, titan_cp_mask)


def bind_cp(model: nn.Module, handle: CPHandle) -> nn.Module:
    """Run ``model``'s attention as titan_cp's CP attention by ``handle``; returns ``model``. What
    :func:`titan_cp.parallel.apply_cp` (exported here as ``apply_cp``, which makes the handle) does for
    a Hugging Face model (loaded, or built on ``meta``; or a :class:`CausalLM`).

    Sets ``attn_implementation="titan_cp"`` (``set_attn_implementation``), binds the handle and the
    layer's mask to each attention module and sets this model's ``generate`` (an attribute of the
    instance, not of its class) to one that refuses, naming titan_cp's generation. ``ValueError`` for a
    model titan_cp cannot run exactly (it names the layer type and the config field), heads the
    strategy cannot split, or a mesh of the wrong shape.
    """
    hf = hf_model_of(model)
    check_supported(hf)
    c = text_config(hf.config)
    q_heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or q_heads
    if handle.mesh is not None:
        handle.strategy_impl.check_mesh(handle.mesh, handle.size, q_heads, kv_heads)
    modules = attention_modules(hf)
    for module in modules:
        if not module.is_causal:
            raise ValueError(
                f"{type(module).__name__} is not causal (is_causal = False): titan_cp runs causal decoders"
            )
    hf.set_attn_implementation(ATTN_IMPLEMENTATION)
    if hf.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"{type(hf).__name__} does not let transformers set its attention implementation")
    for module in modules:
        # transformers' attention modules hold their layer's index as an int (nn.Module's typing says Tensor | Module)
        window, chunk = layer_mask(hf.config, cast(int, module.layer_idx))
        setattr(module, BINDING, CPBinding(handle, window, chunk))
        module.cp_handle = handle  # type: ignore[assignment]  # found by handle_of; torch's stub: tensors/modules
    for module in linear_modules(hf):  # Gated DeltaNet, Mamba2: titan_cp's linear ops (hf_linear)
        bind_linear(module, handle)
        module.cp_handle = handle  # type: ignore[assignment]
    hf.generate = _refuse_generate
    return model


def _adapter(model: nn.Module) -> ParallelAdapter | None:
    return hf_adapter(model, bind_cp)


register_adapter(_adapter)


def _refuse_generate(*args: Any, **kwargs: Any) -> NoReturn:
    raise ValueError(
        "model.generate() after apply_cp: titan_cp attention trains and scores whole rows, without a KV cache; "
        "generate with titan_cp's generation (python -m titan_cp.generate, or titan_cp.generate.hf_runner), or with "
        "a copy of the model loaded with another attn_implementation"
    )


from titan_cp.integrations.trainer_factory import context_parallel_trainer  # noqa: E402 - it binds with apply_cp
