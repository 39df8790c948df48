"""What a CP strategy is: one object per kind, answering what running it asks.

The attention op, ``ContextParallel``, the mesh and the config checks never compare a strategy's
name; they ask its :class:`Strategy`::

    s = get_strategy("hybrid")
    s.mesh_ndim                               2: a (cp_ring, cp_ulysses) sub-mesh
    s.ulysses_size(cp=8, ulysses_degree=2)    2 ranks split the heads by all-to-all
    s.ring_size(cp=8, ulysses_degree=2)       4 ring steps
    s.check_heads(32, 8, cp=8, ulysses_degree=2)
    s.forward(ctx, q, k, v) / s.backward(...) / s.saved_like(...)   the op itself
    s.schedule(layout, mask, batch)           the schedule a call runs ("ring", "ulysses", ...)

What a call costs (bytes sent, kept and buffered, the pairs its kernels compute) is not the strategy's:
its cost object prices it (:mod:`titan_cp.attention.pricing`, for the planner, the FLOP formula and the
benchmarks).

Shapes as in :mod:`titan_cp.attention.context`: ``q (B, H, S_local, E)``, ``k (B, K, S_local, E)``,
``v (B, K, S_local, Ev)``, ``out, dout (B, H, S_local, Ev)`` (``Ev``: v's own head dim, or ``E``); ``saved``
is what the backward needs beyond them. The
``keeps`` tuple names the inputs and outputs among ``("q", "k", "v", "out")`` that the
backward reads (the others arrive as ``None`` and are not kept alive); :meth:`Strategy.kept` may
make it depend on whether the call has documents.

A fifth strategy is one subclass and one :func:`register_strategy` call (and its cost object, one
:func:`~titan_cp.attention.pricing.register_cost` call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar

from torch import Tensor

from titan_cp.attention.tiling import CAUSAL, Mask

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from titan_cp.attention.context import CPContext
    from titan_cp.layout import SequenceLayout

BackwardGrads = tuple[Tensor, Tensor, Tensor, Tensor | None]
"""What a strategy's backward returns: ``(dq, dk, dv, dsinks)`` (``dsinks`` ``None`` without sinks)."""


