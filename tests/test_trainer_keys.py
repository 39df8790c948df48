"""The trainer's keys do what their docstrings say: optimizer name and implementation, AC option,
LR-schedule checkpoint keys, async and model-only saves, exclude_from_loading, load_step, profiling,
train timeout, whole-set validation, MFU and the visible-pair count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titan_cp import checkpoint as ckpt_module
from titan_cp.ac_modes import ac_mode_and_every
from titan_cp.checkpoint import Checkpointer, saved_steps
from titan_cp.families.llama3 import build_model
from titan_cp.metrics import MFU, visible_pairs
from titan_cp.optim import LRSchedulers, build_optimizers, lr_lambda
from titan_cp.parallel.ac import apply_ac
from titan_cp.testing.trainer import tiny_run_args

REPO = Path(__file__).resolve().parents[1]


def _tiny():
    return build_model("tiny", device="cpu")


@pytest.mark.parametrize("name, cls", [("AdamW", torch.optim.AdamW), ("Adam", torch.optim.Adam)])
@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_optimizer_name_and_implementation(name, cls, implementation):
    (opt,) = build_optimizers([_tiny()], name, 1e-3, (0.9, 0.95), 1e-8, 0.1, implementation)
    assert type(opt) is cls
    assert opt.defaults["fused"] is (implementation == "fused")
    assert opt.defaults["foreach"] is (implementation == "foreach")
    with pytest.raises(ValueError, match="optimizer.name"):
        build_optimizers([_tiny()], "SGD", 1e-3, (0.9, 0.95), 1e-8, 0.1, implementation)


@pytest.mark.parametrize("option, wrapped", [("1", [True, True]), ("2", [True, False]), ("op", [True, True])])
def test_selective_ac_option_as_torchtitan(option, wrapped):
    model = _tiny()
    mode, every = ac_mode_and_every("selective", option)
    assert mode == ("op" if option == "op" else "selective")
    apply_ac(model, mode, every=every)
    kinds = [type(block).__name__ == "CheckpointWrapper" for block in model.layers.values()]
    assert kinds == wrapped
    op_level = [
        getattr(block, "checkpoint_fn", None) is not None and "context_fn" in str(block.checkpoint_fn)
        for block in model.layers.values()
    ]
    assert all(op_level) == (option == "op")


def test_lr_schedulers_checkpoint_as_one_state_under_a_fixed_key():
    factor = lr_lambda(2, 10, None, "linear", 0.0)
    parts = [_tiny(), _tiny()]
    optimizers = build_optimizers(parts, "AdamW", 1.0, (0.9, 0.95), 1e-8, 0.0, "foreach")
    scheds = LRSchedulers(optimizers, factor)
    for _ in range(3):
        for opt in optimizers:
            opt.step()
        scheds.step()
    state = scheds.state_dict()
    fresh = LRSchedulers(build_optimizers([_tiny()], "AdamW", 1.0, (0.9, 0.95), 1e-8, 0.0, "foreach"), factor)
    fresh.load_state_dict(state)  # another number of pipeline stages
    assert fresh.get_last_lr() == scheds.get_last_lr() and fresh.schedulers[0].last_epoch == 3
    assert "id(" not in (REPO / "titan_cp" / "train.py").read_text()  # no key from a Python object id


def test_requested_load_step_that_is_not_there_fails(tmp_path):
    with pytest.raises(ValueError, match="checkpoint.load_step = 3, but .* holds no checkpoint"):
        Checkpointer(tmp_path, [], [], {}).load(3)
    assert Checkpointer(tmp_path, [], [], {}).load(-1) is None


def test_visible_pairs_is_the_plan_count():
    rows = [[3, 5], [8]]
    assert visible_pairs(rows, 8) == 6 + 15 + 36
    assert visible_pairs(rows, 8, cp=2, balance="doc_zigzag") == 6 + 15 + 36


def test_cpu_mfu_is_an_estimate_and_never_above_one():
    mfu = MFU(torch.device("cpu"), ranks=2)
    assert mfu.is_estimate
    assert mfu(flops=1e30, seconds=1.0) == pytest.approx(1.0)
    assert 0 < mfu(flops=1e10, seconds=1.0) < 1


def _run(rank, world, argv):
    from titan_cp.mesh import ParallelDims
    from titan_cp.train import main

    timeouts = []
    real = ParallelDims.set_timeout
    ParallelDims.set_timeout = lambda self, s: (timeouts.append(s), real(self, s))[1]
    try:
        return [r["step"] for r in main(argv)], timeouts
    finally:
        ParallelDims.set_timeout = real


BASE = tiny_run_args() + [
    "--parallelism.context_parallel_degree",
    "2",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "0",
    "--comm.train_timeout_seconds",
    "77",
]


def test_async_saves_and_the_model_export_exclude_profiling_and_train_timeout(dist_pools, tmp_path):
    argv = BASE + [
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "4",
        "--checkpoint.async_mode",
        "async",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "3",
    ]
    (steps, timeouts), _ = dist_pools.run(2, _run, argv, timeout=600)
    assert steps == [1, 2, 3, 4] and timeouts == [77]
    folder = tmp_path / "checkpoint"
    assert saved_steps(folder) == [2, 4] and not list(folder.glob("*.tmp"))
    # the last step holds the whole state too; checkpoint.last_save_model_only adds the model alone beside it
    assert not ckpt_module._model_only(folder / "step-2") and not ckpt_module._model_only(folder / "step-4")
    exported = ckpt_module.dcp.FileSystemReader(str(folder / "step-4-model")).read_metadata().state_dict_metadata
    assert exported and all(key.startswith("model.") for key in exported)
    assert sorted(p.name for p in (tmp_path / "profile_traces" / "iteration_3").iterdir()) == [
        "rank0_trace.json",
        "rank1_trace.json",
    ]
    # resume: from the last step, the data (left out) from its start
    argv = BASE + [
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "5",
        "--checkpoint.exclude_from_loading",
        "dataloader",
        "--metrics.save_jsonl_file=",
    ]
    (steps, _), _ = dist_pools.run(2, _run, argv, timeout=600)
    assert steps == [5]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4  # the second run wrote none


def test_whole_set_validation_steps(tmp_path):
    from titan_cp.config import load_config
    from titan_cp.data import build_dataloader, build_tokenizer
    from titan_cp.train import _whole_set_steps

    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in (300, 500, 700)))
    cfg = load_config(
        [
            "--validation.enable",
            "--validation.dataset",
            "text",
            "--validation.dataset_path",
            str(tmp_path / "val.jsonl"),
            "--training.seq_len",
            "256",
            "--training.local_batch_size",
            "2",
            "--lr_scheduler.warmup_steps",
            "1",
            "--training.steps",
            "2",
        ]
    )
    loader = build_dataloader(cfg, build_tokenizer(cfg.model.hf_assets_path), 0, 1, "validation")
    tokens = sum(len(loader.packer.source.document(i).tokens) for i in range(3))
    assert _whole_set_steps(loader) == -(-tokens // 512) >= 3


# --------------------------------------------------------------- compute precision on a CPU


PRECISION_KEY = "training.mixed_precision_param"


@pytest.mark.parametrize(
    "argv, device, want, level",
    [
        ([], "cpu", "float32", "INFO"),  # left at its default bf16: fp32 on a CPU, said once
        ([f"--{PRECISION_KEY}", "bfloat16"], "cpu", "bfloat16", "WARNING"),  # set on purpose: kept, warned
        ([f"--{PRECISION_KEY}", "float32"], "cpu", "float32", None),
        ([], "cuda", "bfloat16", None),
        ([f"--{PRECISION_KEY}", "bfloat16"], "cuda", "bfloat16", None),
    ],
)
def test_cpu_computes_in_fp32_unless_bf16_was_asked_for(caplog, argv, device, want, level):
    from titan_cp.config import load_config
    from titan_cp.train import compute_precision

    cfg = load_config(["--lr_scheduler.warmup_steps", "1", *argv])
    with caplog.at_level("INFO", logger="titan_cp"):
        assert compute_precision(cfg, device, announce=False) == want
        assert not caplog.records
        assert compute_precision(cfg, device, announce=True) == want
    if level is None:
        assert not caplog.records
    else:
        (record,) = caplog.records
        assert record.levelname == level and PRECISION_KEY in record.getMessage()


def _trainer_precision(rank, world, argv):
    """The trainer's compute dtype (its autocast's: one rank, no FSDP) and its log lines about the
    key on a CPU."""
    import logging

    from titan_cp.config import load_config
    from titan_cp.train import Trainer

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append((record.levelname, record.getMessage()))
    log = logging.getLogger("titan_cp")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        trainer = Trainer(load_config(argv))
        trainer.metrics.close()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    dtype = trainer.amp.fast_dtype if isinstance(trainer.amp, torch.autocast) else torch.float32
    return dtype, [(lvl, line) for lvl, line in lines if PRECISION_KEY in line and "on CPU" in line]


def test_trainer_on_cpu_chooses_fp32_when_the_key_is_unset(dist_pools, tmp_path):
    """A TOML without ``training.mixed_precision_param`` (as torchtitan's) trains in fp32 on a CPU
    and says so once; the same TOML with bf16 on the command line keeps bf16 and warns."""
    text = (REPO / "train_configs" / "debug_cp.toml").read_text()
    assert f'{PRECISION_KEY.split(".")[1]} = "float32"' in text
    toml = tmp_path / "no_precision.toml"
    toml.write_text("\n".join(line for line in text.splitlines() if not line.startswith("mixed_precision_param")))
    argv = tiny_run_args() + [
        "--job.config_file",
        str(toml),
        "--parallelism.context_parallel_degree",
        "1",
        "--checkpoint.enable",
        "false",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    ((dtype, lines),) = dist_pools.run(1, _trainer_precision, argv, timeout=600)
    assert dtype == torch.float32 and [lvl for lvl, _ in lines] == ["INFO"]
    ((dtype, lines),) = dist_pools.run(1, _trainer_precision, argv + [f"--{PRECISION_KEY}", "bfloat16"], timeout=600)
    assert dtype == torch.bfloat16 and [lvl for lvl, _ in lines] == ["WARNING"]
