"""A hybrid model's linear-attention layers in the planner: what one holds, sends and takes under CP.

A Gated DeltaNet or Mamba2 layer (:class:`~titan_cp.integrations.hf_shapes.LinearShapes`) under CP runs
each piece of each document from the state the pieces before it leave (:mod:`titan_cp.attention.linear`).
What that costs a rank follows from the layout's pieces alone (:func:`linear_work`, from the ops' own
:func:`~titan_cp.attention.linear.plan.state_plan` and :func:`~titan_cp.attention.linear.plan.halo_plan`):
its pieces and their chunks, which of them have pieces of their document before them (*later* pieces), the
pieces it summarises (a later piece of the same document follows them), the summaries it sends and
receives, the convolution's halo tokens. Nothing grows with the row but the tokens a rank runs: a summary
is ``heads x d_k x (d_v + d_k)`` numbers whatever the piece's length.

**The calls** of Gated DeltaNet through ``fla`` (:mod:`titan_cp.attention.linear.fla`), per rank and layer,
each where the rank has such pieces, forward and backward: before the exchange, one over the pieces that
start their document at ``d_v`` columns and one over the *wide* pieces at ``d_v + d_k`` (``[v | 0]`` from
``[0 | I]``: their outputs, the query carried through their transitions and their summaries in one pass):
every *middle* piece (a later piece a later piece follows: the ranks after it need its summary before its
own state is known) and the *last* pieces (later pieces no piece follows) placed there; after it, one over
the other last pieces, from their composed states, and the whole documents placed there, at ``d_v``
(:func:`~titan_cp.attention.linear.plan.piece_calls` places them so that the ranks reach the exchange, a
collective, together); a document's longest middle piece may run there too, from its state (a *late
middle*: the pieces after it wide, corrected from its final state, which a second exchange sends). Without
CP every piece runs at ``d_v`` from zero, at the same cost as from a given state, so what CP adds to the
kernel is the wide pieces' ``d_k`` more columns (:func:`cp_flops`). Mamba2 runs its summaries' state pass, then every
piece from its composed state.

**Kernel FLOPs** (:func:`chunk_flops`), per head and chunk of ``C`` tokens (a piece's last chunk padded and
computed whole), ``K = d_k``, ``V`` the value width the call runs (``d_v``; ``d_v + d_k`` for Gated
DeltaNet's wide pieces)::

    Gated DeltaNet, fla's chunk_gated_delta_rule (the chunked algorithm of arXiv:2412.06464, section 3.3):
      kkt      A = strict_lower(beta K K^T * D)            2 C^2 K
      solve    T = (I + A)^-1, unit lower triangular        C^3 / 3
      wy       W = T (beta K exp(c)),  U = T (beta V)       2 C^2 K + 2 C^2 V
      state    V' = U - W S,  S <- exp(c_C) S + K'^T V'     4 C K V
      output   O = (Q exp(c)) S + ((Q K^T) * D) V'          2 C K V + 2 C^2 K + 2 C^2 V
      forward  F = 6 C^2 K + 4 C^2 V + 6 C K V + C^3 / 3
      backward 2 F (each product's gradient: two products of its size) + what fla's backward recomputes
               (W, U and the chunk states): 2 C^2 K + 2 C^2 V + 4 C K V
    Mamba2's SSD, titan_cp's torch chunked kernel (N = d_state, P = head_dim; arXiv:2405.21060, section 6):
      forward  F = 2 C^2 N (C B^T) + 2 C^2 P (its masked product with dt x) + 4 C N P (the chunk's state,
               the outputs from the state before it) + 2 N P (the state passed on)
      backward F (the op recomputes its forward) + 2 F

**The floor.** A last piece costs nothing more than alone: it waits for its state and runs from it. A middle
piece cannot wait without serialising the ranks (the ranks after it wait for its summary), so its summary's
transition ``M`` (``d_k x d_k``) is carried through its chunks: per chunk and head the two rank-``C``
products of the state update (``W M``, then ``K'^T`` times it), ``4 C K^2`` forward, twice that backward
(:func:`floor_flops`), with ``W`` shared with the piece's own pass; its outputs could then run from its
composed state at the cost they have alone. That needs a kernel ``fla`` does not have (the transition
carried beside the pass, without outputs); ``fla``'s own call carries it as the ``d_k`` columns ``[0 |
I]`` (titan_cp's wide call: the query carried through the transitions, its product with ``S_in`` after the
exchange) at ``4 C^2 K + 6 C K K`` more (at ``K = V`` and ``C = 64``: 8.4 MFLOP a chunk forward, twice the
floor's 4.2); a second ``fla`` call over the piece for the transition alone would cost a whole pass at
``d_k`` columns (11.6). A row that is one document has middle pieces on nearly every token of every rank.

**Rates.** Gated DeltaNet's kernel at :data:`GATED_DELTA_FRACTION` of the device's peak: 0.15, half the
rate FlashAttention-2 reaches on an H100 at head dim 128 (0.29 to 0.37 of peak, :data:`~titan_cp.plan.kernels.FA2_H100`),
since fla's chunked form runs as a chain of Triton kernels on 64-token tiles that pass ``A``, ``W``, ``U``
and every chunk's state through HBM, and its state pass is sequential over chunks (parallel over heads
and value blocks only). An assumption, not a measurement: no published kernel throughput of
``chunk_gated_delta_rule`` was at hand (:mod:`benchmarks.linear_model` reports the layer at half and twice
it). Mamba2's SSD runs titan_cp's torch kernel in fp32 on every device: fp32 matmuls (TF32 off, PyTorch's
default) run on the CUDA cores, 67 TFLOP/s on an H100/H200 (datasheets), 0.068 of the bf16 peak;
:data:`SSD_FRACTION` takes 0.05.

**Memory** per rank and layer (:func:`saved_per_token`, :func:`state_bytes`), bf16 activations ``a``, on a
GPU (``fla``'s own autograd for Gated DeltaNet, the custom op's saved inputs for Mamba2)::

    per token   the layer's input (a D), the convolution's input (a x channels); Gated DeltaNet:
                fla's saved q, k (normalised, a K each head), their rstd (4 each head), v (a V), g (4),
                beta (a), A (a C) per value head; the gate z and the kernel's output (a value_dim each,
                the gated norm's), the norm's rstd (4 per head), out_proj's input (a value_dim)
                Mamba2: x, dt, B, C (the op's inputs, a each), the gate, the output (fp32), out_proj's input
    CP, Gated DeltaNet (:func:`widened_saved_bytes`, :func:`state_bytes`):
    per wide token    v's d_k more columns (a K per value head: fla's saved v) and the wide call's outputs
                [o | r] (V + K per value head: the correction r^T S_in keeps r, a view of them)
    per token   the permutation (int64) that puts the calls' tokens back, on a rank that runs two or more
    per piece   its call's initial state (fp32, heads x K x V for a first or a last piece: zero, or its
                composed state; heads x K x (V + K), the [0 | I] start, for a middle one); each composed
                state a longer chain extends (fp32 heads x K x V: M s + B keeps s); the summary buffers a
                chain of two links or more reads (fp32 heads x K x (V + K) a row: M s + B keeps M, and the
                first link's s is a view of its summary); each wide piece's state copied to the
                activations' dtype for its correction; the summaries' and the late middles' states' indices (int64)
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import lru_cache

from titan_cp.attention.linear.plan import Piece, _pieces, consecutive, late_middles, layout_calls
from titan_cp.families.llama3.model import ModelArgs
from titan_cp.integrations.hf_shapes import HFShapes, LinearShapes
from titan_cp.layout import get_layout
from titan_cp.plan.devices import Device

FP32 = 4
GATED_DELTA_FRACTION = 0.15
SSD_FRACTION = 0.05


def linear_shapes(args: ModelArgs) -> tuple[LinearShapes | None, tuple[int, ...]]:
    """A model's linear layers: their shapes and indices (``(None, ())`` for a model without any)."""
    if isinstance(args, HFShapes) and args.linear is not None:
        return args.linear, args.linear_layers
    return None, ()


