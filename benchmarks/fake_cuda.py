"""Every rank of a CP group on fake CUDA tensors, in one process: the CUDA path checked without a GPU.

Under ``FakeTensorMode`` a tensor carries its shape, dtype, strides and device but no data, and
no arithmetic runs; one attention layer at full size (131072 tokens, CP 8, Llama 3 8B heads, bf16)
runs through the engine and ATen's CUDA flash kernel in seconds on a CPU-only build. Four shims
make that possible (:func:`fake_cuda`):

- **host to device**: ``titan_cp.layout.to_device`` (the one place host index tensors reach the
  device) returns a fake CUDA tensor of the host tensor's shape and dtype;
- **host-side planning** (the layout, the mask tiles and their index tensors, built once per
  microbatch) runs on real CPU tensors, the fake mode and the meters set aside while it does, its
  plans kept under keys of their own (never served to a real CUDA run);
- **CUDA tensor methods** a CPU-only build refuses even on fake tensors (Python indexing such as
  ``x[0]`` and ``x[rank, slot] = y``, ``copy_``, ``contiguous``, ``.to("cuda")``) go through the ATen
  ops they stand for (so a host-to-device copy is seen, and a blocking one caught);
- **communication**: ``titan_cp.attention.comm``'s ``torch.distributed`` calls move nothing (the
  receive buffers stay as allocated: with no arithmetic their contents are never read); the bytes
  are counted by ``count_comm`` as on a real run.

:func:`simulate` runs one layer's forward and backward of a strategy for every rank in turn and
returns a :class:`RankTrace` per rank. The layer plans on the host as the first layer of a
microbatch does (the tiles and their indices, which later layers reuse); host operations move no
device bytes and are not counted, so one layer's counts are those of every layer:

- every call of ATen's flash ops, checked against the kernel's preconditions (dtype, last-dim
  contiguity, head_dim, int32 contiguous cumulative lengths on the device, Python-int maximum
  lengths, the log-sum-exp's shape and dtype): each broken one is listed in ``violations``;
- a host synchronisation (``.item()``, ``.tolist()``, ``bool()``, ``nonzero`` of a device
  tensor) or a blocking host-to-device copy in the layer, its planning included, raises
  :class:`HostSyncError`;
- kernel calls per ring step, the bytes sent, the kernel's segments (for its work), and the
  operations outside the kernel with the HBM bytes they read and write (:class:`TrafficMeter`: an
  index operation counted by the rows it touches, views, allocations and host operations free), from which
  :mod:`benchmarks.gpu_model` predicts GPU time. The kernel is ATen's flash op alone: a value head dim of
  its own (multi-head latent attention) reaches it with v, out and dout zero-padded to q's head dim, and
  that padding is counted among the operations outside it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import titan_cp.layout as layout_module
from titan_cp.attention import comm
from titan_cp.attention.context import CPContext
from titan_cp.attention.kernels import cuda_flash
from titan_cp.attention.kernels.cuda_flash import CUDAFlashKernel
from titan_cp.attention.strategy import get_strategy
from titan_cp.attention.tiling import Mask
from titan_cp.layout import SequenceLayout

CUDA = torch.device("cuda", 0)
_ATEN = torch.ops.aten


# ---------------------------------------------------------------------------- a fake mesh and transport
@dataclass(frozen=True)
class FakeGroup:
    """One process group of the simulated mesh, seen from one rank."""

    rank: int
    size: int


class FakeMesh:
    """The cp (sub-)mesh of one simulated rank: the ``DeviceMesh`` calls the strategies make."""

    def __init__(self, dims: Sequence[tuple[str, int]], coords: Sequence[int]):
        self.mesh_dim_names = tuple(name for name, _ in dims)
        self._sizes = tuple(n for _, n in dims)
        self._coords = tuple(coords)
        self.ndim = len(dims)

    def size(self, dim: int | None = None) -> int:
        return math.prod(self._sizes) if dim is None else self._sizes[dim]

    def get_local_rank(self, dim: int | None = None) -> int:
        assert dim is not None or self.ndim == 1, "a 2-D mesh needs the dim"
        return self._coords[0 if dim is None else dim]

    def get_group(self, dim: int | None = None) -> FakeGroup:
        d = 0 if dim is None else dim
        return FakeGroup(self._coords[d], self._sizes[d])

    @property
    def mesh(self) -> SimpleNamespace:
        """The ranks in the mesh's shape, as ``DeviceMesh.mesh.tolist()`` gives them (the simulation's global
        ranks are the coordinates, flat; no tensor is made inside the fake mode)."""
        rows = [
            list(range(i * self._sizes[-1], (i + 1) * self._sizes[-1])) for i in range(self.size() // self._sizes[-1])
        ]
        return SimpleNamespace(tolist=lambda: rows if self.ndim == 2 else rows[0])


def fake_meshes(strategy: str, cp: int, ulysses_degree: int = 1) -> list[FakeMesh]:
    """The cp mesh of every rank, ordered by the rank's place in the layout."""
    s = get_strategy(strategy)
    dims = s.mesh_dims(cp, ulysses_degree)
    meshes = []
    for flat in range(cp):
        coords, rest = [], flat
        for _, n in reversed(dims):
            coords.append(rest % n)
            rest //= n
        meshes.append(FakeMesh(dims, tuple(reversed(coords))))
    return sorted(meshes, key=s.layout_rank)


