"""The scripts in ``examples/`` run as their docstrings (and README.md) say, offline on a CPU: each launched with
``torchrun --nproc-per-node 2`` (CP 2 on gloo) prints, on rank 0, the same losses and gradient norms as
the one-process run (``--nproc-per-node 1``: the stock Trainer / SFTTrainer, the loop at CP 1).

The three scripts share a launch per process count (tests/forked_launch.py: their imports paid once, then
each in a fresh process of its own, forked), and the two launches run at once. Tolerances: the printed numbers have six decimals
(rounding 5e-7 each) and the CP runs add the same fp32 numbers in another order (~1e-6 on a loss of ~6).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.forked_launch import free_port, launch, sections

pytest.importorskip("transformers", reason="transformers is in the dev extra")
pytest.importorskip("trl", reason="trl is in the trainer extra")
pytest.importorskip("datasets", reason="datasets is in the dev extra")

ROOT = Path(__file__).parents[1]
EXAMPLES = ["hf_trainer.py", "sft_trainer.py", "hf_loop.py"]


def _launch(nproc: int, tmp: Path) -> subprocess.Popen:
    """``torchrun --nproc-per-node <nproc>`` of every example from the repository root (its own ports)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "CP")}
    env.update(
        OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    )
    steps = [dict(name=e, argv=[f"examples/{e}"], port=free_port()) for e in EXAMPLES]
    plan = dict(steps=steps, markers=str(tmp / f"markers{nproc}"))
    return launch(nproc, plan, tmp / f"plan{nproc}.json", ROOT, env)


def _steps(run: subprocess.Popen, nproc: int) -> dict[str, list[tuple[float, float]]]:
    """The (loss, grad_norm) rank 0 printed per step, by example; the launch must exit 0."""
    out, err = run.communicate(timeout=900)
    assert run.returncode == 0, f"the examples on {nproc} processes exited {run.returncode}:\n{err[-3000:]}"
    found = sections(out)
    assert list(found) == EXAMPLES, f"the examples on {nproc} processes printed:\n{out}"
    got = {}
    for example, text in found.items():
        lines = [line.split() for line in text.splitlines() if line.startswith("step ")]
        assert [line[1] for line in lines] == ["1", "2", "3"], f"{example} on {nproc} processes printed:\n{text}"
        got[example] = [(float(line[3]), float(line[5])) for line in lines]
    return got


def test_each_example_under_cp2_prints_the_one_process_losses(tmp_path):
    runs = {n: _launch(n, tmp_path) for n in (2, 1)}
    got = {n: _steps(run, n) for n, run in runs.items()}
    for example in EXAMPLES:
        cp2, one = got[2][example], got[1][example]
        assert [loss for loss, _ in cp2] == pytest.approx([loss for loss, _ in one], abs=2e-6), example
        assert [norm for _, norm in cp2] == pytest.approx([norm for _, norm in one], rel=1e-5, abs=2e-6), example
        assert one[2][0] < one[0][0], example  # it trains
