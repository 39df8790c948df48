"""Training metrics: a console line, ``metrics.jsonl`` (one JSON object per step), TensorBoard.

MFU: ``step FLOPs / (seconds * peak * ranks)``, the step's FLOPs counting the attention
work of the visible (query, key) pairs only (:func:`visible_pairs`, the attention tiles' own
count). The peak is the device's dense bf16 rating on known GPUs. A CPU has no rating to look
up: its peak is an *estimate*, the best of several timed fp32 matmuls at start-up on this
rank's threads (once per process), raised to any higher throughput the run itself reaches (so
CPU MFU never exceeds 100%; it reads as a fraction of what this machine was seen to do, and is
logged as ``mfu`` with ``mfu_is_estimate = true``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import resource
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TextIO

import torch

from titan_cp.attention.strategy import DEFAULT_STRATEGY, attention_schedule
from titan_cp.attention.tiling import CAUSAL, Mask, tile_mask
from titan_cp.checkpoint import saved_steps
from titan_cp.errors import UserError
from titan_cp.layout import SequenceLayout, get_layout

if TYPE_CHECKING:
    from titan_cp.config import JobConfig
    from titan_cp.data.loader import Step


class FlopCounter(Protocol):
    """What the metrics ask of a model's shapes (the Llama's ``ModelArgs``, or a family's)."""

    def training_flops(self, num_tokens: int, attention_pairs: int) -> int: ...


logger = logging.getLogger("titan_cp")

_GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "B200": 2250e12}
_CPU_PEAKS: dict[int, float] = {}  # by thread count, timed once per process


def peak_flops_per_second(device: torch.device) -> float:
    """Peak dense FLOP/s of one rank's device (see the module docstring)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in _GPU_PEAK_BF16.items():
            if key in name:
                return peak
        return 312e12
    threads = torch.get_num_threads()
    if threads not in _CPU_PEAKS:  # a process may run many trainers
        _CPU_PEAKS[threads] = _timed_matmul_flops()
    return _CPU_PEAKS[threads]


def _timed_matmul_flops() -> float:
    """FLOP/s of the best of several timed fp32 matmuls on this process's threads (a few milliseconds)."""
    n, reps = 256, 8
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):  # the best of several trials: other processes starting up slow some down
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * reps / best