class _Work:
    def wait(self) -> None:
        pass


class _P2POp:
    def __init__(self, op, tensor, group=None, group_peer=None, tag=0):
        self.op, self.tensor, self.group, self.group_peer, self.tag = op, tensor, group, group_peer, tag


def _nothing(*args, **kwargs) -> _Work:
    return _Work()


FAKE_DIST = SimpleNamespace(
    get_rank=lambda group: group.rank,
    get_world_size=lambda group: group.size,
    P2POp=_P2POp,
    isend="isend",
    irecv="irecv",
    batch_isend_irecv=lambda ops: [_Work() for _ in ops],
    all_gather_single=_nothing,
    reduce_scatter_tensor=_nothing,
    all_to_all_single=_nothing,
)


# ---------------------------------------------------------------------------- the flash kernel, checked
@dataclass
class FlashCall:
    """One ATen flash call: which op, and the shapes it saw."""

    op: str
    varlen: bool
    causal: bool
    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    segments: int


def _check_qkv(name: str, tensors: dict[str, torch.Tensor], problems: list[str]) -> None:
    q = tensors["q"]
    for key, t in tensors.items():
        if t.dtype not in (torch.float16, torch.bfloat16):
            problems.append(f"{name}: {key} is {t.dtype}, the flash kernel takes float16/bfloat16")
        if t.dtype != q.dtype:
            problems.append(f"{name}: {key} is {t.dtype} but q is {q.dtype}")
        if t.device.type != "cuda":
            problems.append(f"{name}: {key} is on {t.device}, not on the GPU")
        if t.stride(-1) != 1:
            problems.append(f"{name}: {key} is not contiguous in its last dim (stride {t.stride(-1)})")
    e = q.shape[-1]
    if e % 8 or e > 256:
        problems.append(f"{name}: head_dim {e} is not a multiple of 8 at most 256")
    k, v = tensors["k"], tensors["v"]
    if k.shape[-1] != e or q.shape[-2] % k.shape[-2]:
        problems.append(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} do not agree in head_dim and GQA")
    if v.shape[-1] != e:
        problems.append(f"{name}: v's head_dim {v.shape[-1]} is not q's {e}: the kernel takes one (pad v)")


