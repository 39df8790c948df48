"""One-GPU self-check: every CUDA kernel against fp64, a simulated ring against one native
call, and a short training run. The command line is ``python -m titan_cp.selfcheck``::

    python -m titan_cp.selfcheck                         # one CUDA device, < 4 minutes on an H200
    python -m titan_cp.selfcheck --device cpu --small    # the same logic on CPU at toy sizes
    python -m titan_cp.selfcheck --sections longest      # the longest row the GPU trains (8B's width, 4 blocks)

Each result is one JSON-serialisable dict (one output line); :func:`run` ends with a summary.

Sections
--------
``kernels``  every kernel that runs on the device (CUDA: ``cuda_flash``, ``flash_attn`` where
             installed, ``math``), forward and backward, dense ``(B, H, S, E)`` and packed
             variable-length, GQA, causal and not, against an fp64 reference. A kernel passes
             when each of ``out, dq, dk, dv`` is at most ``3 x`` as far from the fp64
             reference as bf16 SDPA on the same inputs is, plus ``1e-3 x max|reference|``
             (flash-attention's own test bar, with room for the backward's atomics); the lse
             must agree to ``2e-3``. The bf16 SDPA baseline runs segment by segment without a
             mask, so it takes the device's fused kernel (flash on CUDA), not the math path.
``ring``     :func:`simulated_ring`: every rank's ring steps run one after another in this
             process, on the package's engine, timed against one native call on the whole
             sequence (dense causal flash; one variable-length call over packed documents).
             ``efficiency = t(one call) / t(simulated ring summed over ranks)``: 1.0 means
             splitting the work over the ring steps costs nothing; the bars are 0.90 (causal)
             and 0.85 (documents of mean length 1K) for forward + backward.
``linear``   :mod:`titan_cp.selfcheck.linear`: the gated delta rule of hybrid models (Qwen3.5), one
             document cut into pieces and run as the CP op runs them (summaries, composed states),
             through flash-linear-attention where installed, against the fp64 torch kernel over the
             whole document, forward and backward; its time against one call over the document.
``train``    the trainer on the debug model, bf16, one process, a few dozen steps, with
             tokens/s and MFU from its ``metrics.jsonl``.
``longest``  (when named) :mod:`titan_cp.selfcheck.longest`: the longest row one device trains.

A checkout adds sections of its own through ``extra_sections`` (``scripts/gpu_check.py`` adds
``model``: the counting model of ``benchmarks/gpu_model.py`` beside the measured ring).

Timing: CUDA events around each measured call after a warm-up call (the warm-up also
builds the layout's plans, as the first layer of a microbatch does); the fastest of
``repeats`` runs and the median are reported.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from titan_cp.attention.kernels import (
    AttentionKernel,
    Segments,
    check_kernel,
    flash_attn_available,
    flash_attn_problem,
)
from titan_cp.data.row_mixes import lognormal_doc_lens

if TYPE_CHECKING:
    from titan_cp.layout import SequenceLayout

SECTIONS = ("kernels", "ring", "linear", "train")  # run by default
OPTIONAL_SECTIONS = ("longest",)  # run when named (selfcheck.longest: the longest row one device trains)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding this titan_cp: the train section runs it
# A section: (device, sizes, the ring's kernel name or None) -> its records.
Section = Callable[[torch.device, "Sizes", "str | None"], list[dict]]


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one run."""

    # kernels: B rows of S tokens for the dense cases; documents of one packed row for varlen
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    doc_lens: tuple[int, ...]
    # ring: one row of ring_seq tokens, Llama-3-8B heads by default
    ring_seq: int
    ring_heads: int
    ring_kv_heads: int
    ring_head_dim: int
    cp: int
    doc_means: tuple[int, ...]
    repeats: int
    # model (a checkout's extra section, benchmarks/gpu_model.py): its rows at model_seq tokens
    model_seq: int
    model_seed: int
    model_cases: tuple[str, ...]  # names of the rows to run (empty: all)
    # train
    train_steps: int
    train_args: tuple[str, ...]


