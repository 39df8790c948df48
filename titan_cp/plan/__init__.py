"""The planner: which mesh and CP strategy to run, before spending a GPU-hour.

    python -m titan_cp.plan --job.config_file X.toml --ngpu 8 [--gpu h100|h200|a100|cpu]
        [--nnodes N] [--doc-mix NAME] [--hbm-gb G] [--matmul-speedup F] [--plot out.png | FOLDER] [--all]
        [--section.key value ...]          # any config key, as in the trainer

For the config's model, ``training.seq_len``, ``training.local_batch_size``, activation
checkpointing, compute dtype and pipeline schedule, it enumerates every mesh ``pp x
dp_replicate x dp_shard x cp x tp`` of ``--ngpu`` GPUs on whole nodes, and every CP strategy for
it (each registered strategy the heads allow; hybrid with each Ulysses degree), keeps the plans
the trainer's own checks take, estimates those that can be the recommended one, and prints one
JSON line and one table row per estimate, the recommended one first, and what it did not estimate.
Nothing runs on a GPU.

The parts:

    devices    Device constants with their sources; a bandwidth per link kind (intra / inter)
    kernels    the attention kernel's measured throughput per sequence length (FlashAttention-2, H100)
    memory     one memory model: saved bytes per token, parameters per stage, a step's peak, a rank's total
    problem    Workload (model, rows, AC, dtype, pipeline) and Candidate (mesh + strategy)
    cost       compute, transfers and the ring's per-step exposure, as frozen dataclasses; a step's lower bound
    checks     a plan's config keys, put through the trainer's own checks
    search     the plans the trainer runs, the estimates that can matter, the recommendation
    published  torchtitan's published runs as data, and the planner's estimate of each
    cli        the command line
"""

from titan_cp.plan.cli import launch_lines, main, overrides, plot_path, record
from titan_cp.plan.cost import TITAN_CP_RING, TORCH_2024_RING, Cost, RingImpl, Stack, Transfer, cp_bytes_per_rank
from titan_cp.plan.devices import GB, GPUS, HEADROOM, INTER, INTRA, Device, device
from titan_cp.plan.memory import (
    RankMemory,
    RankModel,
    Stage,
    saved_bytes,
    saved_bytes_per_token,
    step_peak,
    step_peak_bytes,
)
from titan_cp.plan.problem import Candidate, Workload
from titan_cp.plan.published import HELD_OUT, LLAMA3_8B_CP, TORCHTITAN_2024, Comparison, PublishedRun, compare
from titan_cp.plan.search import Estimate, PlanResult, candidates, evaluate, plan

__all__ = [
    "GB",
    "GPUS",
    "HEADROOM",
    "HELD_OUT",
    "INTER",
    "INTRA",
    "LLAMA3_8B_CP",
    "TITAN_CP_RING",
    "TORCH_2024_RING",
    "TORCHTITAN_2024",
    "Candidate",
    "Comparison",
    "Cost",
    "Device",
    "Estimate",
    "PlanResult",
    "PublishedRun",
    "RankMemory",
    "RankModel",
    "RingImpl",
    "Stack",
    "Stage",
    "Transfer",
    "Workload",
    "candidates",
    "compare",
    "cp_bytes_per_rank",
    "device",
    "evaluate",
    "launch_lines",
    "main",
    "plot_path",
    "overrides",
    "plan",
    "record",
    "saved_bytes",
    "saved_bytes_per_token",
    "step_peak",
    "step_peak_bytes",
]