def _check_lengths(name: str, cu_q, cu_k, max_q, max_k, q: torch.Tensor, problems: list[str]) -> int:
    """Cumulative lengths and maxima of a variable-length call; the number of segments."""
    for key, cu in (("cum_seq_q", cu_q), ("cum_seq_k", cu_k)):
        if not isinstance(cu, torch.Tensor):
            problems.append(f"{name}: {key} is {type(cu).__name__}, not a tensor")
            continue
        if cu.dtype != torch.int32 or cu.dim() != 1 or not cu.is_contiguous():
            problems.append(f"{name}: {key} must be a contiguous 1-D int32 tensor, got {cu.dtype} {tuple(cu.shape)}")
        if cu.device != q.device:
            problems.append(f"{name}: {key} is on {cu.device}, q on {q.device}")
    for key, m in (("max_q", max_q), ("max_k", max_k)):
        if type(m) is not int or m < 1:
            problems.append(f"{name}: {key} must be a positive Python int, got {m!r}")
    if isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor) and cu_q.shape != cu_k.shape:
        problems.append(f"{name}: cum_seq_q {tuple(cu_q.shape)} and cum_seq_k {tuple(cu_k.shape)} differ")
    if q.dim() != 3:
        problems.append(f"{name}: a variable-length q must be (total_q, heads, head_dim), got {tuple(q.shape)}")
    return cu_q.shape[0] - 1 if isinstance(cu_q, torch.Tensor) else 0


class CheckedAten:
    """Stands in for ``torch.ops.aten`` in the ``cuda_flash`` kernel: checks and records every flash
    call, then runs ATen's own op (its schema checks the argument types; its fake kernel the shapes).
    ``inside`` is set while a flash op runs: that op is the kernel, which a :class:`TrafficMeter` leaves out;
    what the kernel's Python does around it (v padded to q's head dim and the results sliced, the lse made
    contiguous) moves HBM bytes like any operation outside it, and is counted."""

    def __init__(self):
        self.calls: list[FlashCall] = []
        self.violations: list[str] = []
        self.inside = False

    def _run(self, op, *args, **kwargs):
        self.inside = True
        try:
            return op(*args, **kwargs)
        finally:
            self.inside = False

    def __getattr__(self, name):
        op = getattr(_ATEN, name)
        check = {"_flash_attention_forward": self._forward, "_flash_attention_backward": self._backward}.get(name)
        if check is None:
            return op
        return lambda *args, **kwargs: check(op, *args, **kwargs)

    def _forward(self, op, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug_mask, **kw):
        problems = []
        _check_qkv("forward", {"q": q, "k": k, "v": v}, problems)
        varlen = cu_q is not None
        n = _check_lengths("forward", cu_q, cu_k, max_q, max_k, q, problems) if varlen else q.shape[0]
        res = self._run(op, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug_mask, **kw)
        want = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        lse = res[1]
        if tuple(lse.shape) != want or lse.dtype != torch.float32:
            problems.append(f"forward: lse is {lse.dtype} {tuple(lse.shape)}, the engine expects float32 {want}")
        self.calls.append(FlashCall("forward", varlen, causal, tuple(q.shape), tuple(k.shape), n))
        self.violations += problems
        return res

    def _backward(self, op, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, *rest, **kw):
        problems = []
        _check_qkv("backward", {"q": q, "k": k, "v": v, "out": out, "dout": dout}, problems)
        varlen = cu_q is not None
        n = _check_lengths("backward", cu_q, cu_k, max_q, max_k, q, problems) if varlen else q.shape[0]
        want = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        if tuple(lse.shape) != want or lse.dtype != torch.float32 or not lse.is_contiguous():
            problems.append(f"backward: lse must be a contiguous float32 {want}, got {lse.dtype} {tuple(lse.shape)}")
        if dout.shape != q.shape or out.shape != q.shape:
            problems.append(f"backward: dout {tuple(dout.shape)} / out {tuple(out.shape)} differ from q")
        self.calls.append(FlashCall("backward", varlen, causal, tuple(q.shape), tuple(k.shape), n))
        self.violations += problems
        return self._run(op, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, *rest, **kw)


# ---------------------------------------------------------------------------- host syncs
_SYNC_OPS = {_ATEN._local_scalar_dense.default, _ATEN.is_nonzero.default, _ATEN.nonzero.default, _ATEN.item.default}


class HostSyncError(RuntimeError):
    """The layer read a device value on the host, or copied host data to the device blocking."""