def stage_linear_layers(args: ModelArgs, layers: int, first: bool, last: bool) -> int:
    """How many of a pipeline stage's ``layers`` are linear (:func:`layers_in_stage`)."""
    return layers_in_stage(linear_shapes(args)[1], args.n_layers, layers, first, last)


def layers_in_stage(ids: tuple[int, ...], n_layers: int, layers: int, first: bool, last: bool) -> int:
    """How many of the layers ``ids`` (of ``n_layers``) are among a pipeline stage's ``layers``: the model's first
    layers when it is the first stage, its last ones when the last (all of them without a pipeline), else in
    proportion."""
    if first:
        return sum(i < layers for i in ids)
    return sum(i >= n_layers - layers for i in ids) if last else round(len(ids) * layers / n_layers)


# ---------------------------------------------------------------------------- the kernel
def chunk_flops(shapes: LinearShapes, width: int, backward: bool) -> float:
    """FLOPs of one chunk of one head, forward or backward, at value width ``width`` (module docstring)."""
    c, k, v = shapes.chunk, shapes.d_k, width
    if shapes.gated_delta:
        forward = 6 * c * c * k + 4 * c * c * v + 6 * c * k * v + c**3 / 3
        return 2 * forward + 2 * c * c * k + 2 * c * c * v + 4 * c * k * v if backward else forward
    forward = 2 * c * c * k + 2 * c * c * v + 4 * c * k * v + 2 * k * v
    return 3 * forward if backward else forward


