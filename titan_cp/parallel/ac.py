"""Activation checkpointing of transformer blocks with ``torch.utils.checkpoint``.

  "full"       each block keeps only its inputs; the whole block is recomputed in backward.
  "selective"  layer-level, torchtitan's integer ``selective_ac_option``: every k-th block
               (0, k, 2k, ...) fully checkpointed, the others not at all; ``every=1`` is
               every block.
  "op"         op-level (torchtitan's ``selective_ac_option = "op"``): each block saves the
               outputs of matmuls and attention kernels (the expensive ops; CP attention,
               ``titan_cp::cp_attention``, among them, so its communication runs once) and
               recomputes the cheap elementwise ones (norms, RoPE, SiLU, products), via
               ``create_selective_checkpoint_contexts``.

With ``cpu_offload`` or ``blocks_per_checkpoint > 1`` the checkpoints are made by module hooks
over units of blocks instead (``titan_cp.parallel.units``: k blocks per stored input, the inputs
in host memory with ``titan_cp.parallel.offload``); with ``cpu_offload`` the model's head (final
norm and chunked loss, on the stage that holds them) is one more unit.

The modes are :data:`titan_cp.ac_modes.AC_MODES`; ``ac_mode_and_every(mode, selective_ac_option)``
(:mod:`titan_cp.ac_modes`) maps the ``[activation_checkpoint]`` keys to these arguments.

Apply after tensor/context parallelism and before ``torch.compile`` and FSDP, as
torchtitan does. Wrapped blocks keep their state-dict keys (the wrapper strips its
``_checkpoint_wrapped_module.`` prefix); ``named_parameters`` show the prefix.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn

from titan_cp.ac_modes import AC_MODES
from titan_cp.parallel.adapter import adapter_of
from titan_cp.parallel.offload import HostActivationStore
from titan_cp.parallel.units import CheckpointUnit, apply_units


def _save_ops() -> set:
    """Ops whose outputs are saved under op-level selective checkpointing."""
    aten = torch.ops.aten
    names = [
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "linear",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math",
    ]
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    # CP attention: recomputing it would run its kernels and its communication (ring steps,
    # all-gathers, all-to-alls) again; its outputs are what the backward reads anyway
    import titan_cp.attention.api  # noqa: F401, PLC0415 - registers the op

    ops.add(torch.ops.titan_cp.cp_attention.default)
    return ops


def _op_policy(save_ops: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context_fn():
    return create_selective_checkpoint_contexts(partial(_op_policy, _save_ops()))


def checkpoint_block(block: torch.nn.Module, mode: str, index: int = 0, every: int = 1) -> torch.nn.Module:
    """``block`` (the ``index``-th transformer block) wrapped for ``mode`` (module doc); itself when the
    mode leaves it alone (``"none"``, or a ``"selective"`` block off the ``every`` grid)."""
    if mode == "none" or (mode == "selective" and index % every != 0):
        return block
    if mode in ("full", "selective"):  # selective is layer-level: every k-th block fully, the rest not at all
        return checkpoint_wrapper(block, preserve_rng_state=False)
    return checkpoint_wrapper(block, context_fn=_selective_context_fn, preserve_rng_state=False)  # op-level


def check_ac(mode: str, every: int, cpu_offload: bool = False, blocks_per_checkpoint: int = 1) -> None:
    """``ValueError`` naming the key for a mode, period or unit option :func:`apply_ac` does not take."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode must be one of {AC_MODES}, got {mode!r}")
    if every < 1:
        raise ValueError(f"activation_checkpoint.selective_ac_option must be >= 1, got {every}")
    if (
        isinstance(blocks_per_checkpoint, bool)
        or not isinstance(blocks_per_checkpoint, int)
        or blocks_per_checkpoint < 1
    ):
        raise ValueError(
            f"activation_checkpoint.blocks_per_checkpoint must be an integer >= 1, got {blocks_per_checkpoint!r}"
        )
    if blocks_per_checkpoint > 1 and mode not in ("full", "op"):
        raise ValueError(
            f"activation_checkpoint.blocks_per_checkpoint = {blocks_per_checkpoint} needs activation_checkpoint.mode = "
            f"'full' (or selective_ac_option = 'op'), got mode {mode!r}"
        )
    if cpu_offload and mode == "none":
        raise ValueError(
            "activation_checkpoint.cpu_offload = true moves checkpointed block inputs to the host: it needs "
            "activation_checkpoint.mode 'full' or 'selective', got 'none'"
        )


def apply_block_ac(
    blocks: list[torch.nn.Module],
    mode: str,
    every: int = 1,
    cpu_offload: bool = False,
    blocks_per_checkpoint: int = 1,
    prefetch: int = 1,
) -> tuple[list[torch.nn.Module], HostActivationStore | None]:
    """``blocks`` (in call order) checkpointed for ``mode`` (module doc): the list of blocks to put back
    in their places, and the host store of their inputs (with ``cpu_offload``; else None)."""
    if mode == "none":
        return list(blocks), None
    check_ac(mode, every, cpu_offload, blocks_per_checkpoint)
    if not cpu_offload and blocks_per_checkpoint == 1:
        return [checkpoint_block(b, mode, i, every) for i, b in enumerate(blocks)], None
    context_fn = _selective_context_fn if mode == "op" else noop_context_fn
    _, store = apply_units(blocks, mode, every, blocks_per_checkpoint, cpu_offload, prefetch, context_fn)
    return list(blocks), store


def apply_ac(
    model: nn.Module,
    mode: str,
    every: int = 1,
    cpu_offload: bool = False,
    blocks_per_checkpoint: int = 1,
    prefetch: int = 1,
) -> HostActivationStore | None:
    """Wrap ``model``'s blocks in place with activation checkpointing (see module doc), whatever its
    family (:func:`~titan_cp.parallel.adapter.adapter_of`).

    every: for mode "selective", checkpoint blocks 0, every, 2*every, ... (1: every block).
    cpu_offload: checkpointed inputs in host memory, ``prefetch`` units copied back ahead.
    blocks_per_checkpoint: blocks per checkpoint unit (mode "full" or "op").
    Returns the host store (``cpu_offload``), else None.
    """
    adapter = adapter_of(model)
    items = adapter.block_items()
    wrapped, store = apply_block_ac([b for _, b in items], mode, every, cpu_offload, blocks_per_checkpoint, prefetch)
    for (key, block), new in zip(items, wrapped):
        if new is not block:
            adapter.replace_block(key, new)
    if store is not None:
        # the trainer's metrics read it (titan_cp.parallel.offload.offload_metrics); torch's stub types
        # Module.__setattr__ for tensors and modules only, but a module holds any attribute
        adapter.root.activation_store = store  # type: ignore[assignment]
        if adapter.head_unit:
            # the head is one more unit: e.g. the final norm and the chunked loss keep their input on the host
            # too and are recomputed in the backward (what they save is three hidden-state tensors per token)
            CheckpointUnit(adapter.head_unit, noop_context_fn, store)
    return store
