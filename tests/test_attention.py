"""Every strategy against the fp64-computed full-sequence reference: output and the
gradients of q, k and v, at world sizes 1, 2, 3, 4 (and 8 for the ring), causal and
not, MHA and GQA (kv_heads = 1 included), batch 2, both layouts. The GQA and single-K/V-head
cases give v a head dim of its own (multi-head latent attention: 5 and 12 against q/k's 8,
narrower and wider), so every strategy at every world size runs it.

Tolerance: inputs and cp results are fp32; the only differences from the reference are
fp32 rounding in a different summation order (tile splits and the log-sum-exp merge),
which stay below 1e-5 for unit-variance inputs and sequences this short. We allow 5e-5.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.dist_utils import max_errors, run_case

TOL = 5e-5
SEQ = 48  # divisible by 2N for N = 1, 2, 3, 4 and 8


def _kv_options(world: int) -> list[tuple[int, int | None]]:
    """``(kv_heads, v_dim)``: MHA at one head dim; GQA and a single K/V head with v's own (``None``: q/k's 8)."""
    gqa = 3 if world == 3 else 4
    return [(12, None), (gqa, 5), (1, 12)]


def _cases(strategy: str, world: int, ulysses: int = 1) -> list[dict]:
    cases = []
    for causal, (kv_heads, v_dim), balance in itertools.product(
        (True, False), _kv_options(world), ("contiguous", "zigzag")
    ):
        cases.append(
            dict(
                strategy=strategy,
                ulysses=ulysses,
                seq=SEQ,
                batch=2,
                heads=12,
                kv_heads=kv_heads,
                v_dim=v_dim,
                causal=causal,
                balance=balance,
                seed=world * 100 + kv_heads,
            )
        )
    return cases


def _check_cases(rank, world, cases):
    return [max_errors(*run_case(case, world)) for case in cases]


def _assert_all(results_by_rank, cases, tol=TOL):
    failures = []
    for rank, results in enumerate(results_by_rank):
        for case, errs in zip(cases, results):
            bad = {k: v for k, v in errs.items() if not v <= tol}
            if bad:
                failures.append(f"rank {rank} {case}: {bad}")
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_ring(dist_pools, world):
    cases = _cases("ring", world)
    _assert_all(dist_pools.run(world, _check_cases, cases), cases)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["allgather", "ulysses"])
def test_allgather_and_ulysses(dist_pools, strategy, world):
    cases = _cases(strategy, world)
    _assert_all(dist_pools.run(world, _check_cases, cases), cases)


@pytest.mark.parametrize("world,ulysses", [(1, 1), (2, 1), (2, 2), (3, 3), (3, 1), (4, 2)])
def test_hybrid(dist_pools, world, ulysses):
    cases = _cases("hybrid", world, ulysses)
    _assert_all(dist_pools.run(world, _check_cases, cases), cases)


def _check_bf16(rank, world, cases):
    from tests.dist_utils import make_inputs
    from tests.reference import reference_attention

    out = []
    for case in cases:
        expected, got = run_case(case, world, dtype=torch.bfloat16)
        # single-device bf16 SDPA against the same reference: the error bf16 itself costs
        q, k, v, dout = make_inputs(
            case["seed"], case["batch"], case["heads"], case["kv_heads"], case["seq"], 8, torch.bfloat16
        )
        qb, kb, vb = (x.requires_grad_() for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=case["causal"], enable_gqa=True)
        sdpa_grads = torch.autograd.grad(sdpa, (qb, kb, vb), dout)
        qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
        ref = reference_attention(qf, kf, vf, None, case["causal"])
        ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
        base = max_errors([ref, *ref_grads], [sdpa.float(), *(g.float() for g in sdpa_grads)])
        out.append((max_errors(expected, got), base))
    return out


@pytest.mark.parametrize(
    "strategy,world,ulysses", [("ring", 4, 1), ("allgather", 3, 1), ("ulysses", 2, 1), ("hybrid", 4, 2)]
)
def test_bf16_error_is_bf16_sized(dist_pools, strategy, world, ulysses):
    """bf16 error at most 3x single-device bf16 SDPA's own error against the fp32 reference (plus 1e-3
    absolute slack for tensors whose SDPA error happens to be tiny)."""
    cases = [
        dict(
            strategy=strategy,
            ulysses=ulysses,
            seq=SEQ,
            batch=2,
            heads=12,
            kv_heads=kv,
            causal=causal,
            balance="zigzag",
            seed=7 + kv,
        )
        for causal in (True, False)
        for kv in (4, 1)
    ]
    for results in dist_pools.run(world, _check_bf16, cases):
        for case, (errs, base) in zip(cases, results):
            for name in errs:
                assert errs[name] <= 3 * base[name] + 1e-3, (case, name, errs[name], base[name])
