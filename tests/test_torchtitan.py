"""titan_cp inside torchtitan 0.3's own Trainer (:mod:`titan_cp.integrations.torchtitan`), offline on a CPU.

- The exactness bar: docs/torchtitan.md's CPU block, run as the page writes it, in a temporary folder (its
  ``outputs/`` there, ``$PWD`` that folder): ``python -m titan_cp.integrations.torchtitan.train --module
  titan_cp.integrations.torchtitan --config llama3_debugmodel_cp`` on the repository's packed documents,
  on 1 process and on 2 (CP 2: ring with doc_local, every block compiled by torchtitan through
  ``aot_eager``, the traced graphs inductor compiles), from one seed checkpoint (torchtitan's own
  ``--checkpoint.create_seed_checkpoint``: its random init of sharded parameters depends on the sharding).
  Every step's loss metrics, as torchtitan writes them to TensorBoard (float32), equal the one-process
  run's within 1e-5 for 4 steps: ``global_avg_loss``, and ``global_max_loss`` (one dp rank: its rows'
  mean, the average); so do the tokens seen. The one-process run's step-2 checkpoint (copied by the
  page's line) resumed at CP 2 with Ulysses and doc_zigzag (another CP size, strategy and balance) gives
  its steps 3 and 4 within 1e-5. The log names the CP that runs (from the handle, not the config), and its
  lines come once, not once per rank.
- The torchtitan door's mistakes: each is one line naming the flag and exit status 2, with no traceback,
  before any model is built (a bad kernel, strategy, Ulysses degree, sequence length for the CP degree,
  pipeline parallel, another spmd backend, the validator, more ranks than processes).
- The page's Qwen3.5 block (``--config qwen35_debugmodel_cp``: Gated DeltaNet layers through titan_cp's
  linear ops, imported without ``fla``), from its own seed checkpoint: CP 2 ring and CP 2 Ulysses give the
  one-process run's losses at every step, and the CP 2 ring run's step-2 checkpoint resumes at CP 4 (2 rings x
  Ulysses 2) with the straight run's step 3.
- The page's gpt-oss block (``gpt_oss_debugmodel_cp``: sliding windows on alternate layers, sinks inside
  titan_cp's op) and DeepSeek V3 block (``deepseek_v3_debugmodel_cp``: multi-head latent attention, v's head dim
  of its own), each from its own seed: CP 2 ring and CP 2 Ulysses give the one-process run's losses (MoE layers:
  step 1 within 1e-5, step 2 within 5e-5, :func:`_equal_moe_losses`). The expert-parallel block (Qwen3 MoE):
  EP 2 x CP 2 gives EP 2's losses, and its step-1 checkpoint resumes at EP 4 x CP 2 Ulysses with its step 2.
- All of it runs in one launch of 8 ranks (a module fixture), each line in a fresh forked process
  (tests/forked_launch.py: torch and the other libraries imported once, before the ranks fork), several at once on
  different ranks, each waiting for the lines whose outputs it reads (:func:`_schedule`); each line's output
  (every rank's) in a file of its own.
- A gpt-oss attention layer with titan_cp equals torchtitan's own (the log-sum-exp to its ``_apply_sinks``, under
  its causal, document and sliding-window mask mods), output and every gradient.
- titan_cp's Gated DeltaNet on packed rows equals torchtitan's own layer on each document alone (its forward
  and convolution, the recurrence token by token where fla's kernel was), output and every gradient; its
  state dict is torchtitan's. Without fla, torchtitan's Qwen3.5 imports with stand-ins that refuse to run
  and leave no fla module behind.
- The one-process attention equals torchtitan's own FlexAttention forward under its packed-document
  mask (the causal and packed-document mask mods of the same positions) within 1e-5.
- The page's python block: the ``with_titan_cp`` example makes a config function whose config runs
  titan_cp's attention (the GPU command's arguments load in tests/test_docs.py).
- Bad input gets one clear line: strategy / balance typos, a batch without positions or with images, CP with
  an attention or Gated DeltaNet titan_cp does not replace, another spmd backend, another torchtitan
  version, tensor parallel or too wide a Ulysses for Qwen3.5.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from tests.forked_launch import launch, step_logs

pytest.importorskip("torchtitan", reason="torchtitan 0.3 is in the dev extra (Python >= 3.11)")

from titan_cp.attention import CPHandle  # noqa: E402

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "torchtitan.md"
CPU_LAUNCHER = "titan_cp.integrations.torchtitan.train"


def _doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def _cpu_block(config: str) -> list[str]:
    """The command lines of the page's bash block that runs the CPU launcher on ``config`` (continuations joined)."""
    (block,) = (b for b in _doc_blocks("bash") if CPU_LAUNCHER in b and f"--config {config} " in b)
    return [line for line in re.sub(r"\\\n\s*", " ", block).splitlines() if line.strip()]


# Imported by the launch once, before it forks its ranks (tests/forked_launch.py): what torchtitan's
# trainer imports, and torchtitan itself behind the CPU launcher's shims (its prepare(): what each
# step's launcher would do first, done once; a step's run then starts from there, forked).
PRELOAD = [
    "titan_cp", "torch._inductor.compile_fx", "torch.distributed.fsdp", "torch.distributed.checkpoint",
    "torchdata.stateful_dataloader", "datasets", "tensorboard", f"{CPU_LAUNCHER}:prepare",
    "titan_cp.integrations.torchtitan.linear",  # torchtitan's Qwen3.5, after the CPU shims
]  # fmt: skip

