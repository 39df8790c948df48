"""Linear-attention layers under CP (titan_cp.attention.linear): the gated delta rule, Mamba2's SSD and the
short convolution on every balance at world sizes 1-4 (and a 2-D hybrid mesh), forward and every gradient,
against a token-by-token fp64 reference of each document on its own; what crosses rank boundaries, counted."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import cp_mesh
from tests.reference import reference_conv, reference_gated_delta, reference_ssd
from titan_cp.attention.comm import count_comm
from titan_cp.attention.handle import CPHandle
from titan_cp.attention.linear import (
    cp_causal_conv1d,
    cp_gated_delta_rule,
    cp_ssd,
    local_causal_conv1d,
    local_gated_delta_rule,
)
from titan_cp.attention.linear.plan import state_plan
from titan_cp.layout import SequenceLayout
from titan_cp.testing.linear import every_late_middle

SEQ = 96  # a multiple of 2N for N = 1..4 (zigzag)
ROWS = {
    "one document": None,  # every row one document: it crosses every rank boundary
    "packed": [[5, 40, 3, 48], [61, 1, 34]],  # long documents across two or more boundaries, short ones whole
}
TOL = 2e-5  # fp32 kernels against the fp64 reference, relative to each tensor's largest entry


def _inputs(kind: str, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    if kind == "gated_delta":  # 2 q/k heads, 4 value heads (grouped), d_k 8, d_v 6
        return {
            "q": r(batch, SEQ, 2, 8),
            "k": r(batch, SEQ, 2, 8),
            "v": r(batch, SEQ, 4, 6),
            "g": -F.softplus(r(batch, SEQ, 4)) * 0.3,
            "beta": torch.sigmoid(r(batch, SEQ, 4)),
        }
    if kind == "ssd":  # 4 heads of dim 3, 2 groups of state 5
        return {
            "x": r(batch, SEQ, 4, 3),
            "dt": F.softplus(r(batch, SEQ, 4)),
            "a": -(torch.rand(4, generator=gen, dtype=torch.float64) + 0.2),
            "b": r(batch, SEQ, 2, 5),
            "c": r(batch, SEQ, 2, 5),
        }
    return {"x": r(batch, SEQ, 6), "weight": r(6, 4), "bias": r(6)}


def _reference(kind: str, inputs: dict, doc_lens) -> torch.Tensor:
    if kind == "gated_delta":
        return reference_gated_delta(*inputs.values(), doc_lens, qk_l2norm=True)
    if kind == "ssd":
        return reference_ssd(*inputs.values(), doc_lens)
    return reference_conv(*inputs.values(), doc_lens)


@functools.cache
def expected(kind: str, rows: str) -> tuple[dict, torch.Tensor, dict, torch.Tensor]:
    """Inputs, a seeded output gradient, and the reference's output and input gradients (fp64)."""
    doc_lens = ROWS[rows]
    inputs = {n: t.requires_grad_() for n, t in _inputs(kind, 2).items()}
    out = _reference(kind, inputs, doc_lens)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = dict(zip(inputs, torch.autograd.grad(out, list(inputs.values()), dout)))
    return {n: t.detach() for n, t in inputs.items()}, dout, grads, out.detach()


def _run(kind: str, local: dict, mesh, layout: SequenceLayout) -> torch.Tensor:
    if kind.startswith("gated_delta"):
        backend = "fla" if kind == "gated_delta_fla" else "torch"
        return cp_gated_delta_rule(*local.values(), mesh, layout, qk_l2norm=True, chunk=8, backend=backend)
    if kind == "ssd":
        return cp_ssd(*local.values(), mesh, layout, chunk=8)
    return cp_causal_conv1d(*local.values(), mesh, layout)


def _sharded(layout: SequenceLayout, rank: int, name: str, t: torch.Tensor) -> torch.Tensor:
    return t if name in ("a", "weight", "bias") else layout.shard(t, 1, rank)


def linear_case(rank: int, world: int, kind: str, balance: str, rows: str, strategy: str, data) -> dict[str, float]:
    """The largest error of the output and each gradient on this rank, relative to the tensor's largest entry
    (gradients of parameters every rank shares, A and the convolution's weight and bias, summed over ranks)."""
    inputs, dout, grads, out_ref = data
    mesh = cp_mesh(strategy, world, 2 if strategy == "hybrid" else 1)
    cp_rank = CPHandle(mesh, strategy).rank
    layout = SequenceLayout(SEQ, world, balance, ROWS[rows] if ROWS[rows] is not None else None)
    local = {n: _sharded(layout, cp_rank, n, t.float()).requires_grad_() for n, t in inputs.items()}
    out = _run(kind, local, mesh, layout)
    got = dict(zip(local, torch.autograd.grad(out, list(local.values()), _sharded(layout, cp_rank, "", dout).float())))
    errors = {"out": _rel(out, _sharded(layout, cp_rank, "", out_ref))}
    for name, g in got.items():
        if name in ("a", "weight", "bias"):
            torch.distributed.all_reduce(g)
        errors[name] = _rel(g, _sharded(layout, cp_rank, name, grads[name]))
    return errors


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("balance", ["contiguous", "zigzag", "doc_zigzag", "doc_local"])
@pytest.mark.parametrize("kind", ["gated_delta", "ssd", "conv"])
def test_linear_layers_equal_each_document_alone(dist_pools, world, balance, kind):
    for rows in ROWS:
        results = dist_pools.run(world, linear_case, kind, balance, rows, "ring", expected(kind, rows))
        for rank, errors in enumerate(results):
            assert max(errors.values()) < TOL, (rows, rank, errors)


