"""titan_cp's own trainer starts from a torchtitan 0.3 DCP checkpoint (``checkpoint.initial_load_path``,
docs/torchtitan.md): torchtitan 0.3's Llama 3 names the output ``lm_head`` and fuses each layer's Q/K/V
into ``attention.qkv_linear.wqkv``, interleaved per KV group (``titan_cp.families.llama3.torchtitan_checkpoint``).

torchtitan's debug model (and the same with 4 KV heads, so that the KV groups matter) is built in
process, seeded and initialised by torchtitan, its state dict saved with DCP in one process: as torchtitan's
checkpointer writes it (the module's state-dict hook splits ``wqkv`` into ``qkv_linear.wq/wk/wv``) and as
its parameters are (``wqkv`` fused). Loaded through the trainer's initial load
(:meth:`titan_cp.checkpoint.Checkpointer.load_model`) into titan_cp's Llama of the same shapes, the logits
equal torchtitan's forward on the same tokens within 1e-5 (float32). Another model's checkpoint (Qwen3's
q/k norms) is refused in one line.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from titan_cp.checkpoint import Checkpointer
from titan_cp.families.llama3 import build_model

pytest.importorskip("torchtitan", reason="torchtitan 0.3 is in the dev extra (Python >= 3.11)")


def _torchtitan_llama3_debugmodel(n_kv_heads: int | None, vocab_size: int | None = None) -> nn.Module:
    """torchtitan 0.3's ``llama3`` ``debugmodel`` (fused Q/K/V), with ``n_kv_heads`` KV heads (None: its
    own 16), causal SDPA as its inner attention (its FlexAttention compiles, which a CPU test cannot
    afford), with ``vocab_size`` tokens (None: its own 2048), built and initialised by torchtitan from seed 0,
    in float32."""
    from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: PLC0415
    from torchtitan.models.common.config_utils import make_gqa_config  # noqa: PLC0415
    from torchtitan.models.llama3 import model_registry  # noqa: PLC0415

    config = model_registry("debugmodel").model
    if vocab_size is not None:
        config.vocab_size = config.tok_embeddings.num_embeddings = config.lm_head.out_features = vocab_size
    for layer in config.layers:
        if n_kv_heads is not None:
            old = layer.attention
            layer.attention = make_gqa_config(
                dim=old.dim,
                n_heads=old.n_heads,
                n_kv_heads=n_kv_heads,
                wqkv_param_init={"weight": partial(nn.init.trunc_normal_, std=0.02)},
                wo_param_init={"weight": partial(nn.init.trunc_normal_, std=0.02)},
                inner_attention=old.inner_attention,
                rope=old.rope,
                fuse_qkv=True,
            )
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model.eval()


@pytest.mark.parametrize("n_kv_heads", [None, 4], ids=["debugmodel", "4_kv_heads"])
@pytest.mark.parametrize("saved_as", ["checkpointer", "parameters"])
def test_a_torchtitan_03_checkpoint_gives_torchtitans_logits(tmp_path, n_kv_heads, saved_as):
    theirs = _torchtitan_llama3_debugmodel(n_kv_heads)
    if saved_as == "checkpointer":  # torchtitan's ModelWrapper: model.state_dict(), the hook splitting wqkv
        state = theirs.state_dict()
        assert "layers.0.attention.qkv_linear.wq.weight" in state and "lm_head.weight" in state
    else:
        state = dict(theirs.named_parameters())
        assert "layers.0.attention.qkv_linear.wqkv.weight" in state
    state = {k: v.detach() for k, v in state.items()}
    dcp.save({**state, "train_state": {"step": torch.tensor(7)}}, checkpoint_id=str(tmp_path / "tt"), no_dist=True)

    ours = build_model("debugmodel", device="cpu", **({} if n_kv_heads is None else {"n_kv_heads": n_kv_heads}))
    Checkpointer(tmp_path / "ckpt", [ours], [], {}).load_model(tmp_path / "tt")

    tokens = torch.randint(0, ours.args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(tokens), ours(tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_another_models_checkpoint_is_refused_in_one_line(tmp_path):
    theirs = _torchtitan_llama3_debugmodel(None)
    state = {k: v.detach() for k, v in theirs.state_dict().items()}
    state["layers.0.attention.q_norm.weight"] = torch.ones(16)  # Qwen3's q/k norms
    dcp.save(state, checkpoint_id=str(tmp_path / "qwen"), no_dist=True)
    ours = build_model("debugmodel", device="cpu")
    with pytest.raises(ValueError, match=r"holds layers.0.attention.q_norm.weight, which titan_cp's Llama does not"):
        Checkpointer(tmp_path / "ckpt", [ours], [], {}).load_model(tmp_path / "qwen")
    del state["layers.0.attention.q_norm.weight"], state["layers.3.attention.qkv_linear.wk.weight"]
    dcp.save(state, checkpoint_id=str(tmp_path / "short"), no_dist=True)
    with pytest.raises(ValueError, match=r"has no layers.3.attention.wk.weight \(nor .*qkv_linear.wk.weight nor"):
        Checkpointer(tmp_path / "ckpt", [ours], [], {}).load_model(tmp_path / "short")


def _generate(rank, world, argvs):
    from titan_cp.generate.cli import main  # noqa: PLC0415

    return [[r["tokens"] for r in main(argv)] for argv in argvs]


def test_generation_reads_a_torchtitan_03_folder(dist_pools, tmp_path):
    """``python -m titan_cp.generate`` with ``checkpoint.initial_load_path`` at torchtitan 0.3's DCP folder (its
    names: ``lm_head``, ``qkv_linear``; the byte vocabulary of titan_cp's default tokenizer) generates the tokens
    it generates from the same weights as titan_cp's own checkpoint; at CP 2 too."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: PLC0415

    from titan_cp.data.tokenizer import ByteTokenizer  # noqa: PLC0415

    vocab = ByteTokenizer().vocab_size
    theirs = _torchtitan_llama3_debugmodel(None, vocab_size=vocab)
    state = {k: v.detach() for k, v in theirs.state_dict().items()}
    dcp.save({**state, "train_state": {"step": torch.tensor(7)}}, checkpoint_id=str(tmp_path / "tt"), no_dist=True)
    ours = build_model("debugmodel", device="cpu", vocab_size=vocab)
    Checkpointer(tmp_path / "ckpt", [ours], [], {}).load_model(tmp_path / "tt")
    own = tmp_path / "run" / "checkpoint" / "step-1"
    dcp.save({"model": get_model_state_dict(ours)}, checkpoint_id=str(own), no_dist=True)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Packed documents, one after another.\n")

    def argv(cp: int, *weights: str) -> list[str]:
        return [
            "--model.flavor", "debugmodel", "--job.dump_folder", str(tmp_path / "run"),
            "--parallelism.context_parallel_degree", str(cp), "--generate.max_new_tokens", "8",
            "--generate.prompt_file", str(prompts), "--generate.output_file", f"out{cp}.jsonl", *weights,
        ]  # fmt: skip

    torchtitan = ["--checkpoint.initial_load_path", str(tmp_path / "tt")]
    (one,) = dist_pools.run(1, _generate, [argv(1, *torchtitan), argv(1, "--checkpoint.enable")])
    assert one[0] == one[1] and len(one[0][0]) == 8, one
    cp2 = dist_pools.run(2, _generate, [argv(2, *torchtitan)])
    assert cp2[0] == cp2[1] == [one[0]]
