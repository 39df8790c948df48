"""Public entry points: :func:`cp_attention` across a cp mesh, :func:`local_attention` on one device.

Shapes (SDPA's)::

    q:   (batch, q_heads,  seq_local, head_dim)
    k:   (batch, kv_heads, seq_local, head_dim)     q_heads % kv_heads == 0 (GQA)
    v:   (batch, kv_heads, seq_local, v_dim)        v_dim: v's own (multi-head latent attention: 192 / 128)
    out: (batch, q_heads,  seq_local, v_dim)        in q's dtype

``seq_local`` tokens are this rank's shard under ``layout`` (``layout.shard(x, dim=2, rank)``).
The result on every rank equals the matching rows of full-sequence attention with the
causal and document masks; every strategy is differentiable in q, k and v.

The attention is one ``torch.library`` custom op, ``titan_cp::cp_attention`` (and its
backward, ``titan_cp::cp_attention_backward``), with fake implementations that give the
output shapes: ``torch.compile`` traces a block with CP attention as one graph
(``fullgraph=True``) and calls the op, which runs the strategy's communication and kernels
eagerly. Non-tensor settings (mesh, strategy, balance, kernel) travel as the integer id of a
live :class:`~titan_cp.attention.handle.CPHandle`; the documents travel as the ``doc_lens``
tensor (on the host), by which the handle finds the layout the batch was sharded by.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.flop_counter import register_flop_formula

import titan_cp.attention.allgather  # noqa: F401 - the built-in strategies register as their modules run
import titan_cp.attention.hybrid  # noqa: F401
import titan_cp.attention.ulysses  # noqa: F401
from titan_cp.attention.context import CPContext
from titan_cp.attention.handle import CPHandle, handle_by_id
from titan_cp.attention.kernels import check_kernel
from titan_cp.attention.kernels.base import kernel_head_dim
from titan_cp.attention.pricing import AttentionCall, cost_of
from titan_cp.attention.strategy import DEFAULT_STRATEGY, Strategy, get_strategy
from titan_cp.attention.tiling import CAUSAL, Mask
from titan_cp.layout import DocLens, SequenceLayout, get_layout

T = TypeVar("T")


# ---------------------------------------------------------------------------- checks
def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor (batch, heads, seq, head_dim), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        if 0 in t.shape:
            raise ValueError(f"{name} has an empty dimension: shape {tuple(t.shape)} (batch, heads, seq, head_dim)")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, heads and seq (v's head_dim may "
            "differ: multi-head latent attention)"
        )
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, seq and head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_layout(q: Tensor, layout: SequenceLayout) -> None:
    if q.shape[2] != layout.local_len:
        raise ValueError(
            f"q has {q.shape[2]} tokens per rank but the layout gives each rank {layout.local_len} "
            f"(seq_len {layout.seq_len} / cp_size {layout.cp_size})"
        )
    if layout.batch_size is not None and layout.batch_size != q.shape[0]:
        raise ValueError(f"batch size {q.shape[0]} does not match the layout's {layout.batch_size} doc_lens rows")


def _scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a positive finite number (default 1/sqrt(head_dim)), got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number (default 1/sqrt(head_dim)), got {scale}")
    return scale


# ---------------------------------------------------------------------------- the custom op
_LOCAL: dict[str | None, CPHandle] = {}  # one-device handles, one per kernel name


def local_handle(kernel: str | None = None) -> CPHandle:
    """The one-device handle of ``kernel`` (what a model's attention runs by when no mesh is bound)."""
    if kernel not in _LOCAL:
        _LOCAL[kernel] = CPHandle(None, "ring", "contiguous", kernel)
    return _LOCAL[kernel]


def _assume_constant_result(fn: Callable[..., T]) -> Callable[..., T]:
    """``torch.compiler.assume_constant_result(fn)``: the mark it sets, without importing ``torch._dynamo``
    (1.5 s) when titan_cp is imported (tests/test_hot_path.py checks that the two mark alike)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@_assume_constant_result
def _local_id(kernel: str | None) -> int:
    """:func:`local_handle`'s id, run eagerly even while ``torch.compile`` traces a caller (a graph constant)."""
    return local_handle(kernel).id


class _CallerLayouts(CPHandle):
    """The handle :func:`cp_attention` runs by. Its caller gives the layout with every call, so the op finds
    no registered layout: it takes the layout of the call's documents under this handle's balance, which is
    the layout given (a layout is a function of its sequence length, cp size, balance and documents;
    :func:`~titan_cp.layout.get_layout`, memoised by value, returns the caller's own object when the caller
    took it from there). Nothing is registered per call, so nothing runs outside the op while
    ``torch.compile`` traces a caller."""

    def find(self, seq_len: int, doc_lens: DocLens | None) -> SequenceLayout:
        if self.size == 1:
            return super().find(seq_len, doc_lens)
        return get_layout(seq_len, self.size, self.balance, doc_lens)


_FUNCTIONAL: dict[tuple[DeviceMesh | None, str, str, str | None], CPHandle] = {}


@_assume_constant_result
def _functional_id(
    mesh: DeviceMesh | None,
    strategy: str,
    balance: str,
    kernel: str | None,
    cp_size: int,
    q: tuple[torch.device, torch.dtype, int, int],
    kv_heads: int,
) -> int:
    """Checks :func:`cp_attention`'s settings and returns the id of the handle it runs by: one per setting
    (mesh, strategy, the layout's balance, kernel), kept for the process, as a compiled graph holds the id.
    Run eagerly even while ``torch.compile`` traces a caller (a graph constant, as :func:`_local_id`); its
    ``ValueError`` then reaches the caller wrapped by dynamo, message and all.

    ``cp_size``: the layout's; ``q``: its ``(device, dtype, heads, head_dim)``, the head dim the kernel
    runs at (:func:`~titan_cp.attention.kernels.base.kernel_head_dim`)."""
    device, dtype, q_heads, head_dim = q
    check_kernel(kernel, device, dtype, head_dim)
    if mesh is None and cp_size != 1:
        raise ValueError(f"mesh is None but the layout spreads the sequence over {cp_size} ranks")
    key = (mesh, strategy, balance, kernel)
    if key not in _FUNCTIONAL:  # the handle resolves the strategy (and refuses a mesh of other dims)
        _FUNCTIONAL[key] = _CallerLayouts(mesh, strategy, balance, kernel)
    handle = _FUNCTIONAL[key]
    if mesh is not None:
        handle.strategy_impl.check_mesh(mesh, cp_size, q_heads, kv_heads)
    return handle.id


def _mask(causal: bool, window: int, chunk: int) -> Mask:
    """The op's integers (0: none) as a :class:`Mask`."""
    return Mask(bool(causal), window or None, chunk or None)


def _context(
    handle: int,
    q: Tensor,
    k_heads: int,
    doc_lens: Tensor | None,
    mask: Mask,
    scale: float,
    sinks: Tensor | None = None,
    fake: bool = False,
    kernel_dim: int | None = None,
) -> tuple[CPContext, Strategy]:
    """The call's context: ``q`` (or ``dout``) gives its batch, heads, tokens, device and dtype; ``kernel_dim``
    the head dim its kernel runs at (:func:`~titan_cp.attention.kernels.base.kernel_head_dim`; ``None``:
    ``q``'s)."""
    cp = handle_by_id(handle)
    layout = None if fake else cp.find(q.shape[2] * cp.size, doc_lens)
    dim = q.shape[-1] if kernel_dim is None else kernel_dim
    kernel = None if fake else check_kernel(cp.kernel, q.device, q.dtype, dim)
    ctx = CPContext(cp.mesh, layout, mask, scale, kernel, q.shape[1], k_heads, sinks, _documents(doc_lens))
    return ctx, cp.strategy_impl


def _documents(doc_lens: Tensor | None) -> bool:
    """Whether a row may hold several documents: the ``(B, max_docs)`` tensor is wider than one column
    (its shape, known when the op is traced; one document a row is the causal row itself)."""
    return doc_lens is not None and doc_lens.shape[-1] > 1


def _bshe_like(x: Tensor, e: int | None = None) -> Tensor:
    """An empty ``(B, H, S, E)`` tensor like ``x`` (head dim ``e``; ``None``: x's) stored token-major, the
    strides every op output has."""
    b, h, s, x_e = x.shape
    return x.new_empty((b, s, h, x_e if e is None else e)).transpose(1, 2)


def _owned(outputs: list[Tensor], inputs: tuple[object, ...], layouts: int) -> list[Tensor]:
    """``outputs`` in storage of their own: a custom op's outputs may alias neither its inputs nor
    each other (PyTorch checks it under any ``TorchDispatchMode``). The first ``layouts`` outputs
    (``(B, H, S, E)`` attention tensors) are also made token-major, the strides of the fake
    implementation's. A copy is made only where a strategy's result shares storage or strides differ.
    """
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor)}
    for t in inputs:
        if isinstance(t, (list, tuple)):
            seen.update(x.untyped_storage().data_ptr() for x in t)
    owned = []
    for i, x in enumerate(outputs):
        ptr = x.untyped_storage().data_ptr()
        if ptr in seen or (i < layouts and not x.transpose(1, 2).is_contiguous()):
            y = _bshe_like(x) if i < layouts else torch.empty_like(x)
            y.copy_(x)
            x, ptr = y, y.untyped_storage().data_ptr()
        seen.add(ptr)
        owned.append(x)
    return owned


