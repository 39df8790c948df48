"""Local attention kernels behind one interface.

Every kernel computes dense attention of one tile (see :mod:`titan_cp.attention.masks`)::

    forward(q, k, v, causal, scale)                    -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale)   -> (dq, dk, dv)

    q, out, dout: (batch, q_heads, sq, head_dim)        in the input dtype
    k, v:         (batch, kv_heads, sk, head_dim)       kv_heads divides q_heads (GQA)
    lse:          (batch, q_heads, sq)                  fp32, natural log
    dk, dv:       at kv_heads, like k and v
    causal:       top-left aligned; the tiles make every causal call square

and many tiles packed token-major into one variable-length call (:class:`Segments`)::

    varlen_forward(q, k, v, seg, causal, scale)                  -> (out, lse)
    varlen_backward(dout, q, k, v, out, lse, seg, causal, scale) -> (dq, dk, dv)

    q, out, dout: (total_q, q_heads, head_dim)      k, v, dk, dv: (total_k, kv_heads, head_dim)
    lse:          (q_heads, total_q) fp32

``backward`` receives the *final* ``out`` and ``lse`` of the whole attention, not the
tile's own: with ``P = exp(q k^T * scale - lse)`` and ``D = rowsum(dout * out)`` the tile's
gradients are then exact pieces of the full gradient (the flash-attention backward)::

    dv = P^T dout       dS = P * (dout v^T - D)       dq = dS k * scale       dk = dS^T q * scale

Backends:

=============  ============  ===============  ========================================
name           device        dtypes           head_dim
=============  ============  ===============  ========================================
``math``       any           any float        any (plain fp32 reference, S x S scores)
``cpu_flash``  cpu           fp32/fp64/bf16/  any (ATen's CPU flash kernel)
                             fp16
``cuda_flash`` cuda          fp16/bf16        multiple of 8, at most 256 (ATen's CUDA
                                              flash kernel, variable-length, GQA native)
``flash_attn`` cuda          fp16/bf16        multiple of 8, at most 256 (the flash-attn
                                              package, where installed)
=============  ============  ===============  ========================================

:func:`check_kernel` turns a kernel name (or ``None`` for the default) into a kernel and
raises ``ValueError`` for a combination it cannot run.
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

_ATEN = torch.ops.aten
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (torch.float16, torch.bfloat16)


def _offsets(lens: Sequence[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return out


@dataclass(frozen=True)
class Segments:
    """Segment i is q[cu_q[i]:cu_q[i+1]] against k[cu_k[i]:cu_k[i+1]] of token-major packed buffers."""

    cu_q: torch.Tensor  # (n+1,) int32 on the tensors' device
    cu_k: torch.Tensor  # (n+1,) int32
    max_q: int
    max_k: int
    host_q: tuple[int, ...]  # the same offsets on the host, for kernels that loop (never read a device tensor)
    host_k: tuple[int, ...]

    @classmethod
    def from_offsets(cls, host_q: Sequence[int], host_k: Sequence[int], device) -> Segments:
        """Segments from cumulative offsets held on the host (``[0, ..., total]``, ``n+1`` each).

        One host-to-device copy for both offset tensors. Every segment with queries must
        have keys (flash kernels give an empty key range an lse of ``+inf``).
        """
        host_q, host_k = tuple(int(x) for x in host_q), tuple(int(x) for x in host_k)
        assert len(host_q) == len(host_k) >= 1 and host_q[0] == host_k[0] == 0, (host_q, host_k)
        both = torch.tensor([host_q, host_k], dtype=torch.int32).to(device, non_blocking=True)
        widths = lambda c: max((b - a for a, b in zip(c, c[1:])), default=0)  # noqa: E731
        return cls(both[0], both[1], widths(host_q), widths(host_k), host_q, host_k)

    @classmethod
    def from_lengths(cls, q_lens: Sequence[int], k_lens: Sequence[int], device) -> Segments:
        """Segments from per-segment lengths (host integers)."""
        return cls.from_offsets(_offsets(q_lens), _offsets(k_lens), device)

    def __len__(self) -> int:
        return len(self.host_q) - 1


class AttentionKernel:
    """A local tile kernel; subclasses implement :meth:`forward` and :meth:`backward`.

    Kernels with ``native_varlen = True`` run all tiles of a mask plan in one
    :meth:`varlen_forward`/:meth:`varlen_backward` call; the default implementation here
    loops over the segments (on the host offsets) with :meth:`forward`/:meth:`backward`.

    ``devices`` (device types), ``dtypes``, ``max_head_dim`` and ``head_dim_multiple`` say
    what the kernel runs on; ``None`` means no restriction. :func:`check_kernel` reads them.
    """

    name = "base"
    native_varlen = False
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    max_head_dim: int | None = None
    head_dim_multiple: int = 1

    def forward(self, q, k, v, causal: bool, scale: float):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        raise NotImplementedError

    def varlen_forward(self, q, k, v, seg: Segments, causal: bool, scale: float):
        outs, lses = [], []
        for (a, b), (c, d) in zip(zip(seg.host_q, seg.host_q[1:]), zip(seg.host_k, seg.host_k[1:])):
            if a == b:
                continue
            assert d > c, f"segment with queries [{a}, {b}) has no keys"
            out, lse = self.forward(*(x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d])), causal, scale)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        if not outs:
            return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        return torch.cat(outs), torch.cat(lses, dim=1)

    def varlen_backward(self, dout, q, k, v, out, lse, seg: Segments, causal: bool, scale: float):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (a, b), (c, d) in zip(zip(seg.host_q, seg.host_q[1:]), zip(seg.host_k, seg.host_k[1:])):
            if a == b:
                continue
            tiles = (x.transpose(0, 1)[None] for x in (dout[a:b], q[a:b], k[c:d], v[c:d], out[a:b]))
            g = self.backward(*tiles, lse[None, :, a:b], causal, scale)
            dq[a:b] += g[0][0].transpose(0, 1)
            dk[c:d] += g[1][0].transpose(0, 1)
            dv[c:d] += g[2][0].transpose(0, 1)
        return dq, dk, dv

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // groups, groups, s, d).sum(2)


class MathKernel(AttentionKernel):
    """Plain fp32 attention, written out; the reference the fast kernels are checked against."""

    name = "math"
    dtypes = _FLOATS

    @staticmethod
    def _probs(q, k, causal, scale, lse=None):
        groups = q.shape[1] // k.shape[1]
        s = torch.matmul(q.float(), _expand_kv(k, groups).float().transpose(-1, -2)) * scale
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
        out = torch.matmul(p, _expand_kv(v, groups).float())
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[1] // k.shape[1]
        p, _ = self._probs(q, k, causal, scale, lse.float())
        dout32 = dout.float()
        dv = torch.matmul(p.transpose(-1, -2), dout32)
        dp = torch.matmul(dout32, _expand_kv(v, groups).float().transpose(-1, -2))
        delta = (dout32 * out.float()).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, _expand_kv(k, groups).float()) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
        return dq.to(q.dtype), _reduce_kv(dk, groups).to(k.dtype), _reduce_kv(dv, groups).to(v.dtype)


class CPUFlashKernel(AttentionKernel):
    """ATen's CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``); takes GQA as is."""

    name = "cpu_flash"
    devices = ("cpu",)
    dtypes = _FLOATS

    def forward(self, q, k, v, causal, scale):
        return _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        return _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )


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

    def __init__(self):
        self._plans: dict[tuple, tuple] = {}

    def _plan(self, seg: Segments, causal: bool) -> tuple:
        """``(big, buckets)`` for the segments, cached. big: ``(a, b, c, d)`` slices. A bucket:
        ``(m, nq, nk, q_idx (m*nq,), k_idx (m*nk,), visible (m, 1, nq, nk), q_sel, q_rows, k_sel, k_rows)``:
        the padded rows gathered, what each row may see, and which padded rows are real (``*_sel``)
        with their packed rows (``*_rows``)."""
        key = (seg.host_q, seg.host_k, causal)
        if key in self._plans:
            return self._plans[key]
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
                visible = (visible & tri if causal else visible).unsqueeze(1)
                q_sel, k_sel = torch.nonzero(q_valid.flatten()).flatten(), torch.nonzero(k_valid.flatten()).flatten()
                buckets.append(
                    (
                        len(chunk),
                        nq,
                        nk,
                        q_idx.flatten(),
                        k_idx.flatten(),
                        visible,
                        q_sel,
                        q_idx.flatten()[q_sel],
                        k_sel,
                        k_idx.flatten()[k_sel],
                    )
                )
        if len(self._plans) >= 256:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = (big, buckets)
        return big, buckets

    @staticmethod
    def _gather(x, idx, m: int, groups: int = 1):
        """Packed ``(T, H, E)`` rows ``idx`` -> ``(m, H*groups, n, E)`` fp32 (K/V heads repeated for GQA)."""
        y = x.index_select(0, idx).float()
        y = y.view(m, -1, *y.shape[1:]).transpose(1, 2)
        return y.repeat_interleave(groups, dim=1) if groups > 1 else y

    @staticmethod
    def _scatter(dest, rows, sel, y):
        """``dest[rows] = y`` for the real rows ``sel`` of the padded ``(m, H, n, E)`` result."""
        y = y.transpose(1, 2).reshape(-1, *y.shape[1:2], y.shape[-1])
        dest.index_copy_(0, rows, y.index_select(0, sel).to(dest.dtype))

    def varlen_forward(self, q, k, v, seg: Segments, causal: bool, scale: float):
        big, buckets = self._plan(seg, causal)
        groups = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        for m, _nq, _nk, q_idx, k_idx, visible, q_sel, q_rows, _k_sel, _k_rows in buckets:
            s = torch.matmul(self._gather(q, q_idx, m), self._gather(k, k_idx, m, groups).transpose(-1, -2))
            s = s.mul_(scale).masked_fill_(~visible, float("-inf"))
            mx = torch.logsumexp(s, dim=-1)  # (m, H, nq); -inf on padding rows
            p = torch.exp_(s.sub_(torch.where(torch.isinf(mx), 0.0, mx).unsqueeze(-1)))
            self._scatter(out, q_rows, q_sel, torch.matmul(p, self._gather(v, k_idx, m, groups)))
            lse.index_copy_(1, q_rows, mx.transpose(1, 2).reshape(-1, mx.shape[1]).index_select(0, q_sel).t())
        for a, b, c, d in big:
            o, mx = CPUFlashKernel.forward(
                self, *(x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d])), causal, scale
            )
            out[a:b] = o[0].transpose(0, 1)
            lse[:, a:b] = mx[0]
        return out, lse

    def varlen_backward(self, dout, q, k, v, out, lse, seg: Segments, causal: bool, scale: float):
        big, buckets = self._plan(seg, causal)
        h, kh = q.shape[1], k.shape[1]
        groups = h // kh
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        lse_t = lse.t()  # (T, H)
        for m, nq, nk, q_idx, k_idx, visible, q_sel, q_rows, k_sel, k_rows in buckets:
            qb, dob, ob = (self._gather(x, q_idx, m) for x in (q, dout, out))
            kb, vb = self._gather(k, k_idx, m, groups), self._gather(v, k_idx, m, groups)
            mb = lse_t.index_select(0, q_idx).float().view(m, nq, h).transpose(1, 2)  # (m, H, nq)
            s = torch.matmul(qb, kb.transpose(-1, -2)).mul_(scale)
            p = torch.exp_(s.sub_(mb.unsqueeze(-1))).masked_fill_(~visible, 0.0)
            gv = torch.matmul(p.transpose(-1, -2), dob)
            ds = p.mul_(torch.matmul(dob, vb.transpose(-1, -2)).sub_((dob * ob).sum(-1, keepdim=True)))
            gq = torch.matmul(ds, kb).mul_(scale)
            gk = torch.matmul(ds.transpose(-1, -2), qb).mul_(scale)
            if groups > 1:  # dK/dV summed over each group of query heads
                gk = gk.view(m, kh, groups, nk, -1).sum(2)
                gv = gv.view(m, kh, groups, nk, -1).sum(2)
            self._scatter(dq, q_rows, q_sel, gq)
            self._scatter(dk, k_rows, k_sel, gk)
            self._scatter(dv, k_rows, k_sel, gv)
        for a, b, c, d in big:
            seg_in = (x.transpose(0, 1)[None] for x in (dout[a:b], q[a:b], k[c:d], v[c:d], out[a:b]))
            gq, gk, gv = CPUFlashKernel.backward(self, *seg_in, lse[None, :, a:b], causal, scale)
            dq[a:b], dk[c:d], dv[c:d] = gq[0].transpose(0, 1), gk[0].transpose(0, 1), gv[0].transpose(0, 1)
        return dq, dk, dv


