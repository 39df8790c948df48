"""The planner plans a Hugging Face model from its ``config.json`` (``model.name = "hf"``), no weights."""

from __future__ import annotations

import json

import pytest

from titan_cp.config import load_config
from titan_cp.integrations.hf_shapes import hf_model_args
from titan_cp.plan import plan
from titan_cp.preflight import check_files

QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    max_position_embeddings=40960, tie_word_embeddings=False, sliding_window=None, use_sliding_window=False,
)  # fmt: skip


def _job(*argv):
    return load_config(["--training.seq_len", "16384", *argv], warn_adjustments=False)


def test_the_plan_of_a_qwen3_8b_config_uses_its_shapes_and_no_tp_or_pp(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    args = hf_model_args(str(tmp_path))
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.head_dim) == (4096, 36, 32, 8, 128)
    assert args.ffn_hidden_dim == 12288 and args.attention_pattern == "F" * 36
    assert args.num_params() == pytest.approx(8.19e9, rel=0.01)  # Qwen3-8B: 8.2 B parameters
    hf = plan(_job("--job.config_file", "train_configs/hf/qwen3_cp.toml", "--model.hf_assets_path", str(tmp_path)), 8)
    debug = plan(
        _job("--job.config_file", "train_configs/hf/qwen3_cp.toml", "--model.name", "llama3"), 8, exhaustive=True
    )
    assert hf.context.flavor == "hf:qwen3"
    assert {(e.candidate.tp, e.candidate.pp) for e in hf.estimates} == {(1, 1)}
    assert any(e.candidate.tp > 1 for e in debug.estimates)
    assert hf.best.memory.total > 5 * debug.best.memory.total
    assert hf.best.tokens_per_second_per_gpu < debug.best.tokens_per_second_per_gpu / 5


def test_windows_and_sinks_come_from_the_config_and_experts_need_their_count_a_token(tmp_path):
    oss = dict(
        QWEN3_8B, model_type="gpt_oss", sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 18
    )
    (tmp_path / "config.json").write_text(json.dumps(oss))
    args = hf_model_args(str(tmp_path))
    assert args.attention_pattern == "WF" * 18 and args.window == 128 and args.sinks
    (tmp_path / "config.json").write_text(json.dumps(dict(oss, num_local_experts=32)))
    with pytest.raises(ValueError, match=r"config.json has 32 experts and no num_experts_per_tok"):
        hf_model_args(str(tmp_path))  # a mixture of experts is planned (tests/test_plan_moe.py), given its top-k
    with pytest.raises(ValueError, match=r"model.hf_assets_path = .* holds no config.json"):
        hf_model_args(str(tmp_path / "missing"))


def test_generation_with_the_hf_preset_checks_no_training_data(tmp_path):
    pytest.importorskip("transformers")
    from titan_cp.generate.cli import prepare  # noqa: PLC0415
    from titan_cp.integrations.hf_tiny import tiny_qwen3_folder  # noqa: PLC0415

    folder = tiny_qwen3_folder(tmp_path / "qwen3")
    (tmp_path / "p.txt").write_text("hello")
    argv = [
        "--job.config_file", "train_configs/hf/qwen3_cp.toml", "--model.hf_assets_path", str(folder),
        "--checkpoint.initial_load_path", str(folder), "--job.dump_folder", str(tmp_path / "run"),
        "--parallelism.context_parallel_degree", "1", "--generate.prompt_file", str(tmp_path / "p.txt"),
        "--training.dataset_path", str(tmp_path / "no_such_data.jsonl"),  # as when run outside the repository
    ]  # fmt: skip
    job = prepare(load_config(argv, warn_adjustments=False), 1)
    assert job is not None
    with pytest.raises(ValueError, match=r"training.dataset_path"):  # training still checks it
        check_files(load_config(argv, warn_adjustments=False))
