"""titan_cp's linear-attention ops as torchtitan 0.3 Qwen3.5's Gated DeltaNet kernel and short convolutions.

torchtitan's ``GatedDeltaNet`` (75% of Qwen3.5's layers) projects the tokens, runs three depthwise causal
convolutions (``conv_q``, ``conv_k``, ``conv_v``: ``self._causal_conv(x, conv, cu_seqlens, cu_seqlens_cpu)``)
and the gated delta rule (``self.kernel``, a :class:`~torchtitan.models.qwen3_5.model.GatedDeltaKernel`:
``fla``'s chunked kernel), on the batch folded into one row::

    x (B, L, D) -> in_proj_q/k/v (folded (1, B*L, C)) -> _causal_conv -> heads
                -> kernel(q, k, v, g, beta, cu_seqlens=, cu_seqlens_cpu=) -> norm(out, z) -> out_proj

titan_cp keeps that forward, its projections, gates, norm and every parameter (the state dict is
torchtitan's: checkpoints are interchangeable), and replaces only those two seams, as
:class:`~.attention.TitanCPAttention` replaces ``inner_attention``:

- :class:`TitanCPGatedDeltaNet` (the layer's class, same ``__init__``) runs each convolution through
  titan_cp's :func:`~titan_cp.attention.linear.causal_conv1d` with the conv's own weight: each piece of a
  document reads the ``kernel - 1`` tokens before it from the rank that holds them;
- :class:`TitanCPGatedDeltaKernel` (same call signature as ``GatedDeltaKernel``) runs
  :func:`~titan_cp.attention.linear.gated_delta_rule` (``qk_l2norm``, ``d_k ** -0.5``, as ``fla``'s with
  ``use_qk_l2norm_in_kernel``): each piece from the state the pieces before it leave, on any rank.

Both run by the run's one :class:`~titan_cp.attention.handle.CPHandle` (bound by the CP step,
:meth:`TitanCPGatedDeltaNet.bind_cp`) and the batch's documents: the ``(B, max_docs)`` host tensor of
document lengths that :class:`~.trainer.TitanCPTrainer` gives every layer under ``attention_masks``
(:func:`model_inputs`: torchtitan's Qwen3.5 blocks read ``attention_masks["deltanet"]`` and
``["quadratic_attention"]``). torchtitan's forward reads its document metadata as ``VarlenMetadata`` and
hands its ``cu_seq_q`` to the convolutions and the kernel as ``cu_seqlens``; :class:`TitanCPGatedDeltaNet`
gives it the documents tensor there (:class:`_Documents`), so ``cu_seqlens`` is that tensor at both seams.
Each seam unfolds the row back into the batch's ``(B, L_local)`` rows, which titan_cp's layout shards.

``fla`` is not needed: torchtitan's module is imported through :func:`.without_fla.import_qwen35`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor, nn
from torchtitan.protocols.module import Module

from titan_cp.attention.handle import CPHandle
from titan_cp.attention.linear import causal_conv1d, check_conv, check_gated_delta, gated_delta_rule
from titan_cp.integrations.torchtitan.attention import TitanCPAttention, check_documents
from titan_cp.integrations.torchtitan.parallelize import BindsCP
from titan_cp.integrations.torchtitan.without_fla import QWEN35, import_qwen35

import_qwen35(QWEN35)  # before torchtitan's Qwen3.5 is imported below: it imports fla

from torchtitan.models.qwen3_5.model import GatedDeltaNet, Qwen35Attention  # noqa: E402

NO_VISION = {"image_id": -1, "video_id": -1}
"""``special_tokens`` of a text batch (torchtitan's Qwen3.5 reads them; with no images nothing matches)."""


@dataclass(frozen=True)
class _Documents:
    """The documents tensor where torchtitan's ``GatedDeltaNet.forward`` reads its ``VarlenMetadata``: it
    passes ``cu_seq_q`` (cloned) as ``cu_seqlens`` and ``cu_seq_q_host`` (made a tensor: empty here, titan_cp's
    ops read the documents tensor) as ``cu_seqlens_cpu``."""

    cu_seq_q: Tensor
    cu_seq_q_host: tuple[int, ...] = ()


def _rows(x: Tensor, batch: int) -> Tensor:
    """torchtitan's folded ``(1, B * L, ...)`` as the batch's ``(B, L, ...)`` rows (a view)."""
    return x.reshape(batch, x.shape[1] // batch, *x.shape[2:])


def _handle(module: Any) -> CPHandle:
    handle = module.cp_handle
    if handle is None:
        raise ValueError(
            f"{type(module).__name__} has no CP handle: build the run with titan_cp.integrations.torchtitan's "
            "TitanCPTrainer (with_titan_cp's config), whose CP step binds the one it builds"
        )
    return handle


class TitanCPGatedDeltaKernel(Module):
    """torchtitan's ``GatedDeltaKernel`` call run by titan_cp's gated delta rule (module docstring):
    ``forward(q, k, v, g, beta, *, cu_seqlens, cu_seqlens_cpu) -> out`` with q/k ``(1, B*L, Hk, Dk)``, v
    ``(1, B*L, Hv, Dv)``, g/beta ``(1, B*L, Hv)`` (``g`` the log decay), ``cu_seqlens`` the batch's
    ``(B, max_docs)`` documents tensor; returns ``(1, B*L, Hv, Dv)``. ``cp_handle``: the run's handle, bound
    by its layer."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """No settings: the kernel is the bound handle's."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.cp_handle: CPHandle | None = None

    def forward(
        self,
        xq_BLNK: Tensor,
        xk_BLNK: Tensor,
        xv_BLNV: Tensor,
        g_BLN: Tensor,
        beta_BLN: Tensor,
        *,
        cu_seqlens: Tensor | None = None,
        cu_seqlens_cpu: Tensor | None = None,
    ) -> Tensor:
        doc_lens = check_documents(cu_seqlens, type(self).__name__)
        q, k, v, g, beta = (_rows(x, doc_lens.shape[0]) for x in (xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN))
        check_gated_delta(q, k, v, g, beta)
        out = gated_delta_rule(q, k, v, g, beta, _handle(self).id, doc_lens, qk_l2norm=True)
        return out.reshape(xv_BLNV.shape)


class TitanCPGatedDeltaNet(GatedDeltaNet, BindsCP):
    """torchtitan's ``GatedDeltaNet`` (its ``__init__``, forward and parameters) with its short convolutions
    run by titan_cp's (module docstring); ``attention_masks`` is the batch's documents tensor. Its ``kernel``
    is a :class:`TitanCPGatedDeltaKernel` (:func:`use_titan_cp_linear` builds both)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GatedDeltaNet.Config):
        """torchtitan's ``GatedDeltaNet.Config``, with ``kernel`` a :class:`TitanCPGatedDeltaKernel.Config`."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if not isinstance(self.kernel, TitanCPGatedDeltaKernel):
            raise ValueError(f"TitanCPGatedDeltaNet runs TitanCPGatedDeltaKernel, not {type(self.kernel).__name__}")
        self.cp_handle: CPHandle | None = None

    def bind_cp(self, handle: CPHandle) -> None:
        """The run's handle, read by the convolutions and the kernel."""
        self.cp_handle = self.kernel.cp_handle = handle

    def forward(self, x_BLD: Tensor, attention_masks: Any = None) -> Tensor:
        doc_lens = check_documents(attention_masks, type(self).__name__)
        return super().forward(x_BLD, _Documents(doc_lens))

    def _causal_conv(
        self, x_BLD: Tensor, conv: nn.Conv1d, cu_seqlens: Tensor | None = None, cu_seqlens_cpu: Tensor | None = None
    ) -> Tensor:
        """``conv`` (depthwise, ``(C, 1, K)`` weight, no bias) then SiLU inside each document: ``x``
        ``(1, B*L, C)`` folded, ``cu_seqlens`` the documents tensor; returns ``(1, B*L, C)``."""
        doc_lens = check_documents(cu_seqlens, type(self).__name__)
        x, weight = _rows(x_BLD, doc_lens.shape[0]), conv.weight.squeeze(1)
        check_conv(x, weight, conv.bias, "silu")
        return causal_conv1d(x, weight, conv.bias, _handle(self).id, doc_lens, "silu").reshape(x_BLD.shape)


def use_titan_cp_linear(model_config: Any) -> None:
    """Every layer of torchtitan's Qwen3.5 ``model_config`` runs titan_cp: each attention layer's
    ``inner_attention`` becomes :class:`~.attention.TitanCPAttention`, each Gated DeltaNet a
    :class:`TitanCPGatedDeltaNet` of the same settings with a :class:`TitanCPGatedDeltaKernel`."""
    for i, layer in enumerate(model_config.layers):
        if layer.attention is not None:
            if not isinstance(layer.attention, Qwen35Attention.Config):
                raise ValueError(
                    f"with_titan_cp runs Qwen3.5's gated attention; layer {i} has {type(layer.attention).__qualname__}"
                )
            layer.attention.inner_attention = TitanCPAttention.Config()
        if layer.delta_net is not None:
            old = layer.delta_net
            settings = {f.name: getattr(old, f.name) for f in fields(GatedDeltaNet.Config)}
            kernel = TitanCPGatedDeltaKernel.Config(sharding_config=old.kernel.sharding_config)
            layer.delta_net = TitanCPGatedDeltaNet.Config(**{**settings, "kernel": kernel})


def model_inputs(doc_lens: Tensor | None) -> dict[str, Any]:
    """What torchtitan's Qwen3.5 forward takes of a text batch under titan_cp, besides tokens and positions:
    the documents tensor for both kinds of layer (``attention_masks``), and :data:`NO_VISION`."""
    return {"attention_masks": {"quadratic_attention": doc_lens, "deltanet": doc_lens}, "special_tokens": NO_VISION}
