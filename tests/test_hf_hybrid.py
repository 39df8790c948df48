"""Hybrid linear-attention models through the Hugging Face door: Qwen3.5 (dense, MoE), Qwen3-Next (MoE),
Bamba, Nemotron-H and Granite 4 (Mamba2 hybrids), tiny configs, packed documents, CP 1, 2 and 4 with the
attention layers on ring, all-gather and Ulysses: loss and every gradient against each document run alone.

Two oracles, both the model's own ``transformers`` code run one document at a time:
- fp64: the layers' recurrences swapped (in the reference process only) for a token-by-token fp64
  recurrence (``tests.reference``), since ``transformers``' torch kernels compute in fp32 whatever the
  model's dtype; the CP run in fp64 too: exact up to float64 rounding (bar 1e-5, measured ~1e-12);
- fp32, on one process: ``transformers``' own torch kernels as shipped (the fp32 noise floor of these
  models' gradients is ~2e-5 against fp64, for transformers' kernels and titan_cp's alike: bar 1e-4).
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402

from tests.dist_utils import get_mesh  # noqa: E402
from tests.reference import reference_conv, reference_gated_delta, reference_ssd  # noqa: E402
from tests.test_hf_integration import VOCAB, _grad_err, _grads, packed_batch, reference, rel_err  # noqa: E402
from titan_cp.integrations.hf_linear import BINDING  # noqa: E402
from titan_cp.integrations.hf_model import linear_modules  # noqa: E402
from titan_cp.integrations.transformers import CausalLM, apply_cp  # noqa: E402

COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, max_position_embeddings=64, num_attention_heads=4, num_key_value_heads=4
)
GDN = dict(
    head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
    linear_conv_kernel_dim=4, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
MAMBA = dict(intermediate_size=48, num_hidden_layers=3)
FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", dict(**GDN, intermediate_size=48)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(**GDN, **MOE)),
    "qwen3_next": ("Qwen3NextConfig", dict(**GDN, **MOE, intermediate_size=48, decoder_sparse_step=1)),
    "bamba": (
        "BambaConfig",
        dict(
            **MAMBA,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_chunk_size=8,
            attn_layer_indices=[1],
        ),
    ),  # fmt: skip
    "nemotron_h": (
        "NemotronHConfig",
        dict(
            intermediate_size=48,
            num_hidden_layers=4,
            head_dim=8,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=8,
            chunk_size=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
            layers_block_type=["mamba", "attention", "moe", "mamba"],
        ),
    ),  # fmt: skip
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        dict(
            **MAMBA,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_chunk_size=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=16,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        ),
    ),
}
BAR = ("qwen3_5", "qwen3_next", "bamba")  # at CP 2 and 4 on every strategy; the others at CP 2, one strategy
STRATEGIES = ("ring", "allgather", "ulysses")
MODULES = {  # the modeling modules whose recurrences the fp64 oracle swaps
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
    "bamba": "bamba",
    "nemotron_h": "nemotron_h",
    "granitemoehybrid": "granitemoehybrid",
}


def hybrid_model(family: str, dtype: torch.dtype, attn: str = "eager", seed: int = 0):
    name, fields = FAMILIES[family]
    config = getattr(transformers, name)(**{**COMMON, **fields})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn, dtype=dtype, experts_implementation="eager"
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) + (1.0 if "norm" in n else 0.0))
    return model


def _fp64_gated_delta(
    query, key, value, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **kw
):
    assert initial_state is None and not output_final_state
    return reference_gated_delta(query, key, value, g, beta, qk_l2norm=use_qk_l2norm_in_kernel), None


def _fp64_ssd(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
              dt_limit=(0.0, float("inf")), return_final_states=False, **kw):  # fmt: skip
    assert initial_states is None and not return_final_states
    dt = dt + dt_bias if dt_bias is not None else dt
    dt = torch.clamp(torch.nn.functional.softplus(dt) if dt_softplus else dt, *dt_limit)
    y = reference_ssd(hidden_states, dt, A, B, C)
    return y + D[:, None] * hidden_states if D is not None else y


def _fp64_conv(hidden_states, weight, bias=None, activation=None, **kw):
    out = reference_conv(hidden_states.transpose(1, 2), weight, bias, activation=activation)
    return out.transpose(1, 2)


@contextlib.contextmanager
def fp64_kernels(family: str):
    """``transformers``' fp32 torch recurrences of ``family``'s modeling module replaced by fp64 token loops
    (and its convolution by a token loop: torch's fp64 depthwise convolution is slow on a CPU)."""
    module = importlib.import_module(f"transformers.models.{MODULES[family]}.modeling_{MODULES[family]}")
    swaps = {
        "torch_chunk_gated_delta_rule": _fp64_gated_delta,
        "mamba2_chunk_scan": _fp64_ssd,
        "causal_conv1d_fn": _fp64_conv,
    }
    saved = {n: getattr(module, n) for n in swaps if hasattr(module, n)}
    for n in saved:
        setattr(module, n, swaps[n])
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(module, n, f)


@functools.cache
def oracle(family: str, dtype: torch.dtype):
    """Each document on its own through ``transformers``' own model: logits, loss, gradients."""
    model = hybrid_model(family, dtype)
    with fp64_kernels(family) if dtype == torch.float64 else contextlib.nullcontext():
        return reference(model, packed_batch())


def _case(family: str, dtype: torch.dtype, strategy: str, balance: str, cp_mesh, want) -> dict[str, float]:
    want_logits, want_loss, want_grads = want
    model = hybrid_model(family, dtype, attn="titan_cp")
    cp = apply_cp(model, cp_mesh, strategy=strategy, balance=balance)
    group = None if cp_mesh is None else cp_mesh.get_group()
    local = cp.shard(packed_batch())
    out = model(**local)
    out.loss.backward()
    loss = out.loss.detach().clone()
    if group is not None:
        torch.distributed.all_reduce(loss, group=group)
    errors = {
        "logits": rel_err(cp.unshard(out.logits, local["cp_doc_lens"]), want_logits),
        "loss": rel_err(loss, want_loss),
        "grads": _grad_err(_grads(model, group), want_grads),
    }
    if cp_mesh is not None and cp_mesh.size() != 2:
        return errors
    model.zero_grad(set_to_none=True)  # at CP 2, titan_cp's loss: chunked where the head is plain (not Granite's)
    lm = CausalLM(model)
    assert (lm.head is None) == (family == "granitemoehybrid"), family
    chunked = lm(local["input_ids"], local["position_ids"], local["cp_doc_lens"], local["shift_labels"])
    (chunked / local["num_items_in_batch"]).backward()
    errors["chunked_grads"] = _grad_err(_grads(lm, group), want_grads)
    return errors


def _jobs(cp: int) -> list[tuple[str, str]]:
    """``(family, strategy)`` runs at ``cp``: one process, every family; CP 2 and 4, each strategy for the
    families of the bar and, at CP 2, one strategy (taking turns) for each other family."""
    if cp == 1:
        return [(f, "ring") for f in FAMILIES]
    jobs = [(f, s) for f in BAR for s in STRATEGIES]
    others = [f for f in FAMILIES if f not in BAR] if cp == 2 else []
    return jobs + [(f, STRATEGIES[i % len(STRATEGIES)]) for i, f in enumerate(others)]


def _exactness(rank, world, cps, dtype, wants, balances):
    """:func:`_jobs` at each cp size of ``cps`` (a ``(world // cp, cp)`` mesh, the dp groups sharing out the
    work), the balances taking turns."""
    results = {}
    for cp in cps:
        mesh = get_mesh((world // cp, cp), ("dp", "cp"))
        cp_mesh, group = (mesh["cp"] if cp > 1 else None), mesh["dp"].get_local_rank()
        for j, (family, strategy) in enumerate(_jobs(cp)):
            if j % (world // cp) == group:
                balance = balances[j % len(balances)]
                results[(cp, family, strategy, balance)] = _case(
                    family, dtype, strategy, balance, cp_mesh, wants[family]
                )
    return results


BALANCES = ("doc_local", "doc_zigzag", "zigzag", "contiguous")


def test_hybrid_models_equal_each_document_run_alone(dist_pools):
    """fp64 (the bar): every family on one process, the bar's at CP 2 and 4 on every strategy, the others at
    CP 2; the balances take turns, so that each runs at CP 2 and at CP 4."""
    wants = {family: oracle(family, torch.float64) for family in FAMILIES}
    results = {}
    for r in dist_pools.run(4, _exactness, (1, 2, 4), torch.float64, wants, BALANCES, timeout=900):
        results.update(r)
    assert {(cp, f, s) for cp, f, s, _ in results} == {(cp, f, s) for cp in (1, 2, 4) for f, s in _jobs(cp)}
    assert all({b for cp_, *_, b in results if cp_ == cp} == set(BALANCES) for cp in (2, 4))
    bad = {key: errors for key, errors in results.items() if max(errors.values()) > 1e-5}
    assert not bad, bad


def test_transformers_own_kernels_agree_on_one_process():
    """fp32, against ``transformers``' torch kernels as shipped (their q/k normalisation, scale, gates and
    limits, not the fp64 oracle's): every family on one process."""
    for family in FAMILIES:
        errors = _case(family, torch.float32, "ring", "contiguous", None, oracle(family, torch.float32))
        assert max(errors.values()) < 1e-4, (family, errors)


def test_every_linear_layer_is_bound_and_the_state_dict_is_unchanged():
    for family in FAMILIES:
        model = hybrid_model(family, torch.float32, attn="titan_cp")
        names = list(model.state_dict())
        apply_cp(model, None)
        layers = linear_modules(model)
        assert layers and all(getattr(m, BINDING) is not None for m in layers), family
        assert list(model.state_dict()) == names
        assert type(layers[0]).forward is not layers[0].forward.__func__  # the instance's own, not the class's


def test_a_linear_layer_titan_cp_does_not_run_is_refused_by_name():
    """Kimi Linear's KDA layers (a per-channel decay) are not titan_cp's: refused naming the class."""
    config = transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="titan_cp")
    with pytest.raises(ValueError, match="not one titan_cp runs under CP"):
        apply_cp(model, None)


def test_a_cached_or_padded_call_is_refused():
    model = hybrid_model("qwen3_5", torch.float32, attn="titan_cp")
    apply_cp(model, None)
    layer = linear_modules(model)[0]
    h = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="without a cache"):
        layer(h, cache=object())
    with pytest.raises(ValueError, match="padding attention_mask"):
        layer(h, attention_mask=torch.tensor([[1, 1, 0, 0]]))


def test_titan_cp_trainer_trains_a_qwen35_folder_under_cp_as_one_process(dist_pools, tmp_path):
    """``model.name = "hf"`` on a Qwen3.5 folder (Gated DeltaNet and gated attention layers): CP 2 (ring x the
    linear layers' state passing) and FSDP 2 x CP 2 give one process's losses."""
    from tests.test_hf_integration import _losses, _train, _trainer_argv  # noqa: PLC0415
    from titan_cp.integrations.hf_tiny import tiny_qwen35_folder  # noqa: PLC0415

    folder = tiny_qwen35_folder(tmp_path / "qwen35")
    common = ("--checkpoint.enable", "false", "--training.seq_len", "512")

    def losses(world, cp, dp):
        return _losses(
            dist_pools.run(world, _train, _trainer_argv(folder, tmp_path / f"{world}", cp, dp, 3, *common))[0]
        )

    one = losses(1, 1, 1)
    assert one[2] < one[0] - 1e-3  # it trains
    # the first two steps within 1e-5; the third within 1e-4: fp32's summation order, which AdamW's
    # normalised update amplifies for parameters whose gradient is near zero (3.5e-5 measured at step 3;
    # the exactness itself is test_hybrid_models_equal_each_document_run_alone's, in fp64)
    for got in (losses(2, 2, 1), losses(4, 2, 2)):
        assert got[:2] == pytest.approx(one[:2], rel=1e-5) and got[2] == pytest.approx(one[2], rel=1e-4)


def test_generation_refuses_linear_layers_naming_what_runs(tmp_path):
    from titan_cp.generate.hf_runner import HFRunner, build_hf_model  # noqa: PLC0415
    from titan_cp.integrations.hf_tiny import tiny_qwen35_folder  # noqa: PLC0415

    model = build_hf_model(tiny_qwen35_folder(tmp_path / "qwen35"))
    with pytest.raises(ValueError, match="linear-attention layers"):
        HFRunner(model)


def test_linear_layers_compile_with_fullgraph_as_eager():
    """A bound Gated DeltaNet layer and a Mamba2 mixer under ``torch.compile(fullgraph=True)``: the ops' fakes
    give the shapes and strides the real ops return, forward and backward equal eager."""
    for family in ("qwen3_5", "bamba"):
        model = hybrid_model(family, torch.float32, attn="titan_cp")
        apply_cp(model, None)
        layer = linear_modules(model)[0]
        h = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
        docs = torch.tensor([[1, 13, 3, 7], [5, 1, 18, 0]])
        eager = layer(h, cp_doc_lens=docs)
        (grad,) = torch.autograd.grad(eager.square().sum(), h)
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)(h, cp_doc_lens=docs)
        assert rel_err(compiled, eager) < 1e-6
        assert rel_err(torch.autograd.grad(compiled.square().sum(), h)[0], grad) < 1e-6
