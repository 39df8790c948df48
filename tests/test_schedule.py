"""Which schedule ran: ``strategy="ulysses"`` runs its head exchange or the documents' ring schedule,
and the per-step metrics record and the planner's output name the one the op actually ran.

The op's choice is read from what it does (its all-to-alls counted on gloo ranks), never from the
function that names it; the record and the planner must agree with it on a layout of each kind.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import cp_mesh, make_inputs
from titan_cp import SequenceLayout, cp_attention
from titan_cp import plan as P
from titan_cp.attention import CPHandle, attention_schedule
from titan_cp.attention.tiling import CAUSAL, Mask
from titan_cp.data.row_mixes import make_rows
from titan_cp.families.llama3 import model_args
from titan_cp.layout import get_layout
from titan_cp.metrics import StepMetrics, layer_masks

SEQ, WORLD, MIX = 8192, 4, "uniform_short"
# the same documents (ten a row) under two balances: doc_local keeps them whole on their ranks (the
# ring's schedule), doc_zigzag splits every one over all four ranks (the head exchange)
BALANCES = {"doc_local": "ring", "doc_zigzag": "ulysses"}


def _rows() -> list[list[int]]:
    return make_rows(MIX, SEQ, 1, seed=0)


def _all_to_alls(rank: int, world: int, strategy: str, balance: str, rows: list[list[int]]) -> int:
    """All-to-alls this rank's op issued in one forward + backward of ``strategy`` on the layout."""
    from titan_cp.attention import ulysses  # noqa: PLC0415 - the module whose exchange is counted

    mesh = cp_mesh(strategy, world)
    layout = SequenceLayout(SEQ, world, balance, rows)
    q, k, v, dout = (layout.shard(x, 2, CPHandle(mesh, strategy).rank) for x in make_inputs(0, 1, 4, 2, SEQ, 8))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    real, calls = ulysses.all_to_all, []

    def counted(x: torch.Tensor, group: object) -> torch.Tensor:
        calls.append(x.shape)
        return real(x, group)

    ulysses.all_to_all = counted
    try:
        cp_attention(q, k, v, mesh, layout, strategy).backward(dout)
    finally:
        ulysses.all_to_all = real
    return len(calls)


def _record(strategy: str, balance: str, rows: list[list[int]], masks=(CAUSAL,)) -> dict:
    """The trainer's per-step record of one microbatch of ``rows`` sharded under ``balance``."""
    args = model_args("tiny", vocab_size=256)
    batch = SimpleNamespace(doc_lens=rows, tokens=torch.zeros(len(rows), SEQ))
    step_data = SimpleNamespace(microbatches=[batch], global_valid_tokens=SEQ, padding_tokens=0)
    metrics = StepMetrics(torch.device("cpu"), WORLD, args, 1, SEQ, SEQ, WORLD, balance, strategy, masks)
    metrics.start(0, 2)
    layouts = [get_layout(SEQ, WORLD, balance, rows)]
    return metrics.record(1, 1.0, 1.0, 1e-3, step_data, 1.0, {}, layouts)


def _planned(balance: str, capsys: pytest.CaptureFixture) -> tuple[dict, str]:
    """The planner's JSON line and table row of CP 4 Ulysses on the same documents (``--doc-mix``; ``--all``: every
    plan estimated, not only those that can be the fastest)."""
    argv = ["--ngpu", str(WORLD), "--gpu", "cpu", "--doc-mix", MIX, "--model.flavor", "debugmodel_gqa", "--all"]
    argv += ["--training.seq_len", str(SEQ), "--training.local_batch_size", "1"]
    assert P.main([*argv, "--parallelism.context_parallel_load_balancer", balance]) == 0
    out = capsys.readouterr().out
    recs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    rec = next(r for r in recs if (r["strategy"], r["cp"], r["tp"]) == ("ulysses", WORLD, 1))
    table = [line for line in out.splitlines() if " cp4 tp1 " in line and " ulysses " in line]
    return rec, table[0]


def test_metrics_and_planner_name_the_schedule_ulysses_ran(dist_pools, capsys):
    """On documents kept whole (doc_local) Ulysses runs the ring's schedule and issues no all-to-all; on
    the same documents split over every rank (doc_zigzag) it exchanges heads. The metrics record's
    ``attention_schedule`` and the planner's ``schedule`` (JSON and table) say so in both cases."""
    rows = _rows()
    assert len(rows[0]) > 1  # several documents a row: the schedule depends on where they lie
    for balance, expect in BALANCES.items():
        counts = dist_pools.run(WORLD, _all_to_alls, "ulysses", balance, rows)
        ran = "ring" if all(n == 0 for n in counts) else "ulysses"
        assert ran == expect and (ran == "ring" or all(n > 0 for n in counts)), (balance, counts)
        assert _record("ulysses", balance, rows)["attention_schedule"] == ran, balance
        rec, row = _planned(balance, capsys)
        words = row.split()
        assert rec["schedule"] == ran and words[words.index("ulysses") + 1] == ran, (balance, rec, row)


def test_the_record_names_every_strategy_s_schedule():
    """Ring and all-gather run their own; hybrid runs the ring's where Ulysses does; one rank is
    ``local``; layers whose masks run different schedules are named together; the record's keys keep
    their order with the schedule after the ETA."""
    rows = _rows()
    assert _record("ring", "doc_zigzag", rows)["attention_schedule"] == "ring"
    assert _record("allgather", "doc_local", rows)["attention_schedule"] == "allgather"
    assert _record("hybrid", "doc_local", rows)["attention_schedule"] == "ring"
    assert _record("hybrid", "doc_zigzag", rows)["attention_schedule"] == "hybrid"
    assert attention_schedule("ulysses", 1, get_layout(SEQ, 1, "doc_local", rows)) == "local"
    # a window of 64 keys reaches so few rows of another rank that even doc_zigzag's split documents
    # stay home: the windowed layers run the ring's schedule, the full ones exchange heads
    masks = layer_masks(model_args("tiny", vocab_size=256, attention_pattern="WF", window=64))
    assert masks == (Mask(True, 64), CAUSAL)
    record = _record("ulysses", "doc_zigzag", rows, masks)
    assert record["attention_schedule"] == "ring+ulysses"
    assert list(record)[10:12] == ["eta_seconds", "attention_schedule"]