class CUDAFlashKernel(AttentionKernel):
    """ATen's CUDA flash attention, ``aten._flash_attention_forward/_backward`` (fp16/bf16).

    No package beyond PyTorch. K/V stay at their own head count (the kernel takes GQA
    natively and returns dK/dV summed over each group). Both forms go through the same two
    ops; only positional arguments and ``scale`` are passed, common to every release since
    torch 2.7 (which renamed ``philox_seed, philox_offset`` to ``rng_state, unused``, same
    positions; later releases added keyword-only arguments such as ``block_table``)::

        _flash_attention_forward(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                 is_causal, return_debug_mask, *, scale)
            -> (out, lse, rng_state, unused, debug_attn_mask)
        _flash_attention_backward(dout, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k,
                                  dropout_p, is_causal, rng_state, unused, *, scale) -> (dq, dk, dv)

        dense   cum_seq = None      q (B, S, H, D), lse (B, H, S)
        varlen  cum_seq int32 (n+1) q (total_q, H, D), lse (H, total_q)

    The backward takes the variable-length route exactly when ``cum_seq_q`` is a defined
    tensor, so the dense backward passes ``None``. With ``dropout_p = 0`` the kernel never
    reads ``rng_state``; an empty placeholder is passed. The kernel aligns a causal mask
    bottom-right; the tiles make every causal call square, where that is top-left too.
    """

    name = "cuda_flash"
    native_varlen = True
    devices = ("cuda",)
    dtypes = _HALF
    max_head_dim = 256
    head_dim_multiple = 8

    def __init__(self):
        self._rng: dict[torch.device, torch.Tensor] = {}

    def _rng_state(self, device: torch.device) -> torch.Tensor:
        """A placeholder for the philox state, which the kernel reads only when dropout_p > 0."""
        if device not in self._rng:
            self._rng[device] = torch.zeros(2, dtype=torch.int64, device=device)
        return self._rng[device]

    def forward(self, q, k, v, causal, scale):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, S, H, D) views
        res = _ATEN._flash_attention_forward(
            qt, kt, vt, None, None, qt.shape[1], kt.shape[1], 0.0, causal, False, scale=scale
        )
        return res[0].transpose(1, 2), res[1]

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        qt, kt, vt, ot, dot = (x.transpose(1, 2) for x in (q, k, v, out, dout))
        rng = self._rng_state(q.device)
        dq, dk, dv = _ATEN._flash_attention_backward(
            dot,
            qt,
            kt,
            vt,
            ot,
            lse.contiguous(),
            None,
            None,
            qt.shape[1],
            kt.shape[1],
            0.0,
            causal,
            rng,
            rng,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def varlen_forward(self, q, k, v, seg: Segments, causal, scale):
        if len(seg) == 0:
            return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        res = _ATEN._flash_attention_forward(
            q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, causal, False, scale=scale
        )
        out, lse = res[0], res[1]
        if tuple(lse.shape) != (q.shape[1], q.shape[0]):
            raise RuntimeError(
                f"torch {torch.__version__}: aten._flash_attention_forward returned a log-sum-exp of shape "
                f"{tuple(lse.shape)} for {len(seg)} segments, expected (q_heads, total_q) = "
                f"{(q.shape[1], q.shape[0])}; choose another kernel (kernel='flash_attn' or 'math')"
            )
        return out, lse

    def varlen_backward(self, dout, q, k, v, out, lse, seg: Segments, causal, scale):
        if len(seg) == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        rng = self._rng_state(q.device)
        return _ATEN._flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse.contiguous(),
            seg.cu_q,
            seg.cu_k,
            seg.max_q,
            seg.max_k,
            0.0,
            causal,
            rng,
            rng,
            scale=scale,
        )