@pytest.mark.parametrize("kind", ["gated_delta", "ssd", "conv"])
def test_linear_layers_on_a_hybrid_mesh(dist_pools, kind):
    """On a 2-D (ring x ulysses) cp mesh the linear layers run on the layout's ranks, flattened."""
    results = dist_pools.run(4, linear_case, kind, "doc_zigzag", "packed", "hybrid", expected(kind, "packed"))
    assert max(max(e.values()) for e in results) < TOL, results


def late_case(rank: int, world: int, kind: str, balance: str, rows: str, data) -> dict[str, float]:
    """:func:`linear_case` with each document's longest later piece, where it is a middle one, run after the
    exchange from its state (priced or not: :data:`~titan_cp.attention.linear.plan.MARGIN` forced), the pieces
    after it wide, corrected from the state it leaves (the second exchange); ``n_late``: such pieces anywhere,
    ``crosses``: whether their states cross a rank boundary."""
    with every_late_middle():
        with count_comm() as counted:
            if kind == "gated_delta_fla":
                from tests import fla_standin  # noqa: PLC0415

                with fla_standin.installed():
                    errors = linear_case(rank, world, kind, balance, rows, "ring", data)
            else:
                errors = linear_case(rank, world, kind, balance, rows, "ring", data)
        layout = SequenceLayout(SEQ, world, balance, ROWS[rows])
        plans = [state_plan(layout, r, 2, late=True) for r in range(world)]
    second = any(p.second is not None and p.second.crosses for p in plans)
    per = 2 if kind == "gated_delta_fla" else 3  # forward and return (and the recomputing backward's forward)
    errors["wrong_exchanges"] = float(counted.calls != per * (plans[0].crosses + second))
    errors["n_late"] = float(sum(len(p.states2) for p in plans))
    errors["crosses"] = float(second)
    return errors


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kind", ["gated_delta", "gated_delta_fla"])
def test_late_middle_pieces_equal_each_document_alone(dist_pools, world, kind):
    """Middle pieces run after the exchange from their states, the pieces after them corrected from the states
    they leave (a second exchange): forward and every gradient as each document alone, on the torch kernel (the
    custom op, its backward recomputing) and through ``fla`` (plain autograd), at world 2-4 on three balances."""
    crossed = 0.0
    for balance in ("contiguous", "zigzag", "doc_local"):
        for rows in ROWS:
            results = dist_pools.run(world, late_case, kind, balance, rows, expected("gated_delta", rows))
            n_late, crosses = results[0].pop("n_late"), results[0].pop("crosses")
            for errors in results[1:]:
                errors.pop("n_late"), errors.pop("crosses")
            assert max(max(e.values()) for e in results) < TOL, (balance, rows, results)
            crossed += n_late * crosses
    assert crossed > 0  # the second exchange ran


