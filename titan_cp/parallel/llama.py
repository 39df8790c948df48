"""titan_cp's Llama (:class:`~titan_cp.model.llama.Transformer`, or a pipeline stage of it) as the
``apply_*`` functions see it (:class:`~titan_cp.parallel.adapter.ParallelAdapter`)."""

from __future__ import annotations

from torch import nn

from titan_cp.model.llama import Transformer
from titan_cp.parallel.adapter import ParallelAdapter, register_adapter
from titan_cp.parallel.cp import llama_cp


def llama_adapter(model: nn.Module) -> ParallelAdapter | None:
    """The adapter of a :class:`Transformer`: blocks ``model.layers``, its own embedding, tail (final
    norm, output; also the head unit when both are there) and CP plan (:func:`~titan_cp.parallel.cp.llama_cp`); ``None`` for any other model."""
    if not isinstance(model, Transformer):
        return None
    tail: list[nn.Module] = [m for m in (model.norm, model.output) if m is not None]  # a stage may lack them
    return ParallelAdapter(
        model,
        model.layers,
        lambda handle: llama_cp(model, handle),
        family="llama3",
        embedding=model.tok_embeddings,
        tail=tail,
        head_unit=tail if len(tail) == 2 else [],
        mlp_name="feed_forward",
    )


register_adapter(llama_adapter)
