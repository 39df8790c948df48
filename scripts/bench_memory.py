"""Per-rank activation memory of one forward+backward of the model under context parallelism
(``--case cp``, the default), or the peak of the chunked loss alone (``--case loss``).

``--case loss`` prints one JSON line: the peak bytes (above the inputs, gradients included) of
one forward + backward of the chunked output projection + cross-entropy
(``benchmarks.memory.measure_loss_memory``) at ``--tokens`` x ``--vocab`` x ``--dim``,
next to the bytes of the whole fp32 logits it never holds (target: peak <= 10% of them)::

    python scripts/bench_memory.py --case loss            # 16384 tokens, vocab 128256, dim 512
    python scripts/bench_memory.py --case loss --tokens 2048 --unchunked   # the reference, small

For each CP degree (a separate pool of that many gloo ranks; CP 1 is the plain model, no
``apply_cp``), every rank builds the model, takes its shard of one packed row, and runs one
forward + loss + backward while two exact counters watch it. One JSON object per degree::

    {"cp": 4, "seq_len": 8192, "saved_bytes_per_rank": ..., "peak_bytes_per_rank": ...,
     "scaling": saved(1) / (cp * saved(cp)), "peak_scaling": peak(1) / (cp * peak(cp)), ...}

(``*_per_rank``: the maximum over the ranks.) What is measured:

``saved_bytes_per_rank``
    Bytes held for the backward: every tensor autograd saves during the forward and the
    loss goes through a ``torch.autograd.graph.saved_tensors_hooks`` pack hook (including
    what custom ``autograd.Function``s keep with ``ctx.save_for_backward``, e.g. the ring's
    q, k, v, out, lse). Tensors are deduplicated by their untyped storage (data pointer,
    nbytes), so views of one buffer count once, and the whole storage is counted, since a
    saved view keeps all of it alive. Storages of model parameters (the weights linear
    layers save) are left out and reported apart as ``saved_param_bytes``.

``peak_bytes_per_rank``
    The peak, above what was allocated before the step, of the bytes held by PyTorch's
    CPU allocator during forward + loss + backward: activations, temporaries inside
    kernels (flash-attention buffers, matmul outputs), communication buffers and the
    parameter gradients. It is read from the allocator itself: under
    ``torch.profiler.profile(profile_memory=True)`` the CPU allocator reports every
    allocation and free together with its running total of allocated bytes (updated under
    its lock), and the peak is the maximum of that total minus its value at the start. It
    counts allocations made on the profiled (main) thread, which is where every tensor of
    the step is created; ``end_bytes`` (what is still held after the step's outputs are
    dropped) is ``grad_bytes`` plus the few KB of index tensors the layout caches. Memory malloc'ed by gloo
    itself (outside PyTorch's allocator) is not included.

    Without FSDP every rank holds all parameter gradients, which do not shrink with CP, so
    ``peak_bytes_no_grads_per_rank`` repeats the peak with the allocations that become
    ``param.grad`` left out (identified by address), and ``peak_scaling_no_grads`` its scaling.

``bytes_sent_per_rank``
    What the CP attention handed to communication calls during the step
    (``titan_cp.attention.comm.count_comm``): 0 at CP 1, and proof that the ring ran at CP > 1.

``constant_saved`` (CP > 1)
    Saved tensors with the same module, dtype and shape at CP 1 and at this CP (per-token
    tensors change shape with the local length, so these do not shrink at all), with their
    bytes; ``constant_saved_bytes`` is their sum.

``non_shrinking`` (CP > 1)
    Saved bytes grouped by the module that saved them (layer indices folded, ``layers.*``):
    the groups whose own scaling ``bytes(1) / (cp * bytes(cp))`` is below 0.9, largest excess
    ``bytes(cp) - bytes(1)/cp`` first, with their tensors' dtypes and shapes.

``--case full-step`` runs one rank's whole training step at full size on fake tensors and a fake process
group (``benchmarks.full_step``: parameters, optimizer state, saved and recomputed tensors, buffers,
the checkpoint store's host copies, FSDP's CPU offload) and prints one JSON line per configuration: the
device bytes' peak and the host bytes measured, beside the planner's ``planned_device_bytes`` and
``planned_host_bytes`` for the same config. Without config overrides it runs the default cases (Llama 3 8B
at 131072 tokens on CP 8 with nothing offloaded, and the planner's longest lengths on 8 H100 and 8 H200);
with them (the trainer's ``--section.key value``), that one configuration::

    python scripts/bench_memory.py --case full-step
    python scripts/bench_memory.py --case full-step --gpu h200 --model.flavor 8B --training.seq_len 1048576 \
        --parallelism.context_parallel_degree 8 --activation_checkpoint.mode full

``--ac full`` checkpoints every block (``saved_bytes`` then holds each block's input, kept by
the checkpoint, instead of the block's own saved tensors). The counting lives in
``benchmarks.memory``; the planner (``python -m titan_cp.plan``) predicts ``saved_bytes``
exactly and the peak within 10%.

Model: ``debugmodel_gqa`` (dim 256, 6 layers, 16 heads, 4 KV heads) with the byte tokenizer's
vocabulary (259), fp32, batch 1; the row packs ``--docs`` documents whose lengths are
proportional to ``docs, docs-1, ..., 1``. One thread per rank (the CPU flash kernel sizes
its scratch buffers by the thread count, so all degrees use the same).

    python scripts/bench_memory.py                                  # seq 8192, cp 1 2 4 8
    python scripts/bench_memory.py --seq-len 4096 --cps 1 2 --plot /tmp/memory.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed: the checkout's

from benchmarks.full_step import BASE, default_cases, full_step_row  # noqa: E402
from benchmarks.memory import BYTE_VOCAB, measure_cp, measure_loss_memory, summarize  # noqa: E402


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cps = [r["cp"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    mib = 2**20
    series = [
        ("saved_bytes_per_rank", "saved for backward", "C0"),
        ("peak_bytes_per_rank", "peak (allocator)", "C1"),
        ("peak_bytes_no_grads_per_rank", "peak without param grads", "C2"),
    ]
    for key, label, color in series:
        ys = [r[key] / mib for r in rows]
        ax.plot(cps, ys, "o-", color=color, label=label)
        ax.plot(cps, [ys[0] / c for c in cps], ":", color=color, alpha=0.6)
    ax.plot([], [], "k:", label="ideal 1/cp")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(cps, [str(c) for c in cps])
    ax.set_xlabel("cp degree (ring, doc_zigzag)")
    ax.set_ylabel("MiB per rank (max over ranks)")
    ax.set_title(f"forward+backward memory per rank, seq {rows[0]['seq_len']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def full_step(args, rest: list[str]) -> None:
    from titan_cp.config import load_config

    cases = [(args.gpu, [*BASE, *rest])] if rest else default_cases(ngpu=args.ngpu)
    for gpu, overrides in cases:
        row = full_step_row(load_config(overrides), args.ngpu, gpu)
        print(json.dumps(row), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=("cp", "loss", "full-step"), default="cp")
    p.add_argument("--ngpu", type=int, default=8, help="--case full-step: ranks of the mesh")
    p.add_argument("--gpu", default="h100", help="--case full-step: the GPU planned for (with overrides)")
    p.add_argument("--tokens", type=int, default=16384, help="--case loss: tokens")
    p.add_argument("--vocab", type=int, default=128256, help="--case loss: vocabulary")
    p.add_argument("--dim", type=int, default=512, help="--case loss: model dim")
    p.add_argument(
        "--chunk-tokens", type=int, default=None, help="--case loss: tokens per chunk (default: 128 MiB of fp32 logits)"
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="--case loss")
    p.add_argument("--device", default="cpu", help="--case loss: cpu or cuda")
    p.add_argument(
        "--unchunked", action="store_true", help="--case loss: measure whole logits + F.cross_entropy instead"
    )
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--docs", type=int, default=4, help="documents packed in each row (1: one causal document)")
    p.add_argument("--flavor", default="debugmodel_gqa")
    p.add_argument("--vocab-size", type=int, default=BYTE_VOCAB, help="259: the byte tokenizer's")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--strategy", default="ring")
    p.add_argument("--balance", default="doc_zigzag")
    p.add_argument("--ulysses", type=int, default=1, help="hybrid: inner Ulysses degree")
    p.add_argument("--ac", choices=("none", "full"), default="none", help="activation checkpointing of every block")
    p.add_argument("--top", type=int, default=8, help="non_shrinking entries per row")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of bytes per rank vs cp")
    args, rest = p.parse_known_args(argv)
    if rest and args.case != "full-step":
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.case == "full-step":
        full_step(args, rest)
        return
    if args.case == "loss":
        row = measure_loss_memory(
            args.tokens,
            args.vocab,
            args.dim,
            args.chunk_tokens,
            getattr(torch, args.dtype),
            args.device,
            args.unchunked,
        )
        print(json.dumps(row), flush=True)
        return
    cfg = {
        k: getattr(args, k)
        for k in ("seq_len", "batch", "docs", "flavor", "vocab_size", "strategy", "balance", "ulysses", "ac")
    }
    cps = sorted(set(args.cps) | {1})
    results = {cp: measure_cp(cp, cfg) for cp in cps}
    rows = summarize(results, args.seq_len, args.top)
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
