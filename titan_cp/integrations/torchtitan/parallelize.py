"""torchtitan's own ``parallelize_fn`` with only its context-parallel step replaced by titan_cp's.

::

    model_spec.parallelize_fn = TitanCPParallelize(model_spec.parallelize_fn)

The run's one :class:`~titan_cp.attention.handle.CPHandle` (:func:`cp_handle`: the ``titan_cp``
section's strategy, balance and kernel over torchtitan's ``cp`` mesh) is built by
:class:`~.trainer.TitanCPTrainer` once that mesh exists and given to :class:`TitanCPParallelize`
(:meth:`TitanCPParallelize.bound`), which binds every :class:`~.attention.TitanCPAttention` to it
(:func:`apply_titan_cp`): under CP titan_cp's :class:`~titan_cp.parallel.ContextParallel` on every
attention core, where torchtitan's own CP step runs (first: TP's ``local_map``, activation
checkpointing and compile wrap it); on one cp rank the cores hold the handle and run its kernel
locally. It then calls torchtitan's function (TP, activation checkpointing, ``torch.compile``, FSDP2
over ``dp_shard x cp``: all torchtitan's) with a view of ``parallel_dims`` whose ``cp_enabled`` is
``False``, so torchtitan's CP step (``apply_cp_to_forward``: FlexAttention K/V all-gather, which
raises for any other attention) is skipped and everything else sees the real meshes. It is the CP step
of torchtitan's ``partial_dtensor`` backend; under ``spmd_types`` / ``full_dtensor`` the model's
sharding config itself all-gathers K/V, and inputs are typed by torchtitan's own
``post_dataloading_process``: :class:`~.trainer.TitanCPTrainer` refuses those backends, naming the flag.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.distributed import ParallelDims

from titan_cp.attention.handle import CPHandle
from titan_cp.attention.strategy import get_strategy
from titan_cp.integrations.torchtitan.attention import TitanCPAttention
from titan_cp.integrations.torchtitan.without_fla import QWEN35
from titan_cp.parallel import ContextParallel


class BindsCP:
    """A module of titan_cp's in a torchtitan model, besides :class:`~.attention.TitanCPAttention`, that runs by
    the run's one handle: :func:`apply_titan_cp` gives it the handle (:meth:`bind_cp`). The Gated DeltaNet
    layers of Qwen3.5 (:class:`~.linear.TitanCPGatedDeltaNet`) are: titan_cp's linear ops run on the same
    shards under every strategy, with nothing of the strategy but its layout."""

    def bind_cp(self, handle: CPHandle) -> None:
        raise NotImplementedError


class _WithoutCP:
    """``parallel_dims`` as torchtitan's parallelize sees it: every attribute and mesh as they are
    (the FSDP mesh still spans ``dp_shard x cp``), but ``cp_enabled`` ``False``."""

    cp_enabled = False

    def __init__(self, parallel_dims):
        self._dims = parallel_dims

    def __getattr__(self, name: str):
        return getattr(self._dims, name)


class TitanCPParallelize:
    """torchtitan's ``parallelize_fn`` (``torchtitan_fn``) with titan_cp's CP step by ``handle`` (module
    docstring); ``handle`` ``None`` until the Trainer binds the run's (:meth:`bound`)."""

    def __init__(self, torchtitan_fn: Callable[..., nn.Module], handle: CPHandle | None = None) -> None:
        self.torchtitan_fn, self.handle = torchtitan_fn, handle

    def bound(self, handle: CPHandle) -> TitanCPParallelize:
        """The same function, binding the attention of each model part it parallelizes to ``handle``."""
        return TitanCPParallelize(self.torchtitan_fn, handle)

    def __call__(self, model: nn.Module, *, parallel_dims: ParallelDims, parallelism: Any, **kwargs: Any) -> nn.Module:
        if self.handle is None:
            raise ValueError(
                "TitanCPParallelize has no CP handle: build the run with titan_cp.integrations.torchtitan's "
                "TitanCPTrainer (with_titan_cp's config), which binds the one it builds from the titan_cp section"
            )
        apply_titan_cp(model, self.handle)
        _freeze_vision_encoder(model)
        dims = _WithoutCP(parallel_dims) if parallel_dims.cp_enabled else parallel_dims
        return self.torchtitan_fn(model, parallel_dims=dims, parallelism=parallelism, **kwargs)

    def __repr__(self) -> str:
        return f"TitanCPParallelize({getattr(self.torchtitan_fn, '__qualname__', self.torchtitan_fn)!r})"


