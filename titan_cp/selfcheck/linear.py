"""The self-check's section ``linear``: the gated delta rule's CP arithmetic on one device, against fp64.

One document of ``seq`` tokens is cut into ``pieces`` equal pieces, as a layout cuts it over ranks, and
run the way the CP op runs them (:mod:`titan_cp.attention.linear`): one call for the summaries
``[B | M]`` of every piece but the last, the pieces' starting states composed from them, one call over
every piece from its state. Its output and gradients are compared with the fp64 torch kernel over the
whole document (from a zero state), and its time with one call over the whole document: the cost of
cutting it (summaries and the states' composition; the exchange between ranks is not in it). The
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
    chunks = chunked(((0, q.shape[0]),), q.shape[0], 64)
    prep = gated_delta.prepare(chunks, q * q.shape[-1] ** -0.5, k, v.double(), g.double(), beta.double())
    return gated_delta.outputs(chunks, prep, [None])


def _cut(backend: str, x: list[Tensor], pieces: int) -> Tensor:
    """The document as ``pieces`` pieces, the CP op's way: summaries, composed states, every piece."""
    t = x[0].shape[0]
    runs = tuple((i * t // pieces, (i + 1) * t // pieces - i * t // pieces) for i in range(pieces))
    first = tuple(range(pieces - 1))
    middle = tuple(i > 0 for i in first)
    if backend == "fla":
        p = fla.Prepared(x[0], x[1], x[2], x[3], x[4], x[0].shape[-1] ** -0.5, True)
        states = _states(fla.summaries(runs, p, first, middle), pieces)
        return fla.outputs(runs, p, states)
    rep = x[2].shape[1] // x[0].shape[1]
    q, k = (gated_delta.l2norm(y.float().repeat_interleave(rep, 1)) for y in x[:2])
    chunks = chunked(runs, t, 64)
    prep = gated_delta.prepare(chunks, q * q.shape[-1] ** -0.5, k, *(y.float() for y in x[2:]))
    states = _states(gated_delta.summaries(chunks, prep, first, middle), pieces)
    return gated_delta.outputs(chunks, prep, states)


def _states(sent: Tensor, pieces: int) -> list[Tensor | None]:
    """Each piece's starting state composed from the summaries of the pieces before it."""
    states: list[Tensor | None] = [None]
    for j in range(1, pieces):
        states.append(gated_delta.apply(sent[j - 1], states[-1]))
    return states


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
