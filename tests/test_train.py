"""The trainer end to end on gloo: resume on a different mesh continues the same training,
a crash during a save leaves the previous checkpoint loadable, and the CPU debug configs
train with a falling loss.

Resume tolerance: fp32; the reference is one process's run, and the meshes' runs re-shard the same
numbers, so only the reduction order changes (~1e-7 relative per step, seen ~8e-8 over the four steps
before the checkpoint, held to 1e-6); after the resume and four more AdamW steps we allow 1e-4 relative
on the loss.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titan_cp import checkpoint as ckpt_module
from titan_cp import metrics as metrics_module
from titan_cp.checkpoint import saved_steps
from titan_cp.config import load_config
from titan_cp.data import build_dataloader, build_tokenizer
from titan_cp.errors import DEBUG_ENV
from titan_cp.testing.logs import captured
from titan_cp.testing.trainer import tiny_run_args
from titan_cp.train import main

REPO = Path(__file__).resolve().parents[1]
BASE = tiny_run_args(steps=8, warmup_steps=2, global_batch_size=4) + [
    "--checkpoint.interval",
    "4",
    "--checkpoint.keep_latest_k",
    "0",
]


def _mesh_args(cp=1, dp=1, tp=1, pp=1, strategy="ring"):
    return [
        "--parallelism.context_parallel_degree",
        str(cp),
        "--parallelism.data_parallel_shard_degree",
        str(dp),
        "--parallelism.tensor_parallel_degree",
        str(tp),
        "--parallelism.pipeline_parallel_degree",
        str(pp),
        "--parallelism.context_parallel_strategy",
        strategy,
    ]


def _train(rank, world, argv):
    return [r["loss"] for r in main(argv)]


class Preempted(Exception):
    pass


def _train_until(rank, world, argv, stop_after_save):
    """Train, and die right after the checkpoint of step ``stop_after_save`` (a preempted job)."""
    real = ckpt_module.Checkpointer.save

    def save(self, step):
        path = real(self, step)
        if step == stop_after_save:
            raise Preempted(step)
        return path

    ckpt_module.Checkpointer.save = save
    try:
        main(argv)
    except Preempted:
        pass
    finally:
        ckpt_module.Checkpointer.save = real


def _losses(dist_pools, world, folder, mesh, stop_after_save=None, extra=()):
    argv = BASE + _mesh_args(**mesh) + ["--job.dump_folder", str(folder), *extra]
    if stop_after_save is not None:
        dist_pools.run(world, _train_until, argv, stop_after_save, timeout=600)
        return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return dist_pools.run(world, _train, argv, timeout=600)[0]


# the long-context memory options (activations and FSDP shards on the host, 2-block units, tiles):
# the run that saves and the one that resumes use them, the straight run does not
LONG_CONTEXT = [
    "--activation_checkpoint.mode", "full",
    "--activation_checkpoint.cpu_offload", "true",
    "--activation_checkpoint.blocks_per_checkpoint", "2",
    "--activation_checkpoint.tile_tokens", "48",
    "--training.enable_cpu_offload", "true",
]  # fmt: skip


@pytest.fixture(scope="module")
def straight(dist_pools, tmp_path_factory) -> list[float]:
    """The eight steps on one process, without a checkpoint: what a run on any mesh, preempted and resumed
    on another, must reproduce."""
    return _losses(dist_pools, 1, tmp_path_factory.mktemp("straight"), {}, extra=["--checkpoint.enable", "false"])


@pytest.mark.parametrize(
    "first,second,options",
    [
        ((4, dict(cp=4)), (4, dict(dp=2, cp=2)), LONG_CONTEXT),
        ((2, dict(cp=2)), (4, dict(tp=2, cp=2)), []),
        ((2, dict(cp=2, strategy="allgather")), (4, dict(pp=2, cp=2, strategy="allgather")), []),
    ],
    ids=["cp4_to_dp2cp2_long_context", "cp2_to_tp2cp2", "cp2_to_pp2cp2"],
)
def test_resume_on_another_mesh_continues_the_same_training(dist_pools, straight, tmp_path, first, second, options):
    run = tmp_path / "run"
    head = _losses(dist_pools, first[0], run, first[1], stop_after_save=4, extra=options)
    assert saved_steps(run / "checkpoint") == [4]
    tail = _losses(dist_pools, second[0], run, second[1], extra=options)  # resumes from step 4, trains 5..8
    assert len(tail) == 4
    assert head == pytest.approx(straight[:4], rel=1e-6)
    assert tail == pytest.approx(straight[4:], rel=1e-4)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["global_valid_tokens"] > 0 and r["tokens_per_second"] > 0 for r in rows)
    if options:  # the options were applied: the inputs of the tiny model's 2-block unit and its head went to the host
        assert all(r["host_activation_peak_bytes"] > 0 and r["device_inputs_max"] == 2 for r in rows), rows


def _train_crashing_at_save(rank, world, argv, crash_step):
    real = ckpt_module.dcp.save

    def save(state, storage_writer):
        real(state, storage_writer=storage_writer)
        if str(storage_writer.path).endswith(f"step-{crash_step}.tmp"):
            raise RuntimeError("simulated crash while saving")

    ckpt_module.dcp.save = save
    try:
        return main(argv)
    finally:
        ckpt_module.dcp.save = real


def test_crash_during_save_keeps_the_previous_checkpoint(dist_pools, tmp_path):
    argv = (
        BASE
        + _mesh_args(cp=2)
        + ["--job.dump_folder", str(tmp_path), "--checkpoint.interval", "2", "--training.steps", "4"]
    )
    with pytest.raises(Exception, match="simulated crash while saving"):
        dist_pools.run(2, _train_crashing_at_save, argv, 4, timeout=600)
    folder = tmp_path / "checkpoint"
    assert saved_steps(folder) == [2]  # the half-written step-4 is not a checkpoint
    assert (folder / "step-4.tmp").exists()
    losses = dist_pools.run(2, _train, argv, timeout=600)[0]
    assert len(losses) == 2  # resumed from step 2: trained steps 3 and 4
    assert saved_steps(folder) == [2, 4] and not (folder / "step-4.tmp").exists()


CONFIGS = {
    "debug_cp.toml": 4,
    "debug_fsdp_cp.toml": 4,
    "debug_tp_cp.toml": 4,
    "debug_pp_cp.toml": 4,
    "debug_hybrid_cp.toml": 4,
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cpu_debug_configs_train_with_falling_loss(dist_pools, tmp_path, name):
    argv = [
        "--job.config_file",
        f"train_configs/{name}",
        "--model.flavor",
        "tiny",
        "--training.seq_len",
        "512",
        "--training.steps",
        "6",
        "--lr_scheduler.warmup_steps",
        "2",
        "--optimizer.lr",
        "3e-3",
        "--job.dump_folder",
        str(tmp_path),
        "--checkpoint.enable",
        "false",
        "--validation.freq",
        "4",
        "--validation.steps",
        "1",
        "--metrics.log_freq",
        "100",
    ]
    losses = dist_pools.run(CONFIGS[name], _train, argv, timeout=600)[0]
    assert len(losses) == 6
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    assert Path(tmp_path / "metrics.jsonl").exists()


def _validation(rank, world, argv):
    return [{k: v for k, v in r.items() if k.startswith(("val_loss", "recall"))} for r in main(argv)]


def test_validation_under_cp_equals_a_single_process(dist_pools, tmp_path):
    """Held-out loss and recall by distance, computed on cp shards, match the 1-rank run."""
    # rows long enough that some answers share a row with their fact (only those are scored)
    argv = BASE + [
        "--training.steps",
        "2",
        "--validation.enable",
        "true",
        "--validation.freq",
        "2",
        "--validation.steps",
        "2",
        "--checkpoint.enable",
        "false",
        "--training.seq_len",
        "2048",
    ]
    single = dist_pools.run(1, _validation, argv + _mesh_args(cp=1) + ["--job.dump_folder", str(tmp_path / "a")])[0][-1]
    cp = dist_pools.run(4, _validation, argv + _mesh_args(cp=4) + ["--job.dump_folder", str(tmp_path / "b")])[0][-1]
    assert "val_loss" in single and "recall" in single
    by_shard = {key for key in cp if key.startswith("recall_shards_")} | {"recall_remote"}
    assert cp.keys() - by_shard == single.keys() and by_shard <= cp.keys()  # recall by shard distance: CP only
    for key in single:
        assert cp[key] == pytest.approx(single[key], rel=1e-4, abs=1e-9), key


def _records(rank, world, argv):
    return main(argv)


def test_chat_mixture_with_best_fit_packing_under_cp_equals_a_single_process(dist_pools, tmp_path):
    """Trajectories (loss on assistant turns) mixed with the recall corpus, packed best-fit with
    padding documents: the CP 2 run trains on the same tokens with the same loss as one process,
    and logs the tokens drawn per source."""
    argv = [
        "--job.config_file",
        "train_configs/debug_chat_mix.toml",
        "--training.seq_len",
        "2048",
        "--training.steps",
        "3",
        "--training.packing_lookahead",
        "8",
        "--validation.enable",
        "false",
        "--metrics.log_freq",
        "100",
    ]
    single = dist_pools.run(
        1,
        _records,
        argv + ["--parallelism.context_parallel_degree", "1", "--job.dump_folder", str(tmp_path / "a")],
        timeout=600,
    )[0]
    cp = dist_pools.run(2, _records, argv + ["--job.dump_folder", str(tmp_path / "b")], timeout=600)[0]
    assert [r["loss"] for r in cp] == pytest.approx([r["loss"] for r in single], rel=1e-4)
    for key in ("global_valid_tokens", "padding_tokens", "tokens_drawn/trajectories", "tokens_drawn/recall"):
        assert [r[key] for r in cp] == [r[key] for r in single], key
    last = single[-1]
    assert last["tokens_drawn/trajectories"] > 0 and last["tokens_drawn/recall"] > 0
    padding = sum(r["padding_tokens"] for r in single)
    assert padding > 0
    assert last["tokens_drawn/trajectories"] + last["tokens_drawn/recall"] + padding == 3 * 2 * 2048
    logged = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["tokens_drawn/recall"] == last["tokens_drawn/recall"]


def _train_until_logged(rank, world, argv, crash_after):
    """Train, and die right after step ``crash_after`` is logged (before its checkpoint, if any)."""
    real = metrics_module.MetricsLogger.log

    def log(self, record, console=True):
        real(self, record, console)
        if record["step"] == crash_after:
            raise Preempted(crash_after)

    metrics_module.MetricsLogger.log = log
    try:
        main(argv)
    except Preempted:
        pass
    finally:
        metrics_module.MetricsLogger.log = real


def test_steps_without_loss_bearing_tokens_are_skipped_and_a_resume_lists_each_step_once(dist_pools, tmp_path):
    """Chat records whose user turn is longer than a row (rows of it hold no target), among records
    without an assistant turn (dropped when read) and short question-answer records, on CP 2: steps
    whose rows hold no target are skipped and counted, the others train with the loader's exact
    global count; a run that crashed after step 8 resumes from step 4, and metrics.jsonl then lists
    steps 1 to 12 once each."""
    data = tmp_path / "data"
    data.mkdir()
    prompt = [{"role": "user", "content": "question: " + "words " * 120}, {"role": "assistant", "content": "ok"}]
    lines = [line for i in range(8) for line in [prompt] + [prompt[:1]] * (i % 3 == 0)]  # 720+ tokens: 3 rows of 256
    (data / "prompts.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in lines))
    answer = [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "an answer"}]
    (data / "answers.jsonl").write_text("".join(json.dumps({"messages": answer}) + "\n" for _ in range(8)))
    run = tmp_path / "run"
    argv = tiny_run_args(steps=12) + [
        "--parallelism.context_parallel_degree", "2",
        "--training.dataset", "mixture",
        "--training.mixture", f"prompts:chat:{data / 'prompts.jsonl'}:1,answers:chat:{data / 'answers.jsonl'}:1",
        "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0",
        "--job.dump_folder", str(run),
    ]  # fmt: skip
    cfg = load_config(argv)
    loader = build_dataloader(cfg, build_tokenizer(cfg.model.hf_assets_path), 0, 1)  # cp 2 on 2 ranks: one dp rank
    expected = [next(loader).global_valid_tokens for _ in range(12)]
    skipped = [n == 0 for n in expected]
    # skipped steps up to the checkpoint (the count must survive the resume), after it, after the crash
    assert any(skipped[:4]) and not all(skipped[4:8]) and any(skipped[4:8]) and any(skipped[8:])
    dist_pools.run(2, _train_until_logged, argv, 8, timeout=600)
    head = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in head] == list(range(1, 9)) and saved_steps(run / "checkpoint") == [4]
    tail = dist_pools.run(2, _records, argv, timeout=600)[0]
    assert [r["step"] for r in tail] == list(range(5, 13))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))  # the crashed run's steps 5-8 once, as rerun
    assert rows[4:] == [json.loads(json.dumps(r)) for r in tail]
    assert [r["global_valid_tokens"] for r in rows] == expected
    assert [r.get("skipped", False) for r in rows] == skipped
    assert [r["skipped_steps"] for r in rows] == [sum(skipped[: i + 1]) for i in range(12)]  # kept over the resume
    assert all(("loss" in r) != r.get("skipped", False) for r in rows)
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in rows if "loss" in r)
    assert rows[7]["loss"] == pytest.approx(head[7]["loss"], rel=1e-6)  # step 8 again, from the checkpoint


def _logged_steps(rank, world, argv):
    """``main(argv)``'s steps, and what this rank logged and warned."""
    with captured() as out:
        steps = [r["step"] for r in main(argv)]
    return steps, out


