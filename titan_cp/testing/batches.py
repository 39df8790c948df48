"""Packed microbatches for tests and benchmarks, and CP meshes per strategy.

:func:`labels_and_positions` is the one place that turns document lengths into the per-token
tensors the model needs: positions restart at 0 in each document, and the label of a token is
the next token of its document (``IGNORE_INDEX`` on a document's last token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_cp.attention.strategy import get_strategy
from titan_cp.loss import IGNORE_INDEX
from titan_cp.step import Microbatch


def doc_lens_tensor(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """``(B, max_docs)`` int64, zero-padded: the model's ``doc_lens`` argument."""
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)


def labels_and_positions(tokens: torch.Tensor, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, positions)`` ``(B, S)`` int64 of packed ``tokens`` ``(B, S)`` whose row ``b``
    holds documents of lengths ``rows[b]`` (summing to ``S``), computed without Python loops
    over tokens."""
    s = tokens.shape[1]
    labels = torch.full_like(tokens, IGNORE_INDEX)
    positions = torch.empty_like(tokens)
    for i, lens in enumerate(rows):
        lens_t = torch.tensor(list(lens), dtype=torch.long)
        if int(lens_t.sum()) != s or (lens_t < 1).any():
            raise ValueError(f"row {i}: document lengths must be positive and sum to {s}, got {list(lens)}")
        starts = torch.cumsum(lens_t, 0) - lens_t
        positions[i] = torch.arange(s) - torch.repeat_interleave(starts, lens_t)
        last = torch.cumsum(lens_t, 0) - 1  # each document's last token has no next token
        nxt = torch.ones(s, dtype=torch.bool)
        nxt[last] = False
        labels[i, :-1] = torch.where(nxt[:-1], tokens[i, 1:], IGNORE_INDEX)
    return labels, positions


def packed_batch(rows: Sequence[Sequence[int]], vocab_size: int, seed: int = 0) -> Microbatch:
    """Random tokens in ``[0, vocab_size)`` packed as ``rows`` (document lengths per row)."""
    s = sum(rows[0])
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (len(rows), s), generator=g)
    labels, positions = labels_and_positions(tokens, rows)
    return Microbatch(tokens, labels, positions, doc_lens_tensor(rows))


def strategy_mesh(strategy: str, world: int, ulysses: int = 1, device_type: str = "cpu") -> DeviceMesh:
    """The CP mesh a strategy runs on over all ``world`` ranks: 1-D ``("cp",)``, or for
    ``hybrid`` the 2-D ``("cp_ring", "cp_ulysses")`` with ``ulysses`` inner ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = get_strategy(strategy).mesh_dims(world, ulysses)
    return init_device_mesh(device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(name for name, _ in dims))
