"""Linear-attention layers under context parallelism: the gated delta rule, Mamba2's SSD, the short convolution.

A linear-attention layer needs no keys or values from other ranks: its state after a piece of a document
is an affine function of its state before it, so each rank runs its pieces from the states the pieces
before them leave, and only those ``heads x d_k x d_v`` summaries cross rank boundaries, never the
sequence (:mod:`.plan`). Its short causal convolution takes the ``kernel - 1`` tokens before each piece
from whichever rank holds them. Documents never see each other: every state and halo starts at zero at
a document's start, so a document wholly on one rank exchanges nothing.

Shapes are token-major, as ``transformers`` and ``fla`` hold them::

    gated delta rule   q, k: (batch, seq_local, k_heads, d_k)   v: (batch, seq_local, v_heads, d_v)
                       g, beta: (batch, seq_local, v_heads)     -> (batch, seq_local, v_heads, d_v)
    SSD (Mamba2)       x: (batch, seq_local, heads, head_dim)   dt: (batch, seq_local, heads)   A: (heads,)
                       B, C: (batch, seq_local, groups, d_state) -> (batch, seq_local, heads, head_dim), fp32
    causal conv        x: (batch, seq_local, channels)   weight: (channels, kernel)   bias: (channels,)
                       -> (batch, seq_local, channels)

``seq_local`` tokens are this rank's shard under the layout (every strategy's layout: the linear layers
run on the same shards as the attention layers beside them, whatever their strategy).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from titan_cp.attention.api import _assume_constant_result, _CallerLayouts, local_handle
from titan_cp.attention.handle import CPHandle
from titan_cp.attention.linear import op
from titan_cp.attention.linear.conv import ACTIVATIONS
from titan_cp.layout import DocLens, SequenceLayout, get_layout

CHUNK = 64  # tokens per chunk of the chunked kernels (fla's too)

__all__ = [
    "causal_conv1d",
    "cp_causal_conv1d",
    "cp_gated_delta_rule",
    "cp_ssd",
    "gated_delta_rule",
    "local_causal_conv1d",
    "local_gated_delta_rule",
    "local_ssd",
    "ssd",
]


# ---------------------------------------------------------------------------- checks
def _check(name: str, x: object, dims: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(x.shape)}")
    return x


def _check_tokens(first: Tensor, **others: Tensor) -> None:
    for name, x in others.items():
        if x.shape[:2] != first.shape[:2]:
            raise ValueError(f"{name} {tuple(x.shape)} must agree with the first input in (batch, seq)")
        if x.device != first.device:
            raise ValueError(f"{name} is on {x.device}, the first input on {first.device}: put them on one device")


def _check_chunk(chunk: int) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer (tokens per chunk), got {chunk!r}")
    return chunk


def check_gated_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> None:
    """``ValueError`` naming the argument when the gated delta rule cannot run on these shapes."""
    q, k, v = _check("q", q, 4), _check("k", k, 4), _check("v", v, 4)
    g, beta = _check("g", g, 3), _check("beta", beta, 3)
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    _check_tokens(q, k=k, v=v, g=g, beta=beta)
    if v.shape[2] % q.shape[2]:
        raise ValueError(f"v heads ({v.shape[2]}) must be a multiple of q/k heads ({q.shape[2]})")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape[2] != v.shape[2]:
            raise ValueError(f"{name} must have one entry per value head ({v.shape[2]}), got shape {tuple(x.shape)}")


def check_ssd(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor) -> None:
    """``ValueError`` naming the argument when the SSD cannot run on these shapes."""
    x, dt, a = _check("x", x, 4), _check("dt", dt, 3), _check("A", a, 1)
    b, c = _check("B", b, 4), _check("C", c, 4)
    _check_tokens(x, dt=dt, B=b, C=c)
    if b.shape != c.shape:
        raise ValueError(f"B and C must have the same shape, got {tuple(b.shape)} and {tuple(c.shape)}")
    if x.shape[2] % b.shape[2]:
        raise ValueError(f"heads ({x.shape[2]}) must be a multiple of B/C groups ({b.shape[2]})")
    if dt.shape[2] != x.shape[2] or a.shape[0] != x.shape[2]:
        raise ValueError(
            f"dt and A must have one entry per head ({x.shape[2]}), got {tuple(dt.shape)}, {tuple(a.shape)}"
        )


def check_conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> None:
    """``ValueError`` naming the argument when the causal convolution cannot run on these shapes."""
    x, weight = _check("x", x, 3), _check("weight", weight, 2)
    if weight.shape[0] != x.shape[2]:
        raise ValueError(f"weight must be (channels={x.shape[2]}, kernel), got {tuple(weight.shape)}")
    if bias is not None and tuple(_check("bias", bias, 1).shape) != (x.shape[2],):
        raise ValueError(f"bias must be ({x.shape[2]},), got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _scale(scale: float | None, d_k: int) -> float:
    if scale is None:
        return d_k**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number (default d_k ** -0.5), got {scale!r}")
    return float(scale)


# ---------------------------------------------------------------------------- the ops, for callers that checked
def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, handle: int, doc_lens: Tensor | None,
    scale: float | None = None, qk_l2norm: bool = False, chunk: int = CHUNK, backend: str = "auto",
) -> Tensor:  # fmt: skip
    """The op on checked inputs under the CP handle ``handle`` (an id): traceable by ``torch.compile``.

    ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = S_t^T (scale q_t)``,
    inside each document (``qk_l2norm``: q and k normalised first, as Qwen3.5 and Qwen3-Next do).
    ``backend``: ``"auto"`` (``fla`` on CUDA where installed, else torch), ``"torch"`` or ``"fla"``.

    Through ``fla`` and outside ``torch.compile``, the same arithmetic runs as plain autograd
    (:func:`.op.gated_delta_eager`), so the backward does not recompute the forward; a compiled graph
    calls the custom op, whose backward recomputes it."""
    scale = _scale(scale, q.shape[-1])
    if not torch.compiler.is_compiling() and op.gated_delta_backend(backend, q.device) == "fla":
        return op.gated_delta_eager(q, k, v, g, beta, doc_lens, handle, scale, qk_l2norm)
    return op._gated_delta_op(q, k, v, g, beta, doc_lens, handle, scale, qk_l2norm, chunk, backend)


def ssd(
    x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, handle: int, doc_lens: Tensor | None, chunk: int = CHUNK
) -> Tensor:
    """The op on checked inputs: ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t`` inside each
    document (``dt`` after its bias, softplus and limits; the ``D`` skip and the gate are the caller's)."""
    return op._ssd_op(x, dt, a, b, c, doc_lens, handle, chunk)


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    handle: int,
    doc_lens: Tensor | None,
    activation: str | None = "silu",
) -> Tensor:
    """The op on checked inputs: a depthwise causal convolution inside each document, then ``activation``."""
    return op._conv_op(x, weight, bias, doc_lens, handle, activation or "")


