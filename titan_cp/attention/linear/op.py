"""The linear-attention layers' custom ops: the gated delta rule, Mamba2's SSD and the short convolution.

Each op runs one exchange between the cp ranks, through one driver::

    forward     sent, partial = outgoing(x)            this rank's summaries (or halo rows), from its own
                                                       tokens, and what its pieces computed on the way
                recv = send_rows(sent)                 what the ranks after it in each document need (plan)
                out  = local(x, partial, sent, recv)   every piece with the state (or halo) before it
    backward    recompute the forward under autograd, then
                d_x, d_partial, d_sent, d_recv = grad(out)     through local() alone
                d_sent += return_rows(d_recv)                  the exchange reversed: gradients home
                d_x += grad((partial, sent), (d_partial, d_sent))   through outgoing(), once

so the op keeps only its inputs (the backward recomputes the local kernel, as activation checkpointing
would) and its fake needs only shapes. Every output (and gradient) is contiguous, whatever the inputs'
strides: the fakes say so. Settings travel as the handle's integer id and the documents as
the ``doc_lens`` host tensor, as for :mod:`titan_cp.attention.api`'s op.

Shapes are token-major, as ``transformers`` and ``fla`` hold them: ``(batch, seq_local, heads, dim)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from titan_cp.attention.handle import CPHandle, handle_by_id
from titan_cp.attention.linear import conv as conv_kernel
from titan_cp.attention.linear import fla, gated_delta, ssd
from titan_cp.attention.linear.chunks import Chunks, chunked
from titan_cp.attention.linear.exchange import Transport, return_rows, send_rows, transport
from titan_cp.attention.linear.plan import HaloPlan, StatePlan, StateRows, halo_plan, state_plan
from titan_cp.layout import SequenceLayout

Partial = tuple[Tensor, ...]


class Kind(Protocol):
    """One op's arithmetic, bound to a call's plan (:func:`run`, :func:`run_backward`)."""

    send: dict[int, tuple[int, ...]]
    recv: dict[int, int]
    crosses: bool

    def send_index(self, device: torch.device) -> Tensor: ...

    def prepare(self, *inputs: Tensor | None) -> Any: ...
    def outgoing(self, prep: Any) -> tuple[Tensor, Partial]: ...
    def add_sent_grad(self, grads: Sequence[Tensor | None], d_sent: Tensor) -> bool: ...
    def local(self, prep: Any, partial: Partial, sent: Tensor, recv: Tensor) -> Tensor: ...


def run(kind: Kind, comm: Transport | None, inputs: Sequence[Tensor | None]) -> Tensor:
    """The forward (module docstring)."""
    prep = kind.prepare(*inputs)
    sent, partial = kind.outgoing(prep)
    return kind.local(prep, partial, sent, _send(kind, comm, sent))


def _send(kind: Kind, comm: Transport | None, sent: Tensor) -> Tensor:
    return send_rows(comm, sent, kind.send, kind.recv, kind.crosses, kind.send_index(sent.device))


@contextlib.contextmanager
def _autograd() -> Iterator[None]:
    """Autograd inside a custom op's implementation (which runs below autograd: its keys excluded), for
    the backward's recomputation; autocast stays excluded."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _or_zeros(grads: Sequence[Tensor | None], like: Sequence[Tensor]) -> list[Tensor]:
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, like)]