@torch.library.custom_op("titan_cp::cp_attention", mutates_args=())
def _cp_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_lens: Tensor | None,
    sinks: Tensor | None,
    handle: int,
    causal: bool,
    window: int,
    chunk: int,
    scale: float,
) -> list[Tensor]:
    dim = kernel_head_dim(q.shape[-1], v.shape[-1])
    ctx, strategy = _context(
        handle, q, k.shape[1], doc_lens, _mask(causal, window, chunk), scale, sinks, kernel_dim=dim
    )
    with torch.autocast(q.device.type, enabled=False):  # the kernels choose their own precision
        out, saved = strategy.forward(ctx, q, k, v)
    return _owned([out, *saved], (q, k, v, doc_lens, sinks), layouts=1)


@_cp_attention_op.register_fake
def _(q, k, v, doc_lens, sinks, handle, causal, window, chunk, scale):
    ctx, strategy = _context(handle, q, k.shape[1], doc_lens, _mask(causal, window, chunk), scale, sinks, fake=True)
    return [_bshe_like(q, v.shape[-1]), *strategy.saved_like(ctx, q, k, v)]


@torch.library.custom_op("titan_cp::cp_attention_backward", mutates_args=())
def _cp_attention_backward_op(
    dout: Tensor,
    q: Tensor | None,
    k: Tensor | None,
    v: Tensor | None,
    out: Tensor | None,
    saved: list[Tensor],
    doc_lens: Tensor | None,
    sinks: Tensor | None,
    handle: int,
    causal: bool,
    window: int,
    chunk: int,
    scale: float,
    kv_heads: int,
) -> list[Tensor]:
    """``[dq, dk, dv (, dsinks)]``; ``dout`` is ``(B, H, S, v_dim)``."""
    dim = kernel_head_dim(_qk_dim(handle, q, k, saved), dout.shape[-1])
    ctx, strategy = _context(
        handle, dout, kv_heads, doc_lens, _mask(causal, window, chunk), scale, sinks, kernel_dim=dim
    )
    with torch.autocast(dout.device.type, enabled=False):
        dq, dk, dv, dsinks = strategy.backward(ctx, dout, q, k, v, out, saved)
    if dsinks is not None and sinks is None:
        raise RuntimeError(f"strategy {strategy.name!r} returned a sinks gradient for a call without sinks")
    grads = [dq, dk, dv] + ([] if dsinks is None or sinks is None else [dsinks.to(sinks.dtype)])
    return _owned(grads, (dout, q, k, v, out, saved, doc_lens, sinks), layouts=3)


