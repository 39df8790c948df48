"""The short causal depthwise convolution in front of linear-attention layers, over pieces with halos.

Per channel ``c`` with ``K`` taps (``w``: ``(channels, K)``, as ``nn.Conv1d(groups=channels)`` holds it
squeezed)::

    y_t = act(bias_c + sum_{j=0}^{K-1} w[c, K-1-j] x_{t-j})        x_{t-j} = 0 before the document's start

Each token's ``K`` inputs are read through the halo plan's ``taps`` (:class:`~.plan.HaloPlan`) from
``cat([local tokens, halo rows received, one zero row])``: one gather and one contraction, whatever the
pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS = (None, "silu", "swish")


def conv(x: Tensor, halo: Tensor, taps: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    """``x`` ``(tokens, channels)``, ``halo`` ``(rows, channels)`` -> ``(tokens, channels)`` (in ``x``'s
    dtype; accumulated in the weight's dtype or fp32, whichever is wider)."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    ext = torch.cat([x.to(acc), halo.to(acc), x.new_zeros(1, x.shape[1], dtype=acc)])
    gathered = ext.index_select(0, taps.reshape(-1)).view(*taps.shape, x.shape[1])  # (tokens, K, channels)
    y = torch.einsum("tkc,ck->tc", gathered, weight.to(acc).flip(-1))
    if bias is not None:
        y = y + bias.to(acc)
    if activation is not None:
        y = F.silu(y)
    return y.to(x.dtype)