FULL = Sizes(
    batch=2,
    seq=1024,
    heads=8,
    kv_heads=2,
    head_dim=128,
    doc_lens=(300, 1, 77, 500, 146),
    ring_seq=131072,
    ring_heads=32,
    ring_kv_heads=8,
    ring_head_dim=128,
    cp=8,
    doc_means=(1024, 4096),
    repeats=3,
    model_seq=32768,
    model_seed=7,
    model_cases=(),
    train_steps=30,
    train_args=(),
)
SMALL = Sizes(
    batch=2,
    seq=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    doc_lens=(20, 1, 7, 36),
    ring_seq=256,
    ring_heads=4,
    ring_kv_heads=2,
    ring_head_dim=16,
    cp=4,
    doc_means=(32,),
    repeats=1,
    model_seq=512,
    model_seed=7,
    model_cases=("window_1024_docs_1k",),
    train_steps=3,
    train_args=(
        "--model.flavor",
        "tiny",
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "2",
        "--lr_scheduler.warmup_steps",
        "1",
    ),
)

# The train section's job: train_configs/debug_cp.toml's model, optimizer and data at CP 1 in bf16, spelled
# here so that the check needs no file beside the installed package.
TRAIN_KEYS = {
    "model.name": "llama3",
    "model.flavor": "debugmodel_gqa",
    "optimizer.lr": 8e-4,
    "lr_scheduler.warmup_steps": 5,
    "lr_scheduler.decay_ratio": 0.8,
    "lr_scheduler.min_lr_factor": 0.1,
    "training.dataset": "synthetic_recall",
    "training.local_batch_size": 1,
    "training.global_batch_size": 2,
    "training.seq_len": 8192,
    "training.max_norm": 1.0,
    "training.seed": 0,
    "training.deterministic": "false",
    "training.mixed_precision_param": "bfloat16",
    "parallelism.context_parallel_degree": 1,
    "parallelism.data_parallel_shard_degree": 1,
    "activation_checkpoint.mode": "none",
    "validation.enable": "false",
    "checkpoint.enable": "false",
    "metrics.log_freq": 1,
}

RING_BARS = {"causal": 0.90, "docs_1024": 0.85}  # forward + backward efficiency at FULL sizes


# ---------------------------------------------------------------------------- helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> dict:
    """Seconds per call of ``fn``: ``{"min": ..., "median": ...}`` over ``repeats`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return {"min": min(times), "median": statistics.median(times)}


def _cum(lens) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------- section: kernels
def _visible(q_lens, k_lens, causal: bool, device) -> torch.Tensor:
    """``(total_q, total_k)`` bool: segment ``i``'s queries see segment ``i``'s keys (top-left causal)."""

    def ids_and_pos(lens):
        lens_t = torch.tensor(lens, device=device)
        ids = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t)
        starts = torch.tensor(_cum(lens)[:-1], device=device)
        return ids, torch.arange(int(lens_t.sum()), device=device) - starts[ids]

    qi, qp = ids_and_pos(q_lens)
    ki, kp = ids_and_pos(k_lens)
    vis = qi[:, None] == ki[None, :]
    if causal:
        vis &= kp[None, :] <= qp[:, None]
    return vis


def _masked_attention(q, k, v, dout, visible, scale):
    """Attention of packed ``q (Nq, H, E)`` on ``k, v (Nk, K, E)`` under ``visible (Nq, Nk)``,
    written out in the inputs' dtype (the fp64 reference): ``(out, lse (H, Nq), dq, dk, dv)``."""
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    qh = qs.transpose(0, 1)
    kh, vh = (x.transpose(0, 1).repeat_interleave(groups, 0) for x in (ks, vs))
    s = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = (torch.exp(s - lse[..., None]) @ vh).transpose(0, 1)
    grads = torch.autograd.grad(out, (qs, ks, vs), dout)
    return (out.detach(), lse.detach(), *grads)


