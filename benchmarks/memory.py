"""Memory instrumentation: bytes saved for backward, the CPU allocator's exact running total,
and the peak of one training step or of the loss alone.

``SavedTensorCounter`` counts every tensor autograd saves (a ``saved_tensors_hooks`` pack hook,
storages deduplicated, parameters apart); ``measure_step`` runs one forward + loss + backward
under it and under ``allocator_trace``; ``measure_cp`` does that on a pool of gloo ranks per
CP degree, ``measure_mesh`` on a TP / PP / FSDP mesh, and ``summarize`` turns the per-rank
results into ``scripts/bench_memory.py``'s rows (see that script for what each number means).
The planner (``titan_cp.plan``) predicts the same ``saved_bytes`` exactly and the peak within
10% (``tests/test_plan.py``).

``allocator_trace`` reads every allocation and free of PyTorch's CPU allocator, with the
allocator's own running total, from ``torch.profiler`` (``profile_memory=True``); on CUDA
the caching allocator's peak counter serves the same purpose. ``measure_loss_memory`` uses
them on the chunked output projection + cross-entropy (``titan_cp.loss``), next to the
bytes of the whole fp32 logits it never allocates (``scripts/bench_memory.py --case loss``).
"""

from __future__ import annotations

import contextlib
import gc
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from titan_cp.loss import IGNORE_INDEX, LOSS_CHUNK_BYTES, GlobalTokenLoss, chunked_cross_entropy_sum
from titan_cp.step import Microbatch

BYTE_VOCAB = 259  # titan_cp.data.tokenizer.ByteTokenizer.vocab_size
OUTSIDE = "<no module: loss>"


@dataclass
class AllocatorTrace:
    """The CPU allocator's events during ``with allocator_trace() as trace:`` (filled on exit).

    ``events``: ``(ptr, signed nbytes, allocator running total)`` in time order. Totals are
    relative to the allocator's running total just before the first event.
    """

    events: list[tuple[int, int, int]] = field(default_factory=list)
    consistent: bool = True  # every running total equals the previous one plus the event's size

    @property
    def peak(self) -> int:
        return max((total for _, _, total in self.events), default=0)

    @property
    def end(self) -> int:
        return self.events[-1][2] if self.events else 0

    def peak_without(self, ptrs: Iterable[int]) -> int:
        """Peak of the running total with the *last* allocation at each of ``ptrs`` left out
        (e.g. the storages that end up as ``param.grad``): those are the blocks still held at
        the end, so their bytes are subtracted from the first moment they exist."""
        last = {}
        wanted = set(ptrs)
        for i, (ptr, size, _) in enumerate(self.events):
            if size > 0 and ptr in wanted:
                last[ptr] = i
        held = dict.fromkeys(last.values(), True)
        peak = excluded = 0
        for i, (_, size, total) in enumerate(self.events):
            if i in held:
                excluded += size
            peak = max(peak, total - excluded)
        return peak


