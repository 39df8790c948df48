"""Bad input, tried as a new user would: a config file, a data file, a tokenizer, Hugging Face
weights or a checkpoint that cannot be used. Each is one ``ValueError`` whose message names the
key and the file (and the line), found before any process group starts, with nothing written."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from titan_cp.checkpoint import Checkpointer, saved_steps
from titan_cp.config import load_config
from titan_cp.data import ByteTokenizer, TextFiles, build_dataset
from titan_cp.data.chat import ChatJsonl
from titan_cp.errors import UserError
from titan_cp.families.llama3 import build_model
from titan_cp.families.llama3.hf_checkpoint import check_hf_folder, load_hf
from titan_cp.preflight import check_files
from titan_cp.testing.trainer import tiny_run_args
from titan_cp.train import main

TOK = ByteTokenizer()
CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
DEEP = "[" * 100_000 + "]" * 100_000


def load(argv):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(argv)


def listing(folder: Path) -> list[str]:
    """Everything under ``folder`` with its size: what 'nothing was written' compares."""
    return sorted(f"{p.relative_to(folder)} {p.stat().st_size if p.is_file() else '/'}" for p in folder.rglob("*"))


def refused_before_start(argv, match: str, dump: Path) -> None:
    """``titan_cp.train.main(argv)`` raises a ``ValueError`` matching ``match`` with no process
    group started and ``dump`` (``job.dump_folder``) as it was."""
    before = listing(dump) if dump.is_dir() else None
    with pytest.raises(ValueError, match=match):
        main(argv + ["--job.dump_folder", str(dump)])
    assert not dist.is_initialized()
    assert (listing(dump) if dump.is_dir() else None) == before


# ---- the config file and the keys ---------------------------------------------------------------


def test_config_file_that_is_binary_or_a_folder_names_the_key_and_the_file(tmp_path):
    binary = tmp_path / "job.toml"
    binary.write_bytes(b"[training]\nsteps = 3\n\xff\xfe\x00")
    refused_before_start(
        ["--job.config_file", str(binary)],
        rf"job.config_file = '{binary}' is not a text file \(byte 0xff at offset 21 is not UTF-8\)",
        tmp_path / "out",
    )
    folder = tmp_path / "configs"
    folder.mkdir()
    refused_before_start(
        ["--job.config_file", str(folder)], rf"job.config_file = '{folder}' is a folder; give the TOML file", tmp_path
    )


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--training.seq_len", "1099511627776"], "training.seq_len must be at most 16777216 (RoPE computes with float32 positions"),
        (["--validation.seq_len", "33554432"], "validation.seq_len must be at most 16777216"),
        (
            ["--training.seq_len", "16777216", "--training.local_batch_size", "128"],
            "training.local_batch_size x training.seq_len = 128 x 16777216 tokens per microbatch must be at most 2147483647",
        ),
        (
            ["--validation.enable", "--validation.steps", "1", "--validation.local_batch_size", "256",
             "--validation.seq_len", "16777216"],
            "validation.local_batch_size x validation.seq_len = 256 x 16777216",
        ),
    ],
)  # fmt: skip
def test_sequence_lengths_beyond_what_the_model_holds_name_the_key(tmp_path, argv, fragment):
    refused_before_start(tiny_run_args() + argv, fragment.replace("(", r"\(").replace(")", r"\)"), tmp_path)


def test_a_microbatch_larger_than_the_host_memory_names_the_keys(tmp_path, monkeypatch):
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 256 * 1024}  # 1 GiB
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = load(["--training.seq_len", "8388608", "--training.local_batch_size", "2"])
    with pytest.raises(
        ValueError,
        match=r"training.seq_len = 8388608 with training.local_batch_size = 2: one microbatch needs at least "
        r"2.0 GiB of host memory on 4 rank\(s\) .* this machine has 1.0 GiB",
    ):
        check_files(cfg)
    check_files(load(["--training.seq_len", "65536", "--training.local_batch_size", "2"]))  # 16 MiB fits


def test_bad_mixture_kind_and_weights_name_the_key(tmp_path):
    toml = tmp_path / "mix.toml"
    toml.write_text(
        f'[training]\ndataset = "mixture"\n\n[[training.mixture]]\nname = "a"\nkind = "csv"\npath = "{tmp_path}"\n'
    )
    refused_before_start(
        ["--job.config_file", str(toml)],
        r"training.mixture\[0\].kind = 'csv' \('a'\) is not a dataset kind: choose one of "
        r"\['synthetic_recall', 'synthetic_lookup', 'text', 'chat', 'hf'\]",
        tmp_path / "out",
    )
    toml.write_text(
        '[training]\ndataset = "mixture"\n\n[[training.mixture]]\nname = "a"\nkind = "text"\nweight = inf\n'
    )
    refused_before_start(
        ["--job.config_file", str(toml)], "training.mixture.weight must be a finite number, got inf", tmp_path / "out"
    )
    refused_before_start(
        ["--training.dataset", "mixture", "--training.mixture", "a:synthetic_recall::1e308,b:synthetic_recall::1e308"],
        r"training.mixture weights sum to inf \(\[1e\+308, 1e\+308\]\): scale them down",
        tmp_path / "out",
    )


def test_dump_folder_under_a_file_or_unwritable_is_refused_before_any_process_group(tmp_path, monkeypatch):
    file = tmp_path / "notes.txt"
    file.write_text("a file")
    refused_before_start(
        tiny_run_args(),
        rf"job.dump_folder = '{file}/run' cannot be made: '{file}' is a file, not a folder",
        file / "run",
    )
    refused_before_start(tiny_run_args(), rf"job.dump_folder = '{file}' is a file, not a folder", file)
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    refused_before_start(
        tiny_run_args(),
        rf"job.dump_folder = '{locked}/run': cannot write in '{locked}' \(where it would be made\)",
        locked / "run",
    )


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="file modes do not stop root")
def test_dump_folder_without_write_permission(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        refused_before_start(tiny_run_args(), rf"cannot write in '{locked}'", locked / "run")
    finally:
        locked.chmod(0o700)


# ---- data files ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, fragment",
    [
        (CHAT.encode() + b"\n" + CHAT.encode()[:-2] + b'\xff"}\n', r"chat.jsonl, line 2: not UTF-8 text \(byte 0xff"),
        (CHAT.encode() + b"\n" + DEEP.encode() + b"\n", "chat.jsonl, line 2: JSON nested too deeply to read"),
        (b"\n" + CHAT.encode()[:-1] + b"\n", "chat.jsonl, line 2: not JSON"),
    ],
)
def test_chat_jsonl_that_cannot_be_parsed_names_the_file_and_line(tmp_path, content, fragment):
    (tmp_path / "chat.jsonl").write_bytes(content)
    argv = tiny_run_args() + ["--training.dataset", "chat", "--training.dataset_path", str(tmp_path / "chat.jsonl")]
    with pytest.raises(ValueError, match=fragment):
        build_dataset(load(argv), TOK)


def test_a_data_file_that_cannot_be_parsed_stops_the_trainer_before_any_process_group(tmp_path):
    """The trainer reads its data files before its process group starts (and before the mesh line): every
    rank meets the bad line alone, so rank 0's line is the run's one line."""
    (tmp_path / "chat.jsonl").write_bytes(CHAT.encode() + b"\n" + CHAT.encode()[:-1] + b"\n")
    argv = tiny_run_args() + ["--training.dataset", "chat", "--training.dataset_path", str(tmp_path / "chat.jsonl")]
    refused_before_start(argv, "chat.jsonl, line 2: not JSON", tmp_path / "out")


def test_a_line_broken_after_the_start_is_named_when_read(tmp_path):
    chat, text = tmp_path / "chat.jsonl", tmp_path / "docs.jsonl"
    chat.write_text(CHAT + "\n" + CHAT + "\n")
    text.write_text('{"text": "one"}\n{"text": "two"}\n')
    sources = ChatJsonl(chat, TOK), TextFiles(text, TOK)
    chat.write_text(CHAT + "\n" + CHAT[:-5] + "\n")  # the file changes while a run reads it
    text.write_text('{"text": "one"}\n{"text": 2}\n')
    with pytest.raises(
        ValueError, match=r"chat.jsonl, line 2 \(read again: did the file change after the run started\?\): not JSON"
    ):
        sources[0].document(1)
    with pytest.raises(ValueError, match=r"docs.jsonl, line 2 \(read again: .*\): 'text' must be a string, got int 2"):
        sources[1].document(1)
    assert sources[1].text(0) == "one"


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b'{"text": "fine"}\n{"text": 5}\n', "docs.jsonl, line 2: 'text' must be a string, got int 5"),
        (b'{"text": "fine"}\n\nnull\n', "docs.jsonl, line 3: a record must be a JSON object with 'text', got None"),
        (b'{"body": "x"}\n', r"docs.jsonl, line 1: no 'text' key \(keys: \['body'\]\)"),
        (b'{"text": "\xff"}\n', r"docs.jsonl, line 1: not UTF-8 text \(byte 0xff at offset 10\)"),
        (DEEP.encode() + b"\n", "docs.jsonl, line 1: JSON nested too deeply to read"),
        (b'{"text": "a"\n', "docs.jsonl, line 1: not JSON"),
    ],
)
def test_text_jsonl_records_are_checked_when_the_source_is_built(tmp_path, content, fragment):
    (tmp_path / "docs.jsonl").write_bytes(content)
    with pytest.raises(ValueError, match=fragment):
        TextFiles(tmp_path / "docs.jsonl", TOK)


def test_binary_or_undecodable_text_files_are_named(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(ValueError, match=r"a.txt is binary, not text \(a NUL byte at offset 8\)"):
        TextFiles(tmp_path, TOK)
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 au lait")  # Latin-1
    with pytest.raises(ValueError, match=r"a.txt: not UTF-8 text \(byte 0xe9 at offset 3\)"):
        TextFiles(tmp_path, TOK)
    late = b"x" * 100_000 + b"\xff"  # past what construction reads: found when the document is read
    (tmp_path / "a.txt").write_bytes(late)
    source = TextFiles(tmp_path, TOK)
    with pytest.raises(ValueError, match=r"a.txt: not UTF-8 text \(byte 0xff at offset 100000\)"):
        source.document(0)


# ---- tokenizer, Hugging Face weights --------------------------------------------------------------


@pytest.mark.parametrize(
    "name, content, fragment",
    [
        ("tokenizer.json", b"", "tokenizer.json is empty"),
        (
            "tokenizer.json",
            b"<html>not found</html>",
            r"tokenizer.json: not JSON \(Expecting value at line 1 column 1\)",
        ),
        ("tokenizer_config.json", b'{"bos_token": ', "tokenizer_config.json: not JSON"),
    ],
)
def test_tokenizer_files_that_are_not_json_name_the_key_and_file(tmp_path, name, content, fragment):
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "tokenizer.json").write_text("{}")
    (assets / name).write_bytes(content)
    refused_before_start(
        tiny_run_args() + ["--model.hf_assets_path", str(assets)],
        rf"model.hf_assets_path = '{assets}': .*{fragment}",
        tmp_path / "out",
    )


def test_a_json_tokenizer_the_library_cannot_read_names_the_file(tmp_path):
    pytest.importorskip("tokenizers", reason="the check is of what the tokenizers package refuses")
    from titan_cp.data import HFTokenizer

    (tmp_path / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match=r"tokenizer.json: not a tokenizer the 'tokenizers' package can read"):
        HFTokenizer(tmp_path)


def safetensors_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A ``.safetensors`` file written by hand (the format: 8-byte header length, JSON header, data)."""
    header, data = {}, b""
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_truncated_safetensors_and_config_that_is_not_json_are_named(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors_file(hf / "model.safetensors", {"model.norm.weight": torch.ones(64)})
    check_hf_folder(hf)  # whole
    whole = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(whole[:-10])
    argv = tiny_run_args() + ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(hf)]
    refused_before_start(
        argv,
        rf"checkpoint.initial_load_path = '{hf}': {hf}/model.safetensors is truncated \({len(whole) - 10} bytes; "
        rf"its tensors end at byte {len(whole)}\)",
        tmp_path / "out",
    )
    with pytest.raises(ValueError, match="model.safetensors is truncated"):  # the loader checks the same, first
        load_hf([build_model("tiny", device="cpu")], hf, build_model("tiny", device="meta").args)
    (hf / "model.safetensors").write_bytes(whole[:5])
    refused_before_start(argv, r"model.safetensors is truncated or not a .safetensors file \(5 bytes", tmp_path / "out")
    (hf / "model.safetensors").write_bytes(whole)
    (hf / "config.json").write_text("{'hidden_size': 64}")
    refused_before_start(
        argv,
        rf"checkpoint.initial_load_path = '{hf}': {hf}/config.json: not JSON \(Expecting property name",
        tmp_path / "out",
    )


