"""Chat/trajectory records with loss masks by role, the best-fit packer, source mixtures, and the
exactness of CP training on rows with padding documents and masked tokens.

Exactness tolerance (as in test_composition): fp32; the cp run adds the same numbers in another
order (tile splits, log-sum-exp merges), ~1e-6 relative; we assert 1e-5 relative on the loss and
2e-5 absolute (after a 1e-4 relative allowance) on every gradient.
"""

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
    Batch,
    BestFitPacker,
    ByteTokenizer,
    ChatJsonl,
    Document,
    Mixture,
    PackedDataLoader,
    Packer,
    SyntheticRecall,
    build_dataloader,
    build_dataset,
    render_chat,
)
from titan_cp.data.lengths import LengthSource, measure_packing

TOK = ByteTokenizer()
ROLES = ("system", "user", "assistant", "tool")


class ListSource:
    """Documents from a list, repeated forever."""

    def __init__(self, docs):
        self.docs = docs

    def document(self, index):
        return self.docs[index % len(self.docs)]


def random_chat(rng: random.Random, max_turns: int = 6, max_chars: int = 60) -> dict:
    turns = [
        {"role": rng.choice(ROLES), "content": "".join(rng.choices("abcdefgh xyz", k=rng.randint(0, max_chars)))}
        for _ in range(rng.randint(1, max_turns))
    ]
    return {"messages": turns}


def write_chats(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def check_row(row, seq_len):
    """Row invariants of every packer: pieces tile the row, positions restart, labels stay inside a piece."""
    lens = row.doc_lens
    assert sum(lens) == seq_len and all(n > 0 for n in lens)
    assert torch.equal(row.positions, torch.cat([torch.arange(n) for n in lens]))
    start = 0
    for n in lens:
        kept = row.labels[start : start + n - 1] != IGNORE_INDEX
        assert torch.equal(row.labels[start : start + n - 1][kept], row.tokens[start + 1 : start + n][kept])
        assert row.labels[start + n - 1] == IGNORE_INDEX
        start += n
    if row.padding:
        assert lens[-1] == row.padding
        assert (row.tokens[-row.padding :] == TOK.pad_id).all() and (row.labels[-row.padding :] == IGNORE_INDEX).all()


# ---- chat records -----------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "List files."},
    {"role": "assistant", "content": "ls"},
    {"role": "tool", "content": "a.txt b.txt"},
    {"role": "assistant", "content": "Two files."},
]


def _targets(doc: Document) -> str:
    """The text of the tokens that are training targets, runs joined by '|'."""
    runs, current = [], []
    for token, keep in zip(doc.tokens, doc.loss_mask):
        if keep:
            current.append(token)
        elif current:
            runs.append(TOK.decode(current))
            current = []
    return "|".join(runs + ([TOK.decode(current)] if current else []))


def test_chat_template_and_role_masks():
    doc = render_chat(CONVERSATION, TOK)
    assert doc.tokens[0] == TOK.bos_id and doc.tokens[-1] == TOK.eos_id
    assert TOK.decode(doc.tokens) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nList files.<|im_end|>\n"
        "<|im_start|>assistant\nls<|im_end|>\n<|im_start|>tool\na.txt b.txt<|im_end|>\n"
        "<|im_start|>assistant\nTwo files.<|im_end|>\n"
    )
    assert len(doc.loss_mask) == len(doc.tokens)
    # only the assistant turns (content and end marker) are targets: not system, user, tool, headers
    assert _targets(doc) == "ls<|im_end|>|Two files.<|im_end|>"
    assert (
        _targets(render_chat(CONVERSATION, TOK, ["assistant", "tool"]))
        == "ls<|im_end|>|a.txt b.txt<|im_end|>|Two files.<|im_end|>"
    )