def chunks_of(lengths: tuple[int, ...] | list[int], chunk: int) -> int:
    """Chunks of pieces of ``lengths`` (each piece's last chunk padded)."""
    return sum(math.ceil(n / chunk) for n in lengths)


def call_flops(shapes: LinearShapes, chunks: int, width: int) -> tuple[float, float]:
    """``(forward, backward)`` FLOPs of one kernel call over ``chunks`` chunks, every head."""
    return tuple(chunks * shapes.v_heads * chunk_flops(shapes, width, b) for b in (False, True))  # type: ignore[return-value]


def model_flops(args: ModelArgs, rows: tuple[tuple[int, ...], ...]) -> int:
    """A model's linear kernels' FLOPs over ``rows`` (each document one piece: no summaries), forward and
    backward, every linear layer (0 for a model without linear layers)."""
    shapes, ids = linear_shapes(args)
    if shapes is None:
        return 0
    return int(len(ids) * sum(call_flops(shapes, chunks_of([n for r in rows for n in r], shapes.chunk), shapes.d_v)))


def kernel_rate(shapes: LinearShapes, dev: Device) -> float:
    """FLOP/s of the layer's kernel on ``dev`` (module docstring)."""
    return dev.peak_flops * (GATED_DELTA_FRACTION if shapes.gated_delta else SSD_FRACTION)


def cp_flops(shapes: LinearShapes, work: LinearWork) -> tuple[float, float]:
    """``(forward, backward)`` kernel FLOPs CP adds to ``work`` (module docstring): Gated DeltaNet's middle
    pieces at ``d_v + d_k`` columns less the same pieces at ``d_v`` (every piece runs once either way, a last
    piece at ``d_v`` from its composed state);
    Mamba2's summaries' state pass, ``2 C N P + 2 N P`` a chunk and head (its intra-chunk products are the
    outputs call's), three times that backward."""
    if shapes.gated_delta:
        chunks = chunks_of(work.wide_lengths, shapes.chunk)
        wide, narrow = (call_flops(shapes, chunks, shapes.d_v + shapes.d_k * w) for w in (True, False))
        return wide[0] - narrow[0], wide[1] - narrow[1]
    c, n, p = shapes.chunk, shapes.d_k, shapes.d_v
    forward = work.summary_chunks(c) * shapes.v_heads * (2 * c * n * p + 2 * n * p)
    return forward, 3 * forward


