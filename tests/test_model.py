"""Llama 3 model: names, shapes, flavors, RoPE at explicit positions, causality, init.

Tolerances: fp32 on CPU. Identities that hold exactly in real arithmetic but go through
different op orders (RoPE vs a complex-number reference, a shifted position grid) are
checked at 1e-5..1e-4 absolute, a few hundred fp32 ulps of O(1) values; checks that must
be bit-exact (pure copies, determinism) use ``torch.equal``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from titan_cp.families.llama3 import (
    FLAVORS,
    InnerAttention,
    ModelArgs,
    RoPEScaling,
    Transformer,
    apply_rotary_emb,
    build_model,
    model_args,
    rope_cos_sin,
    rope_frequencies,
)

try:
    from titan_cp.attention import local_attention  # noqa: F401

    HAVE_LOCAL_ATTENTION = True
except ImportError:
    HAVE_LOCAL_ATTENTION = False


def doc_causal_mask(doc_lens: torch.Tensor, s: int) -> torch.Tensor:
    """``(B, 1, S, S)`` bool: query t sees key u iff u <= t and both lie in the same document."""
    t = torch.arange(s)
    ends = doc_lens.cumsum(-1)  # (B, D); zero padding repeats the row's total, never <= t < S
    doc_id = (t[None, :, None] >= ends[:, None, :]).sum(-1)  # (B, S)
    same = doc_id[:, :, None] == doc_id[:, None, :]
    return (same & (t[None, :, None] >= t[None, None, :]))[:, None]


class SDPAAttention(InnerAttention):
    """Test stand-in used while ``titan_cp.attention.local_attention`` is not importable:
    SDPA with an explicit causal (and, given ``doc_lens``, block-diagonal) mask."""

    def forward(self, q, k, v, doc_lens):
        if doc_lens is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        mask = doc_causal_mask(doc_lens, q.shape[2]).to(q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def use_test_attention(model: Transformer, force: bool = False) -> Transformer:
    """Swap in the SDPA stand-in where ``local_attention`` is missing (or when ``force``)."""
    if force or not HAVE_LOCAL_ATTENTION:
        for block in model.layers.values():
            block.attention.inner_attention = SDPAAttention()
    return model


def tiny(seed: int = 0, **overrides) -> Transformer:
    """The "tiny" flavor in fp32 on CPU, initialised from ``seed``."""
    torch.manual_seed(seed)
    return use_test_attention(build_model("tiny", device="cpu", **overrides))


def batch(seed: int, b: int, s: int, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ------------------------------------------------------------------ names & shapes


def test_parameter_names_are_torchtitans():
    model = tiny()
    per_layer = [
        "attention.wq.weight",
        "attention.wk.weight",
        "attention.wv.weight",
        "attention.wo.weight",
        "feed_forward.w1.weight",
        "feed_forward.w2.weight",
        "feed_forward.w3.weight",
        "attention_norm.weight",
        "ffn_norm.weight",
    ]
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert set(model.state_dict()) == expected
    assert isinstance(model.layers, torch.nn.ModuleDict) and list(model.layers) == ["0", "1"]
    assert isinstance(model.layers["0"].attention.inner_attention, InnerAttention)


def test_shapes_and_gqa_heads_reach_inner_attention():
    model = tiny()
    args = model.args
    seen = []
    model.layers["0"].attention.inner_attention.register_forward_hook(
        lambda m, inp, out: seen.append([t.shape for t in inp[:3]] + [out.shape])
    )
    tokens, _ = batch(0, 3, 10)
    logits = model(tokens)
    assert logits.shape == (3, 10, args.vocab_size)
    hd = args.head_dim
    assert seen == [[(3, 4, 10, hd), (3, 2, 10, hd), (3, 2, 10, hd), (3, 4, 10, hd)]]  # K/V not expanded


@pytest.mark.parametrize("flavor, expected", [("8B", 8.03e9), ("70B", 70.55e9), ("405B", 405.85e9)])
def test_llama31_flavors_on_meta(flavor, expected):
    model = build_model(flavor)  # meta device: no memory
    assert all(p.is_meta for p in model.parameters())
    n = model.num_params()
    assert n == model.args.num_params()  # analytic count == module count, exactly
    assert abs(n - expected) / expected < 2e-3, n  # published sizes to 3-4 digits
    assert model.args.vocab_size == 128256 and model.args.rope_theta == 500000.0
    assert model.args.rope_scaling == RoPEScaling()


def test_small_flavors_and_overrides():
    dbg = model_args("debugmodel_gqa")
    assert (dbg.dim, dbg.n_layers, dbg.n_heads, dbg.kv_heads) == (256, 6, 16, 4)
    assert dbg.rope_scaling is None
    t = FLAVORS["tiny"]
    assert (t.dim, t.n_layers, t.n_heads, t.kv_heads) == (64, 2, 4, 2)
    m = build_model("debugmodel_gqa", vocab_size=1000)
    assert m.output.weight.shape == (1000, 256)
    assert m.num_params() == model_args("debugmodel_gqa", vocab_size=1000).num_params()


# torchtitan's llama3 flavors (torchtitan/models/llama3/__init__.py, v0.2): the names titan_cp
# shares with torchtitan must be these models exactly. Fields left out take torchtitan's
# TransformerModelArgs defaults: n_kv_heads = n_heads, multiple_of 256, no ffn multiplier,
# norm eps 1e-5, Llama 3.1 RoPE scaling (8, 1, 4, 8192), max_seq_len 131072.
TORCHTITAN_LLAMA3 = {
    "debugmodel": dict(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000),
    "8B": dict(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000
    ),
    "70B": dict(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096, rope_theta=500000
    ),
    "405B": dict(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096, rope_theta=500000
    ),
}
TORCHTITAN_DEFAULTS = dict(
    n_kv_heads=None,
    vocab_size=128256,
    multiple_of=256,
    ffn_dim_multiplier=None,
    norm_eps=1e-5,
    rope_scaling=RoPEScaling(8.0, 1.0, 4.0, 8192),
    max_seq_len=131072,
)


@pytest.mark.parametrize("flavor", sorted(TORCHTITAN_LLAMA3))
def test_flavors_named_as_torchtitans_are_torchtitans_models(flavor):
    want = {**TORCHTITAN_DEFAULTS, **TORCHTITAN_LLAMA3[flavor]}
    ours = FLAVORS[flavor]
    got = {k: getattr(ours, k) for k in want}
    got["n_kv_heads"] = None if ours.kv_heads == ours.n_heads else ours.kv_heads
    assert got == want
    assert ours.depth_init


def test_flavors_named_as_torchtitans_match_installed_torchtitan():
    tt = pytest.importorskip("torchtitan.models.llama3", reason="torchtitan is not installed (optional extra)")
    configs = getattr(tt, "llama3_args", None) or getattr(tt, "llama3_configs", None)
    if configs is None or not hasattr(next(iter(configs.values())), "n_layers"):
        pytest.skip("this torchtitan release describes models with nested configs, not TransformerModelArgs")
    for name in set(configs) & set(FLAVORS):
        theirs, ours = configs[name], FLAVORS[name]
        for field in (
            "dim",
            "n_layers",
            "n_heads",
            "vocab_size",
            "multiple_of",
            "ffn_dim_multiplier",
            "norm_eps",
            "rope_theta",
        ):
            assert getattr(ours, field) == getattr(theirs, field), (name, field)
        assert ours.kv_heads == (theirs.n_kv_heads or theirs.n_heads), name
        s = theirs.rope_scaling_args
        assert ours.rope_scaling == RoPEScaling(
            s.scaling_factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings
        ), name
    with pytest.raises(ValueError, match="model.flavor"):
        build_model("7B")


def test_flops_per_token_formula():
    a = FLAVORS["tiny"]
    n_non_embed = sum(p.numel() for n, p in tiny().named_parameters() if n != "tok_embeddings.weight")
    assert a.num_flops_per_token(128) == 6 * n_non_embed + 12 * a.n_layers * a.n_heads * a.head_dim * 128


def test_init_is_deterministic_and_meta_init_matches():
    a, b = tiny(seed=3), tiny(seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    meta = build_model("tiny")
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    for (_, pa), (_, pm) in zip(a.named_parameters(), meta.named_parameters()):
        assert torch.equal(pa, pm)
    assert not torch.equal(tiny(seed=4).output.weight, a.output.weight)


# ----------------------------------------------------------------------------- RoPE


def test_rope_equals_complex_rotation_by_position():
    torch.manual_seed(0)
    B, S, H, E = 2, 5, 3, 16
    x = torch.randn(B, S, H, E)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 100, 3, 4000, 0]])
    freqs = rope_frequencies(E, 500000.0, None)
    cos, sin = rope_cos_sin(positions, freqs)
    out = apply_rotary_emb(x, cos, sin)
    # reference: adjacent pairs as complex numbers times exp(i * p * freq_j) in float64, from
    # the same fp32 angles (fp32 rounding of p * freq at p = 4000 alone is ~2e-4 rad)
    xc = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    angles = (positions[..., None].float() * freqs).double()
    rot = torch.polar(torch.ones(B, S, E // 2, dtype=torch.float64), angles)
    ref = torch.view_as_real(xc * rot[:, :, None, :]).flatten(-2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    # position 0 is the identity
    torch.testing.assert_close(out[0, 0], x[0, 0], atol=0, rtol=0)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    E = 16
    q, k = torch.randn(1, 1, 1, E), torch.randn(1, 1, 1, E)
    freqs = rope_frequencies(E, 500000.0, RoPEScaling())

    def score(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([[pq]]), freqs)
        ck, sk = rope_cos_sin(torch.tensor([[pk]]), freqs)
        return (apply_rotary_emb(q, cq, sq) * apply_rotary_emb(k, ck, sk)).sum()

    torch.testing.assert_close(score(10, 3), score(1010, 1003), atol=1e-4, rtol=0)
    assert (score(10, 3) - score(10, 9)).abs() > 1e-3


def test_llama31_frequency_scaling():
    E, s = 128, RoPEScaling()
    plain, scaled = rope_frequencies(E, 500000.0, None), rope_frequencies(E, 500000.0, s)
    wavelen = 2 * math.pi / plain
    high = wavelen < s.original_max_position_embeddings / s.high_freq_factor
    low = wavelen > s.original_max_position_embeddings / s.low_freq_factor
    assert high.any() and low.any()
    torch.testing.assert_close(scaled[high], plain[high], atol=0, rtol=0)
    torch.testing.assert_close(scaled[low], plain[low] / s.scaling_factor, atol=0, rtol=1e-6)
    mid = ~high & ~low
    assert ((scaled[mid] <= plain[mid]) & (scaled[mid] >= plain[mid] / s.scaling_factor)).all()


def test_explicit_positions_reach_rope_in_every_layer():
    model = tiny()
    tokens, _ = batch(1, 2, 6)
    positions = torch.tensor([[5, 6, 7, 0, 1, 2], [100, 101, 102, 103, 104, 105]])
    captured = {}
    for lid, block in model.layers.items():
        block.attention.inner_attention.register_forward_hook(
            lambda m, inp, out, lid=lid: captured.__setitem__(lid + "qk", inp[:2])
        )
        block.attention.register_forward_hook(lambda m, inp, out, lid=lid: captured.__setitem__(lid + "x", inp[0]))
    model(tokens, positions=positions)
    freqs = rope_frequencies(model.args.head_dim, model.args.rope_theta, model.args.rope_scaling)
    cos, sin = rope_cos_sin(positions, freqs)
    for lid, block in model.layers.items():
        x, (q, k) = captured[lid + "x"], captured[lid + "qk"]
        attn = block.attention
        q_ref = apply_rotary_emb(attn.wq(x).view(2, 6, -1, attn.head_dim), cos, sin).transpose(1, 2)
        k_ref = apply_rotary_emb(attn.wk(x).view(2, 6, -1, attn.head_dim), cos, sin).transpose(1, 2)
        torch.testing.assert_close(q, q_ref, atol=0, rtol=0)
        torch.testing.assert_close(k, k_ref, atol=0, rtol=0)


def test_positions_default_shift_invariance_and_effect():
    model = tiny()
    with torch.no_grad():  # sharpen attention (init std 0.02 makes it ~uniform) so positions matter
        for block in model.layers.values():
            block.attention.wq.weight.mul_(30)
            block.attention.wk.weight.mul_(30)
    tokens, _ = batch(2, 2, 8)
    base = model(tokens)
    arange = torch.arange(8).expand(2, 8)
    torch.testing.assert_close(model(tokens, positions=arange), base, atol=0, rtol=0)
    # RoPE is relative: a uniform shift changes nothing, up to fp32 rounding of the angles
    # p * freq (~4096 * 2**-24 rad at p = 4096; observed ~5e-6 on O(1) logits)
    torch.testing.assert_close(model(tokens, positions=arange + 4096), base, atol=5e-5, rtol=0)
    # restarting positions mid-row (a packed second document) changes the later tokens only
    restarted = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]).expand(2, 8)
    out = model(tokens, positions=restarted)
    torch.testing.assert_close(out[:, :4], base[:, :4], atol=1e-6, rtol=0)
    assert (out[:, 4:] - base[:, 4:]).abs().max() > 1e-2  # observed ~8e-2


def test_doc_lens_reach_every_layer_unchanged():
    model = tiny()
    seen = []

    class Recorder(SDPAAttention):
        def forward(self, q, k, v, doc_lens):
            seen.append(doc_lens)
            return super().forward(q, k, v, doc_lens)

    for block in model.layers.values():
        block.attention.inner_attention = Recorder()
    tokens, _ = batch(3, 2, 8)
    doc_lens = torch.tensor([[3, 5, 0], [8, 0, 0]])
    model(tokens, doc_lens=doc_lens)
    assert len(seen) == 2 and all(d is doc_lens for d in seen)


def test_causal():
    model = tiny()
    tokens, _ = batch(4, 1, 12)
    changed = tokens.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 256
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], atol=1e-6, rtol=0)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-3


def test_packed_documents_equal_separate_documents():
    model = tiny()
    tokens, _ = batch(5, 2, 10)
    # row 0: documents of 4 and 6 tokens, positions restarting; row 1: one document
    doc_lens = torch.tensor([[4, 6], [10, 0]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], list(range(10))])
    packed = model(tokens, positions=positions, doc_lens=doc_lens)
    torch.testing.assert_close(packed[:1, :4], model(tokens[:1, :4]), atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[:1, 4:], model(tokens[:1, 4:]), atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[1:], model(tokens[1:]), atol=1e-5, rtol=0)


@pytest.mark.skipif(not HAVE_LOCAL_ATTENTION, reason="titan_cp.attention.local_attention not importable yet")
def test_default_inner_attention_is_local_attention():
    torch.manual_seed(0)
    model = build_model("tiny", device="cpu")  # default InnerAttention -> local_attention
    torch.manual_seed(0)
    reference = use_test_attention(build_model("tiny", device="cpu"), force=True)
    tokens, _ = batch(5, 2, 10)
    doc_lens = torch.tensor([[4, 6], [3, 7]])
    for kwargs in ({}, {"doc_lens": doc_lens}):
        torch.testing.assert_close(model(tokens, **kwargs), reference(tokens, **kwargs), atol=1e-5, rtol=0)


def test_model_args_defaults():
    a = ModelArgs()
    assert a.kv_heads == a.n_heads and a.head_dim == a.dim // a.n_heads
