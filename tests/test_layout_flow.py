"""The layout flows: a microbatch is sharded by one layout, built once, and the attention op attends
by that same layout (its balance included), found again from the ``doc_lens`` tensor the model gets.

The CP test parallelizes the model with one balance and shards the batch with another: the loss and
every gradient still equal one process's (fp32; 1e-5 relative on the loss, 2e-5 on the gradients).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from titan_cp.layout import get_layout, layout_of
from titan_cp.loss import IGNORE_INDEX, GlobalTokenLoss
from titan_cp.step import Microbatch

DOC_LENS = [[20, 44], [64]]
VOCAB = 64


def _microbatch() -> Microbatch:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, 64), generator=g)
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), IGNORE_INDEX)], 1)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOC_LENS])
    padded = torch.tensor([row + [0] * (2 - len(row)) for row in DOC_LENS])
    return Microbatch(tokens, labels, positions, padded)


def test_a_sharded_microbatch_carries_its_layout_to_the_op():
    full = _microbatch()
    local = full.shard(2, 1, "doc_zigzag")
    assert local.layout is get_layout(64, 2, "doc_zigzag", DOC_LENS)  # built once, shared by every consumer
    assert layout_of(local.doc_lens) is local.layout  # the op finds it from the tensor the model gets
    assert torch.equal(local.local(full.positions), local.positions)  # validation's tensors cut alike
    local.doc_lens.add_(0)  # a changed tensor no longer names the layout
    assert layout_of(local.doc_lens) is None
    assert full.shard(1, 0, "doc_zigzag").doc_lens is full.doc_lens  # one rank: the documents as given


def _sharding_decides(rank, world):
    from titan_cp.attention import cp_rank
    from titan_cp.mesh import ParallelDims
    from titan_cp.model import build_model
    from titan_cp.parallel.build import ParallelizeOptions, cp_mesh, parallelize_llama
    from titan_cp.step import forward_backward

    full = _microbatch()
    loss_fn = GlobalTokenLoss()
    loss_fn.global_valid_tokens = int((full.labels != IGNORE_INDEX).sum())
    torch.manual_seed(0)
    reference = build_model("tiny", vocab_size=VOCAB, device="cpu", n_layers=2)
    ref_loss = forward_backward([reference], full, loss_fn).item()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=world, tp=1, pp=1, world_size=world)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=VOCAB, device="cpu", n_layers=2)
    parallelize_llama(model, dims, ParallelizeOptions(cp_balance="contiguous", ac_mode="none"))
    local = full.shard(world, cp_rank(cp_mesh(dims), "ring"), "doc_zigzag")  # not the model's balance
    loss = forward_backward([model], local, loss_fn)
    dist.all_reduce(loss)
    errors = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        errors[name] = ((g - ref_grads[name]).abs() - 1e-4 * ref_grads[name].abs()).max().item()
    return ref_loss, loss.item(), errors


def test_the_layout_the_batch_was_sharded_by_is_the_one_attended_by(dist_pools):
    for ref_loss, loss, errors in dist_pools.run(2, _sharding_decides, timeout=600):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        bad = {n: e for n, e in errors.items() if not e <= 2e-5}
        assert not bad, bad
