"""titan_cp's attention as a torchtitan 0.3 layer's ``inner_attention``.

torchtitan's ``GQAttention`` (and Qwen3.5's gated ``Qwen35Attention``, after its q/k norms and partial RoPE)
calls its inner attention as::

    out_BLNH = inner_attention(q_BLNH, k_BLNH, v_BLNH, attention_masks=..., scale=..., enable_gqa=...)

with q ``(B, L, N, H)`` and k/v ``(B, L, K, H)`` after RoPE (``K`` KV heads, GQA not expanded).
:class:`TitanCPAttention` takes that call, hands its ``(B, N, L, H)`` transposes (views) to its
``core`` (:class:`DocumentAttention`: causal attention inside each document, titan_cp's local op)
and returns the output as ``(B, L, N, H)``. Under context parallelism the CP step
(:func:`~titan_cp.integrations.torchtitan.parallelize.apply_titan_cp`) applies titan_cp's
:class:`~titan_cp.parallel.ContextParallel` to each ``core``, so the same call runs any registered
strategy over the cp mesh; every layer reads the run's one CP handle (strategy, balance, kernel).

The documents reach every layer as ``attention_masks``: the ``(B, max_docs)`` host tensor of
document lengths that :class:`~titan_cp.integrations.torchtitan.trainer.TitanCPTrainer` made from
torchtitan's ``positions`` (it carries the layout the batch was sharded by). Anything else there
(torchtitan's own masks, ``None``) is refused: a batch that did not come through that trainer is
sharded by torchtitan's head-tail order, or not masked by document.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchtitan.protocols.module import Module

from titan_cp.attention.api import local_attention
from titan_cp.attention.handle import CPHandle


class DocumentAttention(Module):
    """Exact causal attention inside each packed document: ``forward(q, k, v, doc_lens) -> out`` with
    q ``(B, N, L, H)``, k/v ``(B, K, L, H)``, ``doc_lens`` the ``(B, max_docs)`` host tensor; returns
    ``(B, N, L, H)``. The seam titan_cp's ``ContextParallel`` replaces under CP (the role of
    ``inner_attention`` in titan_cp's own Llama). ``cp_handle`` is the run's one
    :class:`~titan_cp.attention.handle.CPHandle` once the CP step has bound it (its kernel runs here
    on one cp rank); ``None`` before (the default kernel for the device and dtype)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """No settings: the kernel is the bound handle's."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.cp_handle: CPHandle | None = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, doc_lens: Tensor | None) -> Tensor:
        kernel = None if self.cp_handle is None else self.cp_handle.kernel
        return local_attention(q, k, v, doc_lens=doc_lens, causal=True, kernel=kernel)


class TitanCPAttention(Module):
    """A torchtitan inner attention that runs titan_cp's packed-document attention (module docstring).

    It holds no strategy, balance or kernel of its own: those are the run's ``titan_cp`` section, held by
    the one :class:`~titan_cp.attention.handle.CPHandle` that
    :class:`~titan_cp.integrations.torchtitan.trainer.TitanCPTrainer` builds and its CP step binds to every
    layer's ``core`` (:attr:`cp`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """No settings: strategy, balance and kernel are the run's handle's."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.core = DocumentAttention.Config().build()

    @property
    def cp(self) -> CPHandle | None:
        """The handle this layer runs by (``None`` until the CP step binds it)."""
        handle = getattr(self.core, "cp_handle", None)
        return handle if isinstance(handle, CPHandle) else None

    def forward(
        self,
        q_BLNH: Tensor,
        k_BLNH: Tensor,
        v_BLNH: Tensor,
        *,
        attention_masks: Tensor | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs: Any,
    ) -> Tensor:
        _check_call(attention_masks, scale, q_BLNH.shape[-1], kwargs)
        out_BNLH = self.core(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2), attention_masks)
        return out_BNLH.transpose(1, 2)

    def __repr__(self) -> str:
        return f"TitanCPAttention({self.cp!r})"


def check_documents(doc_lens: Any, who: str) -> Tensor:
    """``doc_lens`` if it is the documents tensor (``(B, max_docs)`` int64 on the host) that titan_cp's Trainer
    gives every layer; else ``ValueError``: ``who`` was run outside titan_cp's Trainer."""
    if not isinstance(doc_lens, Tensor) or doc_lens.device.type != "cpu" or doc_lens.dtype != torch.int64:
        got = type(doc_lens).__name__ if not isinstance(doc_lens, Tensor) else f"a {doc_lens.dtype} tensor"
        raise ValueError(
            f"{who} got attention_masks = {got}, not the documents tensor that titan_cp's Trainer "
            "makes from the batch's positions: run the model with titan_cp.integrations.torchtitan's config "
            "(its Trainer shards each batch by titan_cp's layout), not torchtitan's own Trainer"
        )
    return doc_lens


def _check_call(doc_lens, scale: float | None, head_dim: int, kwargs: dict) -> None:
    """What titan_cp's attention cannot run exactly is refused, naming it."""
    check_documents(doc_lens, "TitanCPAttention")
    if scale is not None and not math.isclose(scale, head_dim**-0.5, rel_tol=1e-12):
        raise ValueError(
            f"TitanCPAttention runs softmax scale head_dim ** -0.5 = {head_dim**-0.5:g}, the model asks for {scale:g}"
        )
    unknown = sorted(k for k, v in kwargs.items() if v is not None)
    if unknown:
        raise ValueError(f"TitanCPAttention does not run the inner-attention argument(s) {unknown}")
