"""``ContextParallel``: CP attention as a ``ParallelStyle``, applied with ``parallelize_module``.

::

    style = ContextParallel(strategy="ring", balance="doc_local")
    parallelize_module(
        model,
        cp_mesh,                                # 1-D "cp"; 2-D ("cp_ring", "cp_ulysses") for hybrid
        {"layers.*.attention.inner_attention": style},
    )
    local = style.handle.shard(microbatch)      # the one handle: sharding and attention by one layout

The style takes over the forward of the attention core, ``inner_attention(q, k, v, doc_lens, *, scale,
sinks)`` (q ``(B, H, S_local, E)``, k/v ``(B, K, S_local, E)``; ``scale`` ``None``: ``E ** -0.5``; ``sinks``
given with the call, or the module's ``local_sinks()``), keeping the module's mask (``window``, ``chunk``)
where it has them: everything around it (projections, RoPE, norms, MLP) is token-wise and runs on
the local shard unchanged. Inputs may be plain local shards or DTensors placed ``Shard(2)`` on the
cp mesh; the output is of the same kind. As a DTensor, the "global" sequence is the layout's
rank-concatenated order (the shards stacked by rank), the convention of PyTorch's own load-balanced CP.

The batch's document structure arrives as the ``doc_lens`` argument of every call, the
zero-padded ``(B, max_docs)`` tensor *on the host* that the handle's ``shard`` returned; the
handle finds the layout the batch was sharded by from it (:mod:`titan_cp.attention.handle`),
with its mask tiles and device indices built once and reused by every layer: no device
synchronisation in the layer loop, and each pipeline microbatch carries its own documents
through every stage. The call is the ``titan_cp::cp_attention``
custom op, so a compiled block keeps its whole graph (``fullgraph=True``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from titan_cp.attention.api import attend, check_qkv
from titan_cp.attention.handle import CPHandle
from titan_cp.attention.strategy import DEFAULT_STRATEGY, get_strategy
from titan_cp.balance import get_balance
from titan_cp.layout import DEFAULT_BALANCE
from titan_cp.parallel.adapter import adapter_of

SEQ_DIM = 2


class ContextParallel(ParallelStyle):
    """Run the wrapped attention module's math as CP attention over the mesh it is applied with.

    Args:
        strategy: a registered strategy's name (built in: ``"ring"``, ``"allgather"``, ``"ulysses"``,
            ``"hybrid"`` on a 2-D mesh).
        balance: a registered balance's name: the sequence layout batches are sharded by
            (``style.handle.shard(batch)``) and the attention runs by.
        causal: causal mask within each document.
        kernel: local kernel name, ``None`` for the fastest on the device and dtype.
        handle: a :class:`~titan_cp.attention.handle.CPHandle` to bind instead (its mesh must be the one
            the style is applied with); ``strategy``, ``balance`` and ``kernel`` are then its own.

    Applied, the style's :attr:`handle` is the one object the batches are sharded with.
    """

    def __init__(
        self,
        strategy: str = DEFAULT_STRATEGY,
        balance: str = DEFAULT_BALANCE,
        causal: bool = True,
        kernel: str | None = None,
        handle: CPHandle | None = None,
    ) -> None:
        super().__init__()
        if handle is not None:
            strategy, balance, kernel = handle.strategy, handle.balance, handle.kernel
        get_strategy(strategy)  # a typo is refused here; the handle resolves the name it runs by
        get_balance(balance)
        self.strategy, self.balance, self.causal, self.kernel = strategy, balance, causal, kernel
        self.handle = handle

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.handle is None:  # resolves the strategy and refuses a mesh of other dims
            self.handle = CPHandle(device_mesh, self.strategy, self.balance, self.kernel)
        elif self.handle.mesh is not device_mesh:
            raise ValueError(f"ContextParallel is applied with a mesh other than its handle's ({self.handle})")
        handle = self.handle

        def forward(q, k, v, doc_lens=None, *, scale=None, sinks=None):
            return self._attend(handle, q, k, v, doc_lens, module, scale, sinks)

        module.forward = forward
        module.cp_style = self  # type: ignore[assignment]  # torch's stub: __setattr__ for tensors/modules only
        module.cp_handle = handle  # type: ignore[assignment]
        return module

    def _attend(self, handle: CPHandle, q, k, v, doc_lens, module=None, scale=None, sinks=None):
        mesh = handle.mesh
        assert mesh is not None
        as_dtensor = isinstance(q, DTensor)
        if as_dtensor:
            for name, t in (("q", q), ("k", k), ("v", v)):
                if not isinstance(t, DTensor) or any(p != Shard(SEQ_DIM) for p in t.placements):
                    raise ValueError(
                        f"ContextParallel takes {name} as a DTensor placed Shard({SEQ_DIM}) on the cp mesh"
                    )
            q, k, v = q.to_local(), k.to_local(), v.to_local()
        check_qkv(q, k, v)
        if doc_lens is not None and not isinstance(doc_lens, torch.Tensor):
            raise ValueError(
                "doc_lens must be the (batch, max_docs) host tensor of the sharded batch (cp.shard(batch)), "
                f"got {type(doc_lens).__name__}"
            )
        window, chunk = getattr(module, "window", None), getattr(module, "chunk", None)
        if sinks is None and hasattr(module, "local_sinks"):
            sinks = module.local_sinks()
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = attend(q, k, v, handle.id, doc_lens, self.causal, scale, window, chunk, sinks)
        if as_dtensor:
            out = DTensor.from_local(out, mesh, [Shard(SEQ_DIM)] * mesh.ndim, run_check=False)
        return out

    def __repr__(self) -> str:
        return f"ContextParallel(strategy={self.strategy!r}, balance={self.balance!r}, causal={self.causal})"


def apply_cp(
    model: nn.Module,
    cp: DeviceMesh | CPHandle | None,
    strategy: str | None = None,
    balance: str | None = None,
    kernel: str | None = None,
) -> CPHandle:
    """Make every attention core of ``model`` context-parallel, whatever its family
    (:func:`~titan_cp.parallel.adapter.adapter_of`: titan_cp's Llama, or a Hugging Face causal LM once
    :mod:`titan_cp.integrations.transformers` is imported), and return the handle it runs by.

    ``cp``: the cp mesh (``None``: one device), or a :class:`~titan_cp.attention.handle.CPHandle` to
    bind (every stage of a pipeline binds one handle). ``strategy`` (default ``"ring"``), ``balance``
    (default ``"doc_local"``: the layout batches are sharded by) and ``kernel`` (``None``: the fastest
    for the device and dtype) are given with a mesh; a handle carries its own.

    The handle shards batches (``cp.shard(batch)``), unshards outputs (``cp.unshard``) and knows this
    rank's place (``cp.rank``); the model's attention finds each batch's layout through it.
    """
    if isinstance(cp, CPHandle):
        given = {k: v for k, v in (("strategy", strategy), ("balance", balance), ("kernel", kernel)) if v is not None}
        if given:
            raise ValueError(f"apply_cp got a CPHandle and {sorted(given)}: the handle carries them ({cp})")
        handle = cp
    else:
        handle = CPHandle(cp, strategy or DEFAULT_STRATEGY, balance or DEFAULT_BALANCE, kernel)
    adapter_of(model).attach_cp(handle)
    return handle


def handle_of(model: nn.Module) -> CPHandle | None:
    """The handle ``model``'s attention runs by (:func:`apply_cp`), ``None`` if none is bound."""
    for module in model.modules():
        handle = getattr(module, "cp_handle", None)
        if isinstance(handle, CPHandle):
            return handle
    return None
