"""Llama 3 family transformer: RoPE at explicit positions, GQA, RMSNorm, SwiGLU.

Parameter names are torchtitan's (``tok_embeddings``, ``layers.N.attention.wq`` ...,
``norm``, ``output``), so state dicts are interchangeable. Parallelisms are applied from
outside by the ``titan_cp.parallel.apply_*`` functions; nothing here knows about meshes.

Shape legend for suffixed names:
  B batch, S sequence (local: a CP rank's tokens, not necessarily contiguous),
  D model dim, H query heads, K key/value heads, E head dim, F feed-forward hidden,
  V vocabulary. Head counts are inferred from tensor shapes, so they are the *local*
  counts after tensor parallelism shards wq/wk/wv.

RoPE is computed per token from ``positions`` (B, S), never from a table sliced by S:
under context parallelism and document packing a rank's tokens carry arbitrary global
or per-document positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, cast, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_cp.attention import local_attention
from titan_cp.families.init import ParamInit, draw_seed
from titan_cp.loss import chunked_cross_entropy_sum, chunked_evaluate


@dataclass(frozen=True)
class RoPEScaling:
    """Llama 3.1 RoPE frequency scaling (long-context extension of a model trained at 8K)."""

    scaling_factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelArgs:
    """Shapes of a Llama 3 model (``head_dim = dim // n_heads``)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: same as n_heads (no GQA)
    vocab_size: int = 128256
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RoPEScaling | None = None  # None: plain RoPE; RoPEScaling(): Llama 3.1
    max_seq_len: int = 131072  # informational (planner, configs); RoPE itself has no table
    depth_init: bool = True  # output projections' init std shrinks with layer depth
    # per-layer attention kinds, one letter a layer, the pattern repeated over the layers: "F" full
    # causal, "W" sliding window of ``window`` keys, "C" chunked into ``chunk``-token pieces of each
    # document. Gemma 3: "WWWWWF" (window 1024); gpt-oss: "WF" (window 128, with sinks); Llama 4: "CCCF".
    attention_pattern: str = "F"
    window: int | None = None
    chunk: int | None = None
    sinks: bool = False  # a learned sink logit per query head in every layer's softmax (gpt-oss)

    def __post_init__(self):
        kinds = set(self.attention_pattern)
        if not self.attention_pattern or kinds - {"F", "W", "C"}:
            raise ValueError(f"attention_pattern takes the letters F, W and C, got {self.attention_pattern!r}")
        for letter, field_, value in (("W", "window", self.window), ("C", "chunk", self.chunk)):
            if letter in kinds and (value is None or value < 1):
                raise ValueError(f"attention_pattern {self.attention_pattern!r} has {letter} layers: set {field_} >= 1")

    def layer_mask(self, layer_id: int) -> tuple[int | None, int | None]:
        """``(window, chunk)`` of layer ``layer_id`` (``None``: not windowed / not chunked)."""
        kind = self.attention_pattern[layer_id % len(self.attention_pattern)]
        return (self.window if kind == "W" else None), (self.chunk if kind == "C" else None)

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count of the whole model (``output`` is untied from ``tok_embeddings``)."""
        d, e, f = self.dim, self.head_dim, self.ffn_hidden_dim
        attention = d * self.n_heads * e * 2 + d * self.kv_heads * e * 2  # wq, wo; wk, wv
        layer = attention + 3 * d * f + 2 * d  # w1 w2 w3, two norms
        n = self.n_layers * layer + d + d * self.vocab_size  # + norm, output
        return n + (self.vocab_size * d if include_embedding else 0)

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), torchtitan's/PaLM's convention.

        ``6 * N`` for the matmuls of the N non-embedding parameters, plus
        ``12 * n_layers * n_heads * head_dim * seq_len`` for ``QK^T`` and ``PV``, counted
        over the full (non-causal) square, as torchtitan does, so MFU is comparable.
        """
        n = self.num_params(include_embedding=False)
        return 6 * n + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def training_flops(self, num_tokens: int, attention_pairs: int) -> int:
        """FLOPs of one forward + backward as actually computed: ``6 * N`` per token for the
        matmuls, plus ``12 * head_dim`` per head, layer and visible (query, key) pair for
        ``QK^T`` and ``PV`` (2 * 2 * head_dim forward, twice that backward). With causal and
        document masks the visible pairs are far fewer than ``seq_len^2``; use this for MFU.
        """
        n = self.num_params(include_embedding=False)
        return 6 * n * num_tokens + 12 * self.n_layers * self.n_heads * self.head_dim * attention_pairs


# ---------------------------------------------------------------------------- RoPE


def rope_frequencies(
    head_dim: int, theta: float, scaling: RoPEScaling | None, device: torch.device | str | None = None
) -> Tensor:
    """Inverse frequencies ``theta^(-2j/E)`` for j < E/2, fp32, with Llama 3.1 scaling.

    Scaling divides low frequencies (wavelength > original_max / low_freq_factor) by
    ``scaling_factor``, keeps high ones, and interpolates smoothly in between.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is None:
        return freqs
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = (1 - smooth) * freqs / scaling.scaling_factor + smooth * freqs
    freqs_out = torch.where(wavelen > low_freq_wavelen, freqs / scaling.scaling_factor, freqs)
    return torch.where((wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen), scaled, freqs_out)


MAX_POSITIONS = 2**24
"""Positions the model computes exactly: RoPE turns them into float32 angles (:func:`rope_cos_sin`),
and float32 holds every integer exactly only up to 2**24. ``ModelArgs.max_seq_len`` is no limit:
there is no position table (the trainer's ``training.seq_len`` has the same bound)."""


def rope_cos_sin(positions: Tensor, freqs: Tensor) -> tuple[Tensor, Tensor]:
    """``positions`` (B, S) int -> ``cos, sin`` (B, S, E/2) fp32 of the angles ``p * freq_j``."""
    angles_BSE2 = positions.to(torch.float32)[..., None] * freqs
    return angles_BSE2.cos(), angles_BSE2.sin()


def apply_rotary_emb(x_BSHE: Tensor, cos_BSE2: Tensor, sin_BSE2: Tensor) -> Tensor:
    """Rotate each pair ``(x[2j], x[2j+1])`` by the angle ``p * freq_j`` of its token.

    The interleaved-pair convention is torchtitan's (``view_as_complex`` of adjacent
    pairs), so wq/wk weights are interchangeable. Computed in fp32, returned in x's dtype.
    """
    x = x_BSHE.float().unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    cos, sin = cos_BSE2[:, :, None, :], sin_BSE2[:, :, None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x_BSHE)


# ------------------------------------------------------------------------ modules


class InnerAttention(nn.Module):
    """Exact causal, document-masked attention; the seam that context parallelism replaces.

    ``forward(q, k, v, doc_lens) -> out`` with q ``(B, H, S, E)``, k and v ``(B, K, S, E)``
    (grouped-query heads not expanded), ``doc_lens`` ``(B, max_docs)`` int64 zero-padded
    document lengths per row (None: one causal document per row); returns ``(B, H, S, E)``.
    ``window`` and ``chunk`` are the layer's mask (see ``ModelArgs.attention_pattern``); ``sinks``,
    where the model has them, a learned ``(H,)`` logit per head in the softmax denominator.
    """

    def __init__(self, window: int | None = None, chunk: int | None = None, heads: int | None = None) -> None:
        super().__init__()
        self.window, self.chunk = window, chunk
        self.sinks = nn.Parameter(torch.empty(heads)) if heads else None

    def local_sinks(self) -> Tensor | None:
        """The sinks of this rank's heads (a tensor-parallel DTensor's local shard)."""
        sinks = self.sinks
        return sinks.to_local() if sinks is not None and hasattr(sinks, "to_local") else sinks

    def forward(self, q: Tensor, k: Tensor, v: Tensor, doc_lens: Tensor | None) -> Tensor:
        return local_attention(
            q, k, v, doc_lens=doc_lens, causal=True, window=self.window, chunk=self.chunk, sinks=self.local_sinks()
        )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int = 0) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        window, chunk = args.layer_mask(layer_id)
        self.inner_attention = InnerAttention(window, chunk, args.n_heads if args.sinks else None)

    def init_weights(self, init: ParamInit, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init.trunc_normal_(linear.weight, std=0.02)
        init.trunc_normal_(self.wo.weight, std=init_std)
        if self.inner_attention.sinks is not None:
            init.zeros_(self.inner_attention.sinks)

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, doc_lens: Tensor | None) -> Tensor:
        B, S, _ = x_BSD.shape
        # -1: local head counts, as tensor parallelism shards wq/wk/wv by heads
        q_BSHE = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k_BSKE = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v_BSKE = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        q_BSHE = apply_rotary_emb(q_BSHE, cos, sin)
        k_BSKE = apply_rotary_emb(k_BSKE, cos, sin)
        out_BHSE = self.inner_attention(
            q_BSHE.transpose(1, 2), k_BSKE.transpose(1, 2), v_BSKE.transpose(1, 2), doc_lens
        )
        return self.wo(out_BHSE.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init: ParamInit, init_std: float) -> None:
        init.trunc_normal_(self.w1.weight, std=0.02)
        for linear in (self.w2, self.w3):
            init.trunc_normal_(linear.weight, std=init_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        depth = (layer_id + 1) if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self, init: ParamInit) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            init.ones_(norm.weight)
        self.attention.init_weights(init, self.weight_init_std)
        self.feed_forward.init_weights(init, self.weight_init_std)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, doc_lens: Tensor | None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, doc_lens)
        return h + self.feed_forward(self.ffn_norm(h))


