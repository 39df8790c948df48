"""A counting model of GPU time for one attention layer, from what the engine does on fake CUDA tensors.

:func:`titan_cp.tools.fake_cuda.simulate` runs every rank's forward + backward of one layer at full
size with no arithmetic and counts, per rank: the kernel's segments, the operations outside the
kernel with the HBM bytes they read and write (an index operation by the rows it touches), and the
bytes sent. This module turns the counts into seconds on a device (:data:`titan_cp.plan.GPUS`, the
planner's constants with their sources)::

    kernel     sum over segments of FLOPs / rate       FLOPs: 4 E H P forward, 10 E H P backward
                                                      (P the pairs the kernel computes: its 128 x 128
                                                      blocks touched, so short segments cost whole blocks)
    outside    bytes / HBM bandwidth                   (and with launches: + 2 us per operation, the
                                                      smallest kernel a GPU runs)
    comm       bytes sent / NVLink bandwidth           (reported; the ring overlaps it with the steps)

``rate``: either the kernel's measured throughput per segment length (FlashAttention-2 on H100,
the planner's :data:`~titan_cp.plan.kernels.FA2_H100`: ATen's CUDA flash kernel is that code), or a
flat ``fraction`` of the device's peak (``0.6``: FlashAttention-3's forward + backward on H100 at
head dim 128 and long sequences, arXiv:2407.08608, a faster kernel than ATen ships). The prediction
is the engine's efficiency against one variable-length kernel call over the whole row on one
device, as ``gpu_check``'s simulated ring measures it::

    efficiency = kernel(one call, whole row) / sum over ranks of (kernel_r + outside_r)

``efficiency`` counts the bytes only (the issue that asked for this model counted them so);
``efficiency_with_launches`` adds the per-operation floor: an upper and a lower estimate.
"""

from __future__ import annotations

import math

from titan_cp.attention.mask_plans import Mask, make_plan
from titan_cp.layout import get_layout
from titan_cp.plan.devices import GPUS
from titan_cp.plan.kernels import BWD_FLOPS_PER_PAIR_DIM, FWD_FLOPS_PER_PAIR_DIM
from titan_cp.tools.fake_cuda import simulate

BLOCK = 128  # the flash kernel's tile of queries and keys
OP_FLOOR_S = 2e-6  # the smallest operation a GPU runs


def block_pairs(n: int, m: int, causal: bool) -> int:
    """Pairs the kernel computes for ``n`` queries on ``m`` keys: the 128 x 128 blocks it visits, whole."""
    bq, bk = math.ceil(n / BLOCK), math.ceil(m / BLOCK)
    blocks = bq * (bq + 1) // 2 if causal else bq * bk  # causal segments are square
    return blocks * BLOCK * BLOCK


def kernel_seconds(segments, heads: int, head_dim: int, device: str = "h200", fraction: float | None = None) -> float:
    """Seconds of the kernel calls ``segments`` (``(op, causal, host_q, host_k)``, as the meter records them)."""
    dev = GPUS[device]
    total = 0.0
    for op, causal, host_q, host_k in segments:
        flops_per_pair = (FWD_FLOPS_PER_PAIR_DIM if op == "forward" else BWD_FLOPS_PER_PAIR_DIM) * heads * head_dim
        for (a, b), (c, d) in zip(zip(host_q, host_q[1:]), zip(host_k, host_k[1:])):
            n, m = b - a, d - c
            if not n:
                continue
            rate = dev.peak_flops * fraction if fraction else dev.attention.rate(m, causal, op == "backward")
            total += flops_per_pair * block_pairs(n, m, causal) / rate
    return total


def one_call_segments(seq_len: int, doc_lens, mask: Mask) -> list:
    """The segments of one variable-length call over the whole row on one device, forward and backward."""
    layout = get_layout(seq_len, 1, "contiguous", doc_lens)
    rows = 1 if doc_lens is None else len(doc_lens)
    calls = make_plan(layout, None, None, mask).host_calls(rows)
    return [(op, c.causal, c.host_q, c.host_k) for op in ("forward", "backward") for c in calls]


def predict(
    strategy: str,
    seq_len: int,
    cp: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    doc_lens=None,
    balance: str = "doc_zigzag",
    ulysses_degree: int = 1,
    window: int | None = None,
    chunk: int | None = None,
    device: str = "h200",
    fraction: float | None = None,
) -> dict:
    """One JSON-ready record: per-rank counts and seconds, and the predicted efficiency (module docstring)."""
    dev = GPUS[device]
    traces = simulate(
        strategy, seq_len, cp, heads, kv_heads, head_dim, doc_lens, balance, ulysses_degree, window=window, chunk=chunk
    )
    heads_local = heads // get_ulysses(strategy, cp, ulysses_degree)
    kernel = [kernel_seconds(t.segments, heads_local, head_dim, device, fraction) for t in traces]
    outside = [t.outside_bytes / dev.hbm_bandwidth for t in traces]
    launches = [t.outside_ops * OP_FLOOR_S for t in traces]
    one = kernel_seconds(
        one_call_segments(seq_len, doc_lens, Mask(True, window, chunk)), heads, head_dim, device, fraction
    )
    return {
        "strategy": strategy,
        "balance": balance,
        "seq_len": seq_len,
        "cp": cp,
        "documents": None if doc_lens is None else sum(len(r) for r in doc_lens),
        "window": window,
        "kernel": "flat" if fraction else dev.attention.name,
        "kernel_fraction": fraction,
        "one_call_ms": round(1e3 * one, 3),
        "kernel_ms_all_ranks": round(1e3 * sum(kernel), 3),
        "outside_gb_per_rank_max": round(max(t.outside_bytes for t in traces) / 1e9, 3),
        "outside_ms_all_ranks": round(1e3 * sum(outside), 3),
        "outside_ops_per_rank_max": max(t.outside_ops for t in traces),
        "comm_gb_per_rank_max": round(max(t.bytes_sent for t in traces) / 1e9, 3),
        "comm_ms_per_rank_max": round(1e3 * max(t.bytes_sent for t in traces) / dev.intra_bw, 3),
        "efficiency": round(one / (sum(kernel) + sum(outside)), 4),
        "efficiency_with_launches": round(one / (sum(kernel) + sum(outside) + sum(launches)), 4),
        "straggler_efficiency": round(one / (cp * max(a + b for a, b in zip(kernel, outside))), 4),
    }


def get_ulysses(strategy: str, cp: int, ulysses_degree: int) -> int:
    """Ranks that split each rank's heads (the kernel runs ``heads / this`` heads)."""
    from titan_cp.attention.strategy import get_strategy  # noqa: PLC0415

    return get_strategy(strategy).ulysses_size(cp, ulysses_degree)
