"""The CUDA call path at full size without a GPU: ring, all-gather, Ulysses and hybrid through the
``cuda_flash`` kernel on fake CUDA tensors (``benchmarks.fake_cuda``), forward and backward,
131072 tokens, CP 8, Llama 3 8B heads (32 query, 8 KV, head_dim 128), bf16, causal and packed.

Checked: ATen's schema accepts every call (the real op runs, on its fake kernel), the flash
kernel's preconditions hold, the log-sum-exp comes back as the engine expects, nothing in the
layer synchronises with the host or copies to the device blocking, no host work is redone in a
layer (the plans are built once per microbatch), at most one kernel call per causal flag per ring
step, and the bytes sent equal the strategy's minimum. No arithmetic runs. Multi-head latent
attention (q/k 192, v 128, DeepSeek V3's heads over TP 8): v reaches the kernel padded to q's head
dim, that padding is counted byte for byte, and the bytes sent are priced at v's own size.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

from benchmarks.fake_cuda import HostSyncError, simulate
from benchmarks.gpu_model import traffic_kind
from titan_cp.attention.kernels import cuda_flash
from titan_cp.attention.kernels.cuda_flash import CUDAFlashKernel
from titan_cp.attention.pricing import AttentionCall, cost_of
from titan_cp.layout import get_layout

SEQ, CP, HEADS, KV_HEADS, DIM = 131072, 8, 32, 8, 128
STRATEGIES = [("ring", 1), ("allgather", 1), ("ulysses", 1), ("hybrid", 2)]


def lognormal_docs(seq: int, mean: int, seed: int = 0) -> list[int]:
    """Document lengths of a log-normal mix with mean about ``mean``, filling ``seq`` tokens."""
    rng, out, left = random.Random(seed), [], seq
    sigma = 1.0
    mu = torch.log(torch.tensor(float(mean))).item() - sigma**2 / 2
    while left:
        n = min(left, max(1, int(rng.lognormvariate(mu, sigma))))
        out.append(n)
        left -= n
    return out


DOCS = [lognormal_docs(SEQ, 1024)]


def _min_bytes(
    strategy: str, ulysses: int, layout, rank: int, heads=HEADS, kv_heads=KV_HEADS, dim=DIM, v_dim=DIM
) -> int:
    meta = dict(dtype=torch.bfloat16, device="meta")
    local = layout.local_len
    q, k = torch.empty(1, heads, local, dim, **meta), torch.empty(1, kv_heads, local, dim, **meta)
    v = torch.empty(1, kv_heads, local, v_dim, **meta)
    return cost_of(strategy).min_bytes(AttentionCall.of(q, k, layout.cp_size, ulysses, layout, v=v), rank=rank)


@pytest.mark.parametrize("docs", [None, DOCS], ids=["causal", "documents"])
@pytest.mark.parametrize("strategy,ulysses", STRATEGIES)
def test_cuda_flash_calls_at_full_size(strategy, ulysses, docs):
    balance = "zigzag" if docs is None else "doc_zigzag"
    traces = simulate(strategy, SEQ, CP, HEADS, KV_HEADS, DIM, docs, balance, ulysses)
    assert [t.rank for t in traces] == list(range(CP))
    for t in traces:
        assert t.violations == [], t.violations
        assert t.host_ops == 0  # every host operation is in the plans later layers reuse
        assert t.calls and all(c.varlen for c in t.calls)
        assert 0 < t.calls_per_step("forward") <= 2 and 0 < t.calls_per_step("backward") <= 2
        assert t.bytes_sent == _min_bytes(strategy, ulysses, get_layout(SEQ, CP, balance, docs), t.rank)


MLA_SEQ, MLA_CP, MLA_HEADS, MLA_DIM, MLA_V_DIM = 8192, 4, 16, 192, 128  # K/V at every query head, as MLA expands


def _padding_bytes(trace) -> int:
    """Bytes the trace's operations outside the kernel spent padding v (and out, dout) to q's head dim."""
    return sum(nbytes for (site, op), (_, nbytes) in trace.sites.items() if traffic_kind(site, op) == "padding")


@pytest.mark.parametrize("strategy,ulysses", STRATEGIES)
def test_mla_v_padded_for_the_kernel_counted_and_priced_at_its_own_size(strategy, ulysses):
    """v (and the backward's out and dout) reach ATen's flash kernel zero-padded to q's head dim (else a
    violation), the padding read and written outside the kernel is counted (every call's v rows, and the
    backward's out and dout rows, each read at 128 and written at 192), and the bytes sent are the
    strategy's minimum with V and the output at their own size."""
    docs = [lognormal_docs(MLA_SEQ, 1024)]
    layout = get_layout(MLA_SEQ, MLA_CP, "doc_zigzag", docs)
    heads, dims = MLA_HEADS, MLA_DIM + MLA_V_DIM
    traces = simulate(
        strategy, MLA_SEQ, MLA_CP, heads, heads, MLA_DIM, docs, "doc_zigzag", ulysses, v_head_dim=MLA_V_DIM
    )
    for t in traces:
        assert t.violations == [], t.violations
        rows = [
            c.k_shape[0] * c.k_shape[1] + (2 * c.q_shape[0] * c.q_shape[1] if c.op == "backward" else 0)
            for c in t.calls
        ]
        assert _padding_bytes(t) == 2 * dims * sum(rows) > 0
        want = _min_bytes(strategy, ulysses, layout, t.rank, heads, heads, MLA_DIM, MLA_V_DIM)
        assert t.bytes_sent == want


class _Unpadded(CUDAFlashKernel):
    """Breaks a precondition on purpose: v reaches ATen at its own head dim (the padding switched off)."""

    def varlen_forward(self, q, k, v, seg, causal, scale):
        with mock.patch.object(cuda_flash, "common_head_dim", lambda *tensors: tensors):
            return super().varlen_forward(q, k, v, seg, causal, scale)


def test_an_unpadded_v_is_reported():
    traces = simulate("ring", 4096, 2, 4, 4, 64, [[1000, 3096]], kernel=_Unpadded(), v_head_dim=32)
    assert any("v's head_dim 32 is not q's 64" in v for t in traces for v in t.violations), traces[0].violations
    assert all(_padding_bytes(t) > 0 for t in traces)  # the backward still pads (only the forward is broken)


class _Int64Lengths(CUDAFlashKernel):
    """Breaks a precondition on purpose: int64 cumulative lengths."""

    def varlen_forward(self, q, k, v, seg, causal, scale):
        return super().varlen_forward(q, k, v, type(seg)(seg.cu_q.long(), *list(vars(seg).values())[1:]), causal, scale)


class _NonContiguousHeadDim(CUDAFlashKernel):
    """Breaks a precondition on purpose: q strided in its last dim, with the kernel's own copy of
    strided inputs (``unit_stride``) switched off so that it reaches ATen."""

    def varlen_forward(self, q, k, v, seg, causal, scale):
        q = torch.empty(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=q.dtype, device=q.device)[:, :, ::2]
        with mock.patch.object(cuda_flash, "unit_stride", lambda *tensors: tensors):
            return super().varlen_forward(q, k, v, seg, causal, scale)


class _ReadsOnTheHost(CUDAFlashKernel):
    def varlen_forward(self, q, k, v, seg, causal, scale):
        if seg.cu_q[-1].item() > 0:  # a device-to-host read
            pass
        return super().varlen_forward(q, k, v, seg, causal, scale)


class _CopiesBlocking(CUDAFlashKernel):
    def varlen_forward(self, q, k, v, seg, causal, scale):
        torch.tensor(seg.host_q, dtype=torch.int32).to(q.device)  # a blocking host-to-device copy
        return super().varlen_forward(q, k, v, seg, causal, scale)


@pytest.mark.parametrize(
    "kernel,message",
    [
        (_Int64Lengths, "cum_seq_q must be a contiguous 1-D int32 tensor"),
        (_NonContiguousHeadDim, "q is not contiguous in its last dim"),
    ],
)
def test_a_broken_precondition_is_reported(kernel, message):
    traces = simulate("ring", 4096, 2, 4, 2, 64, [[1000, 3096]], kernel=kernel())
    assert any(message in v for t in traces for v in t.violations), traces[0].violations


@pytest.mark.parametrize(
    "kernel,message", [(_ReadsOnTheHost, "reads a device value"), (_CopiesBlocking, "blocking host-to-device copy")]
)
def test_a_host_sync_in_the_layer_is_caught(kernel, message):
    with pytest.raises(HostSyncError, match=message):
        simulate("ring", 4096, 2, 4, 2, 64, [[1000, 3096]], kernel=kernel())


class _PlansInEveryLayer(CUDAFlashKernel):
    def varlen_forward(self, q, k, v, seg, causal, scale):
        torch.tensor(seg.host_q).cumsum(0)  # host work outside the plans: redone in every layer
        return super().varlen_forward(q, k, v, seg, causal, scale)


def test_host_work_outside_the_plans_is_counted():
    traces = simulate("ring", 4096, 2, 4, 2, 64, [[1000, 3096]], kernel=_PlansInEveryLayer())
    assert all(t.host_ops > 0 for t in traces)
    assert all(t.host_ops == 0 for t in simulate("ring", 4096, 2, 4, 2, 64, [[1000, 3096]]))


@pytest.mark.parametrize("strategy,ulysses", [("ulysses", 1), ("hybrid", 8)])
def test_ulysses_with_fewer_kv_heads_than_ranks_copies_no_head_index_per_layer(strategy, ulysses):
    """With 4 K/V heads over 8 head shards each shard gets one replicated head: the head index is
    built once with the tiles, not copied to the device in every layer (which would raise here)."""
    cp = 8 if strategy == "ulysses" else 16
    traces = simulate(strategy, 8192, cp, HEADS, 4, DIM, [[5000, 3192]], "doc_zigzag", ulysses)
    assert all(t.violations == [] for t in traces)
