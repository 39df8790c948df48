"""torchtitan 0.3's gpt-oss (``torchtitan.models.gpt_oss``) under titan_cp: sliding windows per layer and attention sinks.

gpt-oss's attention (``Attention``) alternates a 128-token causal sliding window (layers 0, 2, ...) with full causal
attention, and gives every query head a learned sink logit ``sink_h`` that joins each softmax denominator::

    o_qh = sum_k e^{s_qkh} v_kh / (e^{sink_h} + sum_k e^{s_qkh})
         = o'_qh * sigmoid(lse_qh - sink_h)          o'_qh, lse_qh: attention without the sink

torchtitan computes it as the second line: its inner attention returns the log-sum-exp to the layer's
``out_transform`` (``_apply_sinks``). titan_cp's op runs the first line itself (``sinks``: the sink's gradient
included, and the log-sum-exp merged across cp ranks before the sink joins it), so :func:`use_titan_cp_gpt_oss` keeps
torchtitan's layers, forward and parameter names and replaces:

- each layer's ``inner_attention`` is :class:`~.attention.TitanCPAttention` with the layer's window (``window =
  sliding_window_size``: a query sees itself and the ``window - 1`` keys before it in its document, as torchtitan's
  varlen ``window_size=(window - 1, 0)`` and its flex mask ``q - kv < window``);
- each attention is :class:`TitanCPGptOssAttention` (torchtitan's class, its ``__init__`` and forward), which gives
  its inner attention its sinks (``sinks_of``): the ``out_transform`` torchtitan's forward still passes is not
  called, titan_cp returns what it would have returned;
- each layer's experts are :class:`GptOssExpertsInTokensDtype`, which returns their output in the tokens' dtype
  (torchtitan's return bfloat16, which its combine cannot add into float32 tokens).

The softmax scale is the layer's: YaRN's ``mscale ** 2`` times ``head_dim ** -0.5``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor
from torchtitan.models.gpt_oss.model import Attention
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

from titan_cp.integrations.torchtitan.attention import TitanCPAttention


class TitanCPGptOssAttention(Attention):
    """torchtitan's gpt-oss ``Attention`` (its ``__init__``, forward and parameters) whose inner attention, a
    :class:`~.attention.TitanCPAttention`, runs its sinks (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Attention.Config):
        """torchtitan's ``Attention.Config``, with ``inner_attention`` a :class:`~.attention.TitanCPAttention.Config`."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if not isinstance(self.inner_attention, TitanCPAttention):
            raise ValueError(f"TitanCPGptOssAttention runs TitanCPAttention, not {type(self.inner_attention).__name__}")
        self.inner_attention.sinks_of = self.local_sinks

    def local_sinks(self) -> Tensor:
        """The ``(n_heads,)`` sink logits, this rank's heads under tensor parallel (as torchtitan's ``_apply_sinks``
        takes them)."""
        sinks = self.sinks
        if isinstance(sinks, DTensor):
            sinks = sinks.to_local(grad_placements=sinks.placements)
        return sinks


class GptOssExpertsInTokensDtype(GptOssGroupedExperts):
    """torchtitan's gpt-oss experts (its bfloat16 grouped matmuls, parameters and names) returning their output in the
    tokens' dtype, as torchtitan's other experts do (``GroupedExperts``: ``.type_as(x)``). torchtitan's return
    bfloat16, which its token combine cannot add into float32 tokens (``scatter(): Expected self.dtype to be equal to
    src.dtype``): with float32 parameters torchtitan's gpt-oss does not run. Under bfloat16 parameters the cast changes
    nothing."""

    @dataclass(kw_only=True, slots=True)
    class Config(GptOssGroupedExperts.Config):
        """torchtitan's ``GptOssGroupedExperts.Config``."""

    def forward(self, x_RD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
        return super().forward(x_RD, num_tokens_per_expert_E).type_as(x_RD)


def _as(config_cls: type, config: object, **changes: object) -> object:
    """``config`` (a dataclass) as an instance of its subclass ``config_cls``, its fields carried over."""
    return config_cls(**{**{f.name: getattr(config, f.name) for f in fields(config)}, **changes})  # type: ignore[arg-type]


def is_gpt_oss(model_config: Any) -> bool:
    """Whether torchtitan's model config has gpt-oss attention layers."""
    return any(isinstance(getattr(layer, "attention", None), Attention.Config) for layer in model_config.layers)


def use_titan_cp_gpt_oss(model_config: Any) -> None:
    """Every gpt-oss layer's attention :class:`TitanCPGptOssAttention` with :class:`~.attention.TitanCPAttention` of
    the layer's window (module docstring); its experts :class:`GptOssExpertsInTokensDtype`."""
    for layer in model_config.layers:
        attention = layer.attention
        inner = TitanCPAttention.Config(window=attention.sliding_window_size)
        layer.attention = _as(TitanCPGptOssAttention.Config, attention, inner_attention=inner)
        routed = layer.moe.routed_experts
        routed.inner_experts = _as(GptOssExpertsInTokensDtype.Config, routed.inner_experts)
