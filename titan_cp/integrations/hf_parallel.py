"""Hugging Face causal LMs under titan_cp's ``apply_*`` functions: their adapter, and the chunked loss.

titan_cp's own ``apply_ac``, ``apply_compile`` and ``apply_fsdp`` (:mod:`titan_cp.parallel`) take a
``transformers`` causal LM, or the :class:`CausalLM` that wraps one for titan_cp's chunked loss,
through :func:`hf_adapter`: the decoder layers are found in their ``nn.ModuleList``
(:func:`.hf_model.layer_list`) and replaced in place, so the state dict keeps ``transformers``' names.

FSDP: one unit per decoder layer, the input embedding on its own when it is not tied to the output
head, and the root (final norm, head, tied embedding). Gradients are summed over the mesh
(division factor 1): each rank's loss is already its share of the step's global mean (the
``num_items_in_batch`` of ``shard_batch``), so the summed gradient is one process's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from titan_cp.integrations.hf_model import hf_model_of, layer_list, plain_head, text_config
from titan_cp.loss import chunked_cross_entropy_sum, chunked_evaluate, token_loss_sum
from titan_cp.parallel.adapter import ParallelAdapter


class CausalLM(nn.Module):
    """A ``transformers`` causal LM under titan_cp's model contract, with titan_cp's chunked loss.

    ``CausalLM(model)(tokens, positions, doc_lens, labels)``: tokens, positions (in-document RoPE
    positions), labels ``(B, S_local)`` with labels *already shifted* (next-token targets, -100 where
    no loss), doc_lens the ``(B, max_docs)`` host tensor of the layout (``shard_batch``'s
    ``cp_doc_lens``). Returns the summed token cross-entropy (fp32, 0-dim): from the decoder's
    last hidden states and the head's weight a chunk of tokens at a time
    (``titan_cp.loss.chunked_cross_entropy_sum``), so the ``(tokens x vocabulary)`` logits never
    exist, where the head is plain (:func:`.hf_model.plain_head`); from the model's own logits
    otherwise. Without labels: logits ``(B, S_local, V)``; with ``predict``: ``(CE sum, argmax
    predictions (B, S_local))``.

    The model's children become this module's children under the same names, so the state dict
    is the model's own (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``); the model
    itself is kept as ``hf_model``, not as a submodule.
    """

    hf_model: nn.Module  # set in __init__, outside the module registry

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        hf = hf_model_of(model)
        if getattr(text_config(hf.config), "output_router_logits", False):
            raise ValueError(
                f"{type(hf).__name__} has config.output_router_logits = True: its router's auxiliary loss is not "
                "part of CausalLM's loss; set it to False, or train with model(**local).loss"
            )
        if list(hf.parameters(recurse=False)) or list(hf.buffers(recurse=False)):
            raise ValueError(f"{type(hf).__name__} holds parameters of its own: CausalLM wraps its children only")
        for name, child in hf.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "hf_model", hf)  # not registered: its children are ours already
        decoder, head = hf.get_decoder(), plain_head(hf)
        self.decoder_name = next((n for n, c in hf.named_children() if c is decoder), None)
        found = head is not None and self.decoder_name is not None
        self.head_name = next((n for n, c in hf.named_children() if found and c is head), None)

    @property
    def config(self) -> Any:  # the wrapped model's PretrainedConfig
        return self.hf_model.config

    @property
    def head(self) -> nn.Linear | None:
        """The output head when the chunked loss replaces the logits (a plain head that is a child of the
        model beside its decoder), else ``None``: the model's own forward and logits."""
        return None if self.head_name is None else getattr(self, self.head_name)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        doc_lens: Tensor | None = None,
        labels: Tensor | None = None,
        predict: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        kwargs = dict(input_ids=tokens, position_ids=positions, cp_doc_lens=doc_lens, use_cache=False)
        if self.head is None:  # the family's own head and logits
            logits = self.hf_model(**kwargs).logits
            if labels is None:
                return logits
            loss = token_loss_sum(logits, labels)
            return (loss.detach(), logits.argmax(-1)) if predict else loss
        assert self.decoder_name is not None  # a plain head is found only beside a decoder (__init__)
        h = getattr(self, self.decoder_name)(**kwargs).last_hidden_state
        if labels is None:
            return self.head(h)
        if predict:
            return chunked_evaluate(h, self.head.weight, labels)
        return chunked_cross_entropy_sum(h, self.head.weight, labels)


def hf_adapter(model: nn.Module, attach_cp: Callable[..., Any]) -> ParallelAdapter | None:
    """The :class:`~titan_cp.parallel.adapter.ParallelAdapter` of a ``transformers`` causal LM or a
    :class:`CausalLM` (module docstring), ``None`` for any other model; ``attach_cp(model, mesh,
    strategy, balance, kernel)`` binds its attention modules."""
    try:
        hf = hf_model_of(model)
    except (ImportError, ValueError):
        return None
    embed, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight  # a tied embedding stays with the head, in the root
    return ParallelAdapter(
        model,
        layer_list(model),
        lambda handle: attach_cp(model, handle),
        family="hf",
        embedding=None if tied else embed,
    )