def test_chat_records_are_documents_and_only_their_roles_carry_loss(tmp_path):
    rng = random.Random(0)
    records = [random_chat(rng) for _ in range(40)]
    write_chats(tmp_path / "chats.jsonl", records)
    source = ChatJsonl(tmp_path / "chats.jsonl", TOK)
    kept = [r for r in records if any(m["role"] == "assistant" for m in r["messages"])]
    assert len(source) == len(kept) == 40 - source.dropped and 0 < source.dropped < 40
    docs = [render_chat(r["messages"], TOK) for r in kept]  # the records without an assistant turn are dropped
    packer = BestFitPacker(source, 512, lookahead=8, pad_id=TOK.pad_id)
    for _ in range(6):
        before = packer.state_dict()
        pieces = packer.skip_row().pieces
        packer.load_state_dict(before)
        row = packer.next_row()
        check_row(row, 512)
        offset = 0
        for i, a, b in pieces:
            labels = row.labels[offset : offset + b - a]
            offset += b - a
            if i < 0:
                assert (labels == IGNORE_INDEX).all()  # padding carries no loss
                continue
            doc = docs[i % len(docs)]
            assert (a, b) == (0, len(doc.tokens))  # one record = one whole document
            # a label is kept exactly where the next token is an assistant target
            assert (labels != IGNORE_INDEX).tolist() == doc.loss_mask[1:] + [False]


def test_chat_validation_and_loss_tokens_through_the_loader(tmp_path):
    write_chats(tmp_path / "train.jsonl", [{"messages": CONVERSATION}] * 3)
    cfg = load_config(
        [
            "--training.dataset",
            "chat",
            "--training.dataset_path",
            str(tmp_path / "train.jsonl"),
            "--training.seq_len",
            "512",
            "--training.local_batch_size",
            "1",
            "--training.packing",
            "best_fit",
            "--validation.dataset",
            "chat",
            "--validation.dataset_path",
            str(tmp_path / "train.jsonl"),
        ]
    )
    doc = render_chat(CONVERSATION, TOK)
    per_doc = sum(doc.loss_mask[1:])
    fit = 512 // len(doc.tokens)
    for split in ("train", "validation"):
        step = next(build_dataloader(cfg, TOK, 0, 1, split))
        assert step.global_valid_tokens == fit * per_doc  # only the masked-in tokens count
        assert step.padding_tokens == 512 - fit * len(doc.tokens)