@_cp_attention_backward_op.register_fake
def _(dout, q, k, v, out, saved, doc_lens, sinks, handle, causal, window, chunk, scale, kv_heads):
    b, _, s, v_dim = dout.shape
    head_dim = _qk_dim(handle, q, k, saved)
    dk, dv = (dout.new_empty((b, s, kv_heads, e)).transpose(1, 2) for e in (head_dim, v_dim))
    return [_bshe_like(dout, head_dim), dk, dv] + ([] if sinks is None else [torch.empty_like(sinks)])


def _qk_dim(handle: int, q: Tensor | None, k: Tensor | None, saved: list[Tensor]) -> int:
    """q/k's head dim in the backward, which may keep neither (the strategy reads it from what it saved)."""
    return handle_by_id(handle).strategy_impl.qk_head_dim(q, k, saved)


_ARGS = ("doc_lens", "sinks", "handle", "causal", "window", "chunk", "scale")


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    keeps = handle_by_id(rest[_ARGS.index("handle")]).strategy_impl.kept(_documents(rest[_ARGS.index("doc_lens")]))
    kept = [t if name in keeps else None for name, t in (("q", q), ("k", k), ("v", v), ("out", output[0]))]
    ctx.kept = [name for name, t in zip(("q", "k", "v", "out"), kept) if t is not None]
    ctx.save_for_backward(*(t for t in kept if t is not None), *output[1:])
    ctx.args, ctx.kv_heads = rest, k.shape[1]


