"""The short causal depthwise convolution in front of linear-attention layers, over pieces with halos.

Per channel ``c`` with ``K`` taps (``w``: ``(channels, K)``, as ``nn.Conv1d(groups=channels)`` holds it
squeezed)::

    y_t = act(bias_c + sum_{j=0}^{K-1} w[c, K-1-j] x_{t-j})        x_{t-j} = 0 before the document's start

One depthwise convolution over the whole local buffer gives every token whose ``K`` inputs are the
tokens just before it in the buffer (all but the first ``K - 1`` of each piece); those *edge* tokens are
computed again from their own inputs, read through the halo plan's ``edge_taps``
(:class:`~.plan.HaloPlan`) from ``cat([local tokens, halo rows received, one zero row])``, and put in
place: a convolution's memory traffic, plus ``pieces x (K - 1)`` tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS = (None, "silu", "swish")


def conv(
    x: Tensor,
    halo: Tensor,
    edge: Tensor,
    edge_taps: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None,
) -> Tensor:
    """``x`` ``(tokens, channels)``, ``halo`` ``(rows, channels)`` -> ``(tokens, channels)`` in ``x``'s dtype,
    computed in the wider of ``x``'s and the weight's (as ``transformers``' own convolution, in the weight's)."""
    dtype = torch.promote_types(x.dtype, weight.dtype)
    tokens, channels = x.shape
    kernel = weight.shape[-1]
    xa, w = x.to(dtype), weight.to(dtype)
    y = F.conv1d(xa.t()[None], w[:, None, :], None, padding=kernel - 1, groups=channels)[0, :, :tokens].t()
    if edge.numel():  # the edges' taps: local tokens below ``tokens``, then the halo rows and one zero row
        local = edge_taps < tokens
        rest = torch.cat([halo.to(dtype), xa.new_zeros(1, channels)])
        gathered = torch.where(
            local[..., None],
            xa[edge_taps.clamp(max=tokens - 1)],
            rest[(edge_taps - tokens).clamp(min=0)],
        )  # (edges, K, channels)
        y = y.index_copy(0, edge, torch.einsum("tkc,ck->tc", gathered, w.flip(-1)))
    if bias is not None:
        y = y + bias.to(dtype)
    if activation is not None:
        y = F.silu(y)
    return y.to(x.dtype)
