"""The main job's recall evaluation (``validation.recall_shard_cut``): the full evaluation under CP equals
the one-process model's, and the shard-cut one equals the one-process model run on each shard alone
(every rank's queries see only its own shard's keys). Plus the pieces: documents cut at the shards,
recall by distance in shards, and the keys the mode needs."""

from __future__ import annotations

import pytest
import torch

from titan_cp.data import ByteTokenizer
from titan_cp.data.datasets import SyntheticLookup
from titan_cp.layout import cut_at_shards
from titan_cp.metrics import recall_counts, shard_edges, shard_recall_metrics


def test_cut_at_shards_cuts_documents_where_the_contiguous_shards_meet():
    assert cut_at_shards([[10, 6], [3, 13], [16]], 16, 4) == [[4, 4, 2, 2, 4], [3, 1, 4, 4, 4], [4, 4, 4, 4]]
    assert cut_at_shards(torch.tensor([[8, 8, 0]]), 16, 2) == [[8, 8]]  # zero padding is no document
    with pytest.raises(ValueError, match="not seq_len"):
        cut_at_shards([[10]], 16, 2)


def test_recall_by_distance_in_shards_and_remote():
    edges = shard_edges(16, 4)  # shards of 4 tokens
    distance = torch.tensor([1, 3, 4, 7, 8, 12, 15, 0])
    pred = torch.tensor([5, 0, 5, 5, 0, 5, 0, 5])
    labels = torch.full((8,), 5)
    counts = recall_counts(pred, labels, distance, edges)
    assert counts.tolist() == [[1, 2], [2, 2], [0, 1], [1, 2]]
    metrics = shard_recall_metrics(counts, "_x")
    assert metrics == {
        "recall_shards_0_x": 0.5,
        "recall_shards_1_x": 1.0,
        "recall_shards_2_x": 0.0,
        "recall_shards_3_x": 0.5,
        "recall_remote_x": 0.6,
    }


def test_lookup_documents_ask_each_planted_fact_once():
    from titan_cp.data.datasets import LOOKUP_FACTS, LOOKUP_KEYS, LOOKUP_VALUES

    source = SyntheticLookup(ByteTokenizer(), seed=1, tokens=512)
    doc = source.document(4)
    assert len(doc.tokens) == 512 and doc.tokens == source.document(4).tokens
    assert len(doc.answer_spans) == len(LOOKUP_KEYS) and sum(doc.loss_mask) == len(LOOKUP_KEYS)
    asked = set()
    for (a, e), d in zip(doc.answer_spans, doc.answer_distances):
        key, fact = LOOKUP_KEYS.index(chr(doc.tokens[a - 1])), LOOKUP_FACTS.index(doc.tokens[a])
        assert e == a + 1 and doc.tokens[a - 2] == ord("?") and doc.loss_mask[a]
        assert fact // len(LOOKUP_VALUES) == key  # the answer is a fact of the key asked
        assert doc.tokens[a - d] == doc.tokens[a] and doc.tokens.index(doc.tokens[a]) == a - d  # its fact, d back
        asked.add(key)
    assert asked == set(range(len(LOOKUP_KEYS)))  # every fact asked once
    assert set(doc.tokens[1 : 1 + len(LOOKUP_KEYS)]) <= set(LOOKUP_FACTS)  # the facts open the document
    held_out = SyntheticLookup(ByteTokenizer(), seed=1, split="validation", tokens=512).document(4)
    assert held_out.tokens != doc.tokens
    with pytest.raises(ValueError, match="at least 25 tokens"):
        SyntheticLookup(ByteTokenizer(), tokens=24)


@pytest.mark.parametrize(
    "keys,message",
    [
        (["--parallelism.context_parallel_load_balancer", "doc_local"], "'contiguous'"),
        (["--parallelism.context_parallel_degree", "1"], "context_parallel_degree > 1"),
        (["--validation.recall_eval", "false"], "recall_eval = true"),
    ],
)
def test_shard_cut_refuses_what_it_cannot_cut(keys, message):
    from titan_cp.config import load_config

    base = ["--job.config_file", "train_configs/cpu_main.toml", "--checkpoint.initial_load_path", ""]
    with pytest.raises(ValueError, match=message):
        load_config(base + keys)


