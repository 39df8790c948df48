"""``[profiling]``: ``torch.profiler`` traces and CUDA memory snapshots every ``profile_freq`` steps.

Layout on disk (``job.dump_folder``-relative folders from the config)::

    <save_traces_folder>/iteration_<step>/rank<r>_trace.json                  Chrome trace of step <step>
    <save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle   (CUDA only)

A trace covers exactly the steps whose number is a multiple of ``profile_freq``. A memory
snapshot holds the allocator's history since the run started (``_record_memory_history``) up to
the end of that step; open it at https://pytorch.org/memory_viz. CPU runs have no caching
allocator to record: the profiler says so once and takes no snapshot.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from titan_cp.config import Profiling

logger = logging.getLogger("titan_cp")


class Profiler:
    """``with profiler.step(n): <train step n>`` traces and snapshots the steps the config asks for."""

    def __init__(self, cfg: Profiling, dump_folder: Path, rank: int, device: torch.device) -> None:
        self.freq, self.rank = cfg.profile_freq, rank
        self.traces = Path(dump_folder) / cfg.save_traces_folder if cfg.enable_profiling else None
        self.snapshots = None
        if cfg.enable_memory_snapshot:
            if device.type == "cuda":
                self.snapshots = Path(dump_folder) / cfg.save_memory_snapshot_folder
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            elif rank == 0:
                logger.warning(
                    "profiling.enable_memory_snapshot: memory snapshots record the CUDA allocator; "
                    "this run is on %s, so none are taken",
                    device.type,
                )

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step % self.freq or (self.traces is None and self.snapshots is None):
            yield
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with (
            torch.profiler.profile(activities=activities)
            if self.traces is not None
            else contextlib.nullcontext() as prof
        ):
            yield
        if self.traces is not None and prof is not None:  # prof: the profiler exactly when traces are kept
            folder = self.traces / f"iteration_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))
        if self.snapshots is not None:
            folder = self.snapshots / f"iteration_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(folder / f"rank{self.rank}_memory_snapshot.pickle"))