def floor_flops(shapes: LinearShapes, work: LinearWork) -> tuple[float, float]:
    """``(forward, backward)``: the least kernel FLOPs the chunked form adds to ``work`` under CP without
    serialising the ranks (module docstring, *The floor*): Gated DeltaNet's middle pieces' transitions carried
    through their chunks, ``4 C K^2`` a chunk and head forward, twice that backward. Gated DeltaNet's alone (a
    Mamba2 layer's CP work: :func:`cp_flops`)."""
    if not shapes.gated_delta:
        raise ValueError("floor_flops is Gated DeltaNet's: a Mamba2 layer's CP work is cp_flops'")
    c, k = shapes.chunk, shapes.d_k
    forward = chunks_of(work.middle_lengths, c) * shapes.v_heads * 4 * c * k * k
    return forward, 2 * forward


def elementwise_bytes_per_token(shapes: LinearShapes, act_bytes: int) -> int:
    """HBM bytes per token of the layer's short convolution and gated norm, forward and backward, as fused
    kernels run them: the convolution reads ``x`` and writes ``y`` forward, reads ``dy`` and ``x`` and writes
    ``dx`` backward (5 x channels); the gated norm reads the output and ``z`` and writes forward, reads
    ``dy``, the output and ``z`` and writes both gradients backward (8 x value_dim)."""
    return act_bytes * (5 * shapes.conv_channels + 8 * shapes.value_dim)


# ---------------------------------------------------------------------------- the layout's pieces
@dataclass(frozen=True)
class LinearWork:
    """One rank's share of a linear layer of one microbatch under a layout (module docstring).

    lengths: the rank's pieces, in its buffer's order; later: whether each has pieces of its document before
    it (else it starts its document); followed: whether a later piece follows each (the rank summarises it;
    a later piece that is followed is a *middle* piece, which Gated DeltaNet runs wide, one that is not a
    *last* piece, run from its composed state after the exchange); sent, received: summary rows sent forward and received; halo_sent,
    halo_received: the convolution's halo tokens; composed: the states composed from two summaries or more
    that a longer chain extends (kept as its ``s``), once per chain prefix (a document's pieces on a rank
    share their chains' prefixes: the op composes each once); reads_sent, reads_received: whether a chain
    of two links or more reads this rank's summaries / the received ones; calls: which of Gated DeltaNet's
    calls runs each piece (:func:`~titan_cp.attention.linear.plan.piece_calls`: 0 before the exchange from
    zero, 1 wide, 2 after it from its composed state; a middle piece there is a *late middle*, whose final
    state a second exchange sends to the ranks holding the pieces after it); sent2, received2: those states
    sent and received; reads_own2, reads_received2: whether a chain of two links or more starts from this
    rank's late middles' states / the received ones (keeping them).
    """

    lengths: tuple[int, ...]
    later: tuple[bool, ...]
    followed: tuple[bool, ...]
    sent: int
    received: int
    halo_sent: int
    halo_received: int
    composed: int = 0
    reads_sent: bool = False
    reads_received: bool = False
    calls: tuple[int, ...] = ()
    sent2: int = 0
    received2: int = 0
    reads_own2: bool = False
    reads_received2: bool = False

    def chunks(self, chunk: int) -> int:
        return chunks_of(self.lengths, chunk)

    def _call(self, call: int) -> tuple[int, ...]:
        return tuple(n for n, c in zip(self.lengths, self.calls) if c == call)

    def groups(self) -> list[tuple[tuple[int, ...], bool]]:
        """Each call's pieces' lengths and whether they are one span of the rank's buffer (consecutive pieces)."""
        out = []
        for call in range(3):
            at = [j for j, c in enumerate(self.calls) if c == call]
            out.append((self._call(call), consecutive(at)))
        return out

    @property
    def before_lengths(self) -> tuple[int, ...]:
        """The pieces Gated DeltaNet runs before the exchange from zero (documents' first pieces), in order."""
        return self._call(0)

    @property
    def wide_lengths(self) -> tuple[int, ...]:
        """The pieces Gated DeltaNet runs wide (every middle piece, and the last pieces placed there), in order."""
        return self._call(1)

    @property
    def after_lengths(self) -> tuple[int, ...]:
        """The pieces Gated DeltaNet runs after the exchange (last pieces from their composed states, documents
        held whole from zero), in order."""
        return self._call(2)

    @property
    def middle_lengths(self) -> tuple[int, ...]:
        """The later pieces a later piece follows, in order."""
        return tuple(n for n, later, f in zip(self.lengths, self.later, self.followed) if later and f)

    @property
    def summarized(self) -> tuple[int, ...]:
        """The pieces it summarises (a later piece follows them, and they are not late middles), in order."""
        return tuple(n for n, f, x in zip(self.lengths, self.followed, self._lates()) if f and not x)

    @property
    def late_middles(self) -> int:
        """How many of its pieces are late middles (their states sent by the second exchange)."""
        return sum(self._lates())

    def _lates(self) -> tuple[bool, ...]:
        calls = self.calls or (0,) * len(self.lengths)
        return tuple(later and f and c == 2 for later, f, c in zip(self.later, self.followed, calls))

    def summary_chunks(self, chunk: int) -> int:
        """Chunks of the pieces it summarises (Mamba2's summaries pass)."""
        return chunks_of(self.summarized, chunk)


