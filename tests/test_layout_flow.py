"""The layout flows through the CP handle: a microbatch is sharded by the layout of its documents under
the handle's balance, and the attention op finds that layout again from the ``doc_lens`` tensor the
model gets; a batch the handle did not shard is refused, naming the fix; the registry holds the
layouts of the batches in flight only.

The CP test shards with the model's handle: the loss and every gradient equal one process's (fp32;
1e-5 relative on the loss, 2e-5 on the gradients).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from titan_cp.attention import CPHandle
from titan_cp.layout import get_layout
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


def test_one_device_keeps_the_documents_as_given():
    full = _microbatch()
    local = CPHandle(None, balance="doc_zigzag").shard(full)
    assert local.doc_lens is full.doc_lens and local.tokens is full.tokens  # one rank: nothing moves
    assert local.layout is get_layout(64, 1, "doc_zigzag", DOC_LENS)


def test_handles_and_layouts_do_not_outlive_their_users():
    from titan_cp.attention import handle as handle_module
    from titan_cp.layout import _layout

    before = len(handle_module._HANDLES)
    for _ in range(50):
        CPHandle(None, balance="doc_zigzag").shard(_microbatch())
    gc.collect()
    assert len(handle_module._HANDLES) <= before  # a dropped handle leaves nothing behind
    for n in range(40):
        get_layout(64 + 2 * n, 2, "doc_zigzag", [[20, 44 + 2 * n]])
    assert _layout.cache_info().currsize <= 16  # the analysis memo is bounded


def _registry(rank, world):
    """What the handle registers while a batch is in flight, and what the op is refused."""
    from titan_cp.testing import strategy_mesh

    cp = CPHandle(strategy_mesh("ring", world), "ring", "doc_zigzag")
    full = _microbatch()
    local = cp.shard(full, microbatches=2)
    found = cp.find(64, local.doc_lens) is local.layout  # the op finds it from the tensor the model gets
    chunk = cp.find(64, local.doc_lens[1:]).doc_lens == ((64,),)  # a pipeline microbatch's rows
    same = torch.equal(local.local(full.positions), local.positions)  # validation's tensors cut alike
    live = cp.live_layouts()
    errors = []
    # an unsharded batch (its S tokens a rank read as S x cp), and rows the handle never sharded
    for seq, doc_lens in ((64 * world, full.doc_lens), (64, torch.tensor([[32, 32], [64, 0]]))):
        try:
            cp.find(seq, doc_lens)
        except ValueError as e:
            errors.append(str(e))
    other = CPHandle(cp.mesh, "ring", "contiguous")  # a batch of one handle is unknown to another
    try:
        other.find(64, local.doc_lens)
    except ValueError as e:
        errors.append(str(e))
    del local
    gc.collect()
    return found, chunk, same, live, cp.live_layouts(), errors


def test_the_handle_registers_a_batchs_layouts_while_it_lives_and_refuses_others(dist_pools):
    for found, chunk, same, live, after, errors in dist_pools.run(2, _registry):
        assert found and chunk and same
        assert live == 3 and after == 0  # the batch and its 2 microbatches; gone with the batch
        assert len(errors) == 3 and all("cp.shard(batch" in e and "microbatches=N" in e for e in errors)


def _sharding_decides(rank, world):
    from titan_cp.families.llama3 import build_model, parallelize_llama
    from titan_cp.mesh import ParallelDims
    from titan_cp.parallel.build import ParallelizeOptions
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
    cp = parallelize_llama(model, dims, ParallelizeOptions(cp_balance="doc_zigzag", ac_mode="none"))
    stray = CPHandle(cp.mesh, "ring", "contiguous").shard(full)  # sharded by another handle: refused
    try:
        forward_backward([model], stray, loss_fn)
        refused = ""
    except ValueError as e:
        refused = str(e)
    local = cp.shard(full)
    loss = forward_backward([model], local, loss_fn)
    dist.all_reduce(loss)
    errors = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        errors[name] = ((g - ref_grads[name]).abs() - 1e-4 * ref_grads[name].abs()).max().item()
    return ref_loss, loss.item(), errors, refused


def test_the_model_attends_by_the_layout_its_handle_sharded_the_batch_by(dist_pools):
    for ref_loss, loss, errors, refused in dist_pools.run(2, _sharding_decides, timeout=600):
        assert "no layout for these documents on this CP handle" in refused
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        bad = {n: e for n, e in errors.items() if not e <= 2e-5}
        assert not bad, bad
