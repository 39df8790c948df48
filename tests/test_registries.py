"""One source for each registry: a strategy, a balance or a model family registered at run time is a
valid config value and trains, through titan_cp's trainer and through the Trainer factory; the
activation-checkpoint modes are one list.

The strategy is a subclass of ring that counts its forward calls, the balance deals the chunks in
reverse and counts the rows it lays out, the family is a tiny decoder without position embeddings
(:mod:`tests.family_standin`); each is registered by one call, by this module, for one test at a time
(in the test process for ``load_config``, and in each worker, which imports this module to run the
training functions). Two training steps on CP 2 must go through them and equal one process's.
"""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path

import pytest
import torch

import titan_cp.attention.kernels.base as kernel_module
import titan_cp.attention.strategy as strategy_module
import titan_cp.balance as balance_module
import titan_cp.families.base as family_module
import titan_cp.parallel.adapter as adapter_module
from tests.family_standin import NoPE, TinyNoPE, TinyNoPEForTrainer
from titan_cp.ac_modes import AC_MODES, ac_mode_and_every
from titan_cp.attention.ring import Ring
from titan_cp.attention.strategy import get_strategy, register_strategy
from titan_cp.balance import LoadBalancer, get_balance, register_balance
from titan_cp.config import load_config
from titan_cp.families import family_of, get_family, register_family
from titan_cp.integrations.trainer_factory import CPOptions, _check_options
from titan_cp.layout import SequenceLayout, seq_len_multiple
from titan_cp.parallel import apply_cp
from titan_cp.preflight import check_model
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
    """The stand-in strategy, balances and family registered for the time of the block, and whatever
    else it registers (kernels: docs/extending.md's) undone after it (the registries are the process's:
    other tests, in this process or in a pool worker, never see them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(strategy_module, "_REGISTRY", dict(strategy_module._REGISTRY))
        mp.setattr(kernel_module, "_REGISTRY", dict(kernel_module._REGISTRY))
        mp.setattr(kernel_module, "_INSTANCES", dict(kernel_module._INSTANCES))
        mp.setattr(balance_module, "_REGISTRY", dict(balance_module._REGISTRY))
        mp.setattr(family_module, "_REGISTRY", dict(family_module._REGISTRY))
        mp.setattr(adapter_module, "_PROVIDERS", list(adapter_module._PROVIDERS))
        register_strategy(CountingRing())
        for balance in (ReversedContiguous(), Overlapping()):
            register_balance(balance)
        register_family(NoPE())
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


# ------------------------------------------------------------------ a third family
def test_a_registered_family_is_a_config_value_and_apply_cp_takes_its_models(tmp_path):
    family = check_model(load_config(_argv(tmp_path) + ["--model.name", NoPE.name]))
    assert isinstance(family, NoPE) and get_family(NoPE.name) is family
    with pytest.raises(ValueError, match=r"model.name must be one of .*'nope_standin'.*did you mean 'nope_standin'"):
        check_model(load_config(_argv(tmp_path) + ["--model.name", "nope_stand_in"]))
    model = TinyNoPE()
    apply_cp(model, None)  # the family's adapter came with its one registration
    assert family_of(model) is family


def _train_family(rank, world, argv):
    CountingRing.calls = ReversedContiguous.rows = 0
    with _stand_ins():
        losses = [r["loss"] for r in main(argv)]
    return losses, CountingRing.calls, ReversedContiguous.rows


def test_a_registered_family_trains_on_cp2_as_one_process_does(dist_pools, tmp_path):
    """titan_cp's trainer: the third family under the sixth strategy and the fifth balance, two steps on
    CP 2 (FSDP over the cp ranks), equal to one process's losses (fp32, 1e-5 relative)."""
    family = ["--model.name", NoPE.name, "--parallelism.context_parallel_load_balancer", ReversedContiguous.name]
    cp2 = dist_pools.run(2, _train_family, _argv(tmp_path / "cp2") + family, timeout=600)
    one = _argv(tmp_path / "one") + family + ["--parallelism.context_parallel_degree", "1"]
    ((reference, _, _),) = dist_pools.run(1, _train_family, one, timeout=600)
    for losses, calls, rows in cp2:
        assert calls > 0 and rows > 0  # the attention was the strategy's, the layouts the balance's
        assert losses == pytest.approx(reference, rel=1e-5)


# ------------------------------------------------------------------ the Trainer factory
_G = torch.Generator().manual_seed(0)
DOCS = [torch.randint(2, 200, (int(n),), generator=_G).tolist() for n in torch.randint(3, 41, (8,), generator=_G)]


def _trainer_factory(rank, world, out_dir):
    """Two steps of ``transformers.Trainer`` made context-parallel over the whole world (CP 2, or one
    process), on the stand-in family's model under the registered strategy and balance; ``((loss,
    grad norm) per step, attention calls, layouts)``."""
    import os  # noqa: PLC0415

    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments  # noqa: PLC0415

    from titan_cp.integrations.trainer_factory import context_parallel_trainer  # noqa: PLC0415

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    CountingRing.calls = ReversedContiguous.rows = 0
    with _stand_ins():
        model = TinyNoPEForTrainer()
        model.init_weights(seed=0)
        cls = context_parallel_trainer(
            Trainer, cp_size=world, strategy=CountingRing.name, balance=ReversedContiguous.name
        )
        args = TrainingArguments(
            output_dir=f"{out_dir}/{world}", per_device_train_batch_size=4, max_steps=2, learning_rate=3e-3,
            warmup_steps=1, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, data_seed=0,
            train_sampling_strategy="sequential", disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        collate = DataCollatorWithFlattening(return_tensors="pt")
        data = [{"input_ids": doc} for doc in DOCS]
        trainer = cls(model=model, args=args, train_dataset=data, data_collator=collate)
        trainer.train()
    steps = [(r["loss"], r["grad_norm"]) for r in trainer.state.log_history if "grad_norm" in r]
    return steps, CountingRing.calls, ReversedContiguous.rows


def test_the_trainer_factory_trains_a_registered_family_strategy_and_balance_on_cp2(dist_pools, tmp_path):
    """``context_parallel_trainer`` takes what was registered: the third family's model, the sixth
    strategy and the fifth balance; two steps on CP 2 equal the factory's on one process (the same
    documents in one packed row a step; fp32: losses 1e-6, gradient norms 1e-5 relative)."""
    pytest.importorskip("transformers", reason="transformers is in the dev extra")
    cp2 = dist_pools.run(2, _trainer_factory, str(tmp_path), timeout=600)
    ((reference, _, _),) = dist_pools.run(1, _trainer_factory, str(tmp_path), timeout=600)
    assert len(reference) == 2
    for steps, calls, rows in cp2:
        assert calls > 0 and rows > 0
        assert [s[0] for s in steps] == pytest.approx([s[0] for s in reference], rel=1e-6)
        assert [s[1] for s in steps] == pytest.approx([s[1] for s in reference], rel=1e-5)


# ------------------------------------------------------------------ docs/extending.md
def test_the_examples_of_the_extending_guide_run():
    """Its strategy, kernel and balance examples, each one subclass and one register call, run as they
    are (their own asserts: the kernel's tiles, the balance's layout); registered for this test only."""
    text = (Path(__file__).parents[1] / "docs" / "extending.md").read_text()
    blocks = re.findall(r"<!-- doc-test: tested tests/test_registries.py -->\n```python\n(.*?)```", text, re.S)
    assert len(blocks) == 3
    for block in blocks:
        exec(compile(block, "docs/extending.md", "exec"), {"__name__": "__main__"})
    assert get_strategy("logged_ring") and get_balance("reversed")


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
