"""torchtitan's own ``parallelize_fn`` with only its context-parallel step replaced by titan_cp's.

::

    model_spec.parallelize_fn = TitanCPParallelize(model_spec.parallelize_fn)

:class:`TitanCPParallelize` applies titan_cp's :class:`~titan_cp.parallel.ContextParallel` to every
:class:`~.attention.TitanCPAttention` core over torchtitan's ``cp`` mesh (1-D), where torchtitan's
own CP step runs (first: TP's ``local_map``, activation checkpointing and compile wrap it), then
calls torchtitan's function (TP, activation checkpointing, ``torch.compile``, FSDP2 over
``dp_shard x cp``: all torchtitan's) with a view of ``parallel_dims`` whose ``cp_enabled`` is
``False``, so torchtitan's CP step (``apply_cp_to_forward``: FlexAttention K/V all-gather, which
raises for any other attention) is skipped and everything else sees the real meshes. It is the CP step
of torchtitan's ``partial_dtensor`` backend; under ``spmd_types`` / ``full_dtensor`` the model's
sharding config itself all-gathers K/V, and inputs are typed by torchtitan's own
``post_dataloading_process``: :class:`~.trainer.TitanCPTrainer` refuses those backends, naming the flag.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.distributed import ParallelDims

from titan_cp.attention.handle import CPHandle
from titan_cp.attention.strategy import get_strategy
from titan_cp.integrations.torchtitan.attention import TitanCPAttention
from titan_cp.parallel import ContextParallel


class _WithoutCP:
    """``parallel_dims`` as torchtitan's parallelize sees it: every attribute and mesh as they are
    (the FSDP mesh still spans ``dp_shard x cp``), but ``cp_enabled`` ``False``."""

    cp_enabled = False

    def __init__(self, parallel_dims):
        self._dims = parallel_dims

    def __getattr__(self, name: str):
        return getattr(self._dims, name)


class TitanCPParallelize:
    """torchtitan's ``parallelize_fn`` (``torchtitan_fn``) with titan_cp's CP step (module docstring)."""

    def __init__(self, torchtitan_fn: Callable[..., nn.Module]) -> None:
        self.torchtitan_fn = torchtitan_fn

    def __call__(self, model: nn.Module, *, parallel_dims: ParallelDims, parallelism: Any, **kwargs: Any) -> nn.Module:
        if not parallel_dims.cp_enabled:
            return self.torchtitan_fn(model, parallel_dims=parallel_dims, parallelism=parallelism, **kwargs)
        apply_titan_cp(model, parallel_dims.get_mesh("cp"))
        return self.torchtitan_fn(model, parallel_dims=_WithoutCP(parallel_dims), parallelism=parallelism, **kwargs)

    def __repr__(self) -> str:
        return f"TitanCPParallelize({getattr(self.torchtitan_fn, '__qualname__', self.torchtitan_fn)!r})"


def apply_titan_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """titan_cp's CP step: :class:`~titan_cp.parallel.ContextParallel` on the core of every
    :class:`~.attention.TitanCPAttention` of ``model`` over ``cp_mesh``, all by one
    :class:`~titan_cp.attention.handle.CPHandle` of their strategy, balance and kernel (the Trainer
    shards each batch with it: :func:`~titan_cp.parallel.handle_of`). Another inner attention under CP is refused by name (it would attend to its
    own shard only)."""
    others = sorted(
        f"{name}.inner_attention ({type(m.inner_attention).__name__})"
        for name, m in model.named_modules()
        if isinstance(getattr(m, "inner_attention", None), nn.Module)
        and not isinstance(m.inner_attention, TitanCPAttention)
    )
    if others:
        raise ValueError(
            f"context parallelism with an attention titan_cp does not replace: {others[:3]}"
            f"{' ...' if len(others) > 3 else ''}; build the model with titan_cp.integrations.torchtitan's "
            "with_titan_cp(config_fn), which puts TitanCPAttention in every layer"
        )
    attentions = [m for m in model.modules() if isinstance(m, TitanCPAttention)]
    settings = {(m.strategy, m.balance, m.kernel, m.ulysses_degree) for m in attentions}
    if len(settings) > 1:
        raise ValueError(f"TitanCPAttention layers disagree on (strategy, balance, kernel, ulysses): {settings}")
    if not attentions:
        return
    strategy, balance, kernel, ulysses = settings.pop()
    get_strategy(strategy).check_degrees(cp_mesh.size(), ulysses)
    axes = get_strategy(strategy).mesh_dims(cp_mesh.size(), ulysses)
    if len(axes) > 1:  # hybrid: torchtitan's 1-D cp axis as (cp_ring, cp_ulysses), Ulysses groups consecutive
        names, sizes = zip(*axes)
        cp_mesh = cp_mesh._unflatten(0, tuple(sizes), tuple(names))
    handle = CPHandle(cp_mesh, strategy, balance, kernel)
    for module in attentions:
        parallelize_module(module.core, cp_mesh, ContextParallel(handle=handle))
