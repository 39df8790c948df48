"""Hugging Face decoders under titan_cp (``titan_cp.integrations.transformers``).

The oracle runs every packed document *on its own* through the same model with
``transformers``' eager attention, on one process: logits, the loss (summed token cross-entropy
over the step's loss-bearing tokens) and every parameter's gradient. The CP runs see the same
packed rows split over the cp ranks by a layout; their logits are gathered and unpermuted,
their losses and gradients summed over the ranks.

Families: tiny random configs built by ``transformers`` itself (2 layers, hidden 32-48): Llama
(GQA), Qwen2 (q/k/v biases), Qwen3 (q/k norms, tied embeddings), Mistral (MQA, 12 heads, so
Ulysses splits heads over 3 ranks too) and Gemma (tied embeddings, scaled embeddings); DeepSeek V3
(multi-head latent attention: q/k 16 + 8 rotary = 24, v 16; a dense layer then a MoE layer with
group-limited top-2 routing over 4 experts and a shared expert; YaRN rope whose mscale changes the
softmax scale) and a config shaped like Kimi K2's (the same architecture: one expert group, its own
routing scale and YaRN parameters). Rows hold a one-token document and documents longer than a shard.

Tolerance, fp32: the CP runs add the same numbers in another order (log-sum-exp merges of tiles,
gradients summed over ranks), ~1e-6 relative; we assert 1e-4 of each tensor's largest entry, and
1e-5 for the MLA families.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")

from tests.dist_utils import get_mesh  # noqa: E402
from titan_cp.attention import CPHandle  # noqa: E402
from titan_cp.attention.strategy import get_strategy  # noqa: E402
from titan_cp.balance import balance_names  # noqa: E402
from titan_cp.integrations.hf_model import attention_modules  # noqa: E402
from titan_cp.integrations.transformers import (  # noqa: E402
    CausalLM,
    apply_ac,
    apply_compile,
    apply_cp,
    apply_fsdp,
    handle_of,
    shard_batch,
)

BALANCES = balance_names()
from titan_cp.loss import IGNORE_INDEX  # noqa: E402
from titan_cp.preflight import check_files, check_model  # noqa: E402

TOL = 1e-4
ONE = CPHandle(None)  # one device: every balance keeps the tokens in order
VOCAB, SEQ = 96, 24
ROWS = ([1, 13, 3, 7], [5, 1, 18])  # a one-token document; 13 and 18 are longer than a CP 4 shard (6)
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=64)
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)),
    "mistral": (
        "MistralConfig",
        dict(hidden_size=48, num_attention_heads=12, num_key_value_heads=1, sliding_window=None),
    ),
    "gemma": ("GemmaConfig", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)),
}
GQA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
MASKED = {  # layers with windows, chunks or sinks, each shorter than the longest documents
    "mistral_swa": ("MistralConfig", dict(hidden_size=48, num_attention_heads=12, num_key_value_heads=1, sliding_window=5)),
    "qwen3_swa": ("Qwen3Config", dict(**GQA, use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
    "gemma3": ("Gemma3TextConfig", dict(**GQA, sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8)),
    "gpt_oss": ("GptOssConfig", dict(**GQA, sliding_window=5, layer_types=["sliding_attention", "full_attention"], num_local_experts=2, num_experts_per_tok=1)),
    "llama4": ("Llama4TextConfig", dict(**GQA, intermediate_size_mlp=48, attention_chunk_size=4, num_local_experts=2)),
}  # fmt: skip
FAMILIES.update(MASKED)
MLA = dict(  # multi-head latent attention: q/k 16 + 8 = 24, v 16 (the tiny DeepSeek V3)
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    first_k_dense_replace=1,
    n_shared_experts=1,
    moe_intermediate_size=16,
)
YARN = dict(rope_type="yarn", original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0, beta_slow=1.0)
FAMILIES.update({
    "deepseek_v3": ("DeepseekV3Config", dict(**MLA, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, rope_parameters=dict(YARN, rope_theta=10000.0, factor=4.0, beta_fast=32.0))),
    # Kimi K2's config.json names DeepseekV3ForCausalLM: one expert group, its routing scale, rope theta and YaRN
    # (factor 32 over its original context, as 128K over 4K)
    "kimi_k2": ("DeepseekV3Config", dict(**MLA, n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.827, rope_parameters=dict(YARN, rope_theta=50000.0, factor=32.0, original_max_position_embeddings=2, beta_fast=1.0))),
})  # fmt: skip
MLA_FAMILIES, MLA_TOL = ("deepseek_v3", "kimi_k2"), 1e-5
ONE_STRATEGY = {*MASKED, "kimi_k2"}  # wiring one strategy per mesh shows, the strategies taking turns
STRATEGIES = ("ring", "allgather", "ulysses")


def hf_model(family: str, seed: int = 0, attn: str = "eager"):
    """A random model of ``family``; every weight drawn distinct (norms around 1), so that a swapped
    or missed parameter cannot pass."""
    name, fields = FAMILIES[family]
    config = getattr(transformers, name)(**{**COMMON, **fields})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) + (1.0 if "norm" in n and family != "gemma" else 0.0))
    return model


def packed_batch(rows=ROWS, seed: int = 1) -> dict:
    """HF-style packed rows: ``position_ids`` restart at 0 at each document; labels unshifted, -100 on
    each document's first token (as ``DataCollatorWithFlattening`` separates them) and on a prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(rows), sum(rows[0])), generator=g)
    labels = ids.clone()
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in rows])
    labels[positions == 0] = IGNORE_INDEX
    labels[0, 2:5] = IGNORE_INDEX  # a prompt: no loss on it
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def reference(model, batch: dict, rows=ROWS):
    """Each document on its own through ``model`` (eager attention): the rows' logits ``(B, S, V)``,
    the loss (summed CE / loss-bearing tokens) and every parameter's gradient, by name."""
    model.zero_grad(set_to_none=True)
    logits, total, count = [], 0.0, 0
    for b, row in enumerate(rows):
        pieces, start = [], 0
        for n in row:
            ids, labels = batch["input_ids"][b, start : start + n], batch["labels"][b, start : start + n]
            out = model(input_ids=ids[None], use_cache=False).logits[0]
            pieces.append(out)
            target = labels[1:]
            total = total + torch.nn.functional.cross_entropy(
                out[:-1], target, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            count += int((target != IGNORE_INDEX).sum())
            start += n
        logits.append(torch.cat(pieces))
    loss = total / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return torch.stack(logits).detach(), loss.detach(), grads


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _grads(model, group) -> dict:
    """Every parameter's gradient, whole: summed over ``group`` (cp ranks hold different tokens), or
    gathered from FSDP's shards (FSDP already summed them)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):
            g = g.full_tensor()
        elif group is not None:
            g = g.clone()
            dist.all_reduce(g, group=group)
        out[name] = g
    return out


def _grad_err(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max(rel_err(got[n], want[n]) for n in want)


_REFERENCES: dict = {}


def _reference(family: str):
    if family not in _REFERENCES:
        _REFERENCES[family] = reference(hf_model(family), packed_batch())
    return _REFERENCES[family]


def _case(family: str, strategy: str, balance: str, cp_mesh, chunked: bool = True) -> dict:
    """Errors of one CP run against the per-document reference: HF's own loss path
    (``model(**local).loss``) and, with ``chunked``, titan_cp's chunked loss (:class:`CausalLM`)."""
    want_logits, want_loss, want_grads = _reference(family)
    model = hf_model(family, attn="titan_cp")
    cp = apply_cp(model, cp_mesh, strategy=strategy, balance=balance)
    group = None if cp_mesh is None else (cp_mesh if cp_mesh.ndim == 1 else cp_mesh._flatten()).get_group()
    local = cp.shard(packed_batch())
    out = model(**local)
    out.loss.backward()
    loss = out.loss.detach().clone()
    if group is not None:
        dist.all_reduce(loss, group=group)
    errors = {
        "logits": rel_err(cp.unshard(out.logits, local["cp_doc_lens"]), want_logits),
        "loss": rel_err(loss, want_loss),
        "grads": _grad_err(_grads(model, group), want_grads),
    }
    if not chunked:
        return errors
    model.zero_grad(set_to_none=True)
    lm = CausalLM(model)
    chunked = lm(local["input_ids"], local["position_ids"], local["cp_doc_lens"], local["shift_labels"])
    chunked = chunked / local["num_items_in_batch"]
    chunked.backward()
    chunked = chunked.detach().clone()
    if group is not None:
        dist.all_reduce(chunked, group=group)
    errors["chunked_loss"] = rel_err(chunked, want_loss)
    errors["chunked_grads"] = _grad_err(_grads(lm, group), want_grads)
    return errors


def _exactness(rank, world, shapes):
    """Every family x strategy on each ``(dp, cp)`` mesh shape (the dp groups share out the families), but at CP 4
    the strategies take turns over the families other than the MLA ones (each strategy still runs there; the
    engine's strategies are checked at world 1-4 in test_attention and test_documents); the balances take turns
    so that each appears on every mesh with more than one cp rank."""
    results = {}
    for dp, cp in shapes:
        mesh = get_mesh((dp, cp), ("dp", "cp"))
        cp_mesh, group = (mesh["cp"] if cp > 1 else None), mesh["dp"].get_local_rank()
        for i, family in enumerate(FAMILIES):
            if i % dp != group:
                continue
            heads = FAMILIES[family][1]
            strategies = STRATEGIES if cp > 1 else STRATEGIES[:1]  # one device: no strategy
            turns = family in ONE_STRATEGY or (cp == 4 and family not in MLA_FAMILIES)
            if turns and cp > 1:  # the masks' (and Kimi K2's config's) wiring, and CP 4's: taking turns
                k = (i + cp) % len(STRATEGIES)
                strategies = STRATEGIES[k:] + STRATEGIES[:k]
            for j, strategy in enumerate(strategies):
                try:
                    get_strategy(strategy).check_heads(heads["num_attention_heads"], heads["num_key_value_heads"], cp)
                except ValueError:
                    continue  # these heads do not split over cp ranks (Ulysses); apply_cp refuses them
                balance = BALANCES[(i + j) % len(BALANCES)]
                # titan_cp's chunked loss once per family and strategy (at CP 2): it reads the same local batch
                results[(cp, family, strategy, balance)] = _case(family, strategy, balance, cp_mesh, chunked=cp == 2)
                if turns:
                    break
    return results


def _check_exactness(results: dict, cps: set[int]) -> None:
    assert {key[0] for key in results} == cps
    assert {key[1] for key in results} == set(FAMILIES)
    assert all({key[3] for key in results if key[0] == cp} == set(BALANCES) for cp in cps - {1})
    assert all(("chunked_grads" in errs) == (key[0] == 2) for key, errs in results.items())
    assert all({key[2] for key in results if key[0] == cp} == set(STRATEGIES) for cp in cps - {1})
    bad = {
        key: errs for key, errs in results.items() if max(errs.values()) > (MLA_TOL if key[1] in MLA_FAMILIES else TOL)
    }
    assert not bad, bad


def _hybrid(rank, world):
    """Hybrid CP 4: Ulysses over 2 ranks inside a ring of 2, on a 2-D (cp_ring, cp_ulysses) mesh."""
    return _case("mistral", "hybrid", "doc_zigzag", get_mesh((2, 2), ("cp_ring", "cp_ulysses")))


def test_logits_loss_and_gradients_equal_each_document_run_alone_cp1_2_4(dist_pools):
    results = {}
    for r in dist_pools.run(4, _exactness, ((4, 1), (2, 2), (1, 4)), timeout=900):
        results.update(r)
    _check_exactness(results, {1, 2, 4})
    for errors in dist_pools.run(4, _hybrid):
        assert max(errors.values()) <= TOL, errors


def test_compiled_checkpointed_layers_keep_loss_and_gradients():
    """``torch.compile`` (fullgraph: the CP op is one node) over op-level checkpointed decoder layers."""
    _, want_loss, want_grads = reference(hf_model("qwen3"), packed_batch())
    model = hf_model("qwen3", attn="titan_cp")
    cp = apply_cp(model, None)
    lm = CausalLM(model)
    apply_ac(lm, "op")
    apply_compile(lm, backend="aot_eager")
    assert all(type(layer).__name__ == "OptimizedModule" for layer in lm.model.layers)
    local = cp.shard(packed_batch())
    loss = lm(local["input_ids"], local["position_ids"], local["cp_doc_lens"], local["shift_labels"])
    loss = loss / local["num_items_in_batch"]
    loss.backward()
    assert rel_err(loss.detach(), want_loss) <= TOL
    assert _grad_err({_clean(n): p.grad for n, p in lm.named_parameters()}, want_grads) <= TOL


# ---- FSDP 2 x CP 2 --------------------------------------------------------------------------------

_FLAT: dict = {}


def _dp_cp_meshes():
    mesh = get_mesh((2, 2), ("dp", "cp"))
    if "dp_cp" not in _FLAT:
        _FLAT["dp_cp"] = mesh["dp", "cp"]._flatten("dp_cp")
    return mesh["dp"], mesh["cp"], _FLAT["dp_cp"]


def _clean(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")


def _fsdp_cp(rank, world, cases):
    """FSDP 2 x CP 2: dp rank d trains row d of the two-row batch; the summed loss and the (FSDP-summed)
    gradients against one process running every document of both rows on its own."""
    dp_mesh, cp_mesh, fsdp_mesh = _dp_cp_meshes()
    d = dp_mesh.get_local_rank()
    results = {}
    for family, chunked, ac in cases:
        _, want_loss, want_grads = _reference(family)
        model = hf_model(family, attn="titan_cp")
        cp = apply_cp(model, cp_mesh, strategy="ring", balance="doc_zigzag")
        target = CausalLM(model) if chunked else model
        apply_ac(target, ac)
        apply_fsdp(target, fsdp_mesh)
        rows = {k: v[d : d + 1] for k, v in packed_batch().items()}
        local = cp.shard(rows, dp_mesh=dp_mesh)
        if chunked:
            loss = target(local["input_ids"], local["position_ids"], local["cp_doc_lens"], local["shift_labels"])
            loss = loss / local["num_items_in_batch"]
        else:
            loss = target(**local).loss
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grads = {_clean(n): g for n, g in _grads(target, None).items()}
        results[(family, chunked, ac)] = {"loss": rel_err(total, want_loss), "grads": _grad_err(grads, want_grads)}
    return results


def test_fsdp2_x_cp2_loss_and_gradients_equal_one_process(dist_pools):
    cases = [
        ("qwen3", False, "none"),
        ("qwen3", True, "full"),
        ("llama", True, "op"),
        ("gemma", False, "full"),
        ("gpt_oss", False, "full"),  # sinks: a parameter of each attention, its gradient summed by FSDP
        ("gemma3", True, "none"),  # sliding layers
    ]
    results = dist_pools.run(4, _fsdp_cp, cases, timeout=600)
    for r in results:
        assert set(r) == set(cases)
        bad = {key: errs for key, errs in r.items() if max(errs.values()) > TOL}
        assert not bad, bad


# ---- what titan_cp refuses ------------------------------------------------------------------------

TINY = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
REFUSED = {
    "Gemma2Config": (dict(num_key_value_heads=1, head_dim=8), ["attention logit soft-capping (config.attn_logit_softcapping = 50.0)"]),
    "Llama4TextConfig": (dict(num_key_value_heads=1, head_dim=8, intermediate_size_mlp=32, attention_chunk_size=16, num_local_experts=2, no_rope_layer_interval=2), ["query temperature tuning on the NoPE layers [1] (config.attn_temperature_tuning with config.no_rope_layers)"]),
    "LlamaConfig": (dict(attention_dropout=0.1), ["attention dropout (config.attention_dropout = 0.1"]),
}  # fmt: skip


def _meta_model(config_name: str, **fields):
    config = getattr(transformers, config_name)(**fields)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("config_name", list(REFUSED))
def test_attention_titan_cp_does_not_run_is_refused_naming_layer_type_and_field(config_name):
    fields, phrases = REFUSED[config_name]
    model = _meta_model(config_name, **TINY, **fields)
    with pytest.raises(ValueError, match="does not run yet") as e:
        apply_cp(model, None)
    for phrase in phrases:
        assert phrase in str(e.value)
    assert model.config._attn_implementation != "titan_cp"  # refused before anything changed


def test_layer_types_titan_cp_does_not_run_are_refused_by_name():
    model = _meta_model("Qwen3Config", **TINY, num_key_value_heads=1)
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"layers of type 'linear_attention' \(config.layer_types\)"):
        apply_cp(model, None)
    model.config.layer_types = ["sliding_attention", "full_attention"]
    model.config.sliding_window = 0
    with pytest.raises(ValueError, match=r"'sliding_attention' without a positive config.sliding_window \(0\)"):
        apply_cp(model, None)


def test_each_layer_binds_its_own_mask():
    """Windows, chunks and plain layers as each family's config names them; sinks come with the call."""

    def masks(family):
        model = hf_model(family, attn="titan_cp")
        apply_cp(model, None)
        return [(m.titan_cp_binding.window, m.titan_cp_binding.chunk) for m in attention_modules(model)]

    assert masks("mistral_swa") == [(5, None), (5, None)]  # no layer_types: config.sliding_window, every layer
    assert masks("gemma3") == [(4, None), (None, None)]
    assert masks("gpt_oss") == [(5, None), (None, None)]
    assert masks("qwen3_swa") == [(6, None), (None, None)]
    assert masks("llama4") == [(None, 4), (None, 4)]
    assert masks("qwen3") == [(None, None), (None, None)]
    stray = hf_model("llama", attn="titan_cp")  # a window in a config whose layers never ask for one
    stray.config.sliding_window = 5
    cp = apply_cp(stray, None)
    with pytest.raises(
        ValueError, match=r"LlamaAttention \(layer 0\) asks for sliding window None but apply_cp bound 5"
    ):
        stray(**cp.shard(packed_batch()))


def test_causal_lm_refuses_a_router_loss_it_would_drop():
    model = _meta_model("Qwen3MoeConfig", **TINY, num_key_value_heads=1, num_experts=2, output_router_logits=True)
    with pytest.raises(ValueError, match=r"config.output_router_logits = True: its router's auxiliary loss"):
        CausalLM(model)


def test_model_without_attention_interface_is_refused():
    model = _meta_model("BloomConfig", vocab_size=32, hidden_size=16, n_layer=1, n_head=2)
    with pytest.raises(ValueError, match="BloomForCausalLM .* does not call attention through transformers' Attention"):
        apply_cp(model, None)


def test_attention_without_apply_cp_and_a_batch_without_the_handle_are_errors():
    model = hf_model("llama", attn="titan_cp")
    local = shard_batch(packed_batch(), CPHandle(None, balance="doc_zigzag"))
    with pytest.raises(ValueError, match="no CP mesh is bound to it: call .*apply_cp"):
        model(**local)
    with pytest.raises(ValueError, match=r"shard_batch takes the handle apply_cp returned .*got NoneType"):
        shard_batch(packed_batch(), None)  # type: ignore[arg-type]  # the mesh-and-balance form of before


# ---- shard_batch on one device --------------------------------------------------------------------


def test_shard_batch_reads_flattening_collators_positions_and_cu_seq_lens_alike():
    docs = [[5, 9, 2], [7], [3, 3, 8, 1, 4, 6]]
    features = [{"input_ids": d} for d in docs]
    by_positions = transformers.DataCollatorWithFlattening(return_tensors="pt")(features)
    by_cu = transformers.DataCollatorWithFlattening(
        return_tensors="pt", return_position_ids=False, return_flash_attn_kwargs=True
    )(features)
    assert "position_ids" not in by_cu and "cu_seq_lens_q" in by_cu
    a, b = shard_batch(by_positions, ONE), shard_batch(by_cu, ONE)
    assert a["cp_doc_lens"].tolist() == b["cp_doc_lens"].tolist() == [[3, 1, 6]]
    for key in ("input_ids", "position_ids", "shift_labels"):
        assert torch.equal(a[key], b[key]), key
    assert a["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4, 5]]
    # next token inside each document; nothing after a document's last token (nor after a 1-token one)
    assert a["shift_labels"].tolist() == [[9, 2, -100, -100, 3, 8, 1, 4, 6, -100]]
    assert int(a["num_items_in_batch"]) == 7 and a["labels"] is a["shift_labels"] and a["use_cache"] is False
    plain = shard_batch({"input_ids": by_positions["input_ids"], "shift_labels": a["shift_labels"]}, ONE)
    assert plain["cp_doc_lens"].tolist() == [[10]]  # no documents given: one per row
    assert torch.equal(plain["shift_labels"][:, :-1], a["shift_labels"][:, :-1])


def test_shard_batch_pads_with_a_document_of_its_own():
    batch = packed_batch(rows=([4, 3],))  # 7 tokens; zigzag needs a multiple of 2 even on one device
    with pytest.raises(ValueError, match=r"input_ids has 7 tokens per row, .* pad_token_id=\.\.\."):
        shard_batch(batch, CPHandle(None, balance="zigzag"))
    local = shard_batch(batch, CPHandle(None, balance="zigzag"), pad_token_id=0)
    assert local["cp_doc_lens"].tolist() == [[4, 3, 1]]
    assert local["input_ids"][0, -1] == 0 and local["shift_labels"][0, -1] == IGNORE_INDEX
    assert local["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]


BAD_BATCHES = {
    "positions not restarting at 0": (
        lambda b: b.update(position_ids=b["position_ids"] + 3),
        r"position_ids row 0 starts at 3, not 0",
    ),
    "positions decreasing inside a document": (
        lambda b: b["position_ids"][1, 9].fill_(1),
        r"position_ids row 1 goes from 2 to 1 at token 9: inside a packed document positions count up by one",
    ),
    "labels already shifted": (
        lambda b: b.update(labels=torch.cat([b["input_ids"][:, 1:], torch.full((2, 1), IGNORE_INDEX)], 1)),
        r"labels look already shifted .* pass labels unshifted .* or pass the shifted ones as shift_labels",
    ),
    "labels and shift_labels": (
        lambda b: b.update(shift_labels=b["labels"]),
        r"both labels and shift_labels: give labels \(unshifted.* or shift_labels \(already shifted\), not both",
    ),
    "padding mask": (
        lambda b: b.update(attention_mask=torch.ones(2, SEQ, dtype=torch.long).index_fill_(1, torch.tensor([0]), 0)),
        r"attention_mask has padding \(zeros\)",
    ),
    "an unknown key": (lambda b: b.update(pixel_values=torch.zeros(1)), r"does not know how to shard .*'pixel_values'"),
    "cu_seq_lens across rows": (
        lambda b: (b.pop("position_ids"), b.update(cu_seq_lens=torch.tensor([0, 20, 48]))),
        r"cu_seq_lens has a document across a row boundary \(no boundary at token 24\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_bad_batches_are_value_errors_naming_the_argument(case):
    change, message = BAD_BATCHES[case]
    batch = packed_batch()
    change(batch)
    with pytest.raises(ValueError, match=message):
        shard_batch(batch, ONE)


def _sequence_cp_does_not_divide(rank, world):
    _, cp_mesh, _ = _dp_cp_meshes()
    batch = {k: v[:, :23] for k, v in packed_batch().items()}  # the last document cut to 6 tokens
    try:
        shard_batch(batch, CPHandle(cp_mesh))
    except ValueError as e:
        return str(e)
    return None


def test_sequence_cp_does_not_divide_is_a_value_error(dist_pools):
    for message in dist_pools.run(4, _sequence_cp_does_not_divide):
        assert message is not None and "input_ids has 23 tokens per row" in message
        assert "cannot split over cp size 2" in message and "pad_token_id" in message


# ---- the trainer on a Hugging Face folder ---------------------------------------------------------


def _train(rank, world, argv):
    from titan_cp.train import main  # noqa: PLC0415

    return main(argv)


def _losses(records) -> list[float]:
    return [r["loss"] for r in records]


class _Preempted(Exception):
    pass


def _train_until(rank, world, argv, stop_after_save):
    """Train, and die right after the checkpoint of step ``stop_after_save`` (a preempted job)."""
    from titan_cp import checkpoint as ckpt_module  # noqa: PLC0415
    from titan_cp.train import main  # noqa: PLC0415

    real = ckpt_module.Checkpointer.save

    def save(self, step):
        path = real(self, step)
        if step == stop_after_save:
            raise _Preempted(step)
        return path

    ckpt_module.Checkpointer.save = save
    try:
        main(argv)
    except _Preempted:
        pass
    finally:
        ckpt_module.Checkpointer.save = real


def _trainer_argv(folder, dump, cp: int, dp: int = 1, steps: int = 4, *extra) -> list[str]:
    return [
        "--job.config_file", "train_configs/hf/qwen3_cp.toml",
        "--model.hf_assets_path", str(folder),
        "--checkpoint.initial_load_path", str(folder),
        "--job.dump_folder", str(dump),
        "--training.seq_len", "1024",
        "--training.global_batch_size", "2",
        "--training.steps", str(steps),
        "--training.mixed_precision_param", "float32",
        "--optimizer.lr", "3e-3",
        "--lr_scheduler.warmup_steps", "2",
        "--lr_scheduler.decay_ratio", "0",  # constant after warmup: 2-step and 4-step runs share their first steps
        "--checkpoint.interval", "2",
        "--checkpoint.keep_latest_k", "0",
        "--checkpoint.last_save_in_hf", "false",
        "--metrics.log_freq", "100",
        "--parallelism.context_parallel_degree", str(cp),
        "--parallelism.data_parallel_shard_degree", str(dp),
        *extra,
    ]  # fmt: skip


def _dcp_model(folder, step_dir):
    """The HF model of ``folder`` with the weights of the trainer's DCP checkpoint ``step_dir`` (one process)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager")
    state = {f"model.{k}": v for k, v in model.state_dict().items()}  # the parameters' storage: loaded in place
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return model.eval()


def _built_like_the_trainer(rank, world, folder):
    """The trainer's HF model (meta, AC, FSDP over the world, shards allocated, buffers restored,
    weights loaded): its logits and loss against ``from_pretrained``'s, each document on its own."""
    from titan_cp.integrations import hf_folder  # noqa: PLC0415
    from titan_cp.mesh import ParallelDims  # noqa: PLC0415
    from titan_cp.parallel.build import ParallelizeOptions  # noqa: PLC0415

    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, world_size=world)
    dims.build_mesh("cpu")
    model, _ = hf_folder.build_parallel_hf_model(folder, dims, ParallelizeOptions(ac_mode="full"), "cpu")
    hf_folder.load_hf_weights(model, folder)
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), attn_implementation="eager", dtype=torch.float32
    )
    want_logits, want_loss, _ = reference(reference_model, packed_batch())
    local = handle_of(model).shard(packed_batch())
    with torch.no_grad():
        logits = model(local["input_ids"], local["position_ids"], local["cp_doc_lens"])
        loss = model(local["input_ids"], local["position_ids"], local["cp_doc_lens"], local["shift_labels"])
    return rel_err(logits, want_logits), rel_err(loss / local["num_items_in_batch"], want_loss)


def test_the_trainers_model_is_the_folders_model(dist_pools, tmp_path):
    """Built on meta with FSDP (world 2) and without (world 1, where allocating unties the tied
    embedding and titan_cp ties it again), from an fp32 and a bf16 folder."""
    from titan_cp.integrations.hf_tiny import tiny_qwen3_folder  # noqa: PLC0415

    for dtype in (torch.float32, torch.bfloat16):
        folder = tiny_qwen3_folder(tmp_path / str(dtype), dtype=dtype)
        for world in (1, 2):
            for errors in dist_pools.run(world, _built_like_the_trainer, folder):
                assert max(errors) <= TOL, (dtype, world, errors)


def test_trainer_trains_a_hugging_face_folder_on_any_mesh_and_exports_it(dist_pools, tmp_path):
    from titan_cp.integrations.hf_tiny import tiny_qwen3_folder  # noqa: PLC0415

    folder = tiny_qwen3_folder(tmp_path / "qwen3")

    def run(world, dump, cp, dp, steps, *extra):
        return dist_pools.run(world, _train, _trainer_argv(folder, dump, cp, dp, steps, *extra), timeout=600)[0]

    straight = _losses(run(2, tmp_path / "straight", 2, 1, 4, "--checkpoint.last_save_in_hf", "true"))
    validated = ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "1"]
    one = run(1, tmp_path / "one", 1, 1, 2, "--checkpoint.enable", "false", *validated)
    fsdp = _losses(
        run(4, tmp_path / "fsdp", 2, 2, 2, "--checkpoint.enable", "false", "--activation_checkpoint.mode", "none")
    )
    assert straight[1] < straight[0] - 1e-3  # it trains
    assert _losses(one) == pytest.approx(straight[:2], rel=1e-5)
    assert fsdp == pytest.approx(straight[:2], rel=1e-5)
    assert 0 < one[1]["val_loss"] < 2 * one[0]["loss"]  # validation (chunked, argmax predictions) ran
    resumed = tmp_path / "run"
    dist_pools.run(2, _train_until, _trainer_argv(folder, resumed, 2, 1, 4), 2, timeout=600)
    # resumes at step 2 on FSDP 2 x CP 2, with the long-context options on (the straight run had none)
    long_context = [
        "--activation_checkpoint.mode", "full",
        "--activation_checkpoint.cpu_offload", "true",
        "--activation_checkpoint.blocks_per_checkpoint", "2",
        "--activation_checkpoint.tile_tokens", "16",
        "--training.enable_cpu_offload", "true",
    ]  # fmt: skip
    records = run(4, resumed, 2, 2, 4, *long_context)
    assert all(r["host_activation_peak_bytes"] > 0 for r in records)  # the decoder layers' inputs went to the host
    tail = _losses(records)
    assert tail == pytest.approx(straight[2:], rel=1e-4)
    exported = tmp_path / "straight" / "checkpoint" / "step-4-hf"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(exported), attn_implementation="eager").eval()
    trained = _dcp_model(folder, tmp_path / "straight" / "checkpoint" / "step-4")
    ids = torch.randint(0, loaded.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = loaded(input_ids=ids).logits, trained(input_ids=ids).logits
        initial = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()(input_ids=ids).logits
    assert rel_err(got, want) < 1e-6
    assert rel_err(initial, want) > 1e-3  # the export is the trained model, not the one it started from
    text = "keys and values go round the ring"
    exported_tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))  # the tokenizer files came along
    assert (
        exported_tokenizer(text)["input_ids"]
        == transformers.AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    )


