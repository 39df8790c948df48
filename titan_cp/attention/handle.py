"""``CPHandle``: one context-parallel setup (mesh, strategy, balance, kernel), the one object a user holds.

::

    cp = apply_cp(model, cp_mesh, strategy="ring", balance="doc_local")   # binds the model to cp
    local = cp.shard(batch)                  # this rank's tokens, by the layout of the batch's documents
    loss = model(**local) ...                # every attention layer finds that layout through cp
    lp = cp.token_logprobs(model, batch)     # per-token log-probs of the labels, without the logits
    full = cp.unshard(out, local_doc_lens)   # every rank's tokens, back in natural order (collective)

The balance is given once, here: the batch is sharded by it and the attention runs by it.

**How a microbatch's layout reaches the op.** :meth:`CPHandle.register` builds the layout of a batch's
documents and registers it with this handle, keyed by its values (sequence length and document
lengths), for as long as the documents tensor it returns lives: the sharded batch holds that tensor,
the model hands it to every attention layer, and the op finds the layout by the tensor's values
(:meth:`CPHandle.find`). A pipeline schedule's microbatches are rows of that tensor, registered with
it (``microbatches``); a compiled graph passes the tensor through. A batch whose layout is not
registered (not sharded by this handle, or sharded for another microbatch count) is an error that
names the fix; nothing is rebuilt on a guess. When the batch is freed its layouts go with it: the
registry never outlives the batches in flight.

The op itself takes the handle as an integer (:attr:`CPHandle.id`, a constant of a compiled graph);
the integer maps to the handle only while the handle lives (a weak map).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_cp.attention.strategy import DEFAULT_STRATEGY, LOCAL_STRATEGY, Strategy, get_strategy
from titan_cp.balance import get_balance
from titan_cp.layout import DEFAULT_BALANCE, DocLens, SequenceLayout, doc_lens_key, get_layout

Key = tuple[int, tuple[tuple[int, ...], ...] | None]

_IDS = itertools.count(1)
_HANDLES: weakref.WeakValueDictionary[int, CPHandle] = weakref.WeakValueDictionary()
_SHARDERS: list[tuple[type, Callable[..., Any]]] = []
_SCORERS: list[tuple[type, Callable[..., Any]]] = []


def register_sharder(kind: type, shard: Callable[..., Any]) -> None:
    """``shard(handle, batch, **options)`` shards batches of ``kind`` for :meth:`CPHandle.shard` (the
    trainer's ``Microbatch``, a Hugging Face mapping): registered by the layer that knows the batch."""
    _SHARDERS.append((kind, shard))


def register_scorer(kind: type, score: Callable[..., TokenLogprobs]) -> None:
    """``score(handle, model, batch, temperature=, entropy=, gather=, **options)`` computes per-token
    log-probs of models of ``kind`` for :meth:`CPHandle.token_logprobs`: registered by the layer that
    knows the model (Hugging Face causal LMs: :mod:`titan_cp.integrations.hf_logprobs`)."""
    _SCORERS.append((kind, score))


@dataclass(frozen=True)
class TokenLogprobs:
    """What :meth:`CPHandle.token_logprobs` returns, fp32, 0 wherever no target was asked for.

    Local (``gather=False``): this rank's tokens in layout order, ``(B, S_local)``: ``logprobs[b, i]``
    is the log-probability of ``labels[b, i]``, the next-token target of local token ``i`` (shifted
    inside its document before sharding, ``-100`` where none). Gathered (``gather=True``): every
    token in natural order, ``(B, S)``, aligned with the targets as Hugging Face's unshifted labels
    are: ``logprobs[b, t]`` is ``log p(labels[b, t] | the tokens before t in its document)``.
    ``entropy``: the entropy of the same next-token distributions (``None`` unless asked for).
    """

    logprobs: torch.Tensor
    labels: torch.Tensor
    entropy: torch.Tensor | None = None


def handle_by_id(handle_id: int) -> CPHandle:
    """The live handle of ``handle_id`` (the integer the op is given)."""
    handle = _HANDLES.get(handle_id)
    if handle is None:
        raise ValueError(
            f"CP handle {handle_id} no longer exists: keep the handle apply_cp returned alive while its model runs"
        )
    return handle


class CPHandle:
    """Mesh, strategy, balance and kernel of one CP setup, and the layouts of the batches in flight.

    Args:
        mesh: the cp ``DeviceMesh`` (1-D; 2-D ``(cp_ring, cp_ulysses)`` for ``"hybrid"``), or ``None``
            on one device.
        strategy: a registered strategy's name (``"ring"``, ``"allgather"``, ``"ulysses"``, ``"hybrid"``).
        balance: a registered balance's name: the layout batches are sharded by and attention runs by.
        kernel: the local kernel's name; ``None`` for the fastest on the device and dtype.
    """

    def __init__(
        self,
        mesh: DeviceMesh | None,
        strategy: str = DEFAULT_STRATEGY,
        balance: str = DEFAULT_BALANCE,
        kernel: str | None = None,
    ) -> None:
        named = get_strategy(strategy)  # the one place the name is resolved: everything else reads the handle
        get_balance(balance)  # a typo is refused here, with the names it could be
        if mesh is not None and mesh.ndim != named.mesh_ndim:
            raise ValueError(
                f"strategy {strategy!r} needs a {named.mesh_ndim}-D cp mesh, got a {mesh.ndim}-D mesh "
                f"{mesh.mesh_dim_names}"
            )
        self.mesh, self.strategy, self.balance, self.kernel = mesh, strategy, balance, kernel
        self.strategy_impl: Strategy = named if mesh is not None else get_strategy(LOCAL_STRATEGY)
        """The registered :class:`~titan_cp.attention.strategy.Strategy` the op runs (on one device the
        ring's one-step path, plain local attention); :attr:`strategy` is its name as given."""
        self.size = 1 if mesh is None else mesh.size()
        self.rank = 0 if mesh is None else named.layout_rank(mesh)
        """This process's place in the layout (the flattened ring x ulysses index under hybrid)."""
        self.ulysses_degree = 1 if mesh is None else named.mesh_ulysses_degree(mesh)
        """The Ulysses degree the mesh gives the strategy (1 but under hybrid)."""
        self.id = next(_IDS)
        _HANDLES[self.id] = self
        self._layouts: dict[Key, list[Any]] = {}  # key -> [layout, live documents tensors]

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group of every cp rank (a 2-D hybrid mesh flattened); ``None`` on one device."""
        if self.mesh is None:
            return None
        return (self.mesh if self.mesh.ndim == 1 else self.mesh._flatten()).get_group()

    # ------------------------------------------------------------------ layouts in flight
    def register(
        self, seq_len: int, doc_lens: DocLens | None, microbatches: int = 1
    ) -> tuple[SequenceLayout, torch.Tensor | None]:
        """The layout of rows of ``seq_len`` tokens with documents ``doc_lens`` under this handle's
        balance, and its documents tensor for the model (``(B, max_docs)`` int64 on the host; ``None``
        without documents), by which every attention layer finds the layout. The layout stays
        registered while that tensor lives. ``microbatches``: the row chunks a pipeline schedule splits
        the batch into (``torch.tensor_split`` along rows), each registered too."""
        layout = get_layout(seq_len, self.size, self.balance, doc_lens)
        tensor = layout.doc_lens_tensor()
        if tensor is None or self.size == 1:
            return layout, tensor
        rows = layout.doc_lens or ()
        if not 1 <= microbatches <= len(rows):
            raise ValueError(f"{len(rows)} rows cannot make {microbatches} pipeline microbatches")
        keys: list[Key] = [(seq_len, rows)]
        if microbatches > 1:
            for chunk in torch.tensor_split(torch.arange(len(rows)), microbatches):
                keys.append((seq_len, tuple(rows[i] for i in chunk.tolist())))
        for key in keys:
            entry = self._layouts.setdefault(key, [None, 0])
            if entry[0] is None:
                entry[0] = layout if key == keys[0] else get_layout(seq_len, self.size, self.balance, key[1])
            entry[1] += 1
        weakref.finalize(tensor, self._release, keys)
        return layout, tensor

    def _release(self, keys: list[Key]) -> None:
        for key in keys:
            entry = self._layouts.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._layouts[key]

    def find(self, seq_len: int, doc_lens: DocLens | None) -> SequenceLayout:
        """The layout a batch of ``seq_len``-token rows with documents ``doc_lens`` was sharded by (the
        op's lookup). On one device, and for rows without documents, the layout is the arguments'
        alone; otherwise it must be registered (:meth:`register`): ``ValueError`` naming the fix."""
        key = doc_lens_key(doc_lens)
        if self.size == 1 or key is None:
            return get_layout(seq_len, self.size, self.balance if self.size > 1 else "contiguous", key)
        entry = self._layouts.get((seq_len, key))
        if entry is None:
            raise ValueError(
                f"no layout for these documents on this CP handle ({self}): shard each batch with the "
                "handle apply_cp returned (cp.shard(batch); under a pipeline schedule of N microbatches, "
                "cp.shard(batch, microbatches=N)) and give the model the doc_lens it returns"
            )
        return entry[0]

    def live_layouts(self) -> int:
        """Layouts registered now (those of the batches in flight)."""
        return len(self._layouts)

    # ------------------------------------------------------------------ batches
    def shard(self, batch: Any, **options: Any) -> Any:
        """This rank's shard of ``batch`` (a trainer ``Microbatch``, a Hugging Face mapping, or a kind
        registered with :func:`register_sharder`), sharded by the layout of its documents."""
        for kind, shard in reversed(_SHARDERS):
            if isinstance(batch, kind):
                return shard(self, batch, **options)
        kinds = ", ".join(k.__name__ for k, _ in _SHARDERS) or "none registered"
        raise ValueError(f"CPHandle.shard takes a batch of a known kind ({kinds}), got {type(batch).__name__}")

    def token_logprobs(
        self,
        model: Any,
        batch: Any,
        *,
        temperature: float = 1.0,
        entropy: bool = False,
        gather: bool = False,
        **options: Any,
    ) -> TokenLogprobs:
        """Per-token log-probs of ``batch``'s targets under ``model`` run by this handle's layout,
        without the ``(tokens x vocabulary)`` logits: the last hidden states and the output weight a
        chunk of tokens at a time (:func:`titan_cp.loss.chunked_token_logprobs`), exact against one
        process. ``batch``: what :meth:`shard` takes (labels: the tokens to score, -100 elsewhere), or
        what it returned. ``temperature`` divides the logits; ``entropy``: also each distribution's
        entropy; ``gather``: every token in natural order on every rank (:class:`TokenLogprobs`; its
        gradient is the dual collective: each rank's gradient summed over the cp ranks, then its own
        tokens kept). Gradients flow to the model. ``options``: :meth:`shard`'s. A model of a kind
        registered with :func:`register_scorer`."""
        for kind, score in reversed(_SCORERS):
            if isinstance(model, kind):
                return score(self, model, batch, temperature=temperature, entropy=entropy, gather=gather, **options)
        kinds = ", ".join(k.__name__ for k, _ in _SCORERS) or "none registered"
        raise ValueError(
            f"CPHandle.token_logprobs takes a model of a known kind ({kinds}), got {type(model).__name__}; "
            "import titan_cp.integrations.transformers for Hugging Face causal LMs"
        )

    def unshard(self, x: torch.Tensor, doc_lens: DocLens | None, dim: int = 1) -> torch.Tensor:
        """Every rank's ``x`` (this rank's tokens along ``dim``) gathered and put back in natural token
        order. Collective over the mesh; no gradient. ``doc_lens``: the sharded batch's documents."""
        if self.mesh is None:
            return x
        layout = self.find(x.shape[dim] * self.size, doc_lens)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        ranks = [torch.zeros((), dtype=torch.int64, device=x.device) for _ in range(self.size)]
        dist.all_gather(parts, x.detach().contiguous(), group=self.group)
        dist.all_gather(ranks, torch.tensor(self.rank, device=x.device), group=self.group)
        by_rank = [parts[i] for i in sorted(range(self.size), key=lambda i: int(ranks[i]))]
        return layout.unshard(by_rank, dim)

    def __repr__(self) -> str:
        mesh = None if self.mesh is None else tuple(self.mesh.shape)
        return f"CPHandle(mesh={mesh}, strategy={self.strategy!r}, balance={self.balance!r}, kernel={self.kernel!r})"