# ---------------------------------------------------------------------------- public functions
_FUNCTIONAL: dict[tuple[DeviceMesh | None, str], CPHandle] = {}


@_assume_constant_result
def _functional_id(mesh: DeviceMesh | None, balance: str, cp_size: int) -> int:
    """The id of the handle the public functions run by, one per (mesh, balance), kept for the process (a
    compiled graph holds the id); the caller gives the layout with every call (as
    :func:`~titan_cp.attention.cp_attention` does). Run eagerly while ``torch.compile`` traces a caller."""
    if mesh is None:
        if cp_size != 1:
            raise ValueError(f"mesh is None but the layout spreads the sequence over {cp_size} ranks")
    elif mesh.size() != cp_size:
        raise ValueError(f"the cp mesh's size is {mesh.size()} but the layout was built for cp_size {cp_size}")
    if (mesh, balance) not in _FUNCTIONAL:
        strategy = "ring" if mesh is None or mesh.ndim == 1 else "hybrid"
        _FUNCTIONAL[(mesh, balance)] = _CallerLayouts(mesh, strategy, balance, None)
    return _FUNCTIONAL[(mesh, balance)].id


def _handle(mesh: DeviceMesh | None, layout: SequenceLayout) -> tuple[int, Tensor | None]:
    """The functional handle's id for ``mesh`` and the documents tensor of ``layout``."""
    return _functional_id(mesh, layout.balance, layout.cp_size), layout.documents


def _check_local(x: Tensor, layout: SequenceLayout) -> None:
    if x.shape[1] != layout.local_len:
        raise ValueError(
            f"the inputs have {x.shape[1]} tokens per rank but the layout gives each rank {layout.local_len} "
            f"(seq_len {layout.seq_len} / cp_size {layout.cp_size})"
        )


