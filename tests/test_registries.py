"""One source for each registry: a strategy registered at run time is a valid config value and trains.

The strategy is a subclass of ring that counts its forward calls, registered under a new name by
this module (in the test process for ``load_config``, and in each worker, which imports this
module to run :func:`_train_counting`). Two training steps on CP 2 must go through it.
"""

from __future__ import annotations

import math

import pytest

from titan_cp.attention.ring import Ring
from titan_cp.attention.strategy import get_strategy, register_strategy, strategy_names
from titan_cp.config import load_config
from titan_cp.testing.trainer import tiny_run_args
from titan_cp.train import main


class CountingRing(Ring):
    """Ring attention under another name, counting the forward calls it serves."""

    name = "counting_ring"
    calls = 0

    def forward(self, ctx, q, k, v):
        CountingRing.calls += 1
        return super().forward(ctx, q, k, v)


def _register() -> None:
    if CountingRing.name not in strategy_names():
        register_strategy(CountingRing())


_register()


def _argv(folder) -> list[str]:
    return tiny_run_args(steps=2, warmup_steps=1) + [
        "--parallelism.context_parallel_degree", "2",
        "--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.context_parallel_strategy", CountingRing.name,
        "--checkpoint.enable", "false",
        "--job.dump_folder", str(folder),
    ]  # fmt: skip


def _train_counting(rank, world, argv):
    _register()
    CountingRing.calls = 0
    losses = [r["loss"] for r in main(argv)]
    return losses, CountingRing.calls


def test_a_registered_strategy_is_a_config_value_and_trains_on_cp2(dist_pools, tmp_path):
    cfg = load_config(_argv(tmp_path))
    assert cfg.parallelism.context_parallel_strategy == CountingRing.name
    assert isinstance(cfg.parallelism.strategy(), CountingRing)
    with pytest.raises(ValueError, match="context_parallel_strategy must be one of .*counting_ring"):
        load_config(_argv(tmp_path) + ["--parallelism.context_parallel_strategy", "counting_rings"])
    results = dist_pools.run(2, _train_counting, _argv(tmp_path), timeout=600)
    for losses, calls in results:
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
        assert calls > 0  # the layers' attention ran through the registered strategy
    assert get_strategy(CountingRing.name).name == CountingRing.name
