"""The small sections: job, profiling, metrics, model, optimizer, LR schedule, checkpoint,
activation checkpointing, compile, validation, comm. ``[training]`` and ``[parallelism]``
have modules of their own.

Every field carries its type, default, bounds and a docstring; what a field's bounds cannot
say (rules between fields of one section) is the section's :meth:`~Section.check`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from titan_cp.ac_modes import ac_mode_and_every, ac_modes
from titan_cp.config.training import SEQ_LEN_BOUND
from titan_cp.config.values import AtLeast, IncreasingPositive, InRange, OneOf, Positive, PositiveOrAuto, Section

DEFAULT_FAMILY = "llama3"
"""The model family of ``model.name`` when none is given (:mod:`titan_cp.families`)."""


@dataclass
class Job(Section, name="job"):
    config_file: str | None = None
    """TOML file to read the job config from."""

    dump_folder: str = "./outputs"
    """Folder for all job outputs (checkpoints, metrics, traces)."""

    description: str = "default job"
    """Free-text description of the job, logged at start."""

    print_config: bool = False
    """Log the resolved job config (every key, as JSON) at start, on rank 0."""


@dataclass
class Profiling(Section, name="profiling"):
    enable_profiling: bool = False
    """Collect ``torch.profiler`` traces (CPU and CUDA activity): one Chrome trace per rank every
    ``profile_freq`` steps, of the last step of each period, as
    ``<save_traces_folder>/iteration_<step>/rank<r>_trace.json``."""

    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to ``job.dump_folder``."""

    profile_freq: Annotated[int, Positive] = 10
    """Trace (and snapshot memory) every this many steps."""

    enable_memory_snapshot: bool = False
    """Record the CUDA caching allocator's history and dump a snapshot every ``profile_freq`` steps
    as ``<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle`` (open it at
    pytorch.org/memory_viz). CUDA only: on CPU the trainer logs that no snapshot is taken."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to ``job.dump_folder``."""


