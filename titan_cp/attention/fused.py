"""The engine's row updates as single operations: fused on CUDA, plain on CPU.

The updates that touch the fp32 accumulators outside the kernel, each a few elementwise passes
when written in eager PyTorch::

    merge_into   several steps' packed (out, lse) and an earlier partial, merged at once into the
                 result rows (or accumulator slots) through their log-sum-exp
    add_rows     acc[index] += src in fp32 (src in any dtype)
    add_into     several steps' packed gradients and an earlier partial, summed at once in fp32
    write_rows   dst[index] = acc in dst's dtype

Each is one ``torch.library`` custom op (``titan_cp::merge_into``, ...), so that autograd, compile
and dispatch modes see one operation with the bytes it must move: on CUDA its body is compiled
by ``torch.compile`` (inductor: the gathers, the arithmetic and the scatter of one update fused
into generated kernels, not one pass per elementwise step); on CPU it runs the eager code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from titan_cp.attention import merge


def _add(acc: Tensor, index: Tensor, src: Tensor) -> None:
    acc.index_add_(0, index, src.to(acc.dtype))


def _write(dst: Tensor, index: Tensor, acc: Tensor) -> None:
    dst.index_copy_(0, index, acc.to(dst.dtype))


@functools.cache
def _compiled(fn: Callable[..., None], backend: str = "inductor") -> Callable[..., None]:
    return torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)


# Compiled variants of one update: one per number of partials in its lists (dynamo specialises on a
# list's length) times its optional arguments. Past the limit an update runs eager (exact, unfused).
RECOMPILE_LIMIT = 64


def compiled_call(fn: Callable[..., None], *args: Any, backend: str = "inductor") -> None:
    """``fn(*args)`` compiled (inductor: the gathers, the arithmetic and the scatter fused), or eager once
    ``fn`` has :data:`RECOMPILE_LIMIT` compiled variants (``fullgraph`` fails hard past dynamo's limit)."""
    try:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            _compiled(fn, backend)(*args)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        fn(*args)


def _run(fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)``, compiled on CUDA (fused, :func:`compiled_call`), eager elsewhere."""
    if args[0].device.type == "cuda":
        compiled_call(fn, *args)
    else:
        fn(*args)


@torch.library.custom_op("titan_cp::merge_into", mutates_args=("dst_out", "dst_lse"))
def merge_into(
    dst_out: Tensor,
    dst_lse: Tensor,
    dst_rows: Tensor,
    acc_out: Tensor | None,
    acc_lse: Tensor | None,
    acc_rows: Tensor | None,
    outs: list[Tensor],
    lses: list[Tensor],
    srcs: list[Tensor],
    places: list[Tensor],
) -> None:
    """:func:`titan_cp.attention.merge.merge_into_` as one operation (shapes there)."""
    _run(merge.merge_into_, dst_out, dst_lse, dst_rows, acc_out, acc_lse, acc_rows, outs, lses, srcs, places)


@merge_into.register_fake
def _(dst_out, dst_lse, dst_rows, acc_out, acc_lse, acc_rows, outs, lses, srcs, places) -> None:
    return None


@torch.library.custom_op("titan_cp::add_into", mutates_args=("dst",))
def add_into(
    dst: Tensor,
    dst_rows: Tensor,
    acc: Tensor | None,
    acc_rows: Tensor | None,
    grads: list[Tensor],
    srcs: list[Tensor],
    places: list[Tensor],
) -> None:
    """:func:`titan_cp.attention.merge.add_into_` as one operation (shapes there)."""
    _run(merge.add_into_, dst, dst_rows, acc, acc_rows, grads, srcs, places)


@add_into.register_fake
def _(dst, dst_rows, acc, acc_rows, grads, srcs, places) -> None:
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