def _long_prompt_first(path, answers=30):
    """The first record a 50,000-character user turn and no assistant turn (teaches nothing), a short
    user-only record among ``answers`` ordinary question-answer records."""
    prompt = {"messages": [{"role": "system", "content": "Read."}, {"role": "user", "content": "word " * 10_000}]}
    qa = [
        {"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(answers)
    ]
    write_chats(path, [prompt, *qa[:10], {"messages": [{"role": "user", "content": "no answer"}]}, *qa[10:]])
    return qa


@pytest.mark.parametrize("packing", ["stream", "best_fit"])
def test_chat_records_without_a_loss_turn_are_dropped_not_packed(tmp_path, caplog, packing):
    """A first record of 50,000 characters of user turn filled ~49 rows of 1,024 tokens with nothing
    to learn (the run stopped at step 7 on training.max_skipped_fraction): it is dropped when the file
    is read, so the first rows hold the other records and every row carries loss; the count is logged
    once, naming the roles trained on."""
    path = tmp_path / "chat.jsonl"
    qa = _long_prompt_first(path)
    argv = ["--training.dataset", "chat", "--training.dataset_path", str(path), "--training.seq_len", "1024"]
    argv += ["--training.local_batch_size", "2", "--training.packing", packing, "--training.packing_lookahead", "4"]
    cfg = load_config(argv)
    loader = build_dataloader(cfg, TOK, 0, 1)
    rows = [row for _ in range(3) for mb in next(loader).microbatches for row in mb.tokens]
    text = "".join(TOK.decode(row.tolist()) for row in rows)
    assert "word word" not in text and "no answer" not in text  # neither dropped record is packed
    assert text.count("<|im_start|>assistant\nanswer 0<|im_end|>") >= 1  # the first kept record is in the first rows
    loader = build_dataloader(cfg, TOK, 0, 1)
    for _ in range(6):
        step = next(loader)
        assert all(int((labels != IGNORE_INDEX).sum()) > 0 for mb in step.microbatches for labels in mb.labels)
    with caplog.at_level("INFO", logger="titan_cp"):
        source = build_dataset(cfg, TOK, announce=True)
        build_dataset(cfg, TOK)  # the other ranks: quiet
    assert (len(source), source.dropped, source.records) == (len(qa), 2, len(qa) + 2)
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage() == (
        f"{path}: dropped 2 of 32 chat records with no loss-bearing token (roles trained on: assistant, "
        "training.loss_roles); they are not packed"
    )


@pytest.mark.parametrize("packing", ["stream", "best_fit"])
def test_dropped_chat_records_keep_a_resume_exact(tmp_path, packing):
    """The loader's position counts kept records only: a run resumed from the saved state reads the
    rows the straight run reads (dropped records ahead of, among and behind the position)."""
    path = tmp_path / "chat.jsonl"
    _long_prompt_first(path, answers=12)
    kw = dict(packing=packing, lookahead=4, pad_id=TOK.pad_id)
    straight = _rows(PackedDataLoader(ChatJsonl(path, TOK), 128, 2, 1, **kw), 12)
    first = PackedDataLoader(ChatJsonl(path, TOK), 128, 2, 1, **kw)
    got = _rows(first, 5)
    resumed = PackedDataLoader(ChatJsonl(path, TOK), 128, 2, 1, **kw)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got.update(_rows(resumed, 7))
    assert sorted(got) == sorted(straight) == list(range(24))  # 12 steps: past the file's end (a wrap)
    assert all(torch.equal(got[r][0], straight[r][0]) and torch.equal(got[r][1], straight[r][1]) for r in straight)


def test_chat_file_without_a_loss_turn_is_one_error(tmp_path):
    """Every record dropped: one error naming the file, the roles looked for and the roles there are
    (not a run of skipped steps, not a hang)."""
    path = tmp_path / "prompts.jsonl"
    prompt = [{"role": "system", "content": "Read."}, {"role": "user", "content": "word " * 1000}]
    write_chats(path, [{"messages": prompt}] * 3)
    cfg = load_config(["--training.dataset", "chat", "--training.dataset_path", str(path)])
    with pytest.raises(ValueError) as e:
        build_dataloader(cfg, TOK, 0, 1)
    assert str(e.value) == (
        f"{str(path)!r}: none of its 3 chat records has a turn of training.loss_roles = ['assistant'] (their roles: "
        "system, user), so no token carries loss; set training.loss_roles to roles the records have, or point the "
        "dataset path at records with such turns"
    )
    assert len(ChatJsonl(path, TOK, ["user"])) == 3  # the roles decide


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("{not json", "not JSON"),
        ('{"text": "hi"}', "no 'messages' key"),
        ('{"messages": []}', "'messages' is empty"),
        ('{"messages": {"role": "user"}}', "'messages' must be a list"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', r"messages\[0\].role = 'bot' is not one of"),
        (
            '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}',
            r"messages\[1\] has no 'content' key",
        ),
        ('{"messages": [{"role": "user", "content": null}]}', r"messages\[0\].content must be a string"),
        ("[1, 2]", "a record must be a JSON object"),
    ],
)
def test_bad_chat_records_name_file_line_and_key(tmp_path, line, fragment):
    good = json.dumps({"messages": CONVERSATION})
    (tmp_path / "bad.jsonl").write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl, line 3: {fragment}"):
        ChatJsonl(tmp_path / "bad.jsonl", TOK)


