"""Recall accuracy by distance bucket, and the LR schedule."""

import pytest
import torch

from titan_cp.metrics import recall_counts, recall_metrics
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
