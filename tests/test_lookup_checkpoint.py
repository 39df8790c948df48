"""checkpoints/lookup_tiny is what its recipe, checkpoints/lookup_tiny.toml, makes: the recipe is
deterministic (seeded data and init, ``training.deterministic``, the same bits for any number of CPU
threads), and the shipped weights answer the recipe's step-400 validation questions as that run's
metrics (benchmarks/results/2026-12-05-lookup-tiny.jsonl, the run docs/recall.md reports) scored them.

The recipe's 400 steps take minutes; here its first steps run twice, on one and two threads, and
must give the same weights bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
RECIPE = "checkpoints/lookup_tiny.toml"
RESULTS = ROOT / "benchmarks" / "results" / "2026-12-05-lookup-tiny.jsonl"


def _first_steps(rank, world, dump, threads):
    """The weights after the recipe's first 2 steps on ``threads`` CPU threads."""
    from titan_cp.config import load_config
    from titan_cp.train import Trainer

    argv = ["--job.config_file", RECIPE, "--training.steps", "2", "--validation.enable", "false",
            "--checkpoint.enable", "false", "--job.dump_folder", dump]  # fmt: skip
    trainer = Trainer(load_config(argv))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainer.train()
        return {k: v.detach().clone() for k, v in trainer.parts[0].state_dict().items()}
    finally:
        torch.set_num_threads(before)
        trainer.metrics.close()
        trainer.close()


def test_the_recipe_gives_the_same_weights_on_one_and_two_threads(dist_pools, tmp_path):
    (one,) = dist_pools.run(1, _first_steps, str(tmp_path / "one"), 1, timeout=600)
    (two,) = dist_pools.run(1, _first_steps, str(tmp_path / "two"), 2, timeout=600)
    assert one.keys() == two.keys() and len(one) > 0
    for name in one:
        assert torch.equal(one[name], two[name]), name


def _lookup(rank, world, dump):
    from titan_cp.generate.cli import main

    return main(["--job.config_file", RECIPE, "--generate.task", "lookup", "--generate.lookup_documents", "2",
                 "--checkpoint.initial_load_path", "checkpoints/lookup_tiny", "--job.dump_folder", dump])  # fmt: skip


def test_the_shipped_weights_score_the_recipes_step_400_recall(dist_pools, tmp_path):
    """The recipe validates on 2 rows of 8192 tokens (12 questions); the shipped model answers the same
    questions through generation, right exactly as often as the recipe's step 400 logged."""
    (logged,) = [json.loads(line) for line in RESULTS.read_text().splitlines() if json.loads(line)["step"] == 400]
    (records,) = dist_pools.run(1, _lookup, str(tmp_path), timeout=600)
    assert len(records) == 12
    right = sum(r["correct"] for r in records)
    assert right == round(12 * logged["recall"]) and right / 12 == pytest.approx(logged["recall"], abs=1e-12)
