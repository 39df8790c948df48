"""titan_cp.data: tokenizers, the synthetic recall corpus, local datasets, packing and DP loading."""

import bisect
import importlib.util
import json
import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from titan_cp.config import load_config
from titan_cp.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    Document,
    HFDiskDataset,
    HFTokenizer,
    PackedDataLoader,
    Packer,
    SyntheticRecall,
    TextFiles,
    build_dataloader,
    build_dataset,
    build_tokenizer,
)

HAS_TOKENIZERS = importlib.util.find_spec("tokenizers") is not None
HAS_DATASETS = importlib.util.find_spec("datasets") is not None
TOK = ByteTokenizer()


# ---- tokenizers -------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    text = "Context parallel: 上下文并行 ✓ — ok\n"
    ids = TOK.encode(text, bos=True, eos=True)
    assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert all(0 <= i < TOK.vocab_size for i in ids)
    assert TOK.decode(ids) == text
    assert TOK.encode(text) == list(text.encode("utf-8"))
    assert TOK.vocab_size == 259 and len({TOK.bos_id, TOK.eos_id, TOK.pad_id}) == 3


def test_build_tokenizer(tmp_path):
    assert isinstance(build_tokenizer(load_config([]).model.hf_assets_path), ByteTokenizer)
    with pytest.raises(ValueError, match="model.hf_assets_path .* holds no tokenizer.json"):
        build_tokenizer(load_config(["--model.hf_assets_path", str(tmp_path)]).model.hf_assets_path)


@pytest.mark.skipif(HAS_TOKENIZERS, reason="checks the error shown when 'tokenizers' is not installed")
def test_hf_tokenizer_without_package_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ImportError, match=r"'tokenizers' package.*titan_cp\[data\]"):
        HFTokenizer(tmp_path)


@pytest.mark.skipif(not HAS_TOKENIZERS, reason="needs the optional 'tokenizers' package")
def test_hf_tokenizer_round_trip(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["the ring passes keys and values", "the cat sat"],
        trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    hf = build_tokenizer(load_config(["--model.hf_assets_path", str(tmp_path)]).model.hf_assets_path)
    assert isinstance(hf, HFTokenizer)
    ids = hf.encode("the ring passes keys", bos=True, eos=True)
    assert ids[0] == tok.token_to_id("<s>") == hf.bos_id and ids[-1] == tok.token_to_id("</s>") == hf.eos_id
    assert hf.decode(ids) == "the ring passes keys"
    assert hf.vocab_size == tok.get_vocab_size() and hf.pad_id == hf.eos_id


# ---- synthetic recall corpus ------------------------------------------------------------------


def test_synthetic_recall_is_deterministic_and_random_access():
    a, b = SyntheticRecall(TOK, seed=3), SyntheticRecall(TOK, seed=3)
    in_order = [a.document(i) for i in range(8)]
    assert b.document(7) == in_order[7]  # any document on its own
    assert [b.document(i) for i in range(8)] == in_order
    assert SyntheticRecall(TOK, seed=4).document(0) != in_order[0]
    held_out = SyntheticRecall(TOK, seed=3, split="validation")
    assert all(held_out.document(i).tokens != d.tokens for i, d in enumerate(in_order))


def test_synthetic_recall_answers_are_the_planted_facts_far_back():
    corpus = SyntheticRecall(TOK, seed=0)
    docs = [corpus.document(i) for i in range(24)]
    lengths = [len(d.tokens) for d in docs]
    assert min(lengths) < 1000 and max(lengths) > 4000  # mixed lengths
    distances = []
    for d in docs:
        assert d.tokens[0] == TOK.bos_id and d.tokens[-1] == TOK.eos_id
        text_before = TOK.decode(d.tokens[: d.answer_spans[0][0]])
        assert text_before.startswith("Remember these facts.\n")
        assert len(d.answer_spans) == len(d.answer_distances) >= 1
        for (s, e), dist_ in zip(d.answer_spans, d.answer_distances):
            answer = d.tokens[s:e]
            fact_value = d.tokens[s - dist_ : s - dist_ + len(answer)]
            assert answer == fact_value  # the answer is the planted value...
            key = TOK.decode(d.tokens[s - dist_ - 1 : s - dist_])
            assert TOK.decode(d.tokens[s - dist_ - 6 : s - dist_]) == f"fact {key}"
            assert TOK.decode(d.tokens[:s]).endswith(f"\nRecall {key}")  # ...of the asked key
            assert TOK.decode(d.tokens).count(key) == 2  # the key occurs only at its fact and its question
            distances.append(dist_)
    assert max(distances) > 3000
    assert sum(x >= 1000 for x in distances) >= len(distances) // 3  # thousands of tokens, not a few


# ---- local datasets ---------------------------------------------------------------------------


def test_text_files_and_jsonl(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "first doc"}\n\n{"text": "second ✓"}\n')
    (tmp_path / "b.txt").write_text("a whole file\nis one document")
    (tmp_path / "skip.bin").write_bytes(b"\0")
    source = TextFiles(tmp_path, TOK)
    assert len(source) == 3
    texts = [TOK.decode(source.document(i).tokens) for i in range(4)]
    assert texts == ["first doc", "second ✓", "a whole file\nis one document", "first doc"]  # wraps around
    assert source.document(1).tokens[0] == TOK.bos_id and source.document(1).answer_spans == []
    cfg = load_config(["--training.dataset", "c4", "--training.dataset_path", str(tmp_path / "a.jsonl")])
    assert TOK.decode(build_dataset(cfg, TOK).document(1).tokens) == "second ✓"


def test_build_dataset_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="training.dataset = 'c4' is not built in.*training.dataset_path"):
        build_dataset(load_config(["--training.dataset", "c4"]), TOK)
    with pytest.raises(ValueError, match="validation.dataset_path = .* does not exist"):
        build_dataset(
            load_config(["--validation.dataset", "text", "--validation.dataset_path", str(tmp_path / "no")]),
            TOK,
            split="validation",
        )
    (tmp_path / "x.jsonl").write_text('{"content": "no text key"}\n')
    with pytest.raises(ValueError, match="no 'text' key"):
        TextFiles(tmp_path, TOK).document(0)
    held_out = build_dataset(load_config([]), TOK, split="validation")
    assert isinstance(held_out, SyntheticRecall) and held_out.split == "validation"