# The door's mistakes, each added to the page's one-process run: (name, flags, what its one line names).
REFUSED = [
    ("kernel", ["--titan_cp.kernel", "bogus"], "--titan_cp.kernel 'bogus': unknown attention kernel"),
    ("strategy", ["--titan_cp.strategy", "rnig"], "--titan_cp.strategy 'rnig' .*did you mean 'ring'"),
    ("seq_len", ["--parallelism.context_parallel_degree", "3"],
     "--training.seq_len 256 is not a multiple of 6, as --parallelism.context_parallel_degree 3 needs"),
    ("hybrid", ["--parallelism.context_parallel_degree", "4", "--titan_cp.strategy", "hybrid",
                "--titan_cp.ulysses_degree", "3"],
     "--titan_cp.ulysses_degree 3 on --parallelism.context_parallel_degree 4: .*must divide"),
    ("pipeline", ["--parallelism.pipeline_parallel_degree", "2"], "--parallelism.pipeline_parallel_degree 2: "),
    ("backend", ["--parallelism.spmd_backend", "full_dtensor"], "set --parallelism.spmd_backend partial_dtensor"),
    ("validator", ["--validator.enable"], "drop --validator.enable"),
    ("world", ["--parallelism.context_parallel_degree", "2"],
     "world size 1 .*--parallelism.context_parallel_degree 2 .* must divide it"),
]  # fmt: skip


def _step(name: str, line: str, cwd: Path, *flags: str, status: int = 0) -> dict:
    """A launch step of one of the page's lines, run in ``cwd`` (``$PWD`` there) as written, with ``flags`` after
    it: ``torchrun --nproc-per-node N -m ...`` as a program on N processes, another line as a shell line."""
    line = line.replace("$PWD", str(cwd))
    argv = shlex.split(line)
    if argv[:2] != ["torchrun", "--nproc-per-node"]:
        assert not flags
        return dict(name=name, shell=line, status=status)
    return dict(name=name, argv=[*argv[3:], *flags], nproc=int(argv[2]), status=status)


def _dump_folder(step: dict) -> str | None:
    """The ``--dump_folder`` a program step writes (the last given; ``None`` for a shell line)."""
    argv = step.get("argv", [])
    return argv[len(argv) - argv[::-1].index("--dump_folder")] if "--dump_folder" in argv else None


# The launch's ranks: more than its largest run's 4, so that the blocks run side by side (:func:`_schedule`); an idle
# rank is a forked process waiting (its memory the launch's, shared).
LAUNCH_RANKS = 8


def _seconds(step: dict) -> float:
    """A rough guess of ``step``'s seconds on a busy 2-core machine, for :func:`_schedule`: a shell line or a refused
    run (parsing, then one line) next to nothing, a seed checkpoint one, a training run five."""
    argv = step.get("argv", [])
    if "shell" in step or step["status"] != 0:
        return 0.2
    return 1.0 if "--checkpoint.create_seed_checkpoint" in argv else 5.0


def _schedule(steps: list[dict], size: int) -> list[dict]:
    """``steps`` placed on the launch's ``size`` ranks, each waiting for the steps whose output it reads: those whose
    dump folder its line names, and the shell line that fills its own (a checkpoint copied in). The steps run side by
    side (a run's rank 0 sleeping 2 s after its last step, as torchtitan's does, loading or saving leave the cores to
    another): longest chain of waits first (by :func:`_seconds`), each step taking the consecutive ranks where it can
    start first, after what it reads and what those ranks run before it. A rank runs its steps in the plan's order,
    and a step waits only for earlier ones."""
    for i, step in enumerate(steps):
        line, own = step.get("shell") or " ".join(step["argv"]), _dump_folder(step)
        step["after"] = [
            before["name"] for before in steps[:i]
            if (_dump_folder(before) and f"{_dump_folder(before)}/" in line)
            or (own and "shell" in before and f"{own}/" in before["shell"])
        ]  # fmt: skip
    chain = {}  # a step's seconds and those of the longest chain of steps waiting for it
    for step in reversed(steps):
        waiting = [chain[later["name"]] for later in steps if step["name"] in later["after"]]
        chain[step["name"]] = _seconds(step) + max(waiting, default=0.0)
    steps = sorted(steps, key=lambda step: -chain[step["name"]])  # a step's chain outlasts those waiting for it
    free, ends = [0.0] * size, {}
    for step in steps:
        n = 1 if "shell" in step else step["nproc"]
        ready = max((ends[name] for name in step["after"]), default=0.0)
        start, first = min((max(ready, *free[r : r + n]), r) for r in range(size - n + 1))
        step["first_rank"], ends[step["name"]] = first, start + _seconds(step)
        free[first : first + n] = [ends[step["name"]]] * n
    return steps


def _launch(steps: list[dict], cwd: Path) -> tuple[dict[str, str], dict[str, str]]:
    """One launch of as many ranks as the largest step in ``cwd`` running ``steps`` (:func:`_schedule`:
    several at once), each in a fresh process; it must exit 0 (every step with its status). Each step's stdout and
    stderr, every rank's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("TITAN_CP_DEBUG", None)
    size, logs = max(LAUNCH_RANKS, *(step.get("nproc", 1) for step in steps)), cwd / "logs"
    logs.mkdir()
    plan = dict(preload=PRELOAD, steps=_schedule(steps, size), markers=str(cwd / "markers"), logs=str(logs))
    run = launch(size, plan, cwd / "plan.json", cwd, env)
    out, err = run.communicate(timeout=1200)
    outs, errs = step_logs(logs, [step["name"] for step in steps])
    failed = "\n".join(f"== {name}\n{errs[name][-3000:]}" for name in errs if "Traceback" in errs[name])
    assert run.returncode == 0, f"the launch exited {run.returncode}:\n{out[-2000:]}\n{err[-3000:]}\n{failed}"
    return outs, errs


def _scalars(dump: Path, tag: str) -> list[float]:
    """Every step's value of ``tag`` (``global_avg_loss``, ...), as torchtitan wrote it to TensorBoard (float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    (events,) = glob.glob(str(dump / "tb" / "**" / "events.*"), recursive=True)
    acc = EventAccumulator(events)
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


