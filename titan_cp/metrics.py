"""Training metrics: a console line, ``metrics.jsonl`` (one JSON object per step), TensorBoard.

MFU: ``flops_per_token * tokens_per_second / (peak * ranks)``. The peak is the device's
dense bf16 rating on known GPUs; on a CPU, which has no rating to look up, it is measured
once at start-up as the throughput of a large fp32 matmul on this rank's threads (so CPU
MFU reads as a fraction of what this machine's matmul reaches).
"""

from __future__ import annotations

import json
import logging
import resource
import time
from pathlib import Path

import torch

logger = logging.getLogger("titan_cp")

_GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "B200": 2250e12}


def peak_flops_per_second(device: torch.device) -> float:
    """Peak dense FLOP/s of one rank's device (see the module docstring)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in _GPU_PEAK_BF16.items():
            if key in name:
                return peak
        return 312e12
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    t0 = time.perf_counter()
    reps = 4
    for _ in range(reps):
        torch.mm(a, b)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def device_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: allocator peak on CUDA, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MetricsLogger:
    """Writes metrics on rank 0: console every ``log_freq`` steps, every step to JSON lines."""

    def __init__(self, dump_folder: Path, cfg, enabled: bool):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        dump_folder.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(dump_folder / cfg.metrics.save_jsonl_file, "a", buffering=1)
        if cfg.metrics.enable_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional

                self._tb = SummaryWriter(str(dump_folder / cfg.metrics.save_tb_folder))
            except ImportError:
                logger.warning("metrics.enable_tensorboard is set but tensorboard is not installed; skipping it")

    def log(self, record: dict, console: bool = True) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])
        if console:
            extra = "".join(f"  {k} {record[k]:.3f}" for k in record if k.startswith(("val_loss", "recall")))
            logger.info(
                "step %d  loss %.4f  grad_norm %.3f  lr %.2e  tokens/s %.0f  mfu %.1f%%  memory %.2f GiB  eta %.0fs%s",
                record["step"], record["loss"], record["grad_norm"], record["lr"], record["tokens_per_second"],
                100 * record["mfu"], record["memory_bytes"] / 2**30, record["eta_seconds"], extra,
            )

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