@pytest.mark.skipif(HAS_DATASETS, reason="checks the error shown when 'datasets' is not installed")
def test_hf_dataset_without_package_is_a_clear_error(tmp_path):
    with pytest.raises(ImportError, match=r"'datasets' package.*titan_cp\[data\]"):
        HFDiskDataset(tmp_path, TOK)


@pytest.mark.skipif(not HAS_DATASETS, reason="needs the optional 'datasets' package")
def test_hf_dataset_from_disk(tmp_path):
    import datasets
    from datasets.table import InMemoryTable

    def dataset(texts, name):  # explicit fingerprint: datasets' dill hashing breaks on some pyarrow versions
        return datasets.Dataset(InMemoryTable.from_pydict({"text": texts}), fingerprint=name)

    datasets.DatasetDict(
        {"train": dataset(["alpha", "beta"], "train"), "validation": dataset(["gamma"], "val")}
    ).save_to_disk(str(tmp_path / "ds"))
    argv = [
        "--training.dataset",
        "c4",
        "--training.dataset_path",
        str(tmp_path / "ds"),
        "--validation.dataset",
        "c4_validation",
        "--validation.dataset_path",
        str(tmp_path / "ds"),
    ]
    cfg = load_config(argv)
    train, val = build_dataset(cfg, TOK), build_dataset(cfg, TOK, split="validation")
    assert [TOK.decode(train.document(i).tokens) for i in range(3)] == ["alpha", "beta", "alpha"]
    assert TOK.decode(val.document(0).tokens) == "gamma"


# ---- packing ----------------------------------------------------------------------------------


class ListSource:
    """Documents from a list, repeated forever."""

    def __init__(self, docs):
        self.docs = docs

    def document(self, index):
        return self.docs[index % len(self.docs)]


def random_docs(rng, n, max_len):
    docs = []
    for _ in range(n):
        length = rng.randint(1, max_len)
        tokens = [rng.randrange(256) for _ in range(length)]
        spans, dists = [], []
        for _ in range(rng.randint(0, 2) if length > 1 else 0):
            s = rng.randrange(1, length)
            e = rng.randint(s + 1, min(length, s + 5))
            if any(s < e2 and s2 < e for s2, e2 in spans):
                continue  # answers are disjoint spans, as in every corpus
            spans.append((s, e))
            dists.append(rng.randint(1, s))  # the fact starts in the document, s - distance >= 0
        docs.append(Document(tokens, spans, dists))
    return docs