@lru_cache(maxsize=64)
def linear_work(
    seq_len: int, cp: int, balance: str, rows: tuple, conv: int, late: bool = False
) -> tuple[LinearWork, ...]:
    """Every rank's :class:`LinearWork` for ``rows`` (document lengths, one tuple a row) under ``balance``
    (a convolution of ``conv`` taps; ``late``: the gated delta rule's plan, with late middle pieces where they
    pay): what the ops' :func:`~titan_cp.attention.linear.plan.state_plan` and
    :func:`~titan_cp.attention.linear.plan.halo_plan` give each rank (``tests/test_linear_cost.py``), from
    the layout's pieces in one pass over the documents (the plans, rank by rank, grow as ``cp^2``)."""
    layout = get_layout(seq_len, cp, balance, [list(r) for r in rows])
    pieces = _pieces(layout, len(rows))
    docs: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for theirs in pieces.values():
        for piece in theirs:
            docs[(piece.row, piece.doc)].append(piece)
    calls = layout_calls(layout, pieces, len(rows), late)
    base = late_middles(pieces, calls)
    counts = {r: Counter() for r in range(cp)}  # type: ignore[var-annotated]
    reads: dict[int, set[int]] = defaultdict(set)
    for key, chain in docs.items():
        chain.sort(key=lambda piece: piece.index)
        _states(chain, base.get(key), counts, reads)
        _halos(chain, conv - 1, counts)
    return tuple(
        LinearWork(
            tuple(piece.length for piece in pieces[r]),
            tuple(piece.index > 0 for piece in pieces[r]),
            tuple(piece.index < piece.count - 1 for piece in pieces[r]),
            counts[r]["sent"],
            counts[r]["received"],
            counts[r]["halo_sent"],
            counts[r]["halo_received"],
            counts[r]["composed"],
            0 in reads[r],
            1 in reads[r],
            calls[r],
            counts[r]["sent2"],
            counts[r]["received2"],
            2 in reads[r],
            3 in reads[r],
        )
        for r in range(cp)
    )