def _first_lse(res, shape: tuple[int, ...]) -> torch.Tensor:
    """The log-sum-exp among a flash-attn forward's results: its one fp32 tensor of ``shape``.

    flash-attn's private forwards return different tuples across releases::

        up to 2.6:   (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
        2.7 on:      (out, softmax_lse, S_dmask, rng_state)

    ``out`` comes first in both; the inputs, ``out_padded`` and ``S_dmask`` are fp16/bf16
    (flash-attn takes no fp32) and ``rng_state`` is int64, so the lse is the one fp32 tensor.
    Its shape is checked too: releases that return a padded ``(n, heads, max_q)`` varlen lse
    are not supported.
    """
    for t in res[1:]:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
            if tuple(t.shape) != shape:
                raise RuntimeError(
                    f"flash-attn {_flash_attn_version()} returned a log-sum-exp of shape {tuple(t.shape)}, "
                    f"expected {shape}; this flash-attn release is not supported (use kernel='cuda_flash')"
                )
            return t
    raise RuntimeError(
        f"flash-attn {_flash_attn_version()}: no fp32 log-sum-exp among the forward's results "
        f"{[type(t).__name__ if not isinstance(t, torch.Tensor) else (tuple(t.shape), t.dtype) for t in res]}; "
        "use kernel='cuda_flash'"
    )


