"""Bad input gives a ValueError naming the problem; communication equals each strategy's minimum."""

import pytest
import torch

from tests.dist_utils import cp_mesh, make_inputs
from titan_cp import SequenceLayout, cp_attention
from titan_cp.attention import CPHandle, min_bytes_per_rank
from titan_cp.attention.comm import count_comm


def _bad_inputs(rank, world):
    mesh = cp_mesh("ring", world)
    mesh2 = cp_mesh("hybrid", world, 2)
    layout = SequenceLayout(16, world, "zigzag")
    q = torch.randn(1, 4, 4, 8)
    k = torch.randn(1, 2, 4, 8)
    cases = [
        (lambda: cp_attention(q, k, k, mesh, layout, strategy="spiral"), "unknown cp attention strategy 'spiral'"),
        (lambda: cp_attention(q, k, k[:, :, :2], mesh, layout), "must agree in batch, heads and seq"),
        (lambda: cp_attention(q, k[:, :, :2], k[:, :, :2], mesh, layout), "must agree in batch, seq and head_dim"),
        (
            lambda: cp_attention(q, torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8), mesh, layout),
            r"q heads \(4\) must be a multiple",
        ),
        (lambda: cp_attention(q, k.double(), k.double(), mesh, layout), "must share a dtype"),
        (lambda: cp_attention(q[0], k, k, mesh, layout), r"q must be \(batch, heads, seq, head_dim\)"),
        (
            lambda: cp_attention(q[:, :, :2], k[:, :, :2], k[:, :, :2], mesh, layout),
            "q has 2 tokens per rank but the layout gives each rank 4",
        ),
        (lambda: cp_attention(q, k, k, mesh2, layout, strategy="ring"), "needs a 1-D cp mesh, got a 2-D mesh"),
        (lambda: cp_attention(q, k, k, mesh, layout, strategy="hybrid"), "needs a 2-D cp mesh, got a 1-D mesh"),
        (lambda: cp_attention(q, k, k, mesh, SequenceLayout(4, 1, "zigzag")), "the layout was built for cp_size 1"),
        (
            lambda: cp_attention(q, k, k, mesh, SequenceLayout(16, 4, "doc_zigzag", [[8, 8], [16]])),
            "batch size 1 does not match",
        ),
        (
            lambda: cp_attention(
                torch.randn(1, 6, 4, 8),
                torch.randn(1, 6, 4, 8),
                torch.randn(1, 6, 4, 8),
                mesh,
                layout,
                strategy="ulysses",
            ),
            r"query heads \(6\) to be divisible by its cp size \(4\)",
        ),
        (
            lambda: cp_attention(
                torch.randn(1, 12, 4, 8),
                torch.randn(1, 6, 4, 8),
                torch.randn(1, 6, 4, 8),
                mesh,
                layout,
                strategy="ulysses",
            ),
            r"K/V heads \(6\) to divide, or be divisible by, its cp size \(4\)",
        ),
        (lambda: cp_attention(q, k, k, mesh, layout, scale=0.0), "scale must be a positive finite number"),
        (lambda: cp_attention(q, k, k, mesh, layout, scale=float("nan")), "scale must be a positive finite number"),
        (lambda: cp_attention(q[..., :0], k[..., :0], k[..., :0], mesh, layout), "q has an empty dimension"),
        (lambda: cp_attention(q[:, :0], k[:, :0], k[:, :0], mesh, layout), "q has an empty dimension"),
        (
            lambda: cp_attention(q, k, k, mesh, layout, kernel="cuda_flash"),
            "runs on cuda tensors, but q, k, v are on cpu",
        ),
        (lambda: cp_attention(q, k, k, mesh, layout, kernel="nope"), "unknown attention kernel 'nope'"),
        (lambda: cp_attention(q.long(), k.long(), k.long(), mesh, layout), "floating-point"),
        (lambda: cp_attention(q, k, k, mesh, layout, scale="0.1"), "scale must be a positive finite number"),
        (lambda: cp_attention(q.numpy(), k, k, mesh, layout), "q must be a torch.Tensor"),
        (lambda: SequenceLayout(64, True), "cp_size must be a positive integer, got True"),
        (lambda: SequenceLayout(True, 1), "seq_len must be a positive integer, got True"),
        (lambda: cp_attention(q, k, k, mesh, layout, window=0), "window must be a positive integer"),
        (lambda: cp_attention(q, k, k, mesh, layout, causal="no"), "causal must be True or False, got 'no'"),
        (lambda: cp_attention(q, k, k, mesh, layout, sinks=torch.zeros(2)), r"sinks must be a \(4,\) tensor"),
    ]
    import re

    failures = []
    for fn, match in cases:
        try:
            fn()
            failures.append(f"no error for {match!r}")
        except ValueError as e:
            if not re.search(match, str(e)):
                failures.append(f"{match!r} not in {e}")
    return failures


def test_bad_input_raises_value_error_naming_the_problem(dist_pools):
    for failures in dist_pools.run(4, _bad_inputs):
        assert not failures, failures


def test_local_attention_without_mesh_needs_cp_size_1():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="mesh is None but the layout spreads the sequence over 2 ranks"):
        cp_attention(q, q, q, None, SequenceLayout(16, 2))


def _measure_bytes(rank, world, strategy, ulysses, kv_heads, dtype):
    mesh = cp_mesh(strategy, world, ulysses)
    layout = SequenceLayout(32, world, "zigzag")
    q, k, v, dout = make_inputs(0, 2, 8, kv_heads, 32, 8, dtype)
    r = CPHandle(mesh, strategy).rank
    ql, kl, vl = (layout.shard(x, 2, r).requires_grad_() for x in (q, k, v))
    with count_comm() as c:
        out = cp_attention(ql, kl, vl, mesh, layout, strategy=strategy)
        forward = c.bytes_sent
        out.backward(layout.shard(dout, 2, r))
        total = c.bytes_sent
    return (
        forward,
        total,
        min_bytes_per_rank(strategy, ql, kl, world, ulysses, backward=False, layout=layout, rank=r),
        min_bytes_per_rank(strategy, ql, kl, world, ulysses, layout=layout, rank=r),
        min_bytes_per_rank(strategy, ql, kl, world, ulysses),
    )


@pytest.mark.parametrize(
    "strategy,ulysses,kv_heads,dtype",
    [
        ("ring", 1, 2, torch.float32),
        ("ring", 1, 2, torch.bfloat16),
        ("allgather", 1, 2, torch.float32),
        ("ulysses", 1, 4, torch.float32),
        ("ulysses", 1, 1, torch.bfloat16),
        ("hybrid", 2, 2, torch.float32),
        ("hybrid", 2, 1, torch.float32),
    ],
)
def test_bytes_sent_equal_the_strategy_minimum(dist_pools, strategy, ulysses, kv_heads, dtype):
    """GQA K/V travel at their own head count (ulysses replicates only up to one head per rank), and only
    the rows another rank can see travel (a zigzag rank needs half of an earlier rank's K/V): the bytes
    equal the strategy's count for the layout, at most the dense count."""
    for fwd, total, fwd_min, total_min, dense in dist_pools.run(4, _measure_bytes, strategy, ulysses, kv_heads, dtype):
        assert fwd == fwd_min > 0
        assert total == total_min <= dense