class MFU:
    """Model FLOPs utilisation of ``ranks`` devices like ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device, ranks: int) -> None:
        self.peak = peak_flops_per_second(device)
        self.ranks = ranks
        self.is_estimate = device.type != "cuda"

    def __call__(self, flops: float, seconds: float) -> float:
        per_rank = flops / seconds / self.ranks
        if self.is_estimate:
            self.peak = max(self.peak, per_rank)
        return per_rank / self.peak


class StepMetrics:
    """The per-step record the trainer logs: loss, grad norm, lr, tokens/s, token counts, MFU,
    memory, ETA, the attention's schedule (in that order, then the running tokens drawn per mixture
    source).

    ``tokens/s = tokens_per_step / seconds`` (every rank's rows); MFU from the step's model FLOPs
    over all ranks: this dp rank's microbatches' FLOPs (``model_args.training_flops`` with the
    visible pairs of the layout the step used) times ``dp_degree``, over ``seconds * peak *
    ranks``; ETA: the mean time per step since :meth:`start` times the steps left.
    ``attention_schedule``: the schedule the CP attention ran (:func:`step_schedule`, from
    ``strategy`` and the model's layer ``masks``).
    """

    def __init__(
        self,
        device: torch.device,
        ranks: int,
        model_args: FlopCounter,
        dp_degree: int,
        tokens_per_step: int,
        seq_len: int,
        cp: int,
        balance: str,
        strategy: str = DEFAULT_STRATEGY,
        masks: Sequence[Mask] = (CAUSAL,),
    ) -> None:
        self.device, self.model_args, self.dp_degree = device, model_args, dp_degree
        self.tokens_per_step, self.seq_len, self.cp, self.balance = tokens_per_step, seq_len, cp, balance
        self.strategy, self.masks = strategy, tuple(masks)
        self.mfu = MFU(device, ranks)
        self.start(0, 0)

    def start(self, first_step: int, last_step: int) -> None:
        """Training runs from after ``first_step`` to ``last_step``, starting now (for the ETA)."""
        self._t0, self._first, self._last = time.perf_counter(), first_step, last_step

    def record(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        step_data: Step,
        seconds: float,
        sources: Mapping[str, int],
        layouts: Sequence[SequenceLayout] | None = None,
    ) -> dict:
        """The record of optimizer step ``step`` that took ``seconds``; ``step_data``: its
        :class:`titan_cp.data.Step`; ``sources``: the running tokens drawn per mixture source;
        ``layouts``: the :class:`~titan_cp.layout.SequenceLayout` each microbatch was sharded by
        (``None``: built here from the microbatches' documents, under this object's cp and balance)."""
        batches = step_data.microbatches
        if layouts is None:
            layouts = [get_layout(self.seq_len, self.cp, self.balance, b.doc_lens) for b in batches]
        pairs = sum(layout_pairs(layout) for layout in layouts)
        flops = self.model_args.training_flops(sum(b.tokens.numel() for b in batches), pairs) * self.dp_degree
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_second": self.tokens_per_step / seconds,
            "global_valid_tokens": step_data.global_valid_tokens,
            "padding_tokens": step_data.padding_tokens,
            "mfu": self.mfu(flops, seconds),
            "mfu_is_estimate": self.mfu.is_estimate,
            "memory_bytes": device_memory_bytes(self.device),
            "eta_seconds": (time.perf_counter() - self._t0) / (step - self._first) * (self._last - step),
            "attention_schedule": step_schedule(self.strategy, layouts, self.masks),
        }
        record.update({f"tokens_drawn/{name}": n for name, n in sources.items()})
        return record

    def skipped_record(self, step: int, lr: float, step_data: Step, sources: Mapping[str, int]) -> dict:
        """The record of step ``step``, skipped for want of loss-bearing tokens: no loss, grad norm,
        throughput or MFU; ``skipped: true``, its token counts and the ETA."""
        record = {
            "step": step,
            "skipped": True,
            "lr": lr,
            "global_valid_tokens": step_data.global_valid_tokens,
            "padding_tokens": step_data.padding_tokens,
            "eta_seconds": (time.perf_counter() - self._t0) / (step - self._first) * (self._last - step),
        }
        record.update({f"tokens_drawn/{name}": n for name, n in sources.items()})
        return record


def step_schedule(strategy: str, layouts: Sequence[SequenceLayout], masks: Sequence[Mask] = (CAUSAL,)) -> str:
    """The schedule ``strategy``'s attention ran on a step's microbatch ``layouts`` under each of the model's
    layer ``masks`` (:func:`~titan_cp.attention.strategy.attention_schedule`: ``"local"`` on one rank, else
    e.g. ``"ulysses"`` or ``"ring"``, the ring's schedule Ulysses runs where the documents stay home); the
    names joined by ``+`` in alphabetical order where microbatches or layers ran different ones."""
    names = {
        attention_schedule(strategy, layout.cp_size, layout, mask, layout.batch_size)
        for layout in layouts
        for mask in masks
    }
    return "+".join(sorted(names))


def layer_masks(model_args: object) -> tuple[Mask, ...]:
    """The distinct attention masks of a model's layers, from its shapes' ``layer_mask(i)`` (``(window,
    chunk)`` of layer ``i``, as :class:`~titan_cp.families.llama3.model.ModelArgs` gives them) over ``n_layers``;
    plain causal for shapes that give none."""
    layer_mask, n = getattr(model_args, "layer_mask", None), getattr(model_args, "n_layers", 0)
    if layer_mask is None or not n:
        return (CAUSAL,)
    return tuple(dict.fromkeys(Mask(True, *layer_mask(i)) for i in range(n)))


def visible_pairs(doc_lens: list[list[int]], seq_len: int, cp: int = 1, balance: str = "contiguous") -> int:
    """Visible causal (query, key) pairs per head of packed rows (``doc_lens``: the document
    lengths of each row): ``sum over documents of n (n + 1) / 2``, as the attention's tiles of the
    whole rows counts them. ``cp``/``balance`` name the layout the step used, to reuse it."""
    return layout_pairs(get_layout(seq_len, cp, balance, doc_lens))


def layout_pairs(layout: SequenceLayout) -> int:
    """Visible causal (query, key) pairs per head of the rows of ``layout`` (:func:`visible_pairs`)."""
    return tile_mask(layout, None, None, True).pairs(layout.batch_size or 1)


def device_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: allocator peak on CUDA, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def recall_counts(pred: torch.Tensor, labels: torch.Tensor, distance: torch.Tensor, buckets: list[int]) -> torch.Tensor:
    """``(len(buckets) + 1, 2)`` float64: per distance bucket, [correct, total] answer tokens.

    pred, labels, distance: same shape; a token is an answer token when ``distance > 0``
    (the tokens between its fact and it); bucket ``b`` holds distances in
    ``(buckets[b-1], buckets[b]]``, the last one distances beyond ``buckets[-1]``.
    """
    answer = distance > 0
    bucket = torch.bucketize(distance, torch.tensor(buckets, device=distance.device))
    correct = (pred == labels) & answer
    counts = torch.zeros(len(buckets) + 1, 2, dtype=torch.float64, device=pred.device)
    counts[:, 0].index_add_(0, bucket[correct], torch.ones_like(bucket[correct], dtype=torch.float64))
    counts[:, 1].index_add_(0, bucket[answer], torch.ones_like(bucket[answer], dtype=torch.float64))
    return counts


def recall_metrics(counts: torch.Tensor, buckets: list[int]) -> dict[str, float]:
    """``recall_le_<d>`` per bucket that saw answers, ``recall_gt_<last>``, and ``recall`` over all."""
    out = {}
    for b in range(len(buckets) + 1):
        name = f"recall_le_{buckets[b]}" if b < len(buckets) else f"recall_gt_{buckets[-1]}"
        if counts[b, 1] > 0:
            out[name] = (counts[b, 0] / counts[b, 1]).item()
    if counts[:, 1].sum() > 0:
        out["recall"] = (counts[:, 0].sum() / counts[:, 1].sum()).item()
    return out


def shard_edges(seq_len: int, cp: int) -> list[int]:
    """The :func:`recall_counts` bucket edges that count distances in whole shards (``seq_len / cp``
    tokens): bucket ``k`` holds the answers whose fact is ``k`` shards back, ``k * shard <=
    distance < (k + 1) * shard``, for ``k < cp`` (no distance in a row reaches ``cp`` shards)."""
    shard = seq_len // cp
    return [(k + 1) * shard - 1 for k in range(cp - 1)]


def shard_recall_metrics(counts: torch.Tensor, suffix: str = "") -> dict[str, float]:
    """From :func:`recall_counts` over :func:`shard_edges`: ``recall_shards_<k><suffix>`` per distance
    of ``k`` shards that saw answers, and ``recall_remote<suffix>`` over the answers whose fact is
    at least one shard back (on another rank under the ``contiguous`` layout)."""
    out = {
        f"recall_shards_{k}{suffix}": (counts[k, 0] / counts[k, 1]).item()
        for k in range(len(counts))
        if counts[k, 1] > 0
    }
    remote = counts[1:].sum(0)
    if remote[1] > 0:
        out[f"recall_remote{suffix}"] = (remote[0] / remote[1]).item()
    return out


def keep_steps_up_to(path: Path, step: int) -> tuple[int, Path | None]:
    """Make the JSON-lines metrics file ``path`` hold the records of steps ``<= step`` only (those a
    run resumed at ``step`` does not write again), never deleting one: when it holds others (or a
    torn line), the whole file is first kept as ``<path>.1`` (``.2``, ...: the first free name).
    Returns the number of lines left out and that name (``None``: the file was left as it was)."""
    if not path.is_file():
        return 0, None
    kept, dropped = [], 0
    for line in path.read_bytes().splitlines(keepends=True):
        try:
            record = json.loads(line)
            keep = record["step"] <= step and line.endswith(b"\n")
        except (ValueError, TypeError, KeyError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += bool(line.strip())
    if not dropped:
        return 0, None
    tmp, aside = path.with_name(path.name + ".tmp"), _free_name(path)
    try:
        tmp.write_bytes(b"".join(kept))
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk: the file is left as it was
        raise
    path.replace(aside)  # the whole history, under its own name
    tmp.replace(path)
    return dropped, aside


def _free_name(path: Path) -> Path:
    """``<path>.1``, ``<path>.2``, ...: the first that does not exist."""
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.{n}")


def write_failure(path: Path, step: int, error: OSError, checkpoints: Path | None = None) -> str:
    """The one line for the metrics file ``path`` that ``error`` (a full disk: ``ENOSPC``) kept from
    taking the records of ``step`` (and those after it): the file, the free bytes, and the newest
    step saved in ``checkpoints`` (the checkpoint folder; ``None``: checkpoints are off), which a rerun
    resumes from."""
    reason = error.strerror or str(error)
    if error.errno == errno.ENOSPC:
        free = shutil.disk_usage(path.parent).free if path.parent.is_dir() else 0
        reason = f"the disk is full ({free} bytes free)"
    steps = saved_steps(checkpoints) if checkpoints is not None else []
    kept = (
        f", step-{steps[-1]} is kept whole and a rerun resumes from it" if steps else ", and a rerun starts from step 1"
    )
    return (
        f"metrics of step {step} could not be written to {path}: {reason}; the records before it are kept{kept}. "
        "Free space there (or choose another job.dump_folder, or set metrics.save_jsonl_file = '' to write none) and "
        "rerun"
    )


class MetricsLogger:
    """Writes metrics on rank 0: console every ``log_freq`` steps, every step to JSON lines.

    ``resumed_step``: the step the run starts after (0 from scratch); when the JSON-lines file
    already holds records of later steps (written by a run that crashed after that checkpoint, or
    one resumed from an older step), the whole file is kept under the first free name ``<file>.1``,
    ``<file>.2``, ... and the file keeps the steps up to ``resumed_step``, so it lists each step
    once and no record is deleted. A run from step 0 over an existing file keeps that history
    under the first free name too. A file deleted while the run writes it is created again at the
    next record (with a warning). A write the file system refuses (a full disk) is one
    ``UserError`` naming the file, the step and the checkpoint a rerun resumes from
    (:func:`write_failure`); rank 0 alone writes, so the trainer raises it on every rank."""

    def __init__(self, dump_folder: Path, cfg: JobConfig, enabled: bool, resumed_step: int = 0) -> None:
        self.enabled = enabled
        self._jsonl: TextIO | None = None
        self._tb = None
        self._checkpoints = dump_folder / cfg.checkpoint.folder if cfg.checkpoint.enable else None
        if not enabled:
            return
        dump_folder.mkdir(parents=True, exist_ok=True)
        if cfg.metrics.save_jsonl_file:
            path = dump_folder / cfg.metrics.save_jsonl_file
            try:
                self._jsonl = self._open(path, resumed_step)
            except OSError as e:
                raise UserError(write_failure(path, resumed_step + 1, e, self._checkpoints)) from None
            self._path = path
        if cfg.metrics.enable_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional

                self._tb = SummaryWriter(str(dump_folder / cfg.metrics.save_tb_folder))
            except ImportError:
                logger.warning("metrics.enable_tensorboard is set but tensorboard is not installed; skipping it")

    @staticmethod
    def _open(path: Path, resumed_step: int) -> TextIO:
        """``path`` opened to append the records after ``resumed_step`` (the class docstring)."""
        if resumed_step == 0 and path.is_file() and path.stat().st_size > 0:
            earlier = _free_name(path)
            path.replace(earlier)
            logger.warning("%s: the run starts from step 0; the earlier records are kept as %s", path, earlier)
        dropped, kept = keep_steps_up_to(path, resumed_step)
        if dropped:
            logger.warning(
                "%s: %d records after step %d (the run resumes there) are left out; the whole file is kept as %s",
                path,
                dropped,
                resumed_step,
                kept,
            )
        return open(path, "a", buffering=1)

    def log(self, record: dict, console: bool = True) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            try:
                self._write(record)
            except OSError as e:
                jsonl, self._jsonl = self._jsonl, None
                with contextlib.suppress(OSError):  # its unwritten bytes would fail again at exit
                    jsonl.close()
                raise UserError(write_failure(self._path, record["step"], e, self._checkpoints)) from None
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])
        if console and "loss" in record:  # a skipped step was announced as a warning
            extra = "".join(f"  {k} {record[k]:.3f}" for k in record if k.startswith(("val_loss", "recall")))
            extra += "".join(f"  {k} {record[k]}" for k in record if k.startswith("tokens_drawn/"))
            extra += f"  attention {record['attention_schedule']}" if "attention_schedule" in record else ""
            logger.info(
                "step %d  loss %.4f  grad_norm %.3f  lr %.2e  tokens/s %.0f  mfu%s %.1f%%  memory %.2f GiB  eta %.0fs%s",
                record["step"],
                record["loss"],
                record["grad_norm"],
                record["lr"],
                record["tokens_per_second"],
                " (est.)" if record.get("mfu_is_estimate") else "",
                100 * record["mfu"],
                record["memory_bytes"] / 2**30,
                record["eta_seconds"],
                extra,
            )

    def _write(self, record: dict) -> None:
        """Append ``record`` as one line (line-buffered: on disk once written)."""
        assert self._jsonl is not None, "_write is called while the file is open"
        if not self._path.exists():  # deleted (or moved) while the run writes it: reopen by path
            logger.warning("%s was removed during the run: writing it again from step %d", self._path, record["step"])
            self._jsonl.close()
            self._jsonl = open(self._path, "a", buffering=1)
        self._jsonl.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