def _freeze_vision_encoder(model: nn.Module) -> None:
    """A multimodal model's vision encoder (torchtitan's Qwen3.5 has one) trains nothing under titan_cp's Trainer,
    which runs text batches only: its parameters never have a gradient, so AdamW neither steps them nor keeps
    state for them. They are frozen (``requires_grad`` off), which changes no step but keeps them out of the
    optimizer: torchtitan's resume gives every trainable parameter an optimizer state and then looks for it in
    the checkpoint, where a parameter without a gradient has none."""
    encoder = getattr(model, "vision_encoder", None)
    if isinstance(encoder, nn.Module):
        encoder.requires_grad_(False)


def cp_handle(parallel_dims: ParallelDims, strategy: str, balance: str, kernel: str | None, ulysses: int) -> CPHandle:
    """The run's one handle: ``strategy`` / ``balance`` / ``kernel`` over torchtitan's cp mesh (hybrid: that
    1-D axis unflattened to ``(cp_ring, cp_ulysses)``, Ulysses groups of ``ulysses`` consecutive cp ranks),
    or on one cp rank (no mesh) where CP is off."""
    if not parallel_dims.cp_enabled:
        return CPHandle(None, strategy, balance, kernel)
    mesh = parallel_dims.get_mesh("cp")
    axes = get_strategy(strategy).mesh_dims(mesh.size(), ulysses)
    if len(axes) > 1:
        names, sizes = zip(*axes)
        mesh = mesh._unflatten(0, tuple(sizes), tuple(names))
    return CPHandle(mesh, strategy, balance, kernel)


def describe(handle: CPHandle) -> str:
    """The log's line of the CP that runs: the mesh the handle holds, not the config's request."""
    kernel = handle.kernel or "default"
    if handle.mesh is None:
        return f"titan_cp: no context parallelism (CP 1): each rank attends over its whole rows, kernel {kernel}"
    axes = " x ".join(f"{name} {size}" for name, size in zip(handle.mesh.mesh_dim_names or (), handle.mesh.shape))
    return f"titan_cp: CP {handle.size} ({axes}): {handle.strategy} attention, {handle.balance} layout, kernel {kernel}"


def apply_titan_cp(model: nn.Module, handle: CPHandle) -> None:
    """titan_cp's CP step: every :class:`~.attention.TitanCPAttention` core of ``model`` bound to ``handle``:
    :class:`~titan_cp.parallel.ContextParallel` over its mesh, or (no mesh) the handle held for its kernel; every
    :class:`BindsCP` module (Qwen3.5's Gated DeltaNet) given the handle. The Trainer shards each batch with the
    same handle. Another inner attention, or torchtitan's own Gated DeltaNet, is refused by name (under CP it
    would run its own shard alone; on one rank it would not read the documents the batch carries)."""
    others = sorted(
        f"{name}.inner_attention ({type(m.inner_attention).__name__})"
        for name, m in model.named_modules()
        if isinstance(getattr(m, "inner_attention", None), nn.Module)
        and not isinstance(m.inner_attention, TitanCPAttention)
    )
    others += _linear_layers_not_replaced(model)
    if others:
        raise ValueError(
            f"titan_cp's CP step found an attention or linear-attention layer titan_cp does not replace: "
            f"{others[:3]}{' ...' if len(others) > 3 else ''}; build the model with titan_cp.integrations.torchtitan's "
            "with_titan_cp(config_fn), which puts titan_cp in every layer"
        )
    for module in model.modules():
        if isinstance(module, BindsCP):
            module.bind_cp(handle)
        elif isinstance(module, TitanCPAttention):
            if handle.mesh is None:
                module.core.cp_handle = handle
            else:
                parallelize_module(module.core, handle.mesh, ContextParallel(handle=handle))


def _linear_layers_not_replaced(model: nn.Module) -> list[str]:
    """torchtitan's own Gated DeltaNet layers in ``model`` (Qwen3.5's, not titan_cp's :class:`BindsCP` one):
    under CP each would run its own shard alone. None exist unless torchtitan's Qwen3.5 module is loaded."""
    qwen35 = sys.modules.get(f"{QWEN35}.model")
    if qwen35 is None:
        return []
    return [
        f"{name} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, qwen35.GatedDeltaNet) and not isinstance(m, BindsCP)
    ]