def _metrics(dump: Path) -> dict[str, list[float]]:
    tags = ("loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "n_tokens_seen")
    return {tag.rpartition("/")[2]: _scalars(dump, tag) for tag in tags}


def _check_refused(name: str, out: str, err: str, names: str) -> None:
    """The step's output: its one error line names the flag; no traceback; no model built."""
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and re.search(names, errors[0]), f"{name}: {errors}\n{err[-2000:]}"
    assert "Traceback" not in err and "Building" not in out, f"{name}:\n{out[-1000:]}\n{err[-2000:]}"


LLAMA_STEPS = ["seed", "one", "cp2", "copy", "resumed"]
QWEN35_STEPS = ["qwen35_seed", "qwen35_one", "qwen35_ring", "qwen35_ulysses", "qwen35_copy", "qwen35_resumed"]
GPT_OSS_STEPS = ["gpt_oss_seed", "gpt_oss_one", "gpt_oss_ring", "gpt_oss_ulysses"]
MOE_STEPS = ["moe_seed", "moe_ep2", "moe_ep2_cp2", "moe_copy", "moe_resumed"]
DEEPSEEK_STEPS = ["deepseek_seed", "deepseek_one", "deepseek_ring", "deepseek_ulysses"]
BLOCKS = [  # the page's CPU blocks after the Llama one: (config, step names)
    ("qwen35_debugmodel_cp", QWEN35_STEPS),
    ("gpt_oss_debugmodel_cp", GPT_OSS_STEPS),
    ("deepseek_v3_debugmodel_cp", DEEPSEEK_STEPS),
    ("qwen3_moe_debugmodel_cp", MOE_STEPS),
]


@pytest.fixture(scope="module")
def pages_runs(tmp_path_factory) -> tuple[Path, dict[str, str], dict[str, str]]:
    """The page's CPU blocks (Llama 3, the door's mistakes, then :data:`BLOCKS`: Qwen3.5, gpt-oss, expert parallel)
    in one launch of :data:`LAUNCH_RANKS` ranks in a temporary folder: that folder, and the launch's stdout and stderr
    by step."""
    cwd = tmp_path_factory.mktemp("torchtitan")
    llama = _cpu_block("llama3_debugmodel_cp")
    steps = [_step(name, line, cwd) for name, line in zip(LLAMA_STEPS, llama, strict=True)]
    steps += [
        _step(f"refused_{n}", llama[1], cwd, *flags, "--dump_folder", "refused", status=2) for n, flags, _ in REFUSED
    ]
    for config, names in BLOCKS:
        steps += [_step(name, line, cwd) for name, line in zip(names, _cpu_block(config), strict=True)]
    out, err = _launch(steps, cwd)
    return cwd, out, err


def test_the_pages_cpu_runs_equal_one_process_and_the_mistakes_are_one_line(pages_runs):
    seed, one, cp2, copy, resumed = _cpu_block("llama3_debugmodel_cp")
    assert "--checkpoint.create_seed_checkpoint" in seed and "--parallelism.context_parallel_degree 2" in cp2
    assert "--compile.enable" in cp2  # every block compiled (torchtitan's fullgraph) with titan_cp's attention
    assert copy.startswith("mkdir") and "ulysses" in resumed
    cwd, out, err = pages_runs
    outputs = cwd / "outputs"
    assert (outputs / "resumed" / "checkpoint" / "step-2").is_dir()
    assert "Training starts at step 3" in out["resumed"]
    single, under_cp, after = (_metrics(outputs / name) for name in ("one", "cp2", "resumed"))
    losses = single["global_avg_loss"]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0, losses  # four steps, and it trains
    assert single["global_max_loss"] == losses  # one process: its rows' mean is the average
    for key, values in single.items():
        assert under_cp[key] == pytest.approx(values, abs=1e-5), f"CP 2 ring, doc_local {key}: {under_cp[key]}"
    for key in ("global_avg_loss", "global_max_loss"):  # n_tokens_seen: torchtitan's train state is one rank's
        assert after[key] == pytest.approx(single[key][2:], abs=1e-5), f"resumed at CP 2 ulysses {key}: {after[key]}"
    assert "titan_cp: no context parallelism (CP 1)" in out["one"]
    assert out["cp2"].count("titan_cp: CP 2 (cp 2): ring attention, doc_local layout") == 1, out["cp2"][-3000:]
    assert out["resumed"].count("titan_cp: CP 2 (cp 2): ulysses attention, doc_zigzag layout") == 1
    assert len(re.findall(r"step:\s+1\s", out["cp2"])) == 1, "torchtitan's lines come once, not once per rank"
    for name, _, text in REFUSED:
        _check_refused(f"refused_{name}", out[f"refused_{name}"], err[f"refused_{name}"], text)


def test_qwen35_at_cp_2_ring_and_ulysses_gives_one_process_losses_and_resumes_at_cp_4(pages_runs):
    """torchtitan's Qwen3.5 (Gated DeltaNet layers through titan_cp's linear ops, gated attention through its
    attention), the page's Qwen3.5 block: one seed; CP 2 ring and CP 2 Ulysses equal one process, every step; the
    CP 2 ring run's step-2 checkpoint resumed at CP 4 (2 rings x Ulysses 2) equals its step 3. Within 1e-5
    relative: float32 reduction order, carried through AdamW at the debug recipe's lr 5e-3 (the page's figures)."""
    seed, one, ring, ulysses, copy, resumed = _cpu_block("qwen35_debugmodel_cp")
    assert "--checkpoint.interval 2" in ring and "qwen35_ring/checkpoint/step-2" in copy
    assert "--parallelism.context_parallel_degree 4" in resumed and "--nproc-per-node 4" in resumed
    cwd, out, _ = pages_runs
    outputs = cwd / "outputs"
    single, by_ring, by_ulysses, after = (
        _metrics(outputs / f"qwen35_{name}") for name in ("one", "ring", "ulysses", "resumed")
    )
    losses = single["global_avg_loss"]
    assert len(losses) == 3 and losses[-1] < losses[0] - 1.0, losses  # three steps, and it trains
    assert single["global_max_loss"] == losses
    for name, run in (("CP 2 ring", by_ring), ("CP 2 ulysses", by_ulysses)):
        assert run["n_tokens_seen"] == single["n_tokens_seen"], name
        for key in ("global_avg_loss", "global_max_loss"):
            assert run[key] == pytest.approx(single[key], rel=1e-5, abs=0), f"{name} {key}: {run[key]} vs {single[key]}"
    assert "Training starts at step 3" in out["qwen35_resumed"]
    for key in ("global_avg_loss", "global_max_loss"):
        assert after[key] == pytest.approx(by_ring[key][2:], rel=1e-5, abs=0), f"resumed at CP 4 {key}: {after[key]}"
    assert "titan_cp: CP 2 (cp 2): ring attention, doc_local layout" in out["qwen35_ring"]
    assert "titan_cp: CP 2 (cp 2): ulysses attention, doc_zigzag layout" in out["qwen35_ulysses"]
    assert "titan_cp: CP 4 (cp_ring 2 x cp_ulysses 2): hybrid attention, doc_zigzag layout" in out["qwen35_resumed"]


def _equal_moe_losses(got: dict[str, list[float]], want: dict[str, list[float]], name: str, first: int = 1) -> None:
    """``got``'s loss metrics equal ``want``'s (steps ``first``, ``first + 1``, ... of it), for a mixture of experts:
    step 1 (the seed's forward) within 1e-5 relative, later steps within 5e-5. torchtitan's experts compute in
    bfloat16 and route by top-k: a float32 difference of reduction order in a token's input rounds to a bfloat16 step
    at times, or tips a near tie of router scores to another expert, and AdamW's first step carries it: one process
    against itself with another attention kernel is up to 1.0e-5 off at step 2 (the page's gpt-oss section, which
    gives each seed's figures; the blocks fix the seed)."""
    for key in ("global_avg_loss", "global_max_loss"):
        values, wanted = got[key], want[key][first - 1 :]
        assert len(values) == len(wanted), f"{name} {key}: {values} vs {wanted}"
        for step, (value, target) in enumerate(zip(values, wanted), start=first):
            rel = 1e-5 if step == 1 else 5e-5
            assert value == pytest.approx(target, rel=rel, abs=0), f"{name} {key} step {step}: {values} vs {wanted}"


def _check_ring_and_ulysses_at_cp_2(pages_runs, config: str, prefix: str, drop: float) -> None:
    """A page's block of ``config`` (seed, one process, CP 2 ring, CP 2 Ulysses; dump folders ``outputs/<prefix>_*``):
    two steps whose loss falls by ``drop``, and the CP runs' tokens and losses those of one process
    (:func:`_equal_moe_losses`), each naming the CP that ran."""
    seed, one, ring, ulysses = _cpu_block(config)
    assert "--parallelism.context_parallel_degree 2 --titan_cp.strategy ring" in ring and "ulysses" in ulysses
    cwd, out, _ = pages_runs
    single, by_ring, by_ulysses = (
        _metrics(cwd / "outputs" / f"{prefix}_{name}") for name in ("one", "ring", "ulysses")
    )
    losses = single["global_avg_loss"]
    assert len(losses) == 2 and losses[1] < losses[0] - drop, losses  # two steps, and it trains
    for name, run in (("CP 2 ring", by_ring), ("CP 2 ulysses", by_ulysses)):
        assert run["n_tokens_seen"] == single["n_tokens_seen"], name
        _equal_moe_losses(run, single, name)
    assert "titan_cp: CP 2 (cp 2): ring attention, doc_local layout" in out[f"{prefix}_ring"]
    assert "titan_cp: CP 2 (cp 2): ulysses attention, doc_zigzag layout" in out[f"{prefix}_ulysses"]


def test_gpt_oss_at_cp_2_ring_and_ulysses_gives_one_process_losses(pages_runs):
    """torchtitan's gpt-oss (sliding windows on alternate layers, sinks run inside titan_cp's op), the page's gpt-oss
    block: one seed; CP 2 ring and CP 2 Ulysses give the one-process run's losses at both steps
    (:func:`_equal_moe_losses`)."""
    _check_ring_and_ulysses_at_cp_2(pages_runs, "gpt_oss_debugmodel_cp", "gpt_oss", drop=1.0)


def test_deepseek_v3_mla_at_cp_2_ring_and_ulysses_gives_one_process_losses(pages_runs):
    """torchtitan's DeepSeek V3 (multi-head latent attention: q/k of 192, v of 128), the page's block: one seed; CP 2
    ring and CP 2 Ulysses give the one-process run's losses at both steps (:func:`_equal_moe_losses`)."""
    _check_ring_and_ulysses_at_cp_2(pages_runs, "deepseek_v3_debugmodel_cp", "deepseek", drop=0.5)


def test_expert_parallel_beside_cp_gives_eps_losses_and_resumes_on_another_shape(pages_runs):
    """torchtitan's expert parallelism with titan_cp's CP, the page's block (Qwen3 MoE): EP 2 x CP 2 (4 processes:
    dp 2 x cp 2, each ring's cp ranks sharing their experts) gives EP 2's losses (2 processes: dp 2) at both steps
    (:func:`_equal_moe_losses`), so the attention and dense layers kept their CP beside EP; its step-1 checkpoint
    resumed at EP 4 x CP 2 Ulysses gives its step 2."""
    seed, ep2, ep2_cp2, copy, resumed = _cpu_block("qwen3_moe_debugmodel_cp")
    assert "--parallelism.expert_parallel_degree 2" in ep2 and "context_parallel" not in ep2
    assert "--parallelism.expert_parallel_degree 2" in ep2_cp2 and "--parallelism.context_parallel_degree 2" in ep2_cp2
    assert "--parallelism.expert_parallel_degree 4" in resumed and "moe_ep2_cp2/checkpoint/step-1" in copy
    cwd, out, _ = pages_runs
    without_cp, with_cp, after = (_metrics(cwd / "outputs" / f"moe_{name}") for name in ("ep2", "ep2_cp2", "resumed"))
    losses = without_cp["global_avg_loss"]
    assert len(losses) == 2 and losses[1] < losses[0] - 0.5, losses
    assert without_cp["global_max_loss"] != losses  # dp 2: the larger rank's mean
    assert with_cp["n_tokens_seen"] == without_cp["n_tokens_seen"]
    _equal_moe_losses(with_cp, without_cp, "EP 2 x CP 2")
    _equal_moe_losses(after, with_cp, "resumed at EP 4 x CP 2", first=2)
    assert "Training starts at step 2" in out["moe_resumed"]
    for name, ep, cp in (("moe_ep2", 2, 1), ("moe_ep2_cp2", 2, 2), ("moe_resumed", 4, 2)):
        assert f"cp={cp}, tp=1, ep={ep}" in out[name], out[name][-2000:]
    assert "titan_cp: CP 2 (cp 2): ring attention, doc_local layout" in out["moe_ep2_cp2"]
    assert "titan_cp: CP 2 (cp 2): ulysses attention, doc_zigzag layout" in out["moe_resumed"]


def test_the_pages_recipe_puts_titan_cp_in_every_layer():
    from titan_cp.integrations.torchtitan import TitanCPAttention  # noqa: PLC0415

    (recipe,) = _doc_blocks("python")
    names: dict = {}
    exec(recipe, names)
    config = names["llama3_8b_cp"]()
    assert (config.titan_cp.strategy, config.titan_cp.balance) == ("ulysses", "doc_zigzag")
    attentions = [layer.attention.inner_attention for layer in config.model_spec.model.layers]
    assert len(attentions) == 32 and all(isinstance(a, TitanCPAttention.Config) for a in attentions)


def _packed_positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def test_one_process_attention_equals_torchtitans_flex_document_mask():
    """What torchtitan's Decoder builds for FlexAttention (causal and its packed-document mask mod of the
    positions), run by PyTorch's flex_attention, is what TitanCPAttention computes (GQA: 8 heads, 2 KV)."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention  # noqa: PLC0415
    from torchtitan.models.common.attention import (  # noqa: PLC0415
        get_causal_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
    )

    from titan_cp.integrations.torchtitan import TitanCPAttention, shard_by_documents  # noqa: PLC0415
    from titan_cp.layout import DEFAULT_BALANCE  # noqa: PLC0415

    positions = _packed_positions([[5, 17, 3, 39], [64]])
    b, s = positions.shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, n, 16, generator=g) for n in (8, 2, 2))  # (B, L, N, H), torchtitan's order
    tokens = torch.zeros(b, s, dtype=torch.int64)
    doc_lens = shard_by_documents(tokens, tokens, positions, CPHandle(None, balance=DEFAULT_BALANCE)).doc_lens
    assert doc_lens.tolist() == [[5, 17, 3, 39], [64, 0, 0, 0]]
    ours = TitanCPAttention.Config().build()(q, k, v, attention_masks=doc_lens, scale=None, enable_gqa=True)
    mask_mod = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    block_mask = create_block_mask(mask_mod, b, None, s, s, device="cpu")
    flex = flex_attention(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(ours, flex.transpose(1, 2), atol=1e-5, rtol=0)
    causal = create_block_mask(get_causal_mask_mod(), b, None, s, s, device="cpu")
    across = flex_attention(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=causal, enable_gqa=True)
    assert not torch.allclose(ours, across.transpose(1, 2), atol=1e-3)  # the documents matter in this batch


class _DenseSinksReference(torch.nn.Module):
    """torchtitan's inner-attention call computed densely: ``softmax(q k^T scale)`` under a ``(B, L, L)`` boolean mask
    (``attention_masks``), its log-sum-exp handed to the layer's ``out_transform`` (gpt-oss: the sinks), as
    torchtitan's flex and varlen attentions do on a GPU (flex has no backward on a CPU)."""

    def forward(self, q, k, v, *, attention_masks, scale, enable_gqa, out_transform):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~attention_masks[:, None], float("-inf"))
        lse = scores.logsumexp(-1)
        out = (scores - lse[..., None]).exp() @ v
        return out_transform(out.transpose(1, 2), lse.transpose(1, 2))


