"""A counting model of GPU time for one attention layer, from what the engine does on fake CUDA tensors.

:func:`benchmarks.fake_cuda.simulate` runs every rank's forward + backward of one layer at full
size with no arithmetic and counts, per rank: the kernel's segments, the operations outside the
kernel with the HBM bytes they read and write (an index operation by the rows it touches), and the
bytes sent. This module turns the counts into seconds on a device (:data:`titan_cp.plan.GPUS`, the
planner's constants with their sources)::

    kernel     sum over segments of FLOPs / rate       FLOPs: 4 E H P forward, 10 E H P backward
                                                      (P the pairs the kernel computes: its 128 x 128
                                                      blocks touched, so short segments cost whole blocks)
    outside    bytes / HBM bandwidth                   (and with launches: + 2 us per operation, the
                                                      smallest kernel a GPU runs)
    comm       bytes sent / NVLink bandwidth           (reported; the ring overlaps it with the steps)

``rate``: either the kernel's measured throughput per segment length (FlashAttention-2 on H100,
the planner's :data:`~titan_cp.plan.kernels.FA2_H100`: ATen's CUDA flash kernel is that code), or a
flat ``fraction`` of the device's peak (``0.6``: FlashAttention-3's forward + backward on H100 at
head dim 128 and long sequences, arXiv:2407.08608, a faster kernel than ATen ships). The prediction
is the engine's efficiency against one variable-length kernel call over the whole row on one
device, as the self-check's simulated ring measures it (:func:`check_model`, section ``model`` of
``scripts/gpu_check.py``)::

    efficiency = kernel(one call, whole row) / sum over ranks of (kernel_r + outside_r)

``efficiency`` counts the bytes only (the issue that asked for this model counted them so);
``efficiency_with_launches`` adds the per-operation floor: an upper and a lower estimate.

``outside_gb_by_kind`` splits the outside bytes of the rank moving most by what they are for
(:func:`traffic_kind`, from where in :mod:`titan_cp.attention` each operation was issued)::

    layout        the model's tensors to and from the engine's token-major buffers, heads exchanged
    repack        q/k/v/out/dout/lse rows gathered for a kernel call, packed results concatenated
    result        single-segment rows written into the result (input dtype)
    merge         the forward's merges: each group of steps' partials merged at once (log-sum-exp) into
                  the result or fp32 slots
    grad_acc      gradients summed per group of steps into the result, fp32 slots or the buffers
                  sent home
    buffers       K/V stacked, taken and copied for sending; receive and gradient-return buffers
    sinks         attention sinks folded in
    padding       a value head dim of its own (multi-head latent attention) zero-padded to q's for the
                  flash kernel, which takes one head dim: v in every call, out and dout in the backward's

A value head dim of its own (``v_head_dim``) also makes the kernel run ``P V`` and ``dV`` at the padded
width: its FLOPs are counted at q's head dim (the larger).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from benchmarks.fake_cuda import simulate
from titan_cp.attention import fold
from titan_cp.attention.kernels import check_kernel
from titan_cp.attention.kernels.base import kernel_head_dim
from titan_cp.attention.strategy import get_strategy
from titan_cp.attention.tiling import Mask, kernel_mask, tile_mask, token_major
from titan_cp.data.row_mixes import lognormal_doc_lens
from titan_cp.layout import SequenceLayout, get_layout
from titan_cp.plan.devices import GPUS
from titan_cp.plan.kernels import BWD_FLOPS_PER_PAIR_DIM, FWD_FLOPS_PER_PAIR_DIM
from titan_cp.selfcheck import Sizes, one_case, simulated_ring, timed

BLOCK = 128  # the flash kernel's tile of queries and keys
OP_FLOOR_S = 2e-6  # the smallest operation a GPU runs


def block_pairs(n: int, m: int, causal: bool, window: int | None = None) -> int:
    """Pairs the kernel computes for ``n`` queries on ``m`` keys: the 128 x 128 blocks it visits, whole.
    With ``window`` (causal, bottom-right aligned, each row its last ``window`` keys) the blocks from
    each query block's first visible key to its last."""
    bq, bk = math.ceil(n / BLOCK), math.ceil(m / BLOCK)
    if window is None:
        blocks = bq * (bq + 1) // 2 if causal else bq * bk  # causal segments are square
        return blocks * BLOCK * BLOCK
    off, blocks = m - n, 0
    for i in range(bq):
        lo = max(0, i * BLOCK + off - window + 1)
        hi = min(m - 1, min(n, (i + 1) * BLOCK) - 1 + off)
        blocks += hi // BLOCK - lo // BLOCK + 1 if hi >= lo else 0
    return blocks * BLOCK * BLOCK


