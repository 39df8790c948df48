"""Checkpoint units of one or several consecutive blocks, by module hooks, with their inputs on the host.

A unit of k blocks ``b_0 .. b_{k-1}`` keeps one stored input (``b_0``'s arguments) and recomputes
all k blocks in the backward: the stored inputs are divided by k, one recomputation holds k
block inputs and one block's activations (below). The blocks stay where they are (in
``model.layers``, under their own names: the state dict, FSDP units and weight init are
untouched); the unit is made of forward hooks, as
PyTorch's composable ``checkpoint`` (``torch.distributed._composable``) is, on the same
non-reentrant checkpoint generator (``torch.utils.checkpoint``):

  b_0's pre-hook     enter the host store's hooks (with ``cpu_offload``), start the checkpoint
                     with b_0's arguments (their tensors are what the unit stores)
  b_j's pre-hook     keep b_j's arguments but its hidden states (RoPE tables, masks, which
                     are shared by the blocks or small) for the recomputation
  b_{k-1}'s hook     end the checkpoint, leave the store's hooks
  recomputation      ``h = b_0(*args); h = b_1(h, *rest); ...`` with the hooks above switched off
                     (FSDP's own hooks run: they gather the weights the recomputation needs)

With ``k > 1`` each block is checkpointed again inside the unit (nested non-reentrant checkpoints,
``torch.utils.checkpoint``'s rules: an inner checkpoint's inputs are what its parent saves): b_j's
pre-hook also starts b_j's own checkpoint, b_j's forward hook ends it, and the recomputation runs
each block under the same inner checkpoint. The unit's recomputation then keeps only the k block
inputs ``(B, S_local, D)`` on the device (it stops after the last one) and each block's internals
are recomputed by its own checkpoint when its backward needs them, one block at a time: one more
forward of the unit's blocks than a single checkpoint, for a device peak of one block's internals.

``k = 1`` is ordinary per-block checkpointing (with ``cpu_offload``: its inputs on the host).

Op-level selective checkpointing (a ``context_fn`` from ``create_selective_checkpoint_contexts``)
looks up each op of the recomputation by its invocation index among the ops of the forward's
region, so both must run the same ops. The hooks do not: in the forward a unit's region starts
after b_0's pre-hooks (FSDP's unshard, record_function regions and input casts) and ends before
b_{k-1}'s forward hooks, but holds b_1 .. b_{k-1}'s pre-hooks and the earlier blocks' forward hooks;
the recomputation calls the blocks, hooks and all (and FSDP's hooks do other things in the
backward). :func:`blocks_only` therefore hands such a context only the ops of the blocks' own
``forward`` (:func:`mark_forwards`), the same in the forward and the recomputation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial, wraps

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, noop_context_fn

from titan_cp.parallel.offload import HostActivationStore


def _with_hidden(args: tuple, kwargs: dict, h: Tensor | None) -> tuple[tuple, dict]:
    """A block's arguments with its hidden states (the first positional, or ``hidden_states``) set to ``h``."""
    if args:
        return (h, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": h}


def _hidden(out) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _finish(gen) -> None:
    """End a checkpoint generator's forward."""
    try:
        next(gen)
    except StopIteration:
        return
    raise RuntimeError("checkpoint generator did not finish")  # invariant of the generator


_forwards = threading.local()  # .depth: the marked forwards running on this thread (the backward's own thread on CUDA)


def _in_forward() -> bool:
    return getattr(_forwards, "depth", 0) > 0


def mark_forwards(blocks: Sequence[nn.Module]) -> None:
    """Mark the run of each block's ``forward`` (the instance attribute, so that the module, its state-dict
    names and hooks are unchanged; its hooks run outside it) for :func:`blocks_only`. Idempotent."""
    for block in blocks:
        if getattr(block, "_unmarked_forward", None) is not None:
            continue
        forward = block.forward

        @wraps(forward)
        def marked(*args, _forward=forward, **kwargs):
            _forwards.depth = getattr(_forwards, "depth", 0) + 1
            try:
                return _forward(*args, **kwargs)
            finally:
                _forwards.depth -= 1

        block._unmarked_forward = forward  # type: ignore[assignment]  # stub: __setattr__ tensors/modules only
        block.forward = marked


class _ForwardsOnly(TorchDispatchMode):
    """``mode`` (a selective checkpoint's caching or cached mode) given only the ops run inside marked
    forwards; every other op runs as it would without it."""

    def __init__(self, mode: TorchDispatchMode) -> None:
        super().__init__()
        self.mode = mode

    def __enter__(self):
        # a fresh count at each recomputation, as the cached mode's own __enter__ does
        counter = getattr(self.mode, "func_counter", None)
        if counter is not None:
            counter.clear()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _in_forward():
            return self.mode.__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


def blocks_only(context_fn: Callable) -> Callable:
    """``context_fn`` (a checkpoint's, returning its forward and recomputation contexts, here dispatch
    modes) with both contexts seeing only the ops of forwards marked by :func:`mark_forwards` (module doc)."""

    def contexts():
        forward, recompute = context_fn()
        return _ForwardsOnly(forward), _ForwardsOnly(recompute)

    return contexts


class CheckpointUnit:
    """The hooks of one unit over ``blocks`` (module doc); ``store``: where its inputs go, or None."""

    def __init__(self, blocks: Sequence[nn.Module], context_fn: Callable, store: HostActivationStore | None) -> None:
        self.blocks, self.context_fn, self.store = list(blocks), context_fn, store
        self.recomputing = False
        self.gen = self.store_ctx = None
        self.rest: list = []  # this call's followers' other arguments
        self.inner = None  # the running block's own checkpoint (k > 1)
        self.handles = [blocks[0].register_forward_pre_hook(self._open, with_kwargs=True)]
        for block in self.blocks[1:]:
            self.handles.append(block.register_forward_pre_hook(self._follow, with_kwargs=True))
        if len(self.blocks) > 1:
            for block in self.blocks:
                self.handles.append(block.register_forward_pre_hook(self._open_inner, with_kwargs=True))
                self.handles.append(block.register_forward_hook(self._close_inner))
        self.handles.append(self.blocks[-1].register_forward_hook(self._close))

    def _generator(self, fn: Callable, args: tuple, kwargs: dict):
        """A started non-reentrant checkpoint of ``fn(*args, **kwargs)`` (ended by :func:`_finish`)."""
        gen = _checkpoint_without_reentrant_generator(
            fn, False, self.context_fn, "default", False, True, *args, **kwargs
        )
        next(gen)
        return gen

    def _open_inner(self, module, args, kwargs):
        if not self.recomputing and self.gen is not None:
            self.inner = self._generator(partial(self._rerun, module), args, kwargs)

    def _close_inner(self, module, args, output):
        if not self.recomputing and self.inner is not None:
            gen, self.inner = self.inner, None
            _finish(gen)

    def _rerun(self, block: nn.Module, *args, **kwargs) -> None:
        """One block's own recomputation (its unit's hooks switched off)."""
        was, self.recomputing = self.recomputing, True
        try:
            block(*args, **kwargs)
        finally:
            self.recomputing = was

    def _run(self, block: nn.Module, args: tuple, kwargs: dict):
        """``block(*args, **kwargs)`` in the unit's recomputation: under its own checkpoint when k > 1."""
        if len(self.blocks) == 1:
            return block(*args, **kwargs)
        gen = self._generator(partial(self._rerun, block), args, kwargs)
        out = block(*args, **kwargs)
        _finish(gen)
        return out

    def _open(self, module, args, kwargs):
        if self.recomputing or not torch.is_grad_enabled():
            return
        if self.store is not None:
            self.store_ctx = self.store.unit()
            self.store_ctx.__enter__()
        self.rest = []
        self.gen = self._generator(partial(self._recompute, self.rest), args, kwargs)

    def _follow(self, module, args, kwargs):
        """Keep a follower's arguments but its hidden states (RoPE tables, masks: the same for every
        block of most models, or cast copies of them) for the recomputation."""
        if not self.recomputing and self.gen is not None:
            self.rest.append(_with_hidden(args, kwargs, None))

    def _close(self, module, args, output):
        if self.recomputing or self.gen is None:
            return
        gen, self.gen, self.rest = self.gen, None, []
        _finish(gen)
        if self.store_ctx is not None:
            ctx, self.store_ctx = self.store_ctx, None
            ctx.__exit__(None, None, None)

    def _recompute(self, rest: list, *args, **kwargs) -> None:
        """Run the unit's blocks again from the stored inputs (their hooks here switched off)."""
        was, self.recomputing = self.recomputing, True
        try:
            h = _hidden(self._run(self.blocks[0], args, kwargs))
            for block, (a, kw) in zip(self.blocks[1:], rest):
                a, kw = _with_hidden(a, kw, h)
                h = _hidden(self._run(block, a, kw))
        finally:
            self.recomputing = was


def unit_blocks(n_blocks: int, mode: str, every: int, blocks_per_checkpoint: int) -> list[list[int]]:
    """The block indices of each checkpoint unit: ``mode`` "full"/"op": consecutive groups of
    ``blocks_per_checkpoint`` (the last one shorter when it does not divide); "selective": blocks
    0, every, 2*every, ... alone."""
    if mode == "selective":
        return [[i] for i in range(0, n_blocks, every)]
    k = blocks_per_checkpoint
    return [list(range(i, min(i + k, n_blocks))) for i in range(0, n_blocks, k)]


def apply_units(
    blocks: Sequence[nn.Module],
    mode: str,
    every: int = 1,
    blocks_per_checkpoint: int = 1,
    cpu_offload: bool = False,
    prefetch: int = 1,
    context_fn: Callable = noop_context_fn,
) -> tuple[list[CheckpointUnit], HostActivationStore | None]:
    """Checkpoint ``blocks`` (in call order) as units (:func:`unit_blocks`) by hooks; with
    ``cpu_offload`` their inputs go to one :class:`HostActivationStore` (``prefetch`` units ahead).
    Returns the units and the store (None without offload). A ``context_fn`` other than the no-op (op-level
    selective checkpointing) sees only the ops of the blocks' own forwards (:func:`blocks_only`)."""
    store = HostActivationStore(prefetch) if cpu_offload else None
    if context_fn is not noop_context_fn:
        mark_forwards(blocks)
        context_fn = blocks_only(context_fn)
    units = [
        CheckpointUnit([blocks[i] for i in idx], context_fn, store)
        for idx in unit_blocks(len(blocks), mode, every, blocks_per_checkpoint)
    ]
    return units, store
