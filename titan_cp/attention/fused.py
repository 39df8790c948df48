"""The engine's row updates as single operations: fused on CUDA, plain on CPU.

Three updates touch the fp32 accumulators outside the kernel, each a few elementwise passes
when written in eager PyTorch::

    merge_rows   fold packed (out, lse) into accumulator rows through their log-sum-exp
    add_rows     acc[index] += src in fp32 (src in any dtype)
    write_rows   dst[index] = acc in dst's dtype

Each is one ``torch.library`` custom op (``titan_cp::merge_rows``, ...), so that autograd, compile
and dispatch modes see one operation with the bytes it must move: on CUDA its body is compiled
by ``torch.compile`` (inductor: the gathers, the arithmetic and the scatter of one update fused
into generated kernels, not one pass per elementwise step); on CPU it runs the eager code.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from titan_cp.attention import merge


def _add(acc: Tensor, index: Tensor, src: Tensor) -> None:
    acc.index_add_(0, index, src.to(acc.dtype))


def _write(dst: Tensor, index: Tensor, acc: Tensor) -> None:
    dst.index_copy_(0, index, acc.to(dst.dtype))


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _run(fn, *args) -> None:
    """``fn(*args)``, compiled on CUDA (fused), eager elsewhere."""
    (_compiled(fn) if args[0].device.type == "cuda" else fn)(*args)


@torch.library.custom_op("titan_cp::merge_rows", mutates_args=("out_acc", "lse_acc"))
def merge_rows(out_acc: Tensor, lse_acc: Tensor, out: Tensor, lse: Tensor, rows: Tensor, local: Tensor) -> None:
    """:func:`titan_cp.attention.merge.merge_rows_` as one operation (shapes there)."""
    _run(merge.merge_rows_, out_acc, lse_acc, out, lse, rows, local)


@merge_rows.register_fake
def _(out_acc, lse_acc, out, lse, rows, local) -> None:
    return None


@torch.library.custom_op("titan_cp::add_rows", mutates_args=("acc",))
def add_rows(acc: Tensor, index: Tensor, src: Tensor) -> None:
    """``acc[index] += src`` along dim 0, ``src`` converted to ``acc``'s dtype on the way (repeats add up)."""
    _run(_add, acc, index, src)


@add_rows.register_fake
def _(acc, index, src) -> None:
    return None


@torch.library.custom_op("titan_cp::write_rows", mutates_args=("dst",))
def write_rows(dst: Tensor, index: Tensor, acc: Tensor) -> None:
    """``dst[index] = acc`` along dim 0, ``acc`` converted to ``dst``'s dtype on the way."""
    _run(_write, dst, index, acc)


@write_rows.register_fake
def _(dst, index, acc) -> None:
    return None