def _backward(ctx, grads):
    saved = list(ctx.saved_tensors)
    kept = {name: saved.pop(0) for name in ctx.kept}
    doc_lens, sinks, *settings = ctx.args
    grads = _cp_attention_backward_op(
        grads[0],
        kept.get("q"),
        kept.get("k"),
        kept.get("v"),
        kept.get("out"),
        saved,
        doc_lens,
        sinks,
        *settings,
        ctx.kv_heads,
    )
    dsinks = grads[3] if sinks is not None else None
    return grads[0], grads[1], grads[2], None, dsinks, None, None, None, None, None


_cp_attention_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------- FLOPs
def local_head_pairs(handle: int, q: Tensor, kv_heads: int, doc_lens: Tensor | None, mask: Mask) -> int:
    """Visible (query, key) pairs times heads that this rank's kernels compute in one CP attention call
    (its strategy's cost object: :meth:`~titan_cp.attention.pricing.StrategyCost.local_head_pairs`)."""
    cp = handle_by_id(handle)
    layout = cp.find(q.shape[2] * cp.size, doc_lens)
    b, h, s, e = q.shape
    call = AttentionCall(cp.size, h, kv_heads, e, cp.ulysses_degree, b, s, q.element_size(), layout, mask)
    return cost_of(cp.strategy_impl).local_head_pairs(call, cp.rank)


@register_flop_formula(torch.ops.titan_cp.cp_attention, get_raw=True)
def _cp_attention_flops(q, k, v, doc_lens, sinks, handle, causal, window, chunk, scale, *a, out_val=None, **kw) -> int:
    """``QK^T`` and ``PV`` over the visible pairs only: ``2 * (head_dim + v_dim)`` per pair and head
    (masked-out and empty tiles are never computed, so they are not counted; a kernel's zero padding of v
    is not useful work, so not counted either)."""
    dims = q.shape[-1] + v.shape[-1]
    return 2 * dims * local_head_pairs(handle, q, k.shape[1], doc_lens, _mask(causal, window, chunk))


@register_flop_formula(torch.ops.titan_cp.cp_attention_backward, get_raw=True)
def _cp_attention_backward_flops(
    dout, q, k, v, out, saved, doc_lens, sinks, handle, causal, window, chunk, scale, kv_heads, *a, out_val=None, **kw
) -> int:
    """Twice the forward (``dQ, dK`` at q/k's head dim, ``dV, dP`` at v's: four products per pair), the
    convention of PyTorch's SDPA backward formula (the recomputation of ``P`` is not counted)."""
    dims = _qk_dim(handle, q, k, saved) + dout.shape[-1]
    return 4 * dims * local_head_pairs(handle, dout, kv_heads, doc_lens, _mask(causal, window, chunk))


# ---------------------------------------------------------------------------- public functions
def _is_bool(value: object) -> bool:
    """A Python or NumPy boolean (``bool(value)`` is then the flag meant)."""
    return isinstance(value, bool) or type(value).__name__ == "bool_"


