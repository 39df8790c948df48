"""Local kernels against the plain math kernel, and the tile backward fed the *global*
``out``/``lse`` (the identity every strategy's backward relies on). v takes a head dim of its own
(multi-head latent attention) in every kernel: narrower and wider than q/k's 16."""

import functools

import pytest
import torch

from tests.flash_attn_standins import standin
from titan_cp.attention import get_kernel
from titan_cp.attention.kernels import (
    CUDAFlashKernel,
    FlashAttnKernel,
    MathKernel,
    Segments,
    check_kernel,
    flash_attn_available,
)
from titan_cp.attention.kernels import base as kernels_module
from titan_cp.attention.kernels import cuda_flash as cuda_flash_module
from titan_cp.attention.kernels import flashattn as flashattn_module

SCALE = 0.25


def _qkv(dtype=torch.float32, device="cpu", sq=40, sk=40, heads=6, kv_heads=2, seed=0, v_dim=16):
    """``q, k`` at head dim 16, ``v`` and ``dout`` at ``v_dim``."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, s, e=16: torch.randn(2, h, s, e, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(heads, sq), mk(kv_heads, sk), mk(kv_heads, sk, v_dim), mk(heads, sq, v_dim)


def _check(kernel, dtype, device, tol):
    ref = MathKernel()
    for causal, sk, v_dim in ((True, 40, 16), (False, 24, 16), (True, 40, 8), (False, 24, 24)):
        q, k, v, dout = _qkv(dtype, device, sk=sk, v_dim=v_dim)
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


def test_auto_picks_cpu_varlen_on_cpu_and_cuda_flash_for_half_on_cuda():
    assert get_kernel(None, torch.device("cpu"), torch.float32).name == "cpu_varlen"
    assert check_kernel(None, torch.device("cpu"), torch.bfloat16, 64).name == "cpu_varlen"
    # the CUDA choice is made without touching a device
    assert check_kernel(None, torch.device("cuda"), torch.bfloat16, 128).name == "cuda_flash"
    assert check_kernel("auto", "cuda", torch.float16, 64).name == "cuda_flash"
    with pytest.warns(
        UserWarning, match=r"attention on cuda in float32 runs the dense 'math' kernel.*mixed_precision_param"
    ):
        assert check_kernel(None, "cuda", torch.float32, 64).name == "math"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: ATen's CUDA flash kernel")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_flash(dtype):
    _check(get_kernel("cuda_flash", torch.device("cuda"), dtype), dtype, "cuda", 2e-2)


class AttentionKernelLoop(MathKernel):
    """The math kernel through the default segment-by-segment varlen loop."""


def _packed(lens_q, lens_k, heads=6, kv_heads=2, dim=16, dtype=torch.float32, device="cpu", seed=0, v_dim=None):
    """Packed ``q, k`` at ``dim``, ``v`` and ``dout`` at ``v_dim`` (``None``: ``dim``)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda n, h, e=dim: torch.randn(n, h, e, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    tq, tk, e = sum(lens_q), sum(lens_k), dim if v_dim is None else v_dim
    return mk(tq, heads), mk(tk, kv_heads), mk(tk, kv_heads, e), mk(tq, heads, e)


def test_segments_from_offsets_and_lengths():
    seg = Segments.from_lengths([3, 0, 7], [5, 2, 7], "cpu")
    assert seg.host_q == (0, 3, 3, 10) and seg.host_k == (0, 5, 7, 14)
    assert seg.cu_q.dtype == seg.cu_k.dtype == torch.int32 and seg.cu_q.is_contiguous()
    assert seg.cu_q.tolist() == [0, 3, 3, 10] and seg.cu_k.tolist() == [0, 5, 7, 14]
    assert (seg.max_q, seg.max_k, len(seg)) == (7, 7, 3)
    assert Segments.from_offsets([0], [0], "cpu").max_q == 0


@pytest.mark.parametrize("causal,v_dim", [(True, 16), (False, 16), (True, 10)])
def test_default_varlen_loop_matches_each_segment_alone(causal, v_dim):
    """The base-class loop: packed (total, heads, dim) buffers, GQA, an empty query segment, v at its own
    head dim or q's; every segment equals dense attention of its own slices, dK/dV come back at kv_heads."""
    lens_q = [5, 0, 9, 1]
    lens_k = lens_q if causal else [4, 3, 11, 2]
    q, k, v, dout = _packed(lens_q, lens_k, v_dim=v_dim)
    seg = Segments.from_lengths(lens_q, lens_k, "cpu")
    kern = AttentionKernelLoop()
    out, lse = kern.varlen_forward(q, k, v, seg, causal, SCALE)
    assert out.shape == dout.shape and lse.shape == (6, sum(lens_q)) and lse.dtype == torch.float32
    dq, dk, dv = kern.varlen_backward(dout, q, k, v, out, lse, seg, causal, SCALE)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for (a, b), (c, d) in zip(zip(seg.host_q, seg.host_q[1:]), zip(seg.host_k, seg.host_k[1:])):
        if a == b:
            continue
        dense = [x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d], dout[a:b])]
        qs, ks, vs = (x.clone().requires_grad_() for x in dense[:3])
        ref = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=causal, scale=SCALE, enable_gqa=True
        )
        grads = torch.autograd.grad(ref, (qs, ks, vs), dense[3])
        torch.testing.assert_close(out[a:b], ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        for got, want in zip((dq[a:b], dk[c:d], dv[c:d]), grads):
            torch.testing.assert_close(got, want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


class _RecordingAten:
    """Stands in for ``torch.ops.aten`` in kernels.py: records the flash calls, runs them on meta tensors."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        op = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return op(*args, **kwargs)

        return call


def test_cuda_flash_kernel_calls_and_shapes_on_meta_tensors(monkeypatch):
    """ATen's CUDA flash kernel, checked without a GPU through its meta implementation: K/V at
    their own head count, the dense backward passes None as cumulative lengths (a defined
    tensor would select the variable-length route), lse (B, H, S) dense and (H, total_q) varlen."""
    rec = _RecordingAten()
    monkeypatch.setattr(cuda_flash_module, "_ATEN", rec)
    kern = CUDAFlashKernel()
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(2, 8, 40, 64, **meta), torch.empty(2, 2, 40, 64, **meta)
    out, lse = kern.forward(q, k, k, True, SCALE)
    assert out.shape == q.shape and lse.shape == (2, 8, 40) and lse.dtype == torch.float32
    dq, dk, dv = kern.backward(q, q, k, k, out, lse, True, SCALE)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    (fname, fargs, fkw), (bname, bargs, bkw) = rec.calls
    assert fname == "_flash_attention_forward" and fargs[3] is None and fargs[4] is None and fkw == {"scale": SCALE}
    assert fargs[1].shape == (2, 40, 2, 64)  # (B, S, H_kv, D): no repeat_interleave
    assert bname == "_flash_attention_backward" and bargs[6] is None and bargs[7] is None
    assert bargs[10] == 0.0 and bargs[11] is True

    rec.calls.clear()
    seg = Segments.from_lengths([5, 17, 1], [5, 17, 1], "cpu")
    seg = Segments(seg.cu_q.to("meta"), seg.cu_k.to("meta"), seg.max_q, seg.max_k, seg.host_q, seg.host_k)
    qp, kp = torch.empty(23, 8, 64, **meta), torch.empty(23, 2, 64, **meta)
    out, lse = kern.varlen_forward(qp, kp, kp, seg, True, SCALE)
    assert out.shape == qp.shape and lse.shape == (8, 23)
    dq, dk, dv = kern.varlen_backward(qp, qp, kp, kp, out, lse, seg, True, SCALE)
    assert dq.shape == qp.shape and dk.shape == kp.shape and dv.shape == kp.shape
    (_, fargs, _), (_, bargs, _) = rec.calls
    assert fargs[3] is seg.cu_q and fargs[5:7] == (17, 17)
    assert bargs[6] is seg.cu_q and bargs[7] is seg.cu_k and bargs[8:10] == (17, 17)


def test_cuda_flash_pads_a_value_head_dim_of_its_own_on_meta_tensors(monkeypatch):
    """Multi-head latent attention on ATen's CUDA flash kernel, which takes one head dim: v (and the
    backward's out and dout) reach it zero-padded to q/k's 192, the results come back at their own dims."""
    rec = _RecordingAten()
    monkeypatch.setattr(cuda_flash_module, "_ATEN", rec)
    kern = CUDAFlashKernel()
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k, v = torch.empty(2, 8, 40, 192, **meta), torch.empty(2, 8, 40, 192, **meta), torch.empty(2, 8, 40, 128, **meta)
    out, lse = kern.forward(q, k, v, True, SCALE)
    grads = kern.backward(torch.empty_like(out), q, k, v, out, lse, True, SCALE)
    assert out.shape == (2, 8, 40, 128) and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    seg = Segments.from_lengths([5, 17, 1], [5, 17, 1], "cpu")
    seg = Segments(seg.cu_q.to("meta"), seg.cu_k.to("meta"), seg.max_q, seg.max_k, seg.host_q, seg.host_k)
    qp, vp = torch.empty(23, 8, 192, **meta), torch.empty(23, 8, 128, **meta)
    out, lse = kern.varlen_forward(qp, qp, vp, seg, True, SCALE)
    grads = kern.varlen_backward(torch.empty_like(out), qp, qp, vp, out, lse, seg, True, SCALE)
    assert out.shape == (23, 8, 128) and [g.shape for g in grads] == [qp.shape, qp.shape, vp.shape]
    assert len(rec.calls) == 4
    for _, args, _ in rec.calls:  # q, k, v (and dout, out): every head dim the kernel sees is 192
        assert {a.shape[-1] for a in args[:5] if isinstance(a, torch.Tensor) and a.dim() >= 3} == {192}


def _fake_flash_attn(generation: str):
    """flash-attn's private functions of ``generation`` ("2.6": Python functions; "2.7": custom ops), math inside."""
    return standin(generation)


@pytest.mark.parametrize("generation", ["2.6", "2.7"])
def test_flash_attn_out_and_lse_whichever_tuple_the_release_returns(generation):
    kern = FlashAttnKernel(_fake_flash_attn(generation))
    q, k, v, _ = _qkv(torch.bfloat16)
    out, lse = kern.forward(q, k, v, True, SCALE)
    want_out, want_lse = MathKernel().forward(q, k, v, True, SCALE)
    assert out.shape == q.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)

    lens = [5, 17, 1]
    qp, kp, vp, _ = _packed(lens, lens, dtype=torch.bfloat16)
    seg = Segments.from_lengths(lens, lens, "cpu")
    out, lse = kern.varlen_forward(qp, kp, vp, seg, False, SCALE)
    want_out, want_lse = AttentionKernelLoop().varlen_forward(qp, kp, vp, seg, False, SCALE)
    assert lse.shape == (6, 23)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


def test_flash_attn_release_with_a_padded_varlen_lse_is_refused():
    fai = _fake_flash_attn("2.6")
    real = fai._flash_attn_varlen_forward

    @functools.wraps(real)  # the installed function's parameters
    def padded(*args, **kwargs):
        out, q, k, v, out_padded, lse, *rest = real(*args, **kwargs)  # 2.6's tuple, lse padded
        return (out, q, k, v, out_padded, torch.zeros(3, lse.shape[0], 17), *rest)

    fai._flash_attn_varlen_forward = padded
    qp, kp, vp, _ = _packed([5, 17, 1], [5, 17, 1], dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"log-sum-exp of shape \(3, 6, 17\), expected \(6, 23\)"):
        FlashAttnKernel(fai).varlen_forward(
            qp, kp, vp, Segments.from_lengths([5, 17, 1], [5, 17, 1], "cpu"), True, SCALE
        )


@pytest.mark.parametrize("generation", ["2.6", "2.7"])
def test_flash_attn_forward_and_backward_with_either_generation(generation):
    """flash-attn 2.7 registers its private functions as custom ops (signature ``(*args, **kwargs)``, the
    window, softcap, alibi slopes and deterministic required): the kernel reads their names from the op
    schema, so the dense and variable-length forward and backward run and equal the math kernel."""
    kern = FlashAttnKernel(_fake_flash_attn(generation))
    ref = MathKernel()
    for causal, sk, v_dim in ((True, 40, 16), (False, 24, 8)):  # flash-attn 2 takes one head dim: v padded
        q, k, v, dout = _qkv(torch.bfloat16, sk=sk, v_dim=v_dim)
        out, lse = kern.forward(q, k, v, causal, SCALE)
        want = ref.forward(q, k, v, causal, SCALE)
        torch.testing.assert_close(out, want[0])
        torch.testing.assert_close(lse, want[1])
        for got, w in zip(
            kern.backward(dout, q, k, v, out, lse, causal, SCALE), ref.backward(dout, q, k, v, out, lse, causal, SCALE)
        ):
            assert got.shape == w.shape
            torch.testing.assert_close(got, w)
    lens_q, lens_k = [5, 17, 1], [9, 3, 30]
    qp, kp, vp, dp = _packed(lens_q, lens_k, dtype=torch.bfloat16, v_dim=24)  # q and k padded to v's 24
    seg = Segments.from_lengths(lens_q, lens_k, "cpu")
    out, lse = kern.varlen_forward(qp, kp, vp, seg, False, SCALE)
    loop = AttentionKernelLoop()
    want = loop.varlen_forward(qp, kp, vp, seg, False, SCALE)
    torch.testing.assert_close(out, want[0])
    got = kern.varlen_backward(dp, qp, kp, vp, out, lse, seg, False, SCALE)
    for g, w in zip(got, loop.varlen_backward(dp, qp, kp, vp, out, lse, seg, False, SCALE)):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)


