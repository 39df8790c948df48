"""``math``: plain fp32 attention, written out (S x S scores); the reference the fast kernels are checked against."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from titan_cp.attention.kernels.base import FLOATS, AttentionKernel, Segments, empty_result


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(B, K, S, E)`` -> ``(B, K * groups, S, E)``: each K/V head repeated for its query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def reduce_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """Dual of :func:`expand_kv`: the gradients of a head's repeats summed."""
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // groups, groups, s, d).sum(2)


class MathKernel(AttentionKernel):
    """Plain fp32 attention, written out; any device, any float dtype, any head_dim (v's may differ)."""

    name = "math"
    dtypes = FLOATS
    native_window = True  # takes a window (bottom-right aligned): the reference for the flash kernels' own

    @staticmethod
    def _probs(
        q: Tensor, k: Tensor, causal: bool, scale: float, lse: Tensor | None = None, window: int | None = None
    ) -> tuple[Tensor, Tensor]:
        groups = q.shape[1] // k.shape[1]
        s = torch.matmul(q.float(), expand_kv(k, groups).float().transpose(-1, -2)) * scale
        if causal:
            sq, sk = s.shape[-2:]
            if window is None:
                visible = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
            else:  # bottom-right: query i sits at key i + sk - sq and sees its last ``window`` keys
                back = torch.arange(sq, device=s.device)[:, None] + (sk - sq) - torch.arange(sk, device=s.device)
                visible = (back >= 0) & (back < window)
            s = s.masked_fill(~visible, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)
        base = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        return torch.exp(s - base.unsqueeze(-1)), lse

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window: int | None = None
    ) -> tuple[Tensor, Tensor]:
        groups = q.shape[1] // k.shape[1]
        p, lse = self._probs(q, k, causal, scale, window=window)
        out = torch.matmul(p, expand_kv(v, groups).float())
        return out.to(q.dtype), lse

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
        window: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        groups = q.shape[1] // k.shape[1]
        p, _ = self._probs(q, k, causal, scale, lse.float(), window)
        dout32 = dout.float()
        dv = torch.matmul(p.transpose(-1, -2), dout32)
        dp = torch.matmul(dout32, expand_kv(v, groups).float().transpose(-1, -2))
        delta = (dout32 * out.float()).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, expand_kv(k, groups).float()) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
        return dq.to(q.dtype), reduce_kv(dk, groups).to(k.dtype), reduce_kv(dv, groups).to(v.dtype)

    def varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, seg: Segments, causal: bool, scale: float, window: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """The packed call; with ``window`` every segment bottom-right aligned and windowed."""
        if window is None:
            return super().varlen_forward(q, k, v, seg, causal, scale)
        outs, lses = [], []
        for (a, b), (c, d) in _spans(seg):
            qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d]))
            out, lse = self.forward(qs, ks, vs, causal, scale, window)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        if not outs:
            return empty_result(q, v)
        return torch.cat(outs), torch.cat(lses, dim=1)

    def varlen_backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        seg: Segments,
        causal: bool,
        scale: float,
        window: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if window is None:
            return super().varlen_backward(dout, q, k, v, out, lse, seg, causal, scale)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (a, b), (c, d) in _spans(seg):
            ts = [x.transpose(0, 1)[None] for x in (dout[a:b], q[a:b], k[c:d], v[c:d], out[a:b])]
            g = self.backward(ts[0], ts[1], ts[2], ts[3], ts[4], lse[None, :, a:b], causal, scale, window)
            dq[a:b] += g[0][0].transpose(0, 1)
            dk[c:d] += g[1][0].transpose(0, 1)
            dv[c:d] += g[2][0].transpose(0, 1)
        return dq, dk, dv


def _spans(seg: Segments) -> list[tuple[Sequence[int], Sequence[int]]]:
    """``((a, b), (c, d))`` query and key offsets of each segment with queries (host)."""
    pairs = zip(zip(seg.host_q, seg.host_q[1:]), zip(seg.host_k, seg.host_k[1:]))
    return [(qs, ks) for qs, ks in pairs if qs[0] < qs[1]]