def bytes_case(rank: int, world: int, seq: int, kind: str) -> int:
    mesh = cp_mesh("ring", world)
    layout = SequenceLayout(seq, world, "doc_zigzag")
    gen = torch.Generator().manual_seed(0)
    if kind == "gated_delta":
        x = [torch.randn(1, seq // world, *s, generator=gen) for s in ((2, 8), (2, 8), (4, 6))]
        g, beta = -torch.rand(1, seq // world, 4, generator=gen), torch.rand(1, seq // world, 4, generator=gen)
        args = (*x, g, beta)
    else:
        args = (torch.randn(1, seq // world, 6, generator=gen), torch.randn(6, 4, generator=gen), None)
    with count_comm() as counted:
        if kind == "gated_delta":
            out = cp_gated_delta_rule(*(a.requires_grad_() for a in args), mesh, layout, chunk=16)
        else:
            out = cp_causal_conv1d(args[0].requires_grad_(), args[1].requires_grad_(), None, mesh, layout)
        out.sum().backward()
    return counted.bytes_sent


@pytest.mark.parametrize("kind", ["gated_delta", "conv"])
def test_what_crosses_is_the_same_at_any_row_length(dist_pools, kind):
    """One document over every rank (doc_zigzag: 2N pieces): the bytes a rank sends (forward and backward)
    do not grow with the row: summaries of heads x d_k x (d_v + d_k), halos of kernel - 1 tokens."""
    short, long = (dist_pools.run(4, bytes_case, seq, kind) for seq in (64, 256))
    assert short == long and min(short) > 0, (short, long)
    row = 4 * 8 * (6 + 8) * 4 if kind == "gated_delta" else 6 * 4  # a summary [B | M] in fp32; a halo token
    assert all(b % row == 0 for b in short), short


def test_a_document_whole_on_one_rank_sends_nothing():
    """doc_local keeps short documents whole: a rank whose documents are all its own has no summary to send
    or receive, and where no document crosses anywhere no rank calls the exchange at all."""
    layout = SequenceLayout(64, 4, "doc_local", [[16, 16, 16, 16]])
    plans = [state_plan(layout, r, 1) for r in range(4)]
    assert not any(p.crosses or p.summarize or p.received or any(p.send.values()) for p in plans)
    split = SequenceLayout(64, 4, "doc_local", [[8, 40, 8, 8]])
    plans = [state_plan(split, r, 1) for r in range(4)]
    assert all(p.crosses for p in plans)
    assert sum(len(p.summarize) for p in plans) >= 1


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunk_size_changes_nothing(chunk):
    inputs, dout, grads, out_ref = expected("gated_delta", "packed")
    local = {n: t.float().requires_grad_() for n, t in inputs.items()}
    out = local_gated_delta_rule(*local.values(), ROWS["packed"], qk_l2norm=True, chunk=chunk)
    assert _rel(out, out_ref) < TOL


def test_one_device_conv_with_documents():
    inputs, _, _, out_ref = expected("conv", "packed")
    out = local_causal_conv1d(*(t.float() for t in inputs.values()), ROWS["packed"])
    assert _rel(out, out_ref) < TOL


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "k": a["k"][..., :4]}, "q and k must have the same shape"),
        (lambda a: {**a, "v": a["v"][:, :, :3]}, "must be a multiple of q/k heads"),
        (lambda a: {**a, "g": a["g"][..., :2]}, "one entry per value head"),
        (lambda a: {**a, "beta": a["beta"][:, :10]}, "must agree with the first input"),
    ],
)
def test_bad_shapes_name_the_argument(change, message):
    inputs = {n: t.float() for n, t in _inputs("gated_delta", 1).items()}
    with pytest.raises(ValueError, match=message):
        local_gated_delta_rule(*change(inputs).values())


def fla_case(rank: int, world: int, balance: str, rows: str, data) -> dict[str, float]:
    """:func:`linear_case`'s gated delta rule through the ``fla`` backend (its stand-in, on the CPU)."""
    from tests import fla_standin  # noqa: PLC0415

    fla_standin.CALLS.clear()
    with fla_standin.installed():
        errors = linear_case(rank, world, "gated_delta_fla", balance, rows, "ring", data)
    plan = state_plan(SequenceLayout(SEQ, world, balance, ROWS[rows]), rank, 2)
    width = {0: 6, 1: 6 + 8, 2: 6}  # d_v; the middle pieces' [v | 0] from [0 | I]
    given = (False, True, any(plan.chains[j] for j in plan.groups[2]))  # zero states are not passed
    want = [dict(pieces=len(g), v_dim=width[i], initial=given[i]) for i, g in enumerate(plan.groups) if g]
    errors["wrong_calls"] = float(fla_standin.CALLS != want)
    return errors


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_fla_backend_runs_the_same_pieces_and_states(dist_pools, world):
    """The ``fla`` backend's calls (pieces by cu_seqlens, initial states, [v | 0] and [0 | I] for the middle
    pieces' summaries, the last pieces from their composed states), through a stand-in of fla's function: the same results as the reference, at world 1, 2 and 4."""
    for rows in ROWS:
        for errors in dist_pools.run(world, fla_case, "doc_zigzag", rows, expected("gated_delta", rows)):
            # each piece once: one call for the pieces that start their document, one (wide) for the middle ones,
            # one for the last ones from their composed states, where there are any; plain autograd, so the
            # backward calls nothing again (fla keeps what it needs)
            assert errors.pop("wrong_calls") == 0
            assert max(errors.values()) < TOL, (rows, errors)


def fla_op_case(rank: int, world: int, rows: str, data) -> dict[str, float]:
    """The custom op itself through ``fla`` (what a compiled graph calls: its backward recomputes)."""
    from tests import fla_standin  # noqa: PLC0415
    from titan_cp.attention.linear import op  # noqa: PLC0415

    inputs, dout, grads, out_ref = data
    mesh = cp_mesh("ring", world)
    layout = SequenceLayout(SEQ, world, "doc_local", ROWS[rows])
    local = {n: layout.shard(t, 1, rank).float().requires_grad_() for n, t in inputs.items()}
    handle = CPHandle(mesh, "ring", "doc_local")
    _, docs = handle.register(SEQ, ROWS[rows])
    with fla_standin.installed():
        out = op._gated_delta_op(*local.values(), docs, handle.id, 8**-0.5, True, 64, "fla")
        got = torch.autograd.grad(out, list(local.values()), layout.shard(dout, 1, rank).float())
    errors = {"out": _rel(out, layout.shard(out_ref, 1, rank))}
    errors.update({n: _rel(g, layout.shard(grads[n], 1, rank)) for n, g in zip(local, got)})
    return errors


def test_the_fla_custom_op_recomputes_to_the_same_gradients(dist_pools):
    for errors in dist_pools.run(2, fla_op_case, "packed", expected("gated_delta", "packed")):
        assert max(errors.values()) < TOL, errors