def kv_head_map(q_heads: int, kv_heads: int, n: int) -> list[int] | None:
    """The K/V head each of ``n`` head groups needs, or ``None`` when ``kv_heads`` splits evenly.

    K/V heads either divide by ``n`` (each group gets its own slice) or divide ``n``, in which
    case each group gets exactly the one K/V head its query heads use: heads are replicated
    only as much as needed, never expanded to the query head count.
    """
    if q_heads % n:
        raise ValueError(f"ulysses needs the query heads ({q_heads}) to be divisible by its cp size ({n})")
    if kv_heads % n == 0:
        return None
    if n % kv_heads:
        raise ValueError(f"ulysses needs the K/V heads ({kv_heads}) to divide, or be divisible by, its cp size ({n})")
    group = q_heads // kv_heads
    return [(j * q_heads // n) // group for j in range(n)]


def kv_heads_per_shard(q_heads: int, kv_heads: int, n: int) -> int:
    """K/V heads each of ``n`` head shards holds: ``kv_heads / n``, or 1 when ``n`` exceeds them."""
    return 1 if kv_head_map(q_heads, kv_heads, n) is not None else kv_heads // n


def kept_input(x: Tensor | None, name: str, strategy: str) -> Tensor:
    """``x``, an input or output the backward of ``strategy`` reads, which it names in its ``keeps``."""
    if x is None:
        raise RuntimeError(f"strategy {strategy!r} reads {name!r} in its backward: name it in the strategy's keeps")
    return x


class Strategy:
    """One CP strategy. Subclasses set :attr:`name` and implement the op (its costs: :mod:`titan_cp.attention.pricing`)."""

    name: ClassVar[str]
    mesh_ndim: ClassVar[int] = 1
    keeps: ClassVar[tuple[str, ...]] = ()

    def kept(self, documents: bool) -> tuple[str, ...]:
        """:attr:`keeps` for a call with or without documents (``doc_lens``): what the op keeps may depend on
        that, which is known when the op is traced, but on nothing the documents hold."""
        return self.keeps

    # ------------------------------------------------------------------ sizes
    def ulysses_size(self, cp: int, ulysses_degree: int = 1) -> int:
        """Ranks that split the heads by all-to-all (1: none)."""
        return 1

    def ring_size(self, cp: int, ulysses_degree: int = 1) -> int:
        """Steps of the K/V ring (1: no ring)."""
        return 1

    def takes_ulysses_degree(self) -> bool:
        """Whether the strategy reads a separate Ulysses degree (only hybrid does)."""
        return False

    def check_degrees(self, cp: int, ulysses_degree: int = 1) -> None:
        """``ValueError`` when ``ulysses_degree`` does not fit ``cp`` for this strategy."""
        if ulysses_degree != 1:
            raise ValueError(
                f"a ulysses degree ({ulysses_degree}) is only used by the 'hybrid' strategy, not {self.name!r}"
            )

    def check_heads(self, q_heads: int, kv_heads: int, cp: int, ulysses_degree: int = 1) -> None:
        """``ValueError`` when the (local) head counts cannot be split as the strategy needs."""
        u = self.ulysses_size(cp, ulysses_degree)
        if u > 1:
            kv_head_map(q_heads, kv_heads, u)

    # ------------------------------------------------------------------ mesh
    def mesh_dims(self, cp: int, ulysses_degree: int = 1) -> tuple[tuple[str, int], ...]:
        """Names and sizes of the cp sub-mesh the strategy runs on."""
        return (("cp", cp),)

    def layout_rank(self, mesh: DeviceMesh) -> int:
        """This process's rank in the sequence layout."""
        return mesh.get_local_rank()

    def check_mesh(self, mesh: DeviceMesh, cp_size: int, q_heads: int, kv_heads: int) -> None:
        """``ValueError`` when ``mesh`` cannot run this strategy on ``cp_size`` ranks with these heads."""
        if mesh.ndim != self.mesh_ndim:
            raise ValueError(
                f"strategy {self.name!r} needs a {self.mesh_ndim}-D cp mesh, got a {mesh.ndim}-D mesh "
                f"{mesh.mesh_dim_names}"
            )
        if mesh.size() != cp_size:
            raise ValueError(f"the cp mesh's size is {mesh.size()} but the layout was built for cp_size {cp_size}")
        self.check_heads(q_heads, kv_heads, mesh.size(), self.mesh_ulysses_degree(mesh))

    def mesh_ulysses_degree(self, mesh: DeviceMesh) -> int:
        """The Ulysses degree a cp mesh gives this strategy."""
        return 1

    # ------------------------------------------------------------------ the op
    def schedule(
        self,
        layout: SequenceLayout | None,
        mask: Mask = CAUSAL,
        batch: int | None = None,
        documents: bool | None = None,
    ) -> str:
        """The schedule a call of this strategy runs on ``layout`` under ``mask`` for ``batch`` rows: the name
        of the strategy whose exchange moves the data. A strategy runs its own (this default) unless it
        hands some layouts to another's: Ulysses and hybrid run the ring's (``"ring"``) where a call's
        documents stay whole on their ranks (:meth:`~titan_cp.attention.ulysses.HeadExchange.schedule`).

        ``batch``: the call's rows (``None``: the layout's, or one); ``documents``: whether a row of the call
        holds several documents (the op's ``doc_lens`` width; ``None``: the layout's
        :attr:`~titan_cp.layout.SequenceLayout.packs_documents`). The op branches on this answer, and the
        metrics and the planner report it (:func:`attention_schedule`)."""
        return self.name

    def forward(self, ctx: CPContext, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """``(out, saved)`` for this rank's shards."""
        raise NotImplementedError

    def backward(
        self,
        ctx: CPContext,
        dout: Tensor,
        q: Tensor | None,
        k: Tensor | None,
        v: Tensor | None,
        out: Tensor | None,
        saved: Sequence[Tensor],
    ) -> BackwardGrads:
        """``(dq, dk, dv, dsinks)`` (``dsinks`` ``None`` without sinks: else this rank's share, ``(q_heads,)``
        fp32); only the inputs named in :meth:`kept` are given (others ``None``; :func:`kept_input`)."""
        raise NotImplementedError

    def saved_like(self, ctx: CPContext, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        """Empty tensors shaped like ``saved`` (the fake op's outputs)."""
        raise NotImplementedError

    def qk_head_dim(self, q: Tensor | None, k: Tensor | None, saved: Sequence[Tensor]) -> int:
        """q/k's head dim as the backward sees it (v's may differ): its kept ``q`` or ``k``; a strategy that
        keeps neither reads it from its ``saved`` (the backward op's fake and FLOP formula ask it)."""
        kept = q if q is not None else k
        if kept is None:
            raise NotImplementedError(f"strategy {self.name!r} keeps neither q nor k: say q/k's head dim from saved")
        return kept.shape[-1]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


_REGISTRY: dict[str, Strategy] = {}
DEFAULT_STRATEGY = "ring"
"""The strategy a config, ``ContextParallel`` and ``apply_cp`` use when none is named."""
LOCAL_STRATEGY = "ring"
"""The strategy attention runs by on one rank, whatever was named: the ring's one step, plain local attention."""


S = TypeVar("S", bound="Strategy")


def register_strategy(strategy: S) -> S:
    """Make ``strategy`` selectable by its name."""
    _REGISTRY[strategy.name] = strategy
    return strategy


def strategy_names() -> tuple[str, ...]:
    """The registered strategies' names, in registration order.

    The built-ins register themselves when their modules run; those run whenever this module is
    imported from outside the package, since Python imports the package ``titan_cp.attention``
    (whose ``__init__`` imports every built-in) before any of its modules."""
    return tuple(_REGISTRY)


LOCAL_SCHEDULE = "local"
"""The schedule of a call on one rank (a cp size of 1): plain local attention, nothing exchanged."""


def attention_schedule(
    strategy: str, cp: int, layout: SequenceLayout | None = None, mask: Mask = CAUSAL, batch: int | None = None
) -> str:
    """The schedule a ``strategy`` call runs over ``cp`` ranks on ``layout`` (``None``: no layout known, the
    strategy's own exchange) under ``mask``: :data:`LOCAL_SCHEDULE` on one rank, else
    :meth:`Strategy.schedule` (``"ring"``, ``"allgather"``, ``"ulysses"``, ``"hybrid"`` or a registered
    strategy's name). What the per-step metrics record as ``attention_schedule`` and the planner prints."""
    if cp == 1:
        return LOCAL_SCHEDULE
    return get_strategy(strategy).schedule(layout, mask, batch)


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; ``ValueError`` naming the choices for an unknown one."""
    names = strategy_names()
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown cp attention strategy {name!r}; choose one of {names}")
    return _REGISTRY[name]