def test_flash_attn_release_requiring_an_unknown_argument_is_refused_when_built():
    fai = _fake_flash_attn("2.6")

    def fwd(q, k, v, dropout_p, softmax_scale, causal, sink_tokens):
        raise AssertionError("never called")

    fai._flash_attn_forward = fwd
    with pytest.raises(ValueError, match=r"fwd requires \['sink_tokens'\], which this kernel does not know"):
        FlashAttnKernel(fai)


def test_a_flash_attn_install_that_fails_to_import_makes_the_kernel_unavailable(monkeypatch):
    """A wheel built for another torch: the import raises; the kernel is unavailable with the reason,
    nothing crashes (the GPU self-check records the reason and goes on)."""
    from titan_cp import selfcheck

    monkeypatch.delitem(kernels_module._INSTANCES, "flash_attn", raising=False)
    real_spec, real_import = flashattn_module.importlib.util.find_spec, flashattn_module.importlib.import_module
    monkeypatch.setattr(
        flashattn_module.importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "flash_attn" else real_spec(name, *a),
    )

    def broken(name, *a):
        if name.startswith("flash_attn"):
            raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice")
        return real_import(name, *a)

    monkeypatch.setattr(flashattn_module.importlib, "import_module", broken)
    flashattn_module._import_problem.cache_clear()
    try:
        assert not flash_attn_available()
        with pytest.raises(
            ValueError,
            match=r"'flash_attn' needs the flash-attn package, which is installed but fails to import \(ImportError: .*undefined symbol",
        ):
            check_kernel("flash_attn", torch.device("cuda"), torch.bfloat16, 64)
        env = selfcheck.environment(torch.device("cpu"))
        assert "undefined symbol" in env["flash_attn_unavailable"]
        assert "flash_attn" not in kernels_module._fitting("cuda", torch.bfloat16, 64)
    finally:
        flashattn_module._import_problem.cache_clear()