def test_gpt_oss_attention_is_torchtitans_sinks_and_window_on_one_process():
    """A gpt-oss attention layer with titan_cp (TitanCPGptOssAttention: the window and the sinks inside titan_cp's op)
    equals torchtitan's layer whose inner attention returns the log-sum-exp to its _apply_sinks, under torchtitan's
    causal, packed-document and sliding-window mask mods (the debug model's layer 0: window 128, 64 query and 8 KV
    heads, YaRN's scale): output and every gradient (x, the sinks, the projections) within 1e-5 of their size."""
    from torch.nn.attention.flex_attention import and_masks  # noqa: PLC0415
    from torchtitan.models.common.attention import (  # noqa: PLC0415
        get_causal_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
        get_sliding_window_mask_mod,
    )
    from torchtitan.models.gpt_oss.model import Attention  # noqa: PLC0415

    from titan_cp.integrations.torchtitan import gpt_oss_debugmodel_cp, shard_by_documents  # noqa: PLC0415
    from titan_cp.integrations.torchtitan.gpt_oss import TitanCPGptOssAttention  # noqa: PLC0415

    layers = gpt_oss_debugmodel_cp().model_spec.model.layers
    assert [layer.attention.inner_attention.window for layer in layers] == [128, None, 128, None]
    config = layers[0].attention
    torch.manual_seed(0)
    ours = config.build()
    assert isinstance(ours, TitanCPGptOssAttention)
    ours.init_states()
    with torch.no_grad():
        ours.sinks.normal_()
    theirs = Attention.Config(**{f.name: getattr(config, f.name) for f in fields(config)}).build()
    theirs.load_state_dict(ours.state_dict())
    theirs.inner_attention = _DenseSinksReference()  # torchtitan's layer, forward and _apply_sinks

    positions = _packed_positions([[150, 60, 46]])  # a document past the window
    b, s = positions.shape
    rows, q_idx, kv_idx = torch.meshgrid(torch.arange(b), torch.arange(s), torch.arange(s), indexing="ij")
    documents = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    without_window = documents(rows, torch.zeros_like(rows), q_idx, kv_idx)  # (B, L, L): may q see kv
    window = get_sliding_window_mask_mod(config.sliding_window_size)
    mask = and_masks(documents, window)(rows, torch.zeros_like(rows), q_idx, kv_idx)
    doc_lens = shard_by_documents(positions, positions, positions, CPHandle(None)).doc_lens
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(b, s, config.dim, generator=g), torch.randn(b, s, config.dim, generator=g)

    def run(layer, masks) -> list[torch.Tensor]:
        xs = x.clone().requires_grad_()
        out = layer(xs, masks, positions)
        return [out, *torch.autograd.grad((out * weight).sum(), [xs, *layer.parameters()])]

    names = ["out", "x", *(n for n, _ in ours.named_parameters())]
    assert "sinks" in names
    got = run(ours, doc_lens)
    for name, value, want in zip(names, got, run(theirs, mask), strict=True):
        torch.testing.assert_close(
            value, want, atol=1e-5 * want.abs().max().item(), rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    with torch.no_grad():  # no sinks, then no window: each not what titan_cp computed
        theirs.sinks.fill_(-1e4)
        assert not torch.allclose(theirs(x, mask, positions), got[0], atol=1e-3)
        theirs.sinks.copy_(ours.sinks)
        assert not torch.allclose(theirs(x, without_window, positions), got[0], atol=1e-3)


def test_the_debug_configs_data_are_packed_documents_from_the_repository():
    """llama3_debugmodel_cp reads the repository's tokenizer and documents (no network); its 256-token rows
    hold several documents each, which doc_local at CP 2 places by document (not in halves)."""
    from titan_cp.integrations.torchtitan import ASSETS, llama3_debugmodel_cp, shard_by_documents  # noqa: PLC0415
    from titan_cp.layout import get_layout  # noqa: PLC0415

    config = llama3_debugmodel_cp()
    assert Path(config.hf_assets_path) == ASSETS / "tokenizer" and ASSETS.is_relative_to(ROOT)
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=256, local_batch_size=2)
    batch, labels = next(iter(loader))
    local = shard_by_documents(batch["input"], labels, batch["positions"], CPHandle(None, balance="doc_local"))
    rows = [[n for n in row if n] for row in local.doc_lens.tolist()]
    assert all(len(row) >= 2 for row in rows), rows
    index = get_layout(256, 2, "doc_local", rows).index(0).expand(2, 128)  # rank 0's tokens of each row
    assert any(not torch.equal(row, torch.arange(128)) for row in index), "doc_local cut the rows in halves"


