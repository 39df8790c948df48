"""FSDP2, activation checkpointing, ``torch.compile`` and the chunked loss for Hugging Face causal LMs.

Applied from outside, as titan_cp's own ``apply_*`` functions are, after :func:`apply_cp`::

    apply_ac(model, "full") -> apply_compile(model) -> apply_fsdp(model, dp_shard x cp mesh)

``model`` is a ``transformers`` causal LM, or the :class:`CausalLM` that wraps one for titan_cp's
chunked loss. The decoder layers are found in their ``nn.ModuleList`` (:func:`.hf_model.layer_list`)
and replaced in place, so the state dict keeps ``transformers``' names.

FSDP: one unit per decoder layer, the input embedding on its own when it is not tied to the output
head, and the root (final norm, head, tied embedding). Gradients are summed over the mesh
(division factor 1): each rank's loss is already its share of the step's global mean (the
``num_items_in_batch`` of ``shard_batch``), so the summed gradient is one process's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan_cp.integrations.hf_model import hf_model_of, layer_list, plain_head, text_config
from titan_cp.loss import chunked_cross_entropy_sum, chunked_evaluate, token_loss_sum
from titan_cp.parallel.ac import apply_block_ac
from titan_cp.parallel.fsdp import offload_policy, set_gradient_sum
from titan_cp.parallel.tiled_mlp import tile_blocks


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

    def __init__(self, model: nn.Module):
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
    def config(self):
        return self.hf_model.config

    @property
    def head(self) -> nn.Linear | None:
        """The output head when the chunked loss replaces the logits (a plain head that is a child of the
        model beside its decoder), else ``None``: the model's own forward and logits."""
        return None if self.head_name is None else getattr(self, self.head_name)

    def forward(self, tokens: Tensor, positions=None, doc_lens=None, labels=None, predict: bool = False):
        kwargs = dict(input_ids=tokens, position_ids=positions, cp_doc_lens=doc_lens, use_cache=False)
        if self.head is None:  # the family's own head and logits
            logits = self.hf_model(**kwargs).logits
            if labels is None:
                return logits
            loss = token_loss_sum(logits, labels)
            return (loss.detach(), logits.argmax(-1)) if predict else loss
        h = getattr(self, self.decoder_name)(**kwargs).last_hidden_state
        if labels is None:
            return self.head(h)
        if predict:
            return chunked_evaluate(h, self.head.weight, labels)
        return chunked_cross_entropy_sum(h, self.head.weight, labels)


def apply_ac(
    model: nn.Module,
    mode: str = "full",
    every: int = 1,
    cpu_offload: bool = False,
    blocks_per_checkpoint: int = 1,
    prefetch: int = 1,
):
    """Activation checkpointing of the decoder layers, in place: ``"full"`` (every layer),
    ``"selective"`` (every ``every``-th layer fully), ``"op"`` (matmul and CP attention outputs
    saved, the rest recomputed), ``"none"``; ``cpu_offload``: the checkpointed inputs in host memory;
    ``blocks_per_checkpoint``: layers per checkpoint unit; as :mod:`titan_cp.parallel.ac`.
    Returns the host store of the inputs (``cpu_offload``), else None."""
    layers = layer_list(model)
    wrapped, store = apply_block_ac(list(layers), mode, every, cpu_offload, blocks_per_checkpoint, prefetch)
    for i, new in enumerate(wrapped):
        if new is not layers[i]:
            layers[i] = new
    if store is not None:
        model.activation_store = store  # the trainer's metrics read it (titan_cp.parallel.offload.offload_metrics)
    return store


def apply_tiled_mlp(model: nn.Module, tile_tokens: int) -> None:
    """Each decoder layer's MLP over tiles of ``tile_tokens`` local tokens, recomputed tile by tile in the
    backward (:mod:`titan_cp.parallel.tiled_mlp`); 0: off."""
    tile_blocks(list(layer_list(model)), tile_tokens)


def apply_compile(model: nn.Module, backend: str = "inductor", fullgraph: bool = True) -> None:
    """``torch.compile`` each decoder layer in place (one graph per layer: the CP attention is a
    custom op with fake implementations; the layers share compiled code)."""
    layers = layer_list(model)
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, backend=backend, fullgraph=fullgraph)


def apply_fsdp(
    model: nn.Module,
    mesh,
    mp_param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> None:
    """Shard ``model`` in place with FSDP2 over ``mesh`` (1-D: the flattened ``dp_shard x cp``
    ranks; 2-D ``(replicate, shard)``: HSDP), gradients summed (module docstring).

    mp_param_dtype: compute dtype (e.g. ``torch.bfloat16``), ``None`` keeps the parameters';
    reduce_dtype: gradient reduction dtype (fp32 by default); cpu_offload: shards, gradients and optimizer
    state in host memory (FSDP2's ``CPUOffloadPolicy``: materialise the model on the CPU, its buffers on
    the device).
    """
    hf = hf_model_of(model)
    config = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=mp_param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=offload_policy(cpu_offload, mesh),
    )
    for layer in layer_list(model):
        fully_shard(layer, **config, reshard_after_forward=reshard_after_forward)
    embed, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    if head is None or head.weight is not embed.weight:  # a tied embedding stays with the head, in the root
        fully_shard(embed, **config, reshard_after_forward=reshard_after_forward)
    fully_shard(model, **config, reshard_after_forward=reshard_after_forward)
    set_gradient_sum(model)
