"""Local attention kernels behind one interface.

Every kernel computes dense attention of one tile (see :mod:`titan_cp.attention.masks`)::

    forward(q, k, v, causal, scale)                    -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale)   -> (dq, dk, dv)

    q, out, dout: (batch, q_heads, sq, head_dim)        in the input dtype
    k, v:         (batch, kv_heads, sk, head_dim)       kv_heads divides q_heads (GQA)
    lse:          (batch, q_heads, sq)                  fp32, natural log
    causal:       top-left aligned; the tiles make every causal call square

``backward`` receives the *final* ``out`` and ``lse`` of the whole attention, not the
tile's own: with ``P = exp(q k^T * scale - lse)`` and ``D = rowsum(dout * out)`` the tile's
gradients are then exact pieces of the full gradient (the flash-attention backward)::

    dv = P^T dout       dS = P * (dout v^T - D)       dq = dS k * scale       dk = dS^T q * scale

Backends: ``cpu_flash`` (ATen's CPU flash kernel), ``cuda_flash`` (ATen's CUDA flash
kernel, fp16/bf16), ``flash_attn`` (the flash-attn package where installed, fp16/bf16),
and ``math``, a plain fp32 reference for tests and for dtypes no fast kernel takes.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Callable

import torch

_ATEN = torch.ops.aten


class AttentionKernel:
    """A local tile kernel; subclasses implement :meth:`forward` and :meth:`backward`.

    Variable-length form: many tiles packed into one call, the way flash-attn's varlen
    kernels take them. Segment ``i`` is ``q[cu_q[i]:cu_q[i+1]]`` against
    ``k[cu_k[i]:cu_k[i+1]]``::

        varlen_forward(q, k, v, cu_q, cu_k, causal, scale)                -> (out, lse)
        varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale) -> (dq, dk, dv)

        q, out, dout: (total_q, q_heads, head_dim)    k, v: (total_k, kv_heads, head_dim)
        lse: (q_heads, total_q) fp32                  cu_q, cu_k: cumulative lengths (lists)

    Kernels with ``native_varlen = True`` run all tiles of a mask plan in one call; the
    default implementation here loops over the segments with :meth:`forward`/:meth:`backward`.
    """

    name = "base"
    native_varlen = False

    def forward(self, q, k, v, causal: bool, scale: float):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        raise NotImplementedError

    def varlen_forward(self, q, k, v, cu_q, cu_k, causal: bool, scale: float):
        outs, lses = [], []
        for (a, b), (c, d) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
            out, lse = self.forward(*(x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d])), causal, scale)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, causal: bool, scale: float):
        dqs, dks, dvs = [], [], []
        for (a, b), (c, d) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
            seg = (x.transpose(0, 1)[None] for x in (dout[a:b], q[a:b], k[c:d], v[c:d], out[a:b]))
            dq, dk, dv = self.backward(*seg, lse[None, :, a:b], causal, scale)
            dqs.append(dq[0].transpose(0, 1))
            dks.append(dk[0].transpose(0, 1))
            dvs.append(dv[0].transpose(0, 1))
        return torch.cat(dqs), torch.cat(dks), torch.cat(dvs)

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

    def forward(self, q, k, v, causal, scale):
        return _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        return _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )


class CUDAFlashKernel(AttentionKernel):
    """ATen's CUDA flash attention (fp16/bf16). K/V heads are expanded locally, after any communication."""

    name = "cuda_flash"

    def forward(self, q, k, v, causal, scale):
        groups = q.shape[1] // k.shape[1]
        res = _ATEN._scaled_dot_product_flash_attention(
            q, _expand_kv(k, groups), _expand_kv(v, groups), 0.0, causal, False, scale=scale
        )
        return res[0], res[1]

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[1] // k.shape[1]
        ke, ve = _expand_kv(k, groups), _expand_kv(v, groups)
        sq, sk = q.shape[2], k.shape[2]
        cum = torch.empty(0, dtype=torch.int32, device=q.device)
        seed = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, ke, ve, out.contiguous(), lse.contiguous(), cum, cum, sq, sk, 0.0, causal,
            seed, seed, scale=scale,
        )
        return dq, _reduce_kv(dk, groups), _reduce_kv(dv, groups)


class FlashAttnKernel(AttentionKernel):
    """The flash-attn package (fp16/bf16 on CUDA); takes GQA natively, tensors as ``(batch, seq, heads, dim)``.

    The tiles make causal calls square, so flash-attn's bottom-right causal alignment
    agrees with the top-left convention of the interface.
    """

    name = "flash_attn"
    native_varlen = True

    def __init__(self):
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
    _OPTIONAL = {"softcap": 0.0, "alibi_slopes": None, "return_softmax": False, "block_table": None,
                 "deterministic": False, "rng_state": None}

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
    def _varlen(cu_q, cu_k, device) -> dict:
        def cu(c):
            return torch.tensor(c, dtype=torch.int32, device=device), max(b - a for a, b in zip(c, c[1:]))

        (cq, mq), (ck, mk) = cu(cu_q), cu(cu_k)
        return dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)

    def forward(self, q, k, v, causal, scale):
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        res = self._fwd(qt, kt, vt, **self._kwargs(self._fwd_params, causal, scale))
        return res[0].transpose(1, 2), res[1]

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        qt, kt, vt, ot, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        self._bwd(dot, qt, kt, vt, ot, lse.contiguous(), dq, dk, dv, **self._kwargs(self._bwd_params, causal, scale))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def varlen_forward(self, q, k, v, cu_q, cu_k, causal, scale):
        kwargs = self._kwargs(self._vfwd_params, causal, scale, **self._varlen(cu_q, cu_k, q.device))
        res = self._vfwd(q.contiguous(), k.contiguous(), v.contiguous(), **kwargs)
        return res[0], res[1]

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
        q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kwargs = self._kwargs(self._vbwd_params, causal, scale, **self._varlen(cu_q, cu_k, q.device))
        self._vbwd(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, **kwargs)
        return dq, dk, dv


_REGISTRY: dict[str, Callable[[], AttentionKernel]] = {
    "math": MathKernel,
    "cpu_flash": CPUFlashKernel,
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


def get_kernel(name: str | None, device: torch.device, dtype: torch.dtype) -> AttentionKernel:
    """The kernel called ``name``, or (``None`` / ``"auto"``) the fastest one for ``device`` and ``dtype``."""
    if name in (None, "auto"):
        if device.type == "cpu":
            name = "cpu_flash"
        elif device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
            name = "flash_attn" if flash_attn_available() else "cuda_flash"
        else:
            name = "math"
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(_REGISTRY)} or 'auto'")
    if name not in _INSTANCES:
        _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]
