"""A third model family for the registry tests: a tiny decoder without position embeddings (NoPE).

Neither titan_cp's Llama nor a ``transformers`` model: pre-norm blocks of a LayerNorm, causal attention
masked by document (q, k, v from one ``Linear``; the core is titan_cp's ``InnerAttention``, the seam CP
replaces) and a GELU MLP. Token order reaches the model through the causal mask alone, so a CP run that
gave a token the wrong keys or put it in the wrong place would show in the loss.

:class:`NoPE` is the family (one subclass of ``ModelFamily``); registering it (``register_family(NoPE())``)
is all titan_cp's trainer (``model.name = "nope_standin"``) and the Trainer factory need. The model
takes titan_cp's model contract (:class:`TinyNoPE`: tokens, positions, doc_lens, labels -> summed CE) and,
as :class:`TinyNoPEForTrainer`, the keyword batch ``shard_batch`` makes for ``transformers.Trainer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import parallelize_module

from titan_cp.attention import CPHandle
from titan_cp.families import ModelFamily
from titan_cp.families.init import ParamInit, draw_seed
from titan_cp.families.llama3.model import InnerAttention
from titan_cp.loss import chunked_cross_entropy_sum, chunked_evaluate
from titan_cp.parallel.adapter import ParallelAdapter
from titan_cp.parallel.build import ModelBuilder, build_parallel_model
from titan_cp.parallel.cp import ContextParallel

VOCAB, DIM, HEADS, LAYERS = 256, 32, 4, 2


class NoPEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.core = InnerAttention()  # (B, H, S, E) q, k, v and the documents -> (B, H, S, E)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: Tensor, doc_lens: Tensor | None) -> Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.out(self.core(q, k, v, doc_lens).transpose(1, 2).reshape(b, s, DIM))
        return x + self.mlp(self.mlp_norm(x))


class TinyNoPE(nn.Module):
    """titan_cp's model contract: ``(tokens, positions, doc_lens, labels)`` -> summed CE over the labels
    (shifted, -100 where no loss); ``predict``: ``(CE sum, argmax)``; no labels: logits."""

    def __init__(self, vocab_size: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, DIM)
        self.blocks = nn.ModuleList(NoPEBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Seeded per parameter name (``titan_cp.families.init``): the same values on any mesh."""
        init = ParamInit(self, draw_seed() if seed is None else seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                (init.ones_ if name.endswith("weight") else init.zeros_)(p)
            elif name.endswith("bias"):
                init.zeros_(p)
            else:
                init.normal_(p, std=0.5 if name.startswith("embed") else 0.2)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        doc_lens: Tensor | None = None,
        labels: Tensor | None = None,
        predict: bool = False,
    ) -> Any:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, doc_lens)
        h = self.norm(h)
        if labels is None:
            return self.head(h)
        if predict:
            return chunked_evaluate(h, self.head.weight, labels)
        return chunked_cross_entropy_sum(h, self.head.weight, labels)


class TinyNoPEForTrainer(TinyNoPE):
    """The same model under ``transformers.Trainer``'s contract: the keywords of ``shard_batch``
    (``shift_labels``: shifted inside each document; ``cp_doc_lens``: the layout's documents) in, the
    mean loss over ``num_items_in_batch`` out."""

    def forward(  # type: ignore[override]
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        shift_labels: Tensor | None = None,
        cp_doc_lens: Tensor | None = None,
        num_items_in_batch: Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, Tensor]:
        loss = super().forward(input_ids, position_ids, cp_doc_lens, shift_labels)
        return {"loss": loss / num_items_in_batch}


@dataclass
class NoPEBuilder(ModelBuilder):
    """Built on ``meta``, materialised shard by shard; CP, AC, compile and FSDP through the adapter (no TP, PP)."""

    vocab_size: int

    def meta(self) -> nn.Module:
        with torch.device("meta"):
            return TinyNoPE(self.vocab_size)

    def materialize(self, model: nn.Module, device: torch.device | str, seed: int | None) -> None:
        model.to_empty(device=device)
        model.init_weights(seed)


@dataclass
class NoPEShapes:
    """What the metrics ask of a model's size."""

    params: int

    def training_flops(self, num_tokens: int, attention_pairs: int) -> int:
        return 6 * self.params * num_tokens + 12 * LAYERS * DIM * attention_pairs


class NoPE(ModelFamily):
    """``model.name = "nope_standin"``: :class:`TinyNoPE`."""

    name = "nope_standin"

    def build_parallel(self, cfg, dims, options, device, vocab_size, loss_fn=None):
        parts = build_parallel_model(NoPEBuilder(vocab_size), dims, options, device, seed=cfg.training.seed)
        with torch.device("meta"):
            params = sum(p.numel() for p in TinyNoPE(vocab_size).parameters())
        return parts, NoPEShapes(params)

    def builds(self, axis: str) -> bool:
        return False  # neither TP nor PP

    def adapter(self, model: nn.Module) -> ParallelAdapter | None:
        if not isinstance(model, TinyNoPE):
            return None

        def attach_cp(handle: CPHandle) -> None:  # the handle apply_cp made: mesh, strategy, balance, kernel
            if handle.mesh is not None:
                parallelize_module(model, handle.mesh, {"blocks.*.core": ContextParallel(handle=handle)})

        tail: list[nn.Module] = [model.norm, model.head]
        return ParallelAdapter(model, model.blocks, attach_cp, self.name, model.embed, tail)
