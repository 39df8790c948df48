"""The oracle: plain fp32 full-sequence attention with causal and document masks, written out."""

from __future__ import annotations

import torch


def doc_ids(seq_len: int, doc_lens_row) -> torch.Tensor:
    lens = doc_lens_row if doc_lens_row is not None else [seq_len]
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))


def dense_mask(seq_len: int, doc_lens, causal: bool, batch: int) -> torch.Tensor:
    """``(batch, 1, S, S)`` bool: True where query i may attend key j."""
    rows = doc_lens if doc_lens is not None else [None] * batch
    masks = []
    for row in rows:
        d = doc_ids(seq_len, row)
        m = d[:, None] == d[None, :]
        if causal:
            m &= torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        masks.append(m)
    return torch.stack(masks)[:, None]


def reference_attention(q, k, v, doc_lens=None, causal=True, scale=None):
    """fp32 attention over the full sequence. q: (B, H, S, D); k, v: (B, Hkv, S, D)."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~dense_mask(q.shape[2], doc_lens, causal, q.shape[0]), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).float()
