"""Distributed checkpoints that survive crashes and resume on a different mesh.

Layout on disk::

    <dump_folder>/<checkpoint.folder>/step-<N>/        one DCP checkpoint per saved step: the whole state
    <dump_folder>/<checkpoint.folder>/step-<N>-model/  the model alone at the last step (an export)
    <dump_folder>/<checkpoint.folder>/step-<N>.tmp/    a save in progress (never loaded)

What is saved: the model (by torchtitan's fully qualified names, whichever pipeline stage
or shard holds them), the optimizer (flattened by parameter name), the LR schedule, the
train state (step) and the data position (global: the next row of the stream).

Why it resumes on another mesh: ``torch.distributed.checkpoint`` stores every DTensor by
its global shape and name, and loading re-slices it for whatever placements the new run
has, so cp, dp_shard, dp_replicate, tp and pp degrees may all change.

Why a crash never leaves a bad "latest": a save is written under ``step-N.tmp`` and renamed
to ``step-N`` by rank 0 only after every rank finished writing (``rename`` is atomic on
POSIX); loading looks at complete ``step-N`` folders only. An asynchronous save
(``checkpoint.async_mode = "async"``, ``dcp.async_save``) is renamed when the next save starts
or :meth:`Checkpointer.close` is called.

Every ``step-N`` holds the whole state, the last step's too, so a finished run extended with a
larger ``training.steps`` continues exactly where it ended. ``checkpoint.last_save_model_only``
adds an export of the model alone, ``step-N-model`` (:meth:`Checkpointer.export_model`): not a
step to resume from. ``checkpoint.keep_latest_k`` prunes the older ``step-N`` folders but never
the newest one holding the whole state, and the ``step-N-model`` exports to the newest k as well
(``step-N-hf``, the Hugging Face export, is never pruned). A ``step-N`` holding the model alone
(a model-only final save as torchtitan writes it) is refused as the newest step of a resume,
naming the steps to choose from; named by ``checkpoint.load_step`` it loads the model alone.

A checkpoint to resume that cannot be read (its ``.metadata`` missing or damaged, a file it
lists missing or shorter than the metadata says, or DCP failing to read it) is a
:class:`~titan_cp.errors.UserError` naming it, and how to resume from an older step
(``checkpoint.load_step``): a resume never silently starts from scratch.
:func:`check_resume` finds all of that but a damaged payload from the metadata alone, before
any process group starts. Leftover ``step-N.tmp`` folders (saves that never finished) are
removed when the next run starts, and after every save.

Every saved item (a tensor's shard, or a pickled object) carries the CRC-32 of its bytes as
written: :class:`ChecksumWriter` sums them while DCP writes them (no second read) and records each
in the item's storage record of ``.metadata``; :class:`ChecksumReader` checks them as DCP reads the
items. An item whose bytes changed since (a flipped region, a torn page) is a ``UserError`` naming
the file, the bytes, the tensor and the step to resume from instead. A checkpoint without checksums
(saved by titan_cp before it wrote them, or by another program) loads with a one-line warning.

Never silently wrong: before loading, the checkpoint's model tensors are compared with the
model's (names and shapes, every pipeline stage's together): another model's checkpoint (a
flavor or ``model.hf_assets_path`` changed since the save) is a ``UserError`` that says so and
that the checkpoint is not damaged. After loading, the weights and optimizer state are checked
for NaN/inf (bytes damaged in a way DCP cannot tell), naming the checkpoint and the tensors. A
save the file system refuses (a full disk: ``ENOSPC``, seen by :class:`ChecksumWriter` where
``torch.save``'s writer would report only a position mismatch) is one ``UserError`` on every rank
naming the folder, the free bytes, the last saved step's size and the step kept
(:func:`save_failure`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import re
import shutil
import zlib
from collections.abc import Iterator, Sequence, Set
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.futures import Future as TorchFuture

from titan_cp.errors import UserError, process_rank
from titan_cp.families.llama3 import hf_checkpoint, torchtitan_checkpoint
from titan_cp.families.llama3.model import ModelArgs

logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d+)$")
_EXPORT_DIR = re.compile(r"^step-(\d+)-model$")
_INITIAL_FIX = "point it at a checkpoint that is whole"


def saved_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in ``folder``, ascending."""
    if not folder.is_dir():
        return []
    try:
        entries = list(folder.iterdir())
    except OSError as e:
        raise UserError(f"checkpoint folder {folder} cannot be read: {e.strerror}") from None
    return sorted(int(m.group(1)) for p in entries if p.is_dir() and (m := _STEP_DIR.match(p.name)))