def _segment_sdpa(q, k, v, dout, q_lens, k_lens, causal, scale):
    """PyTorch SDPA in the inputs' dtype, segment by segment (no mask, so the device's fused
    backend runs): the low-precision baseline. ``(out, None, dq, dk, dv)``, token-major."""
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    outs = []
    for (a, b), (c, d) in zip(zip(_cum(q_lens), _cum(q_lens)[1:]), zip(_cum(k_lens), _cum(k_lens)[1:])):
        seg = (x.transpose(0, 1)[None] for x in (qs[a:b], ks[c:d], vs[c:d]))
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(*seg, is_causal=causal, scale=scale, enable_gqa=True)[
                0
            ].transpose(0, 1)
        )
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, (qs, ks, vs), dout)
    return (out.detach(), None, *grads)


def _run_kernel(kern: AttentionKernel, api: str, q, k, v, dout, q_lens, k_lens, causal, scale):
    """The kernel on packed buffers, through its dense (``api == "dense"``, equal segments as
    batch rows, passed as the ``(B, H, S, E)`` transposed views the engine passes) or its
    variable-length interface. Returns token-major ``(out, lse (H, Nq), dq, dk, dv)``."""
    if api == "varlen":
        seg = Segments.from_lengths(q_lens, k_lens, q.device)
        out, lse = kern.varlen_forward(q, k, v, seg, causal, scale)
        return (out, lse, *kern.varlen_backward(dout, q, k, v, out, lse, seg, causal, scale))
    b = len(q_lens)

    def hm(x):
        return x.view(b, x.shape[0] // b, *x.shape[1:]).transpose(1, 2)

    def tm(x):
        return x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[3])

    out, lse = kern.forward(hm(q), hm(k), hm(v), causal, scale)
    grads = kern.backward(hm(dout), hm(q), hm(k), hm(v), out, lse, causal, scale)
    return (tm(out), lse.transpose(0, 1).reshape(lse.shape[1], -1), *(tm(g) for g in grads))