# ---- best-fit packing -------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000), seq_len=st.integers(2, 64), max_len=st.integers(1, 150), lookahead=st.integers(1, 12)
)
def test_best_fit_keeps_documents_whole(seed, seq_len, max_len, lookahead):
    rng = random.Random(seed)
    docs = [Document([rng.randrange(256) for _ in range(rng.randint(1, max_len))]) for _ in range(rng.randint(1, 8))]
    packer = BestFitPacker(ListSource(docs), seq_len, lookahead=lookahead, pad_id=TOK.pad_id)
    placed: dict[int, list[tuple[int, int]]] = {}
    for _ in range(8):
        before = packer.state_dict()
        summary = packer.skip_row()
        packer.load_state_dict(before)
        row = packer.next_row()  # the same row, built
        assert row.doc_lens == summary.doc_lens and row.num_valid_tokens == summary.valid_tokens
        check_row(row, seq_len)
        offset = 0
        for i, a, b in summary.pieces:
            if i >= 0:
                assert row.tokens[offset : offset + b - a].tolist() == docs[i % len(docs)].tokens[a:b]
                placed.setdefault(i, []).append((a, b))
            offset += b - a
        assert [i for i, _, _ in summary.pieces].count(-1) <= 1 and summary.padding < seq_len
    for i, spans in placed.items():
        n = len(docs[i % len(docs)].tokens)
        if n <= seq_len:
            assert spans == [(0, n)]  # never cut
        else:  # windows of seq_len, in order, and the remainder (possibly placed before them)
            full = [(w * seq_len, (w + 1) * seq_len) for w in range(n // seq_len)]
            rest = [(len(full) * seq_len, n)] if n % seq_len else []
            assert len(set(spans)) == len(spans) and set(spans) <= set(full + rest)
            windows = [s for s in spans if s in full]
            assert windows == full[: len(windows)]


def test_best_fit_resumes_from_its_state():
    source = SyntheticRecall(TOK, min_tokens=64, max_tokens=900)  # some documents longer than a row
    straight = BestFitPacker(source, 512, lookahead=6)
    rows = [straight.next_row() for _ in range(12)]
    for k in (1, 5, 9):
        first = BestFitPacker(source, 512, lookahead=6)
        for _ in range(k):
            first.skip_row()
        resumed = BestFitPacker(source, 512, lookahead=6)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # survives serialisation
        for expected in rows[k:]:
            row = resumed.next_row()
            assert torch.equal(row.tokens, expected.tokens) and row.doc_lens == expected.doc_lens
    assert any(len(r.doc_lens) == 1 and r.padding == 0 for r in rows)  # a window of a long document


def test_best_fit_no_document_waits_for_ever():
    source = LengthSource("lognormal_2k")
    packer = BestFitPacker(source, 32768, lookahead=64)
    oldest_wait = 0
    for _ in range(200):
        for i, _, _ in packer.skip_row().pieces:
            if i >= 0:
                oldest_wait = max(oldest_wait, packer.next_doc - i)
    assert oldest_wait <= 2 * 64 + 64  # the overdue bound plus one row's reading


@pytest.mark.parametrize("mix", ["lognormal_2k", "lognormal_8k", "agent"])
def test_best_fit_cuts_nothing_and_pads_little(mix):
    source = LengthSource(mix)
    best = measure_packing(BestFitPacker(source, 32768, lookahead=512), 64, source.length)
    stream = measure_packing(Packer(source, 32768), 64, source.length)
    assert best["docs_cut_fraction"] == 0.0 and best["padding_fraction"] <= 0.02
    assert stream["docs_cut_fraction"] > 0 and stream["padding_fraction"] == 0.0


def test_recall_corpus_with_best_fit():
    source = SyntheticRecall(TOK, seed=1, min_tokens=256, max_tokens=2048)
    packer = BestFitPacker(source, 8192, lookahead=16, pad_id=TOK.pad_id)
    answers = 0
    for _ in range(3):
        row = packer.next_row()
        check_row(row, 8192)
        marked = row.recall_distance > 0
        answers += int(marked.sum())
        assert (row.labels[marked] != IGNORE_INDEX).all()
        assert all(t in b"abcdefghijklmnopqrstuvwxyz0123456789" for t in row.labels[marked].tolist())
    # no document is cut, so every answer of every document in the rows is scored
    docs = {}
    packer = BestFitPacker(source, 8192, lookahead=16, pad_id=TOK.pad_id)
    for _ in range(3):
        for i, _, _ in packer.skip_row().pieces:
            if i >= 0:
                docs[i] = source.document(i)
    assert answers == sum(e - s for d in docs.values() for s, e in d.answer_spans)


# ---- mixtures ---------------------------------------------------------------------------------


def _tagged(tag: int):
    return ListSource([Document([tag, k]) for k in range(1000)])


def test_mixture_is_deterministic_weighted_and_walks_each_source_in_order():
    mix = Mixture([("a", _tagged(1), 3.0), ("b", _tagged(2), 1.0), ("off", _tagged(3), 0.0)], seed=7, block=64)
    docs = [mix.document(i) for i in range(2000)]
    share_a = sum(d.source == "a" for d in docs) / len(docs)
    assert 0.70 < share_a < 0.80 and not any(d.source == "off" for d in docs)
    for name, tag in (("a", 1), ("b", 2)):
        assert [d.tokens[1] for d in docs if d.source == name][:500] == list(range(500))  # in order, no repeats
        assert all(d.tokens[0] == tag for d in docs if d.source == name)
    fresh = Mixture([("a", _tagged(1), 3.0), ("b", _tagged(2), 1.0), ("off", _tagged(3), 0.0)], seed=7, block=64)
    assert [fresh.document(i) for i in (1999, 3, 700)] == [docs[1999], docs[3], docs[700]]  # random access
    other = Mixture([("a", _tagged(1), 3.0), ("b", _tagged(2), 1.0)], seed=8, block=64)
    assert [other.document(i).source for i in range(200)] != [d.source for d in docs[:200]]


def test_mixture_config_and_bad_sources(tmp_path):
    write_chats(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    (tmp_path / "a.txt").write_text("plain text document")
    toml = tmp_path / "mix.toml"
    toml.write_text(f"""
[training]
dataset = "mixture"
seq_len = 256

[[training.mixture]]
name = "chat"
kind = "chat"
path = "{tmp_path / "chat.jsonl"}"
weight = 2

[[training.mixture]]
name = "text"
kind = "text"
path = "{tmp_path / "a.txt"}"
weight = 1

[[training.mixture]]
name = "recall"
kind = "synthetic_recall"
weight = 1
""")
    cfg = load_config(["--job.config_file", str(toml)])
    source = build_dataset(cfg, TOK)
    assert isinstance(source, Mixture) and source.names == ["chat", "text", "recall"]
    assert {source.document(i).source for i in range(50)} == {"chat", "text", "recall"}
    missing = ["--training.dataset", "mixture", "--training.mixture", f"chat:chat:{tmp_path / 'nope.jsonl'}:1"]
    with pytest.raises(ValueError, match=r"training.mixture\['chat'\].path = .*nope.jsonl' does not exist"):
        build_dataset(load_config(missing), TOK)
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}\n{"messages": 1}\n')
    bad = ["--training.dataset", "mixture", "--training.mixture", f"chat:chat:{tmp_path / 'bad.jsonl'}:1"]
    with pytest.raises(ValueError, match="bad.jsonl, line 2: 'messages' must be a list"):
        build_dataset(load_config(bad), TOK)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (
            ["--training.mixture", "a:synthetic_recall::-1,b:synthetic_recall::1"],
            r"training.mixture\[0\].weight \('a'\) must be >= 0",
        ),
        (["--training.mixture", "a:synthetic_recall::0,b:synthetic_recall::0"], "training.mixture weights sum to zero"),
        (["--training.mixture", "a:synthetic_recall::1,a:synthetic_recall::1"], "names must be non-empty and unique"),
        (["--training.mixture", "a:mixture::1"], "cannot hold another mixture"),
        (["--training.mixture", "a:synthetic_recall"], "name:kind:path:weight"),
        (
            ["--training.mixture", "a:synthetic_recall::1", "--training.dataset_path", "x"],
            "training.dataset_path is not read",
        ),
        ([], None),
    ],
)
def test_mixture_config_errors_name_the_key(argv, fragment):
    argv = ["--training.dataset", "mixture", *argv]
    if fragment is None:
        with pytest.raises(ValueError, match="training.dataset = 'mixture' needs sources"):
            load_config(argv)
        return
    with pytest.raises(ValueError, match=fragment):
        load_config(argv)