class Output(nn.Linear):
    """The output projection ``D -> V``. ``output(h)`` gives logits ``(B, S, V)``;
    ``output(h, labels)`` gives the summed token cross-entropy (fp32, 0-dim), computed chunk
    by chunk so that the ``(B*S, V)`` logits never exist whole (``titan_cp.loss``);
    ``output(h, labels, predict=True)`` gives ``(CE sum, argmax predictions (B, S))`` the same way."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__(dim, vocab_size, bias=False)

    @overload
    def forward(self, h: Tensor, labels: None = None, predict: bool = False) -> Tensor: ...
    @overload
    def forward(self, h: Tensor, labels: Tensor, predict: Literal[False] = False) -> Tensor: ...
    @overload
    def forward(self, h: Tensor, labels: Tensor, predict: Literal[True]) -> tuple[Tensor, Tensor]: ...
    @overload
    def forward(self, h: Tensor, labels: Tensor | None, predict: bool) -> Tensor | tuple[Tensor, Tensor]: ...
    def forward(self, h: Tensor, labels: Tensor | None = None, predict: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        if labels is None:
            return F.linear(h, self.weight)
        if predict:  # evaluation: (CE sum, argmax predictions), chunked, no gradient
            return chunked_evaluate(h, self.weight, labels)
        return chunked_cross_entropy_sum(h, self.weight, labels)


class Transformer(nn.Module):
    """Llama 3 decoder. A pipeline stage holds some of its parts (others None, layers left out
    of the ``ModuleDict``, names unchanged); the same forward runs every stage."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)  # None: another stage's
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: Output | None = Output(args.dim, args.vocab_size)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter in place; skips parts a pipeline stage does not hold.

        Each parameter is drawn from generators seeded by ``(seed, its name, block of rows)``
        and each rank fills only its own shard (``titan_cp.families.init``): the values do not
        depend on the mesh, and nothing larger than a shard is allocated. ``seed`` None draws
        one from torch's global generator (deterministic given ``torch.manual_seed``).
        """
        init = ParamInit(self, draw_seed() if seed is None else seed)
        if self.tok_embeddings is not None:
            init.normal_(self.tok_embeddings.weight, std=1.0)
        for layer in self.layers.values():
            # a block, or a wrapper (compile, checkpointing) that hands attribute reads on to it
            cast(TransformerBlock, layer).init_weights(init)
        if self.norm is not None:
            init.ones_(self.norm.weight)
        if self.output is not None:
            std, cutoff = self.args.dim**-0.5, 3.0
            init.trunc_normal_(self.output.weight, std=std, a=-cutoff * std, b=cutoff * std)

    def num_params(self) -> int:
        """Parameters held by this module (a whole model, or one pipeline stage)."""
        return sum(p.numel() for p in self.parameters())

    def num_flops_per_token(self, seq_len: int) -> int:
        return self.args.num_flops_per_token(seq_len)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        doc_lens: Tensor | None = None,
        labels: Tensor | None = None,
        predict: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """tokens ``(B, S)`` int64 (or hidden states ``(B, S, D)`` on a later pipeline stage);
        positions ``(B, S)`` int64 RoPE positions (default ``arange(S)``); doc_lens
        ``(B, max_docs)`` int64 zero-padded packed-document lengths, given unchanged to every
        layer's attention; labels ``(B, S)`` int64 (``IGNORE_INDEX`` where no loss).
        Returns logits ``(B, S, V)``, or with ``labels`` the summed token cross-entropy (fp32,
        0-dim, the logits never whole), and with ``labels`` and ``predict`` the pair (that sum,
        argmax predictions ``(B, S)``) for evaluation; hidden states ``(B, S, D)`` before the last stage.
        """
        B, S = tokens.shape[0], tokens.shape[1]
        if positions is None:
            positions = torch.arange(S, device=tokens.device).expand(B, S)
        freqs = rope_frequencies(self.args.head_dim, self.args.rope_theta, self.args.rope_scaling, tokens.device)
        cos, sin = rope_cos_sin(positions, freqs)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, cos, sin, doc_lens)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        return self.output(h) if labels is None else self.output(h, labels, predict=predict)
