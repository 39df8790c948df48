"""The planner on multi-head latent attention and mixtures of experts (docs/planning.md, titan_cp/plan/moe.py).

- Parameters: a tiny DeepSeek V3 ``config.json`` (MLA with and without the query's low rank, a dense layer, MoE
  layers with a shared expert), Qwen3-MoE's (``mlp_only_layers``), Qwen3-Next's (shared expert and its gate,
  Gated DeltaNet layers) and Mixtral's count what transformers builds from the same config on the meta device;
  torchtitan's DeepSeek V3 and Qwen3 MoE debug models what torchtitan builds.
- MLA's K/V bytes, sent and kept, at the value head dim of its own; the kernel timed at ``max(E, E_v)``.
- Expert parallelism: every rank stores the same share of the experts at any EP degree, FSDP gathers ``1 / ep``
  of a block's experts, the token exchange's bytes are ``2 T k D a (ep - 1) / ep`` a layer and pass.
- Only the doors that run EP plan it; ``--max-seq`` answers for DeepSeek V3 16B on 8 GPUs; bad input is one line.
- An MoE layer's saved bytes: the formula against what transformers' DeepSeek V3 saves (a count).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from benchmarks.memory import SavedTensorCounter
from titan_cp.attention.pricing import cost_of
from titan_cp.config import load_config
from titan_cp.errors import is_user_error
from titan_cp.integrations.hf_shapes import HFShapes, hf_model_args
from titan_cp.plan import main, plan
from titan_cp.plan import moe as mx
from titan_cp.plan.cost import Setting, Stack, collective_transfers, expert_transfers
from titan_cp.plan.devices import device
from titan_cp.plan.memory import HostOptions, RankModel, Sharding, Stage, moe_delta_saved_per_token, rank_memory
from titan_cp.plan.problem import Candidate, Workload

ROOT = Path(__file__).parents[1]
MODULE = "titan_cp.integrations.torchtitan"
TINY_DSV3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=320, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=12, tie_word_embeddings=False,
)  # fmt: skip
# Kimi K2's config.json is DeepSeek V3's architecture: one expert group, 8 of 384 experts a token, one shared
KIMI_K2_LIKE = dict(
    TINY_DSV3, n_routed_experts=12, num_experts_per_tok=8, n_group=1, topk_group=1,
    routed_scaling_factor=2.827,
)  # fmt: skip
SMALL = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
)  # fmt: skip
# DeepSeek V3 16B's shapes (torchtitan's deepseek_v3_16b: DeepSeek-V2-Lite's) as a config.json
DSV3_16B = dict(
    TINY_DSV3, vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
    num_experts_per_tok=6, n_group=1, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, max_position_embeddings=163840,
)  # fmt: skip


def _shapes(tmp_path: Path, config: dict) -> HFShapes:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return hf_model_args(str(tmp_path))


def _transformers_count(config_cls, model_cls, config: dict, tmp_path: Path) -> tuple[int, HFShapes]:
    """Parameters transformers builds from ``config`` (meta device), and the planner's shapes of its config.json."""
    cfg = config_cls(**config)
    with torch.device("meta"):
        model = model_cls(cfg)
    return sum(p.numel() for p in model.parameters()), _shapes(tmp_path, cfg.to_dict())


def test_parameters_equal_what_transformers_builds(tmp_path):
    tf = pytest.importorskip("transformers")
    cases = [
        (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, TINY_DSV3),
        (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, dict(TINY_DSV3, q_lora_rank=None)),
        (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(SMALL, num_experts=8, moe_intermediate_size=32, mlp_only_layers=[0])),
        (tf.MixtralConfig, tf.MixtralForCausalLM, dict(SMALL, num_local_experts=4)),
        (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, KIMI_K2_LIKE),
        (
            tf.Qwen3_5MoeTextConfig,
            tf.Qwen3_5MoeForCausalLM,
            dict(SMALL, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8),
        ),
        (
            tf.Qwen3NextConfig,
            tf.Qwen3NextForCausalLM,
            dict(SMALL, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8),
        ),
    ]  # fmt: skip
    for i, (config_cls, model_cls, config) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        count, args = _transformers_count(config_cls, model_cls, config, tmp_path / str(i))
        assert args.num_params() == count, (config_cls.__name__, args.num_params(), count)
    args = _shapes(tmp_path, TINY_DSV3)
    assert (args.head_dim, args.v_head_dim, args.kv_heads, args.moe_layers) == (24, 12, 4, (1, 2))
    # by hand: MLA q 64*24 + 24 + 24*4*24, kv_a 64*(16+8) + 16, kv_b 16*4*(16+12), o 4*12*64
    assert args.attention_params == 1536 + 24 + 2304 + 1536 + 16 + 1792 + 3072
    # a token runs 2 of the 4 experts: 2 MoE layers of 3*64*32 * (4 - 2) fewer than held
    assert args.num_params() - args.active_params() == 2 * 3 * 64 * 32 * 2
    assert args.pair_flops() == 6 * (24 + 12)