def _flash_attn_version() -> str:
    try:
        import flash_attn  # noqa: PLC0415 - optional dependency

        return str(getattr(flash_attn, "__version__", "unknown"))
    except ImportError:
        return "(not importable)"


class FlashAttnKernel(AttentionKernel):
    """The flash-attn package (fp16/bf16 on CUDA); takes GQA natively, tensors as ``(batch, seq, heads, dim)``.

    Robust to the version installed: keyword arguments follow the installed signatures
    (:meth:`_kwargs`) and the lse is picked out of the forward's results by dtype and shape
    (:func:`_first_lse`), whichever tuple the release returns. The tiles make causal calls
    square, so flash-attn's bottom-right causal alignment agrees with the top-left
    convention of the interface.
    """

    name = "flash_attn"
    native_varlen = True
    devices = ("cuda",)
    dtypes = _HALF
    max_head_dim = 256
    head_dim_multiple = 8

    def __init__(self, fai=None):
        if fai is None:
            from flash_attn import flash_attn_interface as fai  # noqa: PLC0415 - optional dependency

        self._fwd = fai._flash_attn_forward
        self._bwd = fai._flash_attn_backward
        self._vfwd = fai._flash_attn_varlen_forward
        self._vbwd = fai._flash_attn_varlen_backward
        self._fwd_params = inspect.signature(self._fwd).parameters
        self._bwd_params = inspect.signature(self._bwd).parameters
        self._vfwd_params = inspect.signature(self._vfwd).parameters
        self._vbwd_params = inspect.signature(self._vbwd).parameters

    # keyword arguments some flash-attn versions take and others do not: set where present
    _OPTIONAL = {
        "softcap": 0.0,
        "alibi_slopes": None,
        "return_softmax": False,
        "block_table": None,
        "deterministic": False,
        "rng_state": None,
    }

    @classmethod
    def _kwargs(cls, params, causal: bool, scale: float, **extra) -> dict:
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, **extra)
        if "window_size_left" in params:
            kwargs.update(window_size_left=-1, window_size_right=-1)
        elif "window_size" in params:
            kwargs["window_size"] = (-1, -1)
        kwargs.update({k: v for k, v in cls._OPTIONAL.items() if k in params})
        return kwargs

    @staticmethod
    def _varlen(seg: Segments) -> dict:
        return dict(cu_seqlens_q=seg.cu_q, cu_seqlens_k=seg.cu_k, max_seqlen_q=seg.max_q, max_seqlen_k=seg.max_k)

    def forward(self, q, k, v, causal, scale):
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        res = self._fwd(qt, kt, vt, **self._kwargs(self._fwd_params, causal, scale))
        return res[0].transpose(1, 2), _first_lse(res, (q.shape[0], q.shape[1], q.shape[2]))

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        qt, kt, vt, ot, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        self._bwd(dot, qt, kt, vt, ot, lse.contiguous(), dq, dk, dv, **self._kwargs(self._bwd_params, causal, scale))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def varlen_forward(self, q, k, v, seg: Segments, causal, scale):
        if len(seg) == 0:
            return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        kwargs = self._kwargs(self._vfwd_params, causal, scale, **self._varlen(seg))
        res = self._vfwd(q.contiguous(), k.contiguous(), v.contiguous(), **kwargs)
        return res[0], _first_lse(res, (q.shape[1], q.shape[0]))

    def varlen_backward(self, dout, q, k, v, out, lse, seg: Segments, causal, scale):
        q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if len(seg) == 0:
            return dq.zero_(), dk.zero_(), dv.zero_()
        kwargs = self._kwargs(self._vbwd_params, causal, scale, **self._varlen(seg))
        self._vbwd(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, **kwargs)
        return dq, dk, dv


