"""Hugging Face linear-attention layers under CP: Gated DeltaNet (Qwen3.5, Qwen3-Next) and Mamba2 mixers
(Bamba, Nemotron-H, Granite 4 hybrids), exact, packed, through titan_cp's linear ops.

These layers do not call ``transformers``' ``AttentionInterface``: their short convolution and their
recurrence are module-level functions of each modeling file. :func:`bind_linear` (called by ``apply_cp``
for every ``linear_attention`` layer) gives the one layer *instance* a forward of titan_cp's that runs
the layer's own submodules (projections, norms, output projection: every parameter where ``transformers``
keeps it, the state dict unchanged) around titan_cp's ops in place of those two functions::

    projections -> cp causal_conv1d (kernel - 1 tokens from the piece before)
                -> cp gated_delta_rule / cp ssd (each piece from the state the pieces before it leave)
                -> the layer's gated norm -> out_proj

No class is patched, at import or after: a model ``apply_cp`` did not bind keeps ``transformers``' own
forward. Each kind is recognised by its class name (the classes whose forward this module follows) and
checked for the attributes it reads; any other linear-attention layer (Kimi Linear's KDA, Falcon-H1's
multiplied Mamba2, ...) is refused by name.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_cp.attention.handle import CPHandle
from titan_cp.attention.linear import causal_conv1d, gated_delta_rule, ssd
from titan_cp.attention.linear.conv import ACTIVATIONS

LINEAR_LAYER_TYPES = ("linear_attention",)
"""``config.layer_types`` entries of linear-attention layers (``transformers``' name for them all)."""
BINDING = "titan_cp_linear_handle"  # the attribute bind_linear sets on each layer it binds


@dataclass(frozen=True)
class LinearMixer:
    """One kind of ``transformers`` linear-attention layer: the classes whose forward :attr:`forward`
    follows, the attributes it reads, and that forward (``forward(module, handle, doc_lens, hidden)``)."""

    kind: str
    classes: frozenset[str]
    reads: tuple[str, ...]
    forward: Callable[[nn.Module, CPHandle, Tensor | None, Tensor], Tensor]


def _conv(module: Any, handle: CPHandle, doc_lens: Tensor | None, x: Tensor) -> Tensor:
    conv = module.conv1d
    return causal_conv1d(x, conv.weight.squeeze(1), conv.bias, handle.id, doc_lens, module.activation)


# ---------------------------------------------------------------------------- Gated DeltaNet
def _qwen35_projections(m: Any, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Qwen3.5: ``(mixed q|k|v, z, b, a)`` from separate projections."""
    b, s, _ = h.shape
    return m.in_proj_qkv(h), m.in_proj_z(h).reshape(b, s, -1, m.head_v_dim), m.in_proj_b(h), m.in_proj_a(h)


def _qwen3_next_projections(m: Any, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Qwen3-Next: ``(mixed q|k|v, z, b, a)`` from the grouped projections, by the layer's own reordering."""
    b, s, _ = h.shape
    q, k, v, z, beta, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
    return torch.cat([x.reshape(b, s, -1) for x in (q, k, v)], -1), z, beta, a


def _gated_delta_net(project: Callable[[Any, Tensor], tuple[Tensor, Tensor, Tensor, Tensor]]):
    """The CP forward of a Gated DeltaNet layer whose projections ``project`` makes."""

    def forward(m: Any, handle: CPHandle, doc_lens: Tensor | None, h: Tensor) -> Tensor:
        b, s, _ = h.shape
        qkv, z, beta, a = project(m, h)
        qkv = _conv(m, handle, doc_lens, qkv)
        q, k, v = torch.split(qkv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q, k = q.reshape(b, s, -1, m.head_k_dim), k.reshape(b, s, -1, m.head_k_dim)
        v = v.reshape(b, s, -1, m.head_v_dim)
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        out = gated_delta_rule(q, k, v, g, beta.sigmoid(), handle.id, doc_lens, qk_l2norm=True)
        out = m.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
        return m.out_proj(out.reshape(b, s, -1))

    return forward


_GDN_READS = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "key_dim", "value_dim", "head_k_dim", "head_v_dim")


# ---------------------------------------------------------------------------- Mamba2
def _mamba2(m: Any, handle: CPHandle, doc_lens: Tensor | None, h: Tensor) -> Tensor:
    """The CP forward of a Mamba2 mixer (Bamba's, Nemotron-H's, Granite 4's: one forward in transformers)."""
    b, s, _ = h.shape
    heads, groups, state = m.num_heads, m.n_groups, m.ssm_state_size
    gate, xbc, dt = m.in_proj(h).split([m.intermediate_size, m.conv_dim, heads], dim=-1)
    xbc = _conv(m, handle, doc_lens, xbc)
    x, bm, cm = torch.split(xbc, [m.intermediate_size, groups * state, groups * state], dim=-1)
    x = x.reshape(b, s, heads, m.head_dim)
    dt = torch.clamp(F.softplus(dt + m.dt_bias.to(dt.dtype)), *m.time_step_limit)
    a = -torch.exp(m.A_log.float())
    y = ssd(
        x, dt, a, bm.reshape(b, s, groups, state), cm.reshape(b, s, groups, state), handle.id, doc_lens, m.chunk_size
    )
    y = y + m.D[:, None] * x.float()
    return m.out_proj(m.norm(y.reshape(b, s, -1), gate).to(h.dtype))


_MAMBA2_READS = (
    "in_proj", "conv1d", "A_log", "dt_bias", "D", "norm", "out_proj", "num_heads", "n_groups", "ssm_state_size",
    "head_dim", "intermediate_size", "conv_dim", "chunk_size", "time_step_limit",
)  # fmt: skip

MIXERS = (
    LinearMixer(
        "gated_delta_net",
        frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"}),
        ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", *_GDN_READS),
        _gated_delta_net(_qwen35_projections),
    ),
    LinearMixer(
        "gated_delta_net",
        frozenset({"Qwen3NextGatedDeltaNet"}),
        ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering", *_GDN_READS),
        _gated_delta_net(_qwen3_next_projections),
    ),
    LinearMixer(
        "mamba2",
        frozenset({"BambaMixer", "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "Mamba2Mixer"}),
        _MAMBA2_READS,
        _mamba2,
    ),
)
RUNNABLE = sorted(name for mixer in MIXERS for name in mixer.classes)


def linear_mixer(module: nn.Module) -> LinearMixer | None:
    """The :class:`LinearMixer` that runs ``module``, ``None`` when ``module`` is none titan_cp knows."""
    for mixer in MIXERS:
        if type(module).__name__ in mixer.classes and all(hasattr(module, a) for a in mixer.reads):
            return mixer
    return None


def check_linear(module: nn.Module) -> LinearMixer:
    """The mixer of ``module``, or ``ValueError`` naming the class and what titan_cp runs."""
    mixer = linear_mixer(module)
    if mixer is None:
        raise ValueError(
            f"{type(module).__name__} (a linear-attention layer) is not one titan_cp runs under CP: it runs "
            f"Gated DeltaNet and Mamba2 layers ({', '.join(RUNNABLE)}); refused rather than run with state "
            "leaking across documents or ranks"
        )
    activation = getattr(module, "activation", None)
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"{type(module).__name__}'s convolution activation {activation!r} is not one titan_cp runs ({ACTIVATIONS})"
        )
    return mixer


def _cp_forward(
    self: nn.Module, hidden_states: Tensor, cache: Any = None, attention_mask: Tensor | None = None, **kwargs: Any
) -> Tensor:
    """The bound layer's forward: ``transformers``' call signature, titan_cp's ops inside."""
    handle: CPHandle = getattr(self, BINDING)
    where = f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')})"
    if cache is not None or kwargs.get("cache_params") is not None:
        raise ValueError(
            f"{where}: a linear-attention layer under CP trains and scores whole rows, without a cache; to generate, "
            "use a copy of the model loaded without apply_cp"
        )
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            f"{where} got a padding attention_mask: titan_cp reads the documents from cp.shard(batch) (cp_doc_lens); "
            "make padding a document of its own (labels -100) instead"
        )
    doc_lens = kwargs.get("cp_doc_lens")
    if handle.size > 1 and "cp_doc_lens" not in kwargs:
        raise ValueError(
            f"{where} runs under CP {handle.size} but the batch did not come through the layout (no cp_doc_lens): "
            "shard each batch with the handle apply_cp returned (local = cp.shard(batch)) and call model(**local)"
        )
    return linear_mixer_of(self).forward(self, handle, doc_lens, hidden_states)


def linear_mixer_of(module: nn.Module) -> LinearMixer:
    mixer = linear_mixer(module)
    assert mixer is not None, "bind_linear binds only the layers linear_mixer knows"
    return mixer


def bind_linear(module: nn.Module, handle: CPHandle) -> None:
    """Run ``module`` (a linear-attention layer :func:`check_linear` accepts) under ``handle``: its instance's
    forward becomes titan_cp's (module docstring); binding again replaces the handle."""
    check_linear(module)
    setattr(module, BINDING, handle)
    module.forward = types.MethodType(_cp_forward, module)  # type: ignore[method-assign]
