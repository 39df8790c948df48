"""A Gated DeltaNet layer under CP at full size without a GPU: counted, then timed on a device by a model.

**The count** (:func:`simulate`). Every rank of a CP group runs one layer's short convolution and gated delta
rule, forward and backward, through titan_cp's own ops (:func:`~titan_cp.attention.linear.cp_causal_conv1d`,
:func:`~titan_cp.attention.linear.cp_gated_delta_rule` with the ``fla`` backend, as ``"auto"`` picks on a
GPU), on *meta* tensors: shapes, dtypes and strides, no data. The CUDA path's fake tensors
(:mod:`benchmarks.fake_cuda`) cannot run it: on ``fla`` the layer is plain autograd, and autograd on a
fake CUDA tensor needs CUDA's device guard, which a CPU-only build aborts on. What stands in:

- ``fla``'s ``chunk_gated_delta_rule`` is :class:`MeteredFla`: it records each call (its pieces, from
  ``cu_seqlens``; the value width; whether it starts from given states), forward and backward, saves what
  ``fla``'s own autograd function saves (``fla/ops/gated_delta_rule/chunk.py``: q and k normalised and their
  rstd, v, the cumulative g, beta, the UT matrix ``A``, the initial states) and returns outputs of the
  right shapes;
- the exchange's ``torch.distributed`` calls move nothing (:data:`benchmarks.fake_cuda.FAKE_DIST`), their
  bytes counted by :func:`~titan_cp.attention.comm.count_comm` (the convolution's halos and the summaries
  apart);
- ``titan_cp.layout.to_device`` copies host index tensors non-blocking (on CUDA: pinned, non-blocking);
  :class:`~benchmarks.fake_cuda.SyncDetector` raises on any other host-to-device copy and on any device
  value read on the host; :class:`~benchmarks.fake_cuda.TrafficMeter` counts the operations outside the
  kernel and the HBM bytes they read and write.

Each rank runs the layer twice, the second time counted: the first builds the layout's plans, which every
later layer of a microbatch reuses. Beside it, the rank's own pieces run on one device as documents of their
own (**alone**: one ``fla`` call over the same pieces at ``d_v`` columns, no exchange): what the layer costs
without CP. Under CP each piece runs once too, in one of three calls: before the exchange, the pieces that
start their document at ``d_v`` and the wide ones at ``d_v + d_k``; after it, the last pieces and the late
middle ones from their states and the documents placed there at ``d_v``; the late middles' final states go
by a second exchange to the ranks whose wide pieces they correct (:mod:`titan_cp.attention.linear.fla`,
:func:`titan_cp.attention.linear.plan.piece_calls`).

**The time** (:func:`layer_record`), on a device of :data:`titan_cp.plan.GPUS`::

    own        projections   6 x their parameters x tokens / the planner's matmul rate (dev.matmul_flops)
               kernel        the alone run's fla calls: titan_cp.plan.linear.chunk_flops per chunk and head
                             (forward; backward 2x plus fla's recomputation) / rate
               elementwise   the convolution and the gated norm as fused kernels (plan.linear.elementwise_bytes_per_token)
                             / HBM bandwidth
    overhead   kernel        the fla calls' FLOPs under CP less alone's (the wide pieces' d_k more columns,
                             forward and backward) / rate
               exchange      the bytes counted / NVLink bandwidth, exposed whole (the last call and the wide
                             pieces' corrections wait for the states composed from what arrives)
               wait          the kernel FLOPs the rank waits for the others at the exchange, a collective
                             (:func:`waits`: the longest work before it plus the longest after it, each way,
                             less the rank's own) / rate
               outside       the outside-kernel HBM bytes CP adds (counted under CP less counted alone) / HBM
                             bandwidth

``rate``: :data:`titan_cp.plan.linear.GATED_DELTA_FRACTION` of the device's peak (or ``fraction``). The
record is the rank with the largest ``overhead / own``; ``variants`` say what would bring it down, or push
it up, from the same counts: the kernel at half and twice the rate, the GEMMs at twice theirs, the outside
bytes CP adds gone, the whole decoder layer (its MLP or experts) as the layer. ``floor_pct``: the least any
exact method adds, :func:`titan_cp.plan.linear.floor_flops` (the incoming state carried through the later
pieces' chunks) at ``rate`` over the same ``own``, with no exchange and no byte outside the kernel.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

import titan_cp.layout as layout_module
from benchmarks.fake_cuda import FAKE_DIST, SyncDetector, TrafficMeter, fake_meshes
from titan_cp.attention import comm
from titan_cp.attention.api import local_handle
from titan_cp.attention.handle import CPHandle
from titan_cp.attention.linear import CHUNK, gated_delta_rule, op
from titan_cp.attention.linear.plan import state_plan
from titan_cp.data.row_mixes import lognormal_doc_lens
from titan_cp.integrations.hf_shapes import LinearShapes
from titan_cp.layout import DEFAULT_BALANCE, SequenceLayout, get_layout
from titan_cp.plan import linear as lin
from titan_cp.plan.devices import GPUS
from titan_cp.testing.fla import stand_in

DEVICE = torch.device("meta")
FP32 = 4
BAR = 0.05  # the bar: a linear layer's CP overhead at most 5% of its own time

QWEN3_NEXT = LinearShapes("gated_delta", 16, 32, 128, 128, 4, 64)
"""Qwen3-Next's (and Qwen3.5's) Gated DeltaNet: 16 q/k heads, 32 value heads, ``d_k = d_v = 128``, 4 taps
(``transformers``' ``Qwen3NextConfig`` and ``Qwen3_5TextConfig`` defaults)."""


@dataclass(frozen=True)
class ModelDims:
    """A hybrid model's linear layer as the time model prices it: its ``shapes``, the hidden size ``dim``
    and what the rest of its decoder layer computes per token forward and backward (``ffn_flops``: the
    MLP's or the active experts', for the whole-layer variant)."""

    name: str
    shapes: LinearShapes
    dim: int
    ffn_flops: float


MODELS = {
    # Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults): hidden 2048; 10 of 512 experts of 512 and a
    # shared expert of 512 per token, and the router (2048 x 512): 6 x (3 x 2048 x 5632 + 2048 x 512)
    "qwen3_next": ModelDims("qwen3_next", QWEN3_NEXT, 2048, 6 * (3 * 2048 * (10 * 512 + 512) + 2048 * 512)),
    # Qwen3.5-9B style (transformers' Qwen3_5TextConfig defaults): hidden 4096, dense MLP of 12288
    "qwen3_5": ModelDims("qwen3_5", QWEN3_NEXT, 4096, 6 * 3 * 4096 * 12288),
}


# ---------------------------------------------------------------------------- fla, metered
@dataclass(frozen=True)
class FlaCall:
    """One call of ``fla``'s ``chunk_gated_delta_rule``: ``op`` (forward / backward), its pieces' ``lengths``,
    its value ``width`` (``d_v``, or ``d_v + d_k`` for the later pieces) and whether it starts from given states."""

    op: str
    lengths: tuple[int, ...]
    width: int
    initial: bool

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def flops(self, shapes: LinearShapes) -> float:
        chunks = lin.chunks_of(self.lengths, shapes.chunk)
        return chunks * shapes.v_heads * lin.chunk_flops(shapes, self.width, self.op == "backward")


class _Fla(torch.autograd.Function):
    """The metered call: no arithmetic, ``fla``'s saved tensors and output shapes."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial, meter, lengths, chunk):  # type: ignore[override]
        meter.calls.append(FlaCall("forward", lengths, v.shape[-1], initial is not None))
        rstd = lambda x: torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)  # noqa: E731
        saved = [q.new_empty(q.shape), rstd(q), k.new_empty(k.shape), rstd(k), v, g.new_empty(g.shape), beta]
        saved += [v.new_empty(*v.shape[:-1], chunk), initial]
        ctx.save_for_backward(*saved)
        ctx.meter, ctx.lengths = meter, lengths
        final = torch.empty(len(lengths), v.shape[2], q.shape[-1], v.shape[-1], dtype=torch.float32, device=v.device)
        return v.new_empty(v.shape), final

    @staticmethod
    def backward(ctx, d_out, d_final):  # type: ignore[override]
        q, _, k, _, v, g, beta, _, initial = ctx.saved_tensors
        ctx.meter.calls.append(FlaCall("backward", ctx.lengths, v.shape[-1], initial is not None))
        grads = [x.new_empty(x.shape) for x in (q, k, v, g, beta)]
        return (*grads, None if initial is None else initial.new_empty(initial.shape), None, None, None)


class MeteredFla:
    """Stands in for ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (module docstring): ``calls`` lists
    each call; ``inside`` is set while one runs (so a :class:`~benchmarks.fake_cuda.TrafficMeter` leaves its
    operations out: they are the kernel's)."""

    def __init__(self, chunk: int = 64) -> None:
        self.calls: list[FlaCall] = []
        self.inside = False
        self.chunk = chunk

    def __call__(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):  # fmt: skip
        assert q.shape[0] == 1 and cu_seqlens_cpu is not None and output_final_state
        self.inside = True
        try:
            lengths = tuple(int(n) for n in cu_seqlens_cpu.diff().tolist())
            return _Fla.apply(q, k, v, g, beta, initial_state, self, lengths, self.chunk)
        finally:
            self.inside = False


@contextlib.contextmanager
def meta_device(meter: MeteredFla) -> Iterator[None]:
    """The stand-ins of the module docstring for a block: ``fla`` metered, the exchange counted and moving
    nothing, host index tensors copied to the meta device non-blocking."""
    real_to_device, real_dist = layout_module.to_device, comm.dist

    def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if torch.device(device).type != DEVICE.type:
            return real_to_device(t, device)
        return t.to(device, non_blocking=True)  # the engine's pinned, non-blocking copy on a GPU

    users = [m for m in list(sys.modules.values()) if getattr(m, "to_device", None) is real_to_device]
    try:
        for m in users:
            m.to_device = to_device
        comm.dist = FAKE_DIST
        with stand_in(meter):  # import fla finds meter as its chunk_gated_delta_rule
            yield
    finally:
        for m in users:
            m.to_device = real_to_device
        comm.dist = real_dist


# ---------------------------------------------------------------------------- one rank's layer
class SavedBytes:
    """Bytes autograd saves inside ``with counter:``, storages counted once (meta storages by their identity,
    which stays theirs while the graph holds them); ``exclude``: parameters."""

    def __init__(self, exclude: tuple[torch.Tensor, ...] = ()) -> None:
        self.exclude = {x.untyped_storage()._cdata for x in exclude}
        self.seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in self.exclude:
            self.seen[key] = t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


@dataclass
class LinearTrace:
    """One rank's counted layer (the second of two runs): ``calls`` of ``fla``; bytes handed to the exchange
    by the convolution (``halo_bytes``) and the gated delta rule (``summary_bytes``) and their collectives
    (``collectives``); operations outside the kernel that move data, their HBM bytes and sites; host
    operations; the bytes autograd saved (the mixer's ops: the convolution's and fla's)."""

    rank: int
    calls: list[FlaCall] = field(default_factory=list)
    halo_bytes: int = 0
    summary_bytes: int = 0
    collectives: int = 0
    outside_ops: int = 0
    outside_bytes: int = 0
    sites: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    host_ops: int = 0
    saved_bytes: int = 0

    def kernel_flops(self, shapes: LinearShapes) -> float:
        """FLOPs of the calls."""
        return sum(c.flops(shapes) for c in self.calls)


def _inputs(shapes: LinearShapes, local: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A rank's layer inputs on the meta device, token-major: the convolution's ``x`` and taps, and q, k, v,
    g (fp32, as Qwen's layers make it), beta."""
    s = shapes

    def make(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dt, device=DEVICE).requires_grad_()

    return dict(
        x=make(1, local, s.conv_channels),
        weight=make(s.conv_channels, s.conv),
        q=make(1, local, s.k_heads, s.d_k),
        k=make(1, local, s.k_heads, s.d_k),
        v=make(1, local, s.v_heads, s.d_v),
        g=make(1, local, s.v_heads, dt=torch.float32),
        beta=make(1, local, s.v_heads),
    )


def _conv(t: dict[str, torch.Tensor], handle: int, docs: torch.Tensor | None) -> torch.Tensor:
    """The convolution forward through its custom op's own implementation, below autograd as the op runs it
    (on the meta device the custom op itself would run its fake)."""
    with torch.no_grad():
        return op._conv_op._init_fn(t["x"], t["weight"], None, docs, handle, "silu")


def _gated(t: dict[str, torch.Tensor], handle: int, docs: torch.Tensor | None) -> torch.Tensor:
    """The gated delta rule forward through ``fla`` (plain autograd: what ``"auto"`` runs eagerly on a GPU)."""
    q, k, v, g, beta = (t[n] for n in ("q", "k", "v", "g", "beta"))
    return gated_delta_rule(q, k, v, g, beta, handle, docs, None, True, CHUNK, "fla")


def _run(
    rank: int, t: dict[str, torch.Tensor], handle: int, docs: torch.Tensor | None, meter: MeteredFla
) -> LinearTrace:
    """One counted forward + backward of the layer on ``t`` under the handle ``handle`` (an id) with documents
    ``docs``: both forwards before either backward, the two ops' exchanges counted apart; the convolution
    saves its input (its custom op's ``setup_context``), its backward is the custom op's implementation."""
    meter.calls.clear()
    trace = LinearTrace(rank)
    traffic = TrafficMeter(meter, DEVICE.type)  # type: ignore[arg-type] - anything with an ``inside`` flag
    saved = SavedBytes((t["weight"],))
    with SyncDetector(DEVICE.type), traffic:
        with comm.count_comm() as halos:
            y = _conv(t, handle, docs)
        with comm.count_comm() as summaries, saved:
            out = _gated(t, handle, docs)
        with comm.count_comm() as summaries_back:
            out.backward(torch.empty_like(out))
        with comm.count_comm() as halos_back:
            op._conv_backward_op._init_fn(torch.empty_like(y), t["x"], t["weight"], None, docs, handle, "silu")
    counts = (halos, halos_back, summaries, summaries_back)
    trace.calls = list(meter.calls)
    trace.halo_bytes = halos.bytes_sent + halos_back.bytes_sent
    trace.summary_bytes = summaries.bytes_sent + summaries_back.bytes_sent
    trace.collectives = sum(c.calls for c in counts)
    trace.outside_ops, trace.outside_bytes, trace.sites = traffic.ops, traffic.bytes, traffic.sites
    trace.host_ops, trace.saved_bytes = traffic.host_ops, saved.total + t["x"].untyped_storage().nbytes()
    return trace


def _twice(rank: int, shapes: LinearShapes, local: int, handle: int, docs, meter: MeteredFla, dtype) -> LinearTrace:
    """The layer run once (its plans built, as a microbatch's first layer builds them), then counted."""
    _run(rank, _inputs(shapes, local, dtype), handle, docs, meter)
    return _run(rank, _inputs(shapes, local, dtype), handle, docs, meter)


def simulate(
    shapes: LinearShapes,
    seq_len: int,
    cp: int,
    doc_lens: list[list[int]] | None = None,
    balance: str = DEFAULT_BALANCE,
    dtype: torch.dtype = torch.bfloat16,
) -> list[tuple[LinearTrace, LinearTrace]]:
    """``(under CP, alone)`` of each of the ``cp`` ranks (module docstring): one Gated DeltaNet layer's
    convolution and kernel, forward and backward, on a row of ``seq_len`` tokens (``doc_lens``: its
    documents, one list; ``None``: one document) under ``balance``. A host synchronisation raises
    :class:`~benchmarks.fake_cuda.HostSyncError`."""
    assert shapes.gated_delta, "the count runs Gated DeltaNet's fla path"
    meter = MeteredFla(shapes.chunk)
    out = []
    with meta_device(meter):
        for mesh in fake_meshes("ring", cp):
            handle = CPHandle(mesh, "ring", balance)  # type: ignore[arg-type] - the simulated mesh
            layout, docs = handle.register(seq_len, doc_lens or [[seq_len]])
            traced = _twice(handle.rank, shapes, layout.local_len, handle.id, docs, meter, dtype)
            out.append((traced, _alone(handle.rank, shapes, layout, meter, dtype)))
    return out


def _alone(rank: int, shapes: LinearShapes, layout: SequenceLayout, meter: MeteredFla, dtype) -> LinearTrace:
    """The rank's pieces on one device, each a document of its own: the layer without CP."""
    lengths = [n for _, n in state_plan(layout, rank, 1).runs]
    docs = get_layout(layout.local_len, 1, "contiguous", [lengths]).documents
    return _twice(rank, shapes, layout.local_len, local_handle().id, docs, meter, dtype)


# ---------------------------------------------------------------------------- the time model
@dataclass(frozen=True)
class RankTime:
    """One rank's seconds (module docstring): its layer's ``own`` parts, the ``overhead`` CP adds, and the
    ``floor`` any exact method adds (:func:`titan_cp.plan.linear.floor_flops` at the kernel's rate)."""

    rank: int
    own: dict[str, float]
    overhead: dict[str, float]
    floor: float

    @property
    def ratio(self) -> float:
        return sum(self.overhead.values()) / sum(self.own.values())

    @property
    def floor_ratio(self) -> float:
        return self.floor / sum(self.own.values())


@dataclass(frozen=True)
class Variant:
    """A change to the model, priced from the same counts (module docstring): the kernel's rate and the
    GEMMs' times ``rate`` and ``gemm``; the decoder layer's MLP or experts in the layer's own time
    (``whole_layer``); ``no_outside``: the outside bytes CP adds gone (the bound of fusing the corrections
    ``r^T S_in`` into the kernel and gathering without scatter-adds)."""

    rate: float = 1.0
    gemm: float = 1.0
    whole_layer: bool = False
    no_outside: bool = False


def phases(shapes: LinearShapes, work: lin.LinearWork) -> tuple[float, float, float, float]:
    """One rank's kernel FLOPs by side of the exchange, in the order they run: forward before it (the first
    call and the wide one), forward after it (the last call), backward before the exchange's return (the last
    call's), backward after it (the others')."""
    before = [(work.before_lengths, shapes.d_v), (work.wide_lengths, shapes.d_v + shapes.d_k)]
    fb, bb = (sum(lin.call_flops(shapes, lin.chunks_of(n, shapes.chunk), w)[i] for n, w in before) for i in (0, 1))
    fa, ba = lin.call_flops(shapes, lin.chunks_of(work.after_lengths, shapes.chunk), shapes.d_v)
    return fb, fa, ba, bb


def critical(shapes: LinearShapes, works: Sequence[lin.LinearWork]) -> float:
    """The layer's kernel FLOPs along its critical path: the exchange is a collective, forward and backward, so
    its kernels take the longest of the ranks' work before it plus the longest after it, each way."""
    each = [phases(shapes, w) for w in works]
    return sum(max(p[i] for p in each) for i in range(4))


def waits(shapes: LinearShapes, works: Sequence[lin.LinearWork]) -> list[float]:
    """Each rank's kernel FLOPs of waiting: what the :func:`critical` path adds to its own."""
    longest = critical(shapes, works)
    return [longest - sum(phases(shapes, w)) for w in works]


def rank_times(
    dims: ModelDims, pair: tuple[LinearTrace, LinearTrace], work: lin.LinearWork, device: str = "h200",
    fraction: float = lin.GATED_DELTA_FRACTION, variant: Variant = Variant(), wait: float = 0.0,
) -> RankTime:  # fmt: skip
    """:class:`RankTime` of one rank's ``(under CP, alone)`` counts; ``work``: its
    :class:`~titan_cp.plan.linear.LinearWork`; ``variant``: a :class:`Variant` of the model; ``wait``: its kernel
    FLOPs of waiting at the exchange (:func:`waits`)."""
    cp, alone = pair
    dev, s, v = GPUS[device], dims.shapes, variant
    rate, gemm, tokens = dev.peak_flops * fraction * v.rate, dev.matmul_flops * v.gemm, sum(work.lengths)
    own = {
        "projections": 6 * s.params(dims.dim) * tokens / gemm,
        "kernel": alone.kernel_flops(s) / rate,
        "elementwise": lin.elementwise_bytes_per_token(s, 2) * tokens / dev.hbm_bandwidth,
    }
    if v.whole_layer:
        own["decoder_mlp"] = dims.ffn_flops * tokens / gemm
    overhead = {
        "kernel": (cp.kernel_flops(s) - alone.kernel_flops(s)) / rate,
        "exchange": (cp.halo_bytes + cp.summary_bytes) / dev.intra_bw,
        "wait": wait / rate,
        "outside": 0.0 if v.no_outside else (cp.outside_bytes - alone.outside_bytes) / dev.hbm_bandwidth,
    }
    return RankTime(cp.rank, own, overhead, sum(lin.floor_flops(s, work)) / rate)


VARIANTS = {
    "kernel_at_half_rate": Variant(rate=0.5),
    "kernel_at_twice_rate": Variant(rate=2.0),
    "gemm_at_twice_rate": Variant(gemm=2.0),
    "without_outside_bytes": Variant(no_outside=True),
    "whole_decoder_layer": Variant(whole_layer=True),
    "whole_layer_without_outside_bytes": Variant(whole_layer=True, no_outside=True),
    "whole_layer_kernel_at_twice_rate": Variant(whole_layer=True, rate=2.0),
}
"""What would bring the overhead down, or push it up (module docstring)."""


def _ms(parts: dict[str, float]) -> dict[str, float]:
    return {k: round(1e3 * v, 3) for k, v in parts.items()} | {"total": round(1e3 * sum(parts.values()), 3)}


def layer_record(
    dims: ModelDims, mix: str, seq_len: int, cp: int, doc_lens: list[list[int]] | None,
    balance: str = DEFAULT_BALANCE, device: str = "h200", fraction: float = lin.GATED_DELTA_FRACTION,
) -> dict:  # fmt: skip
    """One JSON-ready record: the counts of :func:`simulate` and the time model on ``device`` (module
    docstring), for the rank with the largest ``overhead / own``, the variants' largest ratios beside it."""
    pairs = simulate(dims.shapes, seq_len, cp, doc_lens, balance)
    rows = tuple(tuple(r) for r in (doc_lens or [[seq_len]]))
    works = lin.linear_work(seq_len, cp, balance, rows, dims.shapes.conv, late=True)
    wait = waits(dims.shapes, works)
    times = [rank_times(dims, p, works[p[0].rank], device, fraction, wait=wait[p[0].rank]) for p in pairs]
    worst = max(times, key=lambda t: t.ratio)
    traced, alone = pairs[worst.rank]
    variants = {
        name: max(rank_times(dims, p, works[p[0].rank], device, fraction, v, wait[p[0].rank]).ratio for p in pairs)
        for name, v in VARIANTS.items()
    }
    sites = {f"{k[0]}:{k[1]}": v[1] - alone.sites.get(k, [0, 0])[1] for k, v in traced.sites.items()}
    return {
        "model": dims.name, "mix": mix, "seq_len": seq_len, "cp": cp, "balance": balance,
        "documents": len(rows[0]), "device": device, "kernel_fraction": fraction, "rank": worst.rank,
        "own_ms": _ms(worst.own), "overhead_ms": _ms(worst.overhead), "overhead_pct": round(100 * worst.ratio, 2),
        "bar_pct": 100 * BAR, "within_bar": worst.ratio <= BAR, "floor_pct": round(100 * max(t.floor_ratio for t in times), 2),
        "overhead_pct_by_rank": [round(100 * t.ratio, 2) for t in times],
        "fla_calls": [dict(op=c.op, pieces=len(c.lengths), tokens=c.tokens, width=c.width) for c in traced.calls],
        "wide_tokens": sum(works[worst.rank].wide_lengths),
        "after_tokens": sum(works[worst.rank].after_lengths),
        "summarized_tokens": sum(works[worst.rank].summarized),
        "bytes_per_layer": {"summaries": traced.summary_bytes, "halos": traced.halo_bytes},
        "bytes_per_layer_max_rank": max(p[0].summary_bytes + p[0].halo_bytes for p in pairs),
        "collectives": traced.collectives,
        "outside_gb": {"under_cp": round(traced.outside_bytes / 1e9, 3), "alone": round(alone.outside_bytes / 1e9, 3)},
        "outside_ops_added": traced.outside_ops - alone.outside_ops,
        "outside_added_gb_by_site": {k: round(v / 1e9, 3) for k, v in sorted(sites.items(), key=lambda kv: -kv[1])[:8]},
        "saved_mb": {"under_cp": round(traced.saved_bytes / 1e6, 1), "alone": round(alone.saved_bytes / 1e6, 1)},
        "host_ops": traced.host_ops,
        "variants_overhead_pct": {k: round(100 * v, 2) for k, v in variants.items()},
    }  # fmt: skip


MIXES = ("docs_1k", "one_document")


def mix_rows(mix: str, seq_len: int, seed: int = 0) -> list[list[int]] | None:
    """The documents of ``mix``: ``docs_1k`` log-normal lengths of mean 1,024 (sigma 1, as
    :func:`benchmarks.gpu_model.model_rows` draws them), ``one_document`` the whole row."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
    return [lognormal_doc_lens(seq_len, 1024, seed=seed)] if mix == MIXES[0] else None
