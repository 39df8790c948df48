"""The whole job config: one field per TOML section, and what is checked across sections.

Three steps, each explicit (:func:`titan_cp.config.load_config` runs the first two):

1. :meth:`JobConfig.validate` — every value against its field's type, choices and bounds,
   then each section's own rules. Pure: changes nothing, reads no file or environment.
2. :meth:`JobConfig.reconcile` — the checks that span sections (the model's heads and layers
   against the degrees, ``seq_len`` against the sequence layout, pipeline microbatches and batch
   sizes against each other) and the adjustments they call for (a warmup longer than the run
   is shortened); returns what it adjusted, for the caller to announce once per job.
3. :meth:`JobConfig.check_files` — what the files on disk can tell before any process starts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from titan_cp.config.generate import Generate
from titan_cp.config.parallelism import Parallelism
from titan_cp.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Job,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Profiling,
    Validation,
    flavors,
)
from titan_cp.config.training import Training, check_microbatch_tokens
from titan_cp.config.values import Section
from titan_cp.layout import seq_len_multiple


@dataclass
class JobConfig:
    """The whole job: one field per TOML section.

    ``given_keys``: the dotted keys the TOML or the command line set (:meth:`from_values`), so
    that a default can be told from the same value given on purpose; none for a config built in
    code.
    """

    job: Job = field(default_factory=Job)
    profiling: Profiling = field(default_factory=Profiling)
    metrics: Metrics = field(default_factory=Metrics)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    validation: Validation = field(default_factory=Validation)
    comm: Comm = field(default_factory=Comm)
    generate: Generate = field(default_factory=Generate)

    def __post_init__(self) -> None:
        self.given_keys: frozenset[str] = frozenset()

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> JobConfig:
        """The config with ``values`` (dotted key -> value of the field's type) set and every other
        key at its default; each section is built from its values. Remembers which keys were given."""
        by_section: dict[str, dict[str, Any]] = defaultdict(dict)
        for key, value in values.items():
            section, name = key.split(".")
            by_section[section][name] = value
        types = section_types()
        job_config = cls(**{section: types[section](**kwargs) for section, kwargs in by_section.items()})
        job_config.given_keys = frozenset(values)
        return job_config

    def is_given(self, key: str) -> bool:
        """Whether the dotted ``key`` was set by the TOML or the command line (not left at its default)."""
        return key in self.given_keys

    def sections(self) -> list[Section]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}``, for logs and checkpoint metadata."""
        return asdict(self)

    def parallel_degrees(self) -> dict[str, int]:
        """Degrees by mesh axis name; ``dp_shard`` may be -1 ("the rest", resolved by the mesh)."""
        p = self.parallelism
        return {
            "pp": p.pipeline_parallel_degree,
            "dp_replicate": p.data_parallel_replicate_degree,
            "dp_shard": p.data_parallel_shard_degree,
            "cp": p.context_parallel_degree,
            "tp": p.tensor_parallel_degree,
        }

    def resolve_batch_sizes(self, dp_degree: int) -> tuple[int, int]:
        """``(global_batch_size, gradient_accumulation_steps)`` in rows, for ``dp_degree`` data-parallel
        ranks (``dp_replicate * dp_shard``): ``global = local_batch_size * dp_degree * accumulation``."""
        t = self.training
        per_microstep = t.local_batch_size * dp_degree
        if t.global_batch_size == -1:
            accum = 1 if t.gradient_accumulation_steps == -1 else t.gradient_accumulation_steps
            return per_microstep * accum, accum
        if t.global_batch_size % per_microstep:
            raise ValueError(
                f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"training.local_batch_size ({t.local_batch_size}) x data-parallel degree ({dp_degree}) "
                f"= {per_microstep}"
            )
        accum = t.global_batch_size // per_microstep
        if t.gradient_accumulation_steps not in (-1, accum):
            raise ValueError(
                f"training.gradient_accumulation_steps ({t.gradient_accumulation_steps}) disagrees with "
                f"training.global_batch_size / (training.local_batch_size x dp degree) = "
                f"{t.global_batch_size} / {per_microstep} = {accum}; set one of them to -1"
            )
        return t.global_batch_size, accum

    def validate(self) -> None:
        """Check every value against its field (type, choices, bounds) and each section's own rules;
        raise ``ValueError`` naming the key. Changes nothing; reads no file or environment."""
        for section in self.sections():
            section.validate()

    def reconcile(self) -> list[str]:
        """The checks that span sections, and the adjustments they call for (module docstring, step 2).

        Returns one sentence per adjustment made (empty: none), for the caller to announce once
        per job. Raises ``ValueError`` naming the keys."""
        m, s, t, p, v = self.model, self.lr_scheduler, self.training, self.parallelism, self.validation
        notes = []
        if s.warmup_steps > t.steps:
            notes.append(
                f"lr_scheduler.warmup_steps ({s.warmup_steps}) is longer than training.steps ({t.steps}): "
                f"warming up over {t.steps} steps"
            )
            self.lr_scheduler = dataclasses.replace(s, warmup_steps=t.steps)
        if t.chat_template == "tokenizer" and not m.hf_assets_path:
            raise ValueError(
                "training.chat_template = 'tokenizer' needs model.hf_assets_path (a tokenizer_config.json "
                "with a chat_template); the byte tokenizer has none"
            )
        if m.name == "hf":
            _check_hf_keys(self)  # the heads are checked against config.json in check_files
        else:
            args = flavors()[m.flavor]
            p.check_model(m.flavor, args.n_heads, args.n_kv_heads or args.n_heads, args.n_layers)
        if p.pipeline_parallel_degree > 1 and t.local_batch_size % p.pipeline_parallel_microbatch_size:
            raise ValueError(
                f"training.local_batch_size ({t.local_batch_size}) must be a multiple of "
                f"parallelism.pipeline_parallel_microbatch_size ({p.pipeline_parallel_microbatch_size})"
            )
        _check_seq_len("training.seq_len", t.seq_len, p)
        if v.seq_len != -1:
            _check_seq_len("validation.seq_len", v.seq_len, p)
        if v.enable:
            check_microbatch_tokens("validation", *self.validation_rows())
        if -1 not in self.parallel_degrees().values():
            self.resolve_batch_sizes(p.data_parallel_replicate_degree * p.data_parallel_shard_degree)
        return notes

    def validation_rows(self) -> tuple[int, int]:
        """``(rows per data-parallel rank, seq_len)`` of a validation microbatch (-1s resolved)."""
        t, v = self.training, self.validation
        return (t.local_batch_size if v.local_batch_size == -1 else v.local_batch_size), (
            t.seq_len if v.seq_len == -1 else v.seq_len
        )

    def check_files(self, training: bool = True) -> None:
        """What the files on disk and this machine can tell before any process starts: the output
        folder can be written, the tokenizer is JSON, each dataset's path exists, the checkpoint to
        resume (its files whole) or to start from, a microbatch fits the host memory. Raises
        ``ValueError`` naming the key (and the file). Writes nothing. ``training=False`` (generation):
        the datasets and the training microbatch are not checked (they are not read)."""
        from titan_cp.data.tokenizer import check_tokenizer_files  # noqa: PLC0415 - the data package imports torch

        _check_dump_folder(self.job.dump_folder)
        if self.model.hf_assets_path:
            check_tokenizer_files(self.model.hf_assets_path)
        if self.model.name == "hf":
            from titan_cp.integrations.hf_trainer import check_job  # noqa: PLC0415 - needs transformers

            check_job(self)
        if training:
            _check_dataset_paths(self.training, self.validation)
        _check_checkpoint_paths(self.checkpoint, Path(self.job.dump_folder))
        if training:
            _check_host_memory(self)


@functools.cache
def section_types() -> dict[str, type[Section]]:
    """Section name -> its dataclass, in :class:`JobConfig`'s order."""
    types = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}
    assert all(cls.NAME == name for name, cls in types.items()), "a JobConfig field and its section's name differ"
    return types