def test_flash_attn_keyword_arguments_follow_the_installed_signature():
    """The flash-attn backend adapts to the version installed: window as two ints or a pair,
    optional arguments only where the signature has them (checked without flash-attn)."""
    v26 = {
        "dropout_p",
        "softmax_scale",
        "causal",
        "window_size_left",
        "window_size_right",
        "softcap",
        "alibi_slopes",
        "return_softmax",
    }
    kw = FlashAttnKernel._kwargs(v26, True, 0.5)
    assert kw == dict(
        dropout_p=0.0,
        softmax_scale=0.5,
        causal=True,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
    )
    v24 = {"dropout_p", "softmax_scale", "causal", "window_size", "alibi_slopes", "deterministic", "rng_state"}
    seg = Segments.from_offsets([0, 3, 10], [0, 5, 6], "cpu")
    kw = FlashAttnKernel._kwargs(v24, False, 0.25, **FlashAttnKernel._varlen(seg))
    assert kw["window_size"] == (-1, -1) and kw["deterministic"] is False and kw["rng_state"] is None
    assert "softcap" not in kw and "return_softmax" not in kw
    assert kw["cu_seqlens_q"].tolist() == [0, 3, 10] and kw["cu_seqlens_q"].dtype == torch.int32
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (7, 5)


