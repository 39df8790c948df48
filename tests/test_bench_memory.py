"""benchmarks.memory (what scripts/bench_memory.py prints): its counters are exact on hand-computed examples, and on the tiny
model the bytes saved for backward halve from CP 1 to CP 2 (ring, doc_zigzag).

Tolerance for the halving: every per-token tensor halves exactly (both ranks hold 32 of the
64 tokens), and only a few per-rank scalars stay (e.g. the 4-byte ``total_weight`` that
cross-entropy saves), so ``2 * saved(2)`` must be within 1% of ``saved(1)``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks import memory as bm

F32 = 4


def _saved(fn, *tensors, exclude=()):
    with bm.SavedTensorCounter(exclude) as counter:
        out = fn(*tensors)
    return counter, out


def test_saved_counter_mul_exact():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(3, 4, requires_grad=True)
    counter, _ = _saved(lambda a, b: a * b, x, w)
    assert counter.saved_bytes == 2 * 3 * 4 * F32  # mul saves both operands: 96 bytes


def test_saved_counter_chain_and_views_exact():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(3, 4, requires_grad=True)
    # views of x and w are saved, not new storages: still 96 bytes; sin saves its 48-byte input
    counter, _ = _saved(lambda a, b: (a.t() * b.t()).sin(), x, w)
    assert counter.saved_bytes == 2 * 48 + 48
    # two views of one storage count once, with the whole storage (12 floats)
    counter, _ = _saved(lambda a: a[0] * a[1], x)
    assert counter.saved_bytes == 48
    # float64 and no grad on one side: mul saves only the operand the gradient needs (w64)
    x64 = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(5, 2, dtype=torch.float64)
    counter, _ = _saved(lambda a, b: a * b, x64, w64)
    assert counter.saved_bytes == 5 * 2 * 8


class _SaveTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, a.view(-1), b)
        return a + b

    @staticmethod
    def backward(ctx, g):
        return g, g


def test_saved_counter_custom_function_and_params():
    a = torch.randn(6, 7, requires_grad=True)
    b = torch.randn(6, 7, requires_grad=True)
    counter, _ = _saved(_SaveTwice.apply, a, b)
    assert counter.saved_bytes == 2 * 6 * 7 * F32  # a (and its view) once, b once

    lin = nn.Linear(4, 3, bias=False)
    x = torch.randn(5, 4, requires_grad=True)
    counter, _ = _saved(lin, x, exclude=lin.parameters())
    assert counter.saved_bytes == 5 * 4 * F32  # the input; the weight is a parameter
    assert counter.param_bytes == 3 * 4 * F32


def test_checkpointed_block_counts_its_input():
    """Under activation checkpointing a block saves nothing through autograd's hooks; what it keeps
    is its input, which watch_checkpoints counts (here the 5 x 4 fp32 input, nothing else)."""
    from titan_cp.parallel.ac import checkpoint_wrapper

    block = checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh()), preserve_rng_state=False)
    x = torch.randn(5, 4, requires_grad=True)
    counter = bm.SavedTensorCounter(block.parameters())
    handles = counter.watch_checkpoints(nn.Sequential(block))
    with counter:
        block(x).sum().backward()
    for h in handles:
        h.remove()
    assert counter.saved_bytes == 5 * 4 * F32


def test_allocator_trace_exact():
    with bm.allocator_trace() as trace:
        a = torch.empty(1000)  # +4000
        b = torch.empty(2000)  # +8000 -> 12000
        del a  # -4000 -> 8000
        c = torch.empty(500)  # +2000 -> 10000
    assert trace.consistent
    assert (trace.peak, trace.end) == (12000, 10000)
    # without b (held to the end), the peak is a alone
    assert trace.peak_without([b.untyped_storage().data_ptr()]) == 4000
    del b, c


def test_tiny_model_memory_halves_with_cp(dist_pools):
    cfg = dict(
        seq_len=64, batch=1, docs=3, flavor="tiny", vocab_size=bm.BYTE_VOCAB, strategy="ring", balance="doc_zigzag"
    )
    results = {cp: bm.measure_cp(cp, cfg, runner=dist_pools.run) for cp in (1, 2)}
    rows = {r["cp"]: r for r in bm.summarize(results, cfg["seq_len"])}
    s1, s2 = rows[1]["saved_bytes_per_rank"], rows[2]["saved_bytes_per_rank"]
    assert 0 < s2 < s1
    assert 2 * s2 == pytest.approx(s1, rel=0.01)
    for r in results[2]:  # both ranks, not only the larger one
        assert 2 * r["saved_bytes"] == pytest.approx(s1, rel=0.01)
    assert rows[2]["scaling"] >= 0.99
    assert rows[2]["constant_saved_bytes"] <= 0.01 * s2  # same-shape tensors at both degrees
    assert rows[2]["peak_bytes_per_rank"] < rows[1]["peak_bytes_per_rank"]
    assert rows[1]["bytes_sent_per_rank"] == 0 < rows[2]["bytes_sent_per_rank"]  # the ring really ran
    for row in rows.values():
        assert row["alloc_trace_consistent"]
        assert row["grad_bytes"] == row["param_bytes"]
        # nothing but the grads left, and the index tensors the step's layout caches (a few KB)
        assert row["grad_bytes"] <= row["end_bytes"] <= 1.02 * row["grad_bytes"]
        assert row["saved_bytes_per_rank"] < row["peak_bytes_per_rank"]


def test_loss_case_never_holds_whole_logits():
    """``--case loss``: the chunked loss's peak is its gradients plus about one chunk of fp32
    logits (here 1/8 of them); the unchunked reference holds at least the whole fp32 logits.
    Both compute the same loss (fp32, reduction order only: rel 1e-5)."""
    size = dict(tokens=512, vocab=4096, dim=64)
    chunked = bm.measure_loss_memory(**size, chunk_tokens=64)
    whole = bm.measure_loss_memory(**size, unchunked=True)
    chunk_logits = 64 * 4096 * F32
    assert chunked["fp32_logits_bytes"] == 512 * 4096 * F32 == 8 * chunk_logits
    assert chunked["alloc_trace_consistent"] and whole["alloc_trace_consistent"]
    assert chunked["grad_bytes"] < chunked["peak_bytes"] <= chunked["grad_bytes"] + 2 * chunk_logits
    assert whole["peak_bytes"] >= whole["fp32_logits_bytes"]
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=1e-5)