def test_mixture_table_without_mixture_dataset_is_an_error():
    with pytest.raises(ValueError, match="set training.dataset = 'mixture'"):
        load_config(["--training.mixture", "a:synthetic_recall::1"])


# ---- loading: resume and global counts ----------------------------------------------------------


def _mixed_source(path):
    chat = ChatJsonl(path, TOK)
    recall = SyntheticRecall(TOK, min_tokens=64, max_tokens=700)
    return Mixture([("chat", chat, 1.0), ("recall", recall, 1.0)], seed=3, block=16)


def _rows(loader, steps):
    out = {}
    for _ in range(steps):
        for mb in next(loader).microbatches:
            for r, tokens, labels in zip(mb.rows, mb.tokens, mb.labels):
                out[r] = (tokens, labels)
    return out


@pytest.mark.parametrize("new_dp", [1, 3])
def test_best_fit_mixture_resumes_on_another_dp_degree(tmp_path, new_dp):
    rng = random.Random(1)
    write_chats(tmp_path / "c.jsonl", [random_chat(rng, max_turns=12, max_chars=80) for _ in range(30)])
    seq_len, G, k = 256, 6, 3
    kw = dict(packing="best_fit", lookahead=8, pad_id=TOK.pad_id, source_names=("chat", "recall"))
    straight_loader = PackedDataLoader(_mixed_source(tmp_path / "c.jsonl"), seq_len, G, G, **kw)
    straight = _rows(straight_loader, 2 * k)
    before = [
        PackedDataLoader(_mixed_source(tmp_path / "c.jsonl"), seq_len, G, 1, dp_rank=d, dp_degree=2, **kw)
        for d in range(2)
    ]
    got = {}
    for loader in before:
        got.update(_rows(loader, k))
    states = [json.loads(json.dumps(loader.state_dict())) for loader in before]
    assert states[0] == states[1]
    after = [
        PackedDataLoader(_mixed_source(tmp_path / "c.jsonl"), seq_len, G, 1, dp_rank=d, dp_degree=new_dp, **kw)
        for d in range(new_dp)
    ]
    for loader in after:
        loader.load_state_dict(states[0])
        for r, row in _rows(loader, k).items():
            assert r not in got
            got[r] = row
    assert sorted(got) == sorted(straight) == list(range(2 * k * G))
    assert all(torch.equal(got[r][0], straight[r][0]) and torch.equal(got[r][1], straight[r][1]) for r in straight)
    drawn = after[0].source_tokens
    assert drawn == straight_loader.source_tokens and drawn["chat"] > 0 and drawn["recall"] > 0
    padding = sum(int((t == TOK.pad_id).sum()) for t, _ in straight.values())
    assert sum(drawn.values()) + padding == 2 * k * G * seq_len  # every token is drawn or padding


