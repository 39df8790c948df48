"""The scripts in ``examples/`` run as their docstrings (and README.md) say, offline on a CPU: each launched with
``torchrun --nproc-per-node 2`` (CP 2 on gloo) prints, on rank 0, the same losses and gradient norms as
the one-process run (``--nproc-per-node 1``: the stock Trainer / SFTTrainer, the loop at CP 1).

All six launches run at once (one free port each). Tolerances: the printed numbers have six decimals
(rounding 5e-7 each) and the CP runs add the same fp32 numbers in another order (~1e-6 on a loss of ~6).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is in the dev extra")
pytest.importorskip("trl", reason="trl is in the trainer extra")
pytest.importorskip("datasets", reason="datasets is in the dev extra")

ROOT = Path(__file__).parents[1]
EXAMPLES = ["hf_trainer.py", "sft_trainer.py", "hf_loop.py"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(example: str, nproc: int) -> subprocess.Popen:
    """``torchrun --nproc-per-node <nproc> examples/<example>`` from the repository root (its own port)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "CP")}
    env.update(
        OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    )
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    argv += ["--master-port", str(_free_port()), f"examples/{example}"]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _steps(run: subprocess.Popen, name: str) -> list[tuple[float, float]]:
    """The (loss, grad_norm) rank 0 printed per step; the launch must exit 0."""
    out, err = run.communicate(timeout=900)
    assert run.returncode == 0, f"{name} exited {run.returncode}:\n{err[-3000:]}"
    lines = [line.split() for line in out.splitlines() if line.startswith("step ")]
    assert [line[1] for line in lines] == ["1", "2", "3"], f"{name} printed:\n{out}"
    return [(float(line[3]), float(line[5])) for line in lines]


def test_each_example_under_cp2_prints_the_one_process_losses():
    runs = {(example, n): _launch(example, n) for example in EXAMPLES for n in (2, 1)}
    got = {key: _steps(run, f"{key[0]} on {key[1]} processes") for key, run in runs.items()}
    for example in EXAMPLES:
        cp2, one = got[(example, 2)], got[(example, 1)]
        assert [loss for loss, _ in cp2] == pytest.approx([loss for loss, _ in one], abs=2e-6), example
        assert [norm for _, norm in cp2] == pytest.approx([norm for _, norm in one], rel=1e-5, abs=2e-6), example
        assert one[2][0] < one[0][0], example  # it trains
