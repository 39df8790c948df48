"""A stand-in for flash-linear-attention's ``chunk_gated_delta_rule``: its signature and its state layout,
one token at a time inside (CPU, fp32), so that titan_cp's ``fla`` backend (:mod:`titan_cp.attention.linear.fla`)
runs its own calls here: variable-length pieces, their initial and final states, grouped value heads.

``installed()`` puts ``fla`` and ``fla.ops.gated_delta_rule`` into ``sys.modules`` for a block (with module
specs, as an installed package has); ``CALLS`` counts the calls."""

from __future__ import annotations

import contextlib

import torch

from titan_cp.testing.fla import stand_in

CALLS: list[dict] = []


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    cu_seqlens=None, cu_seqlens_cpu=None, **kwargs,
):  # fmt: skip
    """``o, final``: ``q, k`` ``(1, T, H, K)``, ``v`` ``(1, T, HV, V)``, ``g, beta`` ``(1, T, HV)``, pieces by
    ``cu_seqlens``; ``initial_state`` ``(N, HV, K, V)``; ``o`` ``(1, T, HV, V)``, ``final`` ``(N, HV, K, V)``."""
    assert q.shape[0] == 1 and cu_seqlens is not None and cu_seqlens_cpu is not None
    assert torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
    CALLS.append(dict(pieces=len(cu_seqlens) - 1, v_dim=v.shape[-1], initial=initial_state is not None))
    rep = v.shape[2] // q.shape[2]
    q, k = (x[0].float().repeat_interleave(rep, 1) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    v, g, beta = v[0].float(), g[0].float(), beta[0].float()
    eye = torch.eye(q.shape[-1])
    outs, finals = [], []
    bounds = cu_seqlens_cpu.tolist()
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        s = initial_state[n].float() if initial_state is not None else q.new_zeros(v.shape[1], q.shape[-1], v.shape[-1])
        for t in range(start, end):
            kt, bt = k[t], beta[t].view(-1, 1, 1)
            s = g[t].exp().view(-1, 1, 1) * (eye - bt * kt.unsqueeze(-1) * kt.unsqueeze(-2)) @ s
            s = s + bt * kt.unsqueeze(-1) * v[t].unsqueeze(-2)
            outs.append((s * q[t].unsqueeze(-1)).sum(-2))
        finals.append(s)
    o = torch.stack(outs)[None].to(v.dtype)
    return o, (torch.stack(finals) if output_final_state else None)


def installed() -> contextlib.AbstractContextManager[None]:
    """``import fla`` finds this stand-in inside the block (:func:`titan_cp.testing.fla.stand_in`)."""
    return stand_in(chunk_gated_delta_rule)
