"""What a process logged and warned, for tests that run the commands on gloo pool processes
(pytest's ``caplog`` and ``recwarn`` see only the test's own process)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Captured:
    """``lines``: ``(level name, message)`` of each record logged under ``titan_cp``; ``warnings``:
    ``(category name, message)`` of each warning raised."""

    lines: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[tuple[str, str]] = field(default_factory=list)

    def messages(self, start: str) -> list[str]:
        """The logged messages that begin with ``start``."""
        return [m for _, m in self.lines if m.startswith(start)]


class _Recorder(logging.Handler):
    """A handler that appends each record's ``(level name, message)`` to ``out.lines``."""

    def __init__(self, out: Captured) -> None:
        super().__init__()
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.lines.append((record.levelname, record.getMessage()))


@contextlib.contextmanager
def captured(logger: str = "titan_cp") -> Iterator[Captured]:
    """Record the INFO and higher lines of ``logger`` (and its children) and every warning (each
    one, not once per place) raised in the body."""
    out = Captured()
    handler = _Recorder(out)
    log = logging.getLogger(logger)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield out
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        out.warnings += [(w.category.__name__, str(w.message)) for w in caught]