def check_row_invariants(row, seq_len):
    lens = row.doc_lens
    assert sum(lens) == seq_len and all(n > 0 for n in lens)
    assert row.tokens.shape == row.labels.shape == row.positions.shape == row.recall_distance.shape == (seq_len,)
    assert torch.equal(row.positions, torch.cat([torch.arange(n) for n in lens]))  # restart per document
    start = 0
    for n in lens:  # labels: the next token of the same document, never across a boundary
        assert torch.equal(row.labels[start : start + n - 1], row.tokens[start + 1 : start + n])
        assert row.labels[start + n - 1] == IGNORE_INDEX
        start += n
    assert int((row.labels != IGNORE_INDEX).sum()) == row.num_valid_tokens == seq_len - len(lens)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), seq_len=st.integers(1, 64), max_len=st.integers(1, 150))
def test_packing_invariants(seed, seq_len, max_len):
    rng = random.Random(seed)
    docs = random_docs(rng, rng.randint(1, 6), max_len)
    # the reference stream: concatenated documents, with each token's answer distance (0: no answer)
    # and the stream index of that answer's fact
    stream, answer_at, fact_at, boundary = [], [], [], []
    while len(stream) < 5 * seq_len + 1:
        for d in docs:
            dist_of, fact_of = [0] * len(d.tokens), [0] * len(d.tokens)
            for (s, e), distance in zip(d.answer_spans, d.answer_distances):
                dist_of[s:e] = [distance] * (e - s)
                fact_of[s:e] = [len(stream) + s - distance] * (e - s)
            stream += d.tokens
            answer_at += dist_of
            fact_at += fact_of
            boundary += [True] + [False] * (len(d.tokens) - 1)
    packer = Packer(ListSource(docs), seq_len)
    for r in range(5):
        row = packer.next_row()
        check_row_invariants(row, seq_len)
        g = r * seq_len
        assert row.tokens.tolist() == stream[g : g + seq_len]  # rows tile the stream: nothing lost or repeated
        starts = [0] + torch.tensor(row.doc_lens).cumsum(0).tolist()[:-1]
        assert starts == [i for i in range(seq_len) if i == 0 or boundary[g + i]]  # cut at documents and rows
        labels = row.labels.tolist()
        piece_start = [g + starts[bisect.bisect_right(starts, i) - 1] for i in range(seq_len)]
        # an answer is marked where its label is, and only when its fact lies in the same piece
        expected = [
            answer_at[g + i + 1] if labels[i] != IGNORE_INDEX and fact_at[g + i + 1] >= piece_start[i] else 0
            for i in range(seq_len)
        ]
        assert row.recall_distance.tolist() == expected


def test_packer_resumes_from_its_state():
    source = SyntheticRecall(TOK, min_tokens=64, max_tokens=700)
    straight = Packer(source, 300)
    rows = [straight.next_row() for _ in range(6)]
    first = Packer(source, 300)
    for _ in range(3):
        first.skip_row()
    resumed = Packer(source, 300)
    resumed.load_state_dict(first.state_dict())
    for expected in rows[3:]:
        row = resumed.next_row()
        assert torch.equal(row.tokens, expected.tokens) and row.doc_lens == expected.doc_lens


def test_recall_distance_marks_the_answers_of_the_corpus():
    row = Packer(SyntheticRecall(TOK, seed=1, min_tokens=256, max_tokens=2048), 8192).next_row()
    check_row_invariants(row, 8192)
    marked = row.recall_distance > 0
    assert marked.sum() > 0
    answer_chars = set(b"abcdefghijklmnopqrstuvwxyz0123456789")
    assert all(t in answer_chars for t in row.labels[marked].tolist())  # labels there are answer tokens


# ---- loader -----------------------------------------------------------------------------------


def small_source(seed=0):
    return SyntheticRecall(TOK, seed=seed, min_tokens=64, max_tokens=600)


def rows_by_index(loader, steps):
    """``{global row: tokens}`` read by ``loader`` in ``steps`` steps."""
    out = {}
    for _ in range(steps):
        for mb in next(loader).microbatches:
            for r, tokens in zip(mb.rows, mb.tokens):
                out[r] = tokens
    return out