def kernel_cases(sizes: Sizes) -> list[dict]:
    """The (api, segment lengths, causal) cases every kernel is checked on."""
    s, b = sizes.seq, sizes.batch
    docs = list(sizes.doc_lens)
    other = docs[1:] + docs[:1]  # keys of other lengths for the non-causal segments
    return [
        dict(name="dense_causal", api="dense", q_lens=[s] * b, k_lens=[s] * b, causal=True),
        dict(name="dense_cross", api="dense", q_lens=[s] * b, k_lens=[s * 3 // 4] * b, causal=False),
        dict(name="varlen_documents_causal", api="varlen", q_lens=docs, k_lens=docs, causal=True),
        dict(name="varlen_segments", api="varlen", q_lens=docs, k_lens=[max(1, n) for n in other], causal=False),
        dict(name="varlen_single_query_segments", api="varlen", q_lens=[1] * 16, k_lens=docs[:4] * 4, causal=False),
    ]


def check_kernels(device: torch.device, sizes: Sizes, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Section ``kernels``: one record per (kernel, case)."""
    names = ["cuda_flash", "flash_attn", "math"] if device.type == "cuda" else ["cpu_varlen", "cpu_flash", "math"]
    if device.type == "cuda" and not flash_attn_available():
        names.remove("flash_attn")
    g = torch.Generator().manual_seed(0)
    h, kh, e = sizes.heads, sizes.kv_heads, sizes.head_dim
    scale = 1 / math.sqrt(e)
    records = []
    for case in kernel_cases(sizes):
        nq, nk = sum(case["q_lens"]), sum(case["k_lens"])
        q, dout = (torch.randn(nq, h, e, generator=g).to(device, dtype) for _ in range(2))
        k, v = (torch.randn(nk, kh, e, generator=g).to(device, dtype) for _ in range(2))
        vis = _visible(case["q_lens"], case["k_lens"], case["causal"], device)
        ref = _masked_attention(q.double(), k.double(), v.double(), dout.double(), vis, scale)
        base = _segment_sdpa(q, k, v, dout, case["q_lens"], case["k_lens"], case["causal"], scale)
        base_err = [_max_err(x, r) for x, r in zip(base[:1] + base[2:], ref[:1] + ref[2:])]
        for name in names:
            rec = dict(
                section="kernels",
                kernel=name,
                case=case["name"],
                api=case["api"],
                causal=case["causal"],
                dtype=str(dtype).replace("torch.", ""),
                heads=h,
                kv_heads=kh,
                head_dim=e,
            )
            try:
                kern = check_kernel(name, device, dtype, e)
                got = _run_kernel(
                    kern, case["api"], q, k, v, dout, case["q_lens"], case["k_lens"], case["causal"], scale
                )
                _sync(device)
                errs = {}
                ok = tuple(got[0].shape) == tuple(q.shape) and tuple(got[1].shape) == (h, nq)
                ok &= tuple(got[3].shape) == tuple(k.shape) and tuple(got[4].shape) == tuple(k.shape)
                for i, key in zip((0, 2, 3, 4), ("out", "dq", "dk", "dv")):
                    err = _max_err(got[i], ref[i])
                    bar = 3 * base_err[(0, 2, 3, 4).index(i)] + 1e-3 * ref[i].abs().max().item()
                    errs[key] = {"err": err, "sdpa_err": base_err[(0, 2, 3, 4).index(i)], "bar": bar}
                    ok &= err <= bar
                lse_err = _max_err(got[1], ref[1])
                errs["lse"] = {"err": lse_err, "bar": 2e-3}
                ok &= lse_err <= 2e-3
                rec.update(status="ok" if ok else "fail", errors=errs)
            except Exception as exc:  # noqa: BLE001 - a failing kernel is a result, not the end of the check
                rec.update(status="error", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc(limit=4))
            records.append(rec)
    return records


@contextlib.contextmanager
def one_case(records: list, rec: dict, device: torch.device) -> Iterator[dict]:
    """One case of a section: an exception in it is its result (``status = "error"`` with the trace),
    not the end of the check; ``rec`` is appended to ``records`` and the device's cache freed after."""
    try:
        yield rec
    except Exception as exc:  # noqa: BLE001 - a failing case is a result
        rec.update(status="error", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc(limit=6))
    finally:
        records.append(rec)
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- section: ring
def simulated_ring(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: SequenceLayout,
    kernel: AttentionKernel,
    causal: bool,
    scale: float,
    dout: Tensor | None = None,
    window: int | None = None,
) -> Tensor | tuple[Tensor, tuple[Tensor, ...]]:
    """Every rank's ring steps of one attention layer, run one after another in this process (nothing is
    communicated: the time is the sum over ranks of what each rank computes).

    q: ``(B, H, S, E)``; k, v: ``(B, K, S, E)``; dout like q; natural order. Rank ``r`` holds shard ``r``
    of ``layout``; at step ``i`` it folds in the rows it needs of rank ``(r - i) mod N``'s K/V with the
    engine's :func:`~titan_cp.attention.fold.fold_forward` (backward: those rows' gradients go home, as
    the ring sends them). ``window``: a sliding window. Returns ``out`` in natural order (and ``dq, dk, dv``).
    """
    from titan_cp.attention import fold  # noqa: PLC0415 - the engine
    from titan_cp.attention.ring import received_grads, ring_steps  # noqa: PLC0415
    from titan_cp.attention.tiling import Mask, head_major, kernel_mask, token_major  # noqa: PLC0415

    n, b = layout.cp_size, q.shape[0]
    mask = kernel_mask(Mask(causal, window), kernel)
    rings = [ring_steps(layout, r, n, lambda i: (i,), mask, b, q.device) for r in range(n)]

    def shards(x):
        return [token_major(layout.shard(x, 2, r)) for r in range(n)]

    def unshard(parts, dtype):
        return layout.unshard([head_major(p.to(dtype), b) for p in parts], dim=2)

    def received(kv, r, i):
        """What rank r holds at step i: the rows of its source's K/V it needs (None: nothing)."""
        if i == 0:
            return kv[r]
        sent = rings[(r - i) % n].steps[i]
        return None if sent.send is None else sent.send.take(kv[(r - i) % n], 1)

    qs = shards(q)
    kv = [torch.stack(pair) for pair in zip(shards(k), shards(v))]
    finished = []
    for r in range(n):
        results = fold.Results(qs[r], rings[r].folds)
        for i in range(n):
            buf = received(kv, r, i)
            if buf is not None:
                fold.fold_forward(qs[r], buf[0], buf[1], rings[r].steps[i].index, kernel, scale, results, i)
        finished.append(results.finish())
    outs, lses = [o for o, _ in finished], [lse for _, lse in finished]
    out = unshard(outs, q.dtype)
    if dout is None:
        return out
    dos = shards(dout)
    dq = [fold.Grads(qs[r], rings[r].folds) for r in range(n)]
    dkv = [[fold.Grads(kv[r][j], rings[r].keys) for j in (0, 1)] for r in range(n)]
    for r in range(n):  # every rank's own step first: a ring's steps are added in order
        dqs, dks, dvs = fold.attend_backward(
            dos[r], qs[r], kv[r][0], kv[r][1], outs[r], lses[r], rings[r].steps[0].index, kernel, scale
        )
        for acc, part in ((dq[r], dqs), (dkv[r][0], dks), (dkv[r][1], dvs)):
            acc.add(0, part)
    for i in range(1, n):
        for r in range(n):
            buf, step = received(kv, r, i), rings[r].steps[i]
            if buf is None:
                continue
            dqs, dks, dvs = fold.attend_backward(
                dos[r], qs[r], buf[0], buf[1], outs[r], lses[r], step.index, kernel, scale
            )
            dq[r].add(i, dqs)
            if step.grads is None:
                raise RuntimeError(f"ring step {i} of rank {r} received rows but has no plan for their gradients")
            grad = received_grads(buf, step.grads, dks, dvs, step.dtype("grad", buf[0]))  # home to the owner
            for j in (0, 1):
                dkv[(r - i) % n][j].add(i, [grad[j]])
    grads = [unshard([g.finish() for g in dq], q.dtype)]
    grads += [unshard([dkv[r][j].finish() for r in range(n)], x.dtype) for j, x in ((0, k), (1, v))]
    return out, tuple(grads)


def _one_call(kernel: AttentionKernel, q, k, v, dout, doc_lens, causal, scale):
    """One native call on the whole sequence: dense ``(1, H, S, E)``, or variable-length over the documents."""
    if doc_lens is None:
        out, lse = kernel.forward(q, k, v, causal, scale)
        return out if dout is None else kernel.backward(dout, q, k, v, out, lse, causal, scale)
    qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))
    seg = Segments.from_lengths(doc_lens, doc_lens, q.device)
    out, lse = kernel.varlen_forward(qt, kt, vt, seg, causal, scale)
    if dout is None:
        return out
    return kernel.varlen_backward(dout[0].transpose(0, 1), qt, kt, vt, out, lse, seg, causal, scale)


def ring_cases(sizes: Sizes) -> list[dict]:
    """Causal without documents (zigzag), and log-normal documents under the default ``doc_local`` and,
    for comparison, ``doc_zigzag`` (every document split over every rank)."""
    cases: list[dict[str, Any]] = [dict(name="causal", balance="zigzag", doc_lens=None, doc_mean=None)]
    for mean in sizes.doc_means:
        lens = lognormal_doc_lens(sizes.ring_seq, mean, seed=mean)
        cases.append(dict(name=f"docs_{mean}", balance="doc_local", doc_lens=lens, doc_mean=mean))
        cases.append(dict(name=f"docs_{mean}_doc_zigzag", balance="doc_zigzag", doc_lens=lens, doc_mean=mean))
    return cases


def check_ring(
    device: torch.device, sizes: Sizes, kernel_name: str | None = None, dtype: torch.dtype = torch.bfloat16
) -> list[dict]:
    """Section ``ring``: simulated ring against one native call, forward and forward + backward."""
    from titan_cp.layout import SequenceLayout  # noqa: PLC0415

    s, h, kh, e, n = sizes.ring_seq, sizes.ring_heads, sizes.ring_kv_heads, sizes.ring_head_dim, sizes.cp
    kern = check_kernel(kernel_name, device, dtype, e)
    scale = 1 / math.sqrt(e)
    g = torch.Generator().manual_seed(1)
    # (1, S, H, E) token-major storage viewed as (1, H, S, E), as the model produces it
    q, dout = (torch.randn(1, s, h, e, generator=g).to(device, dtype).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(1, s, kh, e, generator=g).to(device, dtype).transpose(1, 2) for _ in range(2))
    records: list[dict] = []
    for case in ring_cases(sizes):
        rec = dict(
            section="ring",
            case=case["name"],
            kernel=kern.name,
            seq=s,
            cp=n,
            heads=h,
            kv_heads=kh,
            head_dim=e,
            balance=case["balance"],
            dtype=str(dtype).replace("torch.", ""),
        )
        if case["doc_lens"] is not None:
            rec.update(doc_mean=case["doc_mean"], documents=len(case["doc_lens"]))
        with one_case(records, rec, device):
            doc_rows = None if case["doc_lens"] is None else [case["doc_lens"]]
            layout = SequenceLayout(s, n, case["balance"], doc_rows)
            lens = case["doc_lens"]

            def call_f(lens=lens):
                return _one_call(kern, q, k, v, None, lens, True, scale)

            def call_fb(lens=lens):
                return _one_call(kern, q, k, v, dout, lens, True, scale)

            def ring_f(layout=layout):
                return simulated_ring(q, k, v, layout, kern, True, scale)

            def ring_fb(layout=layout):
                return simulated_ring(q, k, v, layout, kern, True, scale, dout)

            t = {
                key: timed(fn, device, sizes.repeats)
                for key, fn in (
                    ("call_fwd", call_f),
                    ("ring_fwd", ring_f),
                    ("call_fwd_bwd", call_fb),
                    ("ring_fwd_bwd", ring_fb),
                )
            }
            one = call_f()
            ring_out = ring_f()
            one = one if lens is None else one.transpose(0, 1)[None]
            diff = _max_err(ring_out, one)
            eff = {
                "fwd": t["call_fwd"]["min"] / t["ring_fwd"]["min"],
                "fwd_bwd": t["call_fwd_bwd"]["min"] / t["ring_fwd_bwd"]["min"],
            }
            bar = RING_BARS.get(case["name"]) if sizes == FULL else None  # bars are set at full size
            rec.update(
                seconds={key: val["min"] for key, val in t.items()},
                seconds_median={key: val["median"] for key, val in t.items()},
                efficiency=eff,
                bar=bar,
                meets_bar=None if bar is None else bool(eff["fwd_bwd"] >= bar),
                max_abs_diff_vs_one_call=diff,
                # bf16 outputs of the two routes differ by rounding of the fp32 merge only
                status="ok" if diff <= 0.05 else "fail",
            )
    return records


# ---------------------------------------------------------------------------- section: train
def check_train(device: torch.device, sizes: Sizes, timeout: float = 170.0) -> dict:
    """Section ``train``: ``python -m titan_cp.train`` on the debug model, bf16, one process."""
    rec = dict(section="train", steps=sizes.train_steps, flavor="debugmodel_gqa")
    with tempfile.TemporaryDirectory(prefix="selfcheck_train_") as tmp:
        keys = {**TRAIN_KEYS, "training.steps": sizes.train_steps, "job.dump_folder": tmp}
        argv = [sys.executable, "-m", "titan_cp.train", *(f"--{k}={v}" for k, v in keys.items()), *sizes.train_args]
        if "--model.flavor" in sizes.train_args:
            rec["flavor"] = sizes.train_args[sizes.train_args.index("--model.flavor") + 1]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(PACKAGE_ROOT), env.get("PYTHONPATH"))))
        if device.type == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            rec.update(status="error", error=f"training did not finish in {timeout:.0f} s")
            return rec
        rec["wall_seconds"] = time.perf_counter() - t0
        metrics = Path(tmp) / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        if proc.returncode != 0 or not rows:
            rec.update(status="error", returncode=proc.returncode, error=(proc.stderr or proc.stdout)[-3000:])
            return rec
        warm = rows[min(5, len(rows) - 1) :] if len(rows) > 1 else rows
        losses = [r["loss"] for r in rows]
        rec.update(
            steps_logged=len(rows),
            first_loss=losses[0],
            last_loss=losses[-1],
            tokens_per_second=statistics.median(r["tokens_per_second"] for r in warm),
            mfu=statistics.median(r["mfu"] for r in warm),
            memory_gib=max(r.get("memory_bytes", 0) for r in rows) / 2**30,
            status="ok" if len(rows) == sizes.train_steps and all(math.isfinite(x) for x in losses) else "fail",
        )
    return rec


