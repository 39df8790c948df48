"""The self-check's section ``linear``: the gated delta rule's CP arithmetic on one device, against fp64.

One document of ``seq`` tokens is cut into ``pieces`` equal pieces, as a layout cuts it over ranks, and
run the way the CP op runs them (:mod:`titan_cp.attention.linear`): the first piece from zero at v's
width, the others in one wide call from ``[0 | I]`` (their outputs from zero, the query carried through
the transitions, their summaries ``[B | M]``), each later piece's starting state composed from the
summaries before it and its share added. Its output and gradients are compared with the fp64 torch kernel over the
whole document (from a zero state), and its time with one call over the whole document: the cost of
cutting it (the wide call and the states' composition; the exchange between ranks is not in it). The
backend is the op's own on the device (``fla`` on CUDA where installed, else torch).

A case passes when each of ``out, dq, dk, dv, dg, dbeta`` is within ``tol x max|fp64|`` of the fp64
result (``tol``: 2e-2 in bf16, 1e-4 in fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from titan_cp.attention.linear import fla, gated_delta
from titan_cp.attention.linear.chunks import chunked
from titan_cp.attention.linear.op import gated_delta_backend

FULL_CASES = ({"seq": 8192, "pieces": 8, "k_heads": 8, "v_heads": 16, "d": 128},)
SMALL_CASES = ({"seq": 96, "pieces": 4, "k_heads": 2, "v_heads": 4, "d": 8},)
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
Timer = Callable[[Callable[[], object], torch.device, int], dict]


def _inputs(case: dict, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    t, hk, hv, d = case["seq"], case["k_heads"], case["v_heads"], case["d"]
    q, k = (torch.randn(t, hk, d, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, d, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(t, hv, generator=gen)) * 0.1
    beta = torch.rand(t, hv, generator=gen)
    return [x.to(device, dtype if x.dim() == 3 else torch.float32) for x in (q, k, v, g, beta)]


def _fp64(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """The torch kernel in fp64 over the whole document, from a zero state."""
    rep = v.shape[1] // q.shape[1]
    q, k = (gated_delta.l2norm(x.double().repeat_interleave(rep, 1)) for x in (q, k))
    runs = ((0, q.shape[0]),)
    chunks = chunked(runs, q.shape[0], 64)
    prep = gated_delta.prepare(chunks, q * q.shape[-1] ** -0.5, k, v.double(), g.double(), beta.double())
    return gated_delta.scan(chunks, runs, prep, (0,), False)[0]


def _cut(backend: str, x: list[Tensor], pieces: int) -> Tensor:
    """The document as ``pieces`` pieces, the CP op's way: the first from zero, the others wide from ``[0 | I]``
    (outputs from zero, the query carried through the transitions, summaries ``[B | M]``), each later piece's
    state composed from the summaries before it and its share added."""
    t = x[0].shape[0]
    runs = tuple((i * t // pieces, (i + 1) * t // pieces - i * t // pieces) for i in range(pieces))
    later = tuple(range(1, pieces))
    if backend == "fla":
        p: Any = fla.Prepared(x[0], x[1], x[2], x[3], x[4], x[0].shape[-1] ** -0.5, True)
        head, rest = fla.split(p, [runs[0][1], t - runs[0][1]])
        first, wide = fla.scan(head, [runs[0][1]], False), fla.scan(rest, [n for _, n in runs[1:]], True)
    else:
        rep = x[2].shape[1] // x[0].shape[1]
        q, k = (gated_delta.l2norm(y.float().repeat_interleave(rep, 1)) for y in x[:2])
        chunks = chunked(runs, t, 64)
        p = gated_delta.prepare(chunks, q * q.shape[-1] ** -0.5, k, *(y.float() for y in x[2:]))
        first, wide = gated_delta.scan(chunks, runs, p, (0,), False), gated_delta.scan(chunks, runs, p, later, True)
    dv = first[0].shape[-1]
    state = first[1][0].float()  # the state after the first piece: its offset B
    outs, at = [first[0]], 0
    for j in later:
        n = runs[j][1]
        o = wide[0][at : at + n]
        outs.append(o[..., :dv] + torch.einsum("thk,hkv->thv", o[..., dv:], state.to(o.dtype)))
        state = gated_delta.apply(wide[1][j - 1].float(), state)
        at += n
    return torch.cat(outs)


def check_linear(device: torch.device, small: bool, timed: Timer, repeats: int, backend: str = "auto") -> list[dict]:
    """Section ``linear``: one record per case (module docstring); ``backend`` as the op takes it."""
    backend = gated_delta_backend(backend, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    records = []
    for case in SMALL_CASES if small else FULL_CASES:
        rec: dict[str, Any] = dict(
            section="linear", case=f"gated_delta_{case['seq']}_{case['pieces']}", backend=backend
        )
        rec.update(case)
        x = [t.requires_grad_() for t in _inputs(case, device, dtype)]
        want = _fp64(*x)
        dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).to(device)
        grads_want = torch.autograd.grad(want, x, dout.double())
        got = _cut(backend, x, case["pieces"])
        grads = torch.autograd.grad(got, x, dout.to(got.dtype))
        errors = {
            name: float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max())
            for name, a, b in zip(("out", "dq", "dk", "dv", "dg", "dbeta"), (got, *grads), (want, *grads_want))
        }
        rec["errors"] = errors
        rec["status"] = "ok" if max(errors.values()) <= TOL[dtype] else "fail"
        step = _step(backend, x, dout.to(got.dtype))
        rec["seconds_whole"], rec["seconds_cut"] = (timed(step(n), device, repeats) for n in (1, case["pieces"]))
        rec["cut_overhead"] = rec["seconds_cut"]["min"] / rec["seconds_whole"]["min"] - 1
        records.append(rec)
    return records


def _step(backend: str, x: list[Tensor], dout: Tensor) -> Callable[[int], Callable[[], object]]:
    """A forward + backward of the document in ``n`` pieces, as a timed call."""
    return lambda n: lambda: torch.autograd.grad(_cut(backend, x, n), x, dout)
