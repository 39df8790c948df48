"""Recall accuracy by distance bucket, the per-step record, the metrics file on resume, and the LR schedule."""

import errno
import json

import pytest
import torch

from titan_cp.metrics import StepMetrics, keep_steps_up_to, recall_counts, recall_metrics, visible_pairs
from titan_cp.optim import lr_lambda


def test_recall_counts_answer_tokens_by_distance_bucket():
    labels = torch.tensor([[5, 6, 7, 8, 9, 10]])
    pred = torch.tensor([[5, 0, 7, 8, 0, 10]])
    distance = torch.tensor([[0, 100, 100, 3000, 9000, 9000]])  # first token is no answer
    counts = recall_counts(pred, labels, distance, [256, 1024, 4096])
    assert counts.tolist() == [[1, 2], [0, 0], [1, 1], [1, 2]]
    m = recall_metrics(counts, [256, 1024, 4096])
    assert m == {"recall_le_256": 0.5, "recall_le_4096": 1.0, "recall_gt_4096": 0.5, "recall": 0.6}


@pytest.mark.parametrize("decay", ["linear", "cosine", "sqrt"])
def test_lr_warms_up_then_decays_to_the_floor(decay):
    f = lr_lambda(warmup_steps=4, total_steps=20, decay_ratio=None, decay_type=decay, min_lr_factor=0.1)
    values = [f(s) for s in range(20)]
    assert values[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert values[4] <= 1.0 and all(a >= b for a, b in zip(values[4:], values[5:]))
    assert values[-1] == pytest.approx(0.1)


def test_step_record_tokens_per_second_mfu_and_eta(monkeypatch):
    """Two microbatches of one 8-token row (documents 3 + 5, then 8) on dp rank 0 of 2: tokens/s
    over every rank's rows, MFU from the model FLOPs of the visible pairs times the dp degree,
    ETA from the mean step time so far."""
    from types import SimpleNamespace

    from titan_cp import metrics
    from titan_cp.families.llama3 import model_args

    args = model_args("tiny", vocab_size=256)
    batch = lambda lens: SimpleNamespace(doc_lens=[lens], tokens=torch.zeros(1, 8))  # noqa: E731
    step_data = SimpleNamespace(microbatches=[batch([3, 5]), batch([8])], global_valid_tokens=30, padding_tokens=2)
    step = StepMetrics(torch.device("cpu"), 4, args, 2, tokens_per_step=32, seq_len=8, cp=2, balance="doc_zigzag")
    step.mfu.peak = 1e30  # an estimate the run never exceeds
    clock = iter([100.0, 104.0])  # start(), then the record: 4 s for 2 steps
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    step.start(first_step=3, last_step=10)
    r = step.record(5, 2.5, 0.7, 1e-3, step_data, seconds=0.5, sources={"chat": 9})
    pairs = visible_pairs([[3, 5]], 8) + visible_pairs([[8]], 8)
    flops = args.training_flops(16, pairs) * 2
    assert r["tokens_per_second"] == 64 and r["mfu"] == pytest.approx(flops / 0.5 / 4 / 1e30)
    assert r["eta_seconds"] == pytest.approx(4 / 2 * 5) and r["tokens_drawn/chat"] == 9
    assert list(r)[:11] == [
        "step", "loss", "grad_norm", "lr", "tokens_per_second", "global_valid_tokens", "padding_tokens",
        "mfu", "mfu_is_estimate", "memory_bytes", "eta_seconds",
    ]  # fmt: skip
    assert (r["step"], r["loss"], r["grad_norm"], r["lr"], r["global_valid_tokens"]) == (5, 2.5, 0.7, 1e-3, 30)


def test_metrics_file_keeps_the_steps_up_to_the_resumed_one_and_every_record_aside(tmp_path):
    """A run that crashed after step 6 (its last line torn) resumes at step 4: the file keeps steps
    1-4, so the resumed run's 5, 6, ... appear once; the whole file, steps 5 and 6 included, is kept
    as metrics.jsonl.1 (never a record deleted)."""
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo'
    path.write_text(text)
    assert keep_steps_up_to(path, 4) == (3, tmp_path / "metrics.jsonl.1")
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert (tmp_path / "metrics.jsonl.1").read_text() == text
    assert keep_steps_up_to(path, 4) == (0, None) and not (tmp_path / "metrics.jsonl.tmp").exists()
    assert keep_steps_up_to(path, 0) == (4, tmp_path / "metrics.jsonl.2") and path.read_text() == ""
    assert len((tmp_path / "metrics.jsonl.2").read_text().splitlines()) == 4
    assert keep_steps_up_to(tmp_path / "none.jsonl", 3) == (0, None) and not (tmp_path / "none.jsonl").exists()


def _record(step: int) -> dict:
    return {"step": step, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_second": 1.0, "mfu": 0.5,
            "memory_bytes": 0, "eta_seconds": 0.0}  # fmt: skip


class _FullDisk:
    """A line-buffered file on a disk that has just filled up: every write fails with ENOSPC."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        raise OSError(errno.ENOSPC, "No space left on device")  # the unwritten line, flushed again


def test_a_full_disk_under_the_metrics_file_is_one_line_naming_the_file_and_the_step(tmp_path, monkeypatch):
    """The write of step 3's record refused (ENOSPC): one UserError naming the file, the step, the
    free bytes and what to do, not an OSError traceback; the records before it stay. The same when
    the disk is full as a resumed run sets the file's later records aside."""
    from titan_cp.config import load_config
    from titan_cp.errors import UserError
    from titan_cp.metrics import MetricsLogger

    cfg = load_config(["--metrics.log_freq", "100"])
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsLogger(tmp_path, cfg, enabled=True)
    metrics.log(_record(1))
    metrics.log(_record(2))
    metrics._jsonl.close()
    metrics._jsonl = _FullDisk()
    line = (
        rf"metrics of step 3 could not be written to {path}: the disk is full \(\d+ bytes free\); the records before "
        r"it are kept, and a rerun starts from step 1\. Free space there \(or choose another job.dump_folder, or set metrics.save_jsonl_file = '' to "
        r"write none\) and rerun"
    )
    with pytest.raises(UserError, match=line):
        metrics.log(_record(3))
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    monkeypatch.setattr(type(path), "write_bytes", lambda self, data: _FullDisk().write(data))
    with pytest.raises(UserError, match=rf"metrics of step 2 could not be written to {path}: the disk is full"):
        MetricsLogger(tmp_path, cfg, enabled=True, resumed_step=1)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_metrics_file_history_is_kept_on_a_fresh_start_and_reopened_when_deleted(tmp_path):
    """A run from step 0 over an existing metrics.jsonl keeps it as metrics.jsonl.1 (then .2); the file
    deleted mid-run is written again from the next record on."""
    from titan_cp.config import load_config
    from titan_cp.metrics import MetricsLogger

    cfg = load_config(["--metrics.log_freq", "100"])
    path = tmp_path / "metrics.jsonl"
    for run in (1, 2, 3):
        metrics = MetricsLogger(tmp_path, cfg, enabled=True)
        metrics.log({"step": 1, "run": run}, console=False)
        if run == 3:
            path.unlink()
            metrics.log({"step": 2, "run": run}, console=False)
        metrics.close()
    assert [json.loads(line)["run"] for line in (tmp_path / "metrics.jsonl.1").read_text().splitlines()] == [1]
    assert [json.loads(line)["run"] for line in (tmp_path / "metrics.jsonl.2").read_text().splitlines()] == [2]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [2]
