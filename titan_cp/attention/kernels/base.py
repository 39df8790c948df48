"""The kernel interface, packed segments, and the registry that turns a name into a checked kernel.

Every kernel computes dense attention of one tile (see :mod:`titan_cp.attention.masks`)::

    forward(q, k, v, causal, scale)                    -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale)   -> (dq, dk, dv)

    q:            (batch, q_heads, sq, head_dim)        in the input dtype
    k:            (batch, kv_heads, sk, head_dim)       kv_heads divides q_heads (GQA)
    v:            (batch, kv_heads, sk, v_dim)          a value head dim of its own (MLA: 192 / 128)
    out, dout:    (batch, q_heads, sq, v_dim)
    lse:          (batch, q_heads, sq)                  fp32, natural log
    dq, dk, dv:   like q, k and v
    causal:       top-left aligned; the tiles make every causal call square

and many tiles packed token-major into one variable-length call (:class:`Segments`)::

    varlen_forward(q, k, v, seg, causal, scale)                  -> (out, lse)
    varlen_backward(dout, q, k, v, out, lse, seg, causal, scale) -> (dq, dk, dv)

    q: (total_q, q_heads, head_dim)     out, dout: (total_q, q_heads, v_dim)
    k: (total_k, kv_heads, head_dim)    v: (total_k, kv_heads, v_dim)      lse: (q_heads, total_q) fp32

``backward`` receives the *final* ``out`` and ``lse`` of the whole attention, not the
tile's own: with ``P = exp(q k^T * scale - lse)`` and ``D = rowsum(dout * out)`` the tile's
gradients are then exact pieces of the full gradient (the flash-attention backward)::

    dv = P^T dout       dS = P * (dout v^T - D)       dq = dS k * scale       dk = dS^T q * scale

Every kernel takes a value head dim of its own (``v_dim``, multi-head latent attention). One whose
backend needs equal dims (ATen's CPU and CUDA flash kernels, flash-attn 2) pads the smaller side with
zeros to their common dim (:func:`common_head_dim`) and slices its results back (:func:`head_slice`);
exact, since zero columns add nothing to ``q k^T`` and ``P [v, 0] = [P v, 0]``, ``D`` included::

    forward    [out, 0] = attn(q, k, [v, 0])                         (v_dim < head_dim: MLA)
    backward   (dq, dk, [dv, *]) = dattn([dout, 0], q, k, [v, 0], [out, 0])
    and with v_dim > head_dim q and k padded instead, dq and dk sliced
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
HALF = (torch.float16, torch.bfloat16)


def unit_stride(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor as it is when its last dimension has unit stride, else a contiguous copy.

    Flash kernels (ATen's CPU and CUDA ones, flash-attn) index the head dimension as dense
    memory: a transposed, expanded (stride 0) or otherwise strided last dimension would be read
    wrong, so every kernel passes its inputs through here first. Other dimensions may have any
    stride (slices, expanded heads); the kernels take those as they are."""
    return tuple(x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous() for x in xs)


def common_head_dim(*xs: Tensor) -> tuple[Tensor, ...]:
    """Each tensor zero-padded in its last dim to the largest last dim among them (those already that wide
    as they are): what a kernel needing equal q/k and v head dims runs on (module docstring)."""
    width = max(x.shape[-1] for x in xs)
    return tuple(x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in xs)


def kernel_head_dim(head_dim: int, v_dim: int) -> int:
    """The head dim a kernel runs q/k (``head_dim``) and v (``v_dim``) at: the larger, to which a kernel
    needing equal dims pads the other (what :func:`check_kernel` checks against the kernel's limits)."""
    return max(head_dim, v_dim)


def head_slice(x: Tensor, width: int) -> Tensor:
    """``x[..., :width]``: a result of a padded call back at its own head dim (a view; ``x`` where it is that wide)."""
    return x if x.shape[-1] == width else x.narrow(-1, 0, width)


