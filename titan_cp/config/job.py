"""The whole job config: one field per TOML section, and what is checked across sections.

Two steps, each explicit (:func:`titan_cp.config.load_config` runs both for training, the first alone
for generation, which reads none of the keys the second checks):

1. :meth:`JobConfig.validate` — every value against its field's type, choices and bounds,
   then each section's own rules. Pure: changes nothing, reads no file or environment.
2. :meth:`JobConfig.reconcile` — the checks that span sections (``seq_len`` against the sequence
   layout, pipeline microbatches and batch sizes against each other) and the adjustments they call for (a warmup longer than the run
   is shortened); returns what it adjusted, for the caller to announce once per job.
The model family's own rules (the ``[model]`` section, the model's heads and layers against the
degrees) are :func:`titan_cp.preflight.check_model`, and what the files on disk can tell before any
process starts is :func:`titan_cp.preflight.check_files`: a module above the config, the data, the
checkpoint and the model families (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, cast

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
)
from titan_cp.config.training import Training, check_microbatch_tokens
from titan_cp.config.values import Section
from titan_cp.errors import plural
from titan_cp.layout import seq_len_multiple
from titan_cp.mesh import DEGREE_KEYS, ParallelDims


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
        sections: dict[str, Any] = {section: types[section](**kwargs) for section, kwargs in by_section.items()}
        job_config = cls(**sections)
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

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The mesh degrees of ``[parallelism]`` for ``world_size`` ranks; the cp axis is split in two
        where the strategy runs on a 2-D sub-mesh (``hybrid``). ``ValueError`` naming the key."""
        p = self.parallelism
        split = p.strategy().mesh_ndim == 2
        return ParallelDims(
            **self.parallel_degrees(),
            world_size=world_size,
            cp_ulysses=p.context_parallel_ulysses_degree if split else None,
        )

    def parallel_degrees(self) -> dict[str, int]:
        """Degrees by mesh axis name; ``dp_shard`` may be -1 ("the rest", resolved by the mesh)."""
        return {axis: getattr(self.parallelism, key.partition(".")[2]) for axis, key in DEGREE_KEYS.items()}

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
                f"warming up over {plural(t.steps, 'step')}"
            )
            self.lr_scheduler = dataclasses.replace(s, warmup_steps=t.steps)
        if t.chat_template == "tokenizer" and not m.hf_assets_path:
            raise ValueError(
                "training.chat_template = 'tokenizer' needs model.hf_assets_path (a tokenizer_config.json "
                "with a chat_template); the byte tokenizer has none"
            )
        if p.pipeline_parallel_degree > 1 and t.local_batch_size % p.pipeline_parallel_microbatch_size:
            raise ValueError(
                f"training.local_batch_size ({t.local_batch_size}) must be a multiple of "
                f"parallelism.pipeline_parallel_microbatch_size ({p.pipeline_parallel_microbatch_size})"
            )
        p.check_microbatches(t.local_batch_size)
        _check_seq_len("training.seq_len", t.seq_len, p)
        _check_long_context_keys(self)
        if v.seq_len != -1:
            _check_seq_len("validation.seq_len", v.seq_len, p)
        if v.enable:
            check_microbatch_tokens("validation", *self.validation_rows())
        if v.enable and v.recall_shard_cut:
            _check_shard_cut(self)
        if -1 not in self.parallel_degrees().values():
            self.resolve_batch_sizes(p.data_parallel_replicate_degree * p.data_parallel_shard_degree)
        return notes

    def validation_rows(self) -> tuple[int, int]:
        """``(rows per data-parallel rank, seq_len)`` of a validation microbatch (-1s resolved)."""
        t, v = self.training, self.validation
        return (t.local_batch_size if v.local_batch_size == -1 else v.local_batch_size), (
            t.seq_len if v.seq_len == -1 else v.seq_len
        )


@functools.cache
def section_types() -> dict[str, type[Section]]:
    """Section name -> its dataclass, in :class:`JobConfig`'s order."""
    types = {f.name: cast("type[Section]", f.default_factory) for f in dataclasses.fields(JobConfig)}
    assert all(cls.NAME == name for name, cls in types.items()), "a JobConfig field and its section's name differ"
    return types


@functools.cache
def known_keys() -> dict[str, Any]:
    """Every titan_cp dotted key -> its field's annotation (bounds included)."""
    return {f"{name}.{field}": hint for name, cls in section_types().items() for field, hint in cls.hints().items()}


def _check_long_context_keys(cfg: JobConfig) -> None:
    """The block-level memory options are hooks and per-instance forwards that ``torch.compile``'d blocks
    would trace; FSDP's CPU offload needs FSDP."""
    ac, t, p = cfg.activation_checkpoint, cfg.training, cfg.parallelism
    used = [
        key
        for key, on in (
            ("activation_checkpoint.cpu_offload", ac.cpu_offload),
            ("activation_checkpoint.blocks_per_checkpoint", ac.blocks_per_checkpoint > 1),
            ("activation_checkpoint.tile_tokens", ac.tile_tokens > 0),
        )
        if on
    ]
    if used and cfg.compile.enable and "model" in cfg.compile.components:
        raise ValueError(f"{', '.join(used)} cannot be combined with compile.enable (compiled blocks): turn one off")
    fsdp = p.data_parallel_shard_degree * p.context_parallel_degree * p.data_parallel_replicate_degree
    if t.enable_cpu_offload and fsdp == 1:
        raise ValueError(
            "training.enable_cpu_offload = true offloads FSDP's shards: it needs FSDP (parallelism."
            "data_parallel_shard_degree x context_parallel_degree, or data_parallel_replicate_degree, larger than 1)"
        )


def _check_shard_cut(cfg: JobConfig) -> None:
    """``validation.recall_shard_cut`` cuts documents at the shards of the ``contiguous`` layout: it
    needs recall, several cp ranks, and that layout (under another one, where a shard's tokens
    come from is not a stretch of the row)."""
    v, p = cfg.validation, cfg.parallelism
    if not v.recall_eval:
        raise ValueError("validation.recall_shard_cut = true needs validation.recall_eval = true")
    if p.context_parallel_degree < 2:
        raise ValueError(
            "validation.recall_shard_cut = true needs parallelism.context_parallel_degree > 1 (on one rank "
            "there is no other shard to cut away)"
        )
    if p.context_parallel_load_balancer != "contiguous":
        raise ValueError(
            "validation.recall_shard_cut = true needs parallelism.context_parallel_load_balancer = 'contiguous' "
            f"(got {p.context_parallel_load_balancer!r}): its shards are stretches of the row, cut at fixed points"
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