def longest_section(device: torch.device, small: bool) -> list[dict]:
    """Section ``longest`` (:func:`titan_cp.selfcheck.longest.check_longest`; toy sizes with ``small``)."""
    from titan_cp.selfcheck.longest import TOY, check_longest  # noqa: PLC0415 - only when named

    return check_longest(device, **(TOY if small else {}))


def linear_section(device: torch.device, sizes: Sizes) -> list[dict]:
    """Section ``linear`` (:func:`titan_cp.selfcheck.linear.check_linear`; toy sizes with ``SMALL``)."""
    from titan_cp.selfcheck.linear import check_linear  # noqa: PLC0415 - its module beside this one

    return check_linear(device, sizes is SMALL, timed, sizes.repeats)


def sections_of(extra_sections: Mapping[str, Section] | None = None) -> dict[str, Section]:
    """Every section by name: the package's, then ``extra_sections`` (a checkout's, e.g. ``model``)."""
    own: dict[str, Section] = {
        "kernels": lambda dev, sizes, kernel: check_kernels(dev, sizes),
        "ring": check_ring,
        "linear": lambda dev, sizes, kernel: linear_section(dev, sizes),
        "train": lambda dev, sizes, kernel: [check_train(dev, sizes)],
        "longest": lambda dev, sizes, kernel: longest_section(dev, sizes is SMALL),
    }
    clash = set(own) & set(extra_sections or {})
    if clash:
        raise ValueError(f"extra_sections {sorted(clash)} are the self-check's own; name them otherwise")
    return {**own, **(extra_sections or {})}


