"""The engine's row updates: the compiled bodies (what runs on CUDA, fused by inductor) equal the
eager ones on this CPU, with repeated destinations, and the custom ops count as one operation each."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from titan_cp.attention import fused, merge


def _case(seed: int = 0, into_acc: bool = False):
    """Two steps' packed partials and an earlier partial merged into 8 of 20 result rows (bf16), or into
    fp32 slots read back from the destination itself (``into_acc``)."""
    g = torch.Generator().manual_seed(seed)
    n, h, e = 20, 4, 8
    acc_out, acc_lse = torch.randn(n, h, e, generator=g), torch.randn(h, n, generator=g)
    rows = torch.tensor([1, 3, 4, 7, 9, 12, 15, 19])
    prior = torch.tensor([2, -1, 5, 0, -1, 11, -1, 3])  # some rows have an earlier partial
    outs, lses, srcs, places = [], [], [], []
    for t in (30, 11):
        outs.append(torch.randn(t, h, e, generator=g).bfloat16())
        lse = torch.randn(h, t, generator=g)
        lse[:, :3] = float("-inf")  # rows that saw no key in this partial
        lses.append(lse)
        srcs.append(torch.randperm(t, generator=g)[: t - 4])
        places.append(torch.randint(0, len(rows), (t - 4,), generator=g))  # repeats allowed
    if into_acc:  # slots, an earlier partial read from the slot itself where it has one
        slots = torch.tensor([2, 6, 5, 0, 8, 11, 10, 3])
        return acc_out, acc_lse, slots, None, None, torch.where(prior >= 0, slots, -1), outs, lses, srcs, places
    dst_out, dst_lse = torch.zeros(n, h, e, dtype=torch.bfloat16), torch.zeros(h, n)
    return dst_out, dst_lse, rows, acc_out, acc_lse, prior, outs, lses, srcs, places


def test_compiled_merge_equals_eager():
    """Into result rows through inductor; into accumulator slots traced only (``aot_eager``: the same
    operations, another variant of the graph, its code generation the first's)."""
    for into_acc, backend in ((False, "inductor"), (True, "aot_eager")):
        eager, compiled = _case(into_acc=into_acc), _case(into_acc=into_acc)
        merge.merge_into_(*eager)
        fused._compiled(merge.merge_into_, backend)(*compiled)
        torch.testing.assert_close(compiled[0], eager[0], atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(compiled[1], eager[1], atol=1e-5, rtol=1e-5)


def test_compiled_group_sum_equals_eager_when_a_partial_is_the_destination():
    """The call whose packed gradient is the whole buffer is adopted as the result and is also a partial of
    the merge that writes into it: every row is read before it is written."""
    g = torch.Generator().manual_seed(2)
    acc = torch.randn(6, 3, 4, generator=g)
    rows, prior = torch.tensor([0, 2, 5, 7]), torch.tensor([1, -1, 4, 0])

    def case():
        adopted = torch.randn(9, 3, 4, generator=torch.Generator().manual_seed(3)).bfloat16()
        other = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(4)).bfloat16()
        return (
            adopted,
            [adopted, other],
            [rows.clone(), torch.tensor([4, 1, 0])],
            [torch.arange(4), torch.tensor([1, 1, 3])],
        )

    adopted, grads, srcs, places = case()
    want = adopted.float().clone()
    want[rows] = adopted.float()[rows] + torch.where((prior >= 0).view(-1, 1, 1), acc[prior.clamp(min=0)], 0.0)
    want[rows] += torch.zeros(4, 3, 4).index_add_(0, places[1], grads[1][srcs[1]].float())
    merge.add_into_(adopted, rows, acc, prior, grads, srcs, places)
    torch.testing.assert_close(adopted.float(), want.bfloat16().float())
    adopted_c, grads_c, srcs_c, places_c = case()
    fused._compiled(merge.add_into_)(adopted_c, rows, acc, prior, grads_c, srcs_c, places_c)
    torch.testing.assert_close(adopted_c, adopted)


def test_compiled_add_and_write_equal_eager():
    g = torch.Generator().manual_seed(1)
    acc = torch.randn(10, 3, 4, generator=g)
    src = torch.randn(16, 3, 4, generator=g).bfloat16()
    index = torch.randint(0, 10, (16,), generator=g)
    want = acc.clone().index_add_(0, index, src.float())
    got = acc.clone()
    fused._compiled(fused._add)(got, index, src)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    dst = torch.zeros(12, 3, 4, dtype=torch.bfloat16)
    rows = torch.tensor([0, 2, 5, 6, 11, 3, 9, 8, 1, 4])
    fused._compiled(fused._write)(dst, rows, acc)
    torch.testing.assert_close(dst[rows], acc.bfloat16())


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_each_update_is_one_operation():
    args = _case()
    dst, rows, acc = torch.empty(20, 4, 8), args[2], args[3]
    src, part = args[6][0][: len(rows)], acc[: len(rows)]
    with _Ops() as ops:
        fused.merge_into(*args)
        fused.add_into(dst, rows, acc, args[5], args[6], args[8], args[9])
        fused.add_rows(acc, rows, src)
        fused.write_rows(dst, rows, part)
    names = ["titan_cp.merge_into.default", "titan_cp.add_into.default", "titan_cp.add_rows.default"]
    assert ops.names == names + ["titan_cp.write_rows.default"]


def test_compiled_group_updates_take_any_number_of_partials(monkeypatch):
    """On CUDA the group updates run compiled with ``fullgraph``: every number of partials is a variant of
    its own, and dynamo fails hard past its recompile limit. Nine numbers of partials past a limit of 4:
    the first four compile (counted), the rest run eager, and every one equals the eager sum. (Tracing is
    what is tested here: ``aot_eager``, not inductor's code generation, which the tests above cover.)"""
    monkeypatch.setattr(fused, "RECOMPILE_LIMIT", 4)
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(5)
    acc = torch.randn(6, 3, 4, generator=g)
    rows, prior = torch.tensor([0, 2, 5, 7]), torch.tensor([1, -1, 4, 0])
    for n in range(1, 10):
        grads = [torch.randn(5, 3, 4, generator=g).bfloat16() for _ in range(n)]
        srcs = [torch.tensor([4, 1, 0]) for _ in range(n)]
        places = [torch.tensor([1, 1, 3]) for _ in range(n)]
        want, got = torch.zeros(9, 3, 4), torch.zeros(9, 3, 4)
        merge.add_into_(want, rows, acc, prior, grads, srcs, places)
        fused.compiled_call(merge.add_into_, got, rows, acc, prior, grads, srcs, places, backend="aot_eager")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 4
    torch._dynamo.reset()