@contextlib.contextmanager
def allocator_trace():
    """Record the CPU allocator's allocations and frees (``torch.profiler``, ``profile_memory``)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    trace = AllocatorTrace()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        # allocations only: with this thread's op events off (the allocator still reports every block)
        # the profiler's stop and the walk below handle a fraction of the events (under CP the small
        # ops outnumber the allocations); the counts are the same
        torch._C._autograd._enable_record_function(False)
        try:
            yield trace
        finally:
            torch._C._autograd._enable_record_function(True)
    allocs = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            f = node.extra_fields
            allocs.append((node.start_time_ns, f.id, f.ptr, f.alloc_size, f.total_allocated))
    allocs.sort(key=lambda a: (a[0], a[1]))
    if allocs:
        base = allocs[0][4] - allocs[0][3]
        prev = base
        for _, _, ptr, size, total in allocs:
            trace.consistent &= total == prev + size
            prev = total
            trace.events.append((ptr, size, total - base))


def measure_loss_memory(
    tokens: int = 16384,
    vocab: int = 128256,
    dim: int = 512,
    chunk_tokens: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    unchunked: bool = False,
    seed: int = 0,
) -> dict:
    """Peak bytes above the inputs of one loss forward + backward from hidden states ``(tokens, dim)``
    and an output weight ``(vocab, dim)`` (both requiring grad), chunked as in training, or
    ``unchunked`` (logits, then ``F.cross_entropy``: the reference, for small sizes).

    The peak includes the gradients (``dh``, ``dW``: ``grad_bytes``), which any loss must
    produce. ``fp32_logits_bytes`` is ``tokens * vocab * 4``, the one tensor the chunked loss
    never holds; the target is ``peak_fraction = peak_bytes / fp32_logits_bytes <= 0.1``.
    """
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, dim, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = (dim**-0.5 * torch.randn(vocab, dim, generator=g)).to(device=device, dtype=dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    labels[::17] = IGNORE_INDEX
    chunk = chunk_tokens or max(1, LOSS_CHUNK_BYTES // (4 * vocab))

    def step() -> float:
        if unchunked:
            loss = torch.nn.functional.cross_entropy(
                (h @ w.t()).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum"
            )
        else:
            loss = chunked_cross_entropy_sum(h, w, labels, chunk)
        loss.backward()
        return loss.item()

    gc.collect()
    if device == "cpu":
        with allocator_trace() as trace:
            loss = step()
        peak, consistent = trace.peak, trace.consistent
    else:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss = step()
        torch.cuda.synchronize(device)
        peak, consistent = torch.cuda.max_memory_allocated(device) - base, True
    logits = tokens * vocab * 4
    return {
        "case": "loss",
        "tokens": tokens,
        "vocab": vocab,
        "dim": dim,
        "dtype": str(dtype).replace("torch.", ""),
        "device": device,
        "method": "unchunked" if unchunked else "chunked",
        "chunk_tokens": None if unchunked else chunk,
        "peak_bytes": peak,
        "fp32_logits_bytes": logits,
        "peak_fraction": round(peak / logits, 4),
        "grad_bytes": (h.numel() + w.numel()) * h.element_size(),
        "loss": loss,
        "alloc_trace_consistent": consistent,
    }


def make_batch(seq_len: int, batch: int = 1, docs: int = 4, vocab_size: int = BYTE_VOCAB, seed: int = 0) -> Microbatch:
    """``batch`` identical-structure rows of ``docs`` packed documents (lengths proportional to
    ``docs, docs-1, ..., 1``), random tokens (see :func:`titan_cp.testing.packed_batch`)."""
    from titan_cp.data.row_mixes import proportional_doc_lens
    from titan_cp.testing import packed_batch

    return packed_batch([proportional_doc_lens(seq_len, docs)] * batch, vocab_size, seed)


# ----------------------------------------------------------------- saved tensors


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, nbytes) of the untyped storage under ``t``: equal for all views of one buffer.

    A wrapper subclass (tensor parallelism saves ``DTensor``s, whose local shard may itself be a
    collective's ``AsyncCollectiveTensor``) is keyed by the storage of the tensor it wraps."""
    while is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        t = getattr(t, inner[0])
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

    Under activation checkpointing a checkpointed block saves nothing through autograd's hooks
    (``torch.utils.checkpoint`` installs its own): what it keeps for the backward is its input,
    held by the checkpoint to rerun the block. :meth:`watch_checkpoints` counts those inputs too.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), scope: ModuleScope | None = None):
        self._exclude = {storage_key(p) for p in exclude}
        self._scope = scope
        self.records: dict[tuple[int, int], SavedRecord] = {}
        self.params: dict[tuple[int, int], int] = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._active = False

    def watch_checkpoints(self, model: nn.Module) -> list:
        """Count the tensor inputs of every activation-checkpointed block of ``model`` as saved
        (module name ``<block>``, layer indices folded); returns the hook handles to remove."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        handles = []
        for name, mod in model.named_modules():
            if isinstance(mod, CheckpointWrapper):
                label = re.sub(r"layers\.\d+", "layers.*", name)

                def hook(_mod, args, label=label):
                    if self._active:
                        for a in args:
                            if isinstance(a, torch.Tensor) and a.requires_grad:
                                self._record(a, label)

                handles.append(mod.register_forward_pre_hook(hook))
        return handles

    def _record(self, t: torch.Tensor, module: str) -> None:
        key = storage_key(t)
        if key in self._exclude:
            self.params[key] = key[1]
        elif key not in self.records:
            self.records[key] = SavedRecord(key[1], str(t.dtype).replace("torch.", ""), tuple(t.shape), module)

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
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
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
    counter = SavedTensorCounter(params, scope)
    handles = counter.watch_checkpoints(model)
    try:
        with allocator_trace() as trace:
            with counter:
                # as in training: the model computes the summed token CE itself, chunk by chunk
                loss_sum = model(local.tokens, positions=local.positions, doc_lens=local.doc_lens, labels=local.labels)
                loss = loss_fn(loss_sum, local.labels)
            loss.backward()
            del loss_sum, loss
    finally:
        scope.remove()
        for h in handles:
            h.remove()
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
    """One rank: build the model (CP over all ``world`` ranks when world > 1, activation
    checkpointing ``cfg["ac"]``), measure one step (see :func:`measure_step`)."""
    from titan_cp.attention.comm import count_comm
    from titan_cp.families.llama3 import build_model
    from titan_cp.parallel import apply_ac
    from titan_cp.parallel.cp import apply_cp
    from titan_cp.testing import strategy_mesh

    torch.manual_seed(0)
    model = build_model(cfg["flavor"], device="cpu", vocab_size=cfg["vocab_size"])
    mesh = strategy_mesh(cfg["strategy"], world, cfg.get("ulysses", 1)) if world > 1 else None
    cp = apply_cp(model, mesh, cfg["strategy"], cfg["balance"])
    apply_ac(model, cfg.get("ac", "none"))
    full = make_batch(cfg["seq_len"], cfg["batch"], cfg["docs"], cfg["vocab_size"])
    loss_fn = GlobalTokenLoss()
    loss_fn.global_valid_tokens = int((full.labels != IGNORE_INDEX).sum())
    local = cp.shard(full)
    del full
    with count_comm() as comm:  # what the CP attention exchanged (the planner's cp bytes)
        result = measure_step(model, local, loss_fn)
    result["bytes_sent"] = comm.bytes_sent
    return result


def measure_cp(cp: int, cfg: dict, runner: Callable | None = None) -> list[dict]:
    """Per-rank results of :func:`_rank_fn` on ``cp`` gloo ranks. ``runner(world, fn, *args)``
    runs it (e.g. ``PoolCache.run``); by default a fresh :class:`DistPool` is started and closed."""
    if runner is not None:
        return runner(cp, _rank_fn, cfg)
    from titan_cp.testing import DistPool

    pool = DistPool(cp, collective_timeout_s=600, threads=cfg.get("threads", 1))
    try:
        return pool.run(_rank_fn, cfg, timeout=1200)
    finally:
        pool.close()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _mesh_rank_fn(rank: int, world: int, cfg: dict) -> dict:
    """One rank of a TP / PP / FSDP mesh (``cfg``: ``tp``, ``pp``, ``dp_shard``, ``microbatches``,
    ``ac``, ``flavor``, ``n_layers``, ``vocab_size``, ``seq_len``, ``batch``, ``docs``): the model
    built as the trainer builds it, one warm-up step (the pipeline's shape inference), then
    ``repeats`` steps measured (default 1). ``peak_bytes`` is the least of their peaks: gloo runs
    collectives on its own threads, so the buffers of an asynchronous collective may outlive
    their last use by a varying margin (under TP with full AC, up to +25% at the debug model's
    sizes). ``saved_bytes`` is exact only without a pipeline (microbatches reuse addresses)."""
    from titan_cp.families.llama3 import LlamaBuilder, model_args
    from titan_cp.mesh import ParallelDims
    from titan_cp.parallel.build import ParallelizeOptions, build_parallel_model
    from titan_cp.step import forward_backward

    pd = ParallelDims(
        dp_replicate=1,
        dp_shard=cfg.get("dp_shard", 1),
        cp=1,
        tp=cfg.get("tp", 1),
        pp=cfg.get("pp", 1),
        world_size=world,
    )
    pd.build_mesh("cpu")
    loss_fn = GlobalTokenLoss()
    args = model_args(cfg["flavor"], n_layers=cfg["n_layers"], vocab_size=cfg["vocab_size"])
    built = build_parallel_model(
        LlamaBuilder(args),
        pd,
        ParallelizeOptions(ac_mode=cfg.get("ac", "none")),
        "cpu",
        0,
        loss_fn,
        cfg.get("microbatches", 1),
    )
    full = make_batch(cfg["seq_len"], cfg["batch"], cfg["docs"], cfg["vocab_size"])
    loss_fn.global_valid_tokens = int((full.labels != IGNORE_INDEX).sum())
    params = [p for part in built.parts for p in part.parameters()]

    def step() -> None:
        forward_backward(built.parts, full, loss_fn, built.schedule, built.has_first, built.has_last)

    step()
    peaks = []
    for _ in range(cfg.get("repeats", 1)):
        for p in params:
            p.grad = None
        gc.collect()
        counter = SavedTensorCounter([_local(p) for p in params])
        handles = [h for part in built.parts for h in counter.watch_checkpoints(part)]
        with allocator_trace() as trace:
            with counter:
                step()
        for h in handles:
            h.remove()
        peaks.append(trace.peak)
    grads = [_local(p.grad) for p in params if p.grad is not None]
    return {
        "saved_bytes": counter.saved_bytes,
        "peak_bytes": min(peaks),
        "peak_bytes_each": peaks,
        "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
        "first": built.has_first,
        "last": built.has_last,
    }


def measure_mesh(cfg: dict, runner: Callable) -> list[dict]:
    """Per-rank results of one step on a ``tp x pp x dp_shard`` mesh of gloo ranks (see :func:`_mesh_rank_fn`);
    ``runner(world, fn, *args)`` runs it (e.g. ``PoolCache.run``)."""
    world = cfg.get("tp", 1) * cfg.get("pp", 1) * cfg.get("dp_shard", 1)
    return runner(world, _mesh_rank_fn, cfg)


def non_shrinking(base: dict, mine: dict, cp: int, threshold: float = 0.9, top: int = 8) -> list[dict]:
    """Module groups of saved bytes whose own scaling ``bytes(1) / (cp * bytes(cp))`` is below ``threshold``."""
    rows = []
    for module in set(base) | set(mine):
        b1 = base.get(module, {"bytes": 0, "tensors": {}})
        bc = mine.get(module, {"bytes": 0, "tensors": {}})
        scaling = b1["bytes"] / (cp * bc["bytes"]) if bc["bytes"] else float("inf")
        if scaling < threshold:
            rows.append(
                {
                    "module": module,
                    "bytes_cp1": b1["bytes"],
                    "bytes": bc["bytes"],
                    "excess_bytes": bc["bytes"] - b1["bytes"] // cp,
                    "scaling": round(scaling, 4),
                    "tensors_cp1": b1["tensors"],
                    "tensors": bc["tensors"],
                }
            )
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
            "cp": cp,
            "seq_len": seq_len,
            "local_tokens": worst[cp]["local_tokens"],
            "saved_bytes_per_rank": saved,
            "peak_bytes_per_rank": peak,
            "scaling": round(s1 / (cp * saved), 4),
            "peak_scaling": round(p1 / (cp * peak), 4),
            "peak_bytes_no_grads_per_rank": peak_ng,
            "peak_scaling_no_grads": round(n1 / (cp * peak_ng), 4),
            "saved_bytes_min_rank": min(r["saved_bytes"] for r in results[cp]),
            "saved_param_bytes": top_of(cp, "saved_param_bytes"),
            "grad_bytes": top_of(cp, "grad_bytes"),
            "param_bytes": top_of(cp, "param_bytes"),
            "end_bytes": top_of(cp, "end_bytes"),
            "bytes_sent_per_rank": top_of(cp, "bytes_sent"),
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