_REGISTRY: dict[str, Callable[[], AttentionKernel]] = {
    "math": MathKernel,
    "cpu_flash": CPUFlashKernel,
    "cpu_varlen": CPUVarlenKernel,
    "cuda_flash": CUDAFlashKernel,
    "flash_attn": FlashAttnKernel,
}
_INSTANCES: dict[str, AttentionKernel] = {}


def flash_attn_available() -> bool:
    """True when the flash-attn package is importable and a CUDA device is present."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def register_kernel(name: str, factory: Callable[[], AttentionKernel]) -> None:
    """Make a kernel selectable by name."""
    _REGISTRY[name] = factory
    _INSTANCES.pop(name, None)


def default_kernel_name(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel ``None``/``"auto"`` picks: ``cpu_varlen`` on CPU (packed segments, short ones
    batched, long ones through ATen's CPU flash kernel); on CUDA ``cuda_flash`` for
    fp16/bf16 (PyTorch's own variable-length flash kernel: no extra package, and the same
    flash-attention algorithm; flash-attn is used only when named) and ``math`` otherwise."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu_varlen"
    if device.type == "cuda" and dtype in _HALF:
        return "cuda_flash"
    return "math"


def _choices() -> str:
    return ", ".join(repr(n) for n in sorted(_REGISTRY)) + " or None/'auto' for the default"


def get_kernel(name: str | None, device: torch.device, dtype: torch.dtype) -> AttentionKernel:
    """The kernel called ``name``, or (``None`` / ``"auto"``) the default for ``device`` and ``dtype``.

    Raises ``ValueError`` for an unknown name and for flash-attn requested where it is not
    installed. What the kernel runs on is checked by :func:`check_kernel`.
    """
    if name in (None, "auto"):
        name = default_kernel_name(device, dtype)
        if name == "math" and torch.device(device).type == "cuda":
            warnings.warn(
                f"attention on cuda in {_dtype_name(dtype)} runs the dense 'math' kernel (S x S scores in fp32); "
                'compute in bfloat16 (training.mixed_precision_param = "bfloat16") for the flash kernel, '
                "or name the kernel to silence this",
                stacklevel=3,
            )
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {_choices()}")
    if name not in _INSTANCES:
        if name == "flash_attn" and _REGISTRY[name] is FlashAttnKernel:
            if importlib.util.find_spec("flash_attn") is None:
                raise ValueError(
                    "attention kernel 'flash_attn' needs the flash-attn package, which is not installed "
                    f"(pip install flash-attn); or choose one of {_choices()}"
                )
            try:
                _INSTANCES[name] = FlashAttnKernel()
            except ImportError as e:
                raise ValueError(f"attention kernel 'flash_attn': the flash-attn package fails to import ({e})") from e
        else:
            _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _problem(kern, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why ``kern`` (a kernel or kernel class) cannot run this attention, or ``None``."""
    if kern.devices is not None and device_type not in kern.devices:
        return f"runs on {'/'.join(kern.devices)} tensors, but q, k, v are on {device_type}"
    if kern.dtypes is not None and dtype not in kern.dtypes:
        return f"takes {'/'.join(_dtype_name(d) for d in kern.dtypes)} tensors, got {_dtype_name(dtype)}"
    if (kern.max_head_dim is not None and head_dim > kern.max_head_dim) or head_dim % kern.head_dim_multiple:
        limits = [f"a multiple of {kern.head_dim_multiple}"] if kern.head_dim_multiple > 1 else []
        if kern.max_head_dim is not None:
            limits.append(f"at most {kern.max_head_dim}")
        return f"takes head_dim {' and '.join(limits)}, got {head_dim}"
    return None


