"""``cuda_flash``: ATen's CUDA flash attention, dense and variable-length, GQA native (the CUDA default)."""

from __future__ import annotations

import torch
from torch import Tensor

from titan_cp.attention.kernels.base import (
    HALF,
    AttentionKernel,
    Segments,
    common_head_dim,
    empty_result,
    head_slice,
    unit_stride,
)

_ATEN = torch.ops.aten


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

    The kernel needs one head dim for q, k and v: a value dim of its own (MLA: q/k 192, v 128) runs
    with v (and in the backward ``dout`` and ``out``) zero-padded to q/k's, the results sliced back
    (:func:`~.base.common_head_dim`; the padding is outside the kernel, and the fake-CUDA model counts
    its bytes); the kernel computes ``P V`` and ``dV`` at the padded width.
    """

    name = "cuda_flash"
    native_varlen = True
    native_window = True  # window_size_left: a windowed tile is one segment
    devices = ("cuda",)
    dtypes = HALF
    max_head_dim = 256
    head_dim_multiple = 8

    def __init__(self) -> None:
        self._rng: dict[torch.device, torch.Tensor] = {}

    def _rng_state(self, device: torch.device) -> torch.Tensor:
        """A placeholder for the philox state, which the kernel reads only when dropout_p > 0."""
        if device not in self._rng:
            self._rng[device] = torch.zeros(2, dtype=torch.int64, device=device)
        return self._rng[device]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        v_dim = v.shape[-1]
        qt, kt, vt = (x.transpose(1, 2) for x in unit_stride(*common_head_dim(q, k, v)))  # (B, S, H, D) views
        res = _ATEN._flash_attention_forward(
            qt, kt, vt, None, None, qt.shape[1], kt.shape[1], 0.0, causal, False, scale=scale
        )
        return head_slice(res[0].transpose(1, 2), v_dim), res[1]

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        qt, kt, vt, ot, dot = (x.transpose(1, 2) for x in unit_stride(*common_head_dim(q, k, v, out, dout)))
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
        return (
            head_slice(dq.transpose(1, 2), qk_dim),
            head_slice(dk.transpose(1, 2), qk_dim),
            head_slice(dv.transpose(1, 2), v_dim),
        )

    def varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, seg: Segments, causal: bool, scale: float, window: int | None = None
    ) -> tuple[Tensor, Tensor]:
        if len(seg) == 0:
            return empty_result(q, v)
        v_dim = v.shape[-1]
        q, k, v = unit_stride(*common_head_dim(q, k, v))
        res = _ATEN._flash_attention_forward(
            q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, causal, False, scale=scale, **_window(window)
        )
        out, lse = res[0], res[1]
        if tuple(lse.shape) != (q.shape[1], q.shape[0]):
            raise RuntimeError(
                f"torch {torch.__version__}: aten._flash_attention_forward returned a log-sum-exp of shape "
                f"{tuple(lse.shape)} for {len(seg)} segments, expected (q_heads, total_q) = "
                f"{(q.shape[1], q.shape[0])}; choose another kernel (kernel='flash_attn' or 'math')"
            )
        return head_slice(out, v_dim), lse

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
        if len(seg) == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        rng = self._rng_state(q.device)
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        dout, q, k, v, out = unit_stride(*common_head_dim(dout, q, k, v, out))
        dq, dk, dv = _ATEN._flash_attention_backward(
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
            **_window(window),
        )
        return head_slice(dq, qk_dim), head_slice(dk, qk_dim), head_slice(dv, v_dim)


def _window(window: int | None) -> dict[str, int]:
    """The flash ops' window keywords: each query sees its last ``window`` keys (bottom-right aligned)."""
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
