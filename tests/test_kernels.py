"""Local kernels against the plain math kernel, and the tile backward fed the *global*
``out``/``lse`` (the identity every strategy's backward relies on)."""

import pytest
import torch

from titan_cp.attention import get_kernel
from titan_cp.attention.kernels import MathKernel, flash_attn_available

SCALE = 0.25


def _qkv(dtype=torch.float32, device="cpu", sq=40, sk=40, heads=6, kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, s: torch.randn(2, h, s, 16, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(heads, sq), mk(kv_heads, sk), mk(kv_heads, sk), mk(heads, sq)


def _check(kernel, dtype, device, tol):
    ref = MathKernel()
    for causal, sk in ((True, 40), (False, 24)):
        q, k, v, dout = _qkv(dtype, device, sk=sk)
        out, lse = kernel.forward(q, k, v, causal, SCALE)
        rout, rlse = ref.forward(q.float(), k.float(), v.float(), causal, SCALE)
        assert lse.dtype == torch.float32
        torch.testing.assert_close(out.float(), rout, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, rlse, atol=tol, rtol=tol)
        got = kernel.backward(dout, q, k, v, out, lse, causal, SCALE)
        want = ref.backward(dout.float(), q.float(), k.float(), v.float(), rout, rlse, causal, SCALE)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g.float(), w, atol=tol * 4, rtol=tol * 4)


def test_math_kernel_matches_autograd():
    q, k, v, dout = _qkv()
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (qs, ks, vs), dout)
    kern = MathKernel()
    out, lse = kern.forward(q, k, v, True, SCALE)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, w in zip(kern.backward(dout, q, k, v, out, lse, True, SCALE), ref_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_cpu_flash(dtype, tol):
    _check(get_kernel("cpu_flash", torch.device("cpu"), dtype), dtype, "cpu", tol)


def test_backward_with_global_out_and_lse_is_a_slice_of_the_full_gradient():
    """Split the keys in two blocks: per-block backward with the merged out/lse sums to the full gradient."""
    kern = get_kernel("cpu_flash", torch.device("cpu"), torch.float32)
    q, k, v, dout = _qkv(sk=40)
    out, lse = kern.forward(q, k, v, False, SCALE)
    full = kern.backward(dout, q, k, v, out, lse, False, SCALE)
    a = kern.backward(dout, q, k[:, :, :15], v[:, :, :15], out, lse, False, SCALE)
    b = kern.backward(dout, q, k[:, :, 15:], v[:, :, 15:], out, lse, False, SCALE)
    torch.testing.assert_close(a[0] + b[0], full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([a[1], b[1]], 2), full[1], atol=1e-5, rtol=1e-5)


def test_auto_picks_cpu_flash_on_cpu_and_rejects_unknown_names():
    assert get_kernel(None, torch.device("cpu"), torch.float32).name == "cpu_flash"
    with pytest.raises(ValueError, match="unknown attention kernel 'nope'"):
        get_kernel("nope", torch.device("cpu"), torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: ATen's CUDA flash kernel")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_flash(dtype):
    _check(get_kernel("cuda_flash", torch.device("cuda"), dtype), dtype, "cuda", 2e-2)


@pytest.mark.skipif(not flash_attn_available(), reason="needs a CUDA device and the flash-attn package")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn(dtype):
    kernel = get_kernel("flash_attn", torch.device("cuda"), dtype)
    assert get_kernel(None, torch.device("cuda"), dtype).name == "flash_attn"
    _check(kernel, dtype, "cuda", 2e-2)


@pytest.mark.skipif(not flash_attn_available(), reason="needs a CUDA device and the flash-attn package")
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_varlen_matches_segment_by_segment(causal):
    """flash-attn's varlen kernels against the same segments run one by one (the default loop)."""
    kernel = get_kernel("flash_attn", torch.device("cuda"), torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    lens = [5, 17, 1, 40]
    total = sum(lens)
    q, dout = (torch.randn(total, 6, 64, generator=g).cuda().bfloat16() for _ in range(2))
    k, v = (torch.randn(total, 2, 64, generator=g).cuda().bfloat16() for _ in range(2))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    out, lse = kernel.varlen_forward(q, k, v, cu, cu, causal, SCALE)
    ref_out, ref_lse = AttentionKernelLoop().varlen_forward(q, k, v, cu, cu, causal, SCALE)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)
    got = kernel.varlen_backward(dout, q, k, v, out, lse, cu, cu, causal, SCALE)
    want = AttentionKernelLoop().varlen_backward(dout, q, k, v, out, lse, cu, cu, causal, SCALE)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


class AttentionKernelLoop(MathKernel):
    """The math kernel through the default segment-by-segment varlen loop."""


def test_flash_attn_keyword_arguments_follow_the_installed_signature():
    """The flash-attn backend adapts to the version installed: window as two ints or a pair,
    optional arguments only where the signature has them (checked without flash-attn)."""
    from titan_cp.attention.kernels import FlashAttnKernel

    v26 = {"dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
           "alibi_slopes", "return_softmax"}
    kw = FlashAttnKernel._kwargs(v26, True, 0.5)
    assert kw == dict(dropout_p=0.0, softmax_scale=0.5, causal=True, window_size_left=-1, window_size_right=-1,
                      softcap=0.0, alibi_slopes=None, return_softmax=False)
    v24 = {"dropout_p", "softmax_scale", "causal", "window_size", "alibi_slopes", "deterministic", "rng_state"}
    kw = FlashAttnKernel._kwargs(v24, False, 0.25, **FlashAttnKernel._varlen([0, 3, 10], [0, 5, 6], "cpu"))
    assert kw["window_size"] == (-1, -1) and kw["deterministic"] is False and kw["rng_state"] is None
    assert "softcap" not in kw and "return_softmax" not in kw
    assert kw["cu_seqlens_q"].tolist() == [0, 3, 10] and kw["cu_seqlens_q"].dtype == torch.int32
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (7, 5)
