"""titan_cp's attention as a torchtitan 0.3 layer's ``inner_attention``.

torchtitan's ``GQAttention`` (and Qwen3.5's gated ``Qwen35Attention``, after its q/k norms and partial RoPE;
gpt-oss's ``Attention``) calls its inner attention as::

    out_BLNH = inner_attention(q_BLNH, k_BLNH, v_BLNH, attention_masks=..., scale=..., enable_gqa=...
                               [, out_transform=self._apply_sinks])   # gpt-oss

with q ``(B, L, N, H)`` and k/v ``(B, L, K, H)`` after RoPE (``K`` KV heads, GQA not expanded).
:class:`TitanCPAttention` takes that call, hands its ``(B, N, L, H)`` transposes (views) to its
``core`` (:class:`DocumentAttention`: causal attention inside each document, titan_cp's local op)
and returns the output as ``(B, L, N, H)``. The softmax scale is the layer's (gpt-oss folds YaRN's
``mscale ** 2`` into it).

A layer's sliding window is its ``TitanCPAttention.Config(window=...)`` (gpt-oss's, :mod:`.gpt_oss`). A layer with
attention sinks passes ``out_transform`` (gpt-oss's ``_apply_sinks``: an inner attention's output rescaled by its
log-sum-exp, ``out * sigmoid(lse - sink_h) = out * e^lse / (e^lse + e^sink_h)``, the softmax with one more logit
``sink_h`` in every query's denominator); titan_cp runs that softmax in its op (``sinks``: differentiable, merged
across cp ranks with the rest) and returns what the transform would have returned, with the sinks the layer gives
its inner attention (:attr:`TitanCPAttention.sinks_of`, set by :class:`~.gpt_oss.TitanCPGptOssAttention`). A
transform from a layer that gave none is refused: titan_cp does not return the log-sum-exp.

Under context parallelism the CP step (:func:`~titan_cp.integrations.torchtitan.parallelize.apply_titan_cp`) applies
titan_cp's :class:`~titan_cp.parallel.ContextParallel` to each ``core``, so the same call runs any registered
strategy over the cp mesh; every layer reads the run's one CP handle (strategy, balance, kernel).

The documents reach every layer as ``attention_masks``: the ``(B, max_docs)`` host tensor of
document lengths that :class:`~titan_cp.integrations.torchtitan.trainer.TitanCPTrainer` made from
torchtitan's ``positions`` (it carries the layout the batch was sharded by). Anything else there
(torchtitan's own masks, ``None``) is refused: a batch that did not come through that trainer is
sharded by torchtitan's head-tail order, or not masked by document.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchtitan.protocols.module import Module

from titan_cp.attention.api import local_attention
from titan_cp.attention.handle import CPHandle


class DocumentAttention(Module):
    """Exact causal attention inside each packed document: ``forward(q, k, v, doc_lens, *, scale, sinks) -> out``
    with q ``(B, N, L, H)``, k/v ``(B, K, L, H)``, ``doc_lens`` the ``(B, max_docs)`` host tensor, ``scale`` the
    softmax scale (``None``: ``H ** -0.5``), ``sinks`` ``(N,)`` per-head logits in every softmax denominator or
    ``None``; returns ``(B, N, L, H)``. Its :attr:`window` (a causal sliding window, ``None``: none) is the
    layer's mask. The seam titan_cp's ``ContextParallel`` replaces under CP (the role of ``inner_attention`` in
    titan_cp's own Llama: it reads ``window`` and takes ``scale`` and ``sinks`` with each call).
    ``cp_handle`` is the run's one :class:`~titan_cp.attention.handle.CPHandle` once the CP step has bound it
    (its kernel runs here on one cp rank); ``None`` before (the default kernel for the device and dtype)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """The layer's mask; the kernel is the bound handle's."""

        window: int | None = None
        """Causal sliding window: a query sees the keys at most ``window - 1`` positions back in its document."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.window = config.window
        self.cp_handle: CPHandle | None = None

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, doc_lens: Tensor | None, *, scale: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        kernel = None if self.cp_handle is None else self.cp_handle.kernel
        return local_attention(
            q, k, v, doc_lens=doc_lens, causal=True, scale=scale, kernel=kernel, window=self.window, sinks=sinks
        )


class TitanCPAttention(Module):
    """A torchtitan inner attention that runs titan_cp's packed-document attention (module docstring).

    It holds no strategy, balance or kernel of its own: those are the run's ``titan_cp`` section, held by
    the one :class:`~titan_cp.attention.handle.CPHandle` that
    :class:`~titan_cp.integrations.torchtitan.trainer.TitanCPTrainer` builds and its CP step binds to every
    layer's ``core`` (:attr:`cp`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """The layer's mask (strategy, balance and kernel are the run's handle's)."""

        window: int | None = None
        """Causal sliding window (gpt-oss's ``sliding_window_size``): a query sees the keys at most
        ``window - 1`` positions back in its document; ``None``: none."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.core = DocumentAttention.Config(window=config.window).build()
        self.sinks_of: Callable[[], Tensor] | None = None
        """The layer's ``(N,)`` sink logits, read at each call, where the layer runs its sinks here (its
        ``out_transform``); set by that layer (:class:`~.gpt_oss.TitanCPGptOssAttention`)."""

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
        out_transform: Callable[[Tensor, Tensor], Tensor] | None = None,
        **kwargs: Any,
    ) -> Tensor:
        _check_call(attention_masks, kwargs)
        sinks = None if out_transform is None else self._sinks()
        q, k, v = q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2)
        out_BNLH = self.core(q, k, v, attention_masks, scale=scale, sinks=sinks)
        return out_BNLH.transpose(1, 2)

    def _sinks(self) -> Tensor:
        """The sinks the layer's ``out_transform`` stands for (its ``sinks_of``), or ``ValueError``."""
        if self.sinks_of is None:
            raise ValueError(
                "TitanCPAttention got an out_transform of the attention's log-sum-exp, which it does not return: it "
                "runs attention sinks inside its op, given by the layer (torchtitan's gpt-oss attention through "
                "with_titan_cp: TitanCPGptOssAttention)"
            )
        return self.sinks_of()

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


def _check_call(doc_lens, kwargs: dict) -> None:
    """What titan_cp's attention cannot run exactly is refused, naming it."""
    check_documents(doc_lens, "TitanCPAttention")
    unknown = sorted(k for k, v in kwargs.items() if v is not None)
    if unknown:
        raise ValueError(f"TitanCPAttention does not run the inner-attention argument(s) {unknown}")
