"""Initial weights that do not depend on how the parameters are sharded.

A parameter of global shape ``(R, C...)`` is seen as ``R`` rows of ``C = prod(C...)`` values,
cut into blocks of whole rows (about ``BLOCK_ELEMENTS`` values each). Block ``b`` of the
parameter named ``n`` is drawn from its own generator, seeded by ``hash(seed, n, b)``::

    value[r, c] = draw(seed, name, r // rows_per_block)[r % rows_per_block, c]

A rank fills only its local shard: it draws the blocks that hold its rows (whole rows, then
keeps its columns) and copies the part it owns. The values are those of the unsharded
tensor whatever the mesh (FSDP, tensor parallel, pipeline stages: ``Shard`` on dim 0 or 1 of a
DTensor on any number of mesh axes), bit for bit on one device type, so a run's first losses
do not depend on the mesh; and no rank ever holds more than its shard plus one block.

Names are those of the unwrapped model (``layers.0.attention.wq.weight``: activation
checkpointing's and ``torch.compile``'s prefixes removed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

BLOCK_ELEMENTS = 1 << 20  # values per seeded block: 4 MiB of fp32 drawn at a time

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter name without activation checkpointing's and ``torch.compile``'s prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def block_seed(seed: int, name: str, block: int) -> int:
    """The 63-bit seed of block ``block`` of parameter ``name`` (stable across processes and runs)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _local_box(param: Tensor) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """``(local shard as a 2-D view, its (row0, col0) offset in the global tensor, global (rows, cols))``."""
    if isinstance(param, DTensor):
        local = param.to_local()
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        assert tuple(shape) == tuple(local.shape), (shape, local.shape)
    else:
        local, offset = param, (0,) * param.ndim
    if param.ndim > 2:
        raise ValueError(f"seeded init handles 1-D and 2-D parameters, got shape {tuple(param.shape)}")
    rows = param.shape[0]
    cols = param.shape[1] if param.ndim == 2 else 1
    local_2d = local if param.ndim == 2 else local.unsqueeze(1)
    return local_2d, (offset[0], offset[1] if param.ndim == 2 else 0), (rows, cols)


@torch.no_grad()
def seeded_fill_(param: Tensor, seed: int, name: str, draw: Callable[[Tensor, torch.Generator], None]) -> None:
    """Fill this rank's shard of ``param`` with ``draw(block, generator)`` applied block by block
    to the *global* tensor (see the module docstring). ``draw`` fills ``block`` in place."""
    local, (row0, col0), (rows, cols) = _local_box(param)
    n_rows, n_cols = local.shape
    if local.is_meta or n_rows == 0 or n_cols == 0:
        return
    per_block = max(1, BLOCK_ELEMENTS // cols)
    generator = torch.Generator(device=local.device)
    for b in range(row0 // per_block, (row0 + n_rows - 1) // per_block + 1):
        start, stop = b * per_block, min((b + 1) * per_block, rows)
        block = torch.empty(stop - start, cols, dtype=local.dtype, device=local.device)
        generator.manual_seed(block_seed(seed, name, b))
        draw(block, generator)
        lo, hi = max(start, row0), min(stop, row0 + n_rows)
        local[lo - row0 : hi - row0].copy_(block[lo - start : hi - start, col0 : col0 + n_cols])


class ParamInit:
    """The initialisers ``init_weights`` uses, each sharding-invariant (``seeded_fill_``).

    Built once per model (or pipeline stage) to know each parameter's unwrapped name.
    """

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.seed = seed
        self._names = {id(p): clean_name(n) for n, p in model.named_parameters()}

    def _fill(self, param: Tensor, draw) -> None:
        seeded_fill_(param, self.seed, self._names[id(param)], draw)

    def normal_(self, param: Tensor, std: float) -> None:
        self._fill(param, lambda t, g: t.normal_(0.0, std, generator=g))

    def trunc_normal_(self, param: Tensor, std: float, a: float = -2.0, b: float = 2.0) -> None:
        """Normal(0, std) truncated to ``[a, b]`` (absolute bounds, as ``nn.init.trunc_normal_``)."""
        self._fill(param, lambda t, g: nn.init.trunc_normal_(t, 0.0, std, a, b, generator=g))

    @staticmethod
    @torch.no_grad()
    def ones_(param: Tensor) -> None:
        (param.to_local() if isinstance(param, DTensor) else param).fill_(1.0)

    @staticmethod
    def zeros_(param: Tensor) -> None:
        (param.to_local() if isinstance(param, DTensor) else param).zero_()


def draw_seed() -> int:
    """A seed drawn from torch's global generator: ``init_weights()`` is deterministic given ``torch.manual_seed``."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


__all__ = ["BLOCK_ELEMENTS", "ParamInit", "block_seed", "clean_name", "draw_seed", "seeded_fill_"]
