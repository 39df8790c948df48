"""The trainer: ``torchrun --nproc-per-node N -m titan_cp.train --job.config_file X.toml [--section.key value ...]``.

One step::

    loader ── this dp rank's rows + the step's global valid-token count
      └─ per microbatch: shard by the layout (cp rank) ─ forward ─ sum CE / global count ─ backward
    clip by the global grad norm (DTensors, every pipeline stage) ─ AdamW ─ LR schedule
    log loss, grad norm, lr, tokens/s, MFU, memory, ETA ─ validate ─ checkpoint

Runs on CPU with gloo (the embedded defaults) and on GPUs with NCCL. The trainer wires
the parts together and owns no math: the model, parallelisms, loss, data and checkpoint
each live in their own module.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from titan_cp.ac_modes import ac_mode_and_every
from titan_cp.checkpoint import Checkpointer, saved_steps
from titan_cp.config import JobConfig, load_config, usage
from titan_cp.data import build_dataloader, build_tokenizer
from titan_cp.data.loader import Step, build_sources
from titan_cp.errors import UserError, plural, run_cli
from titan_cp.layout import SequenceLayout, cut_at_shards
from titan_cp.lock import DumpLock, watch_launcher
from titan_cp.loss import IGNORE_INDEX, GlobalTokenLoss
from titan_cp.mesh import ParallelDims
from titan_cp.metrics import (
    MetricsLogger,
    StepMetrics,
    layer_masks,
    recall_counts,
    recall_metrics,
    shard_edges,
    shard_recall_metrics,
)
from titan_cp.optim import LRSchedulers, build_optimizers, clip_grad_norm_, lr_lambda, restore_hyperparameters
from titan_cp.parallel.build import ParallelizeOptions
from titan_cp.parallel.offload import offload_metrics
from titan_cp.preflight import check_files, check_model
from titan_cp.profiling import Profiler
from titan_cp.step import Microbatch, forward_backward

__all__ = ["Trainer", "compute_precision", "init_distributed", "main", "mesh_line"]

logger = logging.getLogger("titan_cp")
T = TypeVar("T")
ZERO_GRAD_STEPS = 3
"""Steps in a row with a grad norm of exactly 0 that stop a run (nothing trains)."""


class TrainState:
    """The step done last, how many of the steps so far were skipped (no loss-bearing token), and the
    mesh the run trains on (``mesh``, saved; ``saved_mesh``: the one a loaded checkpoint was saved
    on, ``None`` when it does not say)."""

    def __init__(self, mesh: str = "") -> None:
        self.step = 0
        self.skipped_steps = 0
        self.mesh, self.saved_mesh = mesh, None

    def state_dict(self) -> dict:
        return {"step": self.step, "skipped_steps": self.skipped_steps, "mesh": self.mesh}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", self.skipped_steps))  # older checkpoints lack it
        self.saved_mesh = state.get("mesh")


def mesh_name(dims: ParallelDims) -> str:
    """The mesh of ``dims`` (a :class:`titan_cp.mesh.ParallelDims`) for the log, e.g. ``dp 1 x cp 4``:
    dp and cp always, the other axes when they are used."""
    parts = [f"pp {dims.pp}"] if dims.pp > 1 else []
    if dims.dp_replicate > 1:
        parts += [f"dp_replicate {dims.dp_replicate}", f"dp_shard {dims.dp_shard}"]
    else:
        parts.append(f"dp {dims.dp_shard}")
    ulysses = f" (ring {dims.cp_ring} x ulysses {dims.cp_ulysses})" if dims.cp_ulysses else ""
    parts.append(f"cp {dims.cp}{ulysses}")
    if dims.tp > 1:
        parts.append(f"tp {dims.tp}")
    return " x ".join(parts)


def init_distributed(cfg: JobConfig) -> torch.device:
    """The process group (started unless one is: one process without a launcher is rank 0 of 1;
    NCCL where CUDA is, else gloo) and this rank's device; CPU threads: the cores this process may run on
    (its affinity, which ``taskset`` sets), shared by the local ranks."""
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.comm.init_timeout_seconds))
    watch_launcher()  # under torchrun: exit once the launcher is gone (it cannot forward a SIGKILL)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // local_world))
    return torch.device("cpu")


def compute_precision(cfg: JobConfig, device_type: str, announce: bool) -> str:
    """The compute precision, ``"bfloat16"`` or ``"float32"``: ``training.mixed_precision_param``,
    except on a CPU when the key was left at its default bf16: float32 there, since PyTorch's CPU
    bf16 matmul is a generic kernel about 3x slower than fp32's. A bf16 set explicitly is kept
    (with a warning). ``announce``: log the choice (on one rank: once per job)."""
    key, precision = "training.mixed_precision_param", cfg.training.mixed_precision_param
    if device_type != "cpu" or precision != "bfloat16":
        return precision
    if cfg.is_given(key):
        if announce:
            logger.warning(
                "%s = 'bfloat16' on CPU: PyTorch's bf16 matmul there is a generic kernel, about 3x slower than "
                "float32's; set %s = 'float32' unless bf16 numerics are the point",
                key,
                key,
            )
        return precision
    if announce:
        logger.info(
            "%s is not set: computing in float32 on CPU, where its default bfloat16 is about 3x slower "
            "(PyTorch's CPU bf16 matmul is a generic kernel); set %s = 'bfloat16' to keep bf16",
            key,
            key,
        )
    return "float32"


def mesh_line(dims: ParallelDims, cfg: JobConfig) -> str:
    """The mesh the run builds, for the log: ``"dp_shard 1 x cp 2 (ring, doc_local)"`` (the CP
    strategy and layout where cp is larger than 1; :meth:`titan_cp.mesh.ParallelDims.summary`)."""
    p = cfg.parallelism
    cp = f" ({p.context_parallel_strategy}, {p.context_parallel_load_balancer})" if dims.cp_enabled else ""
    return dims.summary() + cp


def parallelize_options(cfg: JobConfig, mp_param_dtype: torch.dtype | None) -> ParallelizeOptions:
    """The config's :class:`ParallelizeOptions` (``[parallelism]``, ``[activation_checkpoint]``, ``[compile]``,
    ``training.enable_cpu_offload``) with FSDP's compute dtype ``mp_param_dtype``."""
    p, ac = cfg.parallelism, cfg.activation_checkpoint
    ac_mode, ac_every = ac_mode_and_every(ac.mode, ac.selective_ac_option)
    return ParallelizeOptions(
        cp_strategy=p.context_parallel_strategy,
        cp_balance=p.context_parallel_load_balancer,
        ac_mode=ac_mode,
        ac_every=ac_every,
        ac_cpu_offload=ac.cpu_offload,
        ac_blocks_per_checkpoint=ac.blocks_per_checkpoint,
        tile_tokens=ac.tile_tokens,
        fsdp_cpu_offload=cfg.training.enable_cpu_offload,
        compile=cfg.compile.enable and "model" in cfg.compile.components,
        compile_backend=cfg.compile.backend,
        reshard_after_forward=p.fsdp_reshard_after_forward != "never",
        mp_param_dtype=mp_param_dtype,  # the loss is vocabulary-parallel over tp, a plain tensor
    )


