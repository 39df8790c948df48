"""The planner's shapes of a Hugging Face model (``model.name = "hf"``), read from its ``config.json``.

Only the JSON is read (no ``transformers``, no weights): hidden size, layers, query and KV heads,
head size (``head_dim``, which need not be ``hidden / heads``), the MLP width, the vocabulary and
whether the head is tied, and each layer's attention (``layer_types``: full, sliding window,
chunked; gpt-oss's sinks). Tensor and pipeline parallelism are not built for these models, so the
planner lists meshes without them. A mixture of experts is refused (its weights and its compute
per token differ, which the planner's dense model cannot hold both of).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from titan_cp.families.llama3.model import ModelArgs

_KINDS = {"full_attention": "F", "sliding_attention": "W", "chunked_attention": "C"}


@dataclass
class HFShapes(ModelArgs):
    """:class:`ModelArgs` with the shapes a Hugging Face config sets on its own: ``hf_head_dim``,
    ``hf_ffn`` (the MLP width, ``intermediate_size``), ``tied`` (head = embedding)."""

    hf_head_dim: int = 128
    hf_ffn: int = 14336
    tied: bool = False
    name: str = "hf"

    @property
    def head_dim(self) -> int:
        return self.hf_head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hf_ffn

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count (one embedding when the head is tied to it)."""
        d, e, f = self.dim, self.head_dim, self.hf_ffn
        attention = d * self.n_heads * e * 2 + d * self.kv_heads * e * 2
        layer = attention + 3 * d * f + 2 * d
        n = self.n_layers * layer + d + (0 if self.tied else d * self.vocab_size)
        return n + (self.vocab_size * d if include_embedding else 0)


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def _pattern(c: dict, layers: int) -> tuple[str, int | None, int | None]:
    """Per-layer letters (F full, W window, C chunked), the window and the chunk size."""
    types = c.get("layer_types")
    if not types:
        sliding = c.get("sliding_window") is not None and c.get("use_sliding_window", True)
        types = ["sliding_attention" if sliding else "full_attention"] * layers
    unknown = sorted({t for t in types if t not in _KINDS})
    if unknown:
        raise ValueError(f"config.json layer_types {unknown}: the planner knows {sorted(_KINDS)}")
    letters = "".join(_KINDS[t] for t in types[:layers])
    window = c.get("sliding_window") if "W" in letters else None
    chunk = c.get("attention_chunk_size") if "C" in letters else None
    return letters, window, chunk


def hf_model_args(folder: str) -> HFShapes:
    """The planner's :class:`HFShapes` of the Hugging Face folder ``folder`` (its ``config.json``);
    ``ValueError`` naming ``model.hf_assets_path`` when it cannot be read."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"model.hf_assets_path = {folder!r} holds no config.json: the planner reads the model from it")
    c = _text_config(json.loads(path.read_text()))
    try:
        dim, layers, heads = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
        vocab = int(c["vocab_size"])
    except KeyError as e:
        raise ValueError(f"model.hf_assets_path = {folder!r}: config.json has no {e.args[0]!r}") from None
    experts = c.get("num_local_experts") or c.get("num_experts")
    if experts and int(experts) > 1:
        raise ValueError(
            f"model.hf_assets_path = {folder!r} is a mixture of experts (config.json {experts} experts): the "
            "planner models dense MLPs only; plan a dense model of the same attention shapes instead"
        )
    width = int(c.get("intermediate_size") or 4 * dim)
    letters, window, chunk = _pattern(c, layers)
    return HFShapes(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=int(c.get("num_key_value_heads") or heads),
        vocab_size=vocab,
        max_seq_len=int(c.get("max_position_embeddings") or 131072),
        attention_pattern=letters,
        window=window,
        chunk=chunk,
        sinks=c.get("model_type") == "gpt_oss",
        hf_head_dim=int(c.get("head_dim") or dim // heads),
        hf_ffn=width,
        tied=bool(c.get("tie_word_embeddings", False)),
        name=f"hf:{c.get('model_type', '?')}",
    )
