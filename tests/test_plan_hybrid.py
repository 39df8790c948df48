"""The planner plans a hybrid model (Qwen3.5: three Gated DeltaNet layers in four) from its ``config.json``: the
linear layers priced as linear layers (their parameters, what they keep, what they exchange, their kernel),
never as attention; the plan's bytes a layer equal the engine's count (``benchmarks.linear_model``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.linear_model import simulate
from titan_cp.config import load_config
from titan_cp.integrations.hf_shapes import LinearShapes, hf_model_args
from titan_cp.plan import linear as lin
from titan_cp.plan import plan
from titan_cp.plan.cost import Setting, Stack, attention_cost
from titan_cp.plan.devices import device
from titan_cp.plan.memory import (
    Stage,
    block_saved_per_token,
    linear_block_saved_per_token,
    linear_extra_bytes,
    saved_per_token,
)
from titan_cp.plan.problem import Candidate

transformers = pytest.importorskip("transformers")

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    vocab_size=256,
)  # fmt: skip


def _folder(tmp_path, **fields):
    """A Qwen3.5 text model's ``config.json``, written by ``transformers``' own config class (offline)."""
    (tmp_path / "config.json").write_text(transformers.Qwen3_5TextConfig(**fields).to_json_string())
    return str(tmp_path)


def _job(folder: str, *argv: str):
    base = ["--job.config_file", "train_configs/hf/qwen3_cp.toml", "--model.hf_assets_path", folder]
    return load_config([*base, *argv], warn_adjustments=False)


def test_a_qwen35_config_has_linear_layers_and_its_parameters(tmp_path):
    """transformers' Qwen3.5 defaults (the 9B shapes): 24 Gated DeltaNet layers of 32, their heads, and the
    parameter count of the model transformers builds (on meta), the attention's output gate included."""
    import torch  # noqa: PLC0415

    args = hf_model_args(_folder(tmp_path))
    assert args.linear == LinearShapes("gated_delta", 16, 32, 128, 128, 4, 64)
    assert len(args.linear_layers) == 24 and args.attention_layers == 8 and 3 not in args.linear_layers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig())
    assert args.num_params() == pytest.approx(sum(p.numel() for p in model.parameters()), rel=1e-5)


def test_the_plan_prices_linear_layers_as_linear(tmp_path):
    """At 65,536 tokens on 8 H200s, no activation checkpointing (at 131,072 the plan needs it to fit): the
    attention's CP bytes are those of its 8 attention layers (a quarter of the same model with attention
    everywhere), the linear layers' exchange is a transfer of its own, and 24 of the 32 blocks save the linear
    block's bytes a token; what a linear layer keeps beyond them (its states) is the same at half the row, its
    later tokens' wider copies aside."""
    folder = _folder(tmp_path)
    argv = ("--activation_checkpoint.mode", "none")
    result = plan(_job(folder, "--training.seq_len", "65536", *argv), 8, gpu="h200", exhaustive=True)
    cp8 = Candidate("ring", 1, 1, 8, 1, 1)
    e = next(e for e in result.estimates if e.candidate == cp8)
    args = e.workload.args
    dense = dataclasses.replace(args, linear=None, linear_layers=())
    setting = Setting(cp8, dataclasses.replace(e.workload, args=dense), device("h200"), Stack(), Stage(32))
    assert e.cost.transfers["cp"].nbytes * 4 == attention_cost(setting)[1]["cp"].nbytes
    assert e.cost.transfers["cp_linear"].nbytes > 0 and e.cost.compute.linear > 0
    m = e.workload.rank_model(cp8)
    m_dense = dataclasses.replace(m, args=dense, linear_work=None)
    linear, attention = linear_block_saved_per_token(m), block_saved_per_token(m)
    assert linear != attention
    assert saved_per_token(m, Stage(32)) - saved_per_token(m_dense, Stage(32)) == pytest.approx(
        24 * (linear - attention)
    )
    half = plan(_job(folder, "--training.seq_len", "32768", *argv), 8, gpu="h200", exhaustive=True)
    m_half = next(e for e in half.estimates if e.candidate == cp8).workload.rank_model(cp8)
    assert m.linear_work is not None and m_half.linear_work is not None
    states = [linear_extra_bytes(x) - lin.widened_saved_bytes(args.linear, x.linear_work, 2) for x in (m, m_half)]
    assert states[0] == states[1] > 0


def test_the_plans_bytes_a_layer_equal_the_engines_count(tmp_path):
    """A tiny Qwen3.5 at 16,384 tokens of short documents on 4 H200s, CP 4: the plan's ``cp_linear`` bytes over
    its linear layers equal what the engine's count sends on the rank the plan prices."""
    folder = _folder(tmp_path, **TINY)
    args = hf_model_args(folder)
    argv = ("--training.seq_len", "16384", "--activation_checkpoint.mode", "none")
    result = plan(_job(folder, *argv), 4, gpu="h200", doc_mix="uniform_short", exhaustive=True)
    e = next(e for e in result.estimates if e.candidate.cp == 4 and e.candidate.strategy == "ring")
    rows = [list(r) for r in e.workload.rows]
    counted = [cp.summary_bytes + cp.halo_bytes for cp, _ in simulate(args.linear, 16384, 4, rows)]
    per_layer = e.cost.transfers["cp_linear"].nbytes / len(args.linear_layers)
    works = e.workload.linear_works(4, 1)
    priced = [sum(lin.exchange_bytes(args.linear, w, 2, recompute=False)) for w in works]
    assert priced == counted and per_layer in counted
    slowest = max(works, key=lambda w: lin.linear_time(args.linear, w, e.device, "intra", 2).total())
    assert per_layer == counted[works.index(slowest)]


def test_bamba_and_the_layer_kinds_from_the_config(tmp_path):
    """Bamba's attention layers by index, its Mamba2 fields; a config with linear layers of neither kind refused."""
    (tmp_path / "config.json").write_text(transformers.BambaConfig(attn_layer_indices=[9, 18, 27]).to_json_string())
    args = hf_model_args(str(tmp_path))
    assert args.linear == LinearShapes("mamba2", 1, 128, 256, 64, 4, 256) and args.attention_layers == 3
    odd = dict(json.loads((tmp_path / "config.json").read_text()), layer_types=["linear_attention"] * 32)
    for key in ("attn_layer_indices", "mamba_n_heads"):
        odd.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(odd))
    with pytest.raises(ValueError, match="neither Gated DeltaNet's linear_num_value_heads nor Mamba2's"):
        hf_model_args(str(tmp_path))


def test_a_torchtitan_qwen35_config_function_plans_its_linear_layers(tmp_path):
    """torchtitan's Qwen3.5 9B (titan_cp's config function) reads as transformers' Qwen3.5 defaults do: the same
    linear layers, gated attention and parameters; its plans run without TP (titan_cp's Gated DeltaNet does
    not run under torchtitan's TP yet) and price the linear layers' exchange."""
    pytest.importorskip("torchtitan")
    from titan_cp.plan.torchtitan import read  # noqa: PLC0415

    run = read("titan_cp.integrations.torchtitan", "qwen35_9b_cp", [])
    hf = hf_model_args(_folder(tmp_path))
    shapes = run.given.shapes
    assert (shapes.linear, shapes.linear_layers, shapes.q_gate) == (hf.linear, hf.linear_layers, True)
    assert shapes.num_params() == hf.num_params()
    result = plan(run.job_config, 8, gpu="h200", given=run.given, exhaustive=True)
    assert {e.candidate.tp for e in result.estimates} == {1}
    assert all("cp_linear" in e.cost.transfers for e in result.estimates if e.candidate.cp > 1)
