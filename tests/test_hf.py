"""Hugging Face and torchtitan weights in and out.

The oracle is ``transformers``' own ``LlamaForCausalLM`` (random weights, a tiny config, no
download), saved with ``save_pretrained``. Its logits and titan_cp's after loading are compared
in fp32: the two compute the same sums in a different order (rotate-half vs interleaved
RoPE, SDPA vs titan_cp's kernel), ~1e-6 relative; we assert 1e-4 of the largest logit.
Exports are compared exactly: they are copies and row permutations.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from titan_cp.checkpoint import Checkpointer
from titan_cp.families.llama3 import RoPEScaling, Transformer, build_model, model_args
from titan_cp.families.llama3.hf_checkpoint import check_hf_config, from_hf, hf_config, load_hf, to_hf

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
pytest.importorskip("safetensors", reason="safetensors is in the dev extra")

BYTE_VOCAB = 259  # titan_cp's built-in byte tokenizer, so the trainer can load the same checkpoint
LLAMA31 = RoPEScaling(8.0, 1.0, 4.0, 8192)


def hf_llama(args, seed: int = 0, **changes):
    """A random ``LlamaForCausalLM`` of the same shapes as ``args``, configured by hand (not by
    ``hf_config``, so a mistake there cannot hide here); ``changes`` override config fields."""
    s = args.rope_scaling
    fields = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        max_position_embeddings=args.max_seq_len,
        tie_word_embeddings=False,
        hidden_act="silu",
        rope_scaling=None
        if s is None
        else dict(
            rope_type="llama3",
            factor=s.scaling_factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        ),
    )
    fields.update(changes)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    with torch.no_grad():  # every weight distinct (norms too), so a swapped name cannot pass
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model


def tokens(vocab: int, seq: int = 48, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_close_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), err


def cases():
    return {
        "tiny_gqa": model_args("tiny", vocab_size=BYTE_VOCAB),
        "tiny_llama31_rope": model_args("tiny", vocab_size=BYTE_VOCAB, rope_scaling=LLAMA31, n_layers=3),
        "debugmodel": model_args("debugmodel", n_layers=2),  # torchtitan's: MHA, Llama 3.1 RoPE
    }


def test_from_hf_and_to_hf_are_inverse_renamings_with_the_qk_permutation():
    args = cases()["tiny_gqa"]
    hf = hf_llama(args).state_dict()
    sd = from_hf(hf, args)
    assert set(sd) == set(build_model("tiny", vocab_size=BYTE_VOCAB).state_dict())
    back = to_hf(sd, args)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    # q/k rows are reordered within each head (not an identity), the rest are copies
    assert not torch.equal(sd["layers.0.attention.wq.weight"], hf["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(sd["layers.0.attention.wv.weight"], hf["model.layers.0.self_attn.v_proj.weight"])
    hd = args.head_dim  # head h's rows stay in head h: row 2j of the pair layout is row j of the halves
    w, w_hf = sd["layers.1.attention.wk.weight"], hf["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(w[hd + 2 * 3], w_hf[hd + 3]) and torch.equal(w[hd + 2 * 3 + 1], w_hf[hd + hd // 2 + 3])


@pytest.mark.parametrize("sharded", [False, True], ids=["one_file", "sharded_index"])
@pytest.mark.parametrize("case", list(cases()))
def test_hf_checkpoint_gives_transformers_logits_on_one_process(tmp_path, case, sharded):
    args = cases()[case]
    hf = hf_llama(args)
    hf.save_pretrained(tmp_path, max_shard_size="100KB" if sharded else "10GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    model = Transformer(args).eval()  # torch's default init; every weight is then loaded
    load_hf([model], tmp_path, args)
    x = tokens(args.vocab_size)
    with torch.no_grad():
        assert_close_logits(model(x), hf(x).logits)


def test_shape_mismatch_names_the_first_parameter_and_loads_nothing(tmp_path):
    args = cases()["tiny_gqa"]
    hf_llama(args, vocab_size=300).save_pretrained(tmp_path)
    model = build_model("tiny", vocab_size=BYTE_VOCAB, device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError,
        match=r"model\.embed_tokens\.weight has shape \(300, 64\), but the model's "
        r"tok_embeddings\.weight has shape \(259, 64\)",
    ):
        load_hf([model], tmp_path, args)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_config_that_shapes_cannot_show_is_checked(tmp_path):
    args = cases()["tiny_gqa"]
    hf_llama(args, rope_theta=10000.0).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="rope_theta = 10000.0, but the model"):
        load_hf([build_model("tiny", vocab_size=BYTE_VOCAB, device="cpu")], tmp_path, args)
    with pytest.raises(ValueError, match="num_attention_heads = 8"):
        check_hf_config({**hf_config(args), "num_attention_heads": 8}, args)
    check_hf_config(json.loads(json.dumps(hf_config(args))), args)  # its own export passes


def test_missing_path_names_the_key_and_the_path(tmp_path):
    model = build_model("tiny", device="cpu")
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"checkpoint.initial_load_path = '{missing}': no such file"):
        load_hf([model], missing, model.args)
    with pytest.raises(ValueError, match="holds no \\*.safetensors"):
        load_hf([model], tmp_path, model.args)
    ckpt = Checkpointer(tmp_path / "ckpt", [model], [], {})
    with pytest.raises(ValueError, match=f"checkpoint.initial_load_path = '{missing}'"):
        ckpt.load_model(missing)
    hf_llama(model.args).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="set checkpoint.initial_load_in_hf = true"):
        ckpt.load_model(tmp_path / "hf")  # a Hugging Face folder without initial_load_in_hf


def test_torchtitan_dcp_checkpoint_loads_as_it_is(tmp_path):
    """torchtitan saves the model's parameters at the top level of the DCP checkpoint under the
    same names (its ``ModelWrapper`` state dict, flattened into the saved states)."""
    torch.manual_seed(0)
    theirs = build_model("tiny", device="cpu")
    state = get_model_state_dict(theirs)
    assert "tok_embeddings.weight" in state and "layers.0.attention.wq.weight" in state
    dcp.save({**state, "train_state": {"step": torch.tensor(7)}}, checkpoint_id=str(tmp_path / "tt"), no_dist=True)
    torch.manual_seed(1)
    ours = build_model("tiny", device="cpu")
    Checkpointer(tmp_path / "ckpt", [ours], [], {}).load_model(tmp_path / "tt")
    assert all(torch.equal(v, state[k]) for k, v in ours.state_dict().items())
    with pytest.raises(ValueError, match="initial_load_model_only = true"):
        Checkpointer(tmp_path / "ckpt", [ours], [], {}).load_model(tmp_path / "tt", model_only=False)
    wrong = build_model("tiny", device="cpu", vocab_size=300)
    with pytest.raises(
        ValueError,
        match=r"tok_embeddings\.weight has shape \(256, 64\), but the model's has shape "
        r"\(300, 64\)",
    ):
        Checkpointer(tmp_path / "ckpt", [wrong], [], {}).load_model(tmp_path / "tt")


# ---------------------------------------------------------------------------- the trainer, CP 2 x TP 2


def _load_forward_train_export(rank, world, argv, x):
    """Build the trainer (its initial load reads the HF checkpoint into the sharded model), return
    this rank's logits for ``x`` and the matching columns, then train one step (which ends with
    the ``last_save_in_hf`` export)."""
    from titan_cp.config import load_config
    from titan_cp.step import Microbatch
    from titan_cp.train import Trainer

    trainer = Trainer(load_config(argv))
    if trainer.dims.pp_enabled:  # a stage's forward is not the model's: check the export only,
        trainer.checkpointer.save_hf(1, trainer.model_args)  # as train() ends with last_save_in_hf
        return None
    B, S = x.shape
    doc_lens = torch.full((B, 1), S)
    mb = Microbatch(x, x, torch.arange(S).expand(B, S), doc_lens).to(trainer.device)
    local = mb.shard(trainer.cp)
    index = Microbatch(*(torch.arange(S).expand(B, S),) * 3, doc_lens).shard(trainer.cp)
    with torch.no_grad():
        logits = trainer.parts[0](local.tokens, positions=local.positions, doc_lens=local.doc_lens)
    if isinstance(logits, torch.distributed.tensor.DTensor):
        logits = logits.full_tensor()
    trainer.train()
    return logits, index.tokens


@pytest.mark.parametrize("world,mesh", [(4, dict(cp=2, tp=2)), (2, dict(pp=2))], ids=["cp2_tp2", "pp2"])
def test_hf_in_and_out_through_the_trainer(dist_pools, tmp_path, world, mesh):
    """The trainer loads a Hugging Face checkpoint into a CP 2 x TP 2 model (FSDP over cp, TP
    over heads), whose logits are transformers'; one step at lr 1e-30 (a no-op in fp32: every
    update is below an ulp) ends with the ``last_save_in_hf`` export, which transformers
    reloads with the original weights. With two pipeline stages each rank loads and writes
    only its own layers."""
    args = model_args("tiny", vocab_size=BYTE_VOCAB)
    hf = hf_llama(args)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    x = tokens(BYTE_VOCAB, seq=64, batch=1)
    with torch.no_grad():
        want = hf(x).logits
    argv = [
        "--model.flavor",
        "tiny",
        "--training.seq_len",
        "64",
        "--training.steps",
        "1",
        "--training.local_batch_size",
        str(mesh.get("pp", 1)),
        "--training.global_batch_size",
        str(mesh.get("pp", 1)),
        "--lr_scheduler.warmup_steps",
        "0",
        "--optimizer.lr",
        "1e-30",
        "--training.mixed_precision_param",
        "float32",
        "--validation.enable",
        "false",
        "--metrics.log_freq",
        "100",
        "--parallelism.context_parallel_degree",
        str(mesh.get("cp", 1)),
        "--parallelism.tensor_parallel_degree",
        str(mesh.get("tp", 1)),
        "--parallelism.pipeline_parallel_degree",
        str(mesh.get("pp", 1)),
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--parallelism.context_parallel_strategy",
        "ring",
        "--checkpoint.enable",
        "false",
        "--checkpoint.initial_load_in_hf",
        "true",
        "--checkpoint.initial_load_path",
        str(tmp_path / "hf"),
        "--checkpoint.last_save_in_hf",
        "true",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    for result in dist_pools.run(world, _load_forward_train_export, argv, x, timeout=600):
        if result is None:
            continue
        logits, index = result
        assert_close_logits(logits, torch.gather(want, 1, index[..., None].expand(-1, -1, want.shape[-1])))
    out = tmp_path / "run" / "checkpoint" / "step-1-hf"
    assert (out / "config.json").exists() and (out / "model.safetensors.index.json").exists()
    assert not (out / "sharded").exists()
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert back.config.num_key_value_heads == 2 and back.config.tie_word_embeddings is False
    sd = back.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in hf.state_dict().items())
    with torch.no_grad():
        assert_close_logits(back(x).logits, want)