def _states(chain: list[Piece], late: int | None, counts: dict[int, Counter], reads: dict[int, set[int]]) -> None:
    """One document's pieces (in order; ``late``: the index of its late middle piece, if any): each summary sent
    to the other ranks holding a piece that needs it, each rank receiving the others' summaries its pieces need
    (all before them; after the late middle, only those after it), the late middle's state sent to the other
    ranks holding pieces after it, and what composing each piece's state reads and keeps."""
    owners = [piece.rank for piece in chain]
    n = len(chain)

    def needed(p: int) -> range:  # the summaries piece p's chain reads
        return range(late + 1, p) if late is not None and p > late else range(p)

    for i, rank in enumerate(owners[:-1]):
        if i != late:
            users = range(i + 1, late + 1) if late is not None and i < late else range(i + 1, n)
            counts[rank]["sent"] += len({owners[p] for p in users} - {rank})
    for rank in set(owners):
        counts[rank]["received"] += len(
            {i for p in range(n) if owners[p] == rank for i in needed(p) if owners[i] != rank}
        )
    if late is not None:
        later = {owners[p] for p in range(late + 1, n)} - {owners[late]}
        counts[owners[late]]["sent2"] += len(later)
        for rank in later:
            counts[rank]["received2"] += 1
    top: dict[tuple[int, bool], int] = {}  # a rank's chains of one kind share their prefixes: the longest counts
    for p, piece in enumerate(chain):
        start = late if late is not None and p > late else None  # the chain: the late middle's state, then the
        length = p if start is None else p - start  # summaries after it
        top[(piece.rank, start is not None)] = max(top.get((piece.rank, start is not None), 0), length)
        if length >= 2:  # M s + B keeps M and s (the first link's s is a view of its row)
            reads[piece.rank] |= {int(owners[i] != piece.rank) for i in needed(p)}
            if start is not None:
                reads[piece.rank].add(2 if owners[start] == piece.rank else 3)
    for (rank, _), length in top.items():  # each prefix a longer one extends (M s + B keeps s)
        counts[rank]["composed"] += max(0, length - 2)


def _halos(chain: list[Piece], h: int, counts: dict[int, Counter]) -> None:
    """One document's convolution halos: the ``h`` positions before each piece (in its document), each rank
    receiving those other ranks hold once, and sending those it holds to each rank that wants them."""
    wanted: dict[int, set[int]] = defaultdict(set)
    for piece in chain[1:]:
        wanted[piece.rank].update(range(max(piece.doc_start, piece.start - h), piece.start))
    starts = [piece.start for piece in chain]
    for rank, positions in wanted.items():
        for x in positions:
            owner = chain[bisect.bisect_right(starts, x) - 1].rank
            if owner != rank:
                counts[rank]["halo_received"] += 1
                counts[owner]["halo_sent"] += 1


def exchange_bytes(shapes: LinearShapes, work: LinearWork, act_bytes: int, recompute: bool) -> tuple[int, int]:
    """``(summaries, halos)``: bytes one rank hands to the exchange in one forward + backward of one layer,
    as :func:`~titan_cp.attention.comm.count_comm` counts them: the summaries (fp32) sent forward, the
    gradients of those received sent back, and with ``recompute`` (the ops' custom backward: Mamba2, the
    torch kernel, a compiled graph) the forward's sends again; the halo rows (``act_bytes`` a channel) alike,
    the convolution's op always recomputing."""
    summaries = (work.sent * (1 + recompute) + work.received) * shapes.summary_bytes
    summaries += (work.sent2 * (1 + recompute) + work.received2) * shapes.state_bytes  # the late middles' states
    halos = (2 * work.halo_sent + work.halo_received) * shapes.conv_channels * act_bytes
    return summaries, halos


def forward_exchange_bytes(shapes: LinearShapes, work: LinearWork, act_bytes: int) -> int:
    """Bytes one rank sends in one forward of one layer (what a checkpointed forward sends again)."""
    return (
        work.sent * shapes.summary_bytes
        + work.sent2 * shapes.state_bytes
        + work.halo_sent * shapes.conv_channels * act_bytes
    )


