"""``ContextParallel``: CP attention as a ``ParallelStyle``, applied with ``parallelize_module``.

::

    parallelize_module(
        model,
        cp_mesh,                                # 1-D "cp"; 2-D ("cp_ring", "cp_ulysses") for hybrid
        {"layers.*.attention.inner_attention": ContextParallel(strategy="ring", balance="doc_local")},
    )

The style takes over the forward of the attention core, ``inner_attention(q, k, v, doc_lens)``
(q ``(B, H, S_local, E)``, k/v ``(B, K, S_local, E)``), keeping the module's mask (``window``,
``chunk``) and sinks (``local_sinks()``) where it has them: everything around it (projections,
RoPE, norms, MLP) is token-wise and runs on the local shard unchanged. Inputs may be plain
local shards or DTensors placed ``Shard(2)`` on the cp mesh; the output is of the same kind.
As a DTensor, the "global" sequence is the layout's rank-concatenated order (the shards
stacked by rank), the convention of PyTorch's own load-balanced CP.

The batch's document structure arrives as the ``doc_lens`` argument of every call, a
zero-padded ``(B, max_docs)`` tensor *on the host*; the layout, its mask tiles and their
device indices are built from it once per microbatch (the first layer) and reused by every
other layer (the same tensor object is recognised without being read again): no device
synchronisation in the layer loop, and no global state, so each pipeline microbatch
carries its own documents through every stage. The call is the ``titan_cp::cp_attention``
custom op, so a compiled block keeps its whole graph (``fullgraph=True``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from titan_cp.attention.api import attend, check_qkv, register_spec
from titan_cp.attention.strategy import DEFAULT_STRATEGY, get_strategy
from titan_cp.balance import balance_names
from titan_cp.layout import DEFAULT_BALANCE, get_layout
from titan_cp.parallel.adapter import adapter_of

SEQ_DIM = 2


class ContextParallel(ParallelStyle):
    """Run the wrapped attention module's math as CP attention over the mesh it is applied with.

    Args:
        strategy: a registered strategy's name (built in: ``"ring"``, ``"allgather"``, ``"ulysses"``,
            ``"hybrid"`` on a 2-D mesh).
        balance: the sequence layout of calls whose ``doc_lens`` come without one (lists, or a tensor
            of the caller's). A layout's own tensor (``SequenceLayout.doc_lens_tensor``, what
            ``Microbatch.shard`` hands the model) carries its layout, balance included, and the
            attention runs by that layout: sharding and attention cannot disagree.
        causal: causal mask within each document.
        kernel: local kernel name, ``None`` for the fastest on the device.
    """

    def __init__(
        self,
        strategy: str = DEFAULT_STRATEGY,
        balance: str = DEFAULT_BALANCE,
        causal: bool = True,
        kernel: str | None = None,
    ) -> None:
        super().__init__()
        self._strategy = get_strategy(strategy)
        if balance not in balance_names():
            raise ValueError(f"ContextParallel balance must be one of {balance_names()}, got {balance!r}")
        self.strategy, self.balance, self.causal, self.kernel = strategy, balance, causal, kernel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        want = self._strategy.mesh_ndim
        if device_mesh.ndim != want:
            raise ValueError(
                f"ContextParallel(strategy={self.strategy!r}) needs a {want}-D cp mesh, got "
                f"{device_mesh.ndim}-D {device_mesh.mesh_dim_names}"
            )
        handle = register_spec(device_mesh, self.strategy, self.balance, self.kernel)

        def forward(q, k, v, doc_lens=None):
            return self._attend(device_mesh, handle, q, k, v, doc_lens, module)

        module.forward = forward
        module.cp_style = self  # type: ignore[assignment]  # torch's stub: __setattr__ for tensors/modules only
        return module

    def _attend(self, mesh: DeviceMesh, handle: int, q, k, v, doc_lens, module=None):
        as_dtensor = isinstance(q, DTensor)
        if as_dtensor:
            for name, t in (("q", q), ("k", k), ("v", v)):
                if not isinstance(t, DTensor) or any(p != Shard(SEQ_DIM) for p in t.placements):
                    raise ValueError(
                        f"ContextParallel takes {name} as a DTensor placed Shard({SEQ_DIM}) on the cp mesh"
                    )
            q, k, v = q.to_local(), k.to_local(), v.to_local()
        check_qkv(q, k, v)
        if doc_lens is not None and not isinstance(doc_lens, torch.Tensor):  # rows as lists: once, eagerly
            doc_lens = get_layout(q.shape[SEQ_DIM] * mesh.size(), mesh.size(), self.balance, doc_lens).doc_lens_tensor()
        window, chunk = getattr(module, "window", None), getattr(module, "chunk", None)
        sinks = module.local_sinks() if hasattr(module, "local_sinks") else None
        out = attend(q, k, v, handle, doc_lens, self.causal, q.shape[-1] ** -0.5, window, chunk, sinks)
        if as_dtensor:
            out = DTensor.from_local(out, mesh, [Shard(SEQ_DIM)] * mesh.ndim, run_check=False)
        return out

    def __repr__(self) -> str:
        return f"ContextParallel(strategy={self.strategy!r}, balance={self.balance!r}, causal={self.causal})"


def apply_cp(
    model: nn.Module,
    cp_mesh: DeviceMesh | None,
    strategy: str = DEFAULT_STRATEGY,
    balance: str = DEFAULT_BALANCE,
    kernel: str | None = None,
) -> nn.Module:
    """Make every attention core of ``model`` context-parallel over ``cp_mesh`` (``None``: one device),
    whatever its family (:func:`~titan_cp.parallel.adapter.adapter_of`: titan_cp's Llama, or a Hugging
    Face causal LM once :mod:`titan_cp.integrations.transformers` is imported); returns ``model``.

    ``balance``: the sequence layout the batches are sharded with; ``kernel``: the local kernel's name
    (``None``: the fastest for the device and dtype)."""
    adapter_of(model).attach_cp(cp_mesh, strategy, balance, kernel)
    return model


def llama_cp(
    model: nn.Module,
    cp_mesh: DeviceMesh | None,
    strategy: str = DEFAULT_STRATEGY,
    balance: str = DEFAULT_BALANCE,
    kernel: str | None = None,
) -> None:
    """Make every Llama block's attention core context-parallel over ``cp_mesh`` (:class:`ContextParallel`);
    on one device (``None``) the cores already run the local op, masked by document."""
    if cp_mesh is None:
        return
    parallelize_module(
        model,
        cp_mesh,
        {"layers.*.attention.inner_attention": ContextParallel(strategy=strategy, balance=balance, kernel=kernel)},
    )