def test_extending_a_finished_run_continues_where_it_ended(dist_pools, tmp_path):
    """A finished run (CP 2, 4 steps), then the same job with training.steps raised to 5 (on DP 2)
    and 6 (CP 2 again): each run starts at the previous run's last step, whose checkpoint holds the
    whole state (checkpoint.last_save_model_only puts the model alone beside it); the three runs'
    losses are the losses of one 6-step run, metrics.jsonl lists each step once and nothing is set
    aside; with interval 3 and keep_latest_k 2 (the second run saves its last step only) a whole
    state is always kept, and the newest 2 model exports. The log names the saved and the new mesh, and
    the checkpoint once."""
    constant_lr = ["--lr_scheduler.decay_ratio", "0"]  # the same schedule whatever training.steps says
    argv = tiny_run_args(global_batch_size=4) + constant_lr + [
        "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "2",
        "--checkpoint.last_save_model_only",
    ]  # fmt: skip
    run, folder = tmp_path / "run", tmp_path / "run" / "checkpoint"
    straight = argv + ["--job.dump_folder", str(tmp_path / "straight"), "--training.steps", "6"]
    straight = dist_pools.run(2, _train, straight + ["--parallelism.context_parallel_degree", "2"], timeout=600)[0]
    logs = []
    for steps, cp in ((4, 2), (5, 1), (6, 2)):  # cp 1 on 2 ranks: dp 2
        mesh = ["--parallelism.context_parallel_degree", str(cp), "--job.dump_folder", str(run)]
        logs.append(dist_pools.run(2, _logged_steps, [*argv, *mesh, "--training.steps", str(steps)], timeout=600))
    assert [rank0[0] for rank0, _ in logs] == [[1, 2, 3, 4], [5], [6]]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and sorted(p.name for p in run.iterdir()) == [
        "checkpoint",
        "metrics.jsonl",
    ]
    assert [r["loss"] for r in rows] == pytest.approx(straight, rel=1e-4)
    assert saved_steps(folder) == [5, 6] and not any(ckpt_module._model_only(folder / f"step-{s}") for s in (5, 6))
    exports = sorted(p.name for p in folder.glob("*-model"))
    assert exports == ["step-5-model", "step-6-model"]  # keep_latest_k prunes the exports too
    for name in exports:  # the model alone
        saved = ckpt_module.dcp.FileSystemReader(str(folder / name)).read_metadata().state_dict_metadata
        assert saved and all(key.startswith("model.") for key in saved), name
    (first, _), (second, second_other), (third, _) = (ranks for ranks in logs)
    assert second[1].messages("resuming") == [
        "resuming step 4 saved on dp 1 x cp 2 on dp 2 x cp 1: from the checkpoint: weights, optimizer moments, "
        "LR schedule position, data position; from the config: lr, betas, eps, weight_decay (the same as the "
        "checkpoint's)"
    ]
    assert third[1].messages("resuming step 5 saved on dp 2 x cp 1 on dp 1 x cp 2:")
    assert second[1].messages("loaded checkpoint") == [f"loaded checkpoint {folder}/step-4"]
    assert second_other[1].messages("loaded") == [] and second_other[1].messages("resuming") == []
    assert not [w for _, out in (first, second, second_other, third) for w in out.warnings if w[0] == "FutureWarning"]


