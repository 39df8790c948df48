"""What generation asks of a model (the runner contract, :class:`Runner`) and the runner of titan_cp's
Llama; Hugging Face models' runner is :mod:`.hf_runner`. Which runner a model gets is its family's
(:mod:`.registry`).

A *runner* wraps a model already made context-parallel as in training and answers::

    masks                    each layer's (window, chunk): what a decode query of that layer sees
    max_seq_len, vocab_size, device
    hidden(tokens, positions, doc_lens, capture)   the prefill: last hidden states (1, S_local, D) of
                             this rank's tokens, under CP attention; capture(layer, k, v) gets each
                             layer's K/V (1, K, S_local, E) after RoPE
    decode_hidden(tokens, positions, attend)       one token per prompt, (B, 1) each: the last hidden
                             states (B, D), each layer's attention being attend(layer, q (B, H, E),
                             k, v (B, K, E), scale, sinks) -> (B, H, E)
    logits(h)                (n, D) -> (n, V) fp32: what ``hidden`` left out of the forward

The Llama runner calls the model's own blocks in the prefill and in decode (there with each
attention core's forward answered by ``attend``), so tensor parallelism applies as in training.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol, cast

import torch
from torch import Tensor

from titan_cp.attention.strategy import DEFAULT_STRATEGY
from titan_cp.families.llama3.model import (
    MAX_POSITIONS,
    InnerAttention,
    ModelArgs,
    Transformer,
    TransformerBlock,
    rope_cos_sin,
    rope_frequencies,
)
from titan_cp.families.llama3.tp import apply_tp
from titan_cp.layout import DEFAULT_BALANCE
from titan_cp.mesh import ParallelDims
from titan_cp.parallel.build import cp_mesh
from titan_cp.parallel.cp import apply_cp

Capture = Callable[[int, Tensor, Tensor], None]
Attend = Callable[[int, Tensor, Tensor, Tensor, float, "Tensor | None"], Tensor]


class Runner(Protocol):
    """What generation asks of a model (module docstring)."""

    masks: list[tuple[int | None, int | None]]
    max_seq_len: int
    vocab_size: int
    device: torch.device

    def hidden(self, tokens: Tensor, positions: Tensor, doc_lens: Tensor, capture: Capture | None = None) -> Tensor: ...

    def decode_hidden(self, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor: ...

    def logits(self, h: Tensor) -> Tensor: ...


class LlamaRunner:
    """The runner of a :class:`~titan_cp.families.llama3.model.Transformer` (module docstring)."""

    def __init__(self, model: Transformer) -> None:
        self.model, args = model, model.args
        if model.tok_embeddings is None or model.norm is None or model.output is None:
            raise ValueError("generation runs a whole model: this one is a pipeline stage (no embedding or output)")
        self.embed, self.norm, self.output = model.tok_embeddings, model.norm, model.output
        self.max_seq_len, self.vocab_size = MAX_POSITIONS, args.vocab_size  # args.max_seq_len is informational
        self.device = self.norm.weight.device
        self.freqs = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling, self.device)
        self.blocks = [cast(TransformerBlock, layer) for layer in model.layers.values()]
        self.inner = [cast(InnerAttention, block.attention.inner_attention) for block in self.blocks]
        self.masks = [(m.window, m.chunk) for m in self.inner]

    def hidden(self, tokens: Tensor, positions: Tensor, doc_lens: Tensor, capture: Capture | None = None) -> Tensor:
        """The model's forward without the final norm and output, ``(1, S_local, D)``; ``capture`` gets
        each layer's K/V from a forward pre-hook on its attention core."""
        hooks = []
        if capture is not None:
            for i, inner in enumerate(self.inner):
                hooks.append(inner.register_forward_pre_hook(lambda m, args, i=i: capture(i, args[1], args[2])))
        try:
            cos, sin = rope_cos_sin(positions, self.freqs)
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(h, cos, sin, doc_lens)
            return h
        finally:
            for hook in hooks:
                hook.remove()

    def decode_hidden(self, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """The model's own blocks over one token per prompt, each attention core answered by
        ``attend`` for the time of the call (its forward replaced, as ContextParallel replaces it)."""
        cos, sin = rope_cos_sin(positions, self.freqs)
        saved = [inner.__dict__.get("forward") for inner in self.inner]
        for i, inner in enumerate(self.inner):
            inner.forward = functools.partial(_decode_core, attend, i, inner)  # type: ignore[method-assign]
        try:
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(h, cos, sin, None)
            return h[:, 0]
        finally:
            for inner, forward in zip(self.inner, saved):
                if forward is None:
                    del inner.forward
                else:
                    inner.forward = forward  # type: ignore[method-assign]

    def logits(self, h: Tensor) -> Tensor:
        return self.output(self.norm(h)).float()


def _decode_core(
    attend: Attend, layer: int, inner: InnerAttention, q: Tensor, k: Tensor, v: Tensor, doc_lens: Tensor | None
) -> Tensor:
    """An attention core's forward in decode: ``q (B, H, 1, E)``, ``k, v (B, K, 1, E)`` -> ``(B, H, 1, E)``."""
    out = attend(layer, q[:, :, 0], k[:, :, 0], v[:, :, 0], q.shape[-1] ** -0.5, inner.local_sinks())
    return out.unsqueeze(2)


def build_generation_model(
    args: ModelArgs,
    dims: ParallelDims | None = None,
    strategy: str = DEFAULT_STRATEGY,
    balance: str = DEFAULT_BALANCE,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> Transformer:
    """``args``' model on ``device``, parallelized for generation over the mesh of ``dims`` (a
    :class:`~titan_cp.mesh.ParallelDims` with its mesh built; ``None``: one device): heads split over
    tp (activations replicated: one decode token per prompt cannot be split over the sequence), the
    attention cores made context-parallel over cp with ``strategy`` and ``balance``; no FSDP (the
    weights stay whole on every cp rank). Built on meta, then each rank allocates its shards and
    initialises them (``seed``) for the checkpoint to overwrite."""
    with torch.device("meta"):
        model = Transformer(args)
    if dims is not None and dims.tp_enabled:
        apply_tp(model, dims.get_mesh("tp"), sequence_parallel=False)
    if dims is not None and dims.cp_enabled:
        apply_cp(model, cp_mesh(dims), strategy, balance)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model.eval().requires_grad_(False)