def empty_result(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of a packed call without a query segment: ``(total_q, H, v_dim)`` and ``(H, total_q)`` fp32."""
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _offsets(lens: Sequence[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return out


@dataclass(frozen=True)
class Segments:
    """Segment i is q[cu_q[i]:cu_q[i+1]] against k[cu_k[i]:cu_k[i+1]] of token-major packed buffers."""

    cu_q: torch.Tensor  # (n+1,) int32 on the tensors' device
    cu_k: torch.Tensor  # (n+1,) int32
    max_q: int
    max_k: int
    host_q: tuple[int, ...]  # the same offsets on the host, for kernels that loop (never read a device tensor)
    host_k: tuple[int, ...]

    @classmethod
    def from_offsets(cls, host_q: Sequence[int], host_k: Sequence[int], device: torch.device | str) -> Segments:
        """Segments from cumulative offsets held on the host (``[0, ..., total]``, ``n+1`` each).

        One host-to-device copy for both offset tensors. Every segment with queries must
        have keys (flash kernels give an empty key range an lse of ``+inf``).
        """
        host_q, host_k = tuple(int(x) for x in host_q), tuple(int(x) for x in host_k)
        assert len(host_q) == len(host_k) >= 1 and host_q[0] == host_k[0] == 0, (host_q, host_k)
        both = torch.tensor([host_q, host_k], dtype=torch.int32).to(device, non_blocking=True)
        widths = lambda c: max((b - a for a, b in zip(c, c[1:])), default=0)  # noqa: E731
        return cls(both[0], both[1], widths(host_q), widths(host_k), host_q, host_k)

    @classmethod
    def from_lengths(cls, q_lens: Sequence[int], k_lens: Sequence[int], device: torch.device | str) -> Segments:
        """Segments from per-segment lengths (host integers)."""
        return cls.from_offsets(_offsets(q_lens), _offsets(k_lens), device)

    def __len__(self) -> int:
        return len(self.host_q) - 1


class AttentionKernel:
    """A local tile kernel; subclasses implement :meth:`forward` and :meth:`backward`.

    Kernels with ``native_varlen = True`` run all tiles of a mask in one
    :meth:`varlen_forward`/:meth:`varlen_backward` call; the default implementation here
    loops over the segments (on the host offsets) with :meth:`forward`/:meth:`backward`.

    ``devices`` (device types), ``dtypes``, ``max_head_dim`` and ``head_dim_multiple`` say
    what the kernel runs on; ``None`` means no restriction. :func:`check_kernel` reads them,
    and :meth:`unavailable` (a class method) says why the kernel cannot be built here at all
    (a package missing or broken), or ``None``.
    """

    name = "base"
    native_varlen = False
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    max_head_dim: int | None = None
    head_dim_multiple: int = 1

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this kernel cannot be built in this environment (a predicate such as "needs the X
        package, which is not installed"), or ``None`` when it can."""
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` of one tile (shapes in the module docstring)."""
        raise NotImplementedError

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` of one tile, given the whole attention's final ``out`` and ``lse``."""
        raise NotImplementedError

    def varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, seg: Segments, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` of the packed segments ``seg``: by default one :meth:`forward` per segment."""
        outs, lses = [], []
        for (a, b), (c, d) in zip(zip(seg.host_q, seg.host_q[1:]), zip(seg.host_k, seg.host_k[1:])):
            if a == b:
                continue
            assert d > c, f"segment with queries [{a}, {b}) has no keys"
            qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d]))
            out, lse = self.forward(qs, ks, vs, causal, scale)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        if not outs:
            return empty_result(q, v)
        return torch.cat(outs), torch.cat(lses, dim=1)

    def varlen_backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        seg: Segments,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` of the packed segments ``seg``: by default one :meth:`backward` per segment."""
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (a, b), (c, d) in zip(zip(seg.host_q, seg.host_q[1:]), zip(seg.host_k, seg.host_k[1:])):
            if a == b:
                continue
            ts = [x.transpose(0, 1)[None] for x in (dout[a:b], q[a:b], k[c:d], v[c:d], out[a:b])]
            g = self.backward(ts[0], ts[1], ts[2], ts[3], ts[4], lse[None, :, a:b], causal, scale)
            dq[a:b] += g[0][0].transpose(0, 1)
            dk[c:d] += g[1][0].transpose(0, 1)
            dv[c:d] += g[2][0].transpose(0, 1)
        return dq, dk, dv

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


# ---------------------------------------------------------------------------- registry
_REGISTRY: dict[str, Callable[[], AttentionKernel]] = {}
_INSTANCES: dict[str, AttentionKernel] = {}


def register_kernel(name: str, factory: Callable[[], AttentionKernel]) -> None:
    """Make a kernel selectable by name (``factory`` is usually the kernel class)."""
    _REGISTRY[name] = factory
    _INSTANCES.pop(name, None)


def _unavailable(factory: Callable[[], AttentionKernel]) -> str | None:
    check = getattr(factory, "unavailable", None)
    return check() if callable(check) else None


def default_kernel_name(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel ``None``/``"auto"`` picks: ``cpu_varlen`` on CPU (packed segments, short ones
    batched, long ones through ATen's CPU flash kernel); on CUDA ``cuda_flash`` for
    fp16/bf16 (PyTorch's own variable-length flash kernel: no extra package, and the same
    flash-attention algorithm; flash-attn is used only when named) and ``math`` otherwise."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu_varlen"
    if device.type == "cuda" and dtype in HALF:
        return "cuda_flash"
    return "math"


def _choices() -> str:
    return ", ".join(repr(n) for n in sorted(_REGISTRY)) + " or None/'auto' for the default"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def get_kernel(name: str | None, device: torch.device, dtype: torch.dtype) -> AttentionKernel:
    """The kernel called ``name``, or (``None`` / ``"auto"``) the default for ``device`` and ``dtype``.

    Raises ``ValueError`` for an unknown name and for a kernel that cannot be built here (its
    package missing or failing to import, with the reason). What the kernel runs on is checked
    by :func:`check_kernel`.
    """
    if name in (None, "auto"):
        name = default_kernel_name(device, dtype)
        if name == "math" and torch.device(device).type == "cuda":
            warnings.warn(
                f"attention on cuda in {dtype_name(dtype)} runs the dense 'math' kernel (S x S scores in fp32); "
                "compute in bfloat16 or float16 for the flash kernel (the trainer: "
                'training.mixed_precision_param = "bfloat16"), or name the kernel to silence this',
                stacklevel=3,
            )
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {_choices()}")
    if name not in _INSTANCES:
        reason = _unavailable(_REGISTRY[name])
        if reason is not None:
            raise ValueError(f"attention kernel {name!r} {reason}; or choose one of {_choices()}")
        _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]


def _problem(
    kern: AttentionKernel | type[AttentionKernel], device_type: str, dtype: torch.dtype, head_dim: int
) -> str | None:
    """Why ``kern`` (a kernel or kernel class) cannot run this attention, or ``None``."""
    if kern.devices is not None and device_type not in kern.devices:
        return f"runs on {'/'.join(kern.devices)} tensors, but q, k, v are on {device_type}"
    if kern.dtypes is not None and dtype not in kern.dtypes:
        return f"takes {'/'.join(dtype_name(d) for d in kern.dtypes)} tensors, got {dtype_name(dtype)}"
    if (kern.max_head_dim is not None and head_dim > kern.max_head_dim) or head_dim % kern.head_dim_multiple:
        limits = [f"a multiple of {kern.head_dim_multiple}"] if kern.head_dim_multiple > 1 else []
        if kern.max_head_dim is not None:
            limits.append(f"at most {kern.max_head_dim}")
        return f"takes head_dim {' and '.join(limits)}, got {head_dim}"
    return None


def _fitting(device_type: str, dtype: torch.dtype, head_dim: int) -> list[str]:
    """Registered kernels (those given as classes) that can be built here and run this attention."""
    return [
        name
        for name, factory in sorted(_REGISTRY.items())
        if isinstance(factory, type)
        and _problem(factory, device_type, dtype, head_dim) is None
        and _unavailable(factory) is None
    ]


def check_kernel(
    kernel: str | AttentionKernel | None, device: torch.device, dtype: torch.dtype, head_dim: int
) -> AttentionKernel:
    """The kernel to run attention of ``dtype`` tensors on ``device`` with ``head_dim``, checked.

    ``kernel``: a registered name, ``None``/``"auto"`` (see :func:`default_kernel_name`), or
    a kernel object. Raises ``ValueError`` naming the problem and the choices when the name is
    unknown, the kernel cannot be built here, or it does not run on the device, the dtype or
    the head dimension. ``head_dim``: the one the kernel runs at, q/k's, or v's where that is larger
    (a kernel needing equal dims pads the smaller to it, module docstring).
    """
    device = torch.device(device)
    if not dtype.is_floating_point:
        raise ValueError(f"attention needs floating-point q, k, v; got {dtype_name(dtype)}")
    if int(head_dim) != head_dim or head_dim < 1:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim}")
    kern = kernel if isinstance(kernel, AttentionKernel) else get_kernel(kernel, device, dtype)
    problem = _problem(kern, device.type, dtype, head_dim)
    if problem is not None:
        hint = ""
        if kern.dtypes is not None and dtype not in kern.dtypes and device.type == "cuda":
            hint = ' (or compute in bfloat16: the trainer\'s training.mixed_precision_param = "bfloat16")'
        choices = _fitting(device.type, dtype, head_dim)
        default = default_kernel_name(device, dtype)
        or_default = f" or None (the default, {default!r})" if default in choices else ""
        raise ValueError(
            f"attention kernel {kern.name!r} {problem}; for {dtype_name(dtype)} on {device.type} with head_dim "
            f"{head_dim} choose one of {choices}{or_default}{hint}"
        )
    return kern