# ---- never silently wrong: a run that cannot train stops; a resume applies the config ------------


def _messages(rank, world, argvs):
    """``main(argv)`` of each argv: the user error (a ``ValueError``) it stopped with, else its records."""
    out = []
    for argv in argvs:
        try:
            out.append(main(argv))
        except ValueError as e:
            out.append(str(e))
    return out


def test_a_run_that_cannot_train_stops_with_one_message(dist_pools, tmp_path):
    """Weights that give no gradient (all zero: the uniform loss and grad norm 0 of a damaged
    checkpoint) stop after 3 steps; a diverging run (lr 1e30) stops at its first non-finite loss;
    chat records whose user turn fills the rows stop once more than training.max_skipped_fraction of
    the steps were skipped, naming the roles; chat records without a loss-bearing turn at all stop
    before the first step, naming the file and the roles."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titan_cp.families.llama3 import build_model

    zeros = {k: torch.zeros(v.shape) for k, v in get_model_state_dict(build_model("tiny", vocab_size=259)).items()}
    dcp.save({"model": zeros}, checkpoint_id=str(tmp_path / "zeros"))
    long_prompt = [{"role": "user", "content": "hi " * 2000}, {"role": "assistant", "content": "ok"}]
    chat = tmp_path / "chat.jsonl"  # loss in the last of 24 rows of 256 tokens
    chat.write_text(json.dumps({"messages": long_prompt}) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi " * 50}]}) + "\n")
    argv = tiny_run_args(steps=6) + ["--parallelism.context_parallel_degree", "1"]
    argvs = [
        [*argv, "--checkpoint.initial_load_path", str(tmp_path / "zeros"), "--job.dump_folder", str(tmp_path / "a")],
        [*argv, "--optimizer.lr", "1e30", "--job.dump_folder", str(tmp_path / "b")],
        [*argv, "--training.dataset", "chat", "--training.dataset_path", str(chat),
         "--job.dump_folder", str(tmp_path / "c")],
        [*argv, "--training.dataset", "chat", "--training.dataset_path", str(prompts),
         "--job.dump_folder", str(tmp_path / "d")],
    ]  # fmt: skip
    zero, diverged, skipped, no_loss = dist_pools.run(1, _messages, argvs, timeout=600)[0]
    assert zero.startswith("step 3: the grad norm has been exactly 0 for 3 steps (loss 5.5568)"), zero
    assert "the weights are damaged" in zero
    assert re.match(r"step \d: the loss is \S+ and the grad norm \S+: the run diverged; lower optimizer.lr", diverged)
    assert "nan" in diverged or "inf" in diverged
    assert skipped.startswith(
        "step 4: 4 steps skipped (of training.steps = 6), more than training.max_skipped_fraction"
    )
    assert "training.loss_roles = ['assistant']" in skipped
    assert no_loss.startswith(f"{str(prompts)!r}: none of its 1 chat records has a turn of training.loss_roles = ")


def test_resume_applies_the_configs_lr_and_keeps_the_history(dist_pools, tmp_path):
    """A finished run (steps 2 and 3): a resume from step 2 with a new optimizer.lr takes it (the
    schedule's position from the checkpoint); another flavor is named as such, not as damage; a
    training.steps below the newest step is refused, one equal to it trains nothing; the
    resume keeps the first run's metrics.jsonl as metrics.jsonl.1 (its step 3 is trained again), a start
    from step 0 keeps the history as metrics.jsonl.2."""
    run = tmp_path / "run"
    argv = tiny_run_args(steps=3, warmup_steps=1) + [
        "--parallelism.context_parallel_degree", "1", "--job.dump_folder", str(run), "--checkpoint.enable",
        "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "--checkpoint.keep_latest_k", "0",
    ]  # fmt: skip
    resumed = [*argv, "--training.steps", "4", "--optimizer.lr", "1e-3", "--checkpoint.load_step", "2"]
    other = [*argv, "--model.flavor", "tiny_swa"]
    short, done = [*argv, "--training.steps", "3"], [*argv, "--training.steps", "4"]
    fresh = [*argv, "--checkpoint.enable", "false", "--training.steps", "1"]
    argvs = [argv, resumed, other, short, done, fresh]
    first, again, flavor, past, nothing, scratch = dist_pools.run(1, _messages, argvs, timeout=600)[0]
    assert saved_steps(run / "checkpoint") == [2, 3, 4]
    assert past == (
        f"the checkpoint to resume, step 4 ({run}/checkpoint/step-4), is past training.steps = 3: the run would "
        "train nothing. Raise training.steps above 4 to continue it, or resume step 3 with --checkpoint.load_step 3"
    )
    assert nothing == []  # step 4 = training.steps: a finished run, said in a warning
    schedule = [r["lr"] / 8e-4 for r in first]  # debug_cp.toml's optimizer.lr
    assert [r["step"] for r in again] == [3, 4] and again[0]["lr"] == pytest.approx(1e-3 * schedule[2])
    assert flavor.startswith(f"checkpoint {run}/checkpoint/step-4 was saved from another model than model.flavor")
    assert "The checkpoint is not damaged" in flavor
    assert [r["step"] for r in scratch] == [1]
    history = [[json.loads(x)["step"] for x in (run / f"metrics.jsonl.{n}").read_text().splitlines()] for n in (1, 2)]
    assert history == [[1, 2, 3], [1, 2, 3, 4]] and (run / "metrics.jsonl").read_text().count("\n") == 1


def _launch_on_a_full_disk(argv: list[str], prefix: Path, free: int) -> str:
    """``python -m titan_cp.run --nproc-per-node 2 -m titan_cp.train argv`` as a user runs it, with the files
    written under ``prefix`` on a disk with ``free`` bytes left (:mod:`titan_cp.testing.full_disk`); the one
    line it ended with, after checking that it is the only one: exit status 2, no traceback, nothing from
    rank 1, every other line the trainer's log or the launcher's."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in (DEBUG_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    launcher = ["-m", "titan_cp.run", "--standalone", "--nproc-per-node", "2", "-m", "titan_cp.testing.full_disk"]
    done = subprocess.run(
        [sys.executable, *launcher, str(prefix), str(free), *argv],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in output and "[rank" not in output, output
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    log = re.compile(r"\d{4}-\d\d-\d\d [\d:,]+ (INFO|WARNING) |\S+ [\d:.]+ \d+ \S*torch/distributed/")
    assert len(errors) == 1 and all(log.match(line) or line in errors for line in done.stderr.splitlines()), output
    return errors[0]


def test_a_full_disk_mid_metrics_or_mid_checkpoint_is_one_line_on_two_ranks(dist_pools, straight, tmp_path):
    """2 ranks (CP 2), 8 steps saved every 4: metrics.jsonl's disk filling after step 4's save, under the
    launcher, ends with exactly one line, rank 0's, and exit status 2; then, rerun on the pool's ranks, step 8's
    save not fitting (refused inside torch.save, whose zip writer reports only a position mismatch) stops every
    rank with the same error. Each names the file or folder, the free bytes and the step kept. Nothing is lost:
    the records before are kept, step 4 stays whole, and the run resumed from it afterwards trains the straight
    run's steps 5-8."""
    run = tmp_path / "run"
    argv = BASE + _mesh_args(cp=2) + ["--job.dump_folder", str(run)]
    kept = "step-4 is kept whole and a rerun resumes from it"
    line = _launch_on_a_full_disk(argv, run / "metrics.jsonl", 1600)  # ~4.5 records of ~350 bytes
    found = re.fullmatch(
        rf"error: metrics of step (\d) could not be written to {run}/metrics.jsonl: the disk is full \(\d+ bytes "
        rf"free\); the records before it are kept, {kept}\. Free space there .* and rerun",
        line,
    )
    assert found and int(found.group(1)) > 4, line
    lines = (run / "metrics.jsonl").read_text().splitlines()
    head = [json.loads(x)["loss"] for x in lines[: int(found.group(1)) - 1]]  # then a record cut by the disk
    assert head[:4] == pytest.approx(straight[:4], rel=1e-6) and saved_steps(run / "checkpoint") == [4]
    message = _every_rank_alike(
        dist_pools.run(2, _main_on_a_full_disk, argv, run / "checkpoint" / "step-8", 100_000, timeout=600)
    )
    size = sum(f.stat().st_size for f in (run / "checkpoint" / "step-4").rglob("*") if f.is_file())
    assert re.fullmatch(
        rf"checkpoint step 8 could not be written to {run}/checkpoint: the disk is full \(\d+ bytes free; the "
        rf"last saved step takes {size} bytes\); {kept}\. Free space there .* and rerun",
        message,
    ), message
    assert saved_steps(run / "checkpoint") == [4] and not (run / "checkpoint" / "step-8.tmp").exists()
    tail = dist_pools.run(2, _train, argv, timeout=600)[0]  # space freed: the rerun resumes from step 4
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9)) and saved_steps(run / "checkpoint") == [4, 8]
    assert tail == pytest.approx([r["loss"] for r in rows[4:]], rel=1e-6)
    assert tail == pytest.approx(straight[4:], rel=1e-4)