# ---------------------------------------------------------------------------- driver
def environment(device: torch.device) -> dict:
    """Versions, the device, and the schemas of the ATen flash ops the ``cuda_flash`` kernel calls."""
    aten = torch.ops.aten
    rec: dict[str, Any] = dict(
        section="env",
        torch=torch.__version__,
        device=str(device),
        flash_attn_schemas={
            op: str(getattr(aten, op).default._schema)
            for op in ("_flash_attention_forward", "_flash_attention_backward")
        },
    )
    if device.type == "cuda":
        rec.update(
            device_name=torch.cuda.get_device_name(device),
            cuda=torch.version.cuda,
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
        )
    problem = flash_attn_problem()
    if problem is None:
        import flash_attn  # noqa: PLC0415 - optional; imports (flash_attn_problem tried it)

        rec["flash_attn"] = getattr(flash_attn, "__version__", "unknown")
    else:
        rec["flash_attn_unavailable"] = problem
    return rec


STATUSES = ("ok", "below_bar", "error", "fail")  # in order of severity


def summarize(records: list[dict], dev: torch.device, timing: dict, seconds: float, sizes: Sizes | None) -> dict:
    """The summary record. ``status``: ``fail`` when a correctness check failed, ``error`` when a
    check could not run, ``below_bar`` when everything is correct but a ring efficiency is below
    its bar, else ``ok``; each list says which."""
    problems = [r for r in records if r.get("status") not in (None, "ok")]
    below = [r["case"] for r in records if r.get("section") == "ring" and r.get("meets_bar") is False]
    worst = max((STATUSES.index(r["status"]) for r in problems), default=0)
    status = STATUSES[worst] if worst else ("below_bar" if below else "ok")
    train = next((r for r in records if r.get("section") == "train"), {})
    return dict(
        summary=True,
        device=records[0].get("device_name", str(dev)) if records else str(dev),
        torch=torch.__version__,
        status=status,
        failures=[{k: r.get(k) for k in ("section", "kernel", "case", "status")} for r in problems],
        ring_efficiency={
            r["case"]: r["efficiency"] for r in records if r.get("section") == "ring" and "efficiency" in r
        },
        ring_below_bar=below,
        model_efficiency={  # section model, where a checkout adds it (benchmarks/gpu_model.py)
            r["case"]: {"measured": r["measured_efficiency"], "predicted": r["predicted_efficiency"]}
            for r in records
            if r.get("section") == "model" and "measured_efficiency" in r
        },
        train={k: train.get(k) for k in ("tokens_per_second", "mfu", "last_loss")} if train else None,
        linear_cut_overhead={  # section linear: one document cut into pieces against one call over it
            r["case"]: {"backend": r["backend"], "overhead": r["cut_overhead"]}
            for r in records
            if r.get("section") == "linear" and "cut_overhead" in r
        },
        section_seconds=timing,
        seconds=seconds,
        sizes=asdict(sizes) if sizes is not None else "full",
    )