def kernel_seconds(segments, head_dim: int, device: str = "h200", fraction: float | None = None) -> float:
    """Seconds of the kernel calls ``segments`` (``(op, causal, host_q, host_k, window, heads)``, as the meter
    records them: each call says the heads it runs)."""
    dev = GPUS[device]
    total = 0.0
    for op, causal, host_q, host_k, window, heads in segments:
        flops_per_pair = (FWD_FLOPS_PER_PAIR_DIM if op == "forward" else BWD_FLOPS_PER_PAIR_DIM) * heads * head_dim
        for (a, b), (c, d) in zip(zip(host_q, host_q[1:]), zip(host_k, host_k[1:])):
            n, m = b - a, d - c
            if not n:
                continue
            rate = dev.peak_flops * fraction if fraction else dev.attention.rate(m, causal, op == "backward")
            total += flops_per_pair * block_pairs(n, m, causal, window) / rate
    return total


def one_call_segments(seq_len: int, doc_lens, mask: Mask, heads: int) -> list:
    """The segments of one variable-length call over the whole row on one device, forward and backward
    (a window taken by the kernel, as ATen's flash kernel takes it)."""
    layout = get_layout(seq_len, 1, "contiguous", doc_lens)
    rows = 1 if doc_lens is None else len(doc_lens)
    calls = tile_mask(layout, None, None, replace(mask, native_window=mask.window is not None)).host_calls(rows)
    return [(op, c.causal, c.host_q, c.host_k, c.window, heads) for op in ("forward", "backward") for c in calls]


_KINDS = {
    "tiling.token_major": "layout", "tiling.head_major": "layout", "ulysses": "layout", "hybrid": "layout",
    "layout": "layout", "allgather.AllGather.forward": "buffers", "allgather.AllGather.backward": "buffers",
    "allgather.key_buffer": "buffers",
    "tiling.Rows.take": "repack", "fold.attend": "repack", "fold.attend_backward": "repack",
    "fold.Results.__init__": "merge", "fold.Results.finish": "merge", "merge": "merge", "fused.merge_into": "merge",
    "fold.Grads": "grad_acc", "ring._add_home": "grad_acc", "ring.ring_backward": "grad_acc",
    "ring.received_grads": "grad_acc",
    "ring._post_kv": "buffers", "ring.ring_forward": "buffers", "comm": "buffers", "ring._KV": "buffers",
    "tiling.Rows.take_into": "buffers", "base.common_head_dim": "padding", "base.unit_stride": "repack",
    "cuda_flash": "repack",
}  # fmt: skip


def traffic_kind(site: str, op: str) -> str:
    """The kind of an operation outside the kernel (module docstring) from its ``(site, op)``
    (:attr:`~benchmarks.fake_cuda.RankTrace.sites`): the longest matching site prefix decides."""
    if site == "fold.Results.fold":
        return {"index_copy": "result"}.get(op, "merge")
    if site == "fold.Grads.add" and op == "index_copy":
        return "result"
    if site.startswith("ring.ring_backward") and op in ("stack", "clone"):
        return "buffers"
    if site.startswith(("merge.apply_sinks_", "merge.sinks_grad")) or op == "logaddexp":
        return "sinks"
    best = max((k for k in _KINDS if site.startswith(k)), key=len, default=None)
    return _KINDS[best] if best else "other"


