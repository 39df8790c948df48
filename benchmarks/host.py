"""Host-side cost of CP attention: what a GPU would wait on when the CPU cannot issue work fast enough.

On a GPU every host-side operation costs several microseconds whatever its size, so the
number of operations issued per layer, not their arithmetic, decides whether a packed
long-sequence step is host-bound. :func:`host_layer` measures, on one gloo rank, the main
thread's CPU time (``time.thread_time``: waiting for peers is not counted) of one layer's
forward + backward with the layout and its tiles built inside the timing, as for a new
microbatch, with head_dim 8 and one head so that the arithmetic is negligible.
:class:`CountingKernel` counts the kernel calls.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
from torch.utils._python_dispatch import _disable_current_modes

from titan_cp.attention.kernels import AttentionKernel, get_kernel, register_kernel
from titan_cp.attention.strategy import DEFAULT_STRATEGY


class CountingKernel(AttentionKernel):
    """Wraps a registered kernel and counts its calls by entry point (``forward``, ``varlen_forward``, ...).

    The wrapped kernel runs with the Python dispatch modes set aside: a dispatch counter around the
    attention sees only the work around the kernel, and a per-segment loop of a thousand documents
    inside it costs no mode calls.
    """

    def __init__(self, inner: AttentionKernel, native_varlen: bool | None = None):
        self.inner = inner
        self.name = f"counted_{inner.name}"
        self.native_varlen = inner.native_varlen if native_varlen is None else native_varlen
        self.calls: Counter = Counter()

    def __getattr__(self, attr):  # device/dtype/head_dim limits of the wrapped kernel
        return getattr(self.inner, attr)

    def _call(self, entry: str, impl, *args, **kwargs):
        self.calls[entry] += 1
        with _disable_current_modes():
            return impl(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self._call("forward", self.inner.forward, *args, **kwargs)

    def backward(self, *args, **kwargs):
        return self._call("backward", self.inner.backward, *args, **kwargs)

    def varlen_forward(self, *args, **kwargs):
        impl = self.inner.varlen_forward if self.inner.native_varlen else super().varlen_forward
        return self._call("varlen_forward", impl, *args, **kwargs)

    def varlen_backward(self, *args, **kwargs):
        impl = self.inner.varlen_backward if self.inner.native_varlen else super().varlen_backward
        return self._call("varlen_backward", impl, *args, **kwargs)


def counting_kernel(name: str, native_varlen: bool | None = None) -> CountingKernel:
    """Register (once) and return the counting wrapper of kernel ``name``, selectable as ``counted_<name>``
    (``counted_varlen_<name>`` when ``native_varlen`` forces the packed variable-length route)."""
    inner = get_kernel(name, torch.device("cpu"), torch.float32)
    kernel = CountingKernel(inner, native_varlen)
    if native_varlen and not inner.native_varlen:
        kernel.name = f"counted_varlen_{name}"
    register_kernel(kernel.name, lambda: kernel)
    return kernel


def host_layer(
    rank: int,
    world: int,
    seq_len: int,
    doc_lens: list[int],
    strategy: str = DEFAULT_STRATEGY,
    kernel: str = "cpu_varlen",
    native_varlen: bool | None = None,
    iters: int = 3,
) -> dict:
    """Main-thread CPU time of one layer's forward + backward on this rank, layout built inside (fastest of ``iters``).

    Runs inside a gloo process of :class:`titan_cp.testing.pool.DistPool`. Returns ``host_ms``,
    ``tiles`` (this rank's mask tiles over all steps) and ``kernel_calls_per_step``.
    """
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    from titan_cp import SequenceLayout, cp_attention  # noqa: PLC0415
    from titan_cp.attention.ring import ring_step_tiles  # noqa: PLC0415
    from titan_cp.attention.strategy import get_strategy  # noqa: PLC0415
    from titan_cp.attention.tiling import Mask  # noqa: PLC0415

    torch.set_num_threads(1)
    counted = counting_kernel(kernel, native_varlen)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn(1, 1, seq_len // world, 8, generator=g) for _ in range(4))
    best, calls = float("inf"), Counter()
    for _ in range(iters):
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
        dist.barrier()
        counted.calls.clear()
        t0 = time.thread_time()
        layout = SequenceLayout(seq_len, world, "doc_zigzag", [doc_lens])  # a new microbatch
        out = cp_attention(ql, kl, vl, mesh, layout, strategy=strategy, kernel=counted.name)
        out.backward(dout)
        best = min(best, time.thread_time() - t0)
        calls = Counter(counted.calls)
    steps = get_strategy(strategy).ring_size(world)
    ring = steps == world  # every rank's K/V visits every rank: the ring's plans are this rank's tiles
    tiles = sum(p.num_tiles for p in ring_step_tiles(layout, rank, world, lambda r: (r,), Mask())) if ring else None
    return {
        "host_ms": best * 1e3,
        "tiles": tiles,
        "kernel_calls_per_step": calls["varlen_forward" if counted.native_varlen else "forward"] / steps,
    }
