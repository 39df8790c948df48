"""Planning a torchtitan 0.3 run: ``python -m titan_cp.plan --module M --config F --ngpu N [torchtitan's overrides]``.

The config function's ``Trainer.Config`` (:mod:`titan_cp.integrations.torchtitan.planning` reads it) is
planned as a torchtitan 0.2 TOML is: its training, parallelism, activation checkpointing and
``titan_cp`` section become the config keys of the plan (``load_config``), and its model's shapes
the :class:`~titan_cp.plan.search.GivenModel`. What differs is what torchtitan's Trainer runs with
titan_cp's CP: its strategies (hybrid on torchtitan's cp axis split in two), no pipeline meshes (not run yet), its
expert parallelism for a model with experts (each degree torchtitan takes, :func:`~titan_cp.plan.moe.ep_degrees`;
without TP beside experts or MLA, which titan_cp's CP has not run under torchtitan yet), and of the
options the planner turns on when nothing fits, full activation checkpointing alone (the others are
titan_cp's own trainer's). The recommended plan's command is torchtitan's own launcher with its flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan_cp.config import load_config
from titan_cp.plan.problem import Candidate
from titan_cp.plan.search import GivenModel

if TYPE_CHECKING:
    from titan_cp.config import JobConfig
    from titan_cp.integrations.torchtitan.planning import PlannedRun
    from titan_cp.plan.search import Estimate

NOTHING_FITS = (
    "nothing fits, even with full activation checkpointing (the host offloads and the tiled feed-forward the "
    "planner adds otherwise are titan_cp's own trainer's): raise cp or tp, or shorten rows"
)
INSTALL = "pip install -e '.[torchtitan]' (torchtitan 0.3.0; Python 3.11 or newer)"


def _integration() -> None:
    """``ValueError`` (one line) when torchtitan is not installed, or is not the tested version."""
    from titan_cp.integrations import torchtitan  # noqa: PLC0415 - imports nothing of torchtitan itself

    try:
        torchtitan.check_version()
    except ImportError:
        raise ValueError(
            f"--module/--config plans a torchtitan 0.3 config function, and torchtitan is not installed: {INSTALL}"
        ) from None
    except RuntimeError as e:
        raise ValueError(str(e)) from None


@dataclass(frozen=True)
class TorchtitanPlan:
    """What :func:`read` makes of a torchtitan run: the titan_cp ``job_config`` of its keys, the ``given``
    model and trainer, and the ``run`` itself (module, config function, for the launch lines)."""

    job_config: JobConfig
    given: GivenModel
    run: PlannedRun


def read(module: str, config: str, args: list[str]) -> TorchtitanPlan:
    """The plan's input for torchtitan's ``--module module --config config`` with its own overrides ``args``."""
    _integration()
    from titan_cp.integrations.torchtitan import planning  # noqa: PLC0415 - torchtitan checked first

    run = planning.read_run(module, config, args)

    shapes = run.shapes
    tp_runs = shapes.linear is None and shapes.mla is None and shapes.moe is None

    def runs(c: Candidate) -> bool:  # Gated DeltaNet, MLA and experts not run under torchtitan's TP with titan_cp's CP
        pipeline = c.pp == 1 or planning.BUILDS_PIPELINE
        return pipeline and (c.tp == 1 or tp_runs) and (c.cp == 1 or planning.runs_strategy(c.strategy))

    experts = shapes.moe is not None
    given = GivenModel(shapes, run.label, runs, 1, NOTHING_FITS, experts, run.ep if experts else 1)
    return TorchtitanPlan(load_config(list(run.keys), warn_adjustments=False), given, run)


def flags(e: Estimate, run: PlannedRun) -> str:
    """torchtitan's command-line flags of ``e``'s mesh and strategy (its expert-parallel degree for a model with
    experts, and ``--training.disable_cuda_graphs`` beside EP where the run has CUDA graphs on: torchtitan refuses
    them with EP's all-to-all dispatcher), and ``activation_checkpoint:full`` (its subcommand) where the run has
    none and the plan turned it on."""
    c = e.candidate
    out = (
        f"--parallelism.data_parallel_replicate_degree {c.dp_replicate} "
        f"--parallelism.data_parallel_shard_degree {c.dp_shard} --parallelism.context_parallel_degree {c.cp} "
        f"--parallelism.tensor_parallel_degree {c.tp} --parallelism.pipeline_parallel_degree {c.pp}"
    )
    if run.shapes.moe is not None:
        out += f" --parallelism.expert_parallel_degree {c.ep}"
        out += " --training.disable_cuda_graphs" * (c.ep > 1 and run.cuda_graphs)
    if c.cp > 1:
        out += f" --titan_cp.strategy {c.strategy}"
        if c.attention.takes_ulysses_degree():
            out += f" --titan_cp.ulysses_degree {c.ulysses}"
    if e.workload.ac == "full" and run.ac == "none":  # turned on because nothing fitted without
        out += " activation_checkpoint:full"
    return out


CPU_LAUNCHER = "titan_cp.integrations.torchtitan.train"  # torchtitan's launcher plus what it lacks on a CPU


def launch_lines(e: Estimate, ngpu: int, nnodes: int, run: PlannedRun) -> list[str]:
    """torchtitan's launcher, unmodified, running ``e`` on ``nnodes`` nodes of ``ngpu // nnodes`` GPUs (on
    ``--gpu cpu``: :data:`CPU_LAUNCHER`, the same arguments)."""
    per_node = ngpu // nnodes
    launcher = CPU_LAUNCHER if e.device.name == "cpu" else "torchtitan.train"
    command = f"-m {launcher} --module {run.module} --config {run.config} {flags(e, run)}"
    if nnodes == 1:
        return [f"torchrun --standalone --nproc-per-node {per_node} {command}"]
    return [
        f"torchrun --nnodes {nnodes} --nproc-per-node {per_node} --rdzv-backend c10d "
        f"--rdzv-endpoint $HEAD_NODE:29500 --rdzv-id $JOB_ID {command}"
    ]