@dataclass
class Metrics(Section, name="metrics"):
    log_freq: Annotated[int, Positive] = 10
    """Log metrics every this many steps."""

    enable_tensorboard: bool = False
    """Also write TensorBoard events (needs the optional ``tensorboard`` package)."""

    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to ``job.dump_folder``."""

    save_jsonl_file: str = "metrics.jsonl"
    """Machine-readable metrics, one JSON object per step, relative to ``job.dump_folder``;
    empty (``--metrics.save_jsonl_file=``) disables the file."""


@dataclass
class Model(Section, name="model"):
    name: str = DEFAULT_FAMILY
    """Model family, a registered one (:mod:`titan_cp.families`; the family checks this section and its
    keys in :func:`titan_cp.preflight.check_model`): ``llama3`` (titan_cp's own Llama 3, shaped by
    ``flavor``), or ``hf``: the Hugging Face causal LM of the folder ``hf_assets_path`` (its ``config.json``; Llama, Qwen2, Qwen3,
    Mistral, Gemma, ...; ``titan_cp.integrations.hf_folder``), weights from
    ``checkpoint.initial_load_path`` with ``checkpoint.initial_load_in_hf``."""

    flavor: str = "debugmodel"
    """Model size (``titan_cp.families.llama3.flavors``): torchtitan's ``debugmodel``, ``8B``, ``70B``, ``405B``
    (the same models as torchtitan's flavors of those names), or titan_cp's ``tiny`` and
    ``debugmodel_gqa`` (CPU). Not set with ``name = "hf"`` (the folder's ``config.json`` shapes it)."""

    hf_assets_path: str | None = None
    """Folder with local Hugging Face assets; its ``tokenizer.json`` is used as the tokenizer, and with
    ``name = "hf"`` its ``config.json`` is the model. Unset (or empty): the built-in byte-level tokenizer."""


@dataclass
class Optimizer(Section, name="optimizer"):
    name: Literal["AdamW", "Adam"] = "AdamW"
    """``AdamW`` (decoupled weight decay) or ``Adam`` (``weight_decay`` added to the gradient)."""

    lr: Annotated[float, Positive] = 8e-4
    """Peak learning rate."""

    beta1: Annotated[float, InRange(0, 1, high_open=True)] = 0.9
    """First-moment decay."""

    beta2: Annotated[float, InRange(0, 1, high_open=True)] = 0.95
    """Second-moment decay."""

    eps: Annotated[float, Positive] = 1e-8
    """Denominator epsilon."""

    weight_decay: Annotated[float, AtLeast(0)] = 0.1
    """Decoupled weight decay."""

    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """torch.optim implementation: ``fused`` (one kernel for all parameters, fastest),
    ``foreach`` (multi-tensor ops) or ``for-loop`` (one parameter at a time)."""


@dataclass
class LRScheduler(Section, name="lr_scheduler"):
    warmup_steps: Annotated[int, AtLeast(0)] = 200
    """Linear warmup steps, from near 0 to ``optimizer.lr``; at most ``training.steps`` (a longer
    warmup is shortened to ``training.steps``, with a warning, as torchtitan does)."""

    decay_ratio: Annotated[float | None, InRange(0, 1)] = None
    """Fraction of ``training.steps`` spent decaying, at the end (warmup-stable-decay).
    Unset: decay starts right after warmup."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Decay curve."""

    min_lr_factor: Annotated[float, InRange(0, 1)] = 0.0
    """The learning rate decays to ``optimizer.lr * min_lr_factor``."""


@dataclass
class Checkpoint(Section, name="checkpoint"):
    enable: bool = False
    """Save checkpoints, and resume from the latest one."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to ``job.dump_folder``."""

    interval: Annotated[int, Positive] = 500
    """Save every this many steps."""

    keep_latest_k: Annotated[int, AtLeast(0)] = 10
    """Keep only the latest k checkpoints (never pruning the newest one that holds the whole state).
    0: keep all."""

    load_step: Annotated[int, AtLeast(-1)] = -1
    """Step to resume from; that step's checkpoint must exist. -1: the latest, if any."""

    initial_load_path: str | None = None
    """Weights to start from when there is nothing to resume (``enable`` false, or ``folder``
    empty): a DCP checkpoint folder (titan_cp's, or torchtitan's with the same flavor: 0.2's, or 0.3's
    Llama 3 with its ``lm_head`` and ``qkv_linear`` names), or with ``initial_load_in_hf`` a Hugging Face
    checkpoint folder."""

    initial_load_model_only: bool = True
    """Load only the model (not optimizer and train state) from ``initial_load_path``."""

    initial_load_in_hf: bool = False
    """``initial_load_path`` is a Hugging Face Llama checkpoint folder (``*.safetensors``, one file
    or sharded with ``model.safetensors.index.json``; ``config.json`` checked where present):
    its weights are renamed to torchtitan's and q/k converted to titan_cp's RoPE layout
    (``titan_cp.families.llama3.hf_checkpoint``); with ``model.name = "hf"`` they load by ``transformers``' own names
    (``titan_cp.integrations.hf_folder``). Weights only: needs ``initial_load_model_only``."""

    last_save_in_hf: bool = False
    """At the end of training also write the model as a Hugging Face checkpoint (safetensors, index,
    ``config.json``; with ``model.name = "hf"`` also the tokenizer files of ``model.hf_assets_path``)
    to ``<job.dump_folder>/<folder>/step-<N>-hf``, whether or not ``enable`` is set."""

    last_save_model_only: bool = True
    """At the last step (``training.steps``) also write the model alone to ``<folder>/step-<N>-model``
    (a DCP checkpoint of the weights, for export or fine-tuning through ``initial_load_path``; never
    pruned). The last step's ``step-<N>`` holds the whole state whatever this says (torchtitan
    writes the model alone there instead), so the same job with a larger ``training.steps``
    continues exactly where it ended."""

    exclude_from_loading: list[Literal["model", "optimizer", "lr_scheduler", "dataloader", "train_state"]] = field(
        default_factory=list
    )
    """State to leave out when resuming from ``folder``, e.g. ``optimizer,lr_scheduler,dataloader``
    (left as built: fresh optimizer moments, schedule from step 0, data from the start)."""

    async_mode: Literal["disabled", "async"] = "disabled"
    """``async`` saves with ``torch.distributed.checkpoint.async_save`` (training continues while a
    background thread writes; the save is renamed into place when the next one starts or the run
    ends); ``disabled`` saves synchronously."""

    def check(self) -> None:
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
class ActivationCheckpoint(Section, name="activation_checkpoint"):
    mode: Annotated[str, OneOf(ac_modes)] = "selective"
    """Activation checkpointing (:data:`titan_cp.ac_modes.AC_MODES`): ``none``, ``full`` (every block),
    ``selective`` (as ``selective_ac_option`` says), ``op`` (op by op: ``selective`` with ``op``)."""

    selective_ac_option: str = "2"
    """For ``selective``, as torchtitan: a positive integer n checkpoints every n-th block fully
    (blocks 0, n, 2n, ...; ``1`` is every block) and leaves the others alone; ``op`` checkpoints
    every block op by op (matmul and attention outputs saved, the rest recomputed)."""

    cpu_offload: bool = False
    """Keep each checkpoint unit's stored input in pinned host memory: copied there on a side stream
    in the forward, copied back one unit ahead of its backward (``titan_cp.parallel.offload``). The
    GPU then holds about two units' inputs instead of one per unit. Needs ``mode`` ``full`` or
    ``selective``."""

    blocks_per_checkpoint: Annotated[int, Positive] = 1
    """Blocks per checkpoint unit: one stored input per k blocks, each block checkpointed again inside
    the unit, so its recomputation keeps k block inputs and one block's activations at a time
    (``titan_cp.parallel.units``; one more forward of k - 1 blocks per unit); divides the stored
    inputs (and host bytes with ``cpu_offload``) by k. k > 1 needs ``mode = "full"`` (or
    ``selective_ac_option = "op"``)."""

    tile_tokens: Annotated[int, AtLeast(0)] = 0
    """Run each block's feed-forward over tiles of this many local tokens, recomputed tile by tile
    in the backward, so that its wide intermediates exist for one tile at a time
    (``titan_cp.parallel.tiled_mlp``); attention still sees all local tokens. 0: off."""

    def check(self) -> None:
        mode, _ = ac_mode_and_every(self.mode, self.selective_ac_option)  # ValueError naming the key
        if self.cpu_offload and self.mode == "none":
            raise ValueError(
                "activation_checkpoint.cpu_offload = true offloads checkpointed inputs: set activation_checkpoint.mode "
                "to 'full' or 'selective'"
            )
        if self.blocks_per_checkpoint > 1 and mode not in ("full", "op"):
            raise ValueError(
                f"activation_checkpoint.blocks_per_checkpoint = {self.blocks_per_checkpoint} needs "
                "activation_checkpoint.mode = 'full' (or selective_ac_option = 'op')"
            )


@dataclass
class Compile(Section, name="compile"):
    enable: bool = False
    """Apply ``torch.compile``."""

    components: list[Literal["model", "loss"]] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: ``model`` compiles each transformer block. ``loss`` is accepted for
    torchtitan's presets but not compiled (the trainer logs so once)."""

    backend: str = "inductor"
    """``torch.compile`` backend (one of ``torch._dynamo.list_backends()``)."""


@dataclass
class Validation(Section, name="validation"):
    enable: bool = False
    """Run validation every ``freq`` steps."""

    dataset: str = "synthetic_recall"
    """Validation dataset (``synthetic_recall`` and ``synthetic_lookup`` use their held-out split)."""

    dataset_path: str | None = None
    """Local file or folder of the validation dataset."""

    local_batch_size: Annotated[int, PositiveOrAuto] = -1
    """Rows per data-parallel rank. -1: ``training.local_batch_size``."""

    seq_len: Annotated[int, PositiveOrAuto, SEQ_LEN_BOUND] = -1
    """Tokens per row. -1: ``training.seq_len``. At most 2**24, as ``training.seq_len``."""

    freq: Annotated[int, Positive] = 10
    """Validate every this many training steps."""

    steps: Annotated[int, PositiveOrAuto] = -1
    """Validation steps. -1: the whole (finite) validation set."""

    recall_eval: bool = True
    """Also report answer-token accuracy bucketed by fact-to-question distance (datasets with
    answers, e.g. ``synthetic_recall``)."""

    recall_buckets: Annotated[list[int], IncreasingPositive] = field(
        default_factory=lambda: [256, 1024, 2048, 4096, 8192]
    )
    """Upper edges (tokens) of the distance buckets for ``recall_eval``."""

    recall_shard_cut: bool = False
    """Also evaluate recall with attention cut at the shard boundaries: every document is cut where
    the ``contiguous`` layout's shards meet, so each cp rank attends only to its own shard's keys
    (``recall_*_shard_cut``, ``val_loss_shard_cut``). An evaluation mode, never a training one: what
    recall owes to the other ranks' keys is the gap between the two. Needs ``recall_eval``,
    ``parallelism.context_parallel_degree`` > 1 and ``context_parallel_load_balancer = "contiguous"``."""

    def check(self) -> None:
        if self.dataset == "mixture":
            raise ValueError("validation.dataset = 'mixture' is not supported: name one source for validation")
        if self.enable and self.steps == -1 and self.dataset in ("synthetic_recall", "synthetic_lookup"):
            raise ValueError(
                "validation.steps = -1 validates on the whole validation set, but validation.dataset = "
                f"{self.dataset!r} is endless: set validation.steps to a positive number"
            )


@dataclass
class Comm(Section, name="comm"):
    init_timeout_seconds: Annotated[int, Positive] = 300
    """Collective timeout during initialization and the first step."""

    train_timeout_seconds: Annotated[int, Positive] = 100
    """Collective timeout after the first step (set on every process group once step 1 is done)."""
