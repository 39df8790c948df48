"""A stand-in ``fla`` for a block of code, for the tests and the benchmarks that run titan_cp's ``fla`` backend
(:mod:`titan_cp.attention.linear.fla`) on a CPU: ``fla`` and ``fla.ops.gated_delta_rule`` in ``sys.modules``
(with module specs, as an installed package has), its ``chunk_gated_delta_rule`` the function given."""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

NAMES = ("fla", "fla.ops", "fla.ops.gated_delta_rule")


@contextlib.contextmanager
def stand_in(chunk_gated_delta_rule: Callable[..., Any]) -> Iterator[None]:
    """``import fla`` finds a package whose ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` is the one given,
    inside the block, in this process; after it, nothing named ``fla`` is left (a process that goes on to other
    work: transformers must not find it). Refused where a real ``fla`` is imported: the stand-in would hide it."""
    from titan_cp.attention.linear import fla  # noqa: PLC0415

    assert not any(name in sys.modules for name in NAMES), "a real fla is imported: the stand-in would hide it"
    for name in NAMES:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
    sys.modules[NAMES[-1]].chunk_gated_delta_rule = chunk_gated_delta_rule  # type: ignore[attr-defined]
    fla.available.cache_clear()
    try:
        yield
    finally:
        for name in NAMES:
            sys.modules.pop(name, None)
        fla.available.cache_clear()
