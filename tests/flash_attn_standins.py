"""Stand-ins for flash-attn's private interface, two generations, math inside (CPU, any dtype).

- ``"2.6"``: plain Python functions; forwards return
  ``(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)``.
- ``"2.7"``: ``torch.library`` custom ops (so ``inspect.signature`` reads ``(*args, **kwargs)``),
  with that release's schemas: the window, softcap, alibi slopes, return_softmax and
  deterministic are required arguments; forwards return ``(out, softmax_lse, S_dmask, rng_state)``.

Backwards fill the preallocated ``dq, dk, dv`` in place and return ``softmax_d``, as flash-attn's do.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from titan_cp.attention.kernels import MathKernel, Segments


class _Loop(MathKernel):
    """The math kernel through the base class's segment-by-segment varlen loop."""


def _dense_fwd(q, k, v, scale, causal):
    out, lse = MathKernel().forward(*(x.transpose(1, 2) for x in (q, k, v)), causal, scale)
    return out.transpose(1, 2).contiguous(), lse


def _dense_bwd(dout, q, k, v, out, lse, dq, dk, dv, scale, causal):
    g = MathKernel().backward(*(x.transpose(1, 2) for x in (dout, q, k, v, out)), lse, causal, scale)
    for dst, src in zip((dq, dk, dv), g):
        dst.copy_(src.transpose(1, 2))
    return torch.zeros(lse.shape, dtype=torch.float32)


def _seg(cu_q, cu_k) -> Segments:
    return Segments.from_offsets(cu_q.tolist(), cu_k.tolist(), "cpu")


def _varlen_fwd(q, k, v, cu_q, cu_k, scale, causal):
    return _Loop().varlen_forward(q, k, v, _seg(cu_q, cu_k), causal, scale)


def _varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, scale, causal):
    g = _Loop().varlen_backward(dout, q, k, v, out, lse, _seg(cu_q, cu_k), causal, scale)
    for dst, src in zip((dq, dk, dv), g):
        dst.copy_(src)
    return torch.zeros(lse.shape, dtype=torch.float32)


def _tail(q):
    return torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


def generation_2_6() -> SimpleNamespace:
    def fwd(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
    ):
        out, lse = _dense_fwd(q, k, v, softmax_scale, causal)
        return (out, q, k, v, out, lse, *_tail(q))

    def vfwd(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
        block_table=None,
    ):
        out, lse = _varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        return (out, q, k, v, out, lse, *_tail(q))

    def bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        return _dense_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)

    def vbwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        return _varlen_bwd(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal
        )

    return SimpleNamespace(
        _flash_attn_forward=fwd,
        _flash_attn_backward=bwd,
        _flash_attn_varlen_forward=vfwd,
        _flash_attn_varlen_backward=vbwd,
    )


Tensor = torch.Tensor
Opt = Tensor | None


@torch.library.custom_op("titan_cp_standin::_flash_attn_forward", mutates_args=())
def _fwd27(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Opt,
    return_softmax: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, lse = _dense_fwd(q, k, v, softmax_scale, causal)
    return (out, lse, *_tail(q))


@torch.library.custom_op("titan_cp_standin::_flash_attn_varlen_forward", mutates_args=())
def _vfwd27(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Opt = None,
    return_softmax: bool = False,
    block_table: Opt = None,
    leftpad_k: Opt = None,
    seqused_k: Opt = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, lse = _varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return (out, lse, *_tail(q))


@torch.library.custom_op("titan_cp_standin::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _bwd27(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Opt,
    deterministic: bool,
    rng_state: Opt = None,
) -> Tensor:
    return _dense_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)


@torch.library.custom_op("titan_cp_standin::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
def _vbwd27(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Opt,
    deterministic: bool,
    rng_state: Opt = None,
) -> Tensor:
    return _varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)


def generation_2_7() -> SimpleNamespace:
    return SimpleNamespace(
        _flash_attn_forward=_fwd27,
        _flash_attn_backward=_bwd27,
        _flash_attn_varlen_forward=_vfwd27,
        _flash_attn_varlen_backward=_vbwd27,
    )


def standin(generation: str) -> SimpleNamespace:
    """The stand-in module of ``generation`` ("2.6" or "2.7")."""
    return {"2.6": generation_2_6, "2.7": generation_2_7}[generation]()
