"""The hot path: host work per ring step that does not grow with the number of documents,
and a CP block that compiles whole.

Counting is not timing: these tests count kernel calls and the tensor operations
dispatched around them (a ``TorchDispatchMode``), never seconds.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.host import counting_kernel
from tests.dist_utils import cp_mesh, make_inputs
from titan_cp.attention import CPHandle, api, attention_schedule
from titan_cp.attention.tiling import CAUSAL

SEQ = 2048  # room for 1,000 documents; the counts do not depend on the length


# a native-varlen kernel (segments looped on the CPU kernel) that counts its calls
KERNEL = counting_kernel("cpu_flash", native_varlen=True)


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched outside the kernel (it runs with the modes set aside)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _docs(n: int, seed: int = 0) -> list[int]:
    """``n`` documents of random lengths filling ``SEQ`` tokens."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, SEQ), n - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [SEQ])]


def _steps(strategy: str, mesh, layout) -> int:
    """Blocks of keys each rank attends in turn: ring steps, or one gathered buffer; the head exchanges
    run the ring over every cp rank where the documents stay home (their schedule is the ring's)."""
    if attention_schedule(strategy, mesh.size(), layout, CAUSAL, 1) == "ring":
        return mesh.size()
    if strategy == "hybrid":
        return mesh.size(0)
    return 1


def _count(rank, world, strategy, ulysses, n_docs):
    """One forward + backward of the strategy's own functions (inside the op) with the counting kernel."""
    mesh = cp_mesh(strategy, world, ulysses)
    cp = CPHandle(mesh, strategy, "doc_zigzag", KERNEL.name)
    layout, doc_lens = cp.register(SEQ, [_docs(n_docs)])
    q, k, v, dout = (layout.shard(x, 2, cp.rank) for x in make_inputs(0, 1, 4, 2, SEQ, 8))
    ctx, module = api._context(cp.id, q, k.shape[1], doc_lens, True, 0.35)
    layout.memo(("warm",), lambda: module.forward(ctx, q, k, v))  # tiles and device indices: once per microbatch
    KERNEL.calls.clear()
    with OpCounter() as counter:
        out, saved = module.forward(ctx, q, k, v)
        module.backward(ctx, dout, q, k, v, out, saved)
    calls = {"forward": KERNEL.calls["varlen_forward"], "backward": KERNEL.calls["varlen_backward"]}
    return calls, counter.ops, _steps(strategy, mesh, layout)


STRATEGY_MESHES = [("ring", 4, 1), ("allgather", 4, 1), ("ulysses", 2, 1), ("hybrid", 4, 2)]


@pytest.mark.parametrize("strategy,world,ulysses", STRATEGY_MESHES)
def test_varlen_calls_per_step_and_host_ops_do_not_grow_with_documents(dist_pools, strategy, world, ulysses):
    """At most one kernel call per causal flag per step, and the operations around the kernel
    stay the same (within 50%) from 10 to 1,000 documents."""
    ops = {}
    for n_docs in (1, 10, 100, 1000):
        for rank, (calls, n_ops, steps) in enumerate(dist_pools.run(world, _count, strategy, ulysses, n_docs)):
            assert calls["forward"] <= 2 * steps, (n_docs, rank, calls, steps)
            assert calls["backward"] <= 2 * steps, (n_docs, rank, calls, steps)
            assert calls["forward"] >= 1
            ops[n_docs, rank] = n_ops
    for rank in range(world):
        few, many = ops[10, rank], ops[1000, rank]
        assert many <= 1.5 * few, f"rank {rank}: {few} operations around the kernel with 10 documents, {many} with 1000"


# ---------------------------------------------------------------------------- compile
def _model_pair(seed: int = 0):
    from titan_cp.families.llama3 import build_model

    torch.manual_seed(seed)
    eager = build_model("tiny", device="cpu")
    compiled = build_model("tiny", device="cpu")
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def _packed(rows: list[list[int]]):
    seq = sum(rows[0])
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (len(rows), seq), generator=g)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    width = max(len(r) for r in rows)
    doc_lens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    return tokens, positions, doc_lens