# ---- bad input: a ValueError that names the problem and the choices -------------------------


def test_unknown_kernel_name():
    with pytest.raises(ValueError, match=r"unknown attention kernel 'nope'; choose one of .*'cpu_flash'.*'cuda_flash'"):
        get_kernel("nope", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="unknown attention kernel 'nope'"):
        check_kernel("nope", torch.device("cpu"), torch.float32, 64)


@pytest.mark.parametrize("name", ["cuda_flash", "flash_attn"])
def test_cuda_kernel_on_cpu_tensors(name, monkeypatch):
    monkeypatch.setitem(kernels_module._INSTANCES, "flash_attn", FlashAttnKernel(_fake_flash_attn("2.7")))
    with pytest.raises(
        ValueError,
        match=f"kernel '{name}' runs on cuda tensors, but q, k, v are on cpu; for bfloat16 "
        r"on cpu with head_dim 64 choose one of \[.*'cpu_flash', 'cpu_varlen'.*'math'\] or None",
    ):
        check_kernel(name, torch.device("cpu"), torch.bfloat16, 64)


def test_cpu_kernel_on_cuda_tensors():
    with pytest.raises(ValueError, match="kernel 'cpu_flash' runs on cpu tensors, but q, k, v are on cuda"):
        check_kernel("cpu_flash", torch.device("cuda"), torch.bfloat16, 64)


