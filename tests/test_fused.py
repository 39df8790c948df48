"""The engine's row updates: the compiled bodies (what runs on CUDA, fused by inductor) equal the
eager ones on this CPU, with repeated destinations, and the custom ops count as one operation each."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_cp.attention import fused, merge


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, t, h, e = 20, 30, 4, 8
    out_acc = torch.randn(n, h, e, generator=g)
    lse_acc = torch.randn(h, n, generator=g)
    lse_acc[:, :5] = float("-inf")  # rows nothing reached yet
    out = torch.randn(t, h, e, generator=g).bfloat16()
    lse = torch.randn(h, t, generator=g)
    rows = torch.tensor([1, 3, 4, 7, 9, 12, 15, 19])
    local = torch.randint(0, len(rows), (t,), generator=g)
    return out_acc, lse_acc, out, lse, rows, local


def test_compiled_merge_equals_eager():
    eager, compiled = _case(), _case()
    merge.merge_rows_(*eager)
    fused._compiled(merge.merge_rows_)(*compiled)
    torch.testing.assert_close(compiled[0], eager[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled[1], eager[1], atol=1e-5, rtol=1e-5)


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
    out_acc, lse_acc, out, lse, rows, local = _case()
    index, src, dst, acc = local[:5], out[:5], torch.empty(20, 4, 8), out_acc[: len(rows)]
    with _Ops() as ops:
        fused.merge_rows(out_acc, lse_acc, out, lse, rows, local)
        fused.add_rows(out_acc, index, src)
        fused.write_rows(dst, rows, acc)
    assert ops.names == ["titan_cp.merge_rows.default", "titan_cp.add_rows.default", "titan_cp.write_rows.default"]
