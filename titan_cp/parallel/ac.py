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

``ac_mode_and_every(mode, selective_ac_option)`` maps the ``[activation_checkpoint]`` keys
to these arguments.

Apply after tensor/context parallelism and before ``torch.compile`` and FSDP, as
torchtitan does. Wrapped blocks keep their state-dict keys (the wrapper strips its
``_checkpoint_wrapped_module.`` prefix); ``named_parameters`` show the prefix.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan_cp.parallel.adapter import adapter_of


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


def ac_mode_and_every(mode: str, selective_ac_option: str) -> tuple[str, int]:
    """``activation_checkpoint.mode`` and ``.selective_ac_option`` -> ``apply_ac``'s ``(mode, every)``."""
    if mode != "selective":
        return mode, 1
    if selective_ac_option == "op":
        return "op", 1
    if not (selective_ac_option.isdigit() and int(selective_ac_option) > 0):
        raise ValueError(
            f"activation_checkpoint.selective_ac_option must be a positive integer or 'op', got {selective_ac_option!r}"
        )
    return "selective", int(selective_ac_option)


def checkpoint_block(block: torch.nn.Module, mode: str, index: int = 0, every: int = 1) -> torch.nn.Module:
    """``block`` (the ``index``-th transformer block) wrapped for ``mode`` (module doc); itself when the
    mode leaves it alone (``"none"``, or a ``"selective"`` block off the ``every`` grid)."""
    if mode == "none" or (mode == "selective" and index % every != 0):
        return block
    if mode in ("full", "selective"):  # selective is layer-level: every k-th block fully, the rest not at all
        return checkpoint_wrapper(block, preserve_rng_state=False)
    return checkpoint_wrapper(block, context_fn=_selective_context_fn, preserve_rng_state=False)  # op-level


def check_ac(mode: str, every: int) -> None:
    """``ValueError`` naming the key for a mode or period :func:`checkpoint_block` does not take."""
    if mode not in ("none", "full", "selective", "op"):
        raise ValueError(f"activation_checkpoint.mode must be 'none', 'full', 'selective' or 'op', got {mode!r}")
    if every < 1:
        raise ValueError(f"activation_checkpoint.selective_ac_option must be >= 1, got {every}")


def apply_ac(model: nn.Module, mode: Literal["none", "full", "selective", "op"], every: int = 1) -> None:
    """Wrap ``model``'s blocks in place with activation checkpointing (see module doc), whatever its
    family (:func:`~titan_cp.parallel.adapter.adapter_of`).

    every: for mode "selective", checkpoint blocks 0, every, 2*every, ... (1: every block).
    """
    if mode == "none":
        return
    check_ac(mode, every)
    adapter = adapter_of(model)
    for i, (key, block) in enumerate(adapter.block_items()):
        wrapped = checkpoint_block(block, mode, i, every)
        if wrapped is not block:
            adapter.blocks[key] = wrapped