def check_mask(causal: bool, window: int | None, chunk: int | None, sinks: Tensor | None, q_heads: int) -> Mask:
    """The :class:`Mask` of ``causal``, ``window`` and ``chunk``, checked, with ``sinks`` (``ValueError``
    naming the argument)."""
    if not _is_bool(causal):  # a string such as "no" would be truthy: causal attention, silently
        raise ValueError(f"causal must be True or False, got {causal!r}")
    for name, value in (("window", window), ("chunk", chunk)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer (None: no {name}), got {value!r}")
    if window is not None and not causal:
        raise ValueError("window is a causal sliding window: it needs causal=True")
    if sinks is not None:
        if not isinstance(sinks, Tensor) or sinks.dim() != 1 or sinks.shape[0] != q_heads:
            shape = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
            raise ValueError(f"sinks must be a ({q_heads},) tensor: one logit per query head, got {shape}")
        if not sinks.dtype.is_floating_point:
            raise ValueError(f"sinks must be floating point, got {sinks.dtype}")
    return Mask(bool(causal), window, chunk)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    handle: int,
    doc_lens: Tensor | None,
    causal: bool,
    scale: float,
    window: int | None = None,
    chunk: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """The op itself, for callers that checked their inputs (``ContextParallel``): traceable by ``torch.compile``."""
    return _cp_attention_op(q, k, v, doc_lens, sinks, handle, causal, window or 0, chunk or 0, scale)[0]


def cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mesh: DeviceMesh | None,
    layout: SequenceLayout,
    strategy: str = DEFAULT_STRATEGY,
    causal: bool = True,
    scale: float | None = None,
    kernel: str | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact attention for this rank's query shard, with the K/V of every rank of ``mesh``.

    Args:
        q, k, v: local shards, see the module docstring.
        mesh: the cp :class:`~torch.distributed.device_mesh.DeviceMesh`: 1-D, or 2-D
            ``(ring, ulysses)`` for ``"hybrid"`` (names ``cp_ring``/``cp_ulysses`` are honoured).
            ``None`` runs on one device (``layout.cp_size`` must be 1).
        layout: the :class:`~titan_cp.SequenceLayout` the shards were taken with.
        strategy: ``"ring"``, ``"allgather"``, ``"ulysses"`` or ``"hybrid"``.
        causal: causal mask (inside each document when the layout has documents).
        scale: softmax scale, ``1/sqrt(head_dim)`` by default; a positive finite number.
        kernel: local kernel name (``"cpu_varlen"``, ``"cpu_flash"``, ``"cuda_flash"``, ``"flash_attn"``, ``"math"``,
            or one added with ``register_kernel``); ``None`` picks the fastest for the device and dtype.
        window: sliding window (causal): a query sees the keys at most ``window - 1`` positions back
            in its document (Mistral, Gemma, gpt-oss); ``None``: no window.
        chunk: chunked attention (Llama 4): a query sees only the keys of its own ``chunk``-sized
            piece of its document, counted from the document's start; ``None``: no chunks.
        sinks: ``(q_heads,)`` learned per-head logits that join every query's softmax denominator
            (gpt-oss), differentiable; ``None``: no sinks.
    """
    get_strategy(strategy)
    check_qkv(q, k, v)
    _check_layout(q, layout)
    mask = check_mask(causal, window, chunk, sinks, q.shape[1])
    scale = _scale(scale, q.shape[-1])
    settings = (q.device, q.dtype, q.shape[1], kernel_head_dim(q.shape[-1], v.shape[-1]))
    handle = _functional_id(mesh, strategy, layout.balance, kernel, layout.cp_size, settings, k.shape[1])
    return attend(q, k, v, handle, layout.documents, mask.causal, scale, mask.window, mask.chunk, sinks)


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_lens: DocLens | None = None,
    causal: bool = True,
    scale: float | None = None,
    kernel: str | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact single-device attention with causal, packed-document, window, chunk and sink masks.

    ``doc_lens``: ``None``, one list of document lengths per batch row, or a zero-padded
    ``(batch, max_docs)`` integer tensor on the host. GQA K/V are taken as they are; the other
    arguments as for :func:`cp_attention`.
    """
    check_qkv(q, k, v)
    mask = check_mask(causal, window, chunk, sinks, q.shape[1])
    if doc_lens is None or isinstance(doc_lens, Tensor):  # the model's path: straight to the op, traceable
        return attend(
            q, k, v, _local_id(kernel), doc_lens, mask.causal, _scale(scale, q.shape[-1]), window, chunk, sinks
        )
    layout = get_layout(q.shape[2], 1, "contiguous", doc_lens)
    return cp_attention(
        q, k, v, None, layout, causal=causal, scale=scale, kernel=kernel, window=window, chunk=chunk, sinks=sinks
    )


def min_bytes_per_rank(
    strategy: str,
    q: Tensor,
    k: Tensor,
    world: int,
    ulysses_size: int = 1,
    backward: bool = True,
    layout: SequenceLayout | None = None,
    rank: int | None = None,
    mask: Mask | None = None,
    v: Tensor | None = None,
) -> int:
    """The bytes a rank sends for one forward (+ backward) on these local shapes: with ``layout``, what the
    ranks need of each other under it (``rank``; ``None``: the rank sending most), else the dense case
    (the strategy's cost object: :meth:`~titan_cp.attention.pricing.StrategyCost.min_bytes`); ``v``: shaped
    like ``k`` when ``None`` (a value head dim of its own counts V and the output at it)."""
    call = AttentionCall.of(q, k, world, ulysses_size, layout, CAUSAL if mask is None else mask, v)
    return cost_of(strategy).min_bytes(call, backward, rank)