def test_bad_input_gets_one_clear_line(monkeypatch):
    from types import SimpleNamespace  # noqa: PLC0415

    import torchtitan  # noqa: PLC0415
    from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: PLC0415

    import titan_cp.integrations.torchtitan as tt  # noqa: PLC0415

    with pytest.raises(ValueError, match=r"--titan_cp.strategy 'rnig'.*strategies; did you mean 'ring'"):
        tt.TitanCPConfig(strategy="rnig").check()
    with pytest.raises(ValueError, match=r"--titan_cp.balance 'doc_locl'.*did you mean 'doc_local'"):
        tt.TitanCPConfig(balance="doc_locl").check()
    with pytest.raises(ValueError, match=r"'hybrid' takes a --titan_cp.ulysses_degree of 2 or more, got .* 1"):
        tt.TitanCPConfig(strategy="hybrid").check()
    with pytest.raises(ValueError, match=r"'ring' takes none, got --titan_cp.ulysses_degree 2"):
        tt.TitanCPConfig(strategy="ring", ulysses_degree=2).check()
    with pytest.raises(ValueError, match=r"did you mean 'ulysses'"):
        tt.with_titan_cp(llama3_debugmodel, strategy="ulyses")

    def another_attention():  # an attention kind titan_cp does not know
        config = llama3_debugmodel()
        config.model_spec.model.layers[0].attention = SimpleNamespace(n_heads=8)
        return config

    with pytest.raises(
        ValueError, match=r"with_titan_cp runs .*MLA.*; layer 0 has SimpleNamespace, which titan_cp does"
    ):
        tt.with_titan_cp(another_attention)()
    with pytest.raises(
        ValueError, match="got an out_transform of the attention's log-sum-exp, which it does not return"
    ):
        q = torch.randn(1, 8, 2, 4)
        tt.TitanCPAttention.Config().build()(q, q, q, attention_masks=torch.tensor([[8]]), out_transform=torch.mul)

    trainer = SimpleNamespace(cp=CPHandle(None), config=tt.llama3_debugmodel_cp())
    tokens = torch.zeros(1, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="the dataloader must yield .*'positions'"):
        tt.TitanCPTrainer.post_dataloading_process(trainer, {"input": tokens}, tokens)
    with pytest.raises(ValueError, match="positions do not describe packed documents"):
        tt.TitanCPTrainer.post_dataloading_process(trainer, {"input": tokens, "positions": tokens + 3}, tokens)

    with pytest.raises(ValueError, match="not the documents tensor that titan_cp's Trainer makes"):
        q = torch.randn(1, 8, 2, 4)
        tt.TitanCPAttention.Config().build()(q, q, q, attention_masks=None)

    with torch.device("meta"):
        flex_model = llama3_debugmodel().model_spec.model.build()
    with pytest.raises(
        ValueError, match=r"linear-attention layer titan_cp does not replace: \['layers.0.attention.inner_attention"
    ):
        tt.apply_titan_cp(flex_model, CPHandle(None))
    from titan_cp.integrations.torchtitan.without_fla import import_qwen35  # noqa: PLC0415

    with torch.device("meta"):  # torchtitan's own Qwen3.5: its Gated DeltaNet would run each shard alone
        qwen35 = import_qwen35().model_registry("debugmodel").model.build()
    with pytest.raises(ValueError, match=r"does not replace: .*'layers.0.attn \(GatedDeltaNet\)'"):
        tt.apply_titan_cp(qwen35, CPHandle(None))
    positions = torch.arange(8)[None]
    with pytest.raises(ValueError, match=r"the batch holds \['pixel_values'\] besides input and positions"):
        batch = {"input": tokens, "positions": positions, "pixel_values": torch.zeros(1, 4)}
        tt.TitanCPTrainer.post_dataloading_process(trainer, batch, tokens)
    with pytest.raises(ValueError, match="TitanCPGatedDeltaNet has no CP handle: build the run with"):
        layer = tt.qwen35_debugmodel_cp().model_spec.model.layers[0].delta_net.build()
        layer(torch.zeros(1, 8, 256), torch.tensor([[8]]))

    config = tt.llama3_debugmodel_cp()
    config.parallelism.spmd_backend = "spmd_types"
    with pytest.raises(ValueError, match="set --parallelism.spmd_backend partial_dtensor"):
        tt.TitanCPTrainer(config)
    config = tt.llama3_debugmodel_cp()
    config.validator.enable = True
    with pytest.raises(ValueError, match="does not run torchtitan's validator yet.*drop --validator.enable"):
        tt.TitanCPTrainer(config)

    config = tt.llama3_debugmodel_cp()
    config.parallelism.pipeline_parallel_degree = 2
    if not tt.trainer._schedules_take_microbatch_lists():  # torchtitan 0.3's PP on this torch: refused, naming why
        with pytest.raises(ValueError, match=r"step\(arg_mbs=\.\.\., kwarg_mbs=\.\.\.\).*drop it"):
            tt.TitanCPTrainer(config)

    monkeypatch.setattr(torchtitan, "__version__", "0.2.0")
    with pytest.raises(RuntimeError, match=r"written for torchtitan 0\.3\.0, but torchtitan 0\.2\.0 is installed"):
        tt.check_version()


