"""Generation with Hugging Face causal LMs (``model.name = "hf"``), through ``transformers``' own seam.

The model is built as the trainer builds it (``titan_cp.integrations.hf_folder``: on meta,
``apply_cp``, :class:`~titan_cp.integrations.hf_parallel.CausalLM`, shards allocated; no FSDP: the
weights stay whole on every cp rank), then its attention implementation is
``"titan_cp_generate"`` (:func:`generation_attention`, registered with ``AttentionInterface``):

- in the prefill it is the trainer's CP attention (``titan_cp_attention``: every strategy, the
  layer's window or chunks, sinks), and hands each layer's K/V (after RoPE) to the cache;
- in a decode step (one token per prompt) it stores the token's K/V on its owner rank and
  returns the attention over every rank's cache, merged by log-sum-exp (the generator's
  ``attend``), at the module's own ``scaling`` and with its sinks (``s_aux``).

``transformers`` computes everything else (embeddings, norms, RoPE from ``position_ids``, MLPs, the
final norm); the logits are the plain head's (families whose forward rescales or soft-caps
logits are refused by name). Tensor and pipeline parallelism are not built for these models.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from titan_cp.attention.strategy import DEFAULT_STRATEGY
from titan_cp.generate.runners import Attend, Capture
from titan_cp.integrations import hf_folder
from titan_cp.integrations.hf_model import attention_modules, hf_model_of, linear_modules, plain_head, text_config
from titan_cp.integrations.transformers import BINDING, titan_cp_attention, titan_cp_mask
from titan_cp.layout import DEFAULT_BALANCE
from titan_cp.mesh import ParallelDims
from titan_cp.parallel.build import ParallelizeOptions

GENERATE_ATTENTION = "titan_cp_generate"


@dataclass
class _Seam:
    """What :func:`generation_attention` does in the forward now running: capture K/V (prefill) or attend."""

    capture: Capture | None = None
    attend: Attend | None = None


_SEAM = _Seam()


@contextlib.contextmanager
def _seam(capture: Capture | None = None, attend: Attend | None = None):
    saved = (_SEAM.capture, _SEAM.attend)
    _SEAM.capture, _SEAM.attend = capture, attend
    try:
        yield
    finally:
        _SEAM.capture, _SEAM.attend = saved


def generation_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``transformers``' attention-function contract for generation (module docstring): query
    ``(B, H, S, E)``, key/value ``(B, K, S, E)`` after RoPE; returns ``(out (B, S, H, E), None)``."""
    layer = int(getattr(module, "layer_idx"))  # noqa: B009 - transformers' attention modules carry it
    if _SEAM.attend is not None:  # decode: one token per prompt
        if query.shape[2] != 1 or attention_mask is not None:
            raise ValueError(f"a decode step runs one token per prompt without a mask, got query {tuple(query.shape)}")
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        out = _SEAM.attend(layer, query[:, :, 0], key[:, :, 0], value[:, :, 0], scale, kwargs.get("s_aux"))
        return out.unsqueeze(1), None
    if _SEAM.capture is not None:
        _SEAM.capture(layer, key, value)
    return titan_cp_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


AttentionInterface.register(GENERATE_ATTENTION, generation_attention)
AttentionMaskInterface.register(GENERATE_ATTENTION, titan_cp_mask)


class HFRunner:
    """The runner (:mod:`.runners`) of a :class:`CausalLM` built by :func:`build_hf_model`."""

    def __init__(self, model: nn.Module) -> None:
        self.model, hf = model, hf_model_of(model)
        if hf.config._attn_implementation != GENERATE_ATTENTION:
            raise ValueError(
                f"{type(hf).__name__} runs attn_implementation={hf.config._attn_implementation!r}; build it with "
                "titan_cp.generate.hf_runner.build_hf_model"
            )
        head = plain_head(hf)
        if head is None:
            raise ValueError(
                f"{type(hf).__name__}: titan_cp.generate takes the logits from a plain output head (logits = "
                "lm_head(hidden)); this family's forward changes them (e.g. final logit soft-capping)"
            )
        self.head: nn.Linear = head
        self.decoder = hf.get_decoder()
        if linear_modules(hf):
            raise ValueError(
                f"{type(hf).__name__} has linear-attention layers (Gated DeltaNet / Mamba2): titan_cp.generate decodes "
                "from a sharded KV cache, which they do not have; they train and score under CP (apply_cp, the "
                "trainer), and generate with transformers' own generate() on a model loaded without apply_cp"
            )
        modules = attention_modules(hf)
        self.masks = [(getattr(m, BINDING).window, getattr(m, BINDING).chunk) for m in modules]
        assert [m.layer_idx for m in modules] == list(range(len(modules))), "layers out of order"
        self.max_seq_len = text_config(hf.config).max_position_embeddings
        self.vocab_size = self.head.out_features
        self.device = self.head.weight.device

    def hidden(self, tokens: Tensor, positions: Tensor, doc_lens: Tensor, capture: Capture | None = None) -> Tensor:
        """The decoder's last hidden states (after its final norm) ``(1, S_local, D)``."""
        with _seam(capture=capture):
            out = self.decoder(input_ids=tokens, position_ids=positions, cp_doc_lens=doc_lens, use_cache=False)
        return out.last_hidden_state

    def decode_hidden(self, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        with _seam(attend=attend):
            out = self.decoder(input_ids=tokens, position_ids=positions, use_cache=False)
        return out.last_hidden_state[:, 0]

    def logits(self, h: Tensor) -> Tensor:
        return self.head(h).float()


def build_hf_model(
    folder: str | Path,
    dims: ParallelDims | None = None,
    strategy: str = DEFAULT_STRATEGY,
    balance: str = DEFAULT_BALANCE,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """The causal LM of the Hugging Face folder ``folder`` (``model.hf_assets_path``) on ``device``,
    context-parallel over the cp mesh of ``dims`` (``None``: one device) as the trainer builds it
    (no FSDP, AC or compile), attention :data:`GENERATE_ATTENTION`; weights to be loaded."""
    if dims is None:
        dims = ParallelDims(1, 1, 1, 1, 1, 1)
    options = ParallelizeOptions(cp_strategy=strategy, cp_balance=balance)
    model, _ = hf_folder.build_parallel_hf_model(folder, dims, options, device, fsdp=False)
    hf_model_of(model).set_attn_implementation(GENERATE_ATTENTION)
    return model.eval().requires_grad_(False)
