"""Published training runs, as data, and the planner's estimate of each.

All from torchtitan's December 2024 H100 benchmark (``benchmarks/llama3_h100_202412_torchtitan.md``
in pytorch/torchtitan): Grand Teton hosts of 8 H100s with 96 GB of HBM2e (2.4 TB/s), 500 W,
NVLink inside a host, 400 Gb/s RDMA per GPU between hosts; torch.compile and float8 linears on
every run below; TPS/GPU read at step 90, memory the maximum over GPUs.

- :data:`LLAMA3_8B_CP` (Table 2): Llama 3.1 8B, 8 GPUs, FSDP x CP, local batch 1, full AC. The
  planner must land within 20% of each row, in the published order.
- :data:`HELD_OUT` (Tables 4, 5, 6): 70B on 256 GPUs (FSDP 32 x TP 8, local batch 16), 405B on
  512 GPUs (FSDP 8 x TP 8 x PP 8, local batch 32, 1F1B) and 405B 4-D (TP 8 x PP 8 x FSDP x CP,
  local batch 8, 1F1B) at 32K-256K tokens, full AC. The tables do not state the sequence length
  of Tables 4 and 5: torchtitan's 70B and 405B presets of the time (``train_configs/llama3_70b.toml``,
  ``llama3_405b.toml``) train at 8192. Pipeline microbatches: torchtitan's default then, one per
  stage (``pipeline_parallel_microbatches`` unset -> ``pipeline_parallel_degree``). These runs
  are not used to set any constant: they check the planner (fits 96 GB, within 35%).

What ran there, as :class:`~titan_cp.plan.cost.Stack` (:data:`TORCHTITAN_2024`): matmuls at
1.48x bf16 eager (Table 1: FSDP + torch.compile + float8 8,532 against FSDP 5,762 tokens/s/GPU),
torch's 2024 ring (:data:`~titan_cp.plan.cost.TORCH_2024_RING`), AsyncTP where the table says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from titan_cp.attention.ring import RING
from titan_cp.plan.cost import TORCH_2024_RING, Stack
from titan_cp.plan.devices import GB, GPUS
from titan_cp.plan.problem import Candidate
from titan_cp.plan.search import Estimate, evaluate, workload_of

SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
GRAND_TETON_H100 = dataclasses.replace(GPUS["h100"], name="h100 96GB HBM2e", memory_bytes=96 * GB, hbm_bandwidth=2.4e12)
FLOAT8_COMPILE_SPEEDUP = 8532 / 5762  # Table 1
TORCHTITAN_2024 = Stack("torchtitan 2024", FLOAT8_COMPILE_SPEEDUP, False, TORCH_2024_RING)
GIB = 2**30


@dataclass(frozen=True)
class PublishedRun:
    """One published row: the run's shape and its measured tokens/s per GPU and memory."""

    table: str
    flavor: str
    seq_len: int
    local_batch: int
    dp_shard: int
    cp: int
    tp: int = 1
    pp: int = 1
    async_tp: bool = False
    tokens_per_second_per_gpu: float = 0.0
    memory_gib: float = 0.0

    @property
    def ngpu(self) -> int:
        return self.dp_shard * self.cp * self.tp * self.pp

    @property
    def label(self) -> str:
        parts = [f"FSDP {self.dp_shard}"] + [
            f"{k} {v}" for k, v in (("TP", self.tp), ("PP", self.pp), ("CP", self.cp)) if v > 1
        ]
        return " x ".join(parts)


LLAMA3_8B_CP = (
    PublishedRun("Table 2", "8B", 32768, 1, 8, 1, tokens_per_second_per_gpu=3890, memory_gib=83.9),
    PublishedRun("Table 2", "8B", 65536, 1, 4, 2, tokens_per_second_per_gpu=2540, memory_gib=84.2),
    PublishedRun("Table 2", "8B", 131072, 1, 2, 4, tokens_per_second_per_gpu=1071, memory_gib=84.0),
    PublishedRun("Table 2", "8B", 262144, 1, 1, 8, tokens_per_second_per_gpu=548, memory_gib=84.5),
)

HELD_OUT = (
    PublishedRun("Table 4", "70B", 8192, 16, 32, 1, tp=8, tokens_per_second_per_gpu=829, memory_gib=71.9),
    PublishedRun(
        "Table 4", "70B", 8192, 16, 32, 1, tp=8, async_tp=True, tokens_per_second_per_gpu=876, memory_gib=67.6
    ),
    PublishedRun("Table 5", "405B", 8192, 32, 8, 1, 8, 8, True, 100, 82.5),
    PublishedRun("Table 6", "405B", 32768, 8, 8, 1, 8, 8, True, 76, 75.3),
    PublishedRun("Table 6", "405B", 65536, 8, 4, 2, 8, 8, True, 47, 75.9),
    PublishedRun("Table 6", "405B", 131072, 8, 2, 4, 8, 8, True, 31, 77.1),
    PublishedRun("Table 6", "405B", 262144, 8, 1, 8, 8, 8, True, 16, 84.9),
)


@dataclass(frozen=True)
class Comparison:
    """A published row and the planner's estimate of the same run."""

    run: PublishedRun
    estimate: Estimate

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.estimate.tokens_per_second_per_gpu

    @property
    def ratio(self) -> float:
        """Predicted over published tokens/s per GPU."""
        return self.tokens_per_second_per_gpu / self.run.tokens_per_second_per_gpu

    @property
    def memory_gib(self) -> float:
        return self.estimate.memory.total / GIB

    @property
    def fits(self) -> bool:
        return self.estimate.fits


def as_run(run: PublishedRun) -> Stack:
    """The stack ``run`` ran on: :data:`TORCHTITAN_2024`, with AsyncTP where the table says so."""
    return dataclasses.replace(TORCHTITAN_2024, async_tp=run.async_tp)


def estimate_run(run: PublishedRun, stack: Stack | None = None) -> Estimate:
    """The planner's estimate of ``run`` (one causal document per row, bf16, full AC) under ``stack``
    (default: :func:`as_run`)."""
    from titan_cp.config import load_config

    args = ["--model.flavor", run.flavor, "--training.seq_len", str(run.seq_len)]
    args += ["--training.local_batch_size", str(run.local_batch), "--activation_checkpoint.mode", "full"]
    args += ["--parallelism.context_parallel_load_balancer", "zigzag"]  # torch's 2024 CP: two chunks per rank
    if run.pp > 1:  # torchtitan's default then: one microbatch per stage
        args += ["--parallelism.pipeline_parallel_microbatch_size", str(run.local_batch // run.pp)]
    w, _ = workload_of(load_config(args), "h100", "causal", 0)
    candidate = Candidate(RING.name, run.dp_shard, 1, run.cp, run.tp, run.pp)
    dev = dataclasses.replace(GRAND_TETON_H100, gpus_per_node=8)
    return evaluate(candidate, w, dev, stack or as_run(run))


def compare(runs: Sequence[PublishedRun] = LLAMA3_8B_CP, stack: Stack | None = None) -> list[Comparison]:
    """The planner's estimate of each of ``runs`` under ``stack`` (default: as each ran, :func:`as_run`)."""
    return [Comparison(run, estimate_run(run, stack)) for run in runs]
