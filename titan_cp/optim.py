"""Optimizers, the LR schedule and gradient clipping: the math the trainer only wires.

- :func:`build_optimizers`: one ``torch.optim`` AdamW/Adam per model part (per pipeline stage
  held by this rank), ``fused`` / ``foreach`` / ``for-loop`` as ``optimizer.implementation`` says.
- :func:`lr_lambda`: the multiplier of the peak LR at each step (warmup, stable, decay).
- :class:`LRSchedulers`: one ``LambdaLR`` per optimizer, checkpointed as one state (the
  schedulers step together), so a run resumes whatever the number of pipeline stages.
- :func:`clip_grad_norm_`: clip by the global L2 norm over DTensor shards and pipeline stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


def build_optimizers(
    parts: Sequence[nn.Module],
    name: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    implementation: str,
) -> list[torch.optim.Optimizer]:
    """One optimizer per model part. ``implementation``: ``fused`` (one kernel for every
    parameter), ``foreach`` (multi-tensor ops) or ``for-loop`` (one parameter at a time).
    ``Adam`` adds ``weight_decay`` to the gradient (L2); ``AdamW`` decays the weights (decoupled)."""
    if name not in _OPTIMIZERS:
        raise ValueError(f"optimizer.name must be one of {list(_OPTIMIZERS)}, got {name!r}")
    if implementation not in ("fused", "foreach", "for-loop"):
        raise ValueError(f"optimizer.implementation must be 'fused', 'foreach' or 'for-loop', got {implementation!r}")
    flags = {"fused": implementation == "fused", "foreach": implementation == "foreach"}
    cls = _OPTIMIZERS[name]
    return [cls(part.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **flags) for part in parts]


def lr_lambda(
    warmup_steps: int, total_steps: int, decay_ratio: float | None, decay_type: str, min_lr_factor: float
) -> Callable[[int], float]:
    """Multiplier of the peak LR at each step: linear warmup, constant, then decay to ``min_lr_factor``.

    ``decay_ratio``: the fraction of the steps (after warmup) spent decaying; ``None`` decays
    over every step after warmup. With ``s = step + 1`` (``LambdaLR`` passes the steps taken)::

        warmup   s <= W:            s / (W + 1)
        stable   W < s <= D0:       1
        decay    D0 < s:            m + (1 - m) * shape(min(1, (s - D0) / D)),
                                    shape = 1 - p (linear), 1 - sqrt(p), (1 + cos(pi p)) / 2
    """
    decay_steps = total_steps - warmup_steps if decay_ratio is None else round(total_steps * decay_ratio)
    decay_start = total_steps - decay_steps

    def factor(step: int) -> float:
        step += 1
        if step <= warmup_steps:
            return step / (warmup_steps + 1)
        if step <= decay_start or decay_steps <= 0:
            return 1.0
        progress = min(1.0, (step - decay_start) / decay_steps)
        if decay_type == "linear":
            shape = 1 - progress
        elif decay_type == "sqrt":
            shape = 1 - math.sqrt(progress)
        else:
            shape = 0.5 * (1 + math.cos(math.pi * progress))
        return min_lr_factor + (1 - min_lr_factor) * shape

    return factor


class LRSchedulers:
    """One ``LambdaLR`` per optimizer, stepped together; a checkpoint holds one state (the first
    scheduler's: they are identical), loaded into all, so its key never depends on the stages."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], factor: Callable[[int], float]) -> None:
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, factor) for opt in optimizers]
        self._config_base_lrs = [list(s.base_lrs) for s in self.schedulers]  # optimizer.lr of the config

    def restore_base_lrs(self) -> float:
        """After a resume: the base rate back to the config's (``optimizer.lr``; a checkpoint holds the
        rate it was trained with), every group's current rate recomputed at the loaded position.
        Returns the checkpoint's base rate."""
        loaded = self.schedulers[0].base_lrs[0]
        for s, base in zip(self.schedulers, self._config_base_lrs):
            s.base_lrs = list(base)
            for group, lr0, fn in zip(s.optimizer.param_groups, base, s.lr_lambdas):
                group["initial_lr"], group["lr"] = lr0, lr0 * fn(s.last_epoch)
            s._last_lr = [group["lr"] for group in s.optimizer.param_groups]
        return float(loaded)

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        return [float(lr) for lr in self.schedulers[0].get_last_lr()]

    def state_dict(self) -> dict:
        state = self.schedulers[0].state_dict()
        state.pop("lr_lambdas", None)  # functions: rebuilt from the config
        return state

    def load_state_dict(self, state: dict) -> None:
        for s in self.schedulers:
            s.load_state_dict({**state, "lr_lambdas": [None] * len(s.lr_lambdas)})


def restore_hyperparameters(optimizers: Sequence[torch.optim.Optimizer], wanted: dict) -> dict[str, tuple]:
    """Set ``wanted`` (e.g. ``{"betas": (0.9, 0.95), "eps": 1e-8}``) in every param group, where a
    loaded optimizer state put the checkpoint's values; returns ``{name: (checkpoint's, wanted)}``
    of those that differed."""
    changed = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for name, value in wanted.items():
                old = tuple(group[name]) if isinstance(group[name], (tuple, list)) else group[name]
                if old != value:
                    changed[name] = (old, value)
                group[name] = value
    return changed


def clip_grad_norm_(
    parts: Sequence[nn.Module], max_norm: float, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip by the global L2 norm of every gradient, DTensor shards and every pipeline stage included.

    ``norm = sqrt(sum over pipeline stages of |g_stage|^2)``, where ``|g_stage|`` is the full
    (all-shard) norm of a DTensor gradient; every gradient is scaled by ``min(1, max_norm / norm)``.
    """
    grads = [p.grad for part in parts for p in part.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, torch.distributed.tensor.DTensor):
        norm = norm.full_tensor()
    if pp_group is not None:
        sq = norm**2
        dist.all_reduce(sq, group=pp_group)
        norm = sq.sqrt()
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm)
    return norm
