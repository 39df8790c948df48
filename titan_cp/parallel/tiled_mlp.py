"""The feed-forward over tiles of local tokens, recomputed tile by tile in the backward.

A SwiGLU block's widest tensors are its feed-forward intermediates: ``w1 x``, ``w3 x``, their
SiLU product, ``(tokens, ffn_hidden)`` each (14,336 wide for Llama 3 8B, 3.5x the model width),
and the recomputation of a checkpointed block holds them all for every local token.
:func:`apply_tiled_mlp` runs each block's feed-forward over tiles of ``tile_tokens`` tokens (of
the microbatch's ``B x S_local``), each tile under its own non-reentrant
``torch.utils.checkpoint``: the forward keeps only the tiles' inputs (views of the block's
tensor) and the backward recomputes one tile at a time (the autograd engine finishes a tile's
nodes before it starts the previous tile's), so the wide intermediates exist for one tile at a
time. Attention is untouched: it still runs over all local tokens in one call.

Exactness: a token's output is the same function of its own input whatever the tile (the
feed-forward is per token), but the weight gradients are sums over tiles of per-tile
products, a different order of the same additions (and a matmul kernel may block a shorter
row count differently), so results agree to rounding, not bit for bit.

The feed-forward is replaced as its module's ``forward`` (the instance attribute), so the
module tree, its state-dict names and every hook on it (FSDP, tensor parallel) are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from titan_cp.parallel.adapter import adapter_of


def tiled(forward: Callable[[Tensor], Tensor], tile_tokens: int, x: Tensor) -> Tensor:
    """``forward(x)`` for x ``(..., D)``, computed over tiles of ``tile_tokens`` tokens (the
    leading dimensions flattened), each checkpointed; the output has ``forward``'s shape."""
    if not torch.is_grad_enabled() or x.shape[:-1].numel() <= tile_tokens:
        return forward(x)
    flat = x.reshape(-1, x.shape[-1])
    outs = [
        checkpoint(forward, tile, use_reentrant=False, preserve_rng_state=False) for tile in flat.split(tile_tokens)
    ]
    out = torch.cat(outs)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def check_tile_tokens(tile_tokens: int) -> None:
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 0:
        raise ValueError(f"activation_checkpoint.tile_tokens must be an integer >= 0 (0: off), got {tile_tokens!r}")


def tile_mlps(mlps: list[nn.Module], tile_tokens: int) -> None:
    """Run each feed-forward module of ``mlps`` over tiles of ``tile_tokens`` tokens (module doc); 0: no-op."""
    check_tile_tokens(tile_tokens)
    if tile_tokens == 0:
        return
    for mlp in mlps:
        original = getattr(mlp, "_untiled_forward", mlp.forward)
        mlp._untiled_forward = original  # type: ignore[assignment]  # stub: __setattr__ tensors/modules only
        mlp.forward = partial(tiled, original, tile_tokens)


def apply_tiled_mlp(model: nn.Module, tile_tokens: int) -> None:
    """``model``'s feed-forwards over tiles of ``tile_tokens`` local tokens (module doc), whatever its
    family (:func:`~titan_cp.parallel.adapter.adapter_of`: each block's ``mlp_name``); 0: off."""
    check_tile_tokens(tile_tokens)
    if tile_tokens:
        tile_mlps(adapter_of(model).mlps(), tile_tokens)