def test_flash_attn_not_installed(monkeypatch):
    monkeypatch.delitem(kernels_module._INSTANCES, "flash_attn", raising=False)
    real = flashattn_module.importlib.util.find_spec
    monkeypatch.setattr(
        flashattn_module.importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"'flash_attn' needs the flash-attn package, which is not installed"):
        check_kernel("flash_attn", torch.device("cuda"), torch.bfloat16, 64)


def test_fp32_with_a_flash_only_kernel():
    with pytest.raises(
        ValueError,
        match=r"'cuda_flash' takes float16/bfloat16 tensors, got float32; .*\['math'\]"
        r".*training.mixed_precision_param",
    ):
        check_kernel("cuda_flash", torch.device("cuda"), torch.float32, 64)


@pytest.mark.parametrize("head_dim", [100, 264, 4])
def test_head_dim_the_flash_kernel_does_not_take(head_dim):
    with pytest.raises(
        ValueError, match=f"'cuda_flash' takes head_dim a multiple of 8 and at most 256, got {head_dim}"
    ):
        check_kernel("cuda_flash", torch.device("cuda"), torch.bfloat16, head_dim)
    assert check_kernel("cpu_flash", torch.device("cpu"), torch.bfloat16, head_dim).name == "cpu_flash"
    # the default does not fit either: the error says so instead of falling back to the dense kernel
    with pytest.raises(ValueError, match=r"'cuda_flash' takes head_dim .* choose one of \['math'\]$"):
        check_kernel(None, torch.device("cuda"), torch.bfloat16, head_dim)


