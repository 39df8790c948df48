"""Achieved attention-kernel throughput, from published measurements (not fitted to any training run).

The planner times attention at the kernel's own rate, per sequence length and mask, counting
FLOPs as the flash-attention benchmarks count them (per head, ``E`` the head dimension, ``P``
the visible (query, key) pairs)::

    forward   4 E P        (QK^T and PV)
    backward  10 E P       (2.5 x the forward: dV, dP, dS, dQ, dK, with QK^T recomputed)

so that time = FLOPs / rate holds for the very numbers the tables report.

:data:`FA2_H100`: FlashAttention-2 on an H100 80GB SXM5, BF16, head dim 128, batch x seqlen =
16K tokens, hidden 2048: the "FlashAttention-2" bars of Figures 5 and 6 of Shah et al.,
*FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision*
(arXiv:2407.08608, 2024). PyTorch's SDPA flash backend and ``aten._flash_attention_forward``
(titan_cp's CUDA kernel) ship that FlashAttention-2 code. The paper gives the backward
without a causal mask only; the causal backward is taken at the forward's causal/non-causal
ratio at the same length (an assumption, stated). Lengths past 16K read the 16K plateau;
other head dims read the head-dim-128 rows (the Llama 3 family has head dim 128).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TFLOPS = 1e12
FWD_FLOPS_PER_PAIR_DIM = 4  # QK^T + PV, per head and visible pair, times head_dim
BWD_FLOPS_PER_PAIR_DIM = 10  # the flash-attention papers' backward count (2.5 x forward)


@dataclass(frozen=True)
class AttentionRates:
    """Achieved TFLOP/s of one attention kernel on one device, per sequence length (ascending)."""

    name: str
    source: str
    seq_lens: tuple[int, ...]
    forward: tuple[float, ...]  # no mask
    forward_causal: tuple[float, ...]
    backward: tuple[float, ...]  # no mask

    def _at(self, values: tuple[float, ...], seq: float) -> float:
        """``values`` at ``seq``, linear in log2(seq) between the measured lengths, clamped at both ends."""
        lens = self.seq_lens
        if seq <= lens[0]:
            return values[0]
        if seq >= lens[-1]:
            return values[-1]
        i = next(j for j in range(1, len(lens)) if seq <= lens[j])
        t = (math.log2(seq) - math.log2(lens[i - 1])) / (math.log2(lens[i]) - math.log2(lens[i - 1]))
        return values[i - 1] + t * (values[i] - values[i - 1])

    def rate(self, seq: float, causal: bool, backward: bool) -> float:
        """FLOP/s of a kernel call over sequences of ``seq`` tokens (see the module docstring)."""
        fwd = self._at(self.forward, seq)
        fwd_causal = self._at(self.forward_causal, seq)
        if not backward:
            return (fwd_causal if causal else fwd) * TFLOPS
        bwd = self._at(self.backward, seq)
        return (bwd * fwd_causal / fwd if causal else bwd) * TFLOPS

    def peak(self, backward: bool) -> float:
        """The fastest :meth:`rate` at any length, with or without a causal mask (FLOP/s): the rates are
        linear between the measured lengths, so the fastest is at one of them."""
        return max(self.rate(n, causal, backward) for n in self.seq_lens for causal in (False, True))

    def seconds(self, pairs_heads_dim: float, seq: float, causal: bool) -> tuple[float, float]:
        """``(forward, backward)`` seconds of kernel calls over ``pairs x heads x head_dim``."""
        fwd = FWD_FLOPS_PER_PAIR_DIM * pairs_heads_dim / self.rate(seq, causal, False)
        bwd = BWD_FLOPS_PER_PAIR_DIM * pairs_heads_dim / self.rate(seq, causal, True)
        return fwd, bwd


FA2_H100 = AttentionRates(
    name="FlashAttention-2 on H100 SXM5, bf16, head dim 128",
    source="arXiv:2407.08608 (FlashAttention-3), Figures 5 and 6, FlashAttention-2 bars",
    seq_lens=(512, 1024, 2048, 4096, 8192, 16384),
    forward=(309, 350, 362, 368, 370, 370),
    forward_causal=(191, 260, 298, 319, 333, 335),
    backward=(214, 260, 291, 310, 318, 322),
)


def flat_rates(name: str, source: str, tflops: float) -> AttentionRates:
    """One rate for every length and mask (where no per-length measurement is at hand)."""
    one = (tflops,)
    return AttentionRates(name, source, (1,), one, one, one)
