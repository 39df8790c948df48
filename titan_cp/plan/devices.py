"""The devices the planner knows, with the source of every constant, and their links.

A collective runs on one of two link kinds: ``intra`` (NVLink, inside a node) when the ranks
of its group span at most one node's GPUs, else ``inter`` (the network). Mesh axes are laid
out innermost first (``tp``, then ``cp``, ``dp_shard``, ``dp_replicate``, ``pp``), so a group
of an axis spans the product of its own and the inner degrees.

Sources:

- peak dense BF16 (no sparsity): NVIDIA H100 SXM datasheet 989 TFLOP/s; H200 SXM datasheet
  989 TFLOP/s; A100 SXM datasheet 312 TFLOP/s.
- memory and HBM bandwidth: H100 SXM 80 GB, 3.35 TB/s; H200 141 GB, 4.8 TB/s; A100 SXM 80 GB,
  2.04 TB/s (datasheets). ``--hbm-gb`` overrides the size (the Grand Teton H100s of
  torchtitan's benchmarks have 96 GB of HBM2e at 2.4 TB/s, its benchmark page says).
- NVLink: H100/H200 NVLink 4, 900 GB/s per GPU in both directions (450 GB/s each way);
  A100 NVLink 3, 600 GB/s (300 each way). Network: 400 Gb/s per GPU (ConnectX-7 NDR,
  torchtitan's benchmark hosts) = 50 GB/s; A100 pods: 200 Gb/s HDR = 25 GB/s.
- matmul fraction 0.30: torchtitan's December 2024 H100 benchmark, Table 1: FSDP on 8 H100s
  (500 W), bf16, eager, Llama 3.1 8B at 8K, 5,762 tokens/s/GPU, which is 0.30 of 989 TFLOP/s
  counting ``ModelArgs.training_flops``. Float8 linears and torch.compile: ``Stack.matmul_speedup``.
- attention: the kernel's own measured rates (:mod:`titan_cp.plan.kernels`): FlashAttention-2
  on H100 for H100 and H200 (same SMs and clocks; attention is compute-bound); A100: 0.50 of
  peak, the low end of the 50-73% the FlashAttention-2 paper (arXiv:2307.08691) reports there.
- cpu: a nominal 0.1 TFLOP/s fp32, host memory, gloo over shared memory (~5 GB/s) and 10 GbE
  (1.25 GB/s) between hosts, ~10 GB/s of memory bandwidth: order-of-magnitude only.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from titan_cp.plan.kernels import FA2_H100, AttentionRates, flat_rates

GB = 1e9
INTRA, INTER = "intra", "inter"  # the link kinds
HEADROOM = 0.10  # fits: total <= (1 - HEADROOM) x memory (allocator fragmentation, CUDA context, NCCL)


@dataclass(frozen=True)
class Device:
    """One GPU kind. Bandwidths are per GPU and per direction, in bytes/s."""

    name: str
    peak_flops: float  # dense bf16 (fp32 for cpu)
    memory_bytes: float
    hbm_bandwidth: float
    intra_bw: float  # NVLink (inside a node)
    inter_bw: float  # network (between nodes)
    matmul_efficiency: float  # achieved fraction of peak in the model's matmuls
    attention: AttentionRates
    gpus_per_node: int = 8  # the plan's ranks per node (:func:`device` sets it)
    node_size: int | None = 8  # GPUs a node of this kind holds (None: a host runs any number of ranks, the CPU)

    def link(self, span: int) -> str:
        """The link kind of a group whose ranks span ``span`` consecutive ranks."""
        return INTRA if span <= self.gpus_per_node else INTER

    def bandwidth(self, link: str) -> float:
        """Bytes/s per GPU and direction on ``link`` (``intra`` or ``inter``)."""
        return self.intra_bw if link == INTRA else self.inter_bw

    def seconds(self, nbytes: float, link: str) -> float:
        """Seconds to move ``nbytes`` out of one GPU on ``link``."""
        return nbytes / self.bandwidth(link)

    @property
    def matmul_flops(self) -> float:
        """Achieved FLOP/s of the model's matmuls (bf16, eager)."""
        return self.peak_flops * self.matmul_efficiency


def _host_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


GPUS: dict[str, Device] = {
    "h100": Device("h100", 989e12, 80 * GB, 3.35e12, 450 * GB, 50 * GB, 0.30, FA2_H100),
    "h200": Device("h200", 989e12, 141 * GB, 4.8e12, 450 * GB, 50 * GB, 0.30, FA2_H100),
    "a100": Device(
        "a100",
        312e12,
        80 * GB,
        2.04e12,
        300 * GB,
        25 * GB,
        0.30,
        flat_rates("FlashAttention-2 on A100", "arXiv:2307.08691: 50-73% of peak; the low end", 0.50 * 312),
    ),
    "cpu": Device(
        "cpu",
        0.1e12,
        _host_memory(),
        10 * GB,
        5 * GB,
        1.25 * GB,
        1.0,
        flat_rates("cpu flash kernel", "nominal, order of magnitude", 0.1),
        node_size=None,
    ),
}


def device(gpu: str, hbm_gb: float | None = None, nnodes: int = 1, ngpu: int = 8) -> Device:
    """The constants of ``gpu`` for ``ngpu`` GPUs on ``nnodes`` nodes (``ValueError`` naming ``--gpu`` if unknown)."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is unknown; choose one of {sorted(GPUS)}")
    d = dataclasses.replace(GPUS[gpu], gpus_per_node=ngpu // nnodes)
    if gpu == "cpu":  # the ranks of a host share its memory
        d = dataclasses.replace(d, memory_bytes=d.memory_bytes / d.gpus_per_node)
    return d if hbm_gb is None else dataclasses.replace(d, memory_bytes=hbm_gb * GB)


def node_count(gpu: str, ngpu: int, nnodes: int | None = None) -> int:
    """The nodes ``ngpu`` GPUs of kind ``gpu`` run on: ``nnodes`` when given (it must divide ``ngpu``), else
    whole nodes of the kind's :attr:`Device.node_size` (one node up to that many; a CPU host runs any
    number). ``ValueError`` naming ``--nnodes`` when it does not divide ``--ngpu``, or ``--ngpu`` fills no
    whole number of nodes and ``--nnodes`` is not given; ``--gpu`` when the kind is unknown."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is unknown; choose one of {sorted(GPUS)}")
    if nnodes is not None:
        if nnodes < 1 or ngpu % nnodes:
            raise ValueError(f"--nnodes ({nnodes}) must divide --ngpu ({ngpu})")
        return nnodes
    size = GPUS[gpu].node_size
    if size is None or ngpu <= size:
        return 1
    if ngpu % size:
        raise ValueError(
            f"--ngpu {ngpu} is not a whole number of {size}-GPU {gpu} nodes: give --nnodes (the GPUs per node "
            f"are --ngpu / --nnodes)"
        )
    return ngpu // size