def test_resume_with_another_packing_is_an_error():
    state = PackedDataLoader(SyntheticRecall(TOK), 256, 2, 1).state_dict()
    with pytest.raises(ValueError, match="training.packing = 'stream', now 'best_fit'"):
        PackedDataLoader(SyntheticRecall(TOK), 256, 2, 1, packing="best_fit").load_state_dict(state)


def _masked_counts(rank, world, path, steps):
    loader = PackedDataLoader(
        ChatJsonl(path, TOK),
        256,
        2 * world,
        1,
        dp_rank=rank,
        dp_degree=world,
        packing="best_fit",
        lookahead=8,
        pad_id=TOK.pad_id,
    )
    out = []
    for _ in range(steps):
        step = next(loader)
        local = torch.tensor(sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in step.microbatches))
        total = local.clone()
        dist.all_reduce(total)
        out.append((int(local), int(total), step.global_valid_tokens))
    return out


def test_global_valid_tokens_with_masks_equal_a_single_process_count(tmp_path, dist_pools):
    rng = random.Random(2)
    write_chats(tmp_path / "c.jsonl", [random_chat(rng, max_turns=10, max_chars=50) for _ in range(25)])
    per_rank = dist_pools.run(2, _masked_counts, tmp_path / "c.jsonl", 3)
    single = PackedDataLoader(
        ChatJsonl(tmp_path / "c.jsonl", TOK), 256, 4, 4, packing="best_fit", lookahead=8, pad_id=TOK.pad_id
    )
    for step in zip(*per_rank):
        reference = next(single)
        count = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in reference.microbatches)
        assert reference.global_valid_tokens == count
        assert all(total == global_ == count for _, total, global_ in step)
        # masks matter: fewer than the unmasked count (S - pieces per row)
        assert count < sum(256 - len(lens) for mb in reference.microbatches for lens in mb.doc_lens)


# ---- exactness of CP training on padded, masked rows ---------------------------------------------


def _padded_chat_batch(path, seq_len, rows):
    packer = BestFitPacker(ChatJsonl(path, TOK), seq_len, lookahead=4, pad_id=TOK.pad_id)
    packed = [packer.next_row() for _ in range(rows)]
    return Batch.collate(packed, list(range(rows)))


