"""One rank's whole training step at full size on fake tensors: the device and host bytes it holds.

The planner's memory figures (:mod:`titan_cp.plan.memory`) are arithmetic; this measures the code.
One rank of the configured mesh (rank 0; every rank of a CP group holds the same shapes) builds the
model the trainer builds (:func:`titan_cp.parallel.build.build_parallel_model`: CP, tiled MLP,
activation checkpointing with its host store, FSDP2 with its CPU offload), and runs one whole step
(forward, chunked loss, backward, gradient clipping, the optimizer's step) on one row of
``training.seq_len`` tokens, where:

- every tensor is a ``FakeTensorMode`` tensor: shapes, dtypes and strides, no data, no arithmetic
  (a step of Llama 3 8B at millions of tokens runs in a few hundred MB of RAM);
- the process group is PyTorch's ``fake`` backend (``torch.testing._internal.distributed.fake_pg``):
  FSDP's all-gathers and reduce-scatters and CP's transfers allocate their buffers and move nothing;
- the tensors are on the CPU device (a CPU-only build runs FSDP2 and the checkpoint store there);
  which bytes are the host's is known from the code that puts them there: the checkpoint store's
  host copies (:meth:`HostActivationStore._to_host`) and, with ``training.enable_cpu_offload``,
  FSDP's sharded parameters, their gradients and the optimizer's state. Everything else is the
  device's (parameters, gradients, optimizer state without the offload, saved tensors, recomputed
  tensors, communication buffers, the store's copies back to the device).

:class:`LiveBytes` records every storage an operation creates (a ``TorchDispatchMode``) and its
release (a weak reference on the storage), in order: the device bytes live at each moment, their
peak, and the host bytes. The optimizer's state exists before the measured step (one update of
zero gradients first, as at any step after the first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from titan_cp.attention.handle import CPHandle
from titan_cp.families import get_family
from titan_cp.families.llama3 import Llama3, LlamaBuilder
from titan_cp.loss import GlobalTokenLoss
from titan_cp.optim import build_optimizers, clip_grad_norm_
from titan_cp.parallel.build import build_parallel_model, cp_handle
from titan_cp.parallel.offload import HostActivationStore
from titan_cp.step import Microbatch, forward_backward


def _plain(leaves) -> list[torch.Tensor]:
    """The tensors holding memory among ``leaves``: a tensor subclass's (``DTensor``) inner tensors."""
    out = []
    for t in leaves:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            out += _plain([getattr(t, n) for n in names])
        elif isinstance(t, torch.Tensor):
            out.append(t)
    return out


class LiveBytes(TorchDispatchMode):
    """Every storage created by an operation, with its bytes, and its release: :meth:`timeline`."""

    def __init__(self):
        super().__init__()
        self._keys = WeakIdKeyDictionary()  # storage -> key
        self.sizes: dict[int, int] = {}
        self.what: dict[int, str] = {}  # key -> the op and the shape that created it
        self.events: list[tuple[int, int]] = []  # (key, +bytes at creation / -bytes at release)
        self.host: set[int] = set()
        self.marks: dict[str, int] = {}  # name -> index into events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _plain(tree_leaves(out)):
            if (key := self.track(t)) is not None:
                self.what.setdefault(key, f"{func} {t.dtype} {tuple(t.shape)}")
        return out

    def track(self, t: torch.Tensor) -> int | None:
        """The key of ``t``'s storage, recorded (with its bytes) the first time it is seen."""
        if t.device.type == "meta":
            return None
        st = t.untyped_storage()
        key = self._keys.get(st)
        if key is None:
            key = len(self.sizes)
            self._keys[st] = key
            self.sizes[key] = st.nbytes()
            self.events.append((key, st.nbytes()))
            weakref.finalize(st, self._release, key)
        return key

    def _release(self, key: int) -> None:
        self.events.append((key, -self.sizes[key]))
        self.sizes[key] = 0

    @contextlib.contextmanager
    def resizes(self):
        """Storages resized in place (FSDP2 frees and re-allocates its unsharded parameters so) recorded."""
        real = torch.UntypedStorage.resize_

        def resize_(st, size):
            key = self._keys.get(st)
            out = real(st, size)
            if key is not None:
                self.events.append((key, st.nbytes() - self.sizes[key]))
                self.sizes[key] = st.nbytes()
            return out

        torch.UntypedStorage.resize_ = resize_
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = real

    def mark_host(self, t: torch.Tensor | None) -> None:
        """``t``'s storage is in host memory."""
        for inner in _plain([t]):
            if (key := self.track(inner)) is not None:
                self.host.add(key)

    def mark(self, name: str) -> None:
        self.marks[name] = len(self.events)

    def timeline(self, start: str) -> dict[str, int]:
        """From the mark ``start`` on: the device bytes' peak, and the host bytes' peak and at the peak."""
        device = host = peak = host_peak = host_at_peak = at_start = 0
        begin = self.marks[start]
        for i, (key, delta) in enumerate(self.events):
            if key in self.host:
                host += delta
            else:
                device += delta
            if i + 1 == begin:
                at_start = device
            if i >= begin:
                host_peak = max(host_peak, host)
                if device > peak:
                    peak, host_at_peak = device, host
        return {
            "device_peak_bytes": peak,
            "host_bytes": host_peak,
            "host_bytes_at_device_peak": host_at_peak,
            "device_start_bytes": at_start,
        }