def _validate_and_reference(rank, world, argv):
    """``Trainer.validate()`` under CP, and the same rows through the one-process model: whole, and
    shard by shard (each shard's tokens alone, with their own positions and their documents' pieces);
    the ranks share out the two references."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from titan_cp.config import load_config
    from titan_cp.families.llama3 import build_model
    from titan_cp.loss import IGNORE_INDEX
    from titan_cp.metrics import recall_metrics
    from titan_cp.train import Trainer

    trainer = Trainer(load_config(argv))
    try:
        metrics = trainer.validate()
        state = get_model_state_dict(trainer.parts[0], options=StateDictOptions(full_state_dict=True))
        model = build_model("tiny", vocab_size=trainer.tokenizer.vocab_size, device="cpu")
        model.load_state_dict(state)
        model.eval()
        S, cp = trainer.cfg.training.seq_len, trainer.dims.cp
        buckets, edges = trainer.cfg.validation.recall_buckets, shard_edges(S, cp)
        trainer.val_loader.load_state_dict(trainer.val_start)
        ref = {}
        for mode in ("", "_shard_cut")[rank::world]:
            loss = tokens = 0.0
            counts, shards = (
                torch.zeros(len(buckets) + 1, 2, dtype=torch.float64),
                torch.zeros(cp, 2, dtype=torch.float64),
            )
            trainer.val_loader.load_state_dict(trainer.val_start)
            for _ in range(trainer.val_steps):
                for b in next(trainer.val_loader).microbatches:
                    (lens,) = b.doc_lens  # one row
                    pieces = [(0, S, lens)] if not mode else _shards(cut_at_shards([lens], S, cp)[0], S // cp)
                    preds, ce = [], 0.0
                    with torch.no_grad():
                        for lo, hi, lens in pieces:
                            doc_lens = torch.tensor([lens])
                            c, p = model(
                                b.tokens[:, lo:hi],
                                positions=b.positions[:, lo:hi],
                                doc_lens=doc_lens,
                                labels=b.labels[:, lo:hi],
                                predict=True,
                            )
                            preds.append(p)
                            ce += float(c)
                    pred = torch.cat(preds, dim=1)
                    loss += ce
                    tokens += float((b.labels != IGNORE_INDEX).sum())
                    counts += recall_counts(pred, b.labels, b.recall_distance, buckets)
                    shards += recall_counts(pred, b.labels, b.recall_distance, edges)
            ref[f"val_loss{mode}"] = loss / tokens
            ref.update({f"{k}{mode}": v for k, v in recall_metrics(counts, buckets).items()})
            ref.update(shard_recall_metrics(shards, mode))
        return metrics, ref
    finally:
        trainer.metrics.close()
        trainer.close()


def _shards(cut: list[int], shard: int) -> list[tuple[int, int, list[int]]]:
    """``(start, end, document pieces)`` of each shard of a row whose documents are cut at the shards."""
    out, at = [], 0
    for n in cut:
        if at % shard == 0:
            out.append((at, at + shard, []))
        out[-1][2].append(n)
        at += n
    return out


def test_full_evaluation_equals_one_process_and_shard_cut_equals_each_shard_alone(dist_pools, tmp_path):
    argv = [
        "--job.config_file", "train_configs/cpu_main.toml",
        "--job.dump_folder", str(tmp_path / "run"),
        "--checkpoint.enable", "false",  # the shipped model (checkpoints/lookup_tiny): answers that mean something
        "--training.seq_len", "256", "--validation.steps", "2",
        "--parallelism.context_parallel_degree", "2",
    ]  # fmt: skip
    (metrics, whole), (_, cut) = dist_pools.run(2, _validate_and_reference, argv, timeout=600)
    ref = {**whole, **cut}
    assert metrics["recall_chance"] == pytest.approx(1 / 35)
    del metrics["recall_chance"]
    assert set(metrics) == set(ref) and {"recall_remote", "recall_remote_shard_cut", "recall_shards_1"} <= set(ref)
    for key, value in ref.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # the cut removed something: without the other shard's keys the facts there are out of reach
    assert metrics["val_loss_shard_cut"] > metrics["val_loss"] + 1.0
    assert metrics["recall_remote"] > 0.5 and metrics["recall_remote_shard_cut"] < 0.2