@pytest.mark.parametrize("head_dim", [0, -8])
def test_head_dim_not_positive(head_dim):
    with pytest.raises(ValueError, match=f"head_dim must be a positive integer, got {head_dim}"):
        check_kernel(None, torch.device("cpu"), torch.float32, head_dim)


def test_integer_tensors():
    with pytest.raises(ValueError, match="floating-point q, k, v; got int64"):
        check_kernel(None, torch.device("cpu"), torch.int64, 64)


# ---- on a GPU -------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: ATen's CUDA flash kernel")
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_flash_varlen_matches_segment_by_segment(causal):
    _check_varlen(get_kernel("cuda_flash", torch.device("cuda"), torch.bfloat16), causal)


@pytest.mark.skipif(not flash_attn_available(), reason="needs a CUDA device and the flash-attn package")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn(dtype):
    _check(get_kernel("flash_attn", torch.device("cuda"), dtype), dtype, "cuda", 2e-2)


@pytest.mark.skipif(not flash_attn_available(), reason="needs a CUDA device and the flash-attn package")
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_varlen_matches_segment_by_segment(causal):
    _check_varlen(get_kernel("flash_attn", torch.device("cuda"), torch.bfloat16), causal)


def _check_varlen(kernel, causal):
    """A native varlen kernel against the same segments run one by one through the math kernel."""
    lens_q = [5, 17, 1, 40]
    lens_k = lens_q if causal else [9, 3, 30, 40]
    q, k, v, dout = _packed(lens_q, lens_k, dim=64, dtype=torch.bfloat16, device="cuda")
    seg = Segments.from_lengths(lens_q, lens_k, "cuda")
    out, lse = kernel.varlen_forward(q, k, v, seg, causal, SCALE)
    ref_out, ref_lse = AttentionKernelLoop().varlen_forward(q, k, v, seg, causal, SCALE)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)
    got = kernel.varlen_backward(dout, q, k, v, out, lse, seg, causal, SCALE)
    want = AttentionKernelLoop().varlen_backward(dout, q, k, v, out, lse, seg, causal, SCALE)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


# ---------------------------------------------------------------------------- strided inputs
def _strided(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x`` laid out in memory as ``how`` says: ``transposed`` (the last dimension of stride > 1),
    ``sliced`` (every other element of a larger buffer) or ``expanded`` (stride 0: one head, or one
    head-dim value, repeated); the returned tensor's values are what the kernel must read."""
    if how == "transposed":
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "sliced":
        big = torch.zeros(*x.shape[:-2], 2 * x.shape[-2], 3 * x.shape[-1], dtype=x.dtype, device=x.device)
        big[..., ::2, 1::3] = x
        return big[..., ::2, 1::3]
    assert how == "expanded"
    return x[..., :1].expand(x.shape) if x.dim() == 3 else x[:, :1].expand(x.shape)


_CPU_KERNELS = ["math", "cpu_flash", "cpu_varlen"]
_LAYOUTS = ["transposed", "sliced", "expanded"]


@pytest.mark.parametrize("how", _LAYOUTS)
@pytest.mark.parametrize("name", _CPU_KERNELS)
def test_every_cpu_kernel_reads_strided_inputs_right(name, how):
    """A transposed, sliced or expanded q, k, v, out or dout gives the reference's out, lse and grads
    (the dense and the packed form): the flash kernels read a strided head dimension wrong unless copied."""
    kern, ref = get_kernel(name, torch.device("cpu"), torch.float32), MathKernel()
    q, k, v, dout = _qkv(sk=40)
    s = [_strided(x, how) for x in (q, k, v, dout)]
    want = ref.forward(*(x.contiguous() for x in s[:3]), True, SCALE)
    out, lse = kern.forward(*s[:3], True, SCALE)
    torch.testing.assert_close((out, lse), want, atol=1e-5, rtol=1e-5)
    grads = kern.backward(s[3], *s[:3], _strided(out, how), lse, True, SCALE)
    want_grads = ref.backward(*(x.contiguous() for x in (s[3], *s[:3], _strided(out, how))), lse, True, SCALE)
    torch.testing.assert_close(grads, want_grads, atol=1e-4, rtol=1e-4)
    lens = [50, 3, 40]  # big segments (one flash call each) and a small one (batched)
    seg = Segments.from_lengths(lens, lens, "cpu")
    p = [_strided(x, how) for x in _packed(lens, lens)]
    want = AttentionKernelLoop().varlen_forward(*(x.contiguous() for x in p[:3]), seg, True, SCALE)
    out, lse = kern.varlen_forward(*p[:3], seg, True, SCALE)
    torch.testing.assert_close((out, lse), want, atol=1e-5, rtol=1e-5)
    grads = kern.varlen_backward(p[3], *p[:3], out, lse, seg, True, SCALE)
    want_grads = AttentionKernelLoop().varlen_backward(
        *(x.contiguous() for x in (p[3], *p[:3])), out, lse, seg, True, SCALE
    )
    torch.testing.assert_close(grads, want_grads, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", _CPU_KERNELS)
def test_local_attention_with_a_transposed_v_matches_sdpa(name):
    """The case a user hits: ``v = torch.randn(1, 2, 64, 128).transpose(2, 3)`` through the public API."""
    from titan_cp.attention import local_attention  # noqa: PLC0415

    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, 128, 64, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 64, 128, generator=g).transpose(2, 3).requires_grad_()
    out = local_attention(q, k, v, kernel=name)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v.contiguous(), is_causal=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout))