def run_backward(
    kind: Kind, comm: Transport | None, inputs: Sequence[Tensor | None], dout: Tensor
) -> list[Tensor | None]:
    """The gradients of ``inputs`` (``None`` where an input is ``None`` or not floating point)."""
    leaves = [None if x is None else x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    wanted = [x for x in leaves if x is not None and x.requires_grad]
    with _autograd():
        prep = kind.prepare(*leaves)
        sent, partial = kind.outgoing(prep)
        recv = _send(kind, comm, sent.detach()).requires_grad_()
        sent_leaf = sent.detach().requires_grad_()
        partial_leaf = tuple(t.detach().requires_grad_() for t in partial)
        out = kind.local(prep, partial_leaf, sent_leaf, recv)
        first = torch.autograd.grad(
            out, [*wanted, *partial_leaf, sent_leaf, recv], dout, retain_graph=True, allow_unused=True
        )
        grads, d_partial = list(first[: len(wanted)]), _or_zeros(first[len(wanted) : -2], partial)
        d_sent, d_recv = _or_zeros(first[-2:], (sent, recv))
        d_sent = return_rows(comm, d_recv, d_sent, kind.send, kind.recv, kind.crosses, kind.send_index(d_sent.device))
        outgoing = [*partial] if kind.add_sent_grad(grads, d_sent) else [*partial, sent]  # else autograd's
        made = [(t, d) for t, d in zip(outgoing, (*d_partial, d_sent)) if t.requires_grad and t.numel()]
        if made:
            more = torch.autograd.grad([t for t, _ in made], wanted, [d for _, d in made], allow_unused=True)
            grads = [a if b is None else b if a is None else a + b for a, b in zip(grads, more)]
    by_leaf = iter(grads)
    return [None if x is None or not x.requires_grad else next(by_leaf) for x in leaves]


# ---------------------------------------------------------------------------- the call's plan
@dataclass(frozen=True)
class Call:
    """A linear op's setting: the handle, its layout for this batch, the rows and the transport."""

    handle: CPHandle
    batch: int
    local_len: int
    comm: Transport | None

    def layout(self, doc_lens: Tensor | None) -> SequenceLayout:
        return self.handle.find(self.local_len * self.handle.size, doc_lens)

    def state(self, doc_lens: Tensor | None, late: bool = False) -> StatePlan:
        return state_plan(self.layout(doc_lens), self.handle.rank, self.batch, late)

    def halo(self, doc_lens: Tensor | None, kernel: int) -> HaloPlan:
        return halo_plan(self.layout(doc_lens), self.handle.rank, self.batch, kernel)


def _call(handle: int, x: Tensor) -> Call:
    cp = handle_by_id(handle)
    return Call(cp, x.shape[0], x.shape[1], transport(cp.mesh))


def _acc(x: Tensor) -> Tensor:
    """``x`` in the kernels' precision: fp32, or the input's own where wider."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _flat(x: Tensor) -> Tensor:
    """``(batch, seq, *F)`` -> ``(batch * seq, *F)`` (the flat token order of :mod:`.plan`)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _chunk_size(plan: StatePlan, chunk: int) -> int:
    """``chunk``, or the smallest power of two that holds the longest piece where that is less: pieces
    shorter than a chunk are padded to one, and padding is work (a numerical choice: any size gives the
    same result)."""
    longest = max((n for _, n in plan.runs), default=1)
    return min(chunk, 1 << (longest - 1).bit_length())


def _compose(
    apply: Callable[[Tensor, Tensor | None], Tensor],
    plan: StatePlan,
    sent: Tensor,
    recv: Tensor,
    pieces: Sequence[int] | None = None,
    states: tuple[Tensor, Tensor] | None = None,
) -> dict[int, Tensor | None]:
    """Each piece's initial state (of ``pieces``; all of them by default) from the summaries before it (``None``: a
    document's first piece), or from the state of the late middle piece before it and the summaries after that
    (``states``: this rank's late middles' states and those received, :attr:`.plan.StatePlan.second`). A
    document's pieces share the prefixes of their chains: each prefix's state is composed once (one ``apply``
    per summary of a chain, not per piece and summary), from the summaries unbound once."""
    buffers = (sent, recv) if states is None else (sent, recv, *states)
    rows = [t.unbind(0) if t.shape[0] else () for t in buffers]  # indexed by a Ref's source
    memo: dict[tuple, Tensor | None] = {(): None}

    def state(chain: tuple) -> Tensor | None:
        if chain not in memo:
            source, i = chain[-1]
            memo[chain] = rows[source][i] if source >= 2 else apply(rows[source][i], state(chain[:-1]))
        return memo[chain]

    return {j: state(plan.chains[j]) for j in (range(len(plan.chains)) if pieces is None else pieces)}


@dataclass(frozen=True)
class _Planned:
    """What the driver reads of a kind: its plan's exchange (:class:`Kind`)."""

    plan: StatePlan | HaloPlan

    @property
    def send(self) -> dict[int, tuple[int, ...]]:
        return self.plan.send

    @property
    def recv(self) -> dict[int, int]:
        return self.plan.recv

    @property
    def crosses(self) -> bool:
        return self.plan.crosses

    def send_index(self, device: torch.device) -> Tensor:
        return self.plan.send_index(device)

    def add_sent_grad(self, grads: Sequence[Tensor | None], d_sent: Tensor) -> bool:
        """Add the gradient of the rows sent into ``grads`` (the inputs', in place) where a kind can say where
        they came from, and say so; else the driver runs autograd through :meth:`outgoing`."""
        return False


class _Group(torch.autograd.Function):
    """The tokens of each call, each part a tensor of its own (what a call keeps for its backward holds its own
    tokens only): a view where the part is one span of the buffer (``(start, length)``), else gathered (its flat
    tokens). Backward, the parts' gradients written once into one tensor (the parts tile the buffer), where an
    ``index_select`` each would add its gradient into a full-size zero tensor."""

    @staticmethod
    def forward(ctx, x: Tensor, *parts: tuple[int, int] | Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.parts = parts
        return tuple(x.narrow(0, *p) if isinstance(p, tuple) else x.index_select(0, p) for p in parts)

    @staticmethod
    def backward(ctx, *d_parts: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        total = sum(d.shape[0] for d in d_parts)
        d_x = d_parts[0].new_empty(total, *d_parts[0].shape[1:])
        for p, d in zip(ctx.parts, d_parts):
            if isinstance(p, tuple):
                d_x.narrow(0, *p).copy_(d)
            else:
                d_x.index_copy_(0, p, d)
        return (d_x, *([None] * len(ctx.parts)))


# ---------------------------------------------------------------------------- the gated delta rule
BACKENDS = ("auto", "torch", "fla")
"""The gated delta rule's kernels: ``"torch"`` (:mod:`.gated_delta`, any device), ``"fla"``
(:mod:`.fla`, CUDA with flash-linear-attention installed), ``"auto"``: ``fla`` where it runs."""


def gated_delta_backend(name: str, device: torch.device) -> str:
    """The backend ``name`` resolves to on ``device`` (``ValueError`` for a name that cannot run)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "fla" if device.type == "cuda" and fla.available() else "torch"
    if name == "fla" and not fla.available():
        raise ValueError("backend 'fla' needs flash-linear-attention: pip install fla-core (a CUDA build of torch)")
    return name


@dataclass(frozen=True)
class GatedDelta(_Planned):
    """The gated delta rule on a call's pieces. ``q, k`` ``(B, S, Hk, Dk)``, ``v`` ``(B, S, Hv, Dv)``,
    ``g, beta`` ``(B, S, Hv)``. The torch backend (:mod:`.gated_delta`) repeats q/k heads to ``Hv``
    (grouped value attention), normalises them (``qk_l2norm``) and scales q in fp32; ``fla``
    (:mod:`.fla`) takes them as they are, with those settings."""

    plan: StatePlan
    chunks: Chunks
    scale: float
    qk_l2norm: bool
    backend: str
    comm: Transport | None = None

    def prepare(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Any:
        """The torch kernel's chunks (:func:`.gated_delta.prepare`); through ``fla``, the tokens of each of the
        plan's groups (before the exchange, wide, after it) as an :class:`.fla.Prepared` of its own
        (:class:`_Group`: a view where a group's pieces are one span of the buffer, else gathered)."""
        if self.backend == "fla":
            q, k, v, beta = (_flat(x) for x in (q, k, v, beta))
            flat = fla.Prepared(q, k, v, _flat(g).float(), beta, self.scale, self.qk_l2norm)
            sizes = [sum(self.plan.runs[j][1] for j in pieces) for pieces in self.plan.groups]
            if sum(n > 0 for n in sizes) <= 1:  # the one group is the whole buffer, in order
                return fla.split(flat, sizes)
            where = self.plan.grouped(q.device)
            q, k, v, g, beta = (_Group.apply(x, *where) for x in (flat.q, flat.k, flat.v, flat.g, flat.beta))
            return [fla.Prepared(q[i], k[i], v[i], g[i], beta[i], self.scale, self.qk_l2norm) for i in range(3)]
        rep = v.shape[2] // q.shape[2]
        q, k = (_acc(_flat(x)).repeat_interleave(rep, dim=1) for x in (q, k))
        if self.qk_l2norm:
            q, k = gated_delta.l2norm(q), gated_delta.l2norm(k)
        v, g, beta = (_acc(_flat(x)) for x in (v, g, beta))
        return gated_delta.prepare(self.chunks, q * self.scale, k, v, g, beta)

    def _scan(
        self, prep: Any, group: int, wide: bool = False, starts: list[Tensor | None] | None = None
    ) -> tuple[Tensor, Tensor]:
        """One call over the pieces of the plan's ``group`` (:func:`.gated_delta.scan`, :func:`.fla.scan`):
        ``(outputs, final states)``."""
        pieces = self.plan.groups[group]
        if self.backend == "fla":
            return fla.scan(prep[group], [self.plan.runs[j][1] for j in pieces], wide, starts)
        return gated_delta.scan(self.chunks, self.plan.runs, prep, pieces, wide, starts)

    def outgoing(self, prep: Any) -> tuple[Tensor, Partial]:
        """What runs before the exchange (:attr:`.plan.StatePlan.groups`): the pieces that start their document
        at v's width (their outputs final), the wide ones (outputs ``[o | r]``, :func:`.gated_delta.scan`); the
        summaries are their final states."""
        before, wide, _ = self.plan.groups
        (o_before, s_before), (o_wide, s_wide) = self._scan(prep, 0), self._scan(prep, 1, wide=True)
        dk = s_before.shape[-2]
        acc = torch.promote_types(s_before.dtype, torch.float32)  # fla's states are fp32; the torch kernel's its own
        s_before = torch.cat([s_before, s_before.new_zeros(*s_before.shape[:-1], dk)], -1)
        finals = torch.cat([s_before.to(acc), s_wide.to(acc)])
        slot = {j: i for i, j in enumerate(before + wide)}
        index = self.plan.index_on("summaries", [slot[j] for j in self.plan.summarize], finals.device)
        return finals.index_select(0, index), (o_before, o_wide)

    def local(self, prep: Any, partial: Partial, sent: Tensor, recv: Tensor) -> Tensor:
        """The pieces' outputs in flat order: after the exchange, the last pieces run from their composed states
        (and the documents the plan runs after it from zero); each wide piece's outputs get its composed state's
        share ``r^T S_in`` (in the outputs' dtype, as the kernel reads its state against q; the states
        are composed in fp32, or the inputs' dtype where wider). Pieces are taken from the calls' outputs by
        ``split`` (one backward for all of them)."""
        o_before, o_wide = partial
        _, wide, after = self.plan.groups
        states = _compose(gated_delta.apply, self.plan, sent, recv, after)
        o_after, s_after = self._scan(prep, 2, starts=[states[j] for j in after]) if after else (o_before[:0], None)
        recv2 = self._second(sent, recv, s_after)
        if wide:
            states.update(_compose(gated_delta.apply, self.plan, sent, recv, wide, recv2))
        out = self._assemble(o_before, o_wide, o_after, states)
        second = self.plan.second
        if second is not None and second.crosses and recv2 is not None and recv2[1].requires_grad:
            out = _Join.apply(out, recv2[1])  # every rank returns the second exchange's gradients
        return out

    def _second(self, sent: Tensor, recv: Tensor, s_after: Tensor | None) -> tuple[Tensor, Tensor] | None:
        """The second exchange (:attr:`.plan.StatePlan.second`), where the plan has one: ``(this rank's late
        middle pieces' final states, those received)``, fp32 (or the inputs' dtype where wider)."""
        second = self.plan.second
        if second is None:
            return None
        if self.plan.states2:
            assert s_after is not None
            after = {j: i for i, j in enumerate(self.plan.groups[2])}
            index = self.plan.index_on("states2", [after[j] for j in self.plan.states2], s_after.device)
            own = s_after.index_select(0, index).to(sent.dtype)
        else:
            own = sent.new_zeros(0, *sent.shape[1:-1], sent.shape[-1] - sent.shape[-2])
        return own, _Exchange.apply(own, self.comm, second, recv)

    def _assemble(self, o_before: Tensor, o_wide: Tensor, o_after: Tensor, states: dict[int, Tensor | None]) -> Tensor:
        """The pieces' outputs in flat order, each wide piece's with its state's share."""
        wide = self.plan.groups[1]
        if not wide and not (len(o_before) and len(o_after)):  # one call: its pieces are the buffer, in order
            return o_after if len(o_after) else o_before
        dv = o_before.shape[-1]
        lengths = [[self.plan.runs[j][1] for j in pieces] for pieces in self.plan.groups]
        wides: list[Tensor] = []
        if wide:
            o, r = o_wide.split([dv, o_wide.shape[-1] - dv], -1)
            for j, o_j, r_j in zip(wide, o.split(lengths[1]), r.split(lengths[1])):
                s = states[j]
                assert s is not None
                # a copy of its own in the outputs' dtype: what the correction keeps is that, not the composed
                # state (nor the summaries' buffer a first link's state is a view of); one GEMM a head, batched
                # over heads on strided views, where einsum would first copy r and its result to head-major
                o_h, r_h = o_j.transpose(0, 1), r_j.transpose(0, 1)
                wides.append(torch.baddbmm(o_h, r_h, s.to(r_j.dtype, copy=True)).transpose(0, 1))
        outs = [iter(o_before.split(lengths[0])), iter(wides), iter(o_after.split(lengths[2]))]
        return torch.cat([next(outs[call]) for call in self.plan.calls])


def _gated_delta(
    handle: int, q: Tensor, doc_lens: Tensor | None, scale: float, qk_l2norm: bool, chunk: int, backend: str
):
    call = _call(handle, q)
    plan = call.state(doc_lens, late=True)
    chunks = chunked(plan.runs, call.batch * call.local_len, _chunk_size(plan, chunk))
    return GatedDelta(plan, chunks, scale, qk_l2norm, gated_delta_backend(backend, q.device), call.comm), call


@torch.library.custom_op("titan_cp::cp_gated_delta", mutates_args=())
def _gated_delta_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_lens: Tensor | None, handle: int, scale: float,
    qk_l2norm: bool, chunk: int, backend: str,
) -> Tensor:  # fmt: skip
    kind, call = _gated_delta(handle, q, doc_lens, scale, qk_l2norm, chunk, backend)
    out = run(kind, call.comm, (q, k, v, g, beta))
    return out.reshape(v.shape).to(q.dtype).contiguous()


@_gated_delta_op.register_fake
def _(q, k, v, g, beta, doc_lens, handle, scale, qk_l2norm, chunk, backend):
    return v.new_empty(v.shape, dtype=q.dtype)


@torch.library.custom_op("titan_cp::cp_gated_delta_backward", mutates_args=())
def _gated_delta_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_lens: Tensor | None, handle: int,
    scale: float, qk_l2norm: bool, chunk: int, backend: str,
) -> list[Tensor]:  # fmt: skip
    kind, call = _gated_delta(handle, q, doc_lens, scale, qk_l2norm, chunk, backend)
    grads = run_backward(
        kind, call.comm, (q, k, v, g, beta), _flat(dout) if kind.backend == "fla" else _acc(_flat(dout))
    )
    return [gr.to(x.dtype).contiguous() for gr, x in zip(grads, (q, k, v, g, beta))]  # type: ignore[union-attr]


@_gated_delta_backward_op.register_fake
def _(dout, q, k, v, g, beta, doc_lens, handle, scale, qk_l2norm, chunk, backend):
    return [x.new_empty(x.shape) for x in (q, k, v, g, beta)]


def _gd_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.args = inputs[5:]


def _gd_backward(ctx, dout):
    grads = _gated_delta_backward_op(dout, *ctx.saved_tensors, *ctx.args)
    return (*grads, None, None, None, None, None, None)


_gated_delta_op.register_autograd(_gd_backward, setup_context=_gd_setup)


class _Exchange(torch.autograd.Function):
    """:func:`send_rows` under autograd: its backward is :func:`return_rows` (the exchange reversed). The
    layer's inputs (``anchors``) make its result need a gradient on every rank whose layer does, whether or
    not the rank has summaries of its own."""

    @staticmethod
    def forward(ctx, sent: Tensor, comm: Transport | None, plan: StatePlan | StateRows, *anchors: Tensor) -> Tensor:  # type: ignore[override]
        ctx.comm, ctx.plan, ctx.shape, ctx.anchors = comm, plan, sent.shape, len(anchors)
        return send_rows(comm, sent, plan.send, plan.recv, plan.crosses, plan.send_index(sent.device))

    @staticmethod
    def backward(ctx, d_recv: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        d_sent, plan = d_recv.new_zeros(ctx.shape), ctx.plan
        index = plan.send_index(d_recv.device)  # made once per plan and device: no blocking copy here
        d_sent = return_rows(ctx.comm, d_recv.contiguous(), d_sent, plan.send, plan.recv, plan.crosses, index)
        return (d_sent, None, None, *([None] * ctx.anchors))


class _Join(torch.autograd.Function):
    """``out`` as it is; backward, a zero gradient for ``recv`` beside ``out``'s, so that every rank runs the
    exchange's backward (a collective) and returns the gradients of the summaries it received, even where
    its own pieces read none of them: a rank that skipped it would leave the others waiting and the
    summaries it sent without their gradients."""

    @staticmethod
    def forward(ctx, out: Tensor, recv: Tensor) -> Tensor:  # type: ignore[override]
        ctx.recv = (recv.shape, recv.dtype, recv.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, d_out: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        shape, dtype, device = ctx.recv
        return d_out, torch.zeros(shape, dtype=dtype, device=device)


def gated_delta_eager(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_lens: Tensor | None, handle: int, scale: float,
    qk_l2norm: bool,
) -> Tensor:  # fmt: skip
    """The op's forward through ``fla`` as plain autograd (eager only: the plan is read from ``doc_lens``'
    values): ``fla``'s own functions keep what their backward needs, so nothing is recomputed beyond what
    ``fla`` recomputes itself; the summaries' exchange is :class:`_Exchange`, joined to the output
    (:class:`_Join`) wherever a summary crosses a rank boundary."""
    kind, call = _gated_delta(handle, q, doc_lens, scale, qk_l2norm, CHUNK_UNUSED, "fla")
    prep = kind.prepare(q, k, v, g, beta)
    sent, partial = kind.outgoing(prep)
    recv = _Exchange.apply(sent, call.comm, kind.plan, q, k, v, g, beta)
    out = kind.local(prep, partial, sent, recv)
    if kind.plan.crosses and recv.requires_grad:
        out = _Join.apply(out, recv)
    return out.reshape(v.shape).to(q.dtype)


CHUNK_UNUSED = 64  # fla chunks by itself; the torch kernel's chunk size does not apply


# ---------------------------------------------------------------------------- Mamba2's SSD
@dataclass(frozen=True)
class StateSpace(_Planned):
    """:mod:`.ssd` on a call's pieces. ``x`` ``(B, S, H, P)``, ``dt`` ``(B, S, H)``, ``A`` ``(H,)``, ``B, C``
    ``(B, S, G, N)`` with ``H % G == 0`` (groups repeated to heads), in fp32."""

    plan: StatePlan
    chunks: Chunks

    def prepare(self, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor) -> ssd.Prepared:
        rep = x.shape[2] // b.shape[2]
        b, c = (_acc(_flat(t)).repeat_interleave(rep, dim=1) for t in (b, c))
        return ssd.prepare(self.chunks, _acc(_flat(x)), _acc(_flat(dt)), _acc(a), b, c)

    def outgoing(self, prep: ssd.Prepared) -> tuple[Tensor, Partial]:
        return ssd.summaries(self.chunks, prep, self.plan.summarize, self.plan.middle), ()

    def local(self, prep: ssd.Prepared, partial: Partial, sent: Tensor, recv: Tensor) -> Tensor:
        return ssd.outputs(self.chunks, prep, list(_compose(ssd.apply, self.plan, sent, recv).values()))


def _state_space(handle: int, x: Tensor, doc_lens: Tensor | None, chunk: int):
    call = _call(handle, x)
    plan = call.state(doc_lens)
    return StateSpace(plan, chunked(plan.runs, call.batch * call.local_len, _chunk_size(plan, chunk))), call


@torch.library.custom_op("titan_cp::cp_ssd", mutates_args=())
def _ssd_op(
    x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, doc_lens: Tensor | None, handle: int, chunk: int
) -> Tensor:
    kind, call = _state_space(handle, x, doc_lens, chunk)
    return run(kind, call.comm, (x, dt, a, b, c)).reshape(x.shape).contiguous()


@_ssd_op.register_fake
def _(x, dt, a, b, c, doc_lens, handle, chunk):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, torch.float32))


@torch.library.custom_op("titan_cp::cp_ssd_backward", mutates_args=())
def _ssd_backward_op(
    dout: Tensor, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, doc_lens: Tensor | None, handle: int,
    chunk: int,
) -> list[Tensor]:  # fmt: skip
    kind, call = _state_space(handle, x, doc_lens, chunk)
    grads = run_backward(kind, call.comm, (x, dt, a, b, c), _acc(_flat(dout)))
    return [gr.to(t.dtype).contiguous() for gr, t in zip(grads, (x, dt, a, b, c))]  # type: ignore[union-attr]


@_ssd_backward_op.register_fake
def _(dout, x, dt, a, b, c, doc_lens, handle, chunk):
    return [t.new_empty(t.shape) for t in (x, dt, a, b, c)]


def _ssd_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.args = inputs[5:]


def _ssd_backward(ctx, dout):
    return (*_ssd_backward_op(dout, *ctx.saved_tensors, *ctx.args), None, None, None)


_ssd_op.register_autograd(_ssd_backward, setup_context=_ssd_setup)


# ---------------------------------------------------------------------------- the short convolution
@dataclass(frozen=True)
class Convolution(_Planned):
    """:mod:`.conv` on a call's tokens: ``x`` ``(B, S, channels)``, ``weight`` ``(channels, K)``."""

    plan: HaloPlan
    activation: str | None

    def prepare(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        return _flat(x), weight, bias

    def send_index(self, device: torch.device) -> Tensor:
        """The rows :meth:`outgoing` gives are the rows sent, in order."""
        return self.plan.index_on("all_sent", list(range(sum(map(len, self.plan.send.values())))), device)

    def outgoing(self, prep: tuple[Tensor, Tensor, Tensor | None]) -> tuple[Tensor, Partial]:
        """The halo rows this rank sends, peers in order (nothing more: the tokens are read where they are)."""
        return prep[0].index_select(0, self.plan.send_index(prep[0].device)), ()

    def add_sent_grad(self, grads: Sequence[Tensor | None], d_sent: Tensor) -> bool:
        """The rows sent are tokens of ``x``: their gradient is added into ``x``'s where they are (the halo's
        rows, not a full-size gradient of the gather and its sum)."""
        dx = grads[0]
        if dx is None or not d_sent.numel():
            return dx is not None
        dx.view(-1, dx.shape[-1]).index_add_(0, self.plan.send_index(dx.device), d_sent.to(dx.dtype))
        return True

    def local(self, prep: tuple[Tensor, Tensor, Tensor | None], partial: Partial, sent: Tensor, recv: Tensor) -> Tensor:
        x, weight, bias = prep
        return conv_kernel.conv(x, recv, *self.plan.edge_on(x.device), weight, bias, self.activation)


def _convolution(handle: int, x: Tensor, weight: Tensor, doc_lens: Tensor | None, activation: str):
    call = _call(handle, x)
    return Convolution(call.halo(doc_lens, weight.shape[-1]), activation or None), call


@torch.library.custom_op("titan_cp::cp_causal_conv1d", mutates_args=())
def _conv_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, doc_lens: Tensor | None, handle: int, activation: str
) -> Tensor:
    kind, call = _convolution(handle, x, weight, doc_lens, activation)
    return run(kind, call.comm, (x, weight, bias)).reshape(x.shape).contiguous()


@_conv_op.register_fake
def _(x, weight, bias, doc_lens, handle, activation):
    return x.new_empty(x.shape)


@torch.library.custom_op("titan_cp::cp_causal_conv1d_backward", mutates_args=())
def _conv_backward_op(
    dout: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, doc_lens: Tensor | None, handle: int, activation: str
) -> list[Tensor]:
    kind, call = _convolution(handle, x, weight, doc_lens, activation)
    grads = run_backward(kind, call.comm, (x, weight, bias), _flat(dout))
    return [g.contiguous() for g in grads if g is not None]


@_conv_backward_op.register_fake
def _(dout, x, weight, bias, doc_lens, handle, activation):
    return [t.new_empty(t.shape) for t in (x, weight, bias) if t is not None]


def _conv_setup(ctx, inputs, output):
    x, weight, bias = inputs[:3]
    ctx.save_for_backward(x, weight, *(() if bias is None else (bias,)))
    ctx.has_bias, ctx.args = bias is not None, inputs[3:]


def _conv_backward(ctx, dout):
    saved = ctx.saved_tensors
    x, weight, bias = saved[0], saved[1], saved[2] if ctx.has_bias else None
    grads = _conv_backward_op(dout, x, weight, bias, *ctx.args)
    return grads[0], grads[1], grads[2] if ctx.has_bias else None, None, None, None


_conv_op.register_autograd(_conv_backward, setup_context=_conv_setup)