class _FakeInitBuilder(LlamaBuilder):
    """The Llama, allocated but not initialised (fake tensors hold no values to initialise)."""

    def materialize(self, model, device, seed) -> None:
        model.to_empty(device=device)


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake process group of ``world_size`` ranks, this process rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415

    if dist.is_initialized():
        raise ValueError("a process group is already initialised: the fake world needs a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _DeviceRMSNorm(torch.autograd.Function):
    """What ``F.rms_norm`` is on the GPU: ``aten._fused_rms_norm``'s CUDA kernel, which saves the input and
    the fp32 ``rstd (..., 1)`` and whose backward (``_fused_rms_norm_backward``) writes ``dx`` and ``dw``
    alone. On a CPU-only build the op falls back to its composite form (fp32 copies of the whole input:
    ``x.float()``, ``pow``, ``mul``, and as many in the backward), which a GPU never allocates; on fake
    tensors only the shapes matter, so the kernel's outputs are allocated as the kernel allocates them."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        x, _, weight = ctx.saved_tensors
        return torch.empty_like(x), None if weight is None else torch.empty_like(weight), None


def _device_rms_norm(x, normalized_shape, weight=None, eps=None):
    return _DeviceRMSNorm.apply(x, weight, eps)


@contextlib.contextmanager
def _device_kernels():
    """``F.rms_norm`` as the GPU runs it (:class:`_DeviceRMSNorm`)."""
    real = F.rms_norm
    F.rms_norm = _device_rms_norm
    try:
        yield
    finally:
        F.rms_norm = real


@contextlib.contextmanager
def _host_copies(tracker: LiveBytes):
    """The checkpoint store's host copies marked as host memory."""
    real = HostActivationStore._to_host

    def to_host(self, t):
        host = real(self, t)
        tracker.mark_host(host)
        return host

    HostActivationStore._to_host = to_host
    try:
        yield
    finally:
        HostActivationStore._to_host = real


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _mark_fsdp_host(tracker: LiveBytes, parts, optimizers) -> None:
    """``training.enable_cpu_offload``: FSDP's shards, their gradients and AdamW's state are on the host."""
    for part in parts:
        for p in part.parameters():
            tracker.mark_host(_local(p))
            tracker.mark_host(None if p.grad is None else _local(p.grad))
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim():
                    tracker.mark_host(_local(v))


def _step_rows(cfg, cp: CPHandle) -> Microbatch:
    """One row of ``training.seq_len`` tokens (one causal document), this (fake) rank's shard of it by
    ``cp``, the handle the model is built with (real host tensors)."""
    n = cfg.training.seq_len
    tokens = torch.zeros(1, n, dtype=torch.long)
    return cp.shard(Microbatch(tokens, tokens.clone(), torch.arange(n)[None], torch.tensor([[n]])))


def model_args(cfg, layers: int | None = None):
    """The config's model shapes (the planner's), with ``layers`` blocks when given (a model of the same
    width cut in depth)."""
    args = get_family(cfg.model.name).planner_args(cfg)
    if layers is None:
        return args
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be a positive integer, got {layers!r}")
    return dataclasses.replace(args, n_layers=layers)


def _build(cfg, dims, args, cp: CPHandle):
    """This rank's model parts and optimizers, the optimizer's state made (one update of zero gradients)."""
    from titan_cp.train import compute_precision, parallelize_options  # noqa: PLC0415 - the trainer's own choice

    if not isinstance(get_family(cfg.model.name), Llama3):
        raise ValueError(f"model.name = {cfg.model.name!r}: the full-step measurement builds titan_cp's Llama only")
    mp = {"bfloat16": torch.bfloat16, "float32": None}[compute_precision(cfg, "cuda", announce=False)]
    if mp is not None and not (dims.fsdp_enabled or dims.dp_replicate_enabled):
        raise ValueError(
            "the full-step measurement computes in bf16 through FSDP: it needs a mesh of more than one rank"
        )
    built = build_parallel_model(_FakeInitBuilder(args), dims, parallelize_options(cfg, mp), "cpu", cp=cp)
    if built.schedule is not None:
        raise ValueError("parallelism.pipeline_parallel_degree > 1: the full-step measurement runs one stage's model")
    o = cfg.optimizer
    optimizers = build_optimizers(
        built.parts, o.name, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay, o.implementation
    )
    for part in built.parts:
        for p in part.parameters():
            p.grad = torch.zeros_like(p)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return built.parts, optimizers


def measure_full_step(cfg, ngpu: int, layers: int | None = None) -> dict:
    """Device and host bytes of one rank's whole step for ``cfg`` on ``ngpu`` ranks (module docstring):
    ``device_peak_bytes`` (the most live on the device at once during the step: parameters,
    gradients, optimizer state, saved and recomputed tensors, buffers), ``host_bytes`` (the most in
    host memory), ``device_start_bytes`` (held when the step starts). ``layers``: see :func:`model_args`."""
    dims = cfg.parallel_dims(ngpu)
    tracker = LiveBytes()
    with fake_world(ngpu):
        dims.build_mesh("cpu")
        from titan_cp.train import parallelize_options  # noqa: PLC0415 - the trainer's own choice

        cp = cp_handle(dims, parallelize_options(cfg, None))  # the model's handle: strategy, balance, kernel
        return _measure(cfg, dims, model_args(cfg, layers), cp, _step_rows(cfg, cp), tracker)


def _measure(cfg, dims, args, cp: CPHandle, local: Microbatch, tracker: LiveBytes) -> dict:
    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        tracker,
        tracker.resizes(),
        _host_copies(tracker),
        _device_kernels(),
    ):
        parts, optimizers = _build(cfg, dims, args, cp)
        loss_fn = GlobalTokenLoss()
        loss_fn.global_valid_tokens = cfg.training.seq_len
        tracker.mark("step")
        forward_backward(parts, local, loss_fn)
        clip_grad_norm_(parts, cfg.training.max_norm)
        for opt in optimizers:
            opt.step()
        if cfg.training.enable_cpu_offload:
            _mark_fsdp_host(tracker, parts, optimizers)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        del parts, optimizers
    return tracker.timeline("step")


