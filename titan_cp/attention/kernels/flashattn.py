"""``flash_attn``: the flash-attn package's private forward/backward functions (only when named).

flash-attn changes its private interface between releases; the kernel reads what the
installed release takes instead of assuming one:

- **Parameter names** from each function's signature, or, where the function is a
  ``torch.library`` custom op (flash-attn 2.7 on), whose Python signature reads
  ``(*args, **kwargs)``, from the op's schema. The window is passed as two ints or a pair,
  optional arguments (``softcap``, ``alibi_slopes``, ``return_softmax``, ``deterministic``,
  ``rng_state``, ``block_table``) only where the release has them. A required parameter the
  kernel does not know is an error when the kernel is built, not at the first call.
- **Results**: the lse is picked out of the forward's tuple by dtype and shape
  (:func:`first_lse`), whichever tuple the release returns.

An install that fails to import (a wheel built for another torch) makes the kernel
unavailable, with the import error as the reason (:meth:`FlashAttnKernel.unavailable`).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import Tensor

from titan_cp.attention.kernels.base import HALF, AttentionKernel, Segments, common_head_dim, empty_result, head_slice


@functools.lru_cache(maxsize=1)
def _import_problem() -> str | None:
    """The exception importing flash-attn's interface raises, as text (``None`` when it imports)."""
    try:
        importlib.import_module("flash_attn.flash_attn_interface")
    except Exception as exc:  # noqa: BLE001 - any failure (ImportError, OSError, an undefined symbol) is the reason
        return f"{type(exc).__name__}: {exc}"
    return None


def flash_attn_problem() -> str | None:
    """Why the flash-attn package cannot be used here (not installed, or failing to import), or ``None``."""
    if importlib.util.find_spec("flash_attn") is None:
        return "needs the flash-attn package, which is not installed (pip install flash-attn)"
    problem = _import_problem()
    if problem is not None:
        return (
            f"needs the flash-attn package, which is installed but fails to import ({problem}); reinstall a "
            f"flash-attn built for torch {torch.__version__}"
        )
    return None


def flash_attn_available() -> bool:
    """True when the flash-attn package imports and a CUDA device is present."""
    return torch.cuda.is_available() and flash_attn_problem() is None


def flash_attn_version() -> str:
    try:
        import flash_attn  # noqa: PLC0415 - optional dependency

        return str(getattr(flash_attn, "__version__", "unknown"))
    except Exception:  # noqa: BLE001
        return "(not importable)"


class Params(NamedTuple):
    """A function's parameter names in order, and those without a default."""

    names: tuple[str, ...]
    required: frozenset[str]


def parameters(fn: Callable[..., Any]) -> Params:
    """``fn``'s parameters: from a ``torch.library`` op's schema where ``fn`` is one (a custom op's
    Python signature reads ``(*args, **kwargs)``), else from its Python signature."""
    op = getattr(fn, "_opoverload", None) or getattr(fn, "default", None) or fn  # CustomOpDef, packet, overload
    schema = getattr(op, "_schema", None)
    if schema is not None:
        args = schema.arguments
        return Params(tuple(a.name for a in args), frozenset(a.name for a in args if not a.has_default_value()))
    params = inspect.signature(fn).parameters.values()
    if any(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for p in params):
        raise ValueError(
            f"flash-attn {flash_attn_version()}: cannot read the parameters of {getattr(fn, '__name__', fn)!r} "
            "(neither a signature nor an op schema); use kernel='cuda_flash'"
        )
    return Params(tuple(p.name for p in params), frozenset(p.name for p in params if p.default is p.empty))


def first_lse(res: Sequence[Any], shape: tuple[int, ...]) -> torch.Tensor:
    """The log-sum-exp among a flash-attn forward's results: its one fp32 tensor of ``shape``.

    flash-attn's private forwards return different tuples across releases::

        up to 2.6:   (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
        2.7 on:      (out, softmax_lse, S_dmask, rng_state)

    ``out`` comes first in both; the inputs, ``out_padded`` and ``S_dmask`` are fp16/bf16
    (flash-attn takes no fp32) and ``rng_state`` is int64, so the lse is the one fp32 tensor.
    Its shape is checked too: releases that return a padded ``(n, heads, max_q)`` varlen lse
    are not supported.
    """
    for t in res[1:]:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
            if tuple(t.shape) != shape:
                raise RuntimeError(
                    f"flash-attn {flash_attn_version()} returned a log-sum-exp of shape {tuple(t.shape)}, "
                    f"expected {shape}; this flash-attn release is not supported (use kernel='cuda_flash')"
                )
            return t
    raise RuntimeError(
        f"flash-attn {flash_attn_version()}: no fp32 log-sum-exp among the forward's results "
        f"{[type(t).__name__ if not isinstance(t, torch.Tensor) else (tuple(t.shape), t.dtype) for t in res]}; "
        "use kernel='cuda_flash'"
    )