def test_a_damaged_checkpoint_is_refused_alike_on_every_rank(dist_pools, tmp_path):
    """Steps 4 and 8 saved on CP 2, then 1,000 floats in one of step 8's optimizer tensors set to 0.5
    (the issue's damage, which loaded before without a word): the resume stops on both ranks with the
    same line (DCP passes the rank's error to the others), naming step 4 to resume from instead."""
    argv = BASE + _mesh_args(cp=2) + ["--job.dump_folder", str(tmp_path)]
    dist_pools.run(2, _train, argv, timeout=600)
    step = tmp_path / "checkpoint" / "step-8"
    items = ckpt_module.dcp.FileSystemReader(str(step)).read_metadata().storage_data.items()
    index, info = max(((i, s) for i, s in items if i.fqn.startswith("optimizer")), key=lambda item: item[1].length)
    with open(step / info.relative_path, "r+b") as f:
        f.seek(info.offset + 1024)
        f.write(b"\x00\x00\x00\x3f" * 1000)  # 0.5 in float32
    messages = dist_pools.run(2, _messages, [argv + ["--training.steps", "10"]], timeout=600)
    assert messages[0] == messages[1], messages
    assert messages[0][0] == (
        f"checkpoint {step} is damaged: bytes {info.offset}-{info.offset + info.length - 1} of {info.relative_path} "
        f"({index.fqn}) are not the bytes saved (their CRC-32 differs); resume from an older step with "
        f"--checkpoint.load_step 4 (saved steps: [4]); moving {step} away, the run resumes from step 4"
    )


