"""The oracle: plain fp32 full-sequence attention with causal and document masks, written out."""

from __future__ import annotations

import torch


def doc_ids(seq_len: int, doc_lens_row) -> torch.Tensor:
    lens = doc_lens_row if doc_lens_row is not None else [seq_len]
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))


def dense_mask(seq_len: int, doc_lens, causal: bool, batch: int, window=None, chunk=None) -> torch.Tensor:
    """``(batch, 1, S, S)`` bool: True where query i may attend key j (same document, and with
    ``chunk`` the same ``chunk``-sized piece of it; causal; with ``window`` at most ``window - 1`` back)."""
    rows = doc_lens if doc_lens is not None else [None] * batch
    i = torch.arange(seq_len)
    masks = []
    for row in rows:
        d = doc_ids(seq_len, row)
        m = d[:, None] == d[None, :]
        if chunk is not None:
            lens = row if row is not None else [seq_len]
            starts = torch.repeat_interleave(
                torch.cumsum(torch.tensor(lens), 0) - torch.tensor(lens), torch.tensor(lens)
            )
            piece = (i - starts) // chunk
            m &= piece[:, None] == piece[None, :]
        if causal:
            m &= i[None, :] <= i[:, None]
        if window is not None:
            m &= i[None, :] > i[:, None] - window
        masks.append(m)
    return torch.stack(masks)[:, None]


def reference_attention(q, k, v, doc_lens=None, causal=True, scale=None, window=None, chunk=None, sinks=None):
    """fp64 attention over the full sequence, returned in fp32. q: (B, H, S, D); k, v: (B, Hkv, S, D);
    ``sinks`` (H,): a logit per head in every row's softmax denominator, with no value."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~dense_mask(q.shape[2], doc_lens, causal, q.shape[0], window, chunk), float("-inf"))
    if sinks is None:
        return (torch.softmax(s, dim=-1) @ v).float()
    b, h, n, _ = s.shape
    s = torch.cat([s, sinks.double().view(1, h, 1, 1).expand(b, h, n, 1)], dim=-1)
    return (torch.softmax(s, dim=-1)[..., :-1] @ v).float()
