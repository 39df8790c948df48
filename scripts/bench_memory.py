"""Per-rank activation memory of one forward+backward of the model under context parallelism
(``--case cp``, the default), or the peak of the chunked loss alone (``--case loss``).

``--case loss`` prints one JSON line: the peak bytes (above the inputs, gradients included) of
one forward + backward of the chunked output projection + cross-entropy
(``titan_cp.tools.memory.measure_loss_memory``) at ``--tokens`` x ``--vocab`` x ``--dim``,
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
    dropped) equals ``grad_bytes`` when no free was missed. Memory malloc'ed by gloo
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

Model: ``debugmodel_gqa`` (dim 256, 6 layers, 16 heads, 4 KV heads) with the byte tokenizer's
vocabulary (259), fp32, batch 1; the row packs ``--docs`` documents whose lengths are
proportional to ``docs, docs-1, ..., 1``. One thread per rank (the CPU flash kernel sizes
its scratch buffers by the thread count, so all degrees use the same).

    python scripts/bench_memory.py                                  # seq 8192, cp 1 2 4 8
    python scripts/bench_memory.py --seq-len 4096 --cps 1 2 --plot /tmp/memory.png
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from titan_cp.loss import IGNORE_INDEX, GlobalTokenLoss  # noqa: E402
from titan_cp.tools.memory import AllocatorTrace, allocator_trace, measure_loss_memory  # noqa: E402, F401
from titan_cp.step import Microbatch  # noqa: E402

BYTE_VOCAB = 259  # titan_cp.data.tokenizer.ByteTokenizer.vocab_size
OUTSIDE = "<no module: loss>"


# ----------------------------------------------------------------------------- data


def make_batch(seq_len: int, batch: int = 1, docs: int = 4, vocab_size: int = BYTE_VOCAB, seed: int = 0) -> Microbatch:
    """``batch`` identical-structure rows of ``docs`` packed documents (lengths proportional to
    ``docs, docs-1, ..., 1``); positions restart at each document; labels are the next token
    inside a document and ``IGNORE_INDEX`` on each document's last token."""
    if docs < 1 or docs > seq_len:
        raise ValueError(f"--docs must be in [1, seq_len], got {docs}")
    weights = list(range(docs, 0, -1))
    lens = [seq_len * w // sum(weights) for w in weights]
    lens[-1] += seq_len - sum(lens)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq_len), generator=g)
    labels = torch.full((batch, seq_len), IGNORE_INDEX)
    positions = torch.empty(batch, seq_len, dtype=torch.long)
    start = 0
    for n in lens:
        positions[:, start : start + n] = torch.arange(n)
        labels[:, start : start + n - 1] = tokens[:, start + 1 : start + n]
        start += n
    return Microbatch(tokens, labels, positions, torch.tensor([lens] * batch))


# ----------------------------------------------------------------- saved tensors


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, nbytes) of the untyped storage under ``t``: equal for all views of one buffer."""
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


@dataclass
class SavedRecord:
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    module: str


class ModuleScope:
    """Tracks the innermost module whose forward is running (hooks on every submodule)."""

    def __init__(self, model: nn.Module | None):
        self.stack: list[str] = []
        self._handles = []
        if model is None:
            return
        for name, mod in model.named_modules():
            if not name:
                continue
            self._handles.append(mod.register_forward_pre_hook(self._push(name)))
            self._handles.append(mod.register_forward_hook(self._pop, always_call=True))

    def _push(self, name: str):
        def hook(_mod, _args):
            self.stack.append(name)

        return hook

    def _pop(self, _mod, _args, _out):
        self.stack.pop()

    @property
    def current(self) -> str:
        return re.sub(r"layers\.\d+", "layers.*", self.stack[-1]) if self.stack else OUTSIDE

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class SavedTensorCounter:
    """Counts, exactly, the bytes autograd saves for backward inside ``with counter:``.

    Storages are deduplicated (see :func:`storage_key`); storages of ``exclude`` (the model
    parameters) are tallied apart in ``param_bytes``. Saved tensors stay referenced by the
    graph until the backward, so no address can be reused by another saved storage.
    ``scope`` (a :class:`ModuleScope`) names the module that saved each tensor.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), scope: ModuleScope | None = None):
        self._exclude = {storage_key(p) for p in exclude}
        self._scope = scope
        self.records: dict[tuple[int, int], SavedRecord] = {}
        self.params: dict[tuple[int, int], int] = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key in self._exclude:
            self.params[key] = key[1]
        elif key not in self.records:
            module = self._scope.current if self._scope is not None else ""
            self.records[key] = SavedRecord(key[1], str(t.dtype).replace("torch.", ""), tuple(t.shape), module)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedTensorCounter:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    @property
    def saved_bytes(self) -> int:
        return sum(r.nbytes for r in self.records.values())

    @property
    def param_bytes(self) -> int:
        return sum(self.params.values())

    def by_module(self) -> dict[str, dict]:
        """``{module: {"bytes", "tensors": {"dtype[shape]": [count, bytes]}}}`` over the saved storages
        (the shape is that of the first view saved of each storage)."""
        out: dict[str, dict] = defaultdict(lambda: {"bytes": 0, "tensors": defaultdict(lambda: [0, 0])})
        for r in self.records.values():
            out[r.module]["bytes"] += r.nbytes
            entry = out[r.module]["tensors"][f"{r.dtype}{list(r.shape)}"]
            entry[0] += 1
            entry[1] += r.nbytes
        return {m: {"bytes": v["bytes"], "tensors": dict(v["tensors"])} for m, v in out.items()}