def by_kind(sites: dict) -> dict[str, float]:
    """GB per :func:`traffic_kind` of a trace's ``sites``, largest first."""
    out: dict[str, int] = {}
    for (site, op), (_, nbytes) in sites.items():
        kind = traffic_kind(site, op)
        out[kind] = out.get(kind, 0) + nbytes
    return {k: round(v / 1e9, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def predict(
    strategy: str,
    seq_len: int,
    cp: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    doc_lens=None,
    balance: str = "doc_zigzag",
    ulysses_degree: int = 1,
    window: int | None = None,
    chunk: int | None = None,
    device: str = "h200",
    fraction: float | None = None,
    v_head_dim: int | None = None,
) -> dict:
    """One JSON-ready record: per-rank counts and seconds, and the predicted efficiency (module docstring);
    ``v_head_dim``: v's own (``None``: ``head_dim``), the kernel running at the larger of the two."""
    dev = GPUS[device]
    traces = simulate(
        strategy,
        seq_len,
        cp,
        heads,
        kv_heads,
        head_dim,
        doc_lens,
        balance,
        ulysses_degree,
        window=window,
        chunk=chunk,
        v_head_dim=v_head_dim,
    )
    head_dim = kernel_head_dim(head_dim, v_head_dim or head_dim)  # the padded width the kernel computes at
    kernel = [kernel_seconds(t.segments, head_dim, device, fraction) for t in traces]
    outside = [t.outside_bytes / dev.hbm_bandwidth for t in traces]
    launches = [t.outside_ops * OP_FLOOR_S for t in traces]
    one = kernel_seconds(
        one_call_segments(seq_len, doc_lens, Mask(True, window, chunk), heads), head_dim, device, fraction
    )
    return {
        "strategy": strategy,
        "balance": balance,
        "seq_len": seq_len,
        "cp": cp,
        "documents": None if doc_lens is None else sum(len(r) for r in doc_lens),
        "window": window,
        "kernel": "flat" if fraction else dev.attention.name,
        "kernel_fraction": fraction,
        "one_call_ms": round(1e3 * one, 3),
        "kernel_ms_all_ranks": round(1e3 * sum(kernel), 3),
        "outside_gb_per_rank_max": round(max(t.outside_bytes for t in traces) / 1e9, 3),
        "outside_gb_by_kind": by_kind(max(traces, key=lambda t: t.outside_bytes).sites),
        "outside_ms_all_ranks": round(1e3 * sum(outside), 3),
        "outside_ops_per_rank_max": max(t.outside_ops for t in traces),
        "comm_gb_per_rank_max": round(max(t.bytes_sent for t in traces) / 1e9, 3),
        "comm_ms_per_rank_max": round(1e3 * max(t.bytes_sent for t in traces) / dev.intra_bw, 3),
        "efficiency": round(one / (sum(kernel) + sum(outside)), 4),
        "efficiency_with_launches": round(one / (sum(kernel) + sum(outside) + sum(launches)), 4),
        "straggler_efficiency": round(one / (cp * max(a + b for a, b in zip(kernel, outside))), 4),
    }


@dataclass(frozen=True)
class ModelRow:
    """One row of the model's table: a mix of documents (``None``: one causal document), its layout, a
    window, the strategies it is counted for and the efficiency bar each must reach."""

    name: str
    doc_lens: tuple[tuple[int, ...], ...] | None
    balance: str
    window: int | None
    strategies: tuple[str, ...]
    bar: float


def model_rows(seq_len: int = 131072, seed: int = 0) -> list[ModelRow]:
    """The rows with efficiency bars (``tests/test_gpu_model.py``), drawn with ``seed`` (log-normal lengths, :func:`lognormal_doc_lens`):
    one causal document; documents of mean 1K (sigma 1), 256 (sigma 1), and heavy-tailed mixes of
    mean 4K and 16K (sigma 1.5) under ``doc_local``; sliding windows of 1,024 and 4,096 on one document
    and 1,024 over mean-1K documents."""

    def docs(mean: int, sigma: float) -> tuple[tuple[int, ...], ...]:
        return (tuple(lognormal_doc_lens(seq_len, mean, seed=seed, sigma=sigma)),)

    every = ("ring", "allgather", "ulysses", "hybrid")
    return [
        ModelRow("causal", None, "zigzag", None, ("ring", "allgather"), 0.97),
        ModelRow("docs_1k", docs(1024, 1.0), "doc_local", None, every, 0.92),
        ModelRow("docs_256", docs(256, 1.0), "doc_local", None, ("ring",), 0.92),
        ModelRow("long_tail_4k", docs(4096, 1.5), "doc_local", None, ("ring", "allgather"), 0.85),
        ModelRow("long_docs_16k", docs(16384, 1.5), "doc_local", None, ("ring",), 0.85),
        ModelRow("window_1024", None, "zigzag", 1024, ("ring",), 0.85),
        ModelRow("window_4096", None, "zigzag", 4096, ("ring",), 0.90),
        ModelRow("window_1024_docs_1k", docs(1024, 1.0), "doc_local", 1024, ("ring",), 0.85),
    ]


def predict_row(
    row: ModelRow,
    strategy: str,
    seq_len: int = 131072,
    cp: int = 8,
    fraction: float | None = 0.6,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
) -> dict:
    """:func:`predict` of one :class:`ModelRow` (``seq_len`` its rows' length), by default with Llama 3 8B
    heads, hybrid on a Ulysses degree of 2; the record names the row and carries its bar."""
    docs = None if row.doc_lens is None else [list(r) for r in row.doc_lens]
    ulysses = 2 if get_strategy(strategy).takes_ulysses_degree() else 1
    shape = (seq_len, cp, heads, kv_heads, head_dim, docs, row.balance, ulysses)
    rec = predict(strategy, *shape, window=row.window, fraction=fraction)
    return {"mix": row.name, "bar": row.bar, **rec}


def model_records(seq_len: int = 131072, cp: int = 8, seed: int = 7):
    """The records ``bench_attention.py --cases model`` prints (``docs/model.jsonl``): ring and all-gather
    on causal rows (zigzag), log-normal documents of mean 1K and 4K (seed = mean) under ``doc_local`` and
    ``doc_zigzag`` and a 1,024 window; then every :func:`model_rows` row (drawn with ``seed``) for each of
    its strategies. Each with FlashAttention-2's rates and at a flat 60% of peak."""
    docs = {mean: [lognormal_doc_lens(seq_len, mean, seed=mean)] for mean in (1024, 4096)}
    cases = [("causal", "zigzag", None, None)]
    cases += [(f"docs_{m}", b, docs[m], None) for m in (1024, 4096) for b in ("doc_local", "doc_zigzag")]
    cases += [("window_1024", "zigzag", None, 1024)]
    for strategy in ("ring", "allgather"):
        for name, balance, rows, window in cases:
            for fraction in (None, 0.6):
                rec = predict(strategy, seq_len, cp, 32, 8, 128, rows, balance, window=window, fraction=fraction)
                yield {"mix": name, **rec}
    for row in model_rows(seq_len, seed):
        for strategy in row.strategies:
            for fraction in (None, 0.6):
                yield {"rows": f"issue28_seed{seed}", **predict_row(row, strategy, seq_len, cp, fraction)}


# ---------------------------------------------------------------------------- the self-check's section model
def _single_device(q, k, v, dout, doc_lens, kernel, scale: float, window):
    """The whole row on one device through the engine's one-rank route (one variable-length call per
    causal flag): what :func:`one_call_segments` counts. Forward + backward."""
    layout = SequenceLayout(q.shape[2], 1, "contiguous", None if doc_lens is None else [list(doc_lens)])
    tiles = tile_mask(layout, None, None, kernel_mask(Mask(True, window), kernel))
    qt, kt, vt, dt = (token_major(x) for x in (q, k, v, dout))
    out, lse = fold.tiles_forward(qt, kt, vt, 1, tiles, kernel, scale)
    return fold.tiles_backward(dt, qt, kt, vt, out, lse, 1, tiles, kernel, scale)


def check_model(device: torch.device, sizes: Sizes, kernel_name: str | None = None, dtype=torch.bfloat16) -> list[dict]:
    """The self-check's section ``model`` (``scripts/gpu_check.py`` adds it): each row of :func:`model_rows` (one causal document,
    document mixes, sliding windows) at ``sizes.model_seq`` tokens on ``sizes.cp`` ranks: the simulated
    ring's forward + backward timed against the whole row on one device, beside the counting model's
    prediction for the same shapes (FlashAttention-2's rates and a flat 60% of peak)."""
    s, n = sizes.model_seq, sizes.cp
    h, kh, e = sizes.ring_heads, sizes.ring_kv_heads, sizes.ring_head_dim
    kern = check_kernel(kernel_name, device, dtype, e)
    scale, g = 1 / math.sqrt(e), torch.Generator().manual_seed(2)
    q, dout = (torch.randn(1, s, h, e, generator=g).to(device, dtype).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(1, s, kh, e, generator=g).to(device, dtype).transpose(1, 2) for _ in range(2))
    records = []
    for row in (r for r in model_rows(s, sizes.model_seed) if r.name in sizes.model_cases or not sizes.model_cases):
        rec = dict(section="model", case=row.name, kernel=kern.name, seq=s, cp=n, balance=row.balance)
        rec.update(window=row.window, documents=None if row.doc_lens is None else len(row.doc_lens[0]))
        with one_case(records, rec, device):
            docs = None if row.doc_lens is None else row.doc_lens[0]
            layout = SequenceLayout(s, n, row.balance, None if docs is None else [list(docs)])
            w = row.window
            ring = functools.partial(simulated_ring, q, k, v, layout, kern, True, scale, dout, w)
            t_ring = timed(ring, device, sizes.repeats)
            t_one = timed(functools.partial(_single_device, q, k, v, dout, docs, kern, scale, w), device, sizes.repeats)
            shape = dict(seq_len=s, cp=n, heads=h, kv_heads=kh, head_dim=e)
            predicted = {
                name: predict_row(row, "ring", fraction=fraction, **shape)["efficiency"]
                for name, fraction in (("fa2_rates", None), ("flat_60", 0.6))
            }
            rec.update(
                seconds={"one_device": t_one["min"], "ring": t_ring["min"]},
                measured_efficiency=t_one["min"] / t_ring["min"],
                predicted_efficiency=predicted,
                status="ok",
            )
    return records