def exit_code(summary: dict) -> int:
    """1 when a check failed or could not run, 0 otherwise (``below_bar`` included: it is a measurement)."""
    return 1 if summary.get("status") in ("fail", "error") else 0


def print_json(record: dict) -> None:
    """One record as one JSON line on stdout."""
    print(json.dumps(record, default=str), flush=True)


def run(
    device: str = "cuda",
    small: bool = False,
    sections: tuple[str, ...] | list[str] | None = None,
    emit: Callable[[dict], None] = print_json,
    ring_kernel: str | None = None,
    extra_sections: Mapping[str, Section] | None = None,
) -> dict:
    """Run the check; ``emit`` gets every record, the summary last (and is returned).

    ``sections`` are names of :func:`sections_of` ``(extra_sections)``; by default :data:`SECTIONS` and
    the extra ones. Without a CUDA device when
    ``device == "cuda"``, emits one record saying so and returns it.
    """
    if device == "cuda" and not torch.cuda.is_available():
        rec = dict(
            summary=True,
            status="skipped",
            reason="no CUDA device: nothing to check (use --device cpu --small to exercise the logic on CPU)",
        )
        emit(rec)
        return rec
    known = sections_of(extra_sections)
    sections = SECTIONS + tuple(extra_sections or ()) if sections is None else sections
    unknown = set(sections) - set(known)
    if unknown:
        raise ValueError(f"unknown selfcheck sections {sorted(unknown)}; choose from {tuple(known)}")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    sizes = SMALL if small else FULL
    t0 = time.perf_counter()
    records = [environment(dev)]
    emit(records[-1])
    timing = {}
    for section in sections:
        ts = time.perf_counter()
        out = known[section](dev, sizes, ring_kernel)
        for rec in out:
            emit(rec)
        records += out
        timing[section] = time.perf_counter() - ts
    summary = summarize(records, dev, timing, time.perf_counter() - t0, sizes if small else None)
    emit(summary)
    return summary