# ---------------------------------------------------------------------------- memory
def saved_per_token(shapes: LinearShapes, dim: int, act_bytes: int) -> float:
    """Bytes a linear layer's mixer saves per local token (module docstring), its norms and feed-forward aside:
    the projections' input (``a D``), the gate ``z``, the kernel's output and ``out_proj``'s input (``a
    value_dim`` each), the gated norm's rstd and the gates (fp32, three a value head), and the ops' own
    (:func:`ops_saved_per_token`)."""
    a = act_bytes
    return a * dim + 3 * a * shapes.value_dim + 3 * FP32 * shapes.v_heads + ops_saved_per_token(shapes, a)


def ops_saved_per_token(shapes: LinearShapes, act_bytes: int) -> int:
    """What the linear ops save per token: the convolution's input (its custom op keeps its inputs); Gated
    DeltaNet's ``fla`` outputs call (:func:`_fla_saved_per_token`); Mamba2's op its inputs ``x, dt, B, C``."""
    a, h = act_bytes, shapes.v_heads
    conv = a * shapes.conv_channels
    if shapes.gated_delta:
        return conv + _fla_saved_per_token(shapes, a, shapes.d_v)
    return conv + a * (shapes.value_dim + h + 2 * shapes.k_heads * shapes.d_k)


def _fla_saved_per_token(shapes: LinearShapes, a: int, width: int) -> int:
    """What one ``fla`` call saves per token: q, k (normalised) and their rstd, v (``width``), g (fp32),
    beta, A (``C`` a value head)."""
    h, hk, k = shapes.v_heads, shapes.k_heads, shapes.d_k
    return 2 * a * hk * k + 2 * FP32 * hk + a * h * width + FP32 * h + a * h + a * h * shapes.chunk


def widened_saved_bytes(shapes: LinearShapes, work: LinearWork, act_bytes: int) -> int:
    """Bytes Gated DeltaNet's ``fla`` path saves under CP in proportion to tokens beyond
    :func:`ops_saved_per_token` (module docstring). ``fla`` keeps each call's ``v`` and ``beta`` as given: a call
    whose pieces are one span of the buffer is given views, which keep the layer's whole input (as one call
    over every piece does); another, copies of its tokens (:meth:`~titan_cp.attention.linear.plan.StatePlan.grouped`).
    So: the wide call's ``v``, widened to ``d_v + d_k`` columns, and its outputs ``[o | r]`` (the correction's
    product keeps ``r``, a view of them); each gathered call's ``v`` (a narrow one's) and ``beta``; less the
    whole ``v`` (``beta``) where no narrow call (no call) keeps a view of it. 0 for Mamba2, whose op saves only
    its inputs."""
    if not shapes.gated_delta:
        return 0
    h, a, dv, dk = shapes.v_heads, act_bytes, shapes.d_v, shapes.d_k
    groups = [(call, sum(n), span) for call, (n, span) in enumerate(work.groups()) if sum(n)]
    tokens = sum(work.lengths)
    v_kept = max((tokens * h * a * dv for call, _, span in groups if span and call != 1), default=0)
    v_kept += sum(n * h * a * dv for call, n, span in groups if not span and call != 1)
    beta_kept = max((tokens * h * a for _, _, span in groups if span), default=0)
    beta_kept += sum(n * h * a for _, n, span in groups if not span)
    wide = sum(work.wide_lengths) * h * a * (dv + dk)
    return v_kept + beta_kept - tokens * h * a * (dv + 1) + 2 * wide


