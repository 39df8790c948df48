"""``torch.compile`` per transformer block.

Blocks are identical in structure, so compiling each block (rather than the whole model)
compiles once and reuses the code for all layers, and keeps FSDP's per-block hooks and
pipeline stage boundaries outside the compiled graphs. Apply after activation
checkpointing and before FSDP, as torchtitan does.
"""

from __future__ import annotations

import torch

from titan_cp.model.llama import Transformer


def apply_compile(model: Transformer, backend: str = "inductor", fullgraph: bool = False) -> None:
    """Replace each ``model.layers[i]`` in place by ``torch.compile(block)``.

    fullgraph: fail on a graph break instead of running part of a block eagerly. The
        attention core is opaque to the compiler (``torch.compiler.disable``: a Python loop
        over mask tiles, plus the CP communication), so a block breaks its graph once at the
        attention call; the default allows that break: attention runs eagerly between the
        compiled projections/RoPE and norms/MLP.
    ``model.state_dict()`` then shows an ``_orig_mod.`` prefix in block keys;
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` strips it, so
    checkpoints keep torchtitan's keys.
    """
    for layer_id, block in list(model.layers.items()):
        model.layers.register_module(layer_id, torch.compile(block, backend=backend, fullgraph=fullgraph))
