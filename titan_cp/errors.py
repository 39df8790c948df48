"""The one error path of titan_cp's commands: the trainer, the planner, generation.

A command's ``main(argv)`` raises; :func:`run_cli` turns what it raises into an exit::

    user error  (bad input: a config key, an argument,   one line on stderr from rank 0,
                 a data file, a checkpoint)               ``error: <message>``; exit status 2;
                                                          every other rank exits 2 quietly
    failure     (any other exception: a bug, a crash)     the traceback, on every rank; exit 1
    interrupted (Ctrl-C)                                  ``interrupted`` from rank 0; exit 130

A *user error* is a :class:`UserError`, or a ``ValueError`` that a ``raise`` statement of
titan_cp's own code raised: the package raises ``ValueError`` naming the key, file or argument
(and the fix) for bad input, and uses ``assert`` for its own invariants. A ``ValueError`` raised
inside a library (torch, json, ...) or by a builtin (``int("x")``) is a failure: its traceback
is kept. ``--debug`` on the command line (removed before
``main`` sees it) or ``TITAN_CP_DEBUG=1`` prints the full traceback of a user error too, for
people reporting a bug.

A rank of a job (a process group open, or ``LOCAL_RANK`` set) ends through :func:`end_process`: its
output flushed, then ``os._exit`` with its status, without the interpreter's finalization (the function
says why).

Under a launcher the rank's exit status is the launcher's to report: ``python -m titan_cp.run``
(:mod:`titan_cp.run`) exits with it and adds no traceback of its own; stock ``torchrun`` follows
any failure with its ``ChildFailedError`` traceback and exits 1.

Why the other ranks wait before exiting: under ``torchrun`` every rank usually meets the same
bad input, and the first process to exit makes the launcher stop the rest. A rank other than 0
therefore waits up to :data:`PEER_GRACE_SECONDS` for that (so rank 0's line is printed, and
printed once); a rank still running then (the error was its own) prints its line, prefixed by
its rank, and exits.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn

DEBUG_ENV = "TITAN_CP_DEBUG"
DEBUG_FLAG = "--debug"
EXIT_USER_ERROR = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130
PEER_GRACE_SECONDS = 10.0
_PACKAGE = Path(__file__).resolve().parent


class UserError(ValueError):
    """Bad input from the user (a config key, an argument, a data file, a checkpoint): the message
    names what is wrong and how to fix it. A ``ValueError``, so code that catches those catches it."""


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun`` agreeing, for messages: ``plural(1, "rank")`` is ``"1 rank"``, ``plural(4, "rank")``
    ``"4 ranks"`` (nouns whose plural adds an s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def did_you_mean(word: Any, candidates: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the candidates close to ``word``, else ``""``."""
    by_lower = {c.lower(): c for c in candidates}
    close = [by_lower[c] for c in difflib.get_close_matches(str(word).lower(), list(by_lower), n=3, cutoff=0.6)]
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is bad input (see the module docstring): a :class:`UserError`, or a
    ``ValueError`` whose innermost frame is a ``raise`` statement in titan_cp's own code."""
    if isinstance(exc, UserError):
        return True
    if not isinstance(exc, ValueError) or exc.__traceback__ is None:
        return False
    *_, innermost = traceback.extract_tb(exc.__traceback__)
    ours = Path(innermost.filename).resolve().is_relative_to(_PACKAGE)
    return ours and (innermost.line or "").startswith("raise")


def debug_requested(argv: list[str]) -> tuple[list[str], bool]:
    """``(argv without --debug, whether --debug was given or TITAN_CP_DEBUG is set)``."""
    rest = [a for a in argv if a != DEBUG_FLAG]
    env = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
    return rest, env or len(rest) != len(argv)


def process_rank() -> tuple[int, int]:
    """``(rank, world size)`` of this process: the default process group's when there is one,
    else the launcher's ``RANK``/``WORLD_SIZE`` (``(0, 1)`` when started by hand)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _say(line: str) -> None:
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def error_exit(debug: bool = False, grace_s: float | None = None) -> Iterator[None]:
    """Run the body as a command's top level: a user error becomes one line and ``SystemExit(2)``,
    Ctrl-C ``SystemExit(130)``; failures propagate with their traceback (exit status 1).
    ``grace_s``: how long a rank other than 0 waits before reporting (default
    :data:`PEER_GRACE_SECONDS`)."""
    try:
        yield
    except KeyboardInterrupt:
        if process_rank()[0] == 0:
            _say("interrupted")
        raise SystemExit(EXIT_INTERRUPTED) from None
    except ValueError as exc:
        if not is_user_error(exc):
            raise
        rank, world = process_rank()
        if debug:
            _say("".join(traceback.format_exception(exc)).rstrip())
        elif rank == 0:
            _say(f"error: {exc}")
        elif world > 1:
            time.sleep(PEER_GRACE_SECONDS if grace_s is None else grace_s)  # the launcher stops us first
            _say(f"error (rank {rank}): {exc}")
        raise SystemExit(EXIT_USER_ERROR) from None


def run_cli(main: Callable[[list[str]], object], argv: list[str] | None = None) -> NoReturn:
    """Run ``main(argv)`` (default ``sys.argv[1:]``, ``--debug`` removed) under :func:`error_exit`
    and exit: with ``main``'s return value when it is an integer, else 0. A process group still
    open at the end is destroyed; a process that ran collectives ends through :func:`end_process`."""
    argv, debug = debug_requested(list(sys.argv[1:] if argv is None else argv))
    ranked = _is_rank()
    code: object = 0
    try:
        with error_exit(debug):
            result = main(argv)
            dist = sys.modules.get("torch.distributed")
            if dist is not None and dist.is_available() and dist.is_initialized():
                ranked = True
                dist.destroy_process_group()
            code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except SystemExit as exit_:
        code, ranked = exit_.code, ranked or _is_rank()
    if ranked:
        end_process(code if isinstance(code, int) else EXIT_FAILURE)
    raise SystemExit(code)


def _is_rank() -> bool:
    """Whether this process is a rank of a job: a process group is open, or a launcher started it."""
    dist = sys.modules.get("torch.distributed")
    opened = dist is not None and dist.is_available() and dist.is_initialized()
    return opened or "LOCAL_RANK" in os.environ


def end_process(code: int) -> NoReturn:
    """Flush what was written and end the process with ``code`` at once, without the interpreter's
    finalization.

    gloo's worker threads drop a finished collective's tensors just after waking the rank that waited
    on it. When that rank has meanwhile returned and the interpreter is finalizing, the drop's GIL
    acquire ends the worker thread inside a destructor and the process aborts ("terminate called
    without an active exception", exit status 134 after a run that succeeded: 1 run in 5 to 6 of the
    training docs' CP 2 command on a loaded 2-core machine). A command has closed its files by then;
    nothing it leaves needs the finalization."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