def test_the_run_is_checked_against_torchtitans_settings_when_built():
    """Parsed with torchtitan's own command line, a run titan_cp cannot run is a config (torchtitan's checks wait:
    they would name another cause first, in their parser's box), refused by check_run naming the flag."""
    from torchtitan.config import ConfigManager  # noqa: PLC0415

    import titan_cp.integrations.torchtitan as tt  # noqa: PLC0415

    base = ["--module", "titan_cp.integrations.torchtitan", "--config", "llama3_debugmodel_cp"]

    def refusal(*flags: str) -> str:
        config = ConfigManager().parse_args([*base, *flags])
        with pytest.raises(ValueError) as refused:
            tt.check_run(config)
        return str(refused.value)

    tt.check_run(ConfigManager().parse_args([*base, "--parallelism.context_parallel_degree", "4"]))
    cp3 = ["--parallelism.context_parallel_degree", "3"]
    assert refusal(*cp3, "--titan_cp.strategy", "ulysses") == (
        "--titan_cp.strategy ulysses on --parallelism.context_parallel_degree 3: ulysses needs the query heads (16) "
        "to be divisible by its cp size (3)"
    )
    tp2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
    assert refusal(*tp2, "--training.seq_len", "2052").startswith(
        "--training.seq_len 2052 is not a multiple of 8, as --parallelism.context_parallel_degree 2 needs "
        "(torchtitan's Trainer: 2 x CP x TP = 8"
    )
    assert refusal("--titan_cp.kernel", "flash_atn").startswith(
        "--titan_cp.kernel 'flash_atn': unknown attention kernel"
    )
    if not tt.trainer._schedules_take_microbatch_lists():  # before torchtitan's own "CUDA graphs" refusal of PP
        assert refusal("--parallelism.pipeline_parallel_degree", "2").startswith(
            "--parallelism.pipeline_parallel_degree 2: torchtitan 0.3's pipeline step"
        )
    base[-1] = "qwen35_debugmodel_cp"  # Qwen3.5: Ulysses splits its attention layers' 4 query heads; no TP yet
    tt.check_run(
        ConfigManager().parse_args(
            [*base, "--parallelism.context_parallel_degree", "4", "--titan_cp.strategy", "ulysses"]
        )
    )
    assert refusal("--parallelism.context_parallel_degree", "8", "--titan_cp.strategy", "ulysses") == (
        "--titan_cp.strategy ulysses on --parallelism.context_parallel_degree 8: ulysses needs the query heads (4) "
        "to be divisible by its cp size (8)"
    )
    assert refusal("--parallelism.tensor_parallel_degree", "2").startswith(
        "--parallelism.tensor_parallel_degree 2: titan_cp's Gated DeltaNet layers (Qwen3.5) do not run under "
        "torchtitan's tensor parallelism yet"
    )
    from titan_cp.integrations.torchtitan.planning import read_run  # noqa: PLC0415

    shapes = read_run("titan_cp.integrations.torchtitan", "qwen35_9b_cp", []).shapes  # planned as a hybrid
    assert shapes.linear is not None and len(shapes.linear_layers) == 24  # (tests/test_plan_hybrid.py)