class SyncDetector(TorchDispatchMode):
    """Raises :class:`HostSyncError` where a device value is read on the host (``.item()``,
    ``.tolist()``, ``bool()``, ``nonzero`` of a CUDA tensor) or host data is copied to the device
    blocking. Reading host tensors on the host (the layout's planning) is not a synchronisation.
    ``device_type``: the device the simulation stands for the GPU with (``"meta"`` where autograd runs,
    :mod:`benchmarks.linear_model`)."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS and args[0].device.type == self.device_type:
            raise HostSyncError(f"{func} reads a device value on the host inside the layer")
        if func is _ATEN._to_copy.default and not kwargs.get("non_blocking", False):
            src, dst = args[0].device, torch.device(kwargs.get("device") or args[0].device)
            if src.type == "cpu" and dst.type == self.device_type:
                raise HostSyncError(f"a blocking host-to-device copy of {tuple(args[0].shape)} inside the layer")
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------- the shims
def _basic_or_advanced(x: torch.Tensor, idx):
    """``x[idx]`` through explicit ops: a CPU-only build refuses Python indexing of a CUDA tensor,
    even a fake one. Supports ints, slices and ``None``, or all-tensor (advanced) indices."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if all(isinstance(i, torch.Tensor) for i in idx):
        return _ATEN.index.Tensor(x, list(idx))
    dim = 0
    for i in idx:
        if isinstance(i, bool) or not isinstance(i, (int, slice, type(None))):
            raise NotImplementedError(f"fake_cuda indexing with {type(i).__name__} mixed with other indices")
        if isinstance(i, int):
            x = x.select(dim, i)
        elif isinstance(i, slice):
            x = _ATEN.slice.Tensor(x, dim, i.start, i.stop, i.step or 1)
            dim += 1
        else:
            x = x.unsqueeze(dim)
            dim += 1
    return x


def _is_fake_cuda(x) -> bool:
    return isinstance(x, FakeTensor) and x.device.type == "cuda"


@contextlib.contextmanager
def _cuda_methods():
    """The ``Tensor`` methods a CPU-only build refuses on CUDA tensors, even fake ones (their Python
    binding guards the device), through the ATen ops they stand for: indexing (``x[0]``,
    ``x[rank, slot] = y``), ``copy_``, ``contiguous`` and ``to`` a CUDA device."""
    real_get, real_set = torch.Tensor.__getitem__, torch.Tensor.__setitem__
    real_copy, real_contiguous, real_to = torch.Tensor.copy_, torch.Tensor.contiguous, torch.Tensor.to

    def get(self, idx):
        return _basic_or_advanced(self, idx) if _is_fake_cuda(self) else real_get(self, idx)

    def put(self, idx, value):
        if not _is_fake_cuda(self):
            return real_set(self, idx, value)
        idx = idx if isinstance(idx, tuple) else (idx,)
        if all(isinstance(i, torch.Tensor) for i in idx):
            _ATEN.index_put_(self, list(idx), value)
        else:
            _basic_or_advanced(self, idx).copy_(value)

    def copy(self, src, non_blocking=False):
        return (
            _ATEN.copy_.default(self, src, non_blocking) if _is_fake_cuda(self) else real_copy(self, src, non_blocking)
        )

    def contiguous(self, memory_format=torch.contiguous_format):
        if not _is_fake_cuda(self) or self.is_contiguous(memory_format=memory_format):
            return real_contiguous(self, memory_format=memory_format)
        return _ATEN.clone.default(self, memory_format=memory_format)

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is None or device.type != "cuda" or (self.device == device and dtype in (None, self.dtype)):
            return real_to(self, *args, **kwargs)
        return _ATEN._to_copy.default(self, dtype=dtype or self.dtype, device=device, non_blocking=non_blocking)

    torch.Tensor.__getitem__, torch.Tensor.__setitem__ = get, put
    torch.Tensor.copy_, torch.Tensor.contiguous, torch.Tensor.to = copy, contiguous, to
    try:
        yield
    finally:
        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = real_get, real_set
        torch.Tensor.copy_, torch.Tensor.contiguous, torch.Tensor.to = real_copy, real_contiguous, real_to


_FAKE = "fake_cuda"  # the first element of a plan's key built under fake_cuda