def cp_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, mesh: DeviceMesh | None, layout: SequenceLayout,
    scale: float | None = None, qk_l2norm: bool = False, chunk: int = CHUNK, backend: str = "auto",
) -> Tensor:  # fmt: skip
    """The gated delta rule on this rank's shards (shapes: module docstring), exact against the whole
    sequence: each piece of a document starts from the state the pieces before it leave, on any rank.

    Args:
        mesh: the cp ``DeviceMesh`` the shards were taken over (1-D; 2-D for a hybrid attention mesh);
            ``None`` on one device.
        layout: the :class:`~titan_cp.SequenceLayout` of the shards.
        scale: q's scale, ``d_k ** -0.5`` by default.
        qk_l2norm: normalise q and k first (Qwen3.5, Qwen3-Next).
        chunk: tokens per chunk of the torch kernel (a numerical choice: any size gives the same result).
        backend: ``"auto"`` (``fla`` on CUDA where flash-linear-attention is installed, else torch),
            ``"torch"`` or ``"fla"``.
    """
    check_gated_delta(q, k, v, g, beta)
    _check_local(q, layout)
    op.gated_delta_backend(backend, q.device)
    handle, doc_lens = _handle(mesh, layout)
    return gated_delta_rule(q, k, v, g, beta, handle, doc_lens, scale, bool(qk_l2norm), _check_chunk(chunk), backend)


def cp_ssd(
    x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, mesh: DeviceMesh | None, layout: SequenceLayout,
    chunk: int = CHUNK,
) -> Tensor:  # fmt: skip
    """Mamba2's SSD on this rank's shards (shapes: module docstring; ``dt`` after its bias, softplus and
    limits, ``A`` negative), exact against the whole sequence. ``mesh``, ``layout``: as
    :func:`cp_gated_delta_rule`."""
    check_ssd(x, dt, a, b, c)
    _check_local(x, layout)
    handle, doc_lens = _handle(mesh, layout)
    return ssd(x, dt, a, b, c, handle, doc_lens, _check_chunk(chunk))


def cp_causal_conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None, mesh: DeviceMesh | None, layout: SequenceLayout,
    activation: str | None = "silu",
) -> Tensor:  # fmt: skip
    """The short causal depthwise convolution on this rank's shard (shapes: module docstring), exact against
    the whole sequence: each piece reads the ``kernel - 1`` tokens before it in its document from the
    rank that holds them. ``activation``: ``"silu"`` (or ``"swish"``) or ``None``."""
    check_conv(x, weight, bias, activation)
    _check_local(x, layout)
    handle, doc_lens = _handle(mesh, layout)
    return causal_conv1d(x, weight, bias, handle, doc_lens, activation)


def _local_doc_lens(seq: int, doc_lens: DocLens | None) -> Tensor | None:
    return None if doc_lens is None else get_layout(seq, 1, "contiguous", doc_lens).doc_lens_tensor()


def local_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_lens: DocLens | None = None,
    scale: float | None = None, qk_l2norm: bool = False, chunk: int = CHUNK,
) -> Tensor:  # fmt: skip
    """:func:`cp_gated_delta_rule` on one device; ``doc_lens``: the packed documents of each row."""
    check_gated_delta(q, k, v, g, beta)
    docs = _local_doc_lens(q.shape[1], doc_lens)
    return gated_delta_rule(q, k, v, g, beta, local_handle().id, docs, scale, bool(qk_l2norm), _check_chunk(chunk))


def local_ssd(
    x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, doc_lens: DocLens | None = None, chunk: int = CHUNK
) -> Tensor:
    """:func:`cp_ssd` on one device; ``doc_lens``: the packed documents of each row."""
    check_ssd(x, dt, a, b, c)
    return ssd(x, dt, a, b, c, local_handle().id, _local_doc_lens(x.shape[1], doc_lens), _check_chunk(chunk))


def local_causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    doc_lens: DocLens | None = None,
    activation: str | None = "silu",
) -> Tensor:
    """:func:`cp_causal_conv1d` on one device; ``doc_lens``: the packed documents of each row."""
    check_conv(x, weight, bias, activation)
    return causal_conv1d(x, weight, bias, local_handle().id, _local_doc_lens(x.shape[1], doc_lens), activation)
