"""One source for each registry: a strategy or a balance registered at run time is a valid config value
and trains; the activation-checkpoint modes are one list.

The strategy is a subclass of ring that counts its forward calls, registered under a new name by
this module (in the test process for ``load_config``, and in each worker, which imports this
module to run :func:`_train_counting`). Two training steps on CP 2 must go through it.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import titan_cp.attention.strategy as strategy_module
import titan_cp.balance as balance_module
from titan_cp.ac_modes import AC_MODES, ac_mode_and_every
from titan_cp.attention.ring import Ring
from titan_cp.attention.strategy import get_strategy, register_strategy
from titan_cp.balance import LoadBalancer, get_balance, register_balance
from titan_cp.config import load_config
from titan_cp.integrations.trainer_factory import CPOptions, _check_options
from titan_cp.layout import SequenceLayout, seq_len_multiple
from titan_cp.testing.trainer import tiny_run_args
from titan_cp.train import main


class CountingRing(Ring):
    """Ring attention under another name, counting the forward calls it serves."""

    name = "counting_ring"
    calls = 0

    def forward(self, ctx, q, k, v):
        CountingRing.calls += 1
        return super().forward(ctx, q, k, v)


@contextlib.contextmanager
def _stand_ins():
    """The stand-in strategy and balances registered for the time of the block (the registries are
    the process's: other tests, in this process or in a pool worker, never see them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(strategy_module, "_REGISTRY", dict(strategy_module._REGISTRY))
        mp.setattr(balance_module, "_REGISTRY", dict(balance_module._REGISTRY))
        register_strategy(CountingRing())
        for balance in (ReversedContiguous(), Overlapping()):
            register_balance(balance)
        yield


@pytest.fixture(autouse=True)
def _registered():
    with _stand_ins():
        yield


def _argv(folder) -> list[str]:
    return tiny_run_args(steps=2, warmup_steps=1) + [
        "--parallelism.context_parallel_degree", "2",
        "--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.context_parallel_strategy", CountingRing.name,
        "--checkpoint.enable", "false",
        "--job.dump_folder", str(folder),
    ]  # fmt: skip


def _train_counting(rank, world, argv):
    CountingRing.calls = 0
    with _stand_ins():
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


# ------------------------------------------------------------------ a fifth balance
class ReversedContiguous(LoadBalancer):
    """A stand-in fifth balance: rank r holds the r-th chunk from the end; counts the rows it lays out."""

    name = "reversed_contiguous"
    rows = 0

    def spans(self, seq_len, cp_size, doc_lens):
        ReversedContiguous.rows += 1
        s = seq_len // cp_size
        return [[((cp_size - 1 - r) * s, s)] for r in range(cp_size)]


class Overlapping(LoadBalancer):
    """A broken balance: every rank holds the row's first tokens."""

    name = "overlapping_test"

    def spans(self, seq_len, cp_size, doc_lens):
        return [[(0, seq_len // cp_size)] for _ in range(cp_size)]


def _train_balanced(rank, world, argv):
    ReversedContiguous.rows = 0
    with _stand_ins():
        return [r["loss"] for r in main(argv)], ReversedContiguous.rows


def test_a_registered_balance_is_accepted_everywhere_and_refused_when_it_loses_tokens(tmp_path):
    name = ReversedContiguous.name
    argv = _argv(tmp_path) + ["--parallelism.context_parallel_load_balancer", name]
    assert load_config(argv).parallelism.context_parallel_load_balancer == name
    with pytest.raises(ValueError, match="did you mean 'reversed_contiguous'"):
        load_config(_argv(tmp_path) + ["--parallelism.context_parallel_load_balancer", "reversed_contigous"])
    with pytest.raises(ValueError, match=r"unknown load balancer 'zigzig'.*did you mean 'zigzag'"):
        get_balance("zigzig")
    _check_options(CPOptions(cp_size=2, balance=name))  # the Trainer factory's options
    layout = SequenceLayout(8, 2, name)
    assert layout.index(0).tolist() == [4, 5, 6, 7] and layout.index(1).tolist() == [0, 1, 2, 3]
    x = torch.arange(16).reshape(2, 8)
    assert torch.equal(layout.unshard([layout.shard(x, 1, r) for r in range(2)], 1), x)
    assert seq_len_multiple(name, 4) == 4 and layout.row_independent
    with pytest.raises(ValueError, match="'overlapping_test' does not deal the 8 positions .* every position once"):
        SequenceLayout(8, 2, Overlapping.name)


def test_a_registered_balance_trains_on_cp2_as_one_process_does(dist_pools, tmp_path):
    """Two steps on CP 2 under the fifth balance equal the one-process run's losses (fp32; the CP run
    merges attention over two ranks in another order: 1e-5 relative)."""
    balance = ["--parallelism.context_parallel_load_balancer", ReversedContiguous.name]
    ring = ["--parallelism.context_parallel_strategy", "ring"]
    cp2 = dist_pools.run(2, _train_balanced, _argv(tmp_path / "cp2") + ring + balance, timeout=600)
    one = _argv(tmp_path / "one") + ring + ["--parallelism.context_parallel_degree", "1"]
    (reference, _), *_ = dist_pools.run(1, _train_balanced, one, timeout=600)
    for losses, rows in cp2:
        assert rows > 0  # the layouts were this balance's
        assert losses == pytest.approx(reference, rel=1e-5)


# ------------------------------------------------------------------ activation-checkpoint modes
@pytest.mark.parametrize("mode", AC_MODES)
def test_every_activation_checkpoint_mode_is_a_config_value(tmp_path, mode):
    """The config, apply_ac and the Trainer factory read one list; ``op`` is also torchtitan's
    ``selective`` + ``selective_ac_option = "op"``."""
    ac = load_config(_argv(tmp_path) + ["--activation_checkpoint.mode", mode]).activation_checkpoint
    assert ac_mode_and_every(ac.mode, ac.selective_ac_option) == (mode, 2 if mode == "selective" else 1)
    _check_options(CPOptions(cp_size=2, activation_checkpointing=mode))
    spelled = load_config(
        _argv(tmp_path)
        + ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
    ).activation_checkpoint
    assert ac_mode_and_every(spelled.mode, spelled.selective_ac_option) == ("op", 1)
