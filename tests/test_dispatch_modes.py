"""Every strategy under the dispatch modes people wrap training in: ``FlopCounterMode`` (for MFU)
and a plain ``TorchDispatchMode`` (debugging). The op's outputs must own their storage (PyTorch
checks that custom-op outputs alias neither the inputs nor each other), and the FLOPs the counter
reports for the op are the visible pairs' (summed over ranks: the whole layer's, split, never repeated)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from tests.dist_utils import cp_mesh, make_inputs
from titan_cp import SequenceLayout, cp_attention
from titan_cp.attention import CPHandle
from titan_cp.attention.tiling import tile_mask

SEQ, HEADS, KV_HEADS, DIM = 96, 4, 2, 8
DOCS = [[40, 1, 31, 24]]
CASES = [("ring", 1), ("allgather", 1), ("ulysses", 1), ("hybrid", 2)]


class PassThrough(TorchDispatchMode):
    """A dispatch mode that only counts what passes through it."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _step(strategy, mesh, layout, rank, mode):
    q, k, v, dout = (layout.shard(x, 2, rank) for x in make_inputs(3, 1, HEADS, KV_HEADS, SEQ, DIM))
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with mode:
        out = cp_attention(q, k, v, mesh, layout, strategy=strategy)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    return [out.detach(), *grads]


def _under_modes(rank, world):
    results = {}
    for strategy, ulysses in CASES:
        mesh = cp_mesh(strategy, world, ulysses)
        r = CPHandle(mesh, strategy).rank
        layout = SequenceLayout(SEQ, world, "doc_zigzag", DOCS)
        plain = _step(strategy, mesh, layout, r, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        passthrough = PassThrough()
        seen = _step(strategy, mesh, layout, r, passthrough)
        counter = FlopCounterMode(display=False)
        counted = _step(strategy, mesh, layout, r, counter)
        flops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
        same = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(plain, seen, counted))
        results[strategy] = (same, passthrough.ops, flops)
    return results


def test_every_strategy_runs_under_flop_counter_and_dispatch_modes(dist_pools):
    world = 4
    per_rank = dist_pools.run(world, _under_modes)
    layout = SequenceLayout(SEQ, world, "doc_zigzag", DOCS)
    total_pairs = tile_mask(layout, None, None, True).pairs(1)
    for strategy, _ in CASES:
        assert all(r[strategy][0] for r in per_rank), f"{strategy}: results differ under a dispatch mode"
        assert all(r[strategy][1] > 0 for r in per_rank)
        fwd = sum(r[strategy][2]["titan_cp.cp_attention"] for r in per_rank)
        bwd = sum(r[strategy][2]["titan_cp.cp_attention_backward"] for r in per_rank)
        assert fwd == 4 * DIM * HEADS * total_pairs, strategy
        assert bwd == 2 * fwd, strategy


@pytest.mark.parametrize("causal", [True, False])
def test_one_device_flops_are_the_visible_pairs(causal):
    from titan_cp import local_attention

    q, k, v, dout = make_inputs(0, 2, HEADS, KV_HEADS, SEQ, DIM)
    q.requires_grad_()
    with FlopCounterMode(display=False) as counter:
        out = local_attention(q, k, v, doc_lens=[[50, 46], [96]], causal=causal)
        out.backward(dout)
    pairs = sum(n * (n + 1) // 2 for n in (50, 46, 96)) if causal else sum(n * n for n in (50, 46, 96))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert counts["titan_cp.cp_attention"] == 4 * DIM * HEADS * pairs
    assert counts["titan_cp.cp_attention_backward"] == 8 * DIM * HEADS * pairs