def _compiled_matches_eager(rank, world, strategy, backend):
    """Every block compiled with fullgraph=True (a graph break would raise) gives the eager logits and gradients."""
    from titan_cp.parallel import apply_compile, apply_cp
    from titan_cp.step import Microbatch

    torch._dynamo.reset()
    eager, compiled = _model_pair()
    tokens, positions, doc_lens = _packed([[10, 30, 24], [64]])
    if world > 1:
        cp = apply_cp(eager, cp_mesh(strategy, world), strategy, "doc_zigzag")
        apply_cp(compiled, cp)  # both models run by one handle
        local = cp.shard(Microbatch(tokens, tokens, positions, doc_lens))
        tokens, positions, doc_lens = local.tokens, local.positions, local.doc_lens
    apply_compile(compiled, backend=backend, fullgraph=True)
    for _ in range(2):  # the second call reuses the compiled graphs
        compiled.zero_grad()
        out_c = compiled(tokens, positions=positions, doc_lens=doc_lens)
        out_c.square().mean().backward()
    out = eager(tokens, positions=positions, doc_lens=doc_lens)
    out.square().mean().backward()
    grads = [(p.grad - pc.grad).abs().max().item() for p, pc in zip(eager.parameters(), compiled.parameters())]
    return (out - out_c).abs().max().item(), max(grads)


@pytest.mark.parametrize(
    "world,strategy,backend", [(1, "ring", "aot_eager"), (2, "ring", "aot_eager"), (2, "ulysses", "aot_eager")]
)
def test_block_with_cp_attention_compiles_whole(dist_pools, world, strategy, backend):
    for out_err, grad_err in dist_pools.run(world, _compiled_matches_eager, strategy, backend, timeout=600):
        assert out_err <= 1e-5 and grad_err <= 1e-5, (out_err, grad_err)


def _functional_block_matches_eager(rank, world, strategy, backend):
    """A block that calls :func:`cp_attention` itself (a custom model's path, no ``apply_cp``), compiled with
    fullgraph=True, gives the eager output and gradients; a batch with other documents reuses the graph.
    Returns (output error, gradient error, graphs compiled) over both batches."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from titan_cp import SequenceLayout, cp_attention

    torch._dynamo.reset()
    mesh = cp_mesh(strategy, world) if world > 1 else None
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 48)  # q, k, v: 2 heads of 8

    def block(x, layout):
        b, s, _ = x.shape
        q, k, v = proj(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        return cp_attention(q, k, v, mesh, layout, strategy=strategy, window=24).square().mean()

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    errors = []
    for rows in ([[10, 30, 24], [64]], [[40, 16, 8], [32, 32]]):  # other documents, the same width
        layout = SequenceLayout(64, world, "doc_zigzag", rows)
        x = layout.shard(torch.randn(2, 64, 16), 1, rank).requires_grad_()
        grads = []
        for fn in (block, compiled):
            x.grad = proj.weight.grad = None
            loss = fn(x, layout)
            loss.backward()
            grads.append((loss.detach(), x.grad, proj.weight.grad))
        (loss, *g), (loss_c, *g_c) = grads
        errors.append(((loss - loss_c).abs().item(), max((a - b).abs().max().item() for a, b in zip(g, g_c))))
    return max(e[0] for e in errors), max(e[1] for e in errors), counter.frame_count


# inductor at CP 1: its lowering of the op, forward and backward, in a graph of a few kernels (a whole model block's
# dozens, test_block_with_cp_attention_compiles_whole's, go through aot_eager: the same op, the same fakes); aot_eager
# at CP 2: dynamo's full graph and AOTAutograd's, what the functional path's compile needs to hold
@pytest.mark.parametrize("world,strategy,backend", [(1, "ring", "inductor"), (2, "ring", "aot_eager")])
def test_a_block_calling_cp_attention_compiles_whole(dist_pools, world, strategy, backend):
    for out_err, grad_err, graphs in dist_pools.run(world, _functional_block_matches_eager, strategy, backend):
        assert out_err <= 1e-6 and grad_err <= 1e-6, (out_err, grad_err)
        assert graphs == 1, f"{graphs} graphs: a batch with other documents must reuse the compiled graph"


def test_the_local_handles_id_is_marked_as_torch_compiler_marks_a_constant_result():
    """titan_cp marks :func:`api._local_id` itself (importing ``torch._dynamo`` costs 1.5 s at import): the
    mark must be the one ``torch.compiler.assume_constant_result`` sets (that importing titan_cp imports no
    dynamo is tests/test_imports.py's stage 2)."""

    def reference(kernel):
        return kernel

    def ours(kernel):
        return kernel

    torch.compiler.assume_constant_result(reference)
    api._assume_constant_result(ours)
    assert vars(ours) == vars(reference) and vars(ours)
    assert vars(api._local_id) == vars(reference)