def _main_on_a_full_disk(rank, world, argv, prefix, free=0):
    """``main(argv)`` with the files written under ``prefix`` on a disk with ``free`` bytes left: the ``UserError``
    it stops with."""
    from titan_cp.errors import UserError
    from titan_cp.testing.full_disk import full_disk

    with full_disk(prefix, free):
        try:
            main(argv)
        except UserError as e:
            return str(e)


def _every_rank_alike(messages: list[str]) -> str:
    """Rank 0's message, after checking every rank stopped with the same one (the free bytes aside: the free space
    moves between the ranks' looks)."""
    same = [re.sub(r"\d+ bytes free", "", m) for m in messages]
    assert all(m == same[0] for m in same), messages  # every rank stops with the same line
    return messages[0]


def test_a_full_disk_during_the_model_export_names_the_step_holding_the_same_model(dist_pools, tmp_path):
    argv = tiny_run_args(steps=2) + [
        "--parallelism.context_parallel_degree", "2", "--job.dump_folder", str(tmp_path), "--checkpoint.enable",
        "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0", "--checkpoint.last_save_model_only",
    ]  # fmt: skip
    message = _every_rank_alike(
        dist_pools.run(2, _main_on_a_full_disk, argv, tmp_path / "checkpoint" / "step-2-model", timeout=600)
    )
    assert re.fullmatch(
        rf"the model export step-2-model could not be written to {tmp_path}/checkpoint: the disk is full \(\d+ bytes "
        r"free; the last saved step takes \d+ bytes\); step-2 holds the same model with the whole state "
        r"\(checkpoint.initial_load_path loads its model alone\)",
        message,
    ), message
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]


def _log_of(rank, world, argv):
    """``main(argv)``'s info lines of the ``titan_cp`` logger."""
    import logging

    lines, logger = [], logging.getLogger("titan_cp")
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        main(argv)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return lines


def test_the_log_names_the_mesh_the_run_built(dist_pools, tmp_path):
    """The main job's config (CP 4 in its file) run on 2 ranks with CP 2: the log's mesh line says CP 2,
    and the job line does not say otherwise."""
    argv = [
        "--job.config_file", "train_configs/cpu_main.toml",
        "--parallelism.context_parallel_degree", "2",
        "--training.seq_len", "256",
        "--training.steps", "1",
        "--validation.enable", "false",
        "--checkpoint.enable", "false",
        "--job.dump_folder", str(tmp_path / "run"),
    ]  # fmt: skip
    lines = dist_pools.run(2, _log_of, argv, timeout=600)[0]
    assert "mesh: dp_shard 1 x cp 2 (ring, contiguous)" in lines, lines
    (job,) = [line for line in lines if line.startswith("job: ")]
    assert not re.search(r"\bcp\s*\d", job, re.IGNORECASE), job  # the degree is the mesh line's to say