def test_loader_splits_the_global_batch_across_dp_ranks():
    seq_len, G, B, D = 256, 12, 2, 3
    single = PackedDataLoader(small_source(), seq_len, G, B * 2 * D)
    reference = next(single)
    ref_rows = {r: t for mb in reference.microbatches for r, t in zip(mb.rows, mb.tokens)}
    assert sorted(ref_rows) == list(range(G))
    seen = {}
    total_valid = 0
    for d in range(D):
        step = next(PackedDataLoader(small_source(), seq_len, G, B, dp_rank=d, dp_degree=D))
        assert len(step.microbatches) == G // (B * D)  # gradient accumulation
        assert step.global_valid_tokens == reference.global_valid_tokens
        for mb in step.microbatches:
            assert mb.tokens.shape == mb.labels.shape == mb.positions.shape == mb.recall_distance.shape == (B, seq_len)
            assert mb.doc_lens_padded.shape == (B, max(len(x) for x in mb.doc_lens))
            for lens, padded in zip(mb.doc_lens, mb.doc_lens_padded.tolist()):
                assert padded == lens + [0] * (len(padded) - len(lens)) and sum(lens) == seq_len
            for r, tokens in zip(mb.rows, mb.tokens):
                assert r not in seen  # disjoint across ranks
                seen[r] = tokens
            total_valid += int((mb.labels != IGNORE_INDEX).sum())
    assert sorted(seen) == list(range(G))
    assert all(torch.equal(seen[r], ref_rows[r]) for r in range(G))
    assert total_valid == reference.global_valid_tokens


def _valid_counts(rank, world_size, steps):
    loader = PackedDataLoader(small_source(seed=5), 256, 4 * world_size, 2, dp_rank=rank, dp_degree=world_size)
    out = []
    for _ in range(steps):
        step = next(loader)
        local = torch.tensor(sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in step.microbatches))
        total = local.clone()
        dist.all_reduce(total)
        out.append((int(local), int(total), step.global_valid_tokens))
    return out


def test_global_valid_tokens_equals_the_all_reduced_count(dist_pools):
    per_rank = dist_pools.run(2, _valid_counts, 4)
    for step in zip(*per_rank):
        assert all(total == global_ == step[0][1] for _, total, global_ in step)
    assert any(step[0][0] != step[1][0] for step in zip(*per_rank))  # uneven across ranks


@pytest.mark.parametrize("new_dp", [1, 3])
def test_resume_on_a_different_dp_degree(new_dp):
    seq_len, G, k = 256, 6, 3
    straight = rows_by_index(PackedDataLoader(small_source(), seq_len, G, G), 2 * k)
    before = [PackedDataLoader(small_source(), seq_len, G, 1, dp_rank=d, dp_degree=2) for d in range(2)]
    got = {}
    for loader in before:
        got.update(rows_by_index(loader, k))
    states = [loader.state_dict() for loader in before]
    assert states[0] == states[1]  # global state: the same on every rank
    for d in range(new_dp):
        after = PackedDataLoader(small_source(), seq_len, G, 1, dp_rank=d, dp_degree=new_dp)
        after.load_state_dict(states[0])
        for r, tokens in rows_by_index(after, k).items():
            assert r not in got
            got[r] = tokens
    assert sorted(got) == sorted(straight) == list(range(2 * k * G))  # none skipped, none repeated
    assert all(torch.equal(got[r], straight[r]) for r in straight)


def test_resume_with_another_seq_len_is_an_error():
    state = PackedDataLoader(small_source(), 256, 2, 1).state_dict()
    with pytest.raises(ValueError, match="training.seq_len"):
        PackedDataLoader(small_source(), 512, 2, 1).load_state_dict(state)


def test_build_dataloader_from_config():
    cfg = load_config(
        [
            "--training.seq_len",
            "128",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "8",
            "--validation.local_batch_size",
            "1",
        ]
    )
    train = build_dataloader(cfg, TOK, dp_rank=1, dp_degree=2)
    step = next(train)
    assert train.gradient_accumulation_steps == 2 and len(step.microbatches) == 2
    assert [mb.rows for mb in step.microbatches] == [[4, 5], [6, 7]]
    val = build_dataloader(cfg, TOK, dp_rank=0, dp_degree=2, split="validation")
    assert val.global_batch_size == 2 and val.seq_len == 128
    train_tokens = next(build_dataloader(cfg, TOK, 0, 2)).microbatches[0].tokens
    assert not torch.equal(next(val).microbatches[0].tokens, train_tokens)  # the held-out split
    with pytest.raises(ValueError, match="training.global_batch_size"):
        build_dataloader(cfg, TOK, dp_rank=0, dp_degree=3)
