"""The scripts in ``examples/`` run as their docstrings (and README.md) say, offline on a CPU: each launched with
``torchrun --nproc-per-node 2`` (CP 2 on gloo) prints, on rank 0, the same losses and gradient norms as
the one-process run (``--nproc-per-node 1``: the stock Trainer / SFTTrainer, the loop at CP 1, the GRPO
trainer at CP 1); ``grpo_agent.py`` (docs/rl.md) runs ten steps and prints each step's mean reward too:
the same rollouts, so the same rewards.

The scripts share one launch of 2 ranks (tests/forked_launch.py: their imports paid once, then
each run in a fresh process of its own, forked, with torchrun's environment; the 1-process runs on the launch's first
rank alone). Tolerances: the printed numbers have six decimals
(rounding 5e-7 each) and the CP runs add the same fp32 numbers in another order (~1e-6 on a loss of ~6).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.forked_launch import launch, sections

pytest.importorskip("transformers", reason="transformers is in the dev extra")
pytest.importorskip("trl", reason="trl is in the trainer extra")
pytest.importorskip("datasets", reason="datasets is in the dev extra")

ROOT = Path(__file__).parents[1]
STEPS = {"hf_trainer.py": 3, "sft_trainer.py": 3, "hf_loop.py": 3, "grpo_agent.py": 10}  # what each prints
EXAMPLES = list(STEPS)


def _launch(tmp: Path) -> subprocess.Popen:
    """One launch of 2 ranks (as ``torchrun --nproc-per-node 2``) from the repository root running every example on 2 processes,
    then on 1 (``nproc: 1``: as under ``torchrun --nproc-per-node 1``), each on its own port."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "CP")}
    env.update(
        OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    )
    steps = [dict(name=f"{e}:{n}", argv=[f"examples/{e}"], nproc=n) for e in EXAMPLES for n in (2, 1)]
    plan = dict(steps=steps, markers=str(tmp / "markers"))
    return launch(2, plan, tmp / "plan.json", ROOT, env)


def _steps(run: subprocess.Popen) -> dict[str, list[tuple[float, ...]]]:
    """The (loss, grad_norm[, reward]) rank 0 printed per step, by ``example:nproc``; the launch must exit 0."""
    out, err = run.communicate(timeout=900)
    assert run.returncode == 0, f"the examples' launch exited {run.returncode}:\n{err[-3000:]}"
    found = sections(out)
    assert list(found) == [f"{e}:{n}" for e in EXAMPLES for n in (2, 1)], f"the examples printed:\n{out}"
    got = {}
    for name, text in found.items():
        lines = [line.split() for line in text.splitlines() if line.startswith("step ")]
        steps = STEPS[name.split(":")[0]]
        assert [line[1] for line in lines] == [str(i + 1) for i in range(steps)], f"{name} printed:\n{text}"
        got[name] = [tuple(float(x) for x in line[3::2]) for line in lines]
    return got


def test_each_example_under_cp2_prints_the_one_process_losses(tmp_path):
    got = _steps(_launch(tmp_path))
    for example in EXAMPLES:
        cp2, one = got[f"{example}:2"], got[f"{example}:1"]
        assert [step[0] for step in cp2] == pytest.approx([step[0] for step in one], abs=2e-6), example
        assert [step[1] for step in cp2] == pytest.approx([step[1] for step in one], rel=1e-5, abs=2e-6), example
        if example == "grpo_agent.py":  # the same rollouts, rewards and advantages, step by step
            assert [step[2] for step in cp2] == [step[2] for step in one], example
            assert len({step[2] for step in one}) > 1, example  # the policy moves: its rollouts' rewards change
        else:
            assert one[2][0] < one[0][0], example  # it trains
