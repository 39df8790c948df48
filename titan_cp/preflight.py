"""What the model family, the files on disk and this machine can tell before any process starts.

Above the layers it checks (docs/architecture.md): the config (the values), the model family (its own
keys: :func:`check_model`; its files: :meth:`titan_cp.families.ModelFamily.check_files`), the data
(the tokenizer's files, the datasets' paths) and the checkpoint (the step to resume, the weights to
start from); each of those takes plain values and imports nothing from here. Importing this module
registers the built-in families (the Hugging Face one lives in :mod:`titan_cp.integrations.hf_family`).
``python -m titan_cp.train`` and ``python -m titan_cp.generate`` call :func:`check_files` (which
starts with :func:`check_model`) after ``load_config`` and before any process group starts; the
trainer, the planner and generation take their family from :func:`check_model`.
"""

from __future__ import annotations

import os
from pathlib import Path

from titan_cp import checkpoint
from titan_cp.config import Checkpoint, JobConfig, Training, Validation
from titan_cp.data.tokenizer import check_tokenizer_files
from titan_cp.families import ModelFamily, get_family
from titan_cp.families.llama3 import hf_checkpoint
from titan_cp.files import check_saved_hf_dataset
from titan_cp.integrations import hf_family  # noqa: F401 - registers model.name = 'hf'


def check_model(cfg: JobConfig) -> ModelFamily:
    """The family of ``model.name``, once it has checked its own keys: the ``[model]`` section
    (:meth:`~titan_cp.families.ModelFamily.check_section`), then the keys across sections (the
    model's heads and layers against the degrees: :meth:`~titan_cp.families.ModelFamily.check_keys`).
    ``ValueError`` naming the key. Reads no file."""
    family = get_family(cfg.model.name)
    family.check_section(cfg.model)
    family.check_keys(cfg)
    return family


def check_files(cfg: JobConfig, training: bool = True) -> None:
    """The model family's keys (:func:`check_model`), the output folder can be written, the tokenizer is JSON, the model family's files, each
    dataset's path exists, the checkpoint to resume (its files whole) or to start from, a
    microbatch fits the host memory. Raises ``ValueError`` naming the key (and the file). Writes nothing.
    ``training=False`` (generation): the datasets and the training microbatch are not checked (not read)."""
    family = check_model(cfg)
    _check_dump_folder(cfg.job.dump_folder)
    if cfg.model.hf_assets_path:
        check_tokenizer_files(cfg.model.hf_assets_path)
    family.check_files(cfg)
    if training:
        _check_dataset_paths(cfg.training, cfg.validation)
    _check_checkpoint_paths(cfg.checkpoint, Path(cfg.job.dump_folder), training)
    if training:
        _check_host_memory(cfg)


def _check_dataset_paths(t: Training, v: Validation) -> None:
    """Every dataset that is not built in names a local path that exists."""
    sources = (
        [] if t.dataset == "mixture" else [(t.dataset, t.dataset_path, "training.dataset", "training.dataset_path")]
    )
    sources += [
        (s.kind, s.path, f"training.mixture[{i}].kind", f"training.mixture[{i}].path") for i, s in enumerate(t.mixture)
    ]
    if v.enable:
        sources.append((v.dataset, v.dataset_path, "validation.dataset", "validation.dataset_path"))
    for kind, path, kind_key, path_key in sources:
        if kind in ("synthetic_recall", "synthetic_lookup"):
            continue
        if not path:
            raise ValueError(
                f"{kind_key} = {kind!r} is not built in (built in: 'synthetic_recall', 'synthetic_lookup'); set "
                f"{path_key} to a local copy: titan_cp never downloads data"
            )
        if not Path(path).exists():
            raise ValueError(f"{path_key} = {path!r} does not exist")
        if kind == "hf":
            check_saved_hf_dataset(path, kind_key, path_key)


def _check_checkpoint_paths(c: Checkpoint, dump_folder: Path, training: bool) -> None:
    """The checkpoint to resume (not ``training``: whose weights to load) exists and is whole
    (:func:`titan_cp.checkpoint.check_resume`); the weights to start from exist, and are whole, when
    nothing is resumed."""
    resumed = checkpoint.check_resume(dump_folder / c.folder, c.load_step, weights=not training) if c.enable else None
    if resumed is not None or not c.initial_load_path:
        return
    path, key = Path(c.initial_load_path), "checkpoint.initial_load_path"
    if not path.exists():
        raise ValueError(f"{key} = {c.initial_load_path!r} does not exist")
    if c.initial_load_in_hf:
        hf_checkpoint.check_hf_folder(path, key)
    elif (path / ".metadata").is_file():
        what = f"{key} = {c.initial_load_path!r}"
        fix = "point it at a checkpoint that is whole"
        checkpoint.verify_files(path, checkpoint.read_metadata(path, what, fix), what, fix)


def _check_dump_folder(dump_folder: str) -> None:
    """``job.dump_folder`` is a folder this process can write in, or can be made in one."""
    path = Path(dump_folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing == path and not path.is_dir():
        raise ValueError(f"job.dump_folder = {dump_folder!r} is a file, not a folder; choose a folder")
    if not existing.is_dir():
        raise ValueError(f"job.dump_folder = {dump_folder!r} cannot be made: {str(existing)!r} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        made = "" if existing == path else " (where it would be made)"
        raise ValueError(
            f"job.dump_folder = {dump_folder!r}: cannot write in {str(existing)!r}{made}; choose a folder you can write"
        )


_HOST_BYTES_PER_TOKEN = 32  # the loader's tokens, labels, positions and recall distances, int64 each


def _check_host_memory(cfg: JobConfig) -> None:
    """One microbatch of rows fits this machine's memory, for every rank on it (``LOCAL_WORLD_SIZE``):
    the loader alone holds ``rows * seq_len * 32`` bytes of int64 per-token tensors (a lower bound)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no such query on this system: nothing to compare with
        return
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    t = cfg.training
    for section, (rows, seq_len) in (
        ("training", (t.local_batch_size, t.seq_len)),
        ("validation", cfg.validation_rows()),
    ):
        if section == "validation" and not cfg.validation.enable:
            continue
        need = rows * seq_len * _HOST_BYTES_PER_TOKEN * local_ranks
        if need > total:
            raise ValueError(
                f"{section}.seq_len = {seq_len} with {section}.local_batch_size = {rows}: one microbatch needs at "
                f"least {need / 2**30:.1f} GiB of host memory on {local_ranks} rank(s) ({_HOST_BYTES_PER_TOKEN} "
                f"bytes per token), this machine has {total / 2**30:.1f} GiB; lower {section}.seq_len or "
                f"{section}.local_batch_size"
            )