# ------------------------------------------------------------------- measurement


def measure_step(model: nn.Module, local: Microbatch, loss_fn: Callable, scope_model: bool = True) -> dict:
    """One forward + loss + backward of ``model`` on ``local``; the exact counts (see module docstring)."""
    params = list(model.parameters())
    for p in params:
        p.grad = None
    gc.collect()
    scope = ModuleScope(model if scope_model else None)
    try:
        with allocator_trace() as trace:
            with SavedTensorCounter(params, scope) as counter:
                # as in training: the model computes the summed token CE itself, chunk by chunk
                loss_sum = model(local.tokens, positions=local.positions, doc_lens=local.doc_lens, labels=local.labels)
                loss = loss_fn(loss_sum, local.labels)
            loss.backward()
            del loss_sum, loss
    finally:
        scope.remove()
    grads = {storage_key(p.grad) for p in params if p.grad is not None}
    return {
        "local_tokens": int(local.tokens.numel()),
        "saved_bytes": counter.saved_bytes,
        "saved_param_bytes": counter.param_bytes,
        "saved_by_module": counter.by_module(),
        "peak_bytes": trace.peak,
        "peak_bytes_no_grads": trace.peak_without(ptr for ptr, _ in grads),
        "end_bytes": trace.end,
        "grad_bytes": sum(n for _, n in grads),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "alloc_events": len(trace.events),
        "alloc_trace_consistent": trace.consistent,
    }