def test_torchtitan_debug_models_count_what_torchtitan_builds():
    pytest.importorskip("torchtitan", reason="torchtitan 0.3 is in the dev extra (Python >= 3.11)")
    from titan_cp.integrations.torchtitan import configs  # noqa: PLC0415
    from titan_cp.integrations.torchtitan.planning import model_shapes  # noqa: PLC0415

    for fn in (configs.deepseek_v3_debugmodel_cp, configs.qwen3_moe_debugmodel_cp):
        model_config = fn().model_spec.model
        with torch.device("meta"):
            model = model_config.build()
        shapes = model_shapes(model_config, fn.__name__)
        assert shapes.num_params() == sum(p.numel() for p in model.parameters()), fn.__name__
        assert shapes.moe is not None and shapes.moe.experts == 8
    assert shapes.mla is None and shapes.qk_norm


def test_mla_kv_bytes_are_counted_at_the_value_head_dim(tmp_path):
    args = _shapes(tmp_path, DSV3_16B)
    e, ev, h, a, cp, tokens = 192, 128, 16, 2, 8, 16384
    assert (args.head_dim, mx.v_head_dim(args), mx.kernel_head_dim(args)) == (e, ev, e)
    m = RankModel(args, "ring", cp, act_bytes=a)
    call = m.attention_call(tokens)
    ring = cost_of("ring")
    # the ring's forward: every other rank's K/V rows, K at E and V at E_v a head
    assert ring.min_bytes(call, backward=False) == (cp - 1) * tokens * h * (e + ev) * a
    # kept per token: q (E), out (E_v), k (E), v (E_v), the fp32 lse
    assert ring.saved_bytes_per_token(call) == a * h * (2 * e + 2 * ev) + 4 * h
    dense = dataclasses.replace(args, mla=None, hf_head_dim=e)
    assert ring.min_bytes(RankModel(dense, "ring", cp, act_bytes=a).attention_call(tokens), False) == (
        (cp - 1) * tokens * h * 2 * e * a
    )


def _setting(args: HFShapes, ep: int, dp_shard: int = 1, cp: int = 8, ac: str = "none") -> Setting:
    w = Workload(args, 131072, ((131072,),), ac=ac, act_bytes=2)
    c = Candidate("ring", dp_shard, 1, cp, 1, 1, ep=ep)
    return Setting(c, w, device("h100"), Stack(), Stage(args.n_layers))


