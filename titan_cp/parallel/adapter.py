"""What the ``apply_*`` functions ask of a model, whatever its family: one small adapter.

::

    root        the model (or pipeline stage) itself: FSDP's last unit
    family      the name of its model family (:mod:`titan_cp.families`): the one way a model's family is told
    blocks      the container of its transformer blocks (``nn.ModuleDict`` or ``nn.ModuleList``),
                whose entries AC and compile replace in place and FSDP shards one by one
    embedding   the input embedding, sharded on its own (``None``: absent from this stage, or tied
                to the output head, which keeps it in the root)
    tail        what runs last in the forward (final norm, output head): one FSDP unit kept
                gathered after the forward, since the backward starts with it (empty: the root's)
    mlp_name    the attribute of each block that holds its feed-forward (tiled MLP)
    head_unit   what runs after the blocks and may be recomputed as one more checkpoint unit when
                checkpointed inputs go to the host (titan_cp's final norm and chunked-loss head; empty: none)
    attach_cp   ``attach_cp(handle)``: makes every attention core context-parallel by the
                :class:`~titan_cp.attention.handle.CPHandle` (no mesh: one device, documents still masked)

Each family registers its provider (:func:`register_adapter`): titan_cp's Llama in
:mod:`titan_cp.families.llama3.parallelize` (imported with any module of its room), Hugging Face causal LMs in
:mod:`titan_cp.integrations.transformers`, any other family through its ``ModelFamily.adapter``
(registered by ``titan_cp.families.register_family``). A new memory option or kernel is then written
once, for every family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from titan_cp.attention.handle import CPHandle


@dataclass
class ParallelAdapter:
    """A model as the ``apply_*`` functions see it (module docstring)."""

    root: nn.Module
    blocks: nn.ModuleDict | nn.ModuleList
    attach_cp: Callable[[CPHandle], None]
    family: str
    embedding: nn.Module | None = None
    tail: list[nn.Module] = field(default_factory=list)
    head_unit: list[nn.Module] = field(default_factory=list)
    mlp_name: str = "mlp"

    def block_items(self) -> list[tuple[str | int, nn.Module]]:
        """``(key, block)`` of every block, in order; ``blocks[key] = new`` replaces one in place."""
        if isinstance(self.blocks, nn.ModuleDict):
            return list(self.blocks.items())
        return list(enumerate(self.blocks))

    def replace_block(self, key: str | int, block: nn.Module) -> None:
        """``blocks[key] = block``: a wrapped (checkpointed, compiled) block in place of the one at ``key``
        (a key of :meth:`block_items`)."""
        if isinstance(self.blocks, nn.ModuleDict):
            self.blocks[str(key)] = block
        else:
            self.blocks[int(key)] = block

    def mlps(self) -> list[nn.Module]:
        """Every block's feed-forward module (looked up through AC and compile wrappers), in order;
        ``ValueError`` for a block without one."""
        found = []
        for _, block in self.block_items():
            inner = [block, getattr(block, "_checkpoint_wrapped_module", None), getattr(block, "_orig_mod", None)]
            mlp = next(
                (getattr(m, self.mlp_name) for m in inner if isinstance(getattr(m, self.mlp_name, None), nn.Module)),
                None,
            )
            if mlp is None:
                raise ValueError(
                    f"{type(block).__name__} has no feed-forward module {self.mlp_name!r}: set "
                    "activation_checkpoint.tile_tokens = 0 for this model"
                )
            found.append(mlp)
        return found


_PROVIDERS: list[Callable[[nn.Module], ParallelAdapter | None]] = []


def register_adapter(provider: Callable[[nn.Module], ParallelAdapter | None]) -> None:
    """Add ``provider``: a model -> its :class:`ParallelAdapter`, or ``None`` for a model it does not know."""
    if provider not in _PROVIDERS:
        _PROVIDERS.append(provider)


def adapter_of(model: nn.Module | ParallelAdapter) -> ParallelAdapter:
    """``model``'s adapter (itself when it is one); ``ValueError`` for a model no provider knows."""
    if isinstance(model, ParallelAdapter):
        return model
    for provider in _PROVIDERS:
        adapter = provider(model)
        if adapter is not None:
            return adapter
    raise ValueError(
        f"titan_cp cannot parallelize a {type(model).__name__}: give titan_cp's Transformer, a Hugging Face "
        "causal LM after importing titan_cp.integrations.transformers, or a model of a registered family whose "
        "adapter() knows it (titan_cp.families.register_family)"
    )