def planned(cfg, ngpu: int, gpu: str, host_gb: float = 2000.0, layers: int | None = None) -> dict:
    """The planner's figures for the same config (:func:`titan_cp.plan.search.evaluate` of its mesh)."""
    from titan_cp.plan import Candidate, Stack, device, evaluate  # noqa: PLC0415
    from titan_cp.plan.search import workload_of  # noqa: PLC0415

    p = cfg.parallelism
    w, _ = workload_of(cfg, gpu, "causal", 0, host_gb)
    w = dataclasses.replace(w, args=model_args(cfg, layers))
    takes = p.strategy().takes_ulysses_degree()
    c = Candidate(
        p.context_parallel_strategy,
        cfg.parallel_dims(ngpu).dp_shard,
        p.data_parallel_replicate_degree,
        p.context_parallel_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.context_parallel_ulysses_degree if takes else 1,
    )
    e = evaluate(c, w, device(gpu, None, 1, ngpu), Stack())
    return {"planned_device_bytes": e.memory.total, "planned_host_bytes": e.host_bytes, "planned_parts": e.memory.parts}


def full_step_row(cfg, ngpu: int, gpu: str, host_gb: float = 2000.0, layers: int | None = None) -> dict:
    """One JSON row: the config, the measurement and the planner's figures, and their ratios (``layers``:
    the model cut to that many blocks, in both)."""
    ac, p = cfg.activation_checkpoint, cfg.parallelism
    row = {
        "flavor": cfg.model.flavor,
        "layers": model_args(cfg, layers).n_layers,
        "seq_len": cfg.training.seq_len,
        "ngpu": ngpu,
        "gpu": gpu,
        "cp": p.context_parallel_degree,
        "strategy": p.context_parallel_strategy,
        "ac": ac.mode,
        "cpu_offload": ac.cpu_offload,
        "blocks_per_checkpoint": ac.blocks_per_checkpoint,
        "tile_tokens": ac.tile_tokens,
        "enable_cpu_offload": cfg.training.enable_cpu_offload,
    }
    row.update(measure_full_step(cfg, ngpu, layers))
    row.update(planned(cfg, ngpu, gpu, host_gb, layers))
    row["device_over_planned"] = row["device_peak_bytes"] / row["planned_device_bytes"]
    row["host_over_planned"] = row["host_bytes"] / row["planned_host_bytes"] if row["planned_host_bytes"] else None
    return row