def test_logits_loss_and_gradients_equal_each_document_run_alone_cp3(dist_pools):
    """Last in the file: the only test on 3 ranks (the pools of 1, 2 and 4 ranks stay alive before it)."""
    results = {}
    for r in dist_pools.run(3, _exactness, ((1, 3),), timeout=900):
        results.update(r)
    _check_exactness(results, {3})
    assert (3, "mistral", "ulysses", BALANCES[(3 + 2) % 4]) in results  # 12 heads split over 3 ranks


# ---- the trainer's config -------------------------------------------------------------------------


def _hf_job(folder, *extra):
    from titan_cp.config import load_config  # noqa: PLC0415

    argv = ["--job.config_file", "train_configs/hf/qwen3_cp.toml", "--model.hf_assets_path", str(folder)]
    return load_config([*argv, "--checkpoint.initial_load_path", str(folder), *extra], warn_adjustments=False)


def test_trainer_config_errors_name_the_key(tmp_path):
    from titan_cp.config import load_config  # noqa: PLC0415
    from titan_cp.integrations.hf_tiny import byte_tokenizer, tiny_qwen3_folder  # noqa: PLC0415

    with pytest.raises(ValueError, match=r"model.name = 'hf' needs model.hf_assets_path"):
        check_model(load_config(["--model.name", "hf"], warn_adjustments=False))  # the family's own keys
    no_config = tmp_path / "tokenizer_only"
    byte_tokenizer(no_config)
    with pytest.raises(ValueError, match=r"model.hf_assets_path = .*tokenizer_only' holds no config.json"):
        check_files(_hf_job(no_config))
    folder = tiny_qwen3_folder(tmp_path / "qwen3")
    check_files(_hf_job(folder))  # the TOML as it is loads and passes every check
    for extra, message in [
        (["--parallelism.tensor_parallel_degree", "2"], r"parallelism.tensor_parallel_degree = 2: model.name = 'hf'"),
        (
            ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2"],  # 2 microbatches
            r"parallelism.pipeline_parallel_degree = 2: model.name",
        ),
        (["--model.flavor", "tiny"], r"model.flavor = 'tiny' shapes titan_cp's Llama; .* remove model.flavor"),
        (
            ["--checkpoint.initial_load_in_hf", "false"],
            r"set checkpoint.initial_load_path .* and checkpoint.initial_load_in_hf = true",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            check_model(_hf_job(folder, *extra))
    with pytest.raises(ValueError, match=r"context_parallel_degree: the model's heads \(config.json: 4 query, 2 KV\)"):
        check_files(
            _hf_job(
                folder,
                "--parallelism.context_parallel_strategy",
                "ulysses",
                "--parallelism.context_parallel_degree",
                "8",
            )
        )
    config = json.loads((folder / "config.json").read_text())
    config.update(sliding_window=64, use_sliding_window=True, layer_types=["full_attention", "sliding_attention"])
    (folder / "config.json").write_text(json.dumps(config))
    check_files(_hf_job(folder))  # sliding layers run
    config.update(attention_dropout=0.1)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"model.hf_assets_path = .*attention dropout \(config.attention_dropout = 0.1"
    ):
        check_files(_hf_job(folder))


# ---- the loop of docs/huggingface.md ----------------------------------------------------------------


def _readme_loop() -> str:
    text = (Path(__file__).parents[1] / "docs" / "huggingface.md").read_text()
    block = text.split("<!-- doc-test: tested tests/test_hf_integration.py -->\n```python\n", 1)[1].split("```", 1)[0]
    return block


def _run_readme_loop(rank, world, code, folder):
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    os.environ.update(MODEL=str(folder), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/huggingface.md", "exec"), {"__name__": "__main__"})
    return out.getvalue().splitlines()


def test_the_readme_loop_runs_fsdp2_x_cp2_and_on_one_process(dist_pools, tmp_path):
    from titan_cp.integrations.hf_tiny import tiny_qwen3_folder  # noqa: PLC0415

    code = _readme_loop()
    assert 25 <= len(code.strip().splitlines()) <= 40
    folder = tiny_qwen3_folder(tmp_path / "qwen3")
    for world in (4, 1):
        lines = dist_pools.run(world, _run_readme_loop, code, folder, timeout=600)
        assert all(r == [] for r in lines[1:])  # rank 0 prints the step's global loss, the others nothing
        losses = [float(line.split()[-1]) for line in lines[0]]
        assert [line.split()[1] for line in lines[0]] == ["0", "1", "2"]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[2] < losses[0]


def test_the_readme_loop_trains_a_hybrid_model_unchanged(dist_pools, tmp_path):
    """The same loop on a tiny Qwen3.5 folder (Gated DeltaNet layers beside gated attention, docs/hybrid.md):
    CP 2 prints one process's losses."""
    from titan_cp.integrations.hf_tiny import tiny_qwen35_folder  # noqa: PLC0415

    folder, code = tiny_qwen35_folder(tmp_path / "qwen35"), _readme_loop()
    cp2, one = (dist_pools.run(world, _run_readme_loop, code, folder, timeout=600)[0] for world in (2, 1))
    losses = [[float(line.split()[-1]) for line in lines] for lines in (cp2, one)]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-5)