class Trainer:
    """Everything a run holds; ``train()`` runs it to ``training.steps``.

    Built in order: the process group and mesh, the data (tokenizer, loaders), the model
    (built on meta, parallelized, initialised shard by shard), the optimizers and LR schedule,
    the checkpointer (resuming or loading initial weights), the metrics.
    """

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        # every data file is read and checked before any process group starts: a bad one is one line
        self.tokenizer = build_tokenizer(cfg.model.hf_assets_path)
        self.sources = build_sources(cfg, self.tokenizer, announce=os.environ.get("RANK", "0") == "0")
        self.device = init_distributed(cfg)
        self.rank0 = dist.get_rank() == 0
        torch.manual_seed(cfg.training.seed)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        self._build_mesh()
        self.lock = _lock_dump_folder(Path(cfg.job.dump_folder), self.rank0)
        try:
            self._build(cfg)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: JobConfig) -> None:
        """Everything but the mesh and the dump folder's lock (the class docstring's order)."""
        if self.rank0:
            logger.info("job: %s (%s)", cfg.job.description, cfg.job.config_file or "no config file")
            logger.info("mesh: %s", mesh_line(self.dims, cfg))
            if cfg.job.print_config:
                logger.info("config:\n%s", json.dumps(cfg.to_dict(), indent=2))
        self._build_data()
        self._build_model()
        self._build_optimizers()
        self.state = TrainState(mesh_name(self.dims))
        self.zero_grad_steps = 0  # steps in a row whose grad norm was exactly 0
        self.dump = Path(cfg.job.dump_folder)
        self._build_checkpointer()
        self.metrics = _on_every_rank(MetricsLogger, self.dump, cfg, self.rank0, self.state.step)
        self.profiler = Profiler(cfg.profiling, self.dump, dist.get_rank(), self.device)
        dist.barrier()  # ranks sharing a machine measure together, each seeing its share of it
        p = cfg.parallelism
        self.step_metrics = StepMetrics(
            self.device,
            dist.get_world_size(),
            self.model_args,
            self.dp_degree,
            self.loader.global_batch_size * cfg.training.seq_len,
            cfg.training.seq_len,
            self.dims.cp,
            p.context_parallel_load_balancer,
            p.context_parallel_strategy,
            layer_masks(self.model_args),
        )

    def close(self) -> None:
        """Close the metrics (a run stopped by an error keeps the TensorBoard events of its last steps: the
        process ends without finalization, :func:`titan_cp.errors.end_process`) and release the dump folder
        (rank 0's lock file)."""
        metrics = getattr(self, "metrics", None)  # None: the trainer stopped before it opened them
        if metrics is not None:
            with contextlib.suppress(OSError):  # a full disk was reported already
                metrics.close()
        if self.lock is not None:
            self.lock.release()

    def _build_mesh(self) -> None:
        """The named mesh, and this process's dp, cp and tp ranks."""
        self.dims = self.cfg.parallel_dims(dist.get_world_size())
        self.dims.build_mesh(self.device.type)
        dp = self.dims.get_mesh("dp")
        self.dp_rank, self.dp_degree = dp.get_local_rank(), dp.size()
        self.tp_rank = self.dims.get_mesh("tp").get_local_rank()

    def _build_data(self) -> None:
        """This dp rank's training loader and, with validation, its validation loader (over the sources
        read before the process group started)."""
        cfg, sources, dp = self.cfg, self.sources, (self.dp_rank, self.dp_degree)
        self.loader = build_dataloader(cfg, self.tokenizer, *dp, "train", self.rank0, sources["train"])
        self.val_loader = (
            build_dataloader(cfg, self.tokenizer, *dp, "validation", self.rank0, sources["validation"])
            if cfg.validation.enable
            else None
        )
        if self.val_loader is not None:  # every validation reads the same rows, from the start of the set
            self.val_start = self.val_loader.state_dict()
            self.val_steps = cfg.validation.steps if cfg.validation.steps != -1 else _whole_set_steps(self.val_loader)
            # the accuracy of a guess at one answer token, where the source knows it (the synthetic corpora)
            self.recall_chance = getattr(self.val_loader.packer.source, "chance", None)

    def _build_model(self) -> None:
        """The model parts of this rank (pipeline stages, or the one model), parallelized and
        initialised; the loss; the compute precision (FSDP's, or autocast's without FSDP)."""
        cfg = self.cfg
        if cfg.compile.enable and "loss" in cfg.compile.components and self.rank0:
            logger.info("compile.components: 'loss' is not compiled by titan_cp (only 'model' is)")
        self.loss_fn = GlobalTokenLoss()
        self.family = check_model(cfg)
        precision = compute_precision(cfg, self.device.type, announce=self.rank0)
        mp = {"bfloat16": torch.bfloat16, "float32": None}[precision]
        options = parallelize_options(cfg, mp)
        # FSDP computes in mp's dtype itself; without it (one device, TP or PP alone) autocast does, as torchtitan
        sharded = self.dims.fsdp_enabled or self.dims.dp_replicate_enabled
        self.amp = (
            torch.autocast(self.device.type, dtype=mp) if mp is not None and not sharded else contextlib.nullcontext()
        )
        if mp is not None and not sharded:
            logger.info("training.mixed_precision_param = %s: autocast (no FSDP to cast the parameters)", precision)
        # built on meta, parallelized, then each rank allocates and initialises only its shards (seeded: same on
        # every mesh); a Hugging Face model's weights are loaded later, with the checkpointer
        built, self.model_args = self.family.build_parallel(
            cfg, self.dims, options, self.device, self.tokenizer.vocab_size, self.loss_fn
        )
        self.parts, self.schedule, self.first, self.last = built.parts, built.schedule, built.has_first, built.has_last
        self.cp = built.cp  # the CP handle the parts run by: every microbatch is sharded with it

    def _build_optimizers(self) -> None:
        """One optimizer per model part, and their LR schedule."""
        o, s, t = self.cfg.optimizer, self.cfg.lr_scheduler, self.cfg.training
        self.optimizers = build_optimizers(
            self.parts, o.name, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay, o.implementation
        )
        self.schedulers = LRSchedulers(
            self.optimizers, lr_lambda(s.warmup_steps, t.steps, s.decay_ratio, s.decay_type, s.min_lr_factor)
        )

    def _build_checkpointer(self) -> None:
        """The checkpointer; resumes from ``checkpoint.folder``, or loads ``initial_load_path`` when
        there is nothing to resume."""
        c = self.cfg.checkpoint
        self.checkpointer = Checkpointer(
            self.dump / c.folder,
            self.parts,
            self.optimizers,
            {"lr_scheduler": self.schedulers, "dataloader": self.loader, "train_state": self.state},
            keep_latest_k=c.keep_latest_k,
            async_mode=c.async_mode,
            exclude_from_loading=tuple(c.exclude_from_loading),
            model_what=self.family.describe(self.cfg.model),
        )
        resumed = c.enable and self.checkpointer.load(c.load_step) is not None
        if resumed and self.state.step > self.cfg.training.steps:
            raise UserError(_past_the_end(self.state.step, self.cfg.training.steps, self.checkpointer.folder))
        if resumed and self.state.step > 0:  # the whole state loaded: the config's hyperparameters win
            self._apply_config_hyperparameters()
        if not resumed and c.initial_load_path:  # into the sharded, initialised model
            if c.initial_load_in_hf:
                self.family.load_hf(self.parts, c.initial_load_path, self.model_args)
            else:
                self.checkpointer.load_model(c.initial_load_path, c.initial_load_model_only)

    def _apply_config_hyperparameters(self) -> None:
        """After a resume: the optimizer's hyperparameters and the LR schedule's base rate are the
        config's (a new ``--optimizer.lr`` applies, as in torchtitan); the moments, the schedule's
        position, the data position and the step are the checkpoint's. Logs which is which."""
        o = self.cfg.optimizer
        wanted = {"betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
        changed = restore_hyperparameters(self.optimizers, wanted)
        old_lr = self.schedulers.restore_base_lrs()
        if old_lr != o.lr:
            changed["lr"] = (old_lr, o.lr)
        if self.rank0:
            saved, here = self.state.saved_mesh, self.state.mesh
            mesh = f"on {here}, as saved" if saved == here else f"saved on {saved or 'an unrecorded mesh'} on {here}"
            from_config = ", ".join(f"{k} {new} (the checkpoint had {old})" for k, (old, new) in changed.items())
            logger.info(
                "resuming step %d %s: from the checkpoint: weights, optimizer moments, LR schedule position, data "
                "position; from the config: %s",
                self.state.step,
                mesh,
                from_config or "lr, betas, eps, weight_decay (the same as the checkpoint's)",
            )

    # ------------------------------------------------------------------ steps
    def _microbatch(self, batch, doc_lens: torch.Tensor | None = None) -> Microbatch:
        """``batch`` on this rank's device, sharded by its layout (built here, once per microbatch);
        ``doc_lens``: other documents for the same tokens (the shard-cut evaluation's)."""
        doc_lens = batch.doc_lens_padded if doc_lens is None else doc_lens
        mb = Microbatch(batch.tokens, batch.labels, batch.positions, doc_lens).to(self.device)
        return mb.shard(self.cp, self._pp_microbatches)

    @property
    def _pp_microbatches(self) -> int:
        """The rows' chunks the pipeline schedule runs a microbatch in (1 without a pipeline)."""
        if self.schedule is None:
            return 1
        return self.cfg.training.local_batch_size // self.cfg.parallelism.pipeline_parallel_microbatch_size

    def _global_sum(self, value: torch.Tensor) -> float:
        """Sum a per-rank loss contribution over the world, counting each tp group once, last stage only."""
        counted = value.detach().float() if (self.last and self.tp_rank == 0) else torch.zeros((), device=self.device)
        dist.all_reduce(counted)
        return counted.item()

    def train_step(self, step_data: Step) -> tuple[float, float]:
        """Forward, backward and update on one step's rows; ``(loss, grad norm)``. The step must
        hold loss-bearing tokens (``step_data.global_valid_tokens > 0``)."""
        self.loss_fn.global_valid_tokens = step_data.global_valid_tokens
        local = torch.zeros((), device=self.device)
        self.layouts: list[SequenceLayout] = []  # the step's microbatch layouts, for its metrics
        for batch in step_data.microbatches:
            mb = self._microbatch(batch)
            self.layouts.append(mb.sharded_by())
            with self.amp:
                local = local + forward_backward(self.parts, mb, self.loss_fn, self.schedule, self.first, self.last)
        pp_group = self.dims.get_mesh("pp").get_group() if self.dims.pp_enabled else None
        grad_norm = clip_grad_norm_(self.parts, self.cfg.training.max_norm, pp_group)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        self.schedulers.step()
        return self._global_sum(local), grad_norm.item()

    @torch.no_grad()
    def validate(self) -> dict:
        """Held-out loss and recall accuracy by fact-to-question distance (tokens, and whole shards
        under CP), computed under CP; with ``validation.recall_shard_cut`` the same rows again with
        every document cut at the shards (:func:`~titan_cp.layout.cut_at_shards`: each rank attends
        only to its own shard), as ``*_shard_cut``."""
        if self.dims.pp_enabled:
            logger.warning("validation is skipped under pipeline parallelism")
            return {}
        v, loader = self.cfg.validation, self.val_loader
        if loader is None:
            raise ValueError("validate() needs validation.enable = true")
        buckets, seq_len = v.recall_buckets, self.cfg.validation_rows()[1]
        edges = shard_edges(seq_len, self.dims.cp)
        modes = ("", "_shard_cut") if v.recall_shard_cut else ("",)
        # per mode: [correct, total] per token bucket and per shard distance; loss sum; token count
        counts = {m: torch.zeros(len(buckets) + 1, 2, dtype=torch.float64, device=self.device) for m in modes}
        shards = {m: torch.zeros(self.dims.cp, 2, dtype=torch.float64, device=self.device) for m in modes}
        loss_sum = {m: torch.zeros((), dtype=torch.float64, device=self.device) for m in modes}
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        loader.load_state_dict(self.val_start)
        for part in self.parts:
            part.eval()
        for _ in range(self.val_steps):
            for batch in next(loader).microbatches:
                for mode in modes:
                    cut = cut_at_shards(batch.doc_lens, seq_len, self.dims.cp) if mode else None
                    mb = self._microbatch(batch, None if cut is None else _padded(cut))
                    distance = mb.local(batch.recall_distance.to(self.device))
                    with self.amp:  # chunked: the (tokens x vocab) logits are never whole
                        ce_sum, predicted = self.parts[0](
                            mb.tokens, positions=mb.positions, doc_lens=mb.doc_lens, labels=mb.labels, predict=True
                        )
                    if self.tp_rank == 0:  # the results are replicated over tp: count them once
                        loss_sum[mode] += ce_sum
                        if not mode:  # the same tokens in both modes
                            tokens += (mb.labels != IGNORE_INDEX).sum()
                        if v.recall_eval:
                            counts[mode] += recall_counts(predicted, mb.labels, distance, buckets)
                            shards[mode] += recall_counts(predicted, mb.labels, distance, edges)
        for part in self.parts:
            part.train()
        for t in (*counts.values(), *shards.values(), *loss_sum.values(), tokens):
            dist.all_reduce(t)
        out = {}
        for mode in modes:
            out[f"val_loss{mode}"] = (loss_sum[mode] / tokens.clamp(min=1)).item()
            out.update({f"{k}{mode}": x for k, x in recall_metrics(counts[mode], buckets).items()})
            if self.dims.cp > 1:
                out.update(shard_recall_metrics(shards[mode], mode))
        if v.recall_eval and self.recall_chance is not None and counts[""][:, 1].sum() > 0:
            out["recall_chance"] = self.recall_chance
        return out

    def train(self) -> list[dict]:
        cfg, t = self.cfg, self.cfg.training
        history = []
        first_step = self.state.step
        self.step_metrics.start(first_step, t.steps)
        if first_step == t.steps and self.rank0:
            logger.warning(
                "resumed at step %d = training.steps: nothing left to train (raise training.steps to go on)", t.steps
            )
        while self.state.step < t.steps:
            step_data = next(self.loader)
            t0 = time.perf_counter()
            skip = step_data.global_valid_tokens == 0  # the same on every rank: the loader counts globally
            with self.profiler.step(self.state.step + 1):
                trained = None if skip else self.train_step(step_data)
            self.state.step += 1
            step, dt = self.state.step, time.perf_counter() - t0
            if step == first_step + 1:  # initialisation and the first step may take long; the rest may not
                self.dims.set_timeout(cfg.comm.train_timeout_seconds)
            lr = self.schedulers.get_last_lr()[0]
            if trained is None:
                record = self._skipped(step, lr, step_data)
            else:
                loss, grad_norm = trained
                self._check_step(step, loss, grad_norm)
                record = self.step_metrics.record(
                    step, loss, grad_norm, lr, step_data, dt, self.loader.source_tokens, self.layouts
                )
                record.update(offload_metrics(self.parts))
            record["skipped_steps"] = self.state.skipped_steps
            if self.val_loader is not None and step % cfg.validation.freq == 0:
                record.update(self.validate())
            history.append(record)
            console = step % cfg.metrics.log_freq == 0 or step == t.steps
            _on_every_rank(self.metrics.log, record, console)  # rank 0 writes; a full disk stops every rank
            if cfg.checkpoint.enable and (step % cfg.checkpoint.interval == 0 or step == t.steps):
                self.checkpointer.save(step)  # the last step's too: a longer run continues from it exactly
                if step == t.steps and cfg.checkpoint.last_save_model_only:
                    self.checkpointer.export_model(step)
        self.checkpointer.close()  # an asynchronous save in flight lands
        if cfg.checkpoint.last_save_in_hf:
            folder = self.dump / cfg.checkpoint.folder / f"step-{self.state.step}-hf"
            self.family.save_hf(self.parts, folder, self.model_args, cfg.model.hf_assets_path)
        self.metrics.close()
        return history

    def _check_step(self, step: int, loss: float, grad_norm: float) -> None:
        """Stop (a ``UserError``, the same on every rank: both numbers are global) when the loss or the
        grad norm is not finite, or the grad norm was exactly 0 for :data:`ZERO_GRAD_STEPS` steps in a
        row (no parameter gets a gradient: damaged weights, or a model cut off from its loss)."""
        hint = (
            "lower optimizer.lr or resume from an earlier step with --checkpoint.load_step"
            if self.cfg.checkpoint.enable
            else "lower optimizer.lr"
        )
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise UserError(f"step {step}: the loss is {loss} and the grad norm {grad_norm}: the run diverged; {hint}")
        self.zero_grad_steps = self.zero_grad_steps + 1 if grad_norm == 0.0 else 0
        if self.zero_grad_steps >= ZERO_GRAD_STEPS:
            raise UserError(
                f"step {step}: the grad norm has been exactly 0 for {self.zero_grad_steps} steps (loss {loss:.4f}): "
                "no parameter receives a gradient, so nothing trains; the weights are damaged (e.g. a corrupted "
                "checkpoint: resume from an earlier step with --checkpoint.load_step, or check "
                "checkpoint.initial_load_path) or the model is cut off from its loss"
            )

    def _skipped(self, step: int, lr: float, step_data) -> dict:
        """Count, announce and describe step ``step``, whose rows hold no loss-bearing token (e.g.
        chat records whose turns before their first turn of ``training.loss_roles`` fill whole rows;
        records without such a turn are dropped when read): no update, no schedule step; its rows
        are consumed (the data position advances)."""
        self.state.skipped_steps += 1
        if self.rank0:
            logger.warning(
                "step %d skipped: its %d rows hold no loss-bearing token (e.g. a chat record's turns before its "
                "first turn of training.loss_roles fill them); no update (%d skipped so far)",
                step,
                self.loader.global_batch_size,
                self.state.skipped_steps,
            )
        t = self.cfg.training
        if self.state.skipped_steps > t.max_skipped_fraction * t.steps or self.state.skipped_steps == t.steps:
            raise UserError(
                f"step {step}: {plural(self.state.skipped_steps, 'step')} skipped (of training.steps = {t.steps}), more than "
                f"training.max_skipped_fraction = {t.max_skipped_fraction}: their rows hold no loss-bearing token. "
                f"Loss is taken on the turns of training.loss_roles = {list(t.loss_roles)} (chat records); the turns "
                "before them fill whole rows: raise training.seq_len, shorten those turns, or change the roles"
            )
        return self.step_metrics.skipped_record(step, lr, step_data, self.loader.source_tokens)


def _past_the_end(step: int, steps: int, folder: Path) -> str:
    """The line refusing a resume at ``step`` (saved in the checkpoint ``folder``) past ``training.steps``."""
    earlier = [s for s in saved_steps(folder) if s <= steps]
    other = f", or resume step {earlier[-1]} with --checkpoint.load_step {earlier[-1]}" if earlier else ""
    return (
        f"the checkpoint to resume, step {step} ({folder / f'step-{step}'}), is past training.steps = {steps}: the "
        f"run would train nothing. Raise training.steps above {step} to continue it{other}"
    )


def _on_every_rank(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on this rank; a ``UserError`` it raises on any rank is raised on every rank alike (the
    lowest rank's). For what one rank does alone (rank 0 writes the metrics file, takes the lock): the
    others stop with its one line rather than in their next collective, where a peer gone is a
    traceback each. One ``all_gather_object`` of a ``None`` when nothing failed."""
    error: str | None = None
    try:
        result = fn(*args)
    except UserError as e:
        error = str(e)
    errors: list[str | None] = [error]
    if dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise UserError(first)
    return result


def _lock_dump_folder(folder: Path, rank0: bool) -> DumpLock | None:
    """Rank 0 takes the dump folder's lock (:class:`titan_cp.lock.DumpLock`); a folder another run holds
    is the same ``UserError`` on every rank."""
    lock = DumpLock(folder) if rank0 else None
    _on_every_rank(lock.acquire if lock is not None else lambda: None)
    return lock


def _padded(doc_lens: list[list[int]]) -> torch.Tensor:
    """Rows of document lengths as a zero-padded ``(B, max_docs)`` int64 host tensor."""
    out = torch.zeros(len(doc_lens), max(map(len, doc_lens)), dtype=torch.int64)
    for i, lens in enumerate(doc_lens):
        out[i, : len(lens)] = torch.tensor(lens)
    return out


def _whole_set_steps(loader) -> int:
    """Validation steps that read a finite set once: its tokens over a step's tokens, rounded up
    (with ``best_fit`` packing the padding leaves the last documents of the set unread)."""
    source = loader.packer.source
    n = sum(len(source.document(i).tokens) for i in range(len(source)))
    return max(1, -(-n // (loader.global_batch_size * loader.seq_len)))


def main(argv: list[str] | None = None) -> list[dict]:
    """Run a training job; returns the per-step metrics (as written to ``metrics.jsonl``).

    With no arguments, or ``--help``/``-h``, prints the usage and every key instead (exit status 2
    and 0): a run is never started from the defaults alone by accident. Bad input raises
    ``ValueError`` naming the key or file; ``python -m titan_cp.train`` turns that into one line
    and exit status 2 (:func:`titan_cp.errors.run_cli`)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or any(a in ("--help", "-h") for a in argv):
        print(usage())
        raise SystemExit(0 if argv else 2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = load_config(argv, warn_adjustments=os.environ.get("RANK", "0") == "0")  # once per job, not per process
    check_files(cfg)  # before any process group starts
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()


if __name__ == "__main__":
    run_cli(main)
