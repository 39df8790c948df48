"""``torch.compile`` per transformer block.

Blocks are identical in structure, so compiling each block (rather than the whole model)
compiles once and reuses the code for all layers, and keeps FSDP's per-block hooks and
pipeline stage boundaries outside the compiled graphs. Apply after activation
checkpointing and before FSDP, as torchtitan does.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_cp.parallel.adapter import adapter_of


def apply_compile(model: nn.Module, backend: str = "inductor", fullgraph: bool = True) -> None:
    """Replace each of ``model``'s blocks in place by ``torch.compile(block)``, whatever its family
    (:func:`~titan_cp.parallel.adapter.adapter_of`).

    fullgraph: fail on a graph break instead of running part of a block eagerly. The
        attention (local or context-parallel) is the ``titan_cp::cp_attention`` custom op
        with a fake implementation, so a block is one graph: the compiler fuses the
        projections, RoPE, norms and MLP around the op, which runs its communication and
        kernels eagerly.
    ``model.state_dict()`` then shows an ``_orig_mod.`` prefix in block keys;
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` strips it, so
    checkpoints keep torchtitan's keys.
    """
    adapter = adapter_of(model)
    for key, block in adapter.block_items():
        compiled = torch.compile(block, backend=backend, fullgraph=fullgraph)
        # torch.compile's stub returns a plain callable; for a module it is an nn.Module (OptimizedModule)
        adapter.replace_block(key, compiled)  # type: ignore[arg-type]
