"""torchtitan-style job configuration: one dataclass per TOML section.

Precedence is CLI > TOML > defaults::

    job_config = load_config(["--job.config_file", "train_configs/debug_cp.toml",
                              "--training.steps", "5", "--parallelism.context_parallel_degree=2"])

Section and key names follow torchtitan's v0.2 ``JobConfig`` (``job``, ``metrics``, ``model``,
``optimizer``, ``lr_scheduler``, ``training``, ``parallelism``, ``checkpoint``,
``activation_checkpoint``, ``compile``, ``validation``, ``comm``, ...), so a torchtitan Llama 3
TOML loads unmodified:

- torchtitan keys that titan_cp does not implement (``[float8]``, ``model.converters``, ...) are
  accepted and ignored, all listed in one warning;
- legacy torchtitan keys that were renamed (``checkpoint.enable_checkpoint``,
  ``training.batch_size``, ...) are applied to their new name and listed in the same warning;
- a key that neither defines is a ``ValueError`` with a "did you mean" hint.

CLI overrides: ``--section.key value`` or ``--section.key=value``; booleans also as a bare
``--section.flag`` (true) or ``--section.no_flag`` (false); lists comma-separated; ``none`` for an
optional value.

Values are validated by :meth:`JobConfig.validate` (called by :func:`load_config`) without starting
any process group. What needs the world size (mesh degrees, the gradient-accumulation count when
``parallelism.data_parallel_shard_degree = -1``) is checked by ``titan_cp.mesh.ParallelDims`` and
:meth:`JobConfig.resolve_batch_sizes` at run time.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import types
import typing
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

MODEL_NAMES = ("llama3",)
INT64 = (-(2**63), 2**63 - 1)  # every integer key must fit (seeds, sizes and steps become tensors and C ints)


@dataclass
class Job:
    config_file: str | None = None
    """TOML file to read the job config from."""

    dump_folder: str = "./outputs"
    """Folder for all job outputs (checkpoints, metrics, traces)."""

    description: str = "default job"
    """Free-text description of the job, logged at start."""

    print_config: bool = False
    """Log the resolved job config (every key, as JSON) at start, on rank 0."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Collect ``torch.profiler`` traces (CPU and CUDA activity): one Chrome trace per rank every
    ``profile_freq`` steps, of the last step of each period, as
    ``<save_traces_folder>/iteration_<step>/rank<r>_trace.json``."""

    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to ``job.dump_folder``."""

    profile_freq: int = 10
    """Trace (and snapshot memory) every this many steps."""

    enable_memory_snapshot: bool = False
    """Record the CUDA caching allocator's history and dump a snapshot every ``profile_freq`` steps
    as ``<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle`` (open it at
    pytorch.org/memory_viz). CUDA only: on CPU the trainer logs that no snapshot is taken."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to ``job.dump_folder``."""

    def validate(self) -> None:
        _positive("profiling.profile_freq", self.profile_freq)


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every this many steps."""

    enable_tensorboard: bool = False
    """Also write TensorBoard events (needs the optional ``tensorboard`` package)."""

    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to ``job.dump_folder``."""

    save_jsonl_file: str = "metrics.jsonl"
    """Machine-readable metrics, one JSON object per step, relative to ``job.dump_folder``;
    empty (``--metrics.save_jsonl_file=``) disables the file."""

    def validate(self) -> None:
        _positive("metrics.log_freq", self.log_freq)


@dataclass
class Model:
    name: str = "llama3"
    """Model family; titan_cp implements ``llama3``."""

    flavor: str = "debugmodel"
    """Model size (``titan_cp.model.flavors``): torchtitan's ``debugmodel``, ``8B``, ``70B``, ``405B``
    (the same models as torchtitan's flavors of those names), or titan_cp's ``tiny`` and
    ``debugmodel_gqa`` (CPU)."""

    hf_assets_path: str | None = None
    """Folder with local Hugging Face assets; its ``tokenizer.json`` is used as the tokenizer.
    Unset (or empty): the built-in byte-level tokenizer."""

    def validate(self) -> None:
        _choice("model.name", self.name, MODEL_NAMES)
        _choice("model.flavor", self.flavor, list(_flavors()))


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """``AdamW`` (decoupled weight decay) or ``Adam`` (``weight_decay`` added to the gradient)."""

    lr: float = 8e-4
    """Peak learning rate."""

    beta1: float = 0.9
    """First-moment decay."""

    beta2: float = 0.95
    """Second-moment decay."""

    eps: float = 1e-8
    """Denominator epsilon."""

    weight_decay: float = 0.1
    """Decoupled weight decay."""

    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """torch.optim implementation: ``fused`` (one kernel for all parameters, fastest),
    ``foreach`` (multi-tensor ops) or ``for-loop`` (one parameter at a time)."""

    def validate(self) -> None:
        _positive("optimizer.lr", self.lr)
        _positive("optimizer.eps", self.eps)
        _at_least("optimizer.weight_decay", self.weight_decay, 0)
        for key, beta in (("optimizer.beta1", self.beta1), ("optimizer.beta2", self.beta2)):
            if not 0 <= beta < 1:
                raise ValueError(f"{key} must be in [0, 1), got {beta}")


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Linear warmup steps, from near 0 to ``optimizer.lr``; at most ``training.steps`` (a longer
    warmup is shortened to ``training.steps``, with a warning, as torchtitan does)."""

    decay_ratio: float | None = None
    """Fraction of ``training.steps`` spent decaying, at the end (warmup-stable-decay).
    Unset: decay starts right after warmup."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Decay curve."""

    min_lr_factor: float = 0.0
    """The learning rate decays to ``optimizer.lr * min_lr_factor``."""

    def validate(self) -> None:
        _at_least("lr_scheduler.warmup_steps", self.warmup_steps, 0)
        if self.decay_ratio is not None and not 0 <= self.decay_ratio <= 1:
            raise ValueError(f"lr_scheduler.decay_ratio must be in [0, 1] or unset, got {self.decay_ratio}")
        if not 0 <= self.min_lr_factor <= 1:
            raise ValueError(f"lr_scheduler.min_lr_factor must be in [0, 1], got {self.min_lr_factor}")