def _fitting(device_type: str, dtype: torch.dtype, head_dim: int) -> list[str]:
    """Registered kernels (those given as classes) that run this attention."""
    names = []
    for name, factory in sorted(_REGISTRY.items()):
        if not isinstance(factory, type) or _problem(factory, device_type, dtype, head_dim) is not None:
            continue
        if factory is FlashAttnKernel and importlib.util.find_spec("flash_attn") is None:
            continue
        names.append(name)
    return names


def check_kernel(
    kernel: str | AttentionKernel | None, device: torch.device, dtype: torch.dtype, head_dim: int
) -> AttentionKernel:
    """The kernel to run attention of ``dtype`` tensors on ``device`` with ``head_dim``, checked.

    ``kernel``: a registered name, ``None``/``"auto"`` (see :func:`default_kernel_name`), or
    a kernel object. Raises ``ValueError`` naming the problem and the choices when the name is
    unknown, flash-attn is not installed, or the kernel does not run on the device, the
    dtype or the head dimension.
    """
    device = torch.device(device)
    if not dtype.is_floating_point:
        raise ValueError(f"attention needs floating-point q, k, v; got {_dtype_name(dtype)}")
    if int(head_dim) != head_dim or head_dim < 1:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim}")
    kern = kernel if isinstance(kernel, AttentionKernel) else get_kernel(kernel, device, dtype)
    problem = _problem(kern, device.type, dtype, head_dim)
    if problem is not None:
        hint = ""
        if kern.dtypes is not None and dtype not in kern.dtypes and device.type == "cuda":
            hint = ' (or compute in bfloat16: training.mixed_precision_param = "bfloat16")'
        choices = _fitting(device.type, dtype, head_dim)
        default = default_kernel_name(device, dtype)
        or_default = f" or None (the default, {default!r})" if default in choices else ""
        raise ValueError(
            f"attention kernel {kern.name!r} {problem}; for {_dtype_name(dtype)} on {device.type} with head_dim "
            f"{head_dim} choose one of {choices}{or_default}{hint}"
        )
    return kern