def test_cuda_flash_passes_a_unit_stride_head_dimension(monkeypatch):
    """ATen's CUDA flash kernel (on meta tensors): a transposed q reaches it with a dense head dimension."""
    rec = _RecordingAten()
    monkeypatch.setattr(cuda_flash_module, "_ATEN", rec)
    kern = CUDAFlashKernel()
    q = torch.empty(2, 8, 64, 40, device="meta", dtype=torch.bfloat16).transpose(2, 3)
    k = torch.empty(2, 2, 40, 64, device="meta", dtype=torch.bfloat16)
    out, lse = kern.forward(q, k, k, True, SCALE)
    kern.backward(q, q, k, k, out, lse, True, SCALE)
    seg = Segments.from_lengths([40], [40], "cpu")
    seg = Segments(seg.cu_q.to("meta"), seg.cu_k.to("meta"), seg.max_q, seg.max_k, seg.host_q, seg.host_k)
    qp = q[0].transpose(0, 1)  # (S, H, D), head dimension of stride 40
    out, lse = kern.varlen_forward(qp, k[0].transpose(0, 1), k[0].transpose(0, 1), seg, True, SCALE)
    kern.varlen_backward(qp, qp, k[0].transpose(0, 1), k[0].transpose(0, 1), out, lse, seg, True, SCALE)
    for _, args, _ in rec.calls:
        assert all(a.stride(-1) == 1 for a in args[:5] if isinstance(a, torch.Tensor) and a.dim() >= 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: ATen's CUDA flash kernel")
@pytest.mark.parametrize("how", _LAYOUTS)
def test_cuda_flash_reads_strided_inputs_right(how):
    kern, ref = get_kernel("cuda_flash", torch.device("cuda"), torch.bfloat16), MathKernel()
    q, k, v, dout = (x.cuda() for x in _qkv(dtype=torch.bfloat16, sk=40))
    s = [_strided(x, how) for x in (q, k, v, dout)]
    out, lse = kern.forward(*s[:3], True, SCALE)
    want = ref.forward(*(x.contiguous() for x in s[:3]), True, SCALE)
    torch.testing.assert_close(out.float(), want[0].float(), atol=2e-2, rtol=2e-2)
    grads = kern.backward(s[3], *s[:3], out, lse, True, SCALE)
    want_grads = ref.backward(*(x.contiguous() for x in (s[3], *s[:3], out)), lse, True, SCALE)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g.float(), w.float(), atol=8e-2, rtol=8e-2)
