"""The planner: which mesh and CP strategy to run, before spending a GPU-hour.

    python -m titan_cp.plan --job.config_file X.toml --ngpu 8 [--gpu h100|h200|a100|cpu]
        [--nnodes 1] [--doc-mix NAME] [--hbm-gb G] [--matmul-speedup F] [--plot out.png]
        [--section.key value ...]          # any config key, as in the trainer

For the config's model, ``training.seq_len``, ``training.local_batch_size``, activation
checkpointing and compute dtype, it enumerates every mesh ``pp x dp_replicate x dp_shard x cp
x tp`` of ``--ngpu`` GPUs that the model's heads and layers allow, and every CP strategy for
it (ring, allgather, ulysses, hybrid with each Ulysses degree), and prints one JSON line and
one table row per candidate, the recommended one first. Nothing runs on a GPU.

Memory per rank (bytes), :func:`memory`::

    params      fp32 master weights / (dp_shard x cp)   (FSDP2 shards over dp_shard x cp; TP and PP split first)
    grads       the same (fp32, sharded)
    optimizer   2 x params (AdamW's two moments)
    activations saved for backward: saved_bytes_per_token x local tokens (exact, see below)
                (+ pp microbatches in flight under 1F1B on the first stage)
    loss        one chunk of fp32 logits and its softmax gradient (titan_cp.loss)
    comm        FSDP: two layers' gathered bf16 weights + one layer's unsharded fp32 grads;
                CP: the strategy's receive buffers (ring: two K/V blocks + two fp32 dK/dV)
    recompute   under full AC, one block's saved tensors while its backward runs

``saved_bytes_per_token`` (:func:`saved_bytes_per_token`) is derived from the model's shapes
and checked equal, byte for byte, to what ``titan_cp.tools.memory.SavedTensorCounter`` counts
on the debug model (``tests/test_plan.py``). Per block and local token, ``a`` the activation
dtype's bytes, with no checkpointing::

    attention_norm   input, output (a D each), rstd (a)       ffn_norm: the same
    wq               its input (a D; wk and wv share it)
    attention        q, out (a H E each), k, v (a K E each), lse (4 H)       [ring: as stored locally]
    feed_forward     w1 x, w3 x, silu(w1 x) (a F each); w1 input (a D); w2 input (a F)
  + once per token: tokens (8), RoPE cos and sin (2 x 4 E/2), final norm (2 a D + a),
    output input (a D), labels (8), loss lse (4)

under full AC a block keeps only its input (a D), and the checkpoint also holds cos, sin and
``doc_lens`` (8 bytes per document per row). allgather keeps the gathered K/V (a 2 K E per
token of the whole row); ulysses and hybrid keep their head shards (q_h and out_h the bytes of
q and out, K/V at the heads each shard needs, lse) and not ``out``, so ``wo`` saves its input.

Time per step, :func:`evaluate`: FLOPs from ``ModelArgs.training_flops`` with the visible
(query, key) pairs of the layout on the document mix (the straggler rank's pairs, from the
attention's own mask plans), divided by the device's peak times an achieved fraction (see
:data:`GPUS`); the forward again under full AC. Communication per rank and link kind from the
strategies' own ``*_min_bytes`` (CP), FSDP's all-gather / reduce-scatter, TP's sequence-parallel
all-gathers / reduce-scatters and PP's activations. Exposed time: ring steps whose transfer
exceeds their compute (the hiding condition, per step ``compute >= transfer``), all of
allgather's and Ulysses' collectives, TP's, FSDP's beyond the compute it overlaps, PP's bubble.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from titan_cp.attention.api import min_bytes_per_rank
from titan_cp.attention.plans import make_plan
from titan_cp.attention.ulysses import kv_head_map
from titan_cp.layout import get_layout
from titan_cp.loss import LOSS_CHUNK_BYTES
from titan_cp.model.llama import ModelArgs

GB = 1e9


@dataclass(frozen=True)
class Device:
    """One GPU kind. Bandwidths are per GPU and per direction, in bytes/s."""

    name: str
    peak_flops: float  # dense bf16 (fp32 for cpu)
    memory_bytes: float
    intra_bw: float  # NVLink (inside a node)
    inter_bw: float  # network (between nodes)
    matmul_efficiency: float  # achieved fraction of peak in matmuls
    attention_efficiency: float  # achieved fraction of peak in attention kernels
    gpus_per_node: int = 8


# Sources:
# - peak dense BF16 (no sparsity): NVIDIA H100 SXM datasheet 989 TFLOP/s; H200 SXM datasheet
#   989 TFLOP/s; A100 SXM datasheet 312 TFLOP/s.
# - memory: H100 SXM 80 GB, H200 141 GB, A100 80 GB (datasheets); --hbm-gb overrides (the
#   Grand Teton H100s of torchtitan's benchmarks have 96 GB).
# - NVLink: H100/H200 NVLink 4, 900 GB/s per GPU in both directions (450 GB/s each way);
#   A100 NVLink 3, 600 GB/s (300 each way). Network: 400 Gb/s per GPU (ConnectX-7 NDR,
#   torchtitan's benchmark hosts) = 50 GB/s; A100 pods: 200 Gb/s HDR = 25 GB/s.
# - achieved fractions: 0.30, from torchtitan's December 2024 H100 benchmark, Table 1: FSDP on
#   8 H100s (500 W power limit), bf16, eager, Llama 3.1 8B at 8K, 5,762 tokens/s/GPU, which is
#   0.30 of 989 TFLOP/s counting ModelArgs.training_flops (6 N per token + the visible pairs).
#   Float8 linears and torch.compile are not modelled: Table 1 measures them at 1.48x
#   (8,532 / 5,762) on that matmul-bound run; pass --matmul-speedup 1.48 to apply it.
# - cpu: a nominal 0.1 TFLOP/s fp32, host memory, gloo over shared memory (~5 GB/s) and
#   10 GbE (1.25 GB/s) between hosts: order-of-magnitude only.
GPUS: dict[str, Device] = {
    "h100": Device("h100", 989e12, 80 * GB, 450 * GB, 50 * GB, 0.30, 0.30),
    "h200": Device("h200", 989e12, 141 * GB, 450 * GB, 50 * GB, 0.30, 0.30),
    "a100": Device("a100", 312e12, 80 * GB, 300 * GB, 25 * GB, 0.30, 0.30),
    "cpu": Device(
        "cpu",
        0.1e12,
        float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        5 * GB,
        1.25 * GB,
        1.0,
        1.0,
        gpus_per_node=1,
    ),
}
HEADROOM = 0.10  # fits: total <= (1 - HEADROOM) x memory (allocator fragmentation, CUDA context, NCCL)


def device(gpu: str, hbm_gb: float | None = None, nnodes: int = 1, ngpu: int = 8) -> Device:
    """The constants of ``gpu`` (``ValueError`` naming ``--gpu`` if unknown)."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is unknown; choose one of {sorted(GPUS)}")
    d = GPUS[gpu]
    d = dataclasses.replace(d, gpus_per_node=ngpu // nnodes)
    if gpu == "cpu":  # the ranks of a host share its memory
        d = dataclasses.replace(d, memory_bytes=d.memory_bytes / d.gpus_per_node)
    return d if hbm_gb is None else dataclasses.replace(d, memory_bytes=hbm_gb * GB)


# ---------------------------------------------------------------------------- memory


def saved_bytes_per_token(
    args: ModelArgs,
    strategy: str = "ring",
    cp: int = 1,
    tp: int = 1,
    layers: int | None = None,
    ac: str = "none",
    act_bytes: int = 4,
    ulysses: int = 1,
    first: bool = True,
    last: bool = True,
) -> float:
    """Bytes saved for backward per local token (see the module docstring); ``layers`` blocks
    (default all), on the first/last pipeline stage. Excludes ``doc_lens`` (:func:`saved_bytes`)."""
    a, d, e = act_bytes, args.dim, args.head_dim
    h, k, f = args.n_heads // tp, args.kv_heads // tp, args.ffn_hidden_dim // tp
    layers = args.n_layers if layers is None else layers
    norm = 2 * a * d + a
    if cp == 1 or strategy == "ring":
        attn = 2 * a * h * e + 2 * a * k * e + 4 * h
    elif strategy == "allgather":  # local q, out, lse + the whole row's K/V (cp tokens per local token)
        attn = 2 * a * h * e + 4 * h + cp * 2 * a * k * e
    else:  # ulysses / hybrid: head shards of u times the tokens: q_h, out_h, kv_h, lse_h
        u = cp if strategy == "ulysses" else ulysses
        kv = 1 if kv_head_map(h, k, u) is not None else k // u
        attn = 2 * a * h * e + 2 * a * kv * u * e + 4 * h + a * h * e  # + wo's input: the op keeps no out
    block = norm + a * d + attn + (3 * a * f + a * d + a * f) + norm
    rope = 2 * 4 * (e // 2)
    per = 8 * first + rope
    per += (a * d if ac == "full" else block) * layers
    if last:
        per += norm + a * d + 8 + 4
    return per


def saved_bytes(args: ModelArgs, local_tokens: int, docs_per_row: int, rows: int = 1, **kw) -> int:
    """Bytes saved for backward by one microbatch of ``rows`` rows on one rank (:func:`saved_bytes_per_token`
    times the local tokens; under full AC plus the ``doc_lens`` the checkpoints hold)."""
    total = saved_bytes_per_token(args, **kw) * local_tokens
    if kw.get("ac", "none") == "full":
        total += 8 * docs_per_row * rows
    return int(total)


def _layer_params(args: ModelArgs, tp: int) -> int:
    d, e = args.dim, args.head_dim
    return (d * (args.n_heads * 2 + args.kv_heads * 2) * e + 3 * d * args.ffn_hidden_dim) // tp + 2 * d


def stage_params(args: ModelArgs, tp: int = 1, pp: int = 1) -> tuple[int, int]:
    """``(params, layers)`` of the largest pipeline stage, TP-sharded (first stage: embedding; last: output)."""
    layers = math.ceil(args.n_layers / pp)
    emb = args.vocab_size * args.dim // tp
    ends = emb if pp > 1 else 2 * emb + args.dim
    return layers * _layer_params(args, tp) + ends, layers


def step_peak_bytes(
    args: ModelArgs,
    local_tokens: int,
    docs_per_row: int,
    rows: int = 1,
    ac: str = "none",
    act_bytes: int = 4,
    strategy: str = "ring",
    cp: int = 1,
    tp: int = 1,
    ulysses: int = 1,
    grad_shards: int = 1,
) -> dict:
    """Peak bytes above the step's start of one forward + backward (what ``bench_memory`` measures:
    parameters already allocated; gradients fp32 / ``grad_shards``, here with no FSDP buffers).

    The peak is at the start of the backward without AC (everything saved, plus the loss's
    gradient chunk and the first block's gradients), or under full AC during the first block's
    backward (its recomputed tensors, every gradient but the embedding's).
    """
    kw = dict(strategy=strategy, cp=cp, tp=tp, ac=ac, act_bytes=act_bytes, ulysses=ulysses)
    saved = saved_bytes(args, local_tokens, docs_per_row, rows, **kw)
    tokens = local_tokens * rows
    layer_grad = 4 * _layer_params(args, tp) // grad_shards
    emb_grad = 4 * args.vocab_size * args.dim // tp // grad_shards
    all_grads = 4 * stage_params(args, tp)[0] // grad_shards
    chunk = min(tokens, max(1, LOSS_CHUNK_BYTES // (4 * args.vocab_size // tp)))
    loss = chunk * (args.vocab_size // tp) * 4 * 2
    block = saved_bytes_per_token(args, layers=1, first=False, last=False, **{**kw, "ac": "none"}) - 2 * 4 * (
        args.head_dim // 2
    )
    if ac == "full":
        inputs_left = saved - (args.n_layers - 1) * act_bytes * args.dim * tokens  # block 0's input and the rest
        peak = inputs_left + all_grads - emb_grad + block * tokens
        transient = 0
    else:
        peak = saved + emb_grad + layer_grad
        transient = loss
    return {"saved": saved, "peak": int(max(peak, saved + transient)), "grads": all_grads}


# ---------------------------------------------------------------------------- candidates


@dataclass
class Candidate:
    strategy: str
    dp_shard: int
    dp_replicate: int
    cp: int
    tp: int
    pp: int
    ulysses: int = 1
    result: dict = field(default_factory=dict)

    @property
    def degrees(self) -> dict:
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def candidates(
    args: ModelArgs, seq_len: int, ngpu: int, nnodes: int, balance: str, local_batch: int
) -> list[Candidate]:
    """Every mesh and CP strategy the model, ``seq_len`` and ``ngpu`` allow."""
    out = []
    chunks = 2 if balance == "zigzag" else 1
    for tp in _divisors(min(ngpu // nnodes, ngpu)):
        if args.n_heads % tp or args.kv_heads % tp:
            continue
        h, k = args.n_heads // tp, args.kv_heads // tp
        for pp in _divisors(ngpu // tp):
            if pp > 1 and (args.n_layers < pp or local_batch % pp):
                continue
            for rep in sorted({1, nnodes}):
                rest = ngpu // (tp * pp)
                if rest % rep:
                    continue
                for cp in _divisors(rest // rep):
                    if seq_len % (cp * chunks):
                        continue
                    dp_shard = rest // rep // cp
                    strategies = [("ring", 1)] if cp == 1 else [("ring", 1), ("allgather", 1)]
                    if cp > 1:
                        try:
                            kv_head_map(h, k, cp)
                            strategies.append(("ulysses", cp))
                        except ValueError:
                            pass
                        for u in _divisors(cp)[1:-1]:
                            try:
                                kv_head_map(h, k, u)
                                strategies.append(("hybrid", u))
                            except ValueError:
                                pass
                    for strategy, u in strategies:
                        out.append(Candidate(strategy, dp_shard, rep, cp, tp, pp, u))
    return out


@lru_cache(maxsize=256)
def _rank_pairs(seq_len: int, cp: int, balance: str, rows: tuple) -> tuple[int, int]:
    """``(max over cp ranks, total)`` visible pairs per head of the rows, from the attention's mask plans."""
    from titan_cp.tools.balance import rank_pairs

    layout = get_layout(seq_len, cp, balance, [list(r) for r in rows])
    total = make_plan(layout, None, None, True).pairs(len(rows))
    return (total if cp == 1 else int(rank_pairs(layout).max())), total


def _link(axis_span: int, dev: Device) -> str:
    """``intra`` when a group whose ranks span ``axis_span`` consecutive ranks fits in one node."""
    return "intra" if axis_span <= dev.gpus_per_node else "inter"


def cp_bytes_per_rank(
    args: ModelArgs,
    seq_len: int,
    rows: int,
    strategy: str,
    cp: int,
    tp: int = 1,
    ulysses: int = 1,
    layers: int | None = None,
    ac: str = "none",
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Bytes one rank hands to CP communication in one forward + backward (+ the forward again under
    full AC), from the strategies' own ``*_min_bytes`` on the local shapes."""
    if cp == 1:
        return 0
    layers = args.n_layers if layers is None else layers
    s = seq_len // cp
    q = torch.empty(rows, args.n_heads // tp, s, args.head_dim, dtype=dtype, device="meta")
    k = torch.empty(rows, args.kv_heads // tp, s, args.head_dim, dtype=dtype, device="meta")
    per = min_bytes_per_rank(strategy, q, k, cp, ulysses)
    if ac == "full":
        per += min_bytes_per_rank(strategy, q, k, cp, ulysses, backward=False)
    return per * layers


def evaluate(
    c: Candidate,
    args: ModelArgs,
    seq_len: int,
    doc_rows: list[list[int]],
    dev: Device,
    ac: str,
    balance: str,
    act_bytes: int = 2,
    matmul_speedup: float = 1.0,
    accum: int = 1,
) -> dict:
    """Memory, communication and time of one candidate (see the module docstring)."""
    rows = len(doc_rows)
    ngpu = c.pp * c.dp_replicate * c.dp_shard * c.cp * c.tp
    fsdp = c.dp_shard * c.cp
    local = seq_len // c.cp
    params, layers = stage_params(args, c.tp, c.pp)
    # ---- memory
    mb_in_flight = min(c.pp, rows) if c.pp > 1 else 1
    act = saved_bytes(
        args,
        local,
        max(len(r) for r in doc_rows),
        rows,
        strategy=c.strategy,
        cp=c.cp,
        tp=c.tp,
        layers=layers,
        ac=ac,
        act_bytes=act_bytes,
        ulysses=c.ulysses,
        first=True,
        last=c.pp == 1,
    )
    act *= mb_in_flight if c.pp > 1 else 1
    block = (
        saved_bytes_per_token(args, c.strategy, c.cp, c.tp, 1, "none", act_bytes, c.ulysses, False, False)
        * local
        * rows
    )
    vocab = args.vocab_size // c.tp
    chunk = min(local * rows, max(1, LOSS_CHUNK_BYTES // (4 * vocab)))
    layer = _layer_params(args, c.tp)
    kvb = 2 * (args.kv_heads // c.tp) * args.head_dim * local * rows * act_bytes
    cp_buf = (
        {
            "ring": 2 * kvb + 2 * kvb * 4 // act_bytes,
            "allgather": 0,
            "ulysses": 3 * kvb,
            "hybrid": 2 * kvb * c.ulysses + 2 * kvb * 4 // act_bytes,
        }[c.strategy]
        if c.cp > 1
        else 0
    )
    mem = {
        "params": 4 * params // fsdp,
        "gradients": 4 * params // fsdp,
        "optimizer": 8 * params // fsdp,
        "activations": int(act),
        "loss": chunk * vocab * 4 * 2,
        "comm_buffers": (2 * 2 * layer + 4 * layer if fsdp > 1 else 0) + cp_buf,
        "recompute": int(block) if ac == "full" else 0,
    }
    total = sum(mem.values())
    # ---- flops
    pairs_rank, pairs_total = _rank_pairs(seq_len, c.cp, balance, tuple(tuple(r) for r in doc_rows))
    tokens_rank = local * rows
    dense = 6 * (params - (args.vocab_size * args.dim // c.tp if c.pp == 1 else 0)) * tokens_rank
    attn = 12 * (args.n_heads // c.tp) * args.head_dim * layers * pairs_rank
    if ac == "full":
        dense, attn = dense * 4 / 3, attn * 4 / 3
    compute = dense / (dev.peak_flops * dev.matmul_efficiency * matmul_speedup) + attn / (
        dev.peak_flops * dev.attention_efficiency
    )
    # ---- communication (bytes sent per rank, per link kind)
    comm = {"intra": 0, "inter": 0}
    detail = {}
    span_tp = c.tp
    span_cp = c.cp * c.tp
    span_fsdp = c.dp_shard * c.cp * c.tp
    span_rep = span_fsdp * c.dp_replicate
    cp_total = cp_bytes_per_rank(
        args,
        seq_len,
        rows,
        c.strategy,
        c.cp,
        c.tp,
        c.ulysses,
        layers,
        ac,
        torch.bfloat16 if act_bytes == 2 else torch.float32,
    )
    exposed = 0.0
    ring_ratio = None
    if c.cp > 1:
        if c.strategy == "hybrid":
            q = torch.empty(rows, args.n_heads // c.tp, local, args.head_dim, dtype=torch.bfloat16, device="meta")
            k = torch.empty(rows, args.kv_heads // c.tp, local, args.head_dim, dtype=torch.bfloat16, device="meta")
            uly = min_bytes_per_rank("ulysses", q, k, c.ulysses) * layers * (1.5 if ac == "full" else 1)
            detail["cp_ulysses"] = (int(uly), _link(c.ulysses * c.tp, dev))
            detail["cp_ring"] = (cp_total - int(uly), _link(span_cp, dev))
        else:
            detail["cp"] = (cp_total, _link(span_cp, dev))
        ring_size = {"ring": c.cp, "hybrid": c.cp // c.ulysses}.get(c.strategy, 1)
        for name, (nbytes, link) in detail.items():
            bw = dev.intra_bw if link == "intra" else dev.inter_bw
            t = nbytes / bw
            if name in ("cp", "cp_ring") and ring_size > 1:
                # per layer and ring step: compute of the step vs transfer of one K/V block (fwd) or K/V + fp32 dK/dV (bwd)
                passes = 3 if ac == "full" else 2
                step_compute = attn / (dev.peak_flops * dev.attention_efficiency) / layers / ring_size
                fwd_c, bwd_c = step_compute / (4 if ac == "full" else 3), step_compute * 2 / (4 if ac == "full" else 3)
                if c.strategy == "hybrid":  # the ring moves the Ulysses group's union: u x the tokens, its K/V heads
                    kv_h = (
                        1
                        if kv_head_map(args.n_heads // c.tp, args.kv_heads // c.tp, c.ulysses)
                        else (args.kv_heads // c.tp // c.ulysses)
                    )
                    kv_step = 2 * kv_h * args.head_dim * local * c.ulysses * rows * act_bytes
                else:
                    kv_step = kvb
                fwd_t = kv_step / bw
                bwd_t = (kv_step + kv_step * 4 / act_bytes) / bw
                ring_ratio = min(fwd_c / fwd_t, bwd_c / bwd_t) if fwd_t > 0 else None
                per_layer = (ring_size - 1) * ((passes - 1) * max(0.0, fwd_t - fwd_c) + max(0.0, bwd_t - bwd_c))
                exposed += per_layer * layers
            else:
                exposed += t
    if fsdp > 1:
        gathers = 2 if c.pp == 1 else 1  # reshard after forward: gathered again for the backward
        fs = int(params * 2 * gathers * (fsdp - 1) / fsdp + params * 4 * (fsdp - 1) / fsdp)
        detail["fsdp"] = (fs, _link(span_fsdp, dev))
        bw = dev.intra_bw if detail["fsdp"][1] == "intra" else dev.inter_bw
        exposed += max(0.0, fs / bw - compute)
    if c.dp_replicate > 1:
        ar = int(2 * params * 4 / fsdp * (c.dp_replicate - 1) / c.dp_replicate)
        detail["dp_replicate"] = (ar, _link(span_rep, dev))
        exposed += ar / (dev.intra_bw if detail["dp_replicate"][1] == "intra" else dev.inter_bw)
    if c.tp > 1:
        passes = 3 if ac == "full" else 2
        t_b = int(4 * passes * layers * (c.tp - 1) * tokens_rank * args.dim * act_bytes / c.tp)
        detail["tp"] = (t_b, _link(span_tp, dev))
        exposed += t_b / (dev.intra_bw if detail["tp"][1] == "intra" else dev.inter_bw)
    if c.pp > 1:
        p_b = int(2 * tokens_rank * args.dim * act_bytes)
        detail["pp"] = (p_b, _link(span_rep * c.pp, dev))
        exposed += p_b / (dev.intra_bw if detail["pp"][1] == "intra" else dev.inter_bw)
    for nbytes, link in detail.values():
        comm[link] += nbytes
    step = (compute + exposed) * accum
    if c.pp > 1:  # 1F1B bubble with `rows` microbatches of one row
        step *= (rows + c.pp - 1) / rows
    global_tokens = seq_len * rows * c.dp_shard * c.dp_replicate * accum
    flops = args.training_flops(seq_len * rows, pairs_total) * c.dp_shard * c.dp_replicate * accum
    return {
        "strategy": c.strategy if c.cp > 1 else "none",
        "dp_shard": c.dp_shard,
        "dp_replicate": c.dp_replicate,
        "cp": c.cp,
        "tp": c.tp,
        "pp": c.pp,
        "ulysses_degree": c.ulysses if c.strategy in ("hybrid", "ulysses") else 1,
        "seq_len": seq_len,
        "local_tokens": tokens_rank,
        "memory_bytes_per_rank": int(total),
        "memory_parts": {k: int(v) for k, v in mem.items()},
        "fits": bool(total <= (1 - HEADROOM) * dev.memory_bytes),
        "headroom_bytes": int((1 - HEADROOM) * dev.memory_bytes - total),
        "comm_bytes_per_rank": {"intra": int(comm["intra"]), "inter": int(comm["inter"])},
        "comm_detail": {k: {"bytes": int(v), "link": link} for k, (v, link) in detail.items()},
        "ring_compute_over_transfer": None if ring_ratio is None else round(ring_ratio, 3),
        "compute_seconds": compute * accum,
        "exposed_comm_seconds": exposed * accum,
        "step_seconds": step,
        "model_flops": int(flops),
        "tokens_per_second_per_gpu": global_tokens / step / ngpu,
        "mfu": flops / step / ngpu / dev.peak_flops,
    }


# ---------------------------------------------------------------------------- a published table

# torchtitan's December 2024 H100 benchmark (benchmarks/llama3_h100_202412_torchtitan.md), Table 2:
# Llama 3.1 8B, 8 H100 (96 GB, 500 W), FSDP x CP, local batch 1, full AC, torch.compile + float8:
# (seq_len, cp, tokens/s per GPU, memory GiB).
TORCHTITAN_8B_H100_CP = (
    (32768, 1, 3890, 83.9),
    (65536, 2, 2540, 84.2),
    (131072, 4, 1071, 84.0),
    (262144, 8, 548, 84.5),
)


def published_comparison(matmul_speedup: float = 1.0, strategy: str = "ring") -> list[dict]:
    """The planner's rows for :data:`TORCHTITAN_8B_H100_CP` (one causal document per row)."""
    from titan_cp.config import load_config

    out = []
    for seq, cp, tps, gib in TORCHTITAN_8B_H100_CP:
        cfg = load_config(
            [
                "--model.flavor",
                "8B",
                "--training.seq_len",
                str(seq),
                "--training.local_batch_size",
                "1",
                "--activation_checkpoint.mode",
                "full",
                "--parallelism.context_parallel_degree",
                str(cp),
            ]
        )
        recs = plan(cfg, 8, "h100", hbm_gb=96, matmul_speedup=matmul_speedup)
        r = next(
            r
            for r in recs
            if r["cp"] == cp
            and r["tp"] == r["pp"] == 1
            and r["dp_shard"] == 8 // cp
            and r["strategy"] in (strategy, "none")
        )
        out.append(
            {
                "seq_len": seq,
                "cp": cp,
                "dp_shard": 8 // cp,
                "published_tokens_per_second_per_gpu": tps,
                "published_memory_gib": gib,
                "tokens_per_second_per_gpu": r["tokens_per_second_per_gpu"],
                "memory_gib": r["memory_bytes_per_rank"] / 2**30,
                "fits": r["fits"],
                "mfu": r["mfu"],
            }
        )
    return out


# ---------------------------------------------------------------------------- the command


def plan(
    job_config,
    ngpu: int,
    gpu: str = "h100",
    nnodes: int = 1,
    doc_mix: str = "causal",
    hbm_gb: float | None = None,
    matmul_speedup: float = 1.0,
    seed: int = 0,
) -> list[dict]:
    """Every candidate's record, the recommended one first (``recommended`` true), then by tokens/s."""
    from titan_cp.mesh import ParallelDims
    from titan_cp.model import model_args
    from titan_cp.testing.docs import make_rows

    if ngpu < 1:
        raise ValueError(f"--ngpu must be positive, got {ngpu}")
    if nnodes < 1 or ngpu % nnodes:
        raise ValueError(f"--nnodes ({nnodes}) must divide --ngpu ({ngpu})")
    dev = device(gpu, hbm_gb, nnodes, ngpu)
    ParallelDims.from_config(job_config, ngpu)  # the configured degrees must lay out on ngpu (names the key)
    t, p, m = job_config.training, job_config.parallelism, job_config.model
    args = model_args(m.flavor)
    balance = p.context_parallel_load_balancer
    if balance == "zigzag" and t.seq_len % 2:
        raise ValueError(f"training.seq_len ({t.seq_len}) is odd: no zigzag layout divides it")
    rows = make_rows(doc_mix, t.seq_len, t.local_batch_size, seed)
    ac = job_config.activation_checkpoint.mode
    ac = (
        "full"
        if ac == "full" or (ac == "selective" and job_config.activation_checkpoint.selective_ac_option == "1")
        else ac
    )
    if ac not in ("none", "full"):
        ac = "full"  # selective: bounded above by none and below by full; planned as full (conservative in time)
    act_bytes = 4 if (t.mixed_precision_param == "float32" or gpu == "cpu") else 2
    accum = max(1, t.gradient_accumulation_steps)
    cands = candidates(args, t.seq_len, ngpu, nnodes, balance, t.local_batch_size)
    if not cands:
        raise ValueError(
            f"training.seq_len ({t.seq_len}) is divided by no cp degree of {ngpu} GPUs "
            f"for parallelism.context_parallel_load_balancer = {balance!r}"
        )
    configured = {
        "pp": p.pipeline_parallel_degree,
        "dp_replicate": p.data_parallel_replicate_degree,
        "cp": p.context_parallel_degree,
        "tp": p.tensor_parallel_degree,
    }
    records = []
    for c in cands:
        r = evaluate(c, args, t.seq_len, rows, dev, ac, balance, act_bytes, matmul_speedup, accum)
        r["configured"] = all(getattr(c, k) == v for k, v in configured.items()) and (
            c.strategy == p.context_parallel_strategy or c.cp == 1
        )
        r.update(gpu=gpu, ngpu=ngpu, nnodes=nnodes, doc_mix=doc_mix, ac=ac, flavor=m.flavor, balance=balance)
        records.append(r)
    records.sort(key=lambda r: (-r["fits"], -r["tokens_per_second_per_gpu"], r["memory_bytes_per_rank"]))
    # among the plans that fit within 2% of the fastest, the one with the most headroom (2 GB steps), then speed
    near = [
        r
        for r in records
        if r["fits"] and r["tokens_per_second_per_gpu"] >= 0.98 * records[0]["tokens_per_second_per_gpu"]
    ]
    if near:
        first = min(near, key=lambda r: (r["memory_bytes_per_rank"] // (2 * GB), -r["tokens_per_second_per_gpu"]))
        records.remove(first)
        records.insert(0, first)
    for r in records:
        r["recommended"] = False
    best = records[0]
    best["recommended"] = best["fits"]
    best["reason"] = _reason(best, dev) if best["fits"] else "nothing fits: raise cp or tp, or turn on full AC"
    return records


def _reason(r: dict, dev: Device) -> str:
    why = (
        f"least memory within 2% of the fastest that fits: {r['tokens_per_second_per_gpu']:,.0f} tokens/s/GPU, "
        f"{r['memory_bytes_per_rank'] / GB:.1f} of {dev.memory_bytes / GB:.0f} GB"
    )
    if r["ring_compute_over_transfer"] is not None:
        hidden = "hides" if r["ring_compute_over_transfer"] >= 1 else "cannot hide"
        why += f"; the ring {hidden} its K/V transfer (compute/transfer {r['ring_compute_over_transfer']:.1f}x)"
    elif r["cp"] > 1:
        why += f"; {r['strategy']} exposes {r['exposed_comm_seconds'] * 1e3:.1f} ms of communication per step"
    return why


def overrides(r: dict) -> list[str]:
    """The TOML keys of a record (``[parallelism]`` lines)."""
    lines = [
        "[parallelism]",
        f"data_parallel_replicate_degree = {r['dp_replicate']}",
        f"data_parallel_shard_degree = {r['dp_shard']}",
        f"context_parallel_degree = {r['cp']}",
        f"tensor_parallel_degree = {r['tp']}",
        f"pipeline_parallel_degree = {r['pp']}",
    ]
    if r["cp"] > 1:
        lines.append(f'context_parallel_strategy = "{r["strategy"]}"')
    if r["strategy"] == "hybrid":
        lines.append(f"context_parallel_ulysses_degree = {r['ulysses_degree']}")
    return lines


def launch_lines(r: dict, config_file: str | None) -> list[str]:
    per_node = r["ngpu"] // r["nnodes"]
    cfg = f"--job.config_file {config_file or 'X.toml'}"
    keys = (
        f"--parallelism.data_parallel_replicate_degree {r['dp_replicate']} "
        f"--parallelism.data_parallel_shard_degree {r['dp_shard']} --parallelism.context_parallel_degree {r['cp']} "
        f"--parallelism.tensor_parallel_degree {r['tp']} --parallelism.pipeline_parallel_degree {r['pp']}"
    )
    if r["cp"] > 1:
        keys += f" --parallelism.context_parallel_strategy {r['strategy']}"
    if r["strategy"] == "hybrid":
        keys += f" --parallelism.context_parallel_ulysses_degree {r['ulysses_degree']}"
    if r["nnodes"] == 1:
        return [f"torchrun --standalone --nproc-per-node {per_node} -m titan_cp.train {cfg} {keys}"]
    return [
        f"torchrun --nnodes {r['nnodes']} --nproc-per-node {per_node} --rdzv-backend c10d "
        f"--rdzv-endpoint $HEAD_NODE:29500 --rdzv-id $JOB_ID -m titan_cp.train {cfg} {keys}"
    ]


def _row(r: dict) -> str:
    mesh = f"pp{r['pp']} rep{r['dp_replicate']} fsdp{r['dp_shard']} cp{r['cp']} tp{r['tp']}"
    strat = r["strategy"] + (f"(u{r['ulysses_degree']})" if r["strategy"] == "hybrid" else "")
    ratio = r["ring_compute_over_transfer"]
    return (
        f"{'*' if r['recommended'] else ' '} {mesh:<30} {strat:<12} {r['memory_bytes_per_rank'] / GB:8.1f} "
        f"{'yes' if r['fits'] else 'no':>4} {r['comm_bytes_per_rank']['intra'] / GB:8.2f} "
        f"{r['comm_bytes_per_rank']['inter'] / GB:8.2f} {'-' if ratio is None else f'{ratio:.1f}':>6} "
        f"{r['step_seconds']:8.3f} {r['tokens_per_second_per_gpu']:10,.0f} {100 * r['mfu']:5.1f}"
    )


def plot(records: list[dict], path: str) -> None:
    """Memory per rank and predicted tokens/s per GPU of every candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in records:
        color = "C2" if r["recommended"] else ("C0" if r["fits"] else "C3")
        ax.scatter(r["memory_bytes_per_rank"] / GB, r["tokens_per_second_per_gpu"], color=color, s=18)
    best = records[0]
    ax.annotate(
        f"cp{best['cp']} {best['strategy']}", (best["memory_bytes_per_rank"] / GB, best["tokens_per_second_per_gpu"])
    )
    ax.set_xlabel("memory per rank (GB)")
    ax.set_ylabel("predicted tokens/s per GPU")
    ax.set_title(f"{best['flavor']} seq {best['seq_len']} on {best['ngpu']} {best['gpu']} (red: does not fit)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from titan_cp.config import load_config
    from titan_cp.testing.docs import ROW_MIXES as MIXES

    p = argparse.ArgumentParser(
        prog="python -m titan_cp.plan",
        description=__doc__.split("\n\n")[0],
        epilog="Any --section.key value is a config override, as in the trainer.",
    )
    p.add_argument("--ngpu", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpu", default="h100", help=f"one of {sorted(GPUS)}")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--doc-mix", default="causal", help=f"document mix of the rows: {sorted(MIXES)}")
    p.add_argument("--hbm-gb", type=float, default=None, help="memory per GPU, GB (default: the GPU's)")
    p.add_argument("--matmul-speedup", type=float, default=1.0, help="e.g. 1.48 for float8 + compile (see GPUS)")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--top", type=int, default=0, help="print only the best N rows (0: all)")
    args, rest = p.parse_known_args(argv)
    try:
        if args.doc_mix not in MIXES:
            raise ValueError(f"--doc-mix {args.doc_mix!r} is unknown; choose one of {sorted(MIXES)}")
        device(args.gpu)
        job_config = load_config(rest)
        records = plan(job_config, args.ngpu, args.gpu, args.nnodes, args.doc_mix, args.hbm_gb, args.matmul_speedup)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shown = records[: args.top] if args.top else records
    for r in shown:
        print(json.dumps(r))
    print(
        f"\n  {'mesh':<30} {'strategy':<12} {'mem GB':>8} {'fits':>4} {'intra GB':>8} {'inter GB':>8} "
        f"{'c/t':>6} {'step s':>8} {'tok/s/GPU':>10} {'MFU%':>5}"
    )
    for r in shown:
        print(_row(r))
    best = records[0]
    print(f"\nrecommended: {best['reason']}")
    if best["recommended"]:
        print("\n".join(["", *overrides(best), ""]))
        config_file = job_config.job.config_file
        for line in launch_lines(best, config_file):
            print(line)
        if best["nnodes"] == 1:
            print(
                launch_lines({**best, "nnodes": 2, "ngpu": 2 * best["ngpu"]}, config_file)[0].replace(
                    "--nnodes 2", "--nnodes N"
                )
                + "   # several nodes (set the degrees for N nodes)"
            )
    if args.plot:
        plot(records, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