@functools.cache
def _fake_mode() -> FakeTensorMode:
    """The one fake mode of this process: a plan kept from an earlier simulation holds its tensors."""
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def fake_cuda():
    """A ``FakeTensorMode`` in which the CUDA path runs on a CPU-only build (module docstring); yields
    ``(mode, aten)`` with ``aten`` the :class:`CheckedAten` the ``cuda_flash`` kernel calls. A layout
    met again (``get_layout`` keeps the last few) reuses its fake indices as they are."""
    mode = _fake_mode()
    real_to_device, real_memo, real_dist, real_aten = (
        layout_module.to_device,
        SequenceLayout.memo,
        comm.dist,
        cuda_flash._ATEN,
    )
    from titan_cp.attention.tiling import MaskTiles

    real_tiles_memo = MaskTiles._memo

    def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if torch.device(device).type != "cuda":
            return real_to_device(t, device)
        return mode.fake_tensor_converter.from_meta_and_device(mode, t.to("meta"), torch.device(device))

    def memo(self, key, build):
        with _disable_current_modes():
            return real_memo(self, (_FAKE, *key), build)

    def tiles_memo(self, key, build):
        with _disable_current_modes():
            return real_tiles_memo(self, (_FAKE, *key), build)

    users = [m for m in list(sys.modules.values()) if getattr(m, "to_device", None) is real_to_device]
    aten = CheckedAten()
    try:
        for m in users:
            m.to_device = to_device
        SequenceLayout.memo, MaskTiles._memo, comm.dist, cuda_flash._ATEN = memo, tiles_memo, FAKE_DIST, aten
        with _cuda_methods(), mode:
            yield mode, aten
    finally:
        for m in users:
            m.to_device = real_to_device
        SequenceLayout.memo, MaskTiles._memo, comm.dist, cuda_flash._ATEN = (
            real_memo,
            real_tiles_memo,
            real_dist,
            real_aten,
        )


# ---------------------------------------------------------------------------- counting
class MeteredFlash(CUDAFlashKernel):
    """The ``cuda_flash`` kernel, recording every variable-length call's segments (host offsets, and the
    heads it runs); the ATen flash op inside it is what a traffic meter leaves out (:class:`CheckedAten`)."""

    def __init__(self, inner: CUDAFlashKernel | None = None):
        super().__init__()
        self.inner = inner or CUDAFlashKernel()
        self.segments: list[tuple[str, bool, tuple[int, ...], tuple[int, ...], int | None, int]] = []

    def _run(self, op: str, fn, seg, causal, window, *args):
        self.segments.append((op, causal, seg.host_q, seg.host_k, window, args[0].shape[1]))
        return fn(*args, **({} if window is None else {"window": window}))

    def varlen_forward(self, q, k, v, seg, causal, scale, window=None):
        return self._run("forward", self.inner.varlen_forward, seg, causal, window, q, k, v, seg, causal, scale)

    def varlen_backward(self, dout, q, k, v, out, lse, seg, causal, scale, window=None):
        fn = self.inner.varlen_backward
        return self._run("backward", fn, seg, causal, window, dout, q, k, v, out, lse, seg, causal, scale)


_VIEWS = {
    "view", "_unsafe_view", "transpose", "t", "permute", "expand", "select", "slice", "unsqueeze", "squeeze",
    "alias", "as_strided", "detach", "unbind", "split", "split_with_sizes", "chunk", "narrow", "_reshape_alias",
    "empty", "empty_like", "new_empty", "empty_strided", "lift_fresh", "reshape",
}  # fmt: skip