@dataclass
class MixtureSource:
    """One source of ``training.mixture``: a ``[[training.mixture]]`` table in TOML, or
    ``name:kind:path:weight`` on the command line (comma-separated; ``path`` may be empty)."""

    name: str
    """Name of the source, unique in the mixture; its drawn tokens are logged as ``tokens_drawn/<name>``."""

    kind: str
    """Dataset kind, as ``training.dataset``: ``synthetic_recall``, ``text``, ``chat``, ``hf``, ...."""

    path: str | None = None
    """Local file or folder of the source (not needed for ``synthetic_recall``)."""

    weight: float = 1.0
    """Sampling weight (>= 0): documents are drawn with probability weight / sum of weights."""

    @classmethod
    def parse(cls, key: str, text: str) -> dict[str, str]:
        """``"name:kind:path:weight"`` -> the table's fields (values still strings)."""
        parts = text.split(":")
        if len(parts) < 4:
            raise ValueError(f"{key} entries on the command line are name:kind:path:weight, got {text!r}")
        return {"name": parts[0], "kind": parts[1], "path": ":".join(parts[2:-1]) or "none", "weight": parts[-1]}


@dataclass
class Training:
    dataset: str = "synthetic_recall"
    """Dataset: ``synthetic_recall`` (built in, long-range recall), ``text`` (local .txt/.jsonl at
    ``training.dataset_path``), ``chat`` (chat/agent-trajectory JSON lines, ``{"messages": [{"role",
    "content"}, ...]}``, loss on ``training.loss_roles``), ``hf`` (a Hugging Face dataset saved on
    disk), ``mixture`` (the sources of ``training.mixture``, by weight), or any other name with
    ``training.dataset_path`` pointing at a local copy. Nothing is ever downloaded."""

    dataset_path: str | None = None
    """Local file or folder of the dataset."""

    packing: Literal["stream", "best_fit"] = "stream"
    """How documents become rows (training and validation): ``stream`` packs them end to end and
    cuts one wherever a row ends (no padding); ``best_fit`` never cuts a document no longer than
    ``seq_len`` (longer ones are split into ``seq_len`` windows) and fills the rest of a row with
    one padding document that carries no loss. See ``titan_cp.data.packing``."""

    packing_lookahead: int = 512
    """For ``packing = "best_fit"``: document pieces buffered to choose from when filling a row
    (more: less padding, documents read further ahead)."""

    loss_roles: list[Literal["system", "user", "assistant", "tool"]] = field(default_factory=lambda: ["assistant"])
    """For ``chat`` records: the roles whose turns carry loss; the other turns are context only."""

    chat_template: Literal["chatml", "tokenizer"] = "chatml"
    """For ``chat`` records: ``chatml`` (built in, see ``titan_cp.data.chat``) or ``tokenizer``
    (the ``chat_template`` of the ``tokenizer_config.json`` in ``model.hf_assets_path``)."""

    mixture: list[MixtureSource] = field(default_factory=list)
    """For ``dataset = "mixture"``: the sources and their sampling weights, as ``[[training.mixture]]``
    tables with ``name``, ``kind``, ``path``, ``weight``. Seeded by ``training.seed``."""

    local_batch_size: int = 8
    """Rows (packed sequences of ``seq_len`` tokens) per microbatch per data-parallel rank."""

    global_batch_size: int = -1
    """Rows per optimizer step over all data-parallel ranks and microbatches.
    -1: ``local_batch_size * dp degree * gradient_accumulation_steps``."""

    gradient_accumulation_steps: int = -1
    """Microbatches per optimizer step on each data-parallel rank.
    -1: derived, ``global_batch_size / (local_batch_size * dp degree)`` (1 if both are -1)."""

    seq_len: int = 2048
    """Tokens per row (the full sequence, before context-parallel sharding)."""

    max_norm: float = 1.0
    """Gradient clipping max norm."""

    steps: int = 10000
    """Optimizer steps to train."""

    seed: int = 0
    """Base seed for parameter init and data generation."""

    deterministic: bool = False
    """Use deterministic algorithms (slower), for bit-identical reruns."""

    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype: FSDP casts the parameters to it; without FSDP (one device, TP or PP alone)
    the forward runs under ``torch.autocast`` with it. ``float32`` on CUDA falls to the dense
    ``math`` attention kernel (with a warning): the flash kernels take bf16/fp16 only."""

    def validate(self) -> None:
        for key in ("local_batch_size", "seq_len", "steps", "max_norm", "packing_lookahead"):
            _positive(f"training.{key}", getattr(self, key))
        _positive_or_auto("training.global_batch_size", self.global_batch_size)
        _positive_or_auto("training.gradient_accumulation_steps", self.gradient_accumulation_steps)
        _at_least("training.seed", self.seed, 0)
        if not self.loss_roles:
            raise ValueError("training.loss_roles is empty: chat records would carry no loss; list at least one role")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas of the weights (DDP, or HSDP with data_parallel_shard_degree > 1). 1: off."""

    data_parallel_shard_degree: int = -1
    """FSDP sharding degree. -1: the ranks left after every other degree."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP ``reshard_after_forward``: ``default`` and ``always`` free the gathered weights after
    each block's forward (gathering them again for the backward), except under pipeline
    parallelism, where they stay gathered between a stage's microbatches; ``never`` keeps them."""

    tensor_parallel_degree: int = 1
    """Tensor-parallel degree. 1: off."""

    pipeline_parallel_degree: int = 1
    """Pipeline-parallel degree (ranks, not stages). 1: off."""

    pipeline_parallel_schedule: Literal[
        "1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = "1F1B"
    """``torch.distributed.pipelining`` schedule."""

    pipeline_parallel_microbatch_size: int = 1
    """Rows per pipeline microbatch; must divide ``training.local_batch_size``."""

    context_parallel_degree: int = 1
    """Context-parallel degree: ranks that split one sequence. 1: off."""

    context_parallel_strategy: Literal["ring", "allgather", "ulysses", "hybrid"] = "ring"
    """How attention exchanges data on the ``cp`` axis: ``ring`` (K/V blocks passed around a ring,
    overlapped with compute), ``allgather`` (all-gather K/V), ``ulysses`` (all-to-all, sequence to
    heads), ``hybrid`` (Ulysses inside, ring across)."""

    context_parallel_load_balancer: Literal["contiguous", "zigzag", "doc_zigzag"] = "doc_zigzag"
    """Sequence layout over cp ranks: ``contiguous`` (rank r holds chunk r), ``zigzag`` (rank r holds
    chunks r and 2*cp-1-r), ``doc_zigzag`` (zigzag within each packed document).
    torchtitan's ``headtail`` is read as ``zigzag``."""

    context_parallel_ulysses_degree: int = 1
    """For ``hybrid``: size of the inner Ulysses axis (``cp_ulysses``); the ring axis
    (``cp_ring``) has ``context_parallel_degree / context_parallel_ulysses_degree`` ranks."""

    def validate(self) -> None:
        for key in (
            "data_parallel_replicate_degree",
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "context_parallel_degree",
            "context_parallel_ulysses_degree",
            "pipeline_parallel_microbatch_size",
        ):
            _positive(f"parallelism.{key}", getattr(self, key))
        _positive_or_auto("parallelism.data_parallel_shard_degree", self.data_parallel_shard_degree)
        if self.context_parallel_strategy == "hybrid":
            if self.context_parallel_degree % self.context_parallel_ulysses_degree:
                raise ValueError(
                    f"parallelism.context_parallel_ulysses_degree ({self.context_parallel_ulysses_degree}) must "
                    f"divide parallelism.context_parallel_degree ({self.context_parallel_degree})"
                )
        elif self.context_parallel_ulysses_degree != 1:
            raise ValueError(
                "parallelism.context_parallel_ulysses_degree is only used with "
                "parallelism.context_parallel_strategy = 'hybrid'; got strategy "
                f"{self.context_parallel_strategy!r}: leave the degree at 1 or set the strategy to 'hybrid'"
            )

    def ulysses_degree(self) -> int:
        """Ranks that split the heads by all-to-all: cp for ``ulysses``, the inner axis for ``hybrid``."""
        if self.context_parallel_strategy == "ulysses":
            return self.context_parallel_degree
        return self.context_parallel_ulysses_degree if self.context_parallel_strategy == "hybrid" else 1

    def check_model(self, flavor: str, n_heads: int, n_kv_heads: int, n_layers: int) -> None:
        """Degrees the flavor's heads and layers can take (TP splits heads; Ulysses splits each TP
        shard's heads again; pipeline stages need at least one layer each)."""
        tp, uly = self.tensor_parallel_degree, self.ulysses_degree()
        for what, count in (("heads", n_heads), ("KV heads", n_kv_heads)):
            if count % tp:
                raise ValueError(
                    f"parallelism.tensor_parallel_degree ({tp}) must divide the {what} of "
                    f"model.flavor = {flavor!r} ({count})"
                )
        q, kv = n_heads // tp, n_kv_heads // tp
        key = (
            "parallelism.context_parallel_degree"
            if self.context_parallel_strategy == "ulysses"
            else "parallelism.context_parallel_ulysses_degree"
        )
        if uly > 1 and (q % uly or (kv % uly and uly % kv)):
            raise ValueError(
                f"{key} ({uly}) must divide the query heads per tensor-parallel rank of model.flavor = {flavor!r} "
                f"({n_heads} / tp {tp} = {q}), and divide or be a multiple of its KV heads per rank ({kv})"
            )
        single = self.pipeline_parallel_schedule in ("1F1B", "GPipe")
        stages = self.pipeline_parallel_degree * (1 if single else 2)
        if self.pipeline_parallel_degree > 1 and n_layers < stages:
            raise ValueError(
                f"parallelism.pipeline_parallel_degree ({self.pipeline_parallel_degree}) with schedule "
                f"{self.pipeline_parallel_schedule!r} makes {stages} stages, more than the {n_layers} layers "
                f"of model.flavor = {flavor!r}"
            )


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints, and resume from the latest one."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to ``job.dump_folder``."""

    interval: int = 500
    """Save every this many steps."""

    keep_latest_k: int = 10
    """Keep only the latest k checkpoints. 0: keep all."""

    load_step: int = -1
    """Step to resume from; that step's checkpoint must exist. -1: the latest, if any."""

    initial_load_path: str | None = None
    """Weights to start from when there is nothing to resume (``enable`` false, or ``folder``
    empty): a DCP checkpoint folder (titan_cp's, or torchtitan's with the same flavor), or with
    ``initial_load_in_hf`` a Hugging Face checkpoint folder."""

    initial_load_model_only: bool = True
    """Load only the model (not optimizer and train state) from ``initial_load_path``."""

    initial_load_in_hf: bool = False
    """``initial_load_path`` is a Hugging Face Llama checkpoint folder (``*.safetensors``, one file
    or sharded with ``model.safetensors.index.json``; ``config.json`` checked where present):
    its weights are renamed to torchtitan's and q/k converted to titan_cp's RoPE layout
    (``titan_cp.model.hf``). Weights only: needs ``initial_load_model_only``."""

    last_save_in_hf: bool = False
    """At the end of training also write the model as a Hugging Face Llama checkpoint
    (safetensors, index, ``config.json``) to ``<job.dump_folder>/<folder>/step-<N>-hf``, whether
    or not ``enable`` is set."""

    last_save_model_only: bool = True
    """The save at the last step (``training.steps``) holds only the model (for export or
    fine-tuning); it cannot be resumed, so the resumable saves before it are kept."""

    exclude_from_loading: list[Literal["model", "optimizer", "lr_scheduler", "dataloader", "train_state"]] = field(
        default_factory=list
    )
    """State to leave out when resuming from ``folder``, e.g. ``optimizer,lr_scheduler,dataloader``
    (left as built: fresh optimizer moments, schedule from step 0, data from the start)."""

    async_mode: Literal["disabled", "async"] = "disabled"
    """``async`` saves with ``torch.distributed.checkpoint.async_save`` (training continues while a
    background thread writes; the save is renamed into place when the next one starts or the run
    ends); ``disabled`` saves synchronously."""

    def validate(self) -> None:
        _positive("checkpoint.interval", self.interval)
        _at_least("checkpoint.keep_latest_k", self.keep_latest_k, 0)
        _at_least("checkpoint.load_step", self.load_step, -1)
        if self.initial_load_in_hf and not self.initial_load_path:
            raise ValueError(
                "checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path (a Hugging Face "
                "checkpoint folder)"
            )
        if self.initial_load_in_hf and not self.initial_load_model_only:
            raise ValueError(
                "checkpoint.initial_load_in_hf = true loads weights only: set checkpoint.initial_load_model_only = true"
            )


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "selective"
    """Activation checkpointing: ``none``, ``full`` (every block), ``selective``."""

    selective_ac_option: str = "2"
    """For ``selective``, as torchtitan: a positive integer n checkpoints every n-th block fully
    (blocks 0, n, 2n, ...; ``1`` is every block) and leaves the others alone; ``op`` checkpoints
    every block op by op (matmul and attention outputs saved, the rest recomputed)."""

    def validate(self) -> None:
        if self.mode == "selective" and self.selective_ac_option != "op":
            if not (self.selective_ac_option.isdigit() and int(self.selective_ac_option) > 0):
                raise ValueError(
                    "activation_checkpoint.selective_ac_option must be a positive integer or 'op', "
                    f"got {self.selective_ac_option!r}"
                )


@dataclass
class Compile:
    enable: bool = False
    """Apply ``torch.compile``."""

    components: list[Literal["model", "loss"]] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: ``model`` compiles each transformer block. ``loss`` is accepted for
    torchtitan's presets but not compiled (the trainer logs so once)."""

    backend: str = "inductor"
    """``torch.compile`` backend (one of ``torch._dynamo.list_backends()``)."""


@dataclass
class Validation:
    enable: bool = False
    """Run validation every ``freq`` steps."""

    dataset: str = "synthetic_recall"
    """Validation dataset (``synthetic_recall`` uses its held-out split)."""

    dataset_path: str | None = None
    """Local file or folder of the validation dataset."""

    local_batch_size: int = -1
    """Rows per data-parallel rank. -1: ``training.local_batch_size``."""

    seq_len: int = -1
    """Tokens per row. -1: ``training.seq_len``."""

    freq: int = 10
    """Validate every this many training steps."""

    steps: int = -1
    """Validation steps. -1: the whole (finite) validation set."""

    recall_eval: bool = True
    """Also report answer-token accuracy bucketed by fact-to-question distance (datasets with
    answers, e.g. ``synthetic_recall``)."""

    recall_buckets: list[int] = field(default_factory=lambda: [256, 1024, 2048, 4096, 8192])
    """Upper edges (tokens) of the distance buckets for ``recall_eval``."""

    def validate(self) -> None:
        _positive("validation.freq", self.freq)
        _positive_or_auto("validation.steps", self.steps)
        _positive_or_auto("validation.local_batch_size", self.local_batch_size)
        _positive_or_auto("validation.seq_len", self.seq_len)
        if not self.recall_buckets or any(b <= a for a, b in zip([0] + self.recall_buckets, self.recall_buckets)):
            raise ValueError(
                f"validation.recall_buckets must be increasing positive integers, got {self.recall_buckets}"
            )
        if self.enable and self.steps == -1 and self.dataset == "synthetic_recall":
            raise ValueError(
                "validation.steps = -1 validates on the whole validation set, but validation.dataset = "
                "'synthetic_recall' is endless: set validation.steps to a positive number"
            )


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Collective timeout during initialization and the first step."""

    train_timeout_seconds: int = 100
    """Collective timeout after the first step (set on every process group once step 1 is done)."""

    def validate(self) -> None:
        _positive("comm.init_timeout_seconds", self.init_timeout_seconds)
        _positive("comm.train_timeout_seconds", self.train_timeout_seconds)


@dataclass
class JobConfig:
    """The whole job: one field per TOML section."""

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
        """Check every value that does not need the world size; raise ``ValueError`` naming the key.

        Each section checks its own keys (``<Section>.validate``); this adds the checks that span
        sections. Adjusts (with a warning) a warmup longer than the run. Reads no files."""
        for key, hint in _known_keys().items():  # types and choices, also for configs built in code
            section, name = key.split(".")
            _check_value(key, getattr(getattr(self, section), name), hint)
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        m, s, t, p, v = self.model, self.lr_scheduler, self.training, self.parallelism, self.validation
        if s.warmup_steps > t.steps:
            if os.environ.get("RANK", "0") == "0":  # once per job, not once per process
                warnings.warn(
                    f"lr_scheduler.warmup_steps ({s.warmup_steps}) is longer than training.steps ({t.steps}): "
                    f"warming up over {t.steps} steps",
                    UserWarning,
                    stacklevel=3,
                )
            s.warmup_steps = t.steps
        _check_mixture(t, v)
        if t.chat_template == "tokenizer" and not m.hf_assets_path:
            raise ValueError(
                "training.chat_template = 'tokenizer' needs model.hf_assets_path (a tokenizer_config.json "
                "with a chat_template); the byte tokenizer has none"
            )
        args = _flavors()[m.flavor]
        p.check_model(m.flavor, args.n_heads, args.n_kv_heads or args.n_heads, args.n_layers)
        if p.pipeline_parallel_degree > 1 and t.local_batch_size % p.pipeline_parallel_microbatch_size:
            raise ValueError(
                f"training.local_batch_size ({t.local_batch_size}) must be a multiple of "
                f"parallelism.pipeline_parallel_microbatch_size ({p.pipeline_parallel_microbatch_size})"
            )
        _check_seq_len("training.seq_len", t.seq_len, p)
        if v.seq_len != -1:
            _check_seq_len("validation.seq_len", v.seq_len, p)
        if -1 not in self.parallel_degrees().values():
            self.resolve_batch_sizes(p.data_parallel_replicate_degree * p.data_parallel_shard_degree)

    def check_files(self) -> None:
        """What the files on disk can tell before any process starts: the tokenizer, each dataset's
        path, the checkpoint to resume or start from. Raises ``ValueError`` naming the key."""
        m, t, v, c = self.model, self.training, self.validation, self.checkpoint
        if m.hf_assets_path:
            path = Path(m.hf_assets_path)
            if not (path / "tokenizer.json").is_file() and not (path.is_file() and path.suffix == ".json"):
                raise ValueError(
                    f"model.hf_assets_path = {m.hf_assets_path!r} holds no tokenizer.json; point it at "
                    "a local folder with one, or leave it unset for the built-in byte tokenizer"
                )
        sources = (
            [] if t.dataset == "mixture" else [(t.dataset, t.dataset_path, "training.dataset", "training.dataset_path")]
        )
        sources += [
            (s.kind, s.path, f"training.mixture[{i}].kind", f"training.mixture[{i}].path")
            for i, s in enumerate(t.mixture)
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
        if not c.enable:  # nothing to resume: initial_load_path is used
            if c.initial_load_path and not Path(c.initial_load_path).exists():
                raise ValueError(f"checkpoint.initial_load_path = {c.initial_load_path!r} does not exist")
            return
        folder = Path(self.job.dump_folder) / c.folder
        steps = sorted(int(d.name[5:]) for d in folder.glob("step-*") if d.is_dir() and d.name[5:].isdigit())
        if c.load_step != -1 and c.load_step not in steps:
            raise ValueError(
                f"checkpoint.load_step = {c.load_step}, but {folder} holds "
                f"{'steps ' + str(steps) if steps else 'no checkpoint'}"
            )
        if not steps and c.initial_load_path and not Path(c.initial_load_path).exists():
            raise ValueError(f"checkpoint.initial_load_path = {c.initial_load_path!r} does not exist")


# --------------------------------------------------------------------------------------------
# value checks


def _check_value(key: str, value: Any, hint: Any) -> None:
    """A value of the hint's type (``Literal`` choices included), finite if a float, 64-bit if an int."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        _choice(key, value, args)
    elif origin is list:
        for item in value:
            _check_value(key, item, args[0])
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {value!r}")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        if not INT64[0] <= value <= INT64[1]:
            raise ValueError(f"{key} = {value} does not fit in 64 bits")


@functools.cache
def _flavors() -> dict:
    from titan_cp.model.flavors import FLAVORS  # noqa: PLC0415 - the model imports torch; the config needs it here only

    return FLAVORS


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{key} must be positive, got {value}")


def _at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ValueError(f"{key} must be >= {low}, got {value}")


def _positive_or_auto(key: str, value: int) -> None:
    if value <= 0 and value != -1:
        raise ValueError(f"{key} must be positive or -1 (automatic), got {value}")


def _choice(key: str, value: str, choices: typing.Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}{_did_you_mean(value, choices)}")


def _did_you_mean(word: str, candidates: typing.Iterable[str]) -> str:
    by_lower = {c.lower(): c for c in candidates}
    close = [by_lower[c] for c in difflib.get_close_matches(word.lower(), list(by_lower), n=3, cutoff=0.6)]
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _check_mixture(t: Training, v: Validation) -> None:
    """``training.dataset = "mixture"`` exactly when ``training.mixture`` lists sources; names
    unique, kinds not nested, weights >= 0 with a positive sum."""
    if t.dataset == "mixture" and not t.mixture:
        raise ValueError("training.dataset = 'mixture' needs sources: add [[training.mixture]] tables")
    if t.dataset == "mixture" and t.dataset_path:
        raise ValueError(
            "training.dataset_path is not read for training.dataset = 'mixture' (each source has its "
            "own path in training.mixture): unset it"
        )
    if t.mixture and t.dataset != "mixture":
        raise ValueError(
            f"training.mixture lists sources but training.dataset = {t.dataset!r}: set training.dataset = "
            "'mixture' to train on them, or remove the table"
        )
    if v.dataset == "mixture":
        raise ValueError("validation.dataset = 'mixture' is not supported: name one source for validation")
    names = [m.name for m in t.mixture]
    for i, m in enumerate(t.mixture):
        if not m.name or names.count(m.name) > 1:
            raise ValueError(
                f"training.mixture[{i}].name = {m.name!r}: names must be non-empty and unique, got {names}"
            )
        if m.kind == "mixture":
            raise ValueError(
                f"training.mixture[{i}].kind = 'mixture' ({m.name!r}): a mixture cannot hold another mixture"
            )
        if not m.weight >= 0:
            raise ValueError(f"training.mixture[{i}].weight ({m.name!r}) must be >= 0, got {m.weight}")
    if t.mixture and sum(m.weight for m in t.mixture) <= 0:
        raise ValueError(
            f"training.mixture weights sum to zero ({[m.weight for m in t.mixture]}): give one a positive weight"
        )


def _check_seq_len(key: str, seq_len: int, p: Parallelism) -> None:
    """The sequence must split evenly over the cp ranks: into 2*cp chunks, two per rank
    (``zigzag``), or into cp equal shards (``contiguous``; ``doc_zigzag``, which zigzags each
    document and gives every rank seq_len / cp tokens)."""
    cp = p.context_parallel_degree
    chunks = 2 * cp if p.context_parallel_load_balancer == "zigzag" else cp
    if cp > 1 and seq_len % chunks:
        what = f"({cp})" if chunks == cp else f"({cp}) x 2 = {chunks}"
        raise ValueError(
            f"{key} ({seq_len}) must be divisible by parallelism.context_parallel_degree {what} "
            f"for parallelism.context_parallel_load_balancer = {p.context_parallel_load_balancer!r}"
        )


# --------------------------------------------------------------------------------------------
# torchtitan compatibility

# torchtitan (v0.2 and the legacy v0.1 names) keys titan_cp accepts and ignores, by section
# ("a.b" for nested tables such as [quantize.linear.float8]). Among them, what titan_cp does
# instead: it logs without colors (metrics.disable_color_printing), reduces gradients in fp32
# (training.mixed_precision_reduce), computes the loss on logits gathered over tp
# (parallelism.disable_loss_parallel) and splits layers evenly over the schedule's stages
# (parallelism.pipeline_parallel_layers_per_stage).
_TORCHTITAN_ONLY: dict[str, tuple[str, ...]] = {
    "job": ("print_args", "use_for_integration_test", "save_config_file", "custom_config_module"),
    "profiling": ("profiler_active", "profiler_warmup"),
    "metrics": ("save_for_all_ranks", "enable_wandb", "disable_color_printing"),
    "model": ("tokenizer_path", "converters", "print_after_conversion"),
    "optimizer": ("early_step_in_backward",),
    "training": ("enable_cpu_offload", "dtype", "gc_freq", "gc_debug", "mixed_precision_reduce"),
    "training.dataloader": ("num_workers", "persistent_workers", "pin_memory", "prefetch_factor"),
    "parallelism": (
        "enable_compiled_autograd",
        "enable_async_tensor_parallel",
        "disable_sequence_parallel",
        "pipeline_parallel_split_points",
        "module_fqns_per_model_part",
        "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_expert_parallel_overlap",
        "context_parallel_rotate_method",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
        "expert_parallel_comm_backend",
        "disable_loss_parallel",
        "pipeline_parallel_layers_per_stage",
    ),
    "checkpoint": (
        "enable_ft_dataloader_checkpoints",
        "initial_load_in_hf_quantized",
        "export_dtype",
        "create_seed_checkpoint",
        "load_only",
        "model_weights_only",
        "enable_first_step_checkpoint",
    ),
    "activation_checkpoint": (
        "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "early_stop",
        "memory_budget",
        "visualize_memory_budget_pareto",
        "preserve_rng_state",
        "determinism_check",
        "debug",
    ),
    "comm": ("trace_buf_size", "save_traces_folder", "save_traces_file_prefix", "mode"),
    "validation.dataloader": ("num_workers", "persistent_workers", "pin_memory", "prefetch_factor"),
    "float8": (
        "enable_fsdp_float8_all_gather",
        "precompute_float8_dynamic_scale_for_fsdp",
        "force_recompute_fp8_weight_in_bwd",
        "recipe_name",
        "filter_fqns",
        "emulate",
        "moe_fqns_prototype",
    ),
    "mx": ("mxfp8_dim1_cast_kernel_choice", "recipe_name", "filter_fqns"),
    "quantize.linear.float8": (
        "enable_fsdp_float8_all_gather",
        "precompute_float8_dynamic_scale_for_fsdp",
        "force_recompute_fp8_weight_in_bwd",
        "recipe_name",
        "filter_fqns",
        "emulate",
    ),
    "quantize.linear.mx": ("mxfp8_dim1_cast_kernel_choice", "recipe_name", "filter_fqns"),
    "quantize.grouped_mm.float8": ("fqns",),
    "quantize.grouped_mm.mx": ("recipe_name", "fqns"),
    "memory_estimation": ("enable", "enabled", "disable_fake_mode"),
    "fault_tolerance": (
        "enable",
        "process_group",
        "process_group_timeout_ms",
        "replica_id",
        "group_size",
        "min_replica_size",
        "semi_sync_method",
        "sync_steps",
        "should_quantize",
        "fragment_sync_delay",
        "fragment_update_alpha",
    ),
    "experimental": ("custom_import", "custom_args_module"),
    "debug": ("deterministic_warn_only", "moe_force_load_balance"),
}

# Renamed torchtitan keys: old dotted name -> titan_cp dotted name.
_RENAMED = {
    "checkpoint.enable_checkpoint": "checkpoint.enable",
    "training.batch_size": "training.local_batch_size",
    "training.compile": "compile.enable",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
    "validation.enabled": "validation.enable",
    "debug.seed": "training.seed",
    "debug.deterministic": "training.deterministic",
}

# torchtitan values with a titan_cp equivalent.
_VALUE_ALIASES = {"parallelism.context_parallel_load_balancer": {"headtail": "zigzag"}}


@functools.cache
def _known_keys() -> dict[str, Any]:
    """Every titan_cp dotted key -> its type hint."""
    sections = typing.get_type_hints(JobConfig)
    return {
        f"{section.name}.{name}": hint
        for section in dataclasses.fields(JobConfig)
        for name, hint in typing.get_type_hints(sections[section.name]).items()
    }


@functools.cache
def _torchtitan_keys() -> frozenset[str]:
    return frozenset(f"{section}.{key}" for section, keys in _TORCHTITAN_ONLY.items() for key in keys)


def _unknown_key(key: str, origin: str) -> ValueError:
    candidates = [*_known_keys(), *_torchtitan_keys(), *_RENAMED]
    return ValueError(f"unknown config key {key!r} ({origin}){_did_you_mean(key, candidates)}")


def _flatten_toml(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": {"c": 1}}}`` -> ``{"a.b.c": 1}``."""
    out: dict[str, Any] = {}
    for name, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten_toml(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


# --------------------------------------------------------------------------------------------
# value coercion


def _coerce(key: str, value: Any, hint: Any, from_cli: bool) -> Any:
    """Check (TOML) or parse (CLI string) ``value`` against the type hint of ``key``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (from_cli and str(value).lower() in ("none", "null", ""))):
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0], from_cli)
    if origin is Literal:
        if not isinstance(value, str):
            raise ValueError(f"{key} must be one of {list(args)}, got {value!r}")
        value = _VALUE_ALIASES.get(key, {}).get(value, value)
        _choice(key, value, args)
        return value
    if origin is list:
        if from_cli or isinstance(value, str):
            value = [v.strip() for v in str(value).split(",") if v.strip()]
        if not isinstance(value, list):
            raise ValueError(f"{key} must be a list (comma-separated on the command line), got {value!r}")
        return [_coerce(key, v, args[0], from_cli) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in _BOOL_WORDS:
            return _BOOL_WORDS[str(value).lower()]
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if hint in (int, float):
        kind = "a float" if hint is float else "an integer"
        if isinstance(value, bool):
            raise ValueError(f"{key} must be {kind}, got {value!r}")
        if from_cli:
            try:
                value = hint(value)
            except ValueError:
                raise ValueError(f"{key} must be {kind}, got {value!r}") from None
        if hint is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, hint):
            raise ValueError(f"{key} must be {kind}, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(hint):  # a table, e.g. one [[training.mixture]] entry
        if from_cli or isinstance(value, str):
            value, from_cli = hint.parse(key, str(value)), True
        if not isinstance(value, dict):
            raise ValueError(f"{key} entries must be tables, got {value!r}")
        hints = typing.get_type_hints(hint)
        for name in value:
            if name not in hints:
                raise ValueError(f"{key}: unknown key {name!r} in {value!r}{_did_you_mean(name, hints)}")
        required = [f.name for f in dataclasses.fields(hint) if f.default is dataclasses.MISSING]
        missing = [name for name in required if name not in value]
        if missing:
            raise ValueError(f"{key}: entry {value!r} lacks {missing}")
        return hint(**{name: _coerce(f"{key}.{name}", v, hints[name], from_cli) for name, v in value.items()})
    raise TypeError(f"unsupported config type {hint} for {key}")  # internal: a field type coerce lacks


_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


# --------------------------------------------------------------------------------------------
# loading


def _parse_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    """``["--a.b", "1", "--c.d=x", "--e.flag"]`` -> ``[("a.b", "1"), ("c.d", "x"), ("e.flag", None)]``.

    A bare flag (no value) is ``None``; whether that is allowed depends on the key's type.
    """
    known = _known_keys()
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"expected --section.key, got {arg!r}")
        name, eq, value = arg[2:].partition("=")
        i += 1
        if eq:
            out.append((name, value))
            continue
        hint = known.get(name)
        takes_word = i < len(argv) and not argv[i].startswith("--")
        if hint is bool and takes_word and argv[i].lower() not in _BOOL_WORDS:
            takes_word = False  # a bare flag followed by something else
        if takes_word:
            out.append((name, argv[i]))
            i += 1
        else:
            out.append((name, None))
    return out


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Build a validated :class:`JobConfig` from ``argv``: the TOML in ``--job.config_file`` (if any)
    overridden by the other ``--section.key value`` arguments. Starts no process group.

    Raises ``ValueError`` (naming the key) for unknown keys and bad values, and warns once listing
    the torchtitan keys that are ignored or renamed.
    """
    cli = _parse_cli(list(argv or []))
    known = _known_keys()
    toml_path = None
    for name, value in cli:
        if name == "job.config_file":
            toml_path = value
    ignored: list[str] = []
    renamed: list[str] = []
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # titan_cp key -> how the TOML named it (two names for one key: an error)

    def place(key: str, value: Any, origin: str, from_cli: bool) -> None:
        given = key
        if from_cli and key not in known and key not in _RENAMED and value is None:
            section, _, leaf = key.rpartition(".")
            if leaf.startswith("no_") and known.get(f"{section}.{leaf[3:]}") is bool:
                key, value = f"{section}.{leaf[3:]}", "false"
        if key in _RENAMED:
            renamed.append(f"{key} -> {_RENAMED[key]}")
            key = _RENAMED[key]
        if key in known:
            if not from_cli:
                if key in spelled:
                    raise ValueError(f"{spelled[key]} and {given} ({origin}) both set {key}: keep one")
                spelled[key] = given
            hint = known[key]
            if value is None:
                if hint is not bool:
                    raise ValueError(f"--{key} needs a value")
                value = "true"
            values[key] = _coerce(key, value, hint, from_cli)
        elif key in _torchtitan_keys():
            ignored.append(key)
        else:
            raise _unknown_key(key, origin)

    if toml_path is not None:
        try:
            with open(toml_path, "rb") as f:
                table = tomllib.load(f)
        except FileNotFoundError:
            raise ValueError(f"job.config_file = {toml_path!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"job.config_file = {toml_path!r} is not valid TOML: {e}") from None
        for key, value in _flatten_toml(table).items():
            place(key, value, f"in {toml_path}", from_cli=False)
    for key, value in cli:
        place(key, value, "on the command line", from_cli=True)
    if ignored or renamed:
        parts = []
        if ignored:
            parts.append("ignoring torchtitan keys titan_cp does not implement: " + ", ".join(dict.fromkeys(ignored)))
        if renamed:
            parts.append("renamed legacy torchtitan keys: " + ", ".join(dict.fromkeys(renamed)))
        warnings.warn("; ".join(parts), UserWarning, stacklevel=2)

    job_config = JobConfig()
    for key, value in values.items():
        section, name = key.split(".")
        setattr(getattr(job_config, section), name, value)
    job_config.validate()
    return job_config


def usage() -> str:
    """The command line and every key with its type and default, by section (``--help``)."""
    lines = [
        "usage: torchrun --nproc-per-node N -m titan_cp.train --job.config_file X.toml [--section.key value ...]",
        "",
        "Precedence: command line > TOML > defaults. Booleans: --section.flag / --section.no_flag;",
        "lists comma-separated; 'none' unsets an optional value. Presets: train_configs/*.toml.",
    ]
    defaults = JobConfig()
    for section in dataclasses.fields(JobConfig):
        lines.append(f"\n[{section.name}]")
        for f in dataclasses.fields(getattr(defaults, section.name)):
            hint = _known_keys()[f"{section.name}.{f.name}"]
            kind = typing.get_args(hint) if typing.get_origin(hint) is Literal else getattr(hint, "__name__", hint)
            lines.append(
                f"  --{section.name}.{f.name} ({kind}, default {getattr(getattr(defaults, section.name), f.name)!r})"
            )
    return "\n".join(lines)