# ---- checkpoints --------------------------------------------------------------------------------


def dcp_step(folder: Path, step: int, with_optimizer: bool = True) -> Path:
    """A small DCP checkpoint ``step-<step>`` written in this process (no process group)."""
    state = {"model": {"w": torch.arange(64.0)}, "train_state": {"step": step}}
    if with_optimizer:
        state["optimizer"] = {"m": torch.ones(64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(folder / f"step-{step}"), no_dist=True)
    return folder / f"step-{step}"


def resume_argv(dump: Path) -> list[str]:
    return tiny_run_args() + ["--checkpoint.enable", "--job.dump_folder", str(dump)]


def refused_by_check_files(argv, match: str, dump: Path) -> None:
    """``check_files`` of ``argv`` raises a ``ValueError`` matching ``match``; ``dump`` is as it was."""
    before = listing(dump)
    with pytest.raises(ValueError, match=match):
        check_files(load(argv))
    assert listing(dump) == before


def test_corrupt_newest_checkpoint_is_named_with_the_older_step_to_resume(tmp_path):
    folder = tmp_path / "checkpoint"
    dcp_step(folder, 2)
    newest = dcp_step(folder, 4)
    payload = next(newest.glob("*.distcp"))
    payload.write_bytes(payload.read_bytes()[:100])
    fix = r"resume from an older step with --checkpoint.load_step 2 \(saved steps: \[2\]\)"
    argv = resume_argv(tmp_path)
    refused_by_check_files(argv, rf"checkpoint {newest}: {payload} is truncated \(100 bytes, .*\); {fix}", tmp_path)
    (newest / ".metadata").write_bytes(b"\x80\x04garbage")
    refused_by_check_files(argv, rf"checkpoint {newest}: {newest}/.metadata cannot be read \(.*\); {fix}", tmp_path)
    (newest / ".metadata").unlink()
    refused_by_check_files(argv, rf"checkpoint {newest} is not a complete DCP checkpoint .*; {fix}", tmp_path)
    check_files(load(argv + ["--checkpoint.load_step", "2"]))  # the fix works
    refused_before_start(argv[:-2], rf"checkpoint {newest} is not a complete", tmp_path)


def test_corrupt_only_checkpoint_says_how_to_start_from_scratch(tmp_path):
    only = dcp_step(tmp_path / "checkpoint", 3)
    next(only.glob("*.distcp")).unlink()
    with pytest.raises(
        ValueError,
        match=r"step-3/__0_0.distcp is missing .*; moving .*step-3 away, the run starts from "
        r"scratch: step 1, freshly initialised weights \(metrics.jsonl is kept under another name\)",
    ):
        check_files(load(resume_argv(tmp_path)))


def test_damaged_checkpoint_advice_says_what_moving_it_away_does(tmp_path):
    """A damaged step-3 between a whole step-2 and a model-only step-4: the resume asks which step
    (step-4 cannot be continued); load_step 3 names step 2 to resume from instead, and what moving
    step-3 away would do."""
    folder = tmp_path / "checkpoint"
    dcp_step(folder, 2)
    damaged = dcp_step(folder, 3)
    dcp_step(folder, 4, with_optimizer=False)
    next(damaged.glob("*.distcp")).unlink()
    with pytest.raises(ValueError, match=r"step-4 is the newest step but holds only the model"):
        check_files(load(resume_argv(tmp_path)))
    match = (
        r"resume from an older step with --checkpoint.load_step 2 \(saved steps: \[2\]\); moving .*step-3 away, the "
        r"run stops at step-4, which holds only the model or cannot be read \(name a step to load\)"
    )
    with pytest.raises(ValueError, match=match):
        check_files(load([*resume_argv(tmp_path), "--checkpoint.load_step", "3"]))
    (folder / "step-4").rename(folder / "step-4-model")  # an export: not a step
    with pytest.raises(ValueError, match=r"resume from an older .*; moving .*step-3 away, the run resumes from step 2"):
        check_files(load(resume_argv(tmp_path)))


def test_a_newest_step_holding_only_the_model_is_refused_naming_the_steps_to_choose(tmp_path):
    """A folder whose newest step holds the model alone (a model-only final save, as torchtitan writes
    it): a resume would go back to the older whole step or start at step 1, so it is refused before
    any process group starts, naming both; each named step is then accepted."""
    folder = tmp_path / "checkpoint"
    dcp_step(folder, 2)
    dcp_step(folder, 4, with_optimizer=False)
    fix = (
        rf"checkpoint {folder}/step-4 is the newest step but holds only the model \(no optimizer, LR schedule or "
        r"data position\): a resume cannot continue it\. Either resume the whole state of step 2 with "
        r"--checkpoint.load_step 2 \(steps 3-4 trained again, the records of the first time kept under another "
        r"name\), or start from its weights with --checkpoint.load_step 4 \(optimizer, schedule and data position "
        r"afresh, from step 1\)"
    )
    refused_by_check_files(resume_argv(tmp_path), fix, tmp_path)
    refused_before_start(resume_argv(tmp_path)[:-2], fix, tmp_path)
    assert check_files(load([*resume_argv(tmp_path), "--checkpoint.load_step", "2"])) is None
    assert check_files(load([*resume_argv(tmp_path), "--checkpoint.load_step", "4"])) is None
    (folder / "step-2" / ".metadata").unlink()  # no whole state left: only the model's weights to offer
    refused_by_check_files(resume_argv(tmp_path), r"cannot continue it\. Either start from its weights", tmp_path)


def test_pruning_never_removes_the_newest_whole_state(tmp_path):
    """checkpoint.keep_latest_k = 2 over a whole step 2 and model-only steps 3 and 4 (model-only final
    saves of runs extended twice): step 2 stays, the only step a resume can continue; once a whole
    step 5 is saved it goes. The step-N-model exports keep the newest 2."""
    folder = tmp_path / "checkpoint"
    dcp_step(folder, 2)
    dcp_step(folder, 3, with_optimizer=False)
    dcp_step(folder, 4, with_optimizer=False)
    for step in (2, 3, 4):  # the model exports of three runs' last steps: pruned to the newest k as well
        (folder / f"step-{step}-model").mkdir()
    ckpt = Checkpointer(folder, [], [], {}, keep_latest_k=2)
    ckpt._purge()
    assert saved_steps(folder) == [2, 3, 4]
    assert sorted(p.name for p in folder.glob("*-model")) == ["step-3-model", "step-4-model"]
    dcp_step(folder, 5)
    ckpt._purge()
    assert saved_steps(folder) == [4, 5]


def _flip_bytes(tensor: torch.Tensor, folder: Path) -> None:
    """Overwrite 64 bytes of ``tensor``'s data where DCP wrote them in ``folder`` with 0xff (a NaN)."""
    data = tensor.contiguous().numpy().tobytes()
    (payload,) = folder.glob("*.distcp")
    raw = bytearray(payload.read_bytes())
    at = raw.index(data) + len(data) // 2
    raw[at : at + 64] = b"\xff" * 64
    payload.write_bytes(bytes(raw))


def test_non_finite_weights_or_optimizer_state_in_a_checkpoint_are_named(tmp_path):
    """Bytes flipped inside a weight (DCP reads them without complaint) and a NaN in the optimizer
    state: the load stops naming the checkpoint and the tensor, before a step trains on them."""
    model = build_model("tiny", device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).float().sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp_path, [model], [opt], {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": ckpt._model_state()}, checkpoint_id=str(tmp_path / "step-5"), no_dist=True)
        _flip_bytes(model.layers["0"].attention.wq.weight.detach(), tmp_path / "step-5")
        with pytest.raises(UserError, match=rf"checkpoint {tmp_path}/step-5 holds non-finite values \(NaN or inf\) in "
                           r"model.layers.0.attention.wq.weight: it is damaged"):  # fmt: skip
            ckpt.load(5)  # the model alone: named by its step
        next(iter(opt.state.values()))["exp_avg"][0] = float("nan")
        dcp.save(ckpt._state(model_only=False), checkpoint_id=str(tmp_path / "step-6"), no_dist=True)
        with pytest.raises(
            UserError,
            match=r"step-6 holds non-finite values \(NaN or inf\) in .*optimizer.state.tok_embeddings.weight.exp_avg",
        ):
            ckpt.load()


def _trained_checkpointer(folder: Path) -> Checkpointer:
    """A Checkpointer of the tiny model and an AdamW that took one step (so it holds moments)."""
    model = build_model("tiny", device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).float().sum().backward()
    opt.step()
    return Checkpointer(folder, [model], [opt], {})


def _overwrite(folder: Path, prefix: str, values: int = 1000) -> str:
    """Overwrite ``values`` floats of the largest item named ``prefix...`` in ``folder``'s payload with 0.5,
    from 1 KiB into its bytes (inside the tensor's data: DCP reads them without complaint); its name."""
    items = dcp.FileSystemReader(str(folder)).read_metadata().storage_data.items()
    index, info = max(((i, s) for i, s in items if i.fqn.startswith(prefix)), key=lambda item: item[1].length)
    assert info.length > 1024 + 4 * values
    with open(folder / info.relative_path, "r+b") as f:
        f.seek(info.offset + 1024)
        f.write(torch.full((values,), 0.5).numpy().tobytes())
    return index.fqn


@pytest.mark.parametrize("section", ["optimizer", "model"])
def test_a_flipped_region_of_a_saved_file_is_refused_naming_the_step_to_resume(tmp_path, section):
    """Steps 4 and 8 saved with their checksums; 1,000 floats of one of step 8's optimizer (or model)
    tensors overwritten with 0.5 (finite: DCP and the NaN check load them without a word, and the run
    goes on differently): the resume refuses step 8 in one line naming the bytes, the tensor and step 4
    to resume from instead. Step 4, intact, loads, as does step 8 before the damage."""
    from titan_cp.checkpoint import ChecksumWriter, has_checksums

    ckpt = _trained_checkpointer(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        for step in (4, 8):
            dcp.save(
                ckpt._state(model_only=False), storage_writer=ChecksumWriter(tmp_path / f"step-{step}"), no_dist=True
            )
    assert has_checksums(dcp.FileSystemReader(str(tmp_path / "step-8")).read_metadata())
    assert ckpt.load() == 8
    name = _overwrite(tmp_path / "step-8", section)
    with pytest.raises(
        UserError,
        match=rf"checkpoint {tmp_path}/step-8 is damaged: bytes \d+-\d+ of __0_0.distcp \({name}\) are not the bytes "
        r"saved \(their CRC-32 differs\); resume from an older step with --checkpoint.load_step 4 \(saved steps: "
        rf"\[4\]\); moving {tmp_path}/step-8 away, the run resumes from step 4$",
    ):
        ckpt.load()
    assert ckpt.load(4) == 4


def test_a_checkpoint_without_checksums_loads_with_a_warning(tmp_path):
    """A step saved by DCP alone (titan_cp before checksums, or another program): loaded, with one
    warning saying its bytes are not checked."""
    from titan_cp.testing.logs import captured

    ckpt = _trained_checkpointer(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(ckpt._state(model_only=False), checkpoint_id=str(tmp_path / "step-3"), no_dist=True)
    with captured() as out:
        assert ckpt.load() == 3
    assert [m for level, m in out.lines if level == "WARNING"] == [
        f"checkpoint {tmp_path}/step-3 carries no checksums (saved by titan_cp before it wrote them, or by another "
        "program): its bytes are loaded unchecked (DCP's own checks and the NaN/inf check only)"
    ]


def test_a_payload_damaged_in_place_is_a_user_error_when_loaded(tmp_path):
    """Garbage of the right length passes the pre-start check; DCP's failure to read it is turned
    into one message naming the checkpoint (DCP raises a BaseException that names nothing)."""
    model = build_model("tiny", device="cpu")
    ckpt = Checkpointer(tmp_path, [model], [], {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": ckpt._model_state()}, checkpoint_id=str(tmp_path / "step-5"), no_dist=True)
        payload = next((tmp_path / "step-5").glob("*.distcp"))
        payload.write_bytes(b"\0" * payload.stat().st_size)
        with pytest.raises(UserError, match=rf"checkpoint {tmp_path}/step-5 cannot be loaded \(.*\); moving .* away"):
            ckpt.load(5)  # the model alone: named by its step


def test_leftovers_of_an_unfinished_first_save_are_removed_at_the_next_start(tmp_path):
    (tmp_path / "step-2.tmp").mkdir()
    (tmp_path / "step-2.tmp" / "__0_0.distcp").write_bytes(b"half")
    ckpt = Checkpointer(tmp_path, [], [], {})
    assert ckpt.load() is None  # nothing complete: a fresh start
    assert not (tmp_path / "step-2.tmp").exists()


def test_initial_dcp_checkpoint_that_is_truncated_is_named(tmp_path):
    start = dcp_step(tmp_path, 7, with_optimizer=False)
    payload = next(start.glob("*.distcp"))
    payload.write_bytes(payload.read_bytes()[:10])
    refused_before_start(
        tiny_run_args() + ["--checkpoint.initial_load_path", str(start)],
        rf"checkpoint.initial_load_path = '{start}': {payload} is truncated",
        tmp_path / "out",
    )


def test_a_text_folder_of_empty_files_is_refused_naming_the_path(tmp_path):
    """An empty .txt (or one of blank lines), and JSON lines whose texts are empty: nothing to train on
    but begin/end tokens; refused naming the folder. An empty file beside real text is left out."""
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("\n \n")
    (tmp_path / "c.jsonl").write_text('{"text": ""}\n\n')
    with pytest.raises(
        ValueError, match=rf"'{tmp_path}' holds no text: its 3 file\(s\) \(a.txt, b.txt, c.jsonl\) are empty"
    ):
        TextFiles(tmp_path, TOK)
    (tmp_path / "d.txt").write_text("words")
    assert len(TextFiles(tmp_path, TOK)) == 1
    with pytest.raises(ValueError, match=rf"'{tmp_path / 'a.txt'}' holds no text: its 1 file\(s\) \(a.txt\)"):
        TextFiles(tmp_path / "a.txt", TOK)


def test_a_jsonl_file_given_as_a_hugging_face_dataset_is_one_line(tmp_path, capsys):
    """``--training.dataset hf --training.dataset_path x.jsonl`` (187 lines from ``datasets`` before)."""
    from titan_cp.errors import run_cli

    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    argv = tiny_run_args() + ["--training.dataset", "hf", "--training.dataset_path", str(tmp_path / "x.jsonl")]
    message = rf"training.dataset_path = '{tmp_path / 'x.jsonl'}' is a file, not a Hugging Face dataset saved with "
    refused_before_start(argv, message, tmp_path / "out")
    with pytest.raises(ValueError, match=message + r".*set training.dataset = 'text'"):
        build_dataset(load(argv), TOK)  # the source itself, whatever checked the config
    with pytest.raises(SystemExit) as info:
        run_cli(main, argv + ["--job.dump_folder", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and err.startswith("error: training.dataset_path")


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"{model_type: llama", r"config.json: not JSON \(Expecting property name"),
        (b"[1, 2]", "config.json must hold a JSON object"),
        (b'{"hidden_size": 8}', "config.json cannot be read by transformers: Unrecognized model"),
    ],
)
def test_a_hugging_face_config_that_is_not_json_is_one_line(tmp_path, content, fragment):
    pytest.importorskip("transformers")
    from titan_cp.integrations.hf_tiny import byte_tokenizer

    byte_tokenizer(tmp_path)
    (tmp_path / "config.json").write_bytes(content)
    argv = ["--job.config_file", "train_configs/hf/qwen3_cp.toml", "--model.hf_assets_path", str(tmp_path)]
    with pytest.raises(UserError, match=rf"model.hf_assets_path = '{tmp_path}': {fragment}"):
        check_files(load(argv))