def _nbytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def _rows_of(x: torch.Tensor, dim: int, n: int) -> int:
    """Bytes of ``n`` slices of ``x`` along ``dim``."""
    return n * (_nbytes(x) // max(1, x.shape[dim])) if x.dim() else _nbytes(x)


def _fused_bytes(name: str, args) -> int:
    """Bytes of the engine's fused row updates ``add_rows`` and ``write_rows``
    (:mod:`titan_cp.attention.fused`): each row it touches read and written once, its inputs read once."""
    acc_or_dst, index, src = args
    touched = _rows_of(acc_or_dst, 0, index.numel())
    return _nbytes(src) + _nbytes(index) + touched * (2 if name == "add_rows" else 1)


def _gathered_bytes(name: str, args) -> int:
    """Bytes of the engine's group merges (``merge_into``, ``add_into``): the packed rows of each partial
    read once (with their lse), each earlier partial's row read once, each destination row written once."""
    if name == "merge_into":
        dst_out, dst_lse, dst_rows, acc_out, acc_lse, prior, outs, lses, srcs, places = args
        dst, acc, parts = [(dst_out, 0), (dst_lse, 1)], [(acc_out, 0), (acc_lse, 1)], zip(outs, lses)
        parts = [[(o, 0), (lse, 1)] for o, lse in parts]
    else:
        dst_out, dst_rows, acc_out, prior, grads, srcs, places = args
        dst, acc, parts = [(dst_out, 0)], [(acc_out, 0)], [[(g, 0)] for g in grads]
    acc = dst if acc_out is None else acc  # an earlier partial held in the destination itself
    read = sum(_rows_of(t, d, i.numel()) for lane, i in zip(parts, srcs) for t, d in lane)
    held = 0 if prior is None else sum(_rows_of(t, d, prior.numel()) for t, d in acc)
    written = sum(_rows_of(t, d, dst_rows.numel()) for t, d in dst)
    return read + held + written + sum(map(_nbytes, [dst_rows, prior, *srcs, *places]))


def op_bytes(func, args, kwargs, out) -> int:
    """HBM bytes an operation reads and writes, an index operation counted by the rows it touches."""
    name = func.__name__.split(".")[0].rstrip("_")
    if func.namespace == "titan_cp" and name in ("add_rows", "write_rows"):
        return _fused_bytes(name, args)
    if func.namespace == "titan_cp" and name in ("merge_into", "add_into"):
        return _gathered_bytes(name, args)
    outs = [t for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]
    if not outs:  # queries (a device, a size) move no data
        return 0
    if name in _VIEWS and not (name == "reshape" and outs and outs[0]._base is None):
        return 0
    if name == "index_select":
        x, dim, idx = args[:3]
        return _rows_of(x, dim, idx.numel()) + _nbytes(idx) + sum(map(_nbytes, outs))
    if name in ("index_add", "index_copy"):
        acc, dim, idx, src = args[:4]
        touched = _rows_of(acc, dim, idx.numel())
        return _nbytes(src) + _nbytes(idx) + touched * (2 if name == "index_add" else 1)
    if name == "index_put":
        return 2 * _nbytes(args[2]) + sum(_nbytes(i) for i in args[1] if i is not None)
    if name in ("zeros", "full", "fill", "zero", "new_zeros", "zeros_like", "full_like", "new_full"):
        return sum(map(_nbytes, outs))
    if name == "copy":  # dst.copy_(src): src read, dst written (not read)
        return _nbytes(args[1]) + _nbytes(args[0])
    inputs = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    return sum(map(_nbytes, inputs)) + sum(map(_nbytes, outs))


def _on_device(args, out, device_type: str = "cuda") -> bool:
    """Whether an operation touches a (fake) CUDA tensor (one of ``device_type``): the host's own planning
    moves no HBM bytes."""
    return any(isinstance(t, torch.Tensor) and t.device.type == device_type for t in pytree.tree_leaves((args, out)))


def engine_site() -> str:
    """Where the engine issued the operation being dispatched: ``module.function`` of the innermost
    frame in :mod:`titan_cp.attention` or :mod:`titan_cp.layout` (``"other"`` when none is)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("titan_cp.attention.") or name == "titan_cp.layout":
            return f"{name.rsplit('.', 1)[-1]}.{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "other"


class TrafficMeter(TorchDispatchMode):
    """Counts the device operations outside the kernel and the HBM bytes they read and write (:func:`op_bytes`);
    ``sites`` splits them by where the engine issued them and which op it was
    (``{("fold.Results.fold", "index_copy"): [ops, bytes]}``). ``kernel``: anything with an ``inside`` flag
    (the flash ops' :class:`CheckedAten`); ``device_type``: as :class:`SyncDetector`'s."""

    def __init__(self, kernel: CheckedAten, device_type: str = "cuda"):
        super().__init__()
        self.kernel, self.ops, self.bytes, self.host_ops = kernel, 0, 0, 0
        self.device_type = device_type
        self.sites: dict[tuple[str, str], list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _on_device(args, out, self.device_type):
            self.host_ops += 1
        elif not self.kernel.inside:
            nbytes = op_bytes(func, args, kwargs, out)
            self.bytes += nbytes
            self.ops += nbytes > 0
            if nbytes:
                entry = self.sites.setdefault((engine_site(), func.__name__.split(".")[0].rstrip("_")), [0, 0])
                entry[0] += 1
                entry[1] += nbytes
        return out


# ---------------------------------------------------------------------------- one layer, every rank
@dataclass
class RankTrace:
    """What one rank's traced layer did."""

    rank: int
    steps: int
    calls: list[FlashCall] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    segments: list[tuple[str, bool, tuple[int, ...], tuple[int, ...], int | None, int]] = field(default_factory=list)
    outside_ops: int = 0  # operations outside the kernel that move data (views and allocations excluded)
    outside_bytes: int = 0  # HBM bytes they read and write
    sites: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (site, op): [ops, bytes]
    host_ops: int = 0  # host operations outside the layout's and the tiles' plans (redone in every layer)

    def calls_per_step(self, op: str) -> float:
        return sum(c.op == op for c in self.calls) / self.steps


def _inputs(batch: int, local: int, heads: int, kv_heads: int, head_dim: int, dtype, v_head_dim: int) -> tuple:
    """Fake ``(B, H, S, E)`` views of token-major ``(B, S, H, E)`` storage, as the model hands them over
    (``v`` and ``dout`` at ``v_head_dim``)."""

    def make(h, e=head_dim):
        return torch.empty(batch, local, h, e, dtype=dtype, device=CUDA).transpose(1, 2)

    return make(heads), make(kv_heads), make(kv_heads, v_head_dim), make(heads, v_head_dim)


def simulate(
    strategy: str,
    seq_len: int,
    cp: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    doc_lens=None,
    balance: str = "doc_zigzag",
    ulysses_degree: int = 1,
    causal: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    kernel: CUDAFlashKernel | None = None,
    window: int | None = None,
    chunk: int | None = None,
    v_head_dim: int | None = None,
) -> list[RankTrace]:
    """One layer's forward + backward of ``strategy`` for each of the ``cp`` ranks (module docstring).

    ``doc_lens``: one list of document lengths per batch row (``None``: one causal document);
    ``window``, ``chunk``: the layer's mask; ``v_head_dim``: v's own (multi-head latent attention; ``None``:
    ``head_dim``). A host synchronisation raises :class:`HostSyncError`.
    """
    s = get_strategy(strategy)
    batch = 1 if doc_lens is None else len(doc_lens)
    layout = layout_module.get_layout(seq_len, cp, balance, doc_lens)
    meter = MeteredFlash(kernel)
    mask = Mask(causal, window, chunk)
    traces = []
    with fake_cuda() as (_, aten):
        for mesh in fake_meshes(strategy, cp, ulysses_degree):
            ctx = CPContext(mesh, layout, mask, head_dim**-0.5, meter, heads, kv_heads)
            q, k, v, dout = _inputs(batch, seq_len // cp, heads, kv_heads, head_dim, dtype, v_head_dim or head_dim)
            aten.calls.clear()
            meter.segments.clear()
            traffic = TrafficMeter(aten)
            with comm.count_comm() as sent, SyncDetector(), traffic:
                out, saved = s.forward(ctx, q, k, v)
                s.backward(ctx, dout, q, k, v, out, saved)
            trace = RankTrace(s.layout_rank(mesh), s.ring_size(cp, ulysses_degree), list(aten.calls))
            trace.violations, trace.bytes_sent, trace.segments = (
                list(aten.violations),
                sent.bytes_sent,
                list(meter.segments),
            )
            trace.outside_ops, trace.outside_bytes, trace.host_ops = traffic.ops, traffic.bytes, traffic.host_ops
            trace.sites = traffic.sites
            traces.append(trace)
            aten.violations.clear()
    return traces
