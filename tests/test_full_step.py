"""benchmarks.full_step (``scripts/bench_memory.py --case full-step``): its byte counter is exact on
hand-computed fake tensors (creation, release, FSDP2's in-place resizes, host marks), and one rank's
whole step on fake tensors agrees with the planner's memory model (``titan_cp.plan.memory``) within the
issue's 10% on the device and on the host, at a small size (the full-size rows are in docs/training.md and
docs/full_step_memory.jsonl).

Why 10%: the planner's step peak is a sum of per-token figures and named buffers (module docstring of
``titan_cp.plan.memory``); the measured one is the most bytes live at one moment, which also holds what
the planner leaves out (FSDP's previous reduce-scatter input, the loss's and attention's transients)
and lacks what the planner over-counts (a block's saved tensors are freed during its backward).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks import full_step as fs
from titan_cp.config import load_config

MB = 2**20


def test_live_bytes_exact_with_resizes_and_host_marks():
    tracker = fs.LiveBytes()
    with FakeTensorMode(), tracker, tracker.resizes():
        a = torch.empty(MB // 4, dtype=torch.float32)  # 1 MiB
        b = torch.empty(MB, dtype=torch.bfloat16)  # 2 MiB
        tracker.mark("step")
        c = a + 1  # 3 MiB live, then a freed
        del a
        host = c.clone()  # 4 MiB live: 3 on the device, 1 on the host
        tracker.mark_host(host)
        b.untyped_storage().resize_(0)  # FSDP2's free of an unsharded parameter: 1 MiB device
        d = torch.empty(MB // 2, dtype=torch.float32)  # 3 MiB device
        b.untyped_storage().resize_(2 * MB)  # re-allocated: 5 MiB device, the peak
        del b, c, d, host
    t = tracker.timeline("step")
    assert t == {
        "device_peak_bytes": 5 * MB,
        "host_bytes": MB,
        "host_bytes_at_device_peak": MB,
        "device_start_bytes": 3 * MB,
    }


# Llama 3 8B's width cut to 4 blocks, 131072 tokens on CP 2 (at the debug models' widths the loss chunk and
# the buffers outweigh the activations the planner's per-token figures are about)
SMALL = [
    *fs.BASE,
    "--model.flavor", "8B",
    "--training.seq_len", "131072",
    "--parallelism.context_parallel_degree", "2",
]  # fmt: skip
LAYERS = 4


@pytest.mark.parametrize(
    "options",
    [
        [],  # nothing offloaded
        [
            "--activation_checkpoint.cpu_offload",
            "true",
            "--activation_checkpoint.tile_tokens",
            "8192",
            "--training.enable_cpu_offload",
            "true",
        ],
    ],  # fmt: skip
    ids=["nothing-offloaded", "every-offload"],
)
def test_full_step_agrees_with_the_planner(options):
    row = fs.full_step_row(load_config([*SMALL, *options]), 2, "h100", layers=LAYERS)
    assert row["layers"] == LAYERS and row["cp"] == 2
    assert abs(row["device_over_planned"] - 1) <= 0.10, row
    if options:  # the shards, gradients and moments on the host: the device starts the step empty
        assert row["device_start_bytes"] < 2**20 and abs(row["host_over_planned"] - 1) <= 0.10, row
    else:  # fp32 shards and AdamW's moments of the blocks, the embedding and the output over 2 ranks
        assert row["host_bytes"] == row["planned_host_bytes"] == 0
        assert row["device_start_bytes"] >= 12 * (LAYERS * 218_112_000 + 2 * 525_336_576) // 2


def test_full_step_refuses_a_world_already_initialised(monkeypatch):
    monkeypatch.setattr(fs.dist, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="process group is already initialised"):
        fs.full_step_row(load_config(SMALL), 2, "h100", layers=LAYERS)


def test_full_step_refuses_bad_layers():
    with pytest.raises(ValueError, match="layers must be a positive integer"):
        fs.model_args(load_config(SMALL), 0)