def test_every_layer_reads_the_one_handle():
    """The CP step binds the run's one handle to every layer (on one cp rank too: its kernel runs there); an
    unbound parallelize function is refused."""
    from types import SimpleNamespace  # noqa: PLC0415

    import titan_cp.integrations.torchtitan as tt  # noqa: PLC0415

    spec = tt.llama3_debugmodel_cp().model_spec
    model = spec.model.build()
    seen = []
    parallelize = tt.TitanCPParallelize(lambda m, **kw: seen.append(kw["parallel_dims"]) or m)
    one_rank = SimpleNamespace(cp_enabled=False)
    with pytest.raises(ValueError, match="TitanCPParallelize has no CP handle: build the run with .*TitanCPTrainer"):
        parallelize(model, parallel_dims=one_rank, parallelism=None)
    handle = CPHandle(None, "ulysses", "doc_zigzag", kernel="cuda_flash")
    assert parallelize.bound(handle)(model, parallel_dims=one_rank, parallelism=None) is model and seen == [one_rank]
    layers = [m for m in model.modules() if isinstance(m, tt.TitanCPAttention)]
    assert len(layers) == 6 and all(layer.cp is handle for layer in layers)
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="attention kernel 'cuda_flash' runs on cuda"):  # the handle's kernel runs
        layers[0](q, q, q, attention_masks=torch.tensor([[8]]))


def _titan_cp_layers(model_config) -> list[str]:
    """What runs each layer of torchtitan's model config: ``attention`` (titan_cp's inner attention), ``linear``
    (titan_cp's Gated DeltaNet and its kernel), or ``torchtitan`` (not titan_cp's)."""
    from titan_cp.integrations.torchtitan import TitanCPAttention, TitanCPGatedDeltaKernel, TitanCPGatedDeltaNet  # noqa: PLC0415

    kinds = []
    for layer in model_config.layers:
        attention, linear = getattr(layer, "attention", None), getattr(layer, "delta_net", None)
        if isinstance(getattr(attention, "inner_attention", None), TitanCPAttention.Config):
            kinds.append("attention")
        elif isinstance(linear, TitanCPGatedDeltaNet.Config) and isinstance(
            linear.kernel, TitanCPGatedDeltaKernel.Config
        ):
            kinds.append("linear")
        else:
            kinds.append("torchtitan")
    return kinds


