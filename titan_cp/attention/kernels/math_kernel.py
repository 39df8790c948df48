"""``math``: plain fp32 attention, written out (S x S scores); the reference the fast kernels are checked against."""

from __future__ import annotations

import torch

from titan_cp.attention.kernels.base import FLOATS, AttentionKernel


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
    """Plain fp32 attention, written out; any device, any float dtype, any head_dim."""

    name = "math"
    dtypes = FLOATS

    @staticmethod
    def _probs(q, k, causal, scale, lse=None):
        groups = q.shape[1] // k.shape[1]
        s = torch.matmul(q.float(), expand_kv(k, groups).float().transpose(-1, -2)) * scale
        if causal:
            sq, sk = s.shape[-2:]
            visible = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~visible, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)
        base = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        return torch.exp(s - base.unsqueeze(-1)), lse

    def forward(self, q, k, v, causal, scale):
        groups = q.shape[1] // k.shape[1]
        p, lse = self._probs(q, k, causal, scale)
        out = torch.matmul(p, expand_kv(v, groups).float())
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[1] // k.shape[1]
        p, _ = self._probs(q, k, causal, scale, lse.float())
        dout32 = dout.float()
        dv = torch.matmul(p.transpose(-1, -2), dout32)
        dp = torch.matmul(dout32, expand_kv(v, groups).float().transpose(-1, -2))
        delta = (dout32 * out.float()).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, expand_kv(k, groups).float()) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
        return dq.to(q.dtype), reduce_kv(dk, groups).to(k.dtype), reduce_kv(dv, groups).to(v.dtype)
