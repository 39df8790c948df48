"""A disk that fills up, for the trainer's tests: files written under a path prefix go to a disk
with ``free`` bytes left, then every write is refused with ``ENOSPC``, as the kernel refuses it.

Run as the trainer, under the launcher (each rank a process with its own ``free`` bytes)::

    python -m titan_cp.run --nproc-per-node 2 -m titan_cp.testing.full_disk PREFIX FREE [titan_cp.train arguments]

or in a process of the tests' pools: ``with full_disk(prefix, free): ...``.

What is simulated is the lowest layer Python's files have: ``open`` (and ``Path.open``, which calls
it) of a file under ``prefix`` for writing returns Python's own buffered (and text) layers over a
:class:`FillingFile`, a real ``io.FileIO`` whose ``write`` writes what still fits (a short count, as
``write(2)`` returns on a filling disk) and then raises ``OSError(ENOSPC)``. Everything above it is
the code a user runs: the buffers, ``torch.save``'s zip writer, DCP, the trainer, the launcher. The
free bytes the trainer reports are the real disk's (``shutil.disk_usage``).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_real_open = io.open
_left = {"bytes": 0}  # what the simulated disk still takes (this process)


class FillingFile(io.FileIO):
    """A file on the simulated disk: writes take from its free bytes, and fail once none are left."""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if _left["bytes"] <= 0 and len(view):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        written = super().write(view[: _left["bytes"]]) or 0
        _left["bytes"] -= written
        return written


def _open_on(prefix: str):  # noqa: ANN202 - builtins.open's signature
    """``open`` with the files written under ``prefix`` on the simulated disk (see the module docstring)."""

    def open_(file: Any, mode: str = "r", buffering: int = -1, encoding: str | None = None, errors: str | None = None,
              newline: str | None = None, closefd: bool = True, opener: Any = None) -> Any:  # fmt: skip
        writes = any(c in mode for c in "wax+")
        if not (writes and isinstance(file, (str, os.PathLike)) and str(Path(file).absolute()).startswith(prefix)):
            return _real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
        raw = FillingFile(file, mode.replace("b", "").replace("t", ""), closefd, opener)
        if "b" in mode and buffering == 0:
            return raw
        size = buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE
        buffered = io.BufferedRandom(raw, size) if "+" in mode else io.BufferedWriter(raw, size)
        if "b" in mode:
            return buffered
        return io.TextIOWrapper(buffered, encoding, errors, newline, line_buffering=buffering == 1)

    return open_


@contextlib.contextmanager
def full_disk(prefix: str | Path, free: int) -> Iterator[None]:
    """Files written under ``prefix`` (a path: a file, or a folder with what is under it) in the body
    go to a disk with ``free`` bytes left."""
    patched = _open_on(str(Path(prefix).absolute()))
    _left["bytes"] = free
    io.open = builtins.open = patched
    try:
        yield
    finally:
        io.open = builtins.open = _real_open


def main(argv: list[str] | None = None) -> None:
    """``PREFIX FREE [titan_cp.train arguments]``: the trainer's command with the disk of the module docstring."""
    from titan_cp.errors import run_cli
    from titan_cp.train import main as train

    prefix, free, *rest = sys.argv[1:] if argv is None else argv
    with full_disk(prefix, int(free)):
        run_cli(train, rest)


if __name__ == "__main__":
    main()