@pytest.mark.parametrize(
    "name, layers, seq_len",
    [
        ("llama3_debugmodel_cp", ["attention"] * 6, 2048),
        ("qwen3_debugmodel_cp", ["attention"] * 8, 2048),
        ("llama3_8b_cp", ["attention"] * 32, 131072),
        ("qwen35_debugmodel_cp", ["linear", "linear", "linear", "attention"], 256),
        ("gpt_oss_debugmodel_cp", ["attention"] * 4, 256),
        ("qwen3_moe_debugmodel_cp", ["attention"] * 2, 256),
        ("deepseek_v3_debugmodel_cp", ["attention"] * 3, 256),
        ("deepseek_v3_16b_cp", ["attention"] * 27, 131072),
        ("deepseek_v3_671b_cp", ["attention"] * 61, 131072),
        ("qwen35_9b_cp", ["linear", "linear", "linear", "attention"] * 8, 131072),
    ],
)
def test_each_config_function_loads_with_titan_cp_in_every_layer(name, layers, seq_len):
    from torchtitan.config import ConfigManager  # noqa: PLC0415

    from titan_cp.integrations.torchtitan import TitanCPParallelize  # noqa: PLC0415

    config = ConfigManager().parse_args(["--module", "titan_cp.integrations.torchtitan", "--config", name])
    assert _titan_cp_layers(config.model_spec.model) == layers
    assert isinstance(config.model_spec.parallelize_fn, TitanCPParallelize)
    assert config.training.seq_len == seq_len and config.parallelism.spmd_backend == "partial_dtensor"


# ---------------------------------------------------------------------------- Qwen3.5's Gated DeltaNet
def test_torchtitans_qwen35_imports_without_fla_whose_names_refuse_to_run():
    """Where fla is absent torchtitan's Qwen3.5 imports with stand-ins that raise, naming fla, and that leave no
    fla module behind (transformers would take one for fla's kernels)."""
    import importlib.util  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from titan_cp.integrations.torchtitan.without_fla import fla_installed, import_qwen35  # noqa: PLC0415

    if fla_installed():
        pytest.skip("fla is installed here: torchtitan imports it, nothing is stood in")
    model = import_qwen35("torchtitan.models.qwen3_5.model")
    assert not [m for m in sys.modules if m.split(".")[0] == "fla"] and importlib.util.find_spec("fla") is None
    with pytest.raises(RuntimeError, match=r"fla.chunk_gated_delta_rule is not installed here: .*with_titan_cp"):
        model._fla_chunk_gated_delta_rule(None)
    with pytest.raises(RuntimeError, match=r"fla.ChunkGatedDeltaRuleFunction is not installed here"):
        model.ChunkGatedDeltaRuleFunction.apply(torch.zeros(1))


class _TokenByToken(torch.nn.Module):
    """torchtitan's GatedDeltaKernel call, run one token at a time (tests/reference.py) where fla's kernel was."""

    def forward(self, q, k, v, g, beta, *, cu_seqlens=None, cu_seqlens_cpu=None):
        from tests.reference import reference_gated_delta  # noqa: PLC0415

        assert cu_seqlens is None, "each document alone: no offsets"
        return reference_gated_delta(q, k, v, g, beta, qk_l2norm=True)


def test_qwen35_gated_deltanet_is_torchtitans_layer_on_each_document_alone():
    """titan_cp's Gated DeltaNet (its convolutions and gated delta rule, on one cp rank) on rows of packed
    documents equals torchtitan's own GatedDeltaNet run on each document alone (its forward and pure-torch
    convolution, the recurrence token by token where fla's kernel was): output and every gradient, in float64
    (torchtitan computes the decay g in float32: hence 1e-6). Parameter names and shapes are torchtitan's."""
    from titan_cp.integrations.torchtitan.linear import TitanCPGatedDeltaNet, use_titan_cp_linear  # noqa: PLC0415
    from titan_cp.integrations.torchtitan.trainer import shard_by_documents  # noqa: PLC0415
    from titan_cp.integrations.torchtitan.without_fla import import_qwen35  # noqa: PLC0415

    model_config = import_qwen35().model_registry("debugmodel").model
    torch.manual_seed(0)
    theirs = model_config.layers[0].delta_net.build()
    theirs.init_states()
    theirs.kernel = _TokenByToken()
    use_titan_cp_linear(model_config)
    ours = model_config.layers[0].delta_net.build()
    assert isinstance(ours, TitanCPGatedDeltaNet)
    state = theirs.state_dict()
    assert ours.state_dict().keys() == state.keys() and ours.load_state_dict(state, strict=True)
    theirs.double(), ours.double()
    ours.bind_cp(CPHandle(None))

    rows = [[5, 20, 23], [48]]
    positions = _packed_positions(rows)
    x = torch.randn(2, 48, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    doc_lens = shard_by_documents(positions, positions, positions, CPHandle(None)).doc_lens
    weight = torch.randn(2, 48, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def run(layer, each_alone: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        xs = x.clone().requires_grad_()
        if each_alone:
            ends = [list(torch.tensor(row).cumsum(0)) for row in rows]
            out = torch.stack([
                torch.cat([layer(xs[b : b + 1, int(e - n) : int(e)])[0] for n, e in zip(row, ends[b])])
                for b, row in enumerate(rows)
            ])  # fmt: skip
        else:
            out = layer(xs, doc_lens)
        grads = torch.autograd.grad((out * weight).sum(), [xs, *layer.parameters()])
        return out, list(grads)

    (want, want_grads), (got, got_grads) = run(theirs, True), run(ours, False)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    names = ["x", *(n for n, _ in ours.named_parameters())]
    assert names[1:] == [n for n, _ in theirs.named_parameters()]
    for name, g, w in zip(names, got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    across = ours(x, torch.tensor([[48], [48]]))  # each row one document
    assert not torch.allclose(across, want, atol=1e-3)  # the documents matter in this batch
