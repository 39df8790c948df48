"""Distributed checkpoints that survive crashes and resume on a different mesh.

Layout on disk::

    <dump_folder>/<checkpoint.folder>/step-<N>/        one DCP checkpoint per saved step
    <dump_folder>/<checkpoint.folder>/step-<N>.tmp/    a save in progress (never loaded)

What is saved: the model (by torchtitan's fully qualified names, whichever pipeline stage
or shard holds them), the optimizer (flattened by parameter name), the LR schedule, the
train state (step) and the data position (global: the next row of the stream).

Why it resumes on another mesh: ``torch.distributed.checkpoint`` stores every DTensor by
its global shape and name, and loading re-slices it for whatever placements the new run
has, so cp, dp_shard, dp_replicate, tp and pp degrees may all change.

Why a crash never leaves a bad "latest": a save is written under ``step-N.tmp`` and renamed
to ``step-N`` by rank 0 only after every rank finished writing (``rename`` is atomic on
POSIX); loading looks at complete ``step-N`` folders only.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d+)$")


def saved_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in ``folder``, ascending."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name)))


class Checkpointer:
    """Save and load the whole training state with DCP.

    ``model_parts`` and ``optimizers`` are parallel lists (one optimizer per pipeline stage
    held by this rank); ``stateful`` maps names to objects with ``state_dict``/``load_state_dict``
    (the LR schedulers, the data loader, the train state).
    """

    def __init__(self, folder: str | Path, model_parts, optimizers, stateful: dict, keep_latest_k: int = 0):
        self.folder = Path(folder)
        self.model_parts, self.optimizers, self.stateful = model_parts, optimizers, stateful
        self.keep_latest_k = keep_latest_k
        self._options = StateDictOptions(flatten_optimizer_state_dict=True)

    def _model_state(self) -> dict:
        state = {}
        for part in self.model_parts:
            state.update(get_model_state_dict(part))
        return state

    def _optim_state(self) -> dict:
        state = {}
        for part, opt in zip(self.model_parts, self.optimizers):
            state.update(get_optimizer_state_dict(part, opt, options=self._options))
        return state

    def _state(self, model_only: bool) -> dict:
        state = {"model": self._model_state()}
        if not model_only:
            state["optimizer"] = self._optim_state()
            state.update({name: obj.state_dict() for name, obj in self.stateful.items()})
        return state

    def save(self, step: int) -> Path:
        """Write ``step-<step>`` atomically; then keep only the newest ``keep_latest_k``."""
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        rank0 = dist.get_rank() == 0
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save(self._state(model_only=False), checkpoint_id=str(tmp))
        dist.barrier()  # every rank has written its shards
        if rank0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._purge()
        dist.barrier()
        return final

    def _purge(self) -> None:
        for p in self.folder.glob("step-*.tmp"):  # leftovers of crashed saves
            shutil.rmtree(p, ignore_errors=True)
        if self.keep_latest_k > 0:
            for step in saved_steps(self.folder)[: -self.keep_latest_k]:
                shutil.rmtree(self.folder / f"step-{step}", ignore_errors=True)

    def load(self, step: int = -1) -> int | None:
        """Load ``step`` (``-1``: the newest complete one); return it, or ``None`` if there is none."""
        steps = saved_steps(self.folder)
        if not steps:
            return None
        if step == -1:
            step = steps[-1]
        elif step not in steps:
            raise ValueError(f"checkpoint.load_step = {step}, but {self.folder} holds steps {steps}")
        self._load_path(self.folder / f"step-{step}", model_only=False)
        return step

    def load_model(self, path: str | Path) -> None:
        """Load model weights only (``checkpoint.initial_load_path``)."""
        if not Path(path).is_dir():
            raise ValueError(f"checkpoint.initial_load_path {path} is not a checkpoint folder")
        self._load_path(Path(path), model_only=True)

    def _load_path(self, path: Path, model_only: bool) -> None:
        state = self._state(model_only)
        dcp.load(state, checkpoint_id=str(path))
        for part in self.model_parts:
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        if model_only:
            return
        for part, opt in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(part, opt, state["optimizer"], options=self._options)
        for name, obj in self.stateful.items():
            obj.load_state_dict(state[name])
        logger.info("loaded checkpoint %s", path)