def test_expert_parallel_shards_what_fsdp_gathers_not_what_a_rank_stores(tmp_path):
    args = _shapes(tmp_path, DSV3_16B)
    moe = args.moe
    assert moe is not None
    d, a, k, tokens, f = 2048, 2, 6, 16384, 8
    x = moe.expert_params(d)  # one layer's routed experts
    assert x == 3 * 2048 * 1408 * 64
    one = rank_memory(RankModel(args, "ring", 8, act_bytes=a), Stage(27), Sharding(f), tokens, 1, 1)
    for ep in (2, 4, 8):
        m = RankModel(args, "ring", 8, act_bytes=a, ep=ep)
        mem = rank_memory(m, Stage(27), Sharding(f), tokens, 1, 1)
        assert (mem.params, mem.optimizer) == (one.params, one.optimizer)  # 1 / (dp_shard x cp) of every expert
        # two gathered blocks (compute dtype) and one unsharded fp32 gradient hold 1 / ep of the experts; the
        # token exchange receives k copies of the local tokens
        saved = (2 * a + 4) * (x - x // ep) - k * tokens * d * a
        assert one.comm_buffers - mem.comm_buffers == saved
        assert mem.step.gradients < one.step.gradients


def test_the_token_exchange_and_fsdp_bytes_follow_the_formulas(tmp_path):
    args = _shapes(tmp_path, DSV3_16B)
    d, a, k, layers = 2048, 2, 6, 26  # 26 MoE layers after the first dense one
    stored = args.num_params()
    x = layers * args.moe.expert_params(d)
    for ep, dp_shard, cp, ac in ((2, 1, 8, "none"), (8, 1, 8, "full"), (4, 2, 4, "none")):
        s = _setting(args, ep, dp_shard, cp, ac)
        tokens, passes = 131072 // cp, s.forward_passes
        assert passes == (2 if ac == "full" else 1)
        (t,) = expert_transfers(s).values()
        assert t.nbytes == int(layers * 2 * tokens * k * d * a * (ep - 1) / ep * (passes + 1))
        f = dp_shard * cp
        efsdp = f // ep
        want = (stored - x) * (f - 1) / f + x / ep * (efsdp - 1) / efsdp
        assert collective_transfers(s, 1.0, 1.0)["fsdp"].nbytes == int(want * (2 * a + 4))
    assert expert_transfers(_setting(args, 1)) == {}
    assert mx.ep_degrees(args, 1, 8, 1) == [1, 2, 4, 8]
    assert mx.ep_degrees(args, 3, 4, 1) == [1, 2, 4]  # 64 experts: 3, 6 and 12 do not divide them


def test_only_the_doors_that_run_expert_parallel_plan_it(tmp_path, capsys):
    pytest.importorskip("torchtitan", reason="torchtitan 0.3 is in the dev extra (Python >= 3.11)")
    (tmp_path / "config.json").write_text(json.dumps(TINY_DSV3))
    job = load_config(
        ["--job.config_file", "train_configs/hf/qwen3_cp.toml", "--model.hf_assets_path", str(tmp_path),
         "--training.seq_len", "4096"],
        warn_adjustments=False,
    )  # fmt: skip
    hf = plan(job, 4, "cpu", exhaustive=True)
    assert {e.candidate.ep for e in hf.estimates} == {1}
    assert hf.context.flavor == "hf:deepseek_v3" and any(e.candidate.cp > 1 for e in hf.estimates)
    argv = ["--module", MODULE, "--config", "deepseek_v3_debugmodel_cp", "--ngpu", "4", "--gpu", "cpu", "--all"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {r["ep"] for r in records} == {1, 2, 4}
    assert all((r["dp_shard"] * r["cp"]) % r["ep"] == 0 and r["tp"] == 1 for r in records)
    assert any(r["ep"] > 1 and r["cp"] > 1 and "ep" in r["comm_detail"] for r in records)
    assert f"--parallelism.expert_parallel_degree {records[0]['ep']} " in out
    # a plan with EP beside CP is a launch line torchtitan's config manager and the door's checks take
    from torchtitan.config import ConfigManager  # noqa: PLC0415

    from titan_cp.integrations.torchtitan import check_run  # noqa: PLC0415
    from titan_cp.plan import torchtitan  # noqa: PLC0415

    tt = torchtitan.read(MODULE, "deepseek_v3_debugmodel_cp", [])
    result = plan(tt.job_config, 4, "cpu", given=tt.given, exhaustive=True)
    e = next(e for e in result.estimates if e.candidate.ep > 1 and e.candidate.cp > 1)
    (line,) = torchtitan.launch_lines(e, 4, 1, tt.run)
    config = ConfigManager().parse_args(shlex.split(line.split(f"-m {torchtitan.CPU_LAUNCHER} ")[1]))
    check_run(config)
    p = config.parallelism
    assert (p.expert_parallel_degree, p.context_parallel_degree) == (e.candidate.ep, e.candidate.cp)


def test_max_seq_of_deepseek_v3_16b_on_8_gpus_answers(capsys):
    pytest.importorskip("torchtitan", reason="torchtitan 0.3 is in the dev extra (Python >= 3.11)")
    text = (ROOT / "docs/planning.md").read_text()
    (line,) = re.findall(r"^python -m titan_cp\.plan --max-seq .*deepseek_v3_16b_cp.*$", text, re.M)
    assert main(shlex.split(line)[3:]) == 0
    first, answer = capsys.readouterr().out.splitlines()[:2]
    record = json.loads(first)
    assert record["flavor"] == "torchtitan:deepseek_v3/16B" and record["fits"] and record["max_seq_len"] > 131072
    assert answer.startswith(f"longest row: {record['max_seq_len']:,} tokens on ")
    assert answer in text  # the page prints the answer it gets


def test_bad_input_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_DSV3, num_experts_per_tok=None)))
    argv = [
        "--ngpu",
        "8",
        "--job.config_file",
        "train_configs/hf/qwen3_cp.toml",
        "--model.hf_assets_path",
        str(tmp_path),
    ]
    with pytest.raises(ValueError, match=r"config.json has 4 experts and no num_experts_per_tok") as e:
        main(argv)
    assert is_user_error(e.value) and "\n" not in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_DSV3, num_experts_per_tok=5)))
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in 1..4 \(the experts\), got 5"):
        main(argv)


def test_an_moe_layers_saved_bytes_are_near_what_transformers_saves(tmp_path):
    """The MoE feed-forward's saved bytes a token beyond a dense one's (a formula over what any implementation
    keeps, titan_cp/plan/moe.py) within 10% of what transformers' DeepSeek V3 saves (fp32, its experts' loop)."""
    tf = pytest.importorskip("transformers")
    tokens, counted = 512, []
    for first_dense in (2, 0):  # two dense layers, then two MoE layers
        config = tf.DeepseekV3Config(
            **dict(TINY_DSV3, num_hidden_layers=2, n_group=1, first_k_dense_replace=first_dense)
        )
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = tf.DeepseekV3ForCausalLM(config)
        counter = SavedTensorCounter(model.parameters())
        with counter:
            model(input_ids=torch.randint(0, 320, (1, tokens))).logits.sum()
        counted.append(counter.saved_bytes)
    per_token = (counted[1] - counted[0]) / 2 / tokens
    formula = moe_delta_saved_per_token(RankModel(_shapes(tmp_path, TINY_DSV3), act_bytes=4))
    assert formula == 1088  # measured 1,136 to 1,152: a few per-expert tensors of transformers' loop follow the routing
    assert abs(formula - per_token) / per_token < 0.1, per_token
    tiled = RankModel(_shapes(tmp_path, TINY_DSV3), act_bytes=4, host=HostOptions(tile_tokens=64))
    assert moe_delta_saved_per_token(tiled) == 0  # a tiled feed-forward, MoE or dense, keeps its input alone
