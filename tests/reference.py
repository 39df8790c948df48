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


# ---------------------------------------------------------------------------- linear attention, token by token
def _documents(seq_len: int, doc_lens, batch: int):
    """``(row, start, end)`` of every document."""
    rows = doc_lens if doc_lens is not None else [[seq_len]] * batch
    for b, row in enumerate(rows):
        start = 0
        for n in row:
            yield b, start, start + n
            start += n


def reference_gated_delta(q, k, v, g, beta, doc_lens=None, scale=None, qk_l2norm=False):
    """The gated delta rule one token at a time, from a zero state at every document's start:
    ``S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, ``o_t = S_t^T (scale q_t)``.
    ``q, k`` ``(B, S, Hk, Dk)``, ``v`` ``(B, S, Hv, Dv)``, ``g, beta`` ``(B, S, Hv)``: ``(B, S, Hv, Dv)``."""
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    if qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    outs = [[None] * q.shape[1] for _ in range(q.shape[0])]
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    for b, start, end in _documents(q.shape[1], doc_lens, q.shape[0]):
        s = q.new_zeros(v.shape[2], q.shape[-1], v.shape[-1])
        for t in range(start, end):
            kt, bt = k[b, t], beta[b, t]
            decay = g[b, t].exp().view(-1, 1, 1) * (eye - bt.view(-1, 1, 1) * kt.unsqueeze(-1) * kt.unsqueeze(-2))
            s = decay @ s + bt.view(-1, 1, 1) * kt.unsqueeze(-1) * v[b, t].unsqueeze(-2)
            outs[b][t] = (s * q[b, t].unsqueeze(-1)).sum(-2)
    return torch.stack([torch.stack(row) for row in outs])


def reference_ssd(x, dt, a, bm, cm, doc_lens=None):
    """Mamba2's SSD one token at a time from a zero state at every document's start:
    ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t``. ``x`` ``(B, S, H, P)``, ``dt``
    ``(B, S, H)``, ``A`` ``(H,)``, ``B, C`` ``(B, S, G, N)``: ``(B, S, H, P)``."""
    rep = x.shape[2] // bm.shape[2]
    bm, cm = bm.repeat_interleave(rep, 2), cm.repeat_interleave(rep, 2)
    outs = [[None] * x.shape[1] for _ in range(x.shape[0])]
    for b, start, end in _documents(x.shape[1], doc_lens, x.shape[0]):
        s = x.new_zeros(x.shape[2], x.shape[3], bm.shape[-1])
        for t in range(start, end):
            s = (dt[b, t] * a).exp().view(-1, 1, 1) * s + (dt[b, t].view(-1, 1) * x[b, t]).unsqueeze(-1) * bm[
                b, t
            ].unsqueeze(-2)
            outs[b][t] = (s * cm[b, t].unsqueeze(-2)).sum(-1)
    return torch.stack([torch.stack(row) for row in outs])


def reference_conv(x, weight, bias=None, doc_lens=None, activation="silu"):
    """A depthwise causal convolution per document (``y_t = sum_j w[:, K-1-j] x_{t-j}`` over the document's
    own tokens), then SiLU. ``x`` ``(B, S, C)``, ``weight`` ``(C, K)``."""
    out = torch.zeros_like(x)
    kernel = weight.shape[1]
    for b, start, end in _documents(x.shape[1], doc_lens, x.shape[0]):
        for t in range(start, end):
            y = sum(weight[:, kernel - 1 - j] * x[b, t - j] for j in range(kernel) if t - j >= start)
            y = y + (0 if bias is None else bias)
            out[b, t] = torch.nn.functional.silu(y) if activation else y
    return out
