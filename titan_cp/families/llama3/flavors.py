"""Model flavors. A name torchtitan also uses (``debugmodel``, ``8B``, ``70B``, ``405B``) is
torchtitan's model exactly (``torchtitan.models.llama3``: same shapes, RoPE theta and Llama 3.1
RoPE scaling, norm eps), so its checkpoints load as they are; titan_cp's own variants have
names torchtitan does not use (``tiny``, ``debugmodel_gqa``).

``build_model(flavor, vocab_size=..., device="meta")`` builds without allocating memory;
``model.to_empty(device=...)`` then ``model.init_weights()`` materialises it, as torchtitan
does, so that large flavors can be sharded before any weight exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from titan_cp.families.llama3.model import ModelArgs, RoPEScaling, Transformer

FLAVORS: dict[str, ModelArgs] = {
    # titan_cp's own. A few thousand parameters per layer: unit and multi-process tests on CPU.
    # 4 heads and 2 KV heads divide a TP degree of 2; dim 64 gives head_dim 16.
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=4096),
    # titan_cp's own: torchtitan's debug model shape with GQA (4 KV heads) and plain RoPE, so
    # CPU runs exercise grouped-query K/V exchange.
    "debugmodel_gqa": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=2048, multiple_of=256, max_seq_len=8192
    ),
    # titan_cp's own: tiny with sliding-window layers (every other one, window 5) and attention sinks.
    "tiny_swa": ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        multiple_of=32,
        max_seq_len=4096,
        attention_pattern="WF",
        window=5,
        sinks=True,
    ),
    # titan_cp's own: debugmodel_gqa with Gemma 3's pattern (five 512-token sliding-window layers,
    # then one global) and gpt-oss's per-head sinks.
    "debugmodel_swa": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=4,
        vocab_size=2048,
        multiple_of=256,
        max_seq_len=8192,
        attention_pattern="WWWWWF",
        window=512,
        sinks=True,
    ),
    # torchtitan's: MHA (16 KV heads) with Llama 3.1 RoPE scaling, as torchtitan's default args.
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        vocab_size=2048,
        multiple_of=256,
        rope_theta=500000,
        rope_scaling=RoPEScaling(),
        max_seq_len=131072,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000,
        rope_scaling=RoPEScaling(),
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000,
        rope_scaling=RoPEScaling(),
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000,
        rope_scaling=RoPEScaling(),
    ),
}


def model_args(flavor: str, **overrides: Any) -> ModelArgs:
    """The flavor's ``ModelArgs`` with fields replaced by ``overrides`` (e.g. ``vocab_size``)."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown model.flavor {flavor!r}; choose one of {sorted(FLAVORS)}")
    return dataclasses.replace(FLAVORS[flavor], **overrides)


def build_model(
    flavor: str, vocab_size: int | None = None, device: torch.device | str = "meta", **overrides: Any
) -> Transformer:
    """Build ``flavor`` on ``device``; on a real device its weights are initialised by
    ``init_weights`` (deterministic given the torch seed), on ``meta`` they are left for
    the caller to materialise after sharding."""
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    args = model_args(flavor, **overrides)
    with torch.device("meta"):
        model = Transformer(args)
    if torch.device(device).type != "meta":
        # same weights as meta + to_empty + init_weights: only init_weights draws random numbers
        model.to_empty(device=device)
        model.init_weights()
    return model
