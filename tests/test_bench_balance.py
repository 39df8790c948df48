"""benchmarks.balance (what scripts/bench_balance.py prints): the exact pair counter, the
balances it compares, the records; and the script's command line, run as a process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import balance as bb
from titan_cp import SequenceLayout
from titan_cp.balance import balance_names

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_balance.py"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add wake-up latency (as the script itself sets)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dense_pair_matrix(positions, doc_lens):
    """W[r, j] from the dense S x S causal-within-document mask (the reference, small S only)."""
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    s = doc.numel()
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    mask = (doc[:, None] == doc[None, :]) & (j <= i)
    owner = torch.empty(s, dtype=torch.long)
    for r, p in enumerate(positions):
        owner[p] = r
    onehot = torch.nn.functional.one_hot(owner, len(positions)).double()
    return (onehot.T @ mask.double() @ onehot).round().long()


doc_rows = st.integers(1, 4).flatmap(
    lambda cp: st.tuples(
        st.just(cp),
        st.lists(st.integers(1, 40), min_size=1, max_size=12).map(
            # pad the row to a multiple of 2*cp with one more document so every balance applies
            lambda lens: lens + ([2 * cp - sum(lens) % (2 * cp)] if sum(lens) % (2 * cp) else [])
        ),
    )
)


@settings(max_examples=25, deadline=None)
@given(doc_rows)
def test_pair_matrix_matches_dense_mask_and_plans(case):
    cp, lens = case
    for balance in balance_names():
        layout = SequenceLayout(sum(lens), cp, balance, [lens])
        positions = [layout.index(r) for r in range(cp)]
        w = bb.pair_matrix(positions, *bb.doc_structure(lens))
        assert torch.equal(w, dense_pair_matrix(positions, lens))
        work, steps, tiles = bb.layout_work(layout)  # titan_cp's mask tiles
        assert torch.equal(w.sum(1), work)
        assert torch.equal(bb.ring_step_work(w), steps)
        # runs rebuilt from positions give the same tiles as the layout's own runs
        rsteps, rtiles = bb.ring_tiles([bb.runs_of(p, *bb.doc_structure(lens)) for p in positions])
        assert torch.equal(rsteps, steps) and torch.equal(rtiles, tiles)


@pytest.mark.parametrize("cp", [2, 4])
def test_every_balance_counts_all_pairs_exactly(cp):
    rows = bb.make_rows("code_repo", 2048, 1, seed=3)
    for balance in bb.ALL_BALANCES:
        if balance == "torch_per_doc_head_tail":
            continue  # rejects these rows, see below
        got = bb.row_measure(balance, rows[0], cp)
        assert int(got["work"].sum()) == bb.causal_doc_total(rows[0]) == int(got["steps"].sum())
        assert got["work"].shape == (cp,) and got["steps"].shape == (cp, cp)


def test_mixes_fill_the_row_deterministically():
    for mix in bb.BALANCE_MIXES:
        rows = bb.make_rows(mix, 8192, 2, seed=1)
        assert all(sum(r) == 8192 and min(r) >= 1 for r in rows)
        assert rows == bb.make_rows(mix, 8192, 2, seed=1)
        assert rows[0] != rows[1]
    huge = bb.make_rows("one_huge", 8192, 1, seed=0)[0]
    assert max(huge) >= 8192 // 2


def test_contiguous_is_worse_than_doc_zigzag_on_one_huge_document():
    rows = bb.make_rows("one_huge", 8192, 2, seed=0)
    for cp in (2, 4):
        cont = bb.measure("one_huge", cp, "contiguous", rows)
        doc = bb.measure("one_huge", cp, "doc_zigzag", rows)
        assert cont["max_over_mean"] > 1.3
        assert doc["max_over_mean"] <= 1.05 and doc["ring_critical_over_ideal"] <= 1.05
        assert cont["max_over_mean"] > doc["max_over_mean"]
        assert doc["ring_critical_over_ideal"] >= doc["max_over_mean"]  # sum of maxima >= max of sums


def test_torch_head_tail_is_our_zigzag():
    for cp in (2, 4):
        ours = SequenceLayout(64, cp, "zigzag")
        theirs, pad_to = bb.torch_positions("torch_head_tail", [64], cp)
        assert pad_to == 1
        for r in range(cp):
            assert torch.equal(theirs[r].sort().values, ours.index(r).sort().values)


def test_torch_per_document_rule_and_padding():
    lens = [5, 11, 16]  # 5 and 11 are not multiples of 2*cp = 4
    rec = bb.measure("m", 2, "torch_per_doc_head_tail", [lens])
    assert rec["max_over_mean"] is None and rec["ring_critical_over_ideal"] is None
    assert "2 of 3 documents" in rec["note"]
    padded = bb.measure("m", 2, "torch_per_doc_head_tail_padded_regrouped", [lens])
    assert padded["padding_fraction"] == pytest.approx((3 + 1) / (32 + 4), abs=1e-4)
    # regrouped on lengths that already satisfy the rule is exactly doc_zigzag
    ok = [4, 8, 12]
    positions, _ = bb.torch_positions("torch_per_doc_head_tail_padded_regrouped", ok, 2)
    layout = SequenceLayout(24, 2, "doc_zigzag", [ok])
    for r in range(2):
        assert torch.equal(positions[r].sort().values, layout.index(r).sort().values)


def test_torch_per_document_indices_are_document_major():
    """torch's docstring draws rank 0 = [0, 3, 4, 5, 10, 11, 12, 15] for documents (4, 8, 4) on 2 ranks;
    its _generate_indices() lists rank 0's and rank 1's chunks document by document, so the
    contiguous Shard(seq) hands rank 0 all of document 0 instead."""
    real, _ = bb.torch_positions("torch_per_doc_head_tail", [4, 8, 4], 2)
    assert real[0].tolist() == [0, 3, 1, 2, 4, 5, 10, 11]
    regrouped, _ = bb.torch_positions("torch_per_doc_head_tail_padded_regrouped", [4, 8, 4], 2)
    assert regrouped[0].tolist() == [0, 3, 4, 5, 10, 11, 12, 15]


def test_ptrr_block_mask_is_the_flex_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    lens = [100, 200, 50, 162, 256, 256]
    doc_start, _ = bb.doc_structure(lens)

    def doc_causal(b, h, q, k):
        return (doc_start[q] == doc_start[k]) & (k <= q)

    ref = create_block_mask(doc_causal, 1, 1, 1024, 1024, device="cpu", BLOCK_SIZE=128)
    got = bb.ptrr_block_mask(lens)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "kv_indices", "full_kv_indices"):
        assert torch.equal(getattr(ref, name), getattr(got, name)), name


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(1, 300), min_size=1, max_size=20), st.floats(0.0, 1.0))
def test_greedy_doc_is_an_equal_partition(cp, lens, alpha):
    lens = lens + ([cp - sum(lens) % cp] if sum(lens) % cp else [])
    positions = bb.greedy_doc_positions(lens, cp, alpha)
    assert all(p.numel() == sum(lens) // cp for p in positions)
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(sum(lens)))


def test_rank_pairs_sum_to_the_row():
    lens = bb.make_rows("code_repo", 4096, 1, seed=2)[0]
    layout = SequenceLayout(4096, 4, "doc_zigzag", [lens])
    pairs = bb.rank_pairs(layout)
    assert int(pairs.sum()) == bb.causal_doc_total(lens)
    assert torch.equal(pairs, bb.layout_work(layout)[0])


def test_script_prints_records_and_plots(tmp_path):
    png = tmp_path / "balance.png"
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--seq-len",
            "1024",
            "--cps",
            "2",
            "4",
            "--rows",
            "1",
            "--mixes",
            "one_huge",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    recs = [json.loads(line) for line in out.splitlines()]
    assert len(recs) == 2 * len(bb.ALL_BALANCES)
    for r in recs:
        assert {"mix", "cp", "balance", "max_over_mean", "ring_critical_over_ideal"} <= r.keys()
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