BASE = (
    "--training.local_batch_size", "1", "--training.global_batch_size", "1",
    "--activation_checkpoint.mode", "full", "--parallelism.data_parallel_shard_degree", "-1",
)  # fmt: skip


def plan_overrides(e) -> list[str]:
    """The config overrides of the planner's estimate ``e`` (its mesh, strategy and options)."""
    c, h, w = e.candidate, e.workload.host, e.workload
    out = [
        "--training.seq_len", str(w.seq_len),
        "--parallelism.data_parallel_shard_degree", str(c.dp_shard),
        "--parallelism.data_parallel_replicate_degree", str(c.dp_replicate),
        "--parallelism.context_parallel_degree", str(c.cp),
        "--parallelism.tensor_parallel_degree", str(c.tp),
        "--parallelism.pipeline_parallel_degree", str(c.pp),
        "--parallelism.context_parallel_strategy", c.strategy,
        "--parallelism.context_parallel_load_balancer", w.balance,
        "--activation_checkpoint.mode", w.ac,
        "--activation_checkpoint.cpu_offload", str(h.cpu_offload).lower(),
        "--activation_checkpoint.blocks_per_checkpoint", str(h.blocks_per_checkpoint),
        "--activation_checkpoint.tile_tokens", str(h.tile_tokens),
        "--training.enable_cpu_offload", str(h.fsdp_offload).lower(),
    ]  # fmt: skip
    if c.ulysses > 1:
        out += ["--parallelism.context_parallel_ulysses_degree", str(c.ulysses)]
    return out


def default_cases(flavor: str = "8B", ngpu: int = 8) -> list[tuple[str, list[str]]]:
    """``(gpu, overrides)``: ``flavor`` at 131072 tokens on CP ``ngpu`` with nothing offloaded (H100), and the
    planner's longest length on ``ngpu`` H100 and H200 (``python -m titan_cp.plan --max-seq``) with its plan."""
    from titan_cp.config import load_config  # noqa: PLC0415
    from titan_cp.plan.search import max_seq_len  # noqa: PLC0415

    base = [*BASE, "--model.flavor", flavor]
    cases = [("h100", [*base, "--training.seq_len", "131072", "--parallelism.context_parallel_degree", str(ngpu)])]
    for gpu in ("h100", "h200"):
        _, result = max_seq_len(load_config(base), ngpu, gpu)
        if result is not None:
            cases.append((gpu, [*base, *plan_overrides(result.best)]))
    return cases
