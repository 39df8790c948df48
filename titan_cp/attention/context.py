"""What a strategy needs besides ``q, k, v``: one small object instead of a long argument list.

Every strategy (:mod:`titan_cp.attention.strategy`) has the same shape::

    forward(ctx, q, k, v)                       -> (out, saved)
    backward(ctx, dout, q, k, v, out, saved)     -> (dq, dk, dv, dsinks or None)
    saved_like(ctx, q, k, v)                     -> empty tensors shaped like ``saved``
    kept(documents): the inputs/outputs among ("q", "k", "v", "out") its backward reads (others arrive
                 as None), for a call with or without documents

``q`` is ``(batch, q_heads, seq_local, head_dim)``, ``k`` ``(batch, kv_heads, seq_local, head_dim)``,
``v`` ``(batch, kv_heads, seq_local, v_dim)`` and ``out, dout`` ``(batch, q_heads, seq_local, v_dim)``
(``v_dim``: v's own head dim, multi-head latent attention's, or ``head_dim``); ``saved`` is what the
backward needs beyond them (the log-sum-exp, gathered K/V, head shards), returned as outputs of the
custom op so that autograd and ``torch.compile`` see them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_cp.attention.kernels import AttentionKernel
from titan_cp.attention.tiling import Mask, kernel_mask
from titan_cp.layout import SequenceLayout


@dataclass(frozen=True)
class CPContext:
    """One CP attention call's setting.

    mesh: the cp ``DeviceMesh`` (1-D; 2-D ``(ring, ulysses)`` for hybrid), ``None`` on one device.
    layout: the sequence layout the shards were taken with (``None`` in the fake op, which asks only for shapes).
    mask: causal, window and chunk (:class:`~titan_cp.attention.tiling.Mask`).
    q_heads, kv_heads: the local head counts of q and k/v (the backward may see neither tensor).
    sinks: ``(q_heads,)`` per-head sink logits, or ``None``.
    documents: whether some row of the call holds several documents (``doc_lens`` wider than one
        column): known where ``layout`` is not (the fake op).
    """

    mesh: DeviceMesh | None
    layout: SequenceLayout | None
    mask: Mask
    scale: float
    kernel: AttentionKernel | None  # None in the fake op, like layout
    q_heads: int
    kv_heads: int
    sinks: torch.Tensor | None = None
    documents: bool | None = None  # by default: the layout's packs_documents

    def __post_init__(self) -> None:
        # a kernel that takes the window itself gets windowed tiles (one segment per band)
        object.__setattr__(self, "mask", kernel_mask(self.mask, self.kernel))
        if self.documents is None:
            object.__setattr__(self, "documents", self.layout is not None and self.layout.packs_documents)

    def layout_and_kernel(self) -> tuple[SequenceLayout, AttentionKernel]:
        """``(layout, kernel)`` of a real call (the fake op, which has neither, asks only for shapes)."""
        if self.layout is None or self.kernel is None:
            raise RuntimeError("this CP attention context has no layout and kernel: it serves the fake op's shapes")
        return self.layout, self.kernel

    @property
    def causal(self) -> bool:
        return self.mask.causal

    @property
    def cp_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size()

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group of a 1-D cp mesh."""
        if self.mesh is None:
            raise RuntimeError("a CP attention call without a cp mesh (one device) has no process group")
        return self.mesh.get_group()

    @property
    def rank(self) -> int:
        """This rank's index in a 1-D cp mesh and in the layout."""
        return 0 if self.mesh is None else self.mesh.get_local_rank()
