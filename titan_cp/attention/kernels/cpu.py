"""CPU kernels: ``cpu_flash`` (ATen's CPU flash kernel, one call per tile) and ``cpu_varlen``
(the CPU default: packed segments in one call per causal flag)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from titan_cp.attention.kernels.base import FLOATS, AttentionKernel, Segments, common_head_dim, head_slice, unit_stride

_ATEN = torch.ops.aten


class Bucket(NamedTuple):
    """Small segments of one padded shape, run as one batched masked attention by ``cpu_varlen``.

    ``m`` segments padded to ``nq`` queries and ``nk`` keys; ``q_idx (m*nq,)`` and ``k_idx (m*nk,)``
    are the packed rows gathered into the padded batch (padding repeats a segment's last row),
    ``visible (m, 1, nq, nk)`` what each padded row may see; ``q_sel``/``k_sel`` pick the real
    padded rows and ``q_rows``/``k_rows`` are their packed rows.
    """

    m: int
    nq: int
    nk: int
    q_idx: torch.Tensor
    k_idx: torch.Tensor
    visible: torch.Tensor
    q_sel: torch.Tensor
    q_rows: torch.Tensor
    k_sel: torch.Tensor
    k_rows: torch.Tensor


class CPUFlashKernel(AttentionKernel):
    """ATen's CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``); takes GQA as is. It needs
    equal q/k and v head dims: a value dim of its own runs padded (:func:`~.base.common_head_dim`)."""

    name = "cpu_flash"
    devices = ("cpu",)
    dtypes = FLOATS

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        v_dim = v.shape[-1]
        q, k, v = unit_stride(*common_head_dim(q, k, v))  # the kernel reads the head dimension as dense memory
        out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return head_slice(out, v_dim), lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        dout, q, k, v, out = unit_stride(*common_head_dim(dout, q, k, v, out))
        dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return head_slice(dq, qk_dim), head_slice(dk, qk_dim), head_slice(dv, v_dim)


class CPUVarlenKernel(CPUFlashKernel):
    """Packed variable-length attention on the CPU (the CPU default): one call per causal flag.

    Small segments (at most :attr:`SMALL` query-key pairs, the many short tiles of packed
    documents) are bucketed by their shape rounded up to powers of two; each bucket is one
    batched, masked fp32 attention (a gather, two matmuls, a softmax, a scatter), so the
    work issued grows with the number of buckets, not of segments. Larger segments, whose
    arithmetic outweighs a call, go one by one through ATen's CPU flash kernel. Padding
    rows are dropped and padding keys masked, so the result is exact.
    """

    name = "cpu_varlen"
    native_varlen = True
    SMALL = 32 * 32  # query-key pairs: segments up to this size are batched (above it a call pays for itself)
    CHUNK = 1 << 22  # score elements per batched matmul (bounds the memory of a bucket)

    def __init__(self) -> None:
        self._buckets: dict[tuple, tuple] = {}

    def _bucketing(self, seg: Segments, causal: bool) -> tuple:
        """``(big, buckets)`` for the segments, cached: big ``(a, b, c, d)`` query/key slices run one by
        one, and the :class:`Bucket` s of the small segments."""
        key = (seg.host_q, seg.host_k, causal)
        if key in self._buckets:
            return self._buckets[key]
        cq, ck = torch.tensor(seg.host_q), torch.tensor(seg.host_k)
        lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
        small = (lq * lk <= self.SMALL) & (lq > 0)
        big = [
            (seg.host_q[i], seg.host_q[i + 1], seg.host_k[i], seg.host_k[i + 1])
            for i in torch.nonzero(~small & (lq > 0)).flatten().tolist()
        ]
        pq = (2 ** torch.ceil(torch.log2(lq.clamp(min=1).double()))).long()
        pk = (2 ** torch.ceil(torch.log2(lk.clamp(min=1).double()))).long()
        buckets = []
        ids = torch.nonzero(small).flatten()
        shapes = pq[ids] * (1 << 20) + pk[ids]
        for shape in torch.unique(shapes).tolist():
            nq, nk = shape >> 20, shape & ((1 << 20) - 1)
            per = max(1, self.CHUNK // (nq * nk))
            aq, ak = torch.arange(nq), torch.arange(nk)
            tri = torch.ones(nq, nk, dtype=torch.bool).tril() if causal else None
            for chunk in ids[shapes == shape].split(per):
                q_valid = aq[None] < lq[chunk, None]
                k_valid = ak[None] < lk[chunk, None]
                q_idx = torch.minimum(cq[chunk, None] + aq[None], (cq[chunk + 1] - 1)[:, None])
                k_idx = torch.minimum(ck[chunk, None] + ak[None], (ck[chunk + 1] - 1)[:, None])
                visible = q_valid[:, :, None] & k_valid[:, None, :]  # padding rows and keys see nothing
                visible = (visible if tri is None else visible & tri).unsqueeze(1)
                q_sel, k_sel = torch.nonzero(q_valid.flatten()).flatten(), torch.nonzero(k_valid.flatten()).flatten()
                buckets.append(
                    Bucket(
                        m=len(chunk),
                        nq=nq,
                        nk=nk,
                        q_idx=q_idx.flatten(),
                        k_idx=k_idx.flatten(),
                        visible=visible,
                        q_sel=q_sel,
                        q_rows=q_idx.flatten()[q_sel],
                        k_sel=k_sel,
                        k_rows=k_idx.flatten()[k_sel],
                    )
                )
        if len(self._buckets) >= 256:
            self._buckets.pop(next(iter(self._buckets)))
        self._buckets[key] = (big, buckets)
        return big, buckets

    @staticmethod
    def _gather(x: Tensor, idx: Tensor, m: int, groups: int = 1) -> Tensor:
        """Packed ``(T, H, E)`` rows ``idx`` -> ``(m, H*groups, n, E)`` fp32 (K/V heads repeated for GQA)."""
        y = x.index_select(0, idx).float()
        y = y.view(m, -1, *y.shape[1:]).transpose(1, 2)
        return y.repeat_interleave(groups, dim=1) if groups > 1 else y

    @staticmethod
    def _scatter(dest: Tensor, rows: Tensor, sel: Tensor, y: Tensor) -> None:
        """``dest[rows] = y`` for the real rows ``sel`` of the padded ``(m, H, n, E)`` result."""
        y = y.transpose(1, 2).reshape(-1, *y.shape[1:2], y.shape[-1])
        dest.index_copy_(0, rows, y.index_select(0, sel).to(dest.dtype))

    def varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, seg: Segments, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        big, buckets = self._bucketing(seg, causal)
        groups = q.shape[1] // k.shape[1]
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        for bk in buckets:
            s = torch.matmul(self._gather(q, bk.q_idx, bk.m), self._gather(k, bk.k_idx, bk.m, groups).transpose(-1, -2))
            s = s.mul_(scale).masked_fill_(~bk.visible, float("-inf"))
            mx = torch.logsumexp(s, dim=-1)  # (m, H, nq); -inf on padding rows
            p = torch.exp_(s.sub_(torch.where(torch.isinf(mx), 0.0, mx).unsqueeze(-1)))
            self._scatter(out, bk.q_rows, bk.q_sel, torch.matmul(p, self._gather(v, bk.k_idx, bk.m, groups)))
            lse.index_copy_(1, bk.q_rows, mx.transpose(1, 2).reshape(-1, mx.shape[1]).index_select(0, bk.q_sel).t())
        for a, b, c, d in big:
            qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d]))
            o, mx = CPUFlashKernel.forward(self, qs, ks, vs, causal, scale)
            out[a:b] = o[0].transpose(0, 1)
            lse[:, a:b] = mx[0]
        return out, lse

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
    ) -> tuple[Tensor, Tensor, Tensor]:
        big, buckets = self._bucketing(seg, causal)
        h, kh = q.shape[1], k.shape[1]
        groups = h // kh
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        lse_t = lse.t()  # (T, H)
        for bk in buckets:
            m, nq, nk = bk.m, bk.nq, bk.nk
            qb, dob, ob = (self._gather(x, bk.q_idx, m) for x in (q, dout, out))
            kb, vb = self._gather(k, bk.k_idx, m, groups), self._gather(v, bk.k_idx, m, groups)
            mb = lse_t.index_select(0, bk.q_idx).float().view(m, nq, h).transpose(1, 2)  # (m, H, nq)
            s = torch.matmul(qb, kb.transpose(-1, -2)).mul_(scale)
            p = torch.exp_(s.sub_(mb.unsqueeze(-1))).masked_fill_(~bk.visible, 0.0)
            gv = torch.matmul(p.transpose(-1, -2), dob)
            ds = p.mul_(torch.matmul(dob, vb.transpose(-1, -2)).sub_((dob * ob).sum(-1, keepdim=True)))
            gq = torch.matmul(ds, kb).mul_(scale)
            gk = torch.matmul(ds.transpose(-1, -2), qb).mul_(scale)
            if groups > 1:  # dK/dV summed over each group of query heads
                gk = gk.view(m, kh, groups, nk, -1).sum(2)
                gv = gv.view(m, kh, groups, nk, -1).sum(2)
            self._scatter(dq, bk.q_rows, bk.q_sel, gq)
            self._scatter(dk, bk.k_rows, bk.k_sel, gk)
            self._scatter(dv, bk.k_rows, bk.k_sel, gv)
        for a, b, c, d in big:
            ts = [x.transpose(0, 1)[None] for x in (dout[a:b], q[a:b], k[c:d], v[c:d], out[a:b])]
            gq, gk, gv = CPUFlashKernel.backward(
                self, ts[0], ts[1], ts[2], ts[3], ts[4], lse[None, :, a:b], causal, scale
            )
            dq[a:b], dk[c:d], dv[c:d] = gq[0].transpose(0, 1), gk[0].transpose(0, 1), gv[0].transpose(0, 1)
        return dq, dk, dv
