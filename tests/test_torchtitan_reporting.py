"""What the torchtitan door reports (titan_cp/integrations/torchtitan/reporting.py) and its CPU launcher's
one-process default: no torchtitan needed (tests/test_torchtitan.py runs them inside torchtitan's Trainer).

- torchtitan's ``global_avg_loss`` / ``global_max_loss`` of the losses :func:`loss_for_metrics` returns, on a
  dp 2 x cp 2 gloo mesh, reduced as torchtitan reduces them (sum, and max of ``loss x global / local``
  tokens, over the whole dp x cp loss mesh): the average is unchanged and the max is the max over the dp
  ranks of their rows' mean loss, not of one cp shard's share.
- torchtitan's INFO lines come from rank 0 alone; warnings from every rank.
- ``python -m titan_cp.integrations.torchtitan.train`` without torchrun runs as one process.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist

from titan_cp.integrations.torchtitan import reporting

GLOBAL_TOKENS, LOCAL_TOKENS = 10.0, (4.0, 6.0)  # the step's valid tokens, and each dp rank's rows' (uncut)


def _metrics(rank: int, world: int) -> tuple[float, float, float, float]:
    """(torchtitan's global avg, global max) of the shares as they are and as loss_for_metrics returns them."""
    from tests.dist_utils import get_mesh  # noqa: PLC0415

    mesh = get_mesh((2, 2), ("dp", "cp"))
    dp, cp = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    share = torch.tensor(1.0 + rank)  # this cp rank's share of its dp rank's rows' loss sum / GLOBAL_TOKENS
    out = []
    for returned in (share, reporting.loss_for_metrics(share, mesh["cp"].get_group(), cp)):
        total, local_mean = returned.clone(), returned * GLOBAL_TOKENS / LOCAL_TOKENS[dp]
        dist.all_reduce(total)  # torchtitan's dist_sum over its loss mesh (dp x cp: the whole world here)
        dist.all_reduce(local_mean, op=dist.ReduceOp.MAX)  # its dist_max
        out += [total.item(), local_mean.item()]
    return tuple(out)


def test_global_max_loss_is_the_max_over_dp_ranks_of_their_rows_mean(dist_pools):
    results = dist_pools.run(4, _metrics)
    assert len(set(results)) == 1, results
    avg_as_is, max_as_is, avg, max_ = results[0]
    # ranks 0, 1 (dp 0) hold shares 1 and 2 of rows with 4 valid tokens; ranks 2, 3 (dp 1) 3 and 4 of 6
    means = [(1 + 2) * GLOBAL_TOKENS / LOCAL_TOKENS[0], (3 + 4) * GLOBAL_TOKENS / LOCAL_TOKENS[1]]
    assert avg == avg_as_is == 1 + 2 + 3 + 4  # the average is torchtitan's, unchanged
    assert max_ == pytest.approx(max(means)), (max_, means)
    assert max_as_is == pytest.approx(4 * GLOBAL_TOKENS / LOCAL_TOKENS[1])  # a shard's share: what it was


def test_info_lines_come_from_rank_0_alone(monkeypatch, caplog):
    root = logging.getLogger()
    monkeypatch.setattr(root, "filters", list(root.filters))  # the filter goes with the test
    reporting.log_info_on_rank0()
    reporting.log_info_on_rank0()
    assert sum(isinstance(f, reporting._InfoOnRank0) for f in root.filters) == 1
    with caplog.at_level(logging.INFO):
        for rank in ("0", "1"):
            monkeypatch.setenv("RANK", rank)
            root.info("step on rank %s", rank)
            root.warning("warning on rank %s", rank)
    assert caplog.messages == ["step on rank 0", "warning on rank 0", "warning on rank 1"]


def test_the_cpu_launcher_alone_is_one_process(monkeypatch):
    from titan_cp.integrations.torchtitan import train  # noqa: PLC0415

    keys = [*train.ONE_PROCESS, "MASTER_ADDR", "MASTER_PORT"]
    for key in keys:  # each restored after the test, set or not before it
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    train._one_process_default()
    assert {k: os.environ[k] for k in keys} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
    }  # fmt: skip
    monkeypatch.setenv("LOCAL_RANK", "1")  # under torchrun: its environment, untouched
    monkeypatch.setenv("WORLD_SIZE", "2")
    train._one_process_default()
    assert os.environ["WORLD_SIZE"] == "2"