__all__ = [
    "FULL",
    "OPTIONAL_SECTIONS",
    "SECTIONS",
    "Section",
    "SMALL",
    "Sizes",
    "check_kernels",
    "check_ring",
    "check_train",
    "lognormal_doc_lens",
    "print_json",
    "main",
    "one_case",
    "run",
    "sections_of",
    "simulated_ring",
    "summarize",
    "exit_code",
    "timed",
]


def main(argv: list[str] | None = None, extra_sections: Mapping[str, Section] | None = None) -> int:
    """``python -m titan_cp.selfcheck``: parse ``argv``, :func:`run`, and return the exit status
    (:func:`exit_code`). ``extra_sections`` join the default sections (a checkout's wrapper's)."""
    import argparse  # noqa: PLC0415 - the command line only

    default = SECTIONS + tuple(extra_sections or ())
    everything = tuple(sections_of(extra_sections))
    parser = argparse.ArgumentParser(
        prog="python -m titan_cp.selfcheck", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--small", action="store_true", help="toy sizes (for CPU and tests)")
    parser.add_argument(
        "--sections",
        default=",".join(default),
        help=f"comma-separated subset of {','.join(everything)} (default: {','.join(default)})",
    )
    parser.add_argument(
        "--ring-kernel", default=None, help="kernel for the ring section (default: the device's default)"
    )
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    return exit_code(run(args.device, args.small, sections, print_json, args.ring_kernel, extra_sections))
