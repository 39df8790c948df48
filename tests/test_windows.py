"""Sliding-window, chunked and sink attention under every strategy, against the fp64 reference with the
dense mask (documents, causal, window, chunk) and the sinks in the softmax denominator: output and the
gradients of q, k, v and the sinks (each rank's share summed over the cp ranks), worlds 1-4, packed
documents; windows of 1, 7, shorter and longer than a shard; chunk sizes that do and do not divide the
documents. The windows also with the ``math`` kernel, which takes the window itself (as the CUDA flash
kernel does): a band is then one windowed segment. Tolerance as in test_attention.py: fp32 summation
order only."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import max_errors, run_case
from titan_cp import SequenceLayout, local_attention

TOL = 5e-5
SEQ = 48
HEADS = {1: (4, 2), 2: (4, 2), 3: (6, 3), 4: (8, 2)}
DOCS = [[5, 17, 1, 25], [48]]  # one-token document, one longer than a shard at every world > 1


def _cases(strategy: str, world: int, ulysses: int, kernel: str | None = None) -> list[dict]:
    heads, kv_heads = HEADS[world]
    shard = SEQ // world
    masks = [
        dict(window=1),
        dict(window=7, sinks=True),
        dict(window=max(2, shard - 3)),
        dict(window=shard + 5, sinks=True),
        dict(chunk=4),
        dict(chunk=10, sinks=True),
        dict(chunk=6, window=3),
        dict(sinks=True),
    ]
    cases = []
    for i, extra in enumerate(masks):
        if kernel is not None and "window" not in extra:
            continue
        for balance in ("zigzag", "doc_local") if i % 2 == 0 else ("doc_zigzag", "contiguous"):
            cases.append(
                dict(
                    strategy=strategy,
                    ulysses=ulysses,
                    seq=SEQ,
                    batch=2,
                    heads=heads,
                    kv_heads=kv_heads,
                    causal=True,
                    balance=balance,
                    doc_lens=DOCS,
                    seed=world * 10 + i,
                    kernel=kernel,
                    **extra,
                )
            )
    return cases


def _check(rank, world, strategy, ulysses, kernel=None):
    cases = _cases(strategy, world, ulysses, kernel)
    return [max_errors(*run_case(case, world)) for case in cases]


@pytest.mark.parametrize(
    "strategy,world,ulysses",
    [
        ("ring", 1, 1),
        ("ring", 2, 1),
        ("ring", 3, 1),
        ("ring", 4, 1),
        ("allgather", 2, 1),
        ("allgather", 3, 1),
        ("allgather", 4, 1),
        ("ulysses", 2, 1),
        ("ulysses", 4, 1),
        ("hybrid", 4, 2),
    ],
)
def test_windows_chunks_and_sinks_match_the_dense_reference(dist_pools, strategy, world, ulysses):
    _assert_exact(dist_pools, strategy, world, ulysses, None)


@pytest.mark.parametrize(
    "strategy,world,ulysses", [("ring", 2, 1), ("ring", 4, 1), ("allgather", 3, 1), ("ulysses", 2, 1), ("hybrid", 4, 2)]
)
def test_windows_taken_by_the_kernel_match_the_dense_reference(dist_pools, strategy, world, ulysses):
    """``math`` takes the window natively: windowed tiles, bottom-right aligned, one segment per band."""
    _assert_exact(dist_pools, strategy, world, ulysses, "math")


def _assert_exact(dist_pools, strategy, world, ulysses, kernel):
    cases = _cases(strategy, world, ulysses, kernel)
    failures = []
    for rank, results in enumerate(dist_pools.run(world, _check, strategy, ulysses, kernel)):
        for case, errs in zip(cases, results):
            bad = {k: v for k, v in errs.items() if not v <= TOL}
            if bad:
                failures.append(
                    f"rank {rank} { ({k: case.get(k) for k in ('balance', 'window', 'chunk', 'sinks')}) }: {bad}"
                )
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(window=0), "window must be a positive integer"),
        (dict(window=-3), "window must be a positive integer"),
        (dict(window=2.5), "window must be a positive integer"),
        (dict(chunk=0), "chunk must be a positive integer"),
        (dict(window=4, causal=False), "window is a causal sliding window"),
        (dict(sinks=torch.zeros(3)), r"sinks must be a \(4,\) tensor"),
        (dict(sinks=torch.zeros(4, 1)), r"sinks must be a \(4,\) tensor"),
        (dict(sinks=torch.zeros(4, dtype=torch.long)), "sinks must be floating point"),
        (dict(causal="no"), "causal must be True or False, got 'no'"),  # a truthy string: causal, silently
        (dict(causal=0), "causal must be True or False, got 0"),
        (dict(causal=None), "causal must be True or False, got None"),
    ],
)
def test_bad_masks_name_the_argument(kwargs, message):
    q = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match=message):
        local_attention(q, q[:, :2], q[:, :2], **kwargs)
    assert SequenceLayout(8, 1).seq_len == 8