@functools.cache
def known_keys() -> dict[str, Any]:
    """Every titan_cp dotted key -> its field's annotation (bounds included)."""
    return {f"{name}.{field}": hint for name, cls in section_types().items() for field, hint in cls.hints().items()}


def _check_hf_keys(cfg: JobConfig) -> None:
    """``model.name = "hf"``: what titan_cp builds for Hugging Face models (FSDP, CP, AC, compile; not
    TP or PP), and where their weights come from."""
    p, c = cfg.parallelism, cfg.checkpoint
    if cfg.is_given("model.flavor"):
        raise ValueError(
            f"model.flavor = {cfg.model.flavor!r} shapes titan_cp's Llama; with model.name = 'hf' the model is "
            "model.hf_assets_path's config.json: remove model.flavor"
        )
    for key, degree in (
        ("parallelism.tensor_parallel_degree", p.tensor_parallel_degree),
        ("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree),
    ):
        if degree != 1:
            raise ValueError(
                f"{key} = {degree}: model.name = 'hf' runs with FSDP and context parallelism only (not tensor "
                f"or pipeline parallelism); set {key} = 1"
            )
    if not (c.initial_load_path and c.initial_load_in_hf):
        raise ValueError(
            "model.name = 'hf' starts from the weights of a Hugging Face folder: set checkpoint.initial_load_path "
            "(e.g. to model.hf_assets_path) and checkpoint.initial_load_in_hf = true"
        )


def _check_seq_len(key: str, seq_len: int, p: Parallelism) -> None:
    """The sequence must split evenly over the cp ranks, as the layout cuts it
    (:func:`titan_cp.layout.seq_len_multiple`: two chunks per rank for ``zigzag``, equal shards
    otherwise)."""
    cp, balance = p.context_parallel_degree, p.context_parallel_load_balancer
    multiple = seq_len_multiple(balance, cp)
    if cp > 1 and seq_len % multiple:
        what = f"({cp})" if multiple == cp else f"({cp}) x {multiple // cp} = {multiple}"
        raise ValueError(
            f"{key} ({seq_len}) must be divisible by parallelism.context_parallel_degree {what} "
            f"for parallelism.context_parallel_load_balancer = {balance!r}"
        )


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
        if kind == "synthetic_recall":
            continue
        if not path:
            raise ValueError(
                f"{kind_key} = {kind!r} is not built in (built in: 'synthetic_recall'); set "
                f"{path_key} to a local copy: titan_cp never downloads data"
            )
        if not Path(path).exists():
            raise ValueError(f"{path_key} = {path!r} does not exist")


def _check_checkpoint_paths(c: Checkpoint, dump_folder: Path) -> None:
    """The checkpoint to resume exists and is whole (:func:`titan_cp.checkpoint.check_resume`); the
    weights to start from exist, and are whole, when nothing is resumed."""
    from titan_cp import checkpoint  # noqa: PLC0415 - torch's checkpoint reader, needed here only
    from titan_cp.model import hf  # noqa: PLC0415 - as above

    resumed = checkpoint.check_resume(dump_folder / c.folder, c.load_step) if c.enable else None
    if resumed is not None or not c.initial_load_path:
        return
    path, key = Path(c.initial_load_path), "checkpoint.initial_load_path"
    if not path.exists():
        raise ValueError(f"{key} = {c.initial_load_path!r} does not exist")
    if c.initial_load_in_hf:
        hf.check_hf_folder(path, key)
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