def _step_of(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    if m is None:
        raise ValueError(f"{path} is not a step-<N> checkpoint folder")
    return int(m.group(1))


def _resume_fix(path: Path) -> str:
    """What to do about the damaged checkpoint ``path`` of a ``step-N`` folder, and exactly what
    moving it away would make a resume (``checkpoint.load_step = -1``: the newest step) do."""
    step, folder = _step_of(path), path.parent
    others = [s for s in saved_steps(folder) if s != step]
    full = [s for s in others if not _unreadable_or_model_only(folder / f"step-{s}")]
    older = [s for s in full if s < step]
    advice = (
        f"resume from an older step with --checkpoint.load_step {older[-1]} (saved steps: {older}); " if older else ""
    )
    if full and full[-1] == others[-1]:
        then = f"resumes from step {full[-1]}"
    elif others:
        then = f"stops at step-{others[-1]}, which holds only the model or cannot be read (name a step to load)"
    else:
        then = "starts from scratch: step 1, freshly initialised weights (metrics.jsonl is kept under another name)"
    return f"{advice}moving {path} away, the run {then}"


def _unreadable_or_model_only(path: Path) -> bool:
    try:
        return _model_only(path, dcp.FileSystemReader(str(path)).read_metadata())
    except Exception:  # noqa: BLE001 - a damaged .metadata: not a step to resume from
        return True


def _cause(e: BaseException) -> str:
    """``Type: first sentence`` of an exception; of a DCP ``CheckpointException``, its first rank's."""
    ranks = ""
    if isinstance(e, CheckpointException) and e.failures:
        ranks = f" on ranks {sorted(e.failures)}"
        e = next(iter(e.failures.values()))[0]
    first = (str(e).strip().splitlines() or [""])[0].split(". ")[0]  # the first sentence: libraries go on
    first = first if len(first) <= 120 else first[:117] + "..."
    return f"{type(e).__name__}{': ' + first if first else ''}{ranks}"


def read_metadata(path: Path, what: str, fix: str) -> Metadata:
    """The DCP ``Metadata`` of the checkpoint folder ``path``; a ``UserError`` naming ``what``
    (e.g. ``checkpoint step-4``) and ``fix`` when it is missing or cannot be read."""
    if not (path / ".metadata").is_file():
        raise UserError(f"{what} is not a complete DCP checkpoint (no {path / '.metadata'}); {fix}")
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - whatever a damaged pickle raises, the file is what is wrong
        raise UserError(f"{what}: {path / '.metadata'} cannot be read ({_cause(e)}); {fix}") from e


def verify_files(path: Path, metadata: Metadata, what: str, fix: str) -> None:
    """Every file the DCP ``metadata`` of ``path`` lists exists and is as long as it says."""
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = path / name
        if not file.is_file():
            raise UserError(f"{what}: {file} is missing (the checkpoint lists it); {fix}")
        have = file.stat().st_size
        if have < size:
            raise UserError(f"{what}: {file} is truncated ({have} bytes, the checkpoint lists {size}); {fix}")


def _requested_steps(folder: Path, step: int) -> list[int]:
    """The steps saved in ``folder``; a ``UserError`` when ``step`` (not -1, the newest) is not one of them."""
    steps = saved_steps(folder)
    if step != -1 and step not in steps:
        held = f"steps {steps}" if steps else "no checkpoint"
        raise UserError(f"checkpoint.load_step = {step}, but {folder} holds {held}")
    return steps


def resume_path(folder: Path, step: int = -1) -> Path | None:
    """The checkpoint a resume from ``folder`` loads: ``step-<step>``, or for ``-1`` the newest one;
    ``None`` when ``step`` is -1 and there is none. A requested step that is not there, a newest one
    that cannot be read, or a newest one holding the model alone (a resume could not continue it:
    it would go back to an older step, or start at step 1) is a ``UserError`` naming the steps to
    choose from."""
    steps = _requested_steps(folder, step)
    if not steps:
        return None
    if step != -1:
        return folder / f"step-{step}"
    newest = folder / f"step-{steps[-1]}"
    if _model_only(newest):
        raise UserError(_model_only_newest(newest))
    return newest


def _model_only_newest(path: Path) -> str:
    """The line refusing to resume from ``path``, the newest step, which holds the model alone."""
    step, folder = _step_of(path), path.parent
    full = [s for s in saved_steps(folder) if not _unreadable_or_model_only(folder / f"step-{s}")]
    whole = ""
    if full:
        again = f"step {step}" if full[-1] + 1 == step else f"steps {full[-1] + 1}-{step}"
        whole = (
            f"resume the whole state of step {full[-1]} with --checkpoint.load_step {full[-1]} ({again} trained "
            "again, the records of the first time kept under another name), or "
        )
    return (
        f"checkpoint {path} is the newest step but holds only the model (no optimizer, LR schedule or data position): "
        f"a resume cannot continue it. Either {whole}start from its weights with --checkpoint.load_step {step} "
        "(optimizer, schedule and data position afresh, from step 1)"
    )


def weights_path(folder: Path, step: int = -1) -> Path | None:
    """The checkpoint whose model weights ``step`` names for generation: ``step-<step>``, or for ``-1``
    the newest step, a model-only final save included (every step holds the model); ``None`` when
    ``step`` is -1 and there is none. A requested step that is not there is a ``UserError``."""
    steps = _requested_steps(folder, step)
    if not steps:
        return None
    return folder / f"step-{steps[-1] if step == -1 else step}"


def check_resume(folder: Path, step: int = -1, weights: bool = False) -> int | None:
    """The step a resume from ``folder`` would load (``None``: none), after checking its metadata
    and files (:func:`verify_files`); with ``weights``, the step whose model weights generation loads
    (:func:`weights_path`). Reads only: no process group needed, nothing written."""
    path = weights_path(folder, step) if weights else resume_path(folder, step)
    if path is None:
        return None
    what, fix = f"checkpoint {path}", _resume_fix(path)
    verify_files(path, read_metadata(path, what, fix), what, fix)
    return _step_of(path)


CRC_FIELD = "crc32"
"""The attribute of an item's storage record (DCP's ``_StorageInfo`` in ``.metadata``: file, offset,
length) that holds the CRC-32 of the item's bytes as written. An attribute of torch's own record,
so any DCP reader still reads the checkpoint (and ignores it)."""


class _SummedStream:
    """A file DCP writes, passed every byte, keeping the CRC-32 of each item's bytes.

    DCP asks a file's position (``tell``) right before and right after each item it writes
    (``filesystem._write_item``), so the bytes between two asks are one item: ``sums[(start, end)]``
    is their CRC-32 (``zlib.crc32``, chained over the writes). An ``OSError`` of the file (a full
    disk) is kept in ``error``: ``torch.save``'s zip writer reports it only as a position mismatch."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.pos = self._mark = self._crc = 0
        self.sums: dict[tuple[int, int], int] = {}
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            n = self._file.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self._crc = zlib.crc32(memoryview(data).cast("B")[:n], self._crc)
        self.pos += n
        return n

    def tell(self) -> int:
        if self.pos != self._mark:
            self.sums[self._mark, self.pos] = self._crc
            self._mark, self._crc = self.pos, 0
        return self.pos

    def __getattr__(self, name: str) -> Any:  # flush, close, fileno (fsync): the file's own
        return getattr(self._file, name)


class _SummingFileSystem(FileSystem):
    """DCP's local file system, whose files opened for writing are :class:`_SummedStream` s (by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: dict[str, _SummedStream] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            summed = self.streams[Path(path).name] = _SummedStream(cast(IO[bytes], stream))
            yield cast(io.IOBase, summed)


class ChecksumWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that records the CRC-32 of every item it writes in the item's
    storage record (:data:`CRC_FIELD`), summed as the bytes go to the file, and that raises the
    file's own ``OSError`` (a full disk) where ``torch.save`` would report a position mismatch.
    Costs one ``zlib.crc32`` pass over the bytes (benchmarks/results/2026-12-05-checkpoint-checksum.md)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = self._files = _SummingFileSystem()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture:
        try:
            results = super().write_data(plan, planner).wait()
        except Exception as e:
            refused = next((s.error for s in self._files.streams.values() if s.error is not None), None)
            if refused is None:
                raise
            raise refused from e
        for result in results:
            info = result.storage_data
            stream = self._files.streams[info.relative_path]
            stream.tell()  # the file's last item ends here
            span = (info.offset, info.offset + info.length)
            assert info.length == 0 or span in stream.sums, f"DCP wrote {info} between two positions it did not ask"
            setattr(info, CRC_FIELD, stream.sums.get(span, 0))
        done: TorchFuture = TorchFuture()
        done.set_result(results)
        return done


class DamagedItem(Exception):
    """An item of a checkpoint whose bytes do not match the CRC-32 written with them; the message
    names it (DCP pickles a rank's exception to the others: the message is its one argument)."""


class ChecksumReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that checks each item's bytes against the CRC-32 of its storage
    record (:data:`CRC_FIELD`) before DCP decodes them, raising :class:`DamagedItem` when they differ.
    Items without one (older checkpoints) are read as DCP reads them. Holds one item's bytes at a time."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._names = {(info.relative_path, info.offset): index.fqn for index, info in self.storage_data.items()}

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        view = super()._slice_file(file, sinfo)
        expected = getattr(sinfo, CRC_FIELD, None)
        if expected is None:
            return view
        data = view.read()
        if len(data) != sinfo.length or zlib.crc32(data) != expected:
            name = self._names.get((sinfo.relative_path, sinfo.offset), "an item")
            last = sinfo.offset + sinfo.length - 1
            raise DamagedItem(f"bytes {sinfo.offset}-{last} of {sinfo.relative_path} ({name}) are not the bytes saved")
        return io.BytesIO(data)


def has_checksums(metadata: Metadata) -> bool:
    """Whether the checkpoint of ``metadata`` records its items' CRC-32 (:class:`ChecksumWriter`)."""
    return any(hasattr(info, CRC_FIELD) for info in (metadata.storage_data or {}).values())


class Checkpointer:
    """Save and load the whole training state with DCP.

    ``model_parts`` and ``optimizers`` are parallel lists (one optimizer per pipeline stage
    held by this rank); ``stateful`` maps names to objects with ``state_dict``/``load_state_dict``
    (the LR schedulers, the data loader, the train state).
    """

    def __init__(
        self,
        folder: str | Path,
        model_parts: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        stateful: dict,
        keep_latest_k: int = 0,
        async_mode: str = "disabled",
        exclude_from_loading: tuple[str, ...] = (),
        model_what: str = "model.flavor",
    ) -> None:
        self.folder = Path(folder)
        self.model_parts, self.optimizers, self.stateful = model_parts, optimizers, stateful
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.exclude_from_loading = set(exclude_from_loading)
        self.model_what = model_what  # the config key and value that name the model, for errors
        self._options = StateDictOptions(flatten_optimizer_state_dict=True)
        self._pending: tuple[Future, Path, Path] | None = None  # an async save not yet renamed into place
        # an async save's collectives run in a background thread: on a group of their own, as torchtitan
        self._async_group = dist.new_group(backend="gloo") if async_mode == "async" else None

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
        """Write the whole state to ``step-<step>`` atomically; then keep only the newest
        ``keep_latest_k`` steps (the newest whole state always). Asynchronous saves are renamed into
        place by the next save or :meth:`close`."""
        return self._write(f"step-{step}", model_only=False)

    def export_model(self, step: int) -> Path:
        """Write the model alone to ``step-<step>-model`` (``checkpoint.last_save_model_only``), as
        :meth:`save` writes a step: a DCP checkpoint of the ``model`` for export or fine-tuning
        (``checkpoint.initial_load_path``), never a step to resume from, never pruned."""
        return self._write(f"step-{step}-model", model_only=True)

    def _write(self, name: str, model_only: bool) -> Path:
        """Write the state (the model alone if ``model_only``) to ``<folder>/<name>`` atomically."""
        self.close()
        final = self.folder / name
        tmp = self.folder / f"{name}.tmp"
        refused = None
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as e:  # a full disk refuses a folder too
                refused = save_failure(self.folder, tmp, e)
        refused = next((r for r in _all_ranks([refused]) if r is not None), None)  # and every rank waits for it
        if refused is not None:
            raise UserError(refused)
        state = self._state(model_only=model_only)
        writer = ChecksumWriter(tmp)
        if self.async_mode == "async":
            saving = dcp.async_save(state, storage_writer=writer, process_group=self._async_group)
            # a staged save (an async stager's) answers with its two futures: the upload is the save's end
            future = saving.upload_completion if isinstance(saving, AsyncSaveResponse) else saving
            self._pending = (future, tmp, final)
            return final
        try:
            dcp.save(state, storage_writer=writer)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
            self._write_failed(e, tmp)
        self._finish(tmp, final)
        return final

    def close(self) -> None:
        """Wait for an asynchronous save in flight and rename it into place."""
        if self._pending is not None:
            future, tmp, final = self._pending
            self._pending = None
            try:
                future.result()
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - as in save
                self._write_failed(e, tmp)
            self._finish(tmp, final)

    def _write_failed(self, e: BaseException, tmp: Path) -> None:
        """A save that the file system refused (a full disk, no permission: an ``OSError`` on some
        rank) becomes one ``UserError`` on every rank naming the folder, the bytes it needs when a
        saved step tells, and the step kept; the partial ``step-N.tmp`` is removed. Anything else
        propagates."""
        failures = e.failures.values() if isinstance(e, CheckpointException) else [(e, None)]
        os_errors = [f[0] for f in failures if isinstance(f[0], OSError)]
        if not os_errors:
            raise e
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(save_failure(self.folder, tmp, os_errors[0])) from None

    def _finish(self, tmp: Path, final: Path) -> None:
        dist.barrier()  # every rank has written its shards
        if dist.get_rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._purge()
        dist.barrier()

    def _purge(self) -> None:
        """Remove leftovers of crashed saves, the steps older than the newest ``keep_latest_k`` but
        the newest one holding the whole state (a resume needs it; a model-only step cannot stand in
        for it), and the ``step-N-model`` exports older than the newest ``keep_latest_k``."""
        for p in self.folder.glob("step-*.tmp"):  # leftovers of crashed saves
            shutil.rmtree(p, ignore_errors=True)
        if self.keep_latest_k > 0:
            steps = saved_steps(self.folder)
            whole = next((s for s in reversed(steps) if not _unreadable_or_model_only(self.folder / f"step-{s}")), None)
            for step in steps[: -self.keep_latest_k]:
                if step != whole:
                    shutil.rmtree(self.folder / f"step-{step}", ignore_errors=True)
            exports = sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _EXPORT_DIR.match(p.name)))
            for step in exports[: -self.keep_latest_k]:
                shutil.rmtree(self.folder / f"step-{step}-model", ignore_errors=True)

    def remove_leftovers(self) -> None:
        """Remove the ``step-N.tmp`` folders of saves that never finished (rank 0)."""
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        for p in sorted(self.folder.glob("step-*.tmp")):
            logger.info("removing %s: a save that did not finish", p)
            shutil.rmtree(p, ignore_errors=True)

    def load(self, step: int = -1) -> int | None:
        """Load ``step`` (``-1``: the newest complete one holding the whole state, else the newest
        model-only one); return it, or ``None`` if ``step`` is -1 and there is none. A requested
        step that is not there, or a checkpoint that cannot be read, is a ``UserError``: a resume
        never silently starts from scratch. Leftovers of unfinished saves are removed first."""
        self.remove_leftovers()
        path = resume_path(self.folder, step)
        if path is None:
            return None
        what, fix = f"checkpoint {path}", _resume_fix(path)
        metadata = read_metadata(path, what, fix)
        verify_files(path, metadata, what, fix)
        model_only = _model_only(path, metadata)
        if model_only and _rank0():
            logger.warning(
                "checkpoint %s holds only the model: loading the model; optimizer, schedule, data position and "
                "step start afresh",
                path,
            )
        self._load_path(path, metadata, model_only, self.exclude_from_loading, what=what, fix=fix)
        return _step_of(path)

    def load_model(self, path: str | Path, model_only: bool = True) -> None:
        """Start from ``checkpoint.initial_load_path``: the model, or everything it holds when
        ``model_only`` is false (``checkpoint.initial_load_model_only``)."""
        if not Path(path).is_dir():
            raise ValueError(f"checkpoint.initial_load_path = {str(path)!r} is not a checkpoint folder")
        if not (Path(path) / ".metadata").is_file():
            hint = (
                "; it holds *.safetensors: set checkpoint.initial_load_in_hf = true"
                if any(Path(path).glob("*.safetensors"))
                else ""
            )
            raise ValueError(
                f"checkpoint.initial_load_path = {str(path)!r} is not a DCP checkpoint (no .metadata){hint}"
            )
        what, fix = f"checkpoint.initial_load_path = {str(path)!r}", _INITIAL_FIX
        metadata = read_metadata(Path(path), what, fix)
        verify_files(Path(path), metadata, what, fix)
        if _torchtitan_layout(metadata):
            return self._load_torchtitan_model(Path(path), model_only, metadata)
        model_only = model_only or _model_only(Path(path), metadata)
        self._load_path(Path(path), metadata, model_only, what=what, fix=fix)

    def _load_torchtitan_model(self, path: Path, model_only: bool, metadata) -> None:
        """A DCP checkpoint written by torchtitan: the model's parameters at the top level, under
        titan_cp's names (torchtitan 0.2: ``tok_embeddings.weight``, ``layers.0.attention.wq.weight`` ...)
        or torchtitan 0.3's (``lm_head``, the Q/K/V of ``qkv_linear``, fused or split:
        :mod:`titan_cp.families.llama3.torchtitan_checkpoint`). Every parameter's name and shape is checked, and a
        tensor of the checkpoint's model that this model does not have is refused, before anything loads."""
        what = f"checkpoint.initial_load_path = {str(path)!r}"
        if not model_only:
            raise ValueError(
                f"{what} is a torchtitan checkpoint; titan_cp loads its model weights only: set "
                "checkpoint.initial_load_model_only = true"
            )
        saved = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
        state = self._model_state()
        found = torchtitan_checkpoint.sources({k: tuple(t.shape) for k, t in state.items()}, saved, what)
        extra = torchtitan_checkpoint.extra_keys(saved, _all_ranks(sorted({s.key for s in found.values()})))
        if extra:  # another model's checkpoint (every rank reads the same metadata)
            more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
            raise ValueError(
                f"{what} holds {', '.join(extra[:3])}{more}, which titan_cp's Llama does not have: it is another "
                "model's checkpoint (e.g. Qwen3's q/k norms); start from a Llama 3 checkpoint"
            )
        fused = {s.key for s in found.values() if s.part is not None}
        load = {s.key: state[name] for name, s in found.items() if s.part is None}
        load.update({k: torch.empty(saved[k], dtype=metadata.state_dict_metadata[k].properties.dtype) for k in fused})
        _dcp_load(load, path, metadata, what, _INITIAL_FIX)
        if fused:
            self._split_fused_qkv(state, found, load, what)
        _check_finite({"model": state}, what, _INITIAL_FIX)
        for part in self.model_parts:
            set_model_state_dict(part, state, options=StateDictOptions(strict=False))
        if _rank0():
            logger.info("loaded torchtitan model weights %s", path)

    def _split_fused_qkv(self, state: dict, found: dict, loaded: dict, what: str) -> None:
        """Put each layer's ``wq``, ``wk``, ``wv`` into ``state`` from torchtitan 0.3's fused ``wqkv`` tensors
        (``loaded``, whole on every rank), split per KV group by the model's head size."""
        args = getattr(self.model_parts[0], "args", None)
        if not isinstance(args, ModelArgs):
            raise ValueError(
                f"{what} holds torchtitan 0.3's fused qkv_linear.wqkv, which titan_cp splits by its Llama's "
                "head size; this model is not titan_cp's Llama"
            )
        for name, source in found.items():
            if source.part is None:
                continue
            full = torchtitan_checkpoint.split_wqkv(loaded[source.key], args.n_heads // args.kv_heads, args.head_dim)
            target = state[name]
            value = full[source.part].to(dtype=target.dtype)
            if isinstance(target, DTensor):  # this rank's shard of the whole tensor every rank holds
                state[name] = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
            else:
                state[name] = value.to(target.device)

    def load_hf(self, path: str | Path, model_args: ModelArgs) -> None:
        """Start from the Hugging Face Llama checkpoint folder ``path``
        (``checkpoint.initial_load_in_hf``): weights only, renamed and q/k permuted
        (``titan_cp.families.llama3.hf_checkpoint.load_hf``); shapes and ``config.json`` are checked first."""
        hf_checkpoint.load_hf(self.model_parts, path, model_args, key="checkpoint.initial_load_path")

    def save_hf(self, step: int, model_args: ModelArgs) -> Path:
        """Write the model as a Hugging Face Llama checkpoint to ``<folder>/step-<step>-hf``
        (``checkpoint.last_save_in_hf``; ``titan_cp.families.llama3.hf_checkpoint.save_hf``)."""
        return hf_checkpoint.save_hf(self.model_parts, self.folder / f"step-{step}-hf", model_args)

    def _check_model_keys(self, metadata, model_state: dict, what: str) -> None:
        """The checkpoint of ``metadata`` holds exactly the model's parameters, with their shapes
        (checked before loading anything): another model's checkpoint (a flavor or
        ``model.hf_assets_path`` changed since it was saved) is a ``UserError`` that says so."""
        saved = {
            k[len("model.") :]: tuple(m.size)
            for k, m in metadata.state_dict_metadata.items()
            if k.startswith("model.") and hasattr(m, "size")
        }
        names = set(_all_ranks(sorted(model_state)))  # pipeline stages hold different layers
        problems = [f"no {n}" for n in sorted(model_state) if n not in saved]
        problems += [
            f"{n} of shape {saved[n]} where the model's is {tuple(t.shape)}"
            for n, t in model_state.items()
            if n in saved and saved[n] != tuple(t.shape)
        ]
        extra = sorted(set(saved) - names)
        if extra:
            more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
            problems.append(f"{', '.join(extra[:3])}{more}, which the model does not have")
        problems = _all_ranks(problems[:1])
        if problems:
            raise UserError(
                f"{what} was saved from another model than {self.model_what}: it holds {problems[0]}. The checkpoint "
                f"is not damaged: set {self.model_what.split(' = ')[0]} to the model it was saved from, or start "
                "this model in another job.dump_folder"
            )

    def _load_path(
        self, path: Path, metadata: Metadata, model_only: bool, exclude: Set[str] = frozenset(), *, what: str, fix: str
    ) -> None:
        """Load the checkpoint ``path`` (its DCP ``metadata`` read) into the model and, unless
        ``model_only``, the rest of the state but ``exclude``; ``what``/``fix``: for errors."""
        state = {k: v for k, v in self._state(model_only).items() if k not in exclude}
        if "train_state" in state:  # train state added since the checkpoint was written keeps its value
            saved = metadata.state_dict_metadata
            state["train_state"] = {k: v for k, v in state["train_state"].items() if f"train_state.{k}" in saved}
        if "model" in state:
            self._check_model_keys(metadata, state["model"], what)
        _dcp_load(state, path, metadata, what, fix)
        _check_finite({k: state[k] for k in ("model", "optimizer") if k in state}, what, fix)
        if "model" in state:
            for part in self.model_parts:
                set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        if "optimizer" in state:
            for part, opt in zip(self.model_parts, self.optimizers):
                set_optimizer_state_dict(part, opt, state["optimizer"], options=self._options)
        for name, obj in self.stateful.items():
            if name in state:
                obj.load_state_dict(state[name])
        if _rank0():
            left_out = f" (left out: {', '.join(sorted(exclude))})" if exclude else ""
            logger.info("loaded checkpoint %s%s", path, left_out)


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _rank0() -> bool:
    """Whether this process logs for the job: rank 0, or the only process."""
    return process_rank()[0] == 0


def save_failure(folder: Path, tmp: Path, error: OSError) -> str:
    """The one line for a save into ``tmp`` (``step-N.tmp`` or ``step-N-model.tmp`` of ``folder``)
    that ``error`` stopped."""
    name, steps = tmp.name.removesuffix(".tmp"), saved_steps(folder)
    reason = error.strerror or str(error)
    if error.errno == errno.ENOSPC:
        free = shutil.disk_usage(folder).free if folder.is_dir() else 0
        need = f"; the last saved step takes {_folder_bytes(folder / f'step-{steps[-1]}')} bytes" if steps else ""
        reason = f"the disk is full ({free} bytes free{need})"
    if not _STEP_DIR.match(name):  # the model export, written after its step
        return (
            f"the model export {name} could not be written to {folder}: {reason}; step-{steps[-1]} holds the same "
            "model with the whole state (checkpoint.initial_load_path loads its model alone)"
        )
    kept = f"step-{steps[-1]} is kept whole and a rerun resumes from it" if steps else "no earlier step is saved"
    return (
        f"checkpoint step {name.removeprefix('step-')} could not be written to {folder}: {reason}; {kept}. Free space "
        "there (or lower checkpoint.keep_latest_k, or choose another job.dump_folder) and rerun"
    )


def _all_ranks(items: list) -> list:
    """``items`` of every rank, concatenated (this rank's alone without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return items
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [x for rank_items in gathered for x in rank_items]


def _check_finite(state: dict, what: str, fix: str) -> None:
    """Every floating-point tensor of the loaded ``state`` (this rank's shards) is finite, on every
    rank: a NaN or inf (a damaged payload DCP cannot tell, e.g. flipped bytes) is a ``UserError``
    naming ``what`` and the tensors, on every rank alike."""
    bad = []
    for section, tensors in state.items():
        for name, t in tensors.items():
            local = t.to_local() if isinstance(t, DTensor) else t
            if isinstance(local, torch.Tensor) and local.is_floating_point() and not torch.isfinite(local).all():
                bad.append(f"{section}.{name}")
    bad = sorted(set(_all_ranks(bad)))
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise UserError(
            f"{what} holds non-finite values (NaN or inf) in {', '.join(bad[:3])}{more}: it is damaged; {fix}"
        )


def _dcp_load(state: dict, path: Path, metadata: Metadata, what: str, fix: str) -> None:
    """``dcp.load`` of ``state`` from ``path`` (its ``metadata`` read), each item checked against its checksum
    (:class:`ChecksumReader`); an item that does not match, or a failure to read, is a ``UserError``
    naming ``what``. A checkpoint without checksums is loaded with a warning (rank 0)."""
    if not has_checksums(metadata) and _rank0():
        logger.warning(
            "%s carries no checksums (saved by titan_cp before it wrote them, or by another program): its bytes are "
            "loaded unchecked (DCP's own checks and the NaN/inf check only)",
            what,
        )
    try:
        dcp.load(state, storage_reader=ChecksumReader(str(path)))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
        failures = [f[0] for f in e.failures.values()] if isinstance(e, CheckpointException) else [e]
        damaged = next((f for f in failures if isinstance(f, DamagedItem)), None)
        if damaged is not None:
            raise UserError(f"{what} is damaged: {damaged} (their CRC-32 differs); {fix}") from e
        raise UserError(f"{what} cannot be loaded ({_cause(e)}); {fix}") from e


def _torchtitan_layout(metadata) -> bool:
    """Whether the DCP checkpoint of ``metadata`` is torchtitan's: model keys at the top level,
    where titan_cp nests them under ``model.``."""
    keys = metadata.state_dict_metadata
    return "tok_embeddings.weight" in keys or any(k.startswith("layers.") for k in keys)


def _model_only(path: Path, metadata=None) -> bool:
    """Whether the DCP checkpoint at ``path`` (of ``metadata``; read when not given, ``path`` then
    a ``step-N`` folder) holds the model alone (no optimizer state)."""
    if metadata is None:
        metadata = read_metadata(path, f"checkpoint {path}", _resume_fix(path))
    return not any(k.startswith("optimizer") for k in metadata.state_dict_metadata)