def _rank_fn(rank: int, world: int, cfg: dict) -> dict:
    """One rank: build the model (CP over all ``world`` ranks when world > 1), measure one step."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_cp.model import build_model
    from titan_cp.parallel.cp import apply_cp

    torch.manual_seed(0)
    model = build_model(cfg["flavor"], device="cpu", vocab_size=cfg["vocab_size"])
    if world > 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        apply_cp(model, mesh, cfg["strategy"], cfg["balance"])
    full = make_batch(cfg["seq_len"], cfg["batch"], cfg["docs"], cfg["vocab_size"])
    loss_fn = GlobalTokenLoss()
    loss_fn.global_valid_tokens = int((full.labels != IGNORE_INDEX).sum())
    local = full.shard(world, rank, cfg["balance"])
    del full
    from titan_cp.attention.comm import count_comm

    with count_comm() as comm:  # proof that the CP attention really exchanged K/V
        result = measure_step(model, local, loss_fn)
    result["bytes_sent"] = comm.bytes_sent
    return result


def measure_cp(cp: int, cfg: dict, runner: Callable | None = None) -> list[dict]:
    """Per-rank results of :func:`_rank_fn` on ``cp`` gloo ranks. ``runner(world, fn, *args)``
    runs it (e.g. ``PoolCache.run``); by default a fresh :class:`DistPool` is started and closed."""
    if runner is not None:
        return runner(cp, _rank_fn, cfg)
    from titan_cp.spawn import DistPool

    pool = DistPool(cp, collective_timeout_s=600, threads=cfg.get("threads", 1))
    try:
        return pool.run(_rank_fn, cfg, timeout=1200)
    finally:
        pool.close()


def non_shrinking(base: dict, mine: dict, cp: int, threshold: float = 0.9, top: int = 8) -> list[dict]:
    """Module groups of saved bytes whose own scaling ``bytes(1) / (cp * bytes(cp))`` is below ``threshold``."""
    rows = []
    for module in set(base) | set(mine):
        b1 = base.get(module, {"bytes": 0, "tensors": {}})
        bc = mine.get(module, {"bytes": 0, "tensors": {}})
        scaling = b1["bytes"] / (cp * bc["bytes"]) if bc["bytes"] else float("inf")
        if scaling < threshold:
            rows.append({
                "module": module, "bytes_cp1": b1["bytes"], "bytes": bc["bytes"],
                "excess_bytes": bc["bytes"] - b1["bytes"] // cp, "scaling": round(scaling, 4),
                "tensors_cp1": b1["tensors"], "tensors": bc["tensors"],
            })
    rows.sort(key=lambda r: -r["excess_bytes"])
    return rows[:top]


def constant_saved(base: dict, mine: dict) -> list[dict]:
    """Saved tensors of the same module, dtype and shape at cp 1 and at this cp: they do not
    shrink at all (per-token tensors change shape with the local sequence length)."""
    rows = []
    for module, entry in mine.items():
        for tensor, (count, nbytes) in entry["tensors"].items():
            if tensor in base.get(module, {}).get("tensors", {}):
                rows.append({"module": module, "tensor": tensor, "count": count, "bytes": nbytes})
    return sorted(rows, key=lambda r: -r["bytes"])


def summarize(results: dict[int, list[dict]], seq_len: int, top: int = 8) -> list[dict]:
    """One row per cp degree (max over ranks) with the scalings relative to cp 1."""
    if 1 not in results:
        raise ValueError("--cps must include 1: the scalings are relative to the plain model")
    rows = []
    worst = {cp: max(ranks, key=lambda r: r["saved_bytes"]) for cp, ranks in results.items()}
    top_of = lambda cp, k: max(r[k] for r in results[cp])  # noqa: E731
    s1, p1, n1 = top_of(1, "saved_bytes"), top_of(1, "peak_bytes"), top_of(1, "peak_bytes_no_grads")
    for cp in sorted(results):
        saved, peak, peak_ng = top_of(cp, "saved_bytes"), top_of(cp, "peak_bytes"), top_of(cp, "peak_bytes_no_grads")
        row = {
            "cp": cp, "seq_len": seq_len, "local_tokens": worst[cp]["local_tokens"],
            "saved_bytes_per_rank": saved, "peak_bytes_per_rank": peak,
            "scaling": round(s1 / (cp * saved), 4), "peak_scaling": round(p1 / (cp * peak), 4),
            "peak_bytes_no_grads_per_rank": peak_ng, "peak_scaling_no_grads": round(n1 / (cp * peak_ng), 4),
            "saved_bytes_min_rank": min(r["saved_bytes"] for r in results[cp]),
            "saved_param_bytes": top_of(cp, "saved_param_bytes"),
            "grad_bytes": top_of(cp, "grad_bytes"), "param_bytes": top_of(cp, "param_bytes"),
            "end_bytes": top_of(cp, "end_bytes"), "bytes_sent_per_rank": top_of(cp, "bytes_sent"),
            "alloc_trace_consistent": all(r["alloc_trace_consistent"] for r in results[cp]),
        }
        if cp > 1:
            base, mine = worst[1]["saved_by_module"], worst[cp]["saved_by_module"]
            row["non_shrinking"] = non_shrinking(base, mine, cp, top=top)
            const = constant_saved(base, mine)
            row["constant_saved_bytes"] = sum(r["bytes"] for r in const)
            row["constant_saved"] = const[:top]
        rows.append(row)
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cps = [r["cp"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    mib = 2**20
    series = [("saved_bytes_per_rank", "saved for backward", "C0"), ("peak_bytes_per_rank", "peak (allocator)", "C1"),
              ("peak_bytes_no_grads_per_rank", "peak without param grads", "C2")]
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=("cp", "loss"), default="cp")
    p.add_argument("--tokens", type=int, default=16384, help="--case loss: tokens")
    p.add_argument("--vocab", type=int, default=128256, help="--case loss: vocabulary")
    p.add_argument("--dim", type=int, default=512, help="--case loss: model dim")
    p.add_argument("--chunk-tokens", type=int, default=None, help="--case loss: tokens per chunk (default: 128 MiB of fp32 logits)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="--case loss")
    p.add_argument("--device", default="cpu", help="--case loss: cpu or cuda")
    p.add_argument("--unchunked", action="store_true", help="--case loss: measure whole logits + F.cross_entropy instead")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--docs", type=int, default=4, help="documents packed in each row (1: one causal document)")
    p.add_argument("--flavor", default="debugmodel_gqa")
    p.add_argument("--vocab-size", type=int, default=BYTE_VOCAB, help="259: the byte tokenizer's")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--strategy", default="ring")
    p.add_argument("--balance", default="doc_zigzag")
    p.add_argument("--top", type=int, default=8, help="non_shrinking entries per row")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of bytes per rank vs cp")
    args = p.parse_args(argv)
    if args.case == "loss":
        row = measure_loss_memory(args.tokens, args.vocab, args.dim, args.chunk_tokens, getattr(torch, args.dtype),
                                  args.device, args.unchunked)
        print(json.dumps(row), flush=True)
        return
    cfg = {k: getattr(args, k) for k in ("seq_len", "batch", "docs", "flavor", "vocab_size", "strategy", "balance")}
    cps = sorted(set(args.cps) | {1})
    results = {cp: measure_cp(cp, cfg) for cp in cps}
    rows = summarize(results, args.seq_len, args.top)
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
