"""Memory instrumentation: the CPU allocator's exact running total, and the loss's peak.

``allocator_trace`` reads every allocation and free of PyTorch's CPU allocator, with the
allocator's own running total, from ``torch.profiler`` (``profile_memory=True``); on CUDA
the caching allocator's peak counter serves the same purpose. ``measure_loss_memory`` uses
them on the chunked output projection + cross-entropy (``titan_cp.loss``), next to the
bytes of the whole fp32 logits it never allocates (``scripts/bench_memory.py --case loss``).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Iterable

import torch

from titan_cp.loss import IGNORE_INDEX, LOSS_CHUNK_BYTES, chunked_cross_entropy_sum


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
        yield trace
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
            loss = torch.nn.functional.cross_entropy((h @ w.t()).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
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
        "case": "loss", "tokens": tokens, "vocab": vocab, "dim": dim, "dtype": str(dtype).replace("torch.", ""),
        "device": device, "method": "unchunked" if unchunked else "chunked", "chunk_tokens": None if unchunked else chunk,
        "peak_bytes": peak, "fp32_logits_bytes": logits, "peak_fraction": round(peak / logits, 4),
        "grad_bytes": (h.numel() + w.numel()) * h.element_size(), "loss": loss, "alloc_trace_consistent": consistent,
    }
