"""Chunked output projection + cross-entropy against the unchunked loss, on one process and
vocabulary-parallel over tensor-parallel ranks.

Tolerances (fp32): the chunked loss sums per-chunk partial sums and computes the
log-sum-exp itself, the unchunked one sums in one reduction: the same numbers added in a
different order, ~1e-7 relative. Gradients are ``softmax - onehot`` times the same matrices,
chunk by chunk; ``dW`` sums a few hundred tokens' O(1) products (entries up to ~10) in
another order, so entries near zero differ by ~1e-6 absolute. We assert rtol 1e-5 with
atol 1e-6 on losses and 1e-5 on gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.test_parallel import S, full, packed_inputs, reference_grads, tiny
from titan_cp.families.llama3 import apply_tp
from titan_cp.loss import IGNORE_INDEX, GlobalTokenLoss, chunked_cross_entropy_sum, chunked_evaluate, token_loss_sum

TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(n=300, d=32, v=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (0.3 * torch.randn(v, d, generator=g)).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = IGNORE_INDEX
    return h, w, labels


@pytest.mark.parametrize("chunk", [None, 1, 7, 300])
def test_chunked_evaluate_equals_loss_and_argmax_of_the_logits(chunk):
    h, w, labels = _inputs()
    logits = (h @ w.t()).detach()
    ce_sum, predicted = chunked_evaluate(h.detach(), w.detach(), labels, chunk)
    torch.testing.assert_close(ce_sum, token_loss_sum(logits[None], labels[None]), **TOL)
    assert torch.equal(predicted, logits.argmax(-1))


@pytest.mark.parametrize("chunk", [None, 1, 7, 64, 300, 1000])
def test_chunked_loss_and_grads_equal_unchunked(chunk):
    h, w, labels = _inputs()
    loss = chunked_cross_entropy_sum(h, w, labels, chunk)
    dh, dw = torch.autograd.grad(2.5 * loss, (h, w))  # an upstream gradient other than 1
    ref = token_loss_sum((h @ w.t())[None], labels[None])
    ref_dh, ref_dw = torch.autograd.grad(2.5 * ref, (h, w))
    assert loss.dtype == torch.float32 and loss.ndim == 0
    torch.testing.assert_close(loss, ref, **TOL)
    torch.testing.assert_close(dh, ref_dh, **GRAD_TOL)
    torch.testing.assert_close(dw, ref_dw, **GRAD_TOL)


def test_chunked_loss_all_ignored_and_no_grad_for_h():
    h, w, labels = _inputs(n=20)
    loss = chunked_cross_entropy_sum(h, w, torch.full_like(labels, IGNORE_INDEX), 3)
    assert loss.item() == 0.0
    (dw,) = torch.autograd.grad(loss, (w,))
    assert dw.abs().max().item() == 0.0
    h_const = h.detach()  # only the weight wants a gradient
    loss = chunked_cross_entropy_sum(h_const, w, labels, 3)
    (dw,) = torch.autograd.grad(loss, (w,))
    ref = token_loss_sum((h_const @ w.t())[None], labels[None])
    torch.testing.assert_close(dw, torch.autograd.grad(ref, (w,))[0], **GRAD_TOL)


def test_chunked_loss_under_autocast_uses_the_autocast_dtype():
    """bf16 matmuls (as F.linear under autocast), fp32 statistics: within bf16 rounding of fp32."""
    h, w, labels = _inputs(n=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy_sum(h, w, labels, 16)
        ref = token_loss_sum(torch.nn.functional.linear(h, w)[None], labels[None])
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)  # the same bf16 logits, fp32 after
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_model_loss_equals_loss_of_its_logits():
    """``model(tokens, labels=...)`` (chunked inside the output projection) equals the CE of
    ``model(tokens)``'s logits, loss and every parameter's gradient; GlobalTokenLoss takes either."""
    tokens, labels, positions, doc_lens = packed_inputs(2)
    labels[0, :3] = IGNORE_INDEX
    count = int((labels != IGNORE_INDEX).sum())
    model = tiny()
    loss_fn = GlobalTokenLoss()
    loss_fn.global_valid_tokens = count
    ref = loss_fn(model(tokens, positions, doc_lens), labels)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    loss = loss_fn(model(tokens, positions, doc_lens, labels=labels), labels)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, ref, **TOL)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **GRAD_TOL)


def _tp_loss_rank(rank, world, sequence_parallel):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tokens, labels, positions, doc_lens = packed_inputs(2)
    labels[1, S // 2 :] = IGNORE_INDEX
    count = int((labels != IGNORE_INDEX).sum())
    model = tiny()
    # the reference: the same weights, unchunked, one process
    ref_model = tiny()
    ref_loss, ref_grads = reference_grads(ref_model, tokens, labels, positions, doc_lens, count)
    apply_tp(model, mesh, sequence_parallel=sequence_parallel)
    assert isinstance(model.output.weight, DTensor)
    loss_sum = model(tokens, positions, doc_lens, labels=labels)
    assert not isinstance(loss_sum, DTensor) and loss_sum.ndim == 0  # a plain tensor, same on every rank
    loss = loss_sum / count
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            full(p.grad), ref_grads[name], rtol=1e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    # logits still come out whole (no loss parallel)
    logits = model(tokens, positions, doc_lens)
    assert not isinstance(logits, DTensor) and logits.shape == (2, S, 256)
    # evaluation, chunked and vocabulary-parallel: the CE sum and argmax of those logits
    with torch.no_grad():
        ce_sum, predicted = model(tokens, positions, doc_lens, labels=labels, predict=True)
    torch.testing.assert_close(ce_sum, ref_loss * count, rtol=1e-5, atol=1e-4)
    assert torch.equal(predicted, logits.argmax(-1))


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_vocab_parallel_loss_over_tp2_matches_single_process(dist_pools, sequence_parallel):
    dist_pools.run(2, _tp_loss_rank, sequence_parallel)
