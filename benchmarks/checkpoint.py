"""What the checkpoints' checksums cost: DCP's save and load of a training state with titan_cp's
:class:`~titan_cp.checkpoint.ChecksumWriter` / :class:`~titan_cp.checkpoint.ChecksumReader` (a
CRC-32 per item, summed as the bytes are written, checked as they are read) and with DCP's own
``FileSystemWriter`` / ``FileSystemReader``, in one process.

The state is what the trainer saves, less the small pieces: a model's fp32 weights and AdamW's two
fp32 moments per weight (random values: the bytes, not their values, cost). Each repeat saves with
both writers in turn and loads each save with its reader (the order alternating between repeats),
into a fresh folder, with DCP's defaults (one file per process, ``fsync`` after each file). Times are
the medians: ``cpu_s`` the process's CPU time (``time.process_time``: user + system, the waits for
the disk not counted: the figure other work on the machine disturbs least), ``wall_s`` the elapsed
time.
"""

from __future__ import annotations

import shutil
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from titan_cp.checkpoint import ChecksumReader, ChecksumWriter
from titan_cp.families.llama3 import build_model

MODELS: dict[str, dict[str, Any]] = {
    "debugmodel_gqa": {"flavor": "debugmodel_gqa"},  # 6 layers of dim 256, vocabulary 2,048
    "100M": {
        "flavor": "debugmodel_gqa",
        "dim": 768,
        "n_layers": 8,
        "n_heads": 12,
        "n_kv_heads": 4,
        "vocab_size": 32000,
    },
}
"""The models measured: keyword arguments of :func:`titan_cp.families.llama3.build_model`."""

WRITERS = {"dcp": (dcp.FileSystemWriter, dcp.FileSystemReader), "checksum": (ChecksumWriter, ChecksumReader)}


def training_state(model: str, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """``{"model": weights, "optimizer": moments}`` of ``MODELS[model]``: fp32, random."""
    shapes = {name: p.shape for name, p in build_model(**MODELS[model]).named_parameters()}  # on meta: no memory
    g = torch.Generator().manual_seed(seed)
    weights = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
    moments = {
        f"state.{n}.{m}": torch.randn(s, generator=g) for n, s in shapes.items() for m in ("exp_avg", "exp_avg_sq")
    }
    return {"model": weights, "optimizer": moments}


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """``(CPU seconds, wall seconds)`` of ``fn()`` in this process."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def _save_and_load(state: dict, kind: str, path: Path) -> dict[str, tuple[float, float]]:
    """The times of saving ``state`` to ``path`` with the ``kind`` writer and loading it back with its reader."""
    writer, reader = WRITERS[kind]
    into = {section: {k: torch.empty_like(t) for k, t in tensors.items()} for section, tensors in state.items()}
    times = {"save": _timed(lambda: dcp.save(state, storage_writer=writer(path), no_dist=True))}
    times["load"] = _timed(lambda: dcp.load(into, storage_reader=reader(str(path)), no_dist=True))
    assert all(torch.equal(into[s][k], t) for s, tensors in state.items() for k, t in tensors.items())
    return times


def measure(model: str, folder: Path, repeats: int = 3) -> Iterator[dict]:
    """One record per operation (``save``, ``load``) of ``model``'s state: the medians of ``repeats``
    runs with each writer, and what the checksums add (seconds and percent of DCP's own time)."""
    state = training_state(model)
    nbytes = sum(t.numel() * t.element_size() for tensors in state.values() for t in tensors.values())
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        for r in range(repeats):
            for kind in list(WRITERS)[:: 1 if r % 2 == 0 else -1]:
                path = folder / f"{model}-{kind}-{r}"
                for op, seconds in _save_and_load(state, kind, path).items():
                    runs.setdefault((op, kind), []).append(seconds)
                shutil.rmtree(path)
    for op in ("save", "load"):
        record: dict[str, Any] = {"model": model, "op": op, "state_bytes": nbytes, "repeats": repeats}
        for unit, i in (("cpu_s", 0), ("wall_s", 1)):
            plain, summed = (statistics.median(t[i] for t in runs[op, kind]) for kind in WRITERS)
            record[f"dcp_{unit}"], record[f"checksum_{unit}"] = round(plain, 3), round(summed, 3)
            record[f"added_{unit}"] = round(summed - plain, 3)
            record[f"added_{unit.removesuffix('_s')}_percent"] = round(100 * (summed - plain) / plain, 1)
        yield record