def state_bytes(shapes: LinearShapes, work: LinearWork, act_bytes: int) -> int:
    """Bytes of states a layer keeps for its backward on a rank, through ``fla``'s autograd (Gated DeltaNet; 0
    for Mamba2, whose op keeps only its inputs): each call's initial states where it is given any (a wide
    piece's ``[0 | I]`` start, a summary's size; in the call after the exchange, a last piece's composed state
    and a zero state for each document placed there beside one; a call whose pieces all start from zero is
    given none); the summaries' and the late middles' states' indices (int64 a row); each state a longer one extends (``M s + B`` keeps
    ``s``); the summary buffers a chain of two links or more reads (``M s + B`` keeps ``M``, and the first
    link's ``s`` is a view of its summary: this rank's and the received ones, each kept whole); and each wide
    piece's state, copied to the activations' dtype for its correction."""
    if not shapes.gated_delta:
        return 0
    wide = len(work.wide_lengths)
    after = len(work.after_lengths) if any(later and c == 2 for later, c in zip(work.later, work.calls)) else 0
    starts = after * shapes.state_bytes + wide * shapes.summary_bytes
    read = (work.reads_sent * len(work.summarized) + work.reads_received * work.received) * shapes.summary_bytes
    read += (work.reads_own2 * work.late_middles + work.reads_received2 * work.received2) * shapes.state_bytes
    corrections = wide * shapes.state_bytes * act_bytes // FP32  # each wide piece's state, in act's dtype
    indices = 8 * (len(work.summarized) + work.late_middles)  # the summaries' and the late states' (int64)
    return starts + indices + work.composed * shapes.state_bytes + read + corrections


def work_extra_bytes(shapes: LinearShapes, work: LinearWork, act_bytes: int) -> int:
    """What one layer keeps on a rank beyond its per-token figure: the wide tokens' wider copies and the states."""
    return widened_saved_bytes(shapes, work, act_bytes) + state_bytes(shapes, work, act_bytes)


def work_saved_bytes(shapes: LinearShapes, work: LinearWork, dim: int, act_bytes: int) -> int:
    """A rank's whole saved bytes of one linear layer's mixer of ``work``'s microbatch."""
    per = saved_per_token(shapes, dim, act_bytes) * sum(work.lengths)
    return int(per) + work_extra_bytes(shapes, work, act_bytes)


def heaviest(shapes: LinearShapes, works: tuple[LinearWork, ...], act_bytes: int) -> LinearWork:
    """The rank's work that keeps the most (every rank holds as many tokens)."""
    return max(works, key=lambda w: work_extra_bytes(shapes, w, act_bytes))


# ---------------------------------------------------------------------------- time
@dataclass(frozen=True)
class LinearTime:
    """Seconds of one linear layer of one microbatch on one rank, by part (forward passes counted once).

    own_forward, own_backward: the kernel over the rank's pieces as they would run without CP; elementwise:
    the convolution and the gated norm (:func:`elementwise_bytes_per_token`); cp_forward, cp_backward: the
    kernel work CP adds (:func:`cp_flops`); exchange: the summaries and halos at the link's bandwidth
    (exposed: each last piece's call and each wide piece's correction wait for the states composed from what
    arrives)."""

    own_forward: float
    own_backward: float
    elementwise: float
    cp_forward: float
    cp_backward: float
    exchange: float

    def total(self, forward_passes: float = 1.0) -> float:
        forward = self.own_forward + self.cp_forward
        return forward_passes * forward + self.own_backward + self.cp_backward + self.elementwise + self.exchange

    @property
    def overhead(self) -> float:
        """What CP adds: its kernel work and the exchange."""
        return self.cp_forward + self.cp_backward + self.exchange


def linear_time(shapes: LinearShapes, work: LinearWork, dev: Device, link: str, act_bytes: int) -> LinearTime:
    """:class:`LinearTime` of ``work`` on ``dev``, the exchange on ``link`` (``fla``'s eager autograd for Gated
    DeltaNet on a GPU: its backward sends only the gradients back)."""
    rate = kernel_rate(shapes, dev)
    own = call_flops(shapes, work.chunks(shapes.chunk), shapes.d_v)
    added = cp_flops(shapes, work)
    recompute = not shapes.gated_delta or dev.name == "cpu"
    nbytes = sum(exchange_bytes(shapes, work, act_bytes, recompute))
    elementwise = elementwise_bytes_per_token(shapes, act_bytes) * sum(work.lengths) / dev.hbm_bandwidth
    return LinearTime(
        own[0] / rate, own[1] / rate, elementwise, added[0] / rate, added[1] / rate, dev.seconds(nbytes, link)
    )
