"""Group merges of :mod:`titan_cp.attention.fold` against a float64 merge of every partial at once.

Random steps of packed partial results (repeated rows in one call, rows no call reaches, rows seeing
no key in a partial, steps with no call that a strategy skips) folded under every group budget:
one step per group (every merged row through an fp32 slot), a few, and all steps in one group (no
slot at all). Forward output and lse and the query gradient must match to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from titan_cp.attention.fold import Grads, Results, make_folds

SIZE, H, E = 24, 3, 4


def _steps(seed: int):
    g = torch.Generator().manual_seed(seed)
    steps = []
    for s in range(5):
        if s == 3:  # nothing received at this step: no call, and the strategy skips it
            steps.append([])
            continue
        calls = []
        for _ in range(int(torch.randint(1, 3, (1,), generator=g))):
            rows = torch.randint(0, SIZE - 2, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
            out = torch.randn(len(rows), H, E, generator=g)
            lse = torch.randn(H, len(rows), generator=g)
            blind = torch.rand(len(rows), generator=g) < 0.2  # saw no key in this partial: output 0
            lse[:, blind], out[blind] = float("-inf"), 0.0
            grad = torch.randn(len(rows), H, E, generator=g)
            calls.append((rows, out, lse, grad))
        steps.append(calls)
    return steps


def _reference(steps):
    lse_parts = [[] for _ in range(SIZE)]
    for calls in steps:
        for rows, out, lse, grad in calls:
            for p, r in enumerate(rows.tolist()):
                lse_parts[r].append((lse[:, p].double(), out[p].double(), grad[p].double()))
    out = torch.zeros(SIZE, H, E, dtype=torch.float64)
    lse = torch.full((H, SIZE), float("-inf"), dtype=torch.float64)
    dq = torch.zeros(SIZE, H, E, dtype=torch.float64)
    for r, parts in enumerate(lse_parts):
        if not parts:
            continue
        ls = torch.stack([p[0] for p in parts])  # (n, H)
        total = torch.logsumexp(ls, 0)
        seen = ~torch.isneginf(total)
        w = torch.where(seen, torch.exp(ls - total), 0.0)
        out[r] = (w.unsqueeze(-1) * torch.stack([p[1] for p in parts])).sum(0)
        lse[:, r] = total
        dq[r] = torch.stack([p[2] for p in parts]).sum(0)
    return out, lse, dq


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [1, 10, 10_000], ids=["step_each", "a_few", "all_at_once"])
def test_group_merges_match_one_merge_of_every_partial(seed, budget):
    steps = _steps(seed)
    folds = make_folds([[c[0] for c in calls] for calls in steps], SIZE, torch.device("cpu"), budget)
    if budget == 10_000:
        assert folds.slots == 0  # one group: nothing in fp32 slots
    q = torch.empty(SIZE, H, E)
    results, dq = Results(q, folds), Grads(q, folds)
    for s, calls in enumerate(steps):
        if calls:  # as the ring does: a step with nothing received is not folded
            results.fold(s, [(c[1], c[2]) for c in calls])
            dq.add(s, [c[3] for c in calls])
    out, lse = results.finish()
    want_out, want_lse, want_dq = _reference(steps)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq.finish().double(), want_dq, atol=1e-5, rtol=1e-5)
    assert bool((out[-2:] == 0).all()) and bool(torch.isneginf(lse[:, -2:]).all())  # rows no call reaches


@pytest.mark.parametrize("mean,seed,ranks", [(1024, 23, 3), (4096, 11, 4), (16384, 11, 2)])
def test_groups_hold_no_more_than_a_merge_per_step(mean, seed, ranks):
    """On every rank's ring steps (CP 8, 131072 tokens of log-normal documents under doc_local): the partials
    a group keeps and its fp32 slots never exceed what a merge per step held (one step's packed output, the
    adopted one aside, and an fp32 slot, two rows' bytes, for every row reached twice or more) by more than
    a quarter of the query buffer; and on ``ranks`` ranks or more some merged rows need no fp32 slot at all
    (fewer of them with documents long enough to span most ranks)."""
    from titan_cp.attention.ring import ring_steps
    from titan_cp.attention.tiling import CAUSAL
    from titan_cp.data.row_mixes import lognormal_doc_lens
    from titan_cp.layout import get_layout

    layout = get_layout(131072, 8, "doc_local", [lognormal_doc_lens(131072, mean, seed=seed, sigma=1.5)])
    fewer = 0
    for r in range(8):
        ring = ring_steps(layout, r, 8, lambda i: (i,), CAUSAL, 1, torch.device("cpu"))
        for dests, folds in [([st.tiles.q_dest(1) for st in ring.steps], ring.folds)]:
            count = torch.zeros(layout.local_len, dtype=torch.int64)
            for d in (d for ds in dests for d in ds):
                count += torch.bincount(d, minlength=layout.local_len)
            merging = int((count > 1).sum())
            whole = [(s, c) for s, ds in enumerate(dests) for c, d in enumerate(ds) if len(d) == len(count)]
            adopted = (
                whole[0]
                if whole and bool((dests[whole[0][0]][whole[0][1]] == torch.arange(len(count))).all())
                else None
            )
            step_out = max(sum(len(d) for c, d in enumerate(ds) if (s, c) != adopted) for s, ds in enumerate(dests))
            per_step = 2 * merging + step_out
            assert folds.peak_rows <= per_step + layout.local_len // 4, (r, folds.peak_rows, per_step)
            fewer += folds.slots < merging
    assert fewer >= ranks