def _cp_matches_one_process(rank, world, path, strategy, balance):
    from titan_cp.families.llama3 import build_model, parallelize_llama
    from titan_cp.loss import GlobalTokenLoss
    from titan_cp.mesh import ParallelDims
    from titan_cp.parallel.build import ParallelizeOptions
    from titan_cp.step import Microbatch, forward_backward

    batch = _padded_chat_batch(path, 192, 2)
    full = Microbatch(batch.tokens, batch.labels, batch.positions, batch.doc_lens_padded)
    loss_fn = GlobalTokenLoss()
    loss_fn.global_valid_tokens = int((batch.labels != IGNORE_INDEX).sum())
    torch.manual_seed(0)
    reference = build_model("tiny", vocab_size=TOK.vocab_size, device="cpu", n_layers=2)
    ref_loss = forward_backward([reference], full, loss_fn).item()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=world, tp=1, pp=1, world_size=world)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=TOK.vocab_size, device="cpu", n_layers=2)
    cp = parallelize_llama(model, dims, ParallelizeOptions(cp_strategy=strategy, cp_balance=balance, ac_mode="none"))
    local = cp.shard(full)
    loss = forward_backward([model], local, loss_fn)
    dist.all_reduce(loss)
    errors = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = ref_grads[name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")]
        errors[name] = ((g - want).abs() - 1e-4 * want.abs()).max().item()
    return ref_loss, loss.item(), errors, batch.doc_lens


@pytest.mark.parametrize("strategy, balance", [("ring", "doc_zigzag"), ("allgather", "zigzag")])
def test_cp_training_with_padding_documents_equals_one_process(tmp_path, dist_pools, strategy, balance):
    rng = random.Random(4)
    write_chats(tmp_path / "c.jsonl", [random_chat(rng, max_turns=5, max_chars=30) for _ in range(12)])
    for ref_loss, loss, errors, _doc_lens in dist_pools.run(
        2, _cp_matches_one_process, tmp_path / "c.jsonl", strategy, balance, timeout=600
    ):
        packed = _padded_chat_batch(tmp_path / "c.jsonl", 192, 2)
        assert sum(r.item() for r in (packed.tokens == TOK.pad_id).sum(1)) > 0  # padding documents present
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        bad = {n: e for n, e in errors.items() if not e <= 2e-5}
        assert not bad, bad


# ---- the tokenizer's own chat template ------------------------------------------------------------

HAS_TOKENIZERS = __import__("importlib").util.find_spec("tokenizers") is not None

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<turn> {{ m['role'] }} : {{ m['content'] | trim }} <end>\n"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)


def _hf_assets(folder, template):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words = " ".join(f"{m['role']} {m['content']}" for m in CONVERSATION) + " : <turn> <end>"
    tok.train_from_iterator([words], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.skipif(not HAS_TOKENIZERS, reason="needs the optional 'tokenizers' package")
def test_the_tokenizers_chat_template_masks_the_same_turns(tmp_path):
    _hf_assets(tmp_path, TEMPLATE)
    write_chats(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    cfg = load_config(
        [
            "--model.hf_assets_path",
            str(tmp_path),
            "--training.dataset",
            "chat",
            "--training.dataset_path",
            str(tmp_path / "c.jsonl"),
            "--training.chat_template",
            "tokenizer",
        ]
    )
    from titan_cp.data import build_tokenizer

    tok = build_tokenizer(cfg.model.hf_assets_path)
    doc = build_dataset(cfg, tok).document(0)
    words = [tok.token(i) for i in doc.tokens]
    assert words[0] == "<s>" and words[-1] == "</s>" and words.count("<turn>") == len(CONVERSATION)
    targets = [w for w, keep in zip(words, doc.loss_mask) if keep]
    # assistant content and the end of its turn as the template renders it, nothing else
    assert targets == ["ls", "<end>", "</s>", "Two", "files.", "<end>", "</s>"]
    # a template that does not extend the rendering turn by turn is refused, naming file and line
    _hf_assets(tmp_path, "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match=r"c.jsonl, line 1: messages\[1\].*training.chat_template = 'chatml'"):
        build_dataset(cfg, build_tokenizer(cfg.model.hf_assets_path))
    _hf_assets(tmp_path, None)
    with pytest.raises(ValueError, match="has no chat_template"):
        build_dataset(cfg, build_tokenizer(cfg.model.hf_assets_path))
    with pytest.raises(ValueError, match="training.chat_template = 'tokenizer' needs model.hf_assets_path"):
        load_config(["--training.chat_template", "tokenizer"])
