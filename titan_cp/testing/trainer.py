"""Command lines of small training runs for the trainer's tests."""

from __future__ import annotations


def tiny_run_args(steps: int | None = None, warmup_steps: int = 1, global_batch_size: int | None = None) -> list[str]:
    """``titan_cp.train`` arguments of a tiny CPU run: ``debug_cp.toml`` with the tiny model, 256-token
    rows, 2 rows per rank, no validation, quiet log; the mesh and checkpoint keys are the caller's."""
    argv = [
        "--job.config_file", "train_configs/debug_cp.toml",
        "--model.flavor", "tiny",
        "--training.seq_len", "256",
        "--training.local_batch_size", "2",
        "--lr_scheduler.warmup_steps", str(warmup_steps),
        "--validation.enable", "false",
        "--metrics.log_freq", "100",
    ]  # fmt: skip
    if global_batch_size is not None:
        argv += ["--training.global_batch_size", str(global_batch_size)]
    if steps is not None:
        argv += ["--training.steps", str(steps)]
    return argv
