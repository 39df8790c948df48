"""The self-check's section ``longest``: the longest row one device trains one step on, with and without the
long-context options, and the step time of each at 131072 tokens and at the longest length.

The model has Llama 3 8B's width (dim 4096, 32 heads, 8 K/V heads, SwiGLU 14336, its vocabulary) cut to
``layers`` blocks, so that the probe fits the device time; its weights in the compute dtype (one device:
no FSDP), full activation checkpointing, AdamW. Two configurations:

    plain    full activation checkpointing only
    offload  + the checkpointed inputs on the host (``cpu_offload``) and the feed-forward in tiles

A length fits when one whole step (forward, loss, backward, AdamW) runs without the device running out
of memory (``torch.OutOfMemoryError``). The search doubles from ``start`` tokens until a step does not
fit, then bisects to ``granule`` tokens (:func:`longest`). On a CPU the same code runs at toy sizes with
``limit_tokens`` standing in for the memory (tests).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from titan_cp.families.llama3.flavors import model_args
from titan_cp.families.llama3.model import Transformer
from titan_cp.parallel.ac import apply_ac
from titan_cp.parallel.tiled_mlp import apply_tiled_mlp

CONFIGS = {"plain": False, "offload": True}  # the long-context options off / on
TOY: dict[str, Any] = dict(  # check_longest's arguments for a CPU at toy sizes (selfcheck --small)
    layers=1, start=128, granule=128, cap=1024, limit_tokens=512, tile_tokens=64, dtype=torch.float32,
    dim=64, n_heads=4, n_kv_heads=2, vocab_size=259, multiple_of=32,
)  # fmt: skip


def build(
    layers: int,
    device: torch.device,
    dtype: torch.dtype,
    cpu_offload: bool,
    tile_tokens: int,
    flavor: str = "8B",
    **shape: Any,
) -> Transformer:
    """``flavor``'s model cut to ``layers`` blocks (``shape``: other ``ModelArgs`` fields, for toy sizes),
    its weights in ``dtype`` on ``device``, with full AC and the options."""
    args = dataclasses.replace(model_args(flavor), n_layers=layers, **shape)
    with torch.device(device):
        model = Transformer(args).to(dtype)
    model.init_weights(0)
    apply_tiled_mlp(model, tile_tokens)
    apply_ac(model, "full", 1, cpu_offload)
    return model


def step_seconds(model: Transformer, seq_len: int, device: torch.device) -> tuple[float, float]:
    """One training step on a row of ``seq_len`` tokens (one document): ``(seconds, loss)``."""
    g = torch.Generator().manual_seed(seq_len)
    tokens = torch.randint(0, model.args.vocab_size, (1, seq_len), generator=g).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    loss = model(tokens, labels=tokens) / seq_len
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    value = loss.item()  # waits for the step
    return time.perf_counter() - t0, value


def longest(fits: Callable[[int], bool], start: int, granule: int, cap: int) -> int:
    """The longest multiple of ``granule`` up to ``cap`` for which ``fits`` holds (0 if not even ``start``),
    doubling from ``start`` then bisecting; ``fits`` is assumed monotone."""
    if start % granule or start < granule:
        raise ValueError(f"start ({start}) must be a positive multiple of granule ({granule})")
    if not fits(start):
        return 0
    lo, hi = start, start * 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + granule)
    while hi - lo > granule:
        mid = (lo + hi) // 2 // granule * granule
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _runs(model, device, limit_tokens: int | None) -> Callable[[int], float | None]:
    """A step at a length: its seconds, or None where it runs out of memory (or past ``limit_tokens``)."""

    def run(n: int) -> float | None:
        if limit_tokens is not None and n > limit_tokens:
            return None
        try:
            return step_seconds(model, n, device)[0]
        except torch.OutOfMemoryError:
            return None
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()

    return run


def check_longest(
    device: torch.device,
    layers: int = 4,
    start: int = 131072,
    granule: int = 65536,
    cap: int = 2**24,
    limit_tokens: int | None = None,
    tile_tokens: int = 8192,
    dtype: torch.dtype = torch.bfloat16,
    **shape: Any,
) -> list[dict]:
    """One record per configuration of :data:`CONFIGS` (module docstring): ``longest_seq_len``, and
    ``step_seconds_at_start`` / ``step_seconds_at_longest``; ``status`` ``error`` where not even ``start``
    tokens train."""
    records = []
    for name, on in CONFIGS.items():
        tiles = tile_tokens if on else 0
        rec = dict(section="longest", config=name, layers=layers, start=start, cpu_offload=on, tile_tokens=tiles)
        model = build(layers, device, dtype, on, tiles, **shape)
        run = _runs(model, device, limit_tokens)
        times: dict[int, float] = {}

        def fits(n: int, run=run, times=times) -> bool:
            seconds = run(n)
            if seconds is not None:
                times[n] = seconds
            return seconds is not None

        n = longest(fits, start, granule, cap)
        rec.update(longest_seq_len=n, status="ok" if n else "error")
        if n:
            rec.update(step_seconds_at_start=times[start], step_seconds_at_longest=times[n])
        records.append(rec)
        del model, run
    return records
