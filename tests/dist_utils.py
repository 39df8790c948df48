"""Helpers that run inside the gloo workers of the distributed tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.reference import reference_attention
from titan_cp import SequenceLayout, cp_attention
from titan_cp.attention import CPHandle, register_kernel
from titan_cp.attention.kernels import CPUFlashKernel

_MESHES: dict[tuple, object] = {}


class LoopVarlenKernel(CPUFlashKernel):
    """Drives block.py's packed variable-length route (the one flash-attn's varlen kernels take
    on CUDA) on CPU: tiles are packed and unpacked exactly as there, each segment run by the CPU kernel."""

    name = "cpu_varlen_loop"
    native_varlen = True


register_kernel("cpu_varlen_loop", LoopVarlenKernel)


def get_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A cached cpu DeviceMesh over the whole world (creating process groups is not free)."""
    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def cp_mesh(strategy: str, world: int, ulysses: int = 1):
    if strategy == "hybrid":
        return get_mesh((world // ulysses, ulysses), ("cp_ring", "cp_ulysses"))
    return get_mesh((world,), ("cp",))


def make_inputs(
    seed: int, batch: int, heads: int, kv_heads: int, seq: int, dim: int, dtype=torch.float32, v_dim: int | None = None
):
    """``q, k (B, H|K, S, dim)``, ``v (B, K, S, v_dim)`` and ``dout (B, H, S, v_dim)`` (``v_dim``: ``dim`` when
    ``None``; multi-head latent attention gives v a head dim of its own)."""
    g = torch.Generator().manual_seed(seed)
    v_dim = dim if v_dim is None else v_dim
    q = torch.randn(batch, heads, seq, dim, generator=g)
    k = torch.randn(batch, kv_heads, seq, dim, generator=g)
    v = torch.randn(batch, kv_heads, seq, v_dim, generator=g)
    dout = torch.randn(batch, heads, seq, v_dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


def run_case(case: dict, world: int, dtype=torch.float32):
    """cp attention for ``case`` on this rank; returns (shards of the reference, cp results), fp32.

    The reference is computed in fp64 on the full sequence from the same fp32 inputs
    (upcast from ``dtype`` when the case runs in low precision).
    """
    strategy = case["strategy"]
    mesh = cp_mesh(strategy, world, case.get("ulysses", 1))
    rank = CPHandle(mesh, strategy).rank
    layout = SequenceLayout(case["seq"], world, case["balance"], case.get("doc_lens"))
    q, k, v, dout = make_inputs(
        case.get("seed", 0),
        case["batch"],
        case["heads"],
        case["kv_heads"],
        case["seq"],
        case.get("dim", 8),
        dtype,
        case.get("v_dim"),
    )

    masks = {key: case.get(key) for key in ("window", "chunk")}
    sinks = None
    if case.get("sinks"):
        sinks = torch.randn(case["heads"], generator=torch.Generator().manual_seed(case.get("seed", 0) + 7))
    qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
    ref_sinks = None if sinks is None else sinks.clone().requires_grad_()
    ref = reference_attention(qf, kf, vf, case.get("doc_lens"), case["causal"], sinks=ref_sinks, **masks)
    inputs = (qf, kf, vf) if sinks is None else (qf, kf, vf, ref_sinks)
    ref_grads = torch.autograd.grad(ref, inputs, dout.float())

    ql, kl, vl = (layout.shard(x, 2, rank).detach().requires_grad_() for x in (q, k, v))
    cp_sinks = None if sinks is None else sinks.clone().to(dtype).requires_grad_()
    out = cp_attention(
        ql, kl, vl, mesh, layout, strategy, case["causal"], kernel=case.get("kernel"), sinks=cp_sinks, **masks
    )
    local = (ql, kl, vl) if sinks is None else (ql, kl, vl, cp_sinks)
    grads = torch.autograd.grad(out, local, layout.shard(dout, 2, rank))
    expected = [layout.shard(t, 2, rank) for t in (ref,) + tuple(ref_grads[:3])]
    got = [t.float() for t in (out,) + tuple(grads[:3])]
    if sinks is not None:  # each rank's share of the sinks' gradient, summed over the cp ranks
        total = grads[3].float().clone()
        dist.all_reduce(total)
        expected.append(ref_grads[3].float())
        got.append(total)
    return expected, got


def max_errors(expected, got) -> dict[str, float]:
    return {name: (e - g).abs().max().item() for name, e, g in zip(("out", "dq", "dk", "dv", "dsinks"), expected, got)}


def barrier() -> None:
    dist.barrier()