# keyword arguments some flash-attn releases take and others do not: set where present
_OPTIONAL = {
    "softcap": 0.0,
    "alibi_slopes": None,
    "return_softmax": False,
    "block_table": None,
    "deterministic": False,
    "rng_state": None,
}
# positional inputs of each function: (q, k, v) forward, (dout, q, k, v, out, lse, dq, dk, dv) backward
_POSITIONAL = {"fwd": 3, "vfwd": 3, "bwd": 9, "vbwd": 9}
_VARLEN_KEYS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


class FlashAttnKernel(AttentionKernel):
    """The flash-attn package (fp16/bf16 on CUDA); takes GQA natively, tensors as ``(batch, seq, heads, dim)``.

    The tiles make causal calls square, so flash-attn's bottom-right causal alignment agrees
    with the top-left convention of the interface. ``fai``: the module holding the private
    functions (``flash_attn.flash_attn_interface`` by default; tests pass stand-ins). flash-attn 2's
    functions take one head dim for q, k and v: a value dim of its own runs zero-padded, the results
    sliced back (:func:`~.base.common_head_dim`).
    """

    name = "flash_attn"
    native_varlen = True
    devices = ("cuda",)
    dtypes = HALF
    max_head_dim = 256
    head_dim_multiple = 8

    @classmethod
    def unavailable(cls) -> str | None:
        return flash_attn_problem()

    def __init__(self, fai: ModuleType | None = None) -> None:
        if fai is None:
            fai = importlib.import_module("flash_attn.flash_attn_interface")
        self._fn = {
            "fwd": fai._flash_attn_forward,
            "bwd": fai._flash_attn_backward,
            "vfwd": fai._flash_attn_varlen_forward,
            "vbwd": fai._flash_attn_varlen_backward,
        }
        self._params = {key: parameters(fn) for key, fn in self._fn.items()}
        for key, params in self._params.items():
            self._check_covered(key, params)

    def _check_covered(self, key: str, params: Params) -> None:
        """Every required parameter of the installed function is one this kernel passes."""
        extra = dict.fromkeys(_VARLEN_KEYS) if key in ("vfwd", "vbwd") else {}
        passed = set(params.names[: _POSITIONAL[key]]) | set(self._kwargs(params.names, True, 1.0, **extra))
        unknown = sorted(params.required - passed)
        if unknown:
            name = getattr(self._fn[key], "__name__", key)
            raise ValueError(
                f"flash-attn {flash_attn_version()}: {name} requires {unknown}, which this kernel does not "
                "know; this release is not supported (use kernel='cuda_flash')"
            )

    @classmethod
    def _kwargs(cls, params: Sequence[str], causal: bool, scale: float, **extra: Any) -> dict[str, Any]:
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, **extra)
        if "window_size_left" in params:
            kwargs.update(window_size_left=-1, window_size_right=-1)
        elif "window_size" in params:
            kwargs["window_size"] = (-1, -1)
        kwargs.update({k: v for k, v in _OPTIONAL.items() if k in params})
        return kwargs

    @staticmethod
    def _varlen(seg: Segments) -> dict[str, Any]:
        return dict(cu_seqlens_q=seg.cu_q, cu_seqlens_k=seg.cu_k, max_seqlen_q=seg.max_q, max_seqlen_k=seg.max_k)

    def _call(self, key: str, *args: Tensor, causal: bool, scale: float, **extra: Any) -> Any:
        return self._fn[key](*args, **self._kwargs(self._params[key].names, causal, scale, **extra))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        v_dim = v.shape[-1]
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in common_head_dim(q, k, v))
        res = self._call("fwd", qt, kt, vt, causal=causal, scale=scale)
        return head_slice(res[0].transpose(1, 2), v_dim), first_lse(res, (q.shape[0], q.shape[1], q.shape[2]))

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        qt, kt, vt, ot, dot = (x.transpose(1, 2).contiguous() for x in common_head_dim(q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        self._call("bwd", dot, qt, kt, vt, ot, lse.contiguous(), dq, dk, dv, causal=causal, scale=scale)
        dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
        return head_slice(dq, qk_dim), head_slice(dk, qk_dim), head_slice(dv, v_dim)

    def varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, seg: Segments, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        if len(seg) == 0:
            return empty_result(q, v)
        v_dim = v.shape[-1]
        q, k, v = (x.contiguous() for x in common_head_dim(q, k, v))
        res = self._call("vfwd", q, k, v, causal=causal, scale=scale, **self._varlen(seg))
        return head_slice(res[0], v_dim), first_lse(res, (q.shape[1], q.shape[0]))

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
        if len(seg) == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        q, k, v, out, dout = (x.contiguous() for x in common_head_dim(q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        args = (dout, q, k, v, out, lse.contiguous(), dq, dk, dv)
        self._call("vbwd", *args, causal=causal, scale=scale, **self._varlen(seg))
        return head_slice(dq, qk_dim), head_slice(dk, qk_dim), head_slice(dv, v_dim)
