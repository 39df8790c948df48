"""Forward+backward time of each CP attention strategy on 1 and on N gloo ranks (one thread per rank).

Prints one JSON object per (case, strategy, world); ``seconds`` is the fastest of
``--iters`` timed iterations (``seconds_median`` beside it)::

    {"case": "causal", "strategy": "ring", "world": 2, "seq_len": 16384, "seconds": ...,
     "efficiency": seconds(world 1) / (world * seconds(world)),
     "bytes_sent_per_rank": <counted at the communication calls>,
     "bytes_theory_per_rank": <the strategy's own minimum>, ...}

Cases: ``causal`` (one document per row, zigzag layout) and ``docs`` (packed documents
with log-normal lengths, ``--balance``, doc_local by default). World 1 runs the same strategy
code on one rank, so efficiency compares like with like.

Case ``model`` (see :mod:`benchmarks.gpu_model`): the counting model of GPU time of one layer
at full size (``--model-seq-len`` tokens, CP ``--model-cp``, Llama 3 8B heads, bf16), run on fake
CUDA tensors in seconds: kernel and outside-kernel seconds, bytes sent, and the predicted
efficiency against one variable-length call on the whole row, for causal rows (zigzag),
log-normal documents of mean 1K and 4K under doc_local and doc_zigzag, and a 1,024-token window;
then every row of :func:`benchmarks.gpu_model.model_rows` (one causal document, documents of
mean 1K, 256, 4K and 16K, windows of 1,024 and 4,096 with and without documents) for each strategy
it is barred for, with its bar; each line carries ``outside_gb_by_kind``, where the bytes outside the
kernel go (layout copies, repacking, result rows, the fp32 merge, gradient accumulation, buffers);
with FlashAttention-2's measured rates and with a flat 60% of the H200's peak::

    python scripts/bench_attention.py --cases model

Case ``host`` (see :mod:`benchmarks.host`): the host-side cost of one layer, the thing
that makes a packed long-sequence step host-bound on a GPU. One head of head_dim 8 (the
arithmetic is negligible), ``--host-seq-len`` tokens of log-normal documents of mean
``--host-doc-mean``, ring over ``--host-world`` ranks, doc_zigzag; prints
``host_ms_per_layer`` (main-thread CPU time of forward + backward with the layout built
inside, max over ranks), ``tiles`` (rank 0) and ``kernel_calls_per_step`` for ATen's CPU flash
kernel looping over the packed segments, and for ``cpu_varlen``, the CPU default (one call per
causal flag, short segments batched)::

    python scripts/bench_attention.py --cases host

    python scripts/bench_attention.py                       # defaults: seq 16384, 16 q heads, 4 kv heads, dim 64
    python scripts/bench_attention.py --seq-len 4096 --strategies ring --cases causal docs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed: the checkout's

from benchmarks.gpu_model import model_records  # noqa: E402
from benchmarks.host import host_layer  # noqa: E402
from titan_cp import SequenceLayout, cp_attention  # noqa: E402
from titan_cp.attention import CPHandle, get_strategy, min_bytes_per_rank, strategy_names  # noqa: E402
from titan_cp.attention.comm import count_comm  # noqa: E402
from titan_cp.data.row_mixes import lognormal_doc_lens  # noqa: E402
from titan_cp.testing import DistPool, strategy_mesh  # noqa: E402


def _run(rank, world, args: dict, case: str, strategy: str):
    import torch.distributed as dist

    ulysses = min(args["hybrid_ulysses"], world) if get_strategy(strategy).takes_ulysses_degree() else 1
    mesh = strategy_mesh(strategy, world, ulysses)
    r = CPHandle(mesh, strategy).rank
    seq, docs = args["seq_len"], None
    if case == "docs":
        docs = [lognormal_doc_lens(seq, args["doc_mean"], seed=1)]
    balance = args["balance"] if case == "docs" else "zigzag"
    layout = SequenceLayout(seq, world, balance, docs)
    g = torch.Generator().manual_seed(0)
    b, h, hkv, d = args["batch"], args["heads"], args["kv_heads"], args["head_dim"]
    dtype = getattr(torch, args["dtype"])
    full = [torch.randn(b, n, seq, d, generator=g).to(dtype) for n in (h, hkv, hkv, h)]
    q, k, v, dout = (layout.shard(x, 2, r) for x in full)
    del full
    times, sent = [], 0
    for it in range(args["warmup"] + args["iters"]):
        ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
        dist.barrier()
        t0 = time.perf_counter()
        with count_comm() as counter:
            out = cp_attention(ql, kl, vl, mesh, layout, strategy=strategy)
            out.backward(dout)
        dist.barrier()
        if it >= args["warmup"]:
            times.append(time.perf_counter() - t0)
            sent = counter.bytes_sent
    theory = min_bytes_per_rank(strategy, q, k, world, ulysses, layout=layout, rank=r)
    return {
        "seconds": min(times),
        "seconds_median": sorted(times)[len(times) // 2],
        "bytes_sent_per_rank": sent,
        "bytes_theory_per_rank": theory,
        "ulysses": ulysses,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--worlds", type=int, nargs="+", default=[2])
    p.add_argument("--strategies", nargs="+", default=list(strategy_names()), choices=strategy_names())
    p.add_argument("--cases", nargs="+", default=["causal", "docs"], choices=["causal", "docs", "host", "model"])
    p.add_argument("--balance", default="doc_local", help="layout of the docs case")
    p.add_argument("--model-seq-len", type=int, default=131072)
    p.add_argument("--model-cp", type=int, default=8)
    p.add_argument("--model-seed", type=int, default=7, help="seed of the rows with bars (gpu_model.model_rows)")
    p.add_argument("--host-seq-len", type=int, default=131072)
    p.add_argument("--host-doc-mean", type=int, default=1024)
    p.add_argument("--host-world", type=int, default=8)
    p.add_argument("--doc-mean", type=int, default=2048, help="mean document length for the docs case")
    p.add_argument("--hybrid-ulysses", type=int, default=2, help="ulysses axis size for hybrid")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--iters", type=int, default=3, help="timed iterations; seconds is the fastest (a shared machine adds noise)"
    )
    args = vars(p.parse_args(argv))

    for case in args["cases"]:
        if case == "host":
            _host(args)
            continue
        if case == "model":
            _model(args)
            continue
        for strategy in args["strategies"]:
            base = None
            for world in [1] + [w for w in args["worlds"] if w != 1]:
                pool = DistPool(world, collective_timeout_s=1800)
                try:
                    res = pool.run(_run, args, case, strategy, timeout=3600)[0]
                finally:
                    pool.close()
                base = res["seconds"] if world == 1 else base
                row = {
                    "case": case,
                    "strategy": strategy,
                    "world": world,
                    "seq_len": args["seq_len"],
                    "heads": args["heads"],
                    "kv_heads": args["kv_heads"],
                    "head_dim": args["head_dim"],
                    "dtype": args["dtype"],
                    "seconds": round(res["seconds"], 4),
                    "seconds_median": round(res["seconds_median"], 4),
                    "efficiency": round(base / (world * res["seconds"]), 4),
                    "bytes_sent_per_rank": res["bytes_sent_per_rank"],
                    "bytes_theory_per_rank": res["bytes_theory_per_rank"],
                }
                if get_strategy(strategy).takes_ulysses_degree():
                    row["ulysses_size"] = res["ulysses"]
                print(json.dumps(row), flush=True)


def _host(args: dict) -> None:
    seq, world = args["host_seq_len"], args["host_world"]
    docs = lognormal_doc_lens(seq, args["host_doc_mean"], seed=1)
    pool = DistPool(world, collective_timeout_s=1800)
    try:
        for kernel, route, native in (("cpu_flash", "varlen_loop", True), ("cpu_varlen", "varlen", None)):
            res = pool.run(host_layer, seq, docs, "ring", kernel, native, timeout=3600)
            print(
                json.dumps(
                    {
                        "case": "host",
                        "strategy": "ring",
                        "world": world,
                        "seq_len": seq,
                        "documents": len(docs),
                        "doc_mean": args["host_doc_mean"],
                        "kernel": kernel,
                        "route": route,
                        "host_ms_per_layer": round(max(r["host_ms"] for r in res), 2),
                        "host_ms_rank0": round(res[0]["host_ms"], 2),
                        "tiles": res[0]["tiles"],
                        "kernel_calls_per_step": max(r["kernel_calls_per_step"] for r in res),
                    }
                ),
                flush=True,
            )
    finally:
        pool.close()


def _model(args: dict) -> None:
    torch.set_num_threads(1)  # the fake layers run small host-side ops: a second thread only waits
    seq, cp = args["model_seq_len"], args["model_cp"]
    for record in model_records(seq, cp, args["model_seed"]):
        print(json.dumps({"case": "model", **record}), flush=True)


if __name__ == "__main__":
    main()
