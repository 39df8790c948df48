"""``python -m titan_cp.run [torchrun's options] -m titan_cp.train ...``: torchrun, ending as titan_cp's commands do.

Stock ``torchrun`` reports a failed rank by raising ``ChildFailedError`` in its own process: its
summary box, then a Python traceback of the launcher's own frames, and exit status 1 whatever the
rank's status (a user error's 2 included). This is the same launcher: torch's
``torch.distributed.run`` (its options, rendezvous, worker handling and error files), with another
ending when a rank fails (the root cause is the first failure torch observed)::

    root cause                       after the ranks' own output                  exit status
    exit status 2 (bad input: the    nothing (the rank printed its one line)      2
      command's one error line)
    any other exit status            torchrun's summary naming the root cause     that status
    killed by a signal               torchrun's summary                           128 + the signal
    the launcher itself signalled    one line naming the signal (none for Ctrl-C,  128 + the signal
                                     where rank 0 prints ``interrupted``)

No Python traceback of the launcher in any of them; torch's log lines of the agent (``Sending
process ... closing signal SIGTERM``, ``failed (exitcode: 2) local_rank: 0 ...``) stay.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.run import get_args_parser, run

from titan_cp.errors import EXIT_USER_ERROR

__all__ = ["exit_status", "main"]

PROG = "python -m titan_cp.run"


def exit_status(failure: ChildFailedError) -> int:
    """The status to exit with for ``failure``: its root cause's exit status, or 128 + the signal
    that killed it (as a shell reports a killed command)."""
    _, root = failure.get_first_failure()
    return root.exitcode if root.exitcode >= 0 else 128 - root.exitcode


@record  # as torchrun's main: the root cause's error file is copied to the launcher's (TORCHELASTIC_ERROR_FILE)
def _launch(argv: list[str]) -> None:
    parser = get_args_parser()
    parser.prog = PROG
    run(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """Launch as ``torchrun`` with ``argv`` (default ``sys.argv[1:]``); the exit status of the
    module docstring's table."""
    try:
        _launch(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as failure:
        status = exit_status(failure)
        if status != EXIT_USER_ERROR:
            print(failure.format_msg(), file=sys.stderr, flush=True)
        return status
    except SignalException as stopped:
        if stopped.sigval != signal.SIGINT:
            name = signal.Signals(stopped.sigval).name
            print(f"{PROG}: stopped by {name}; the ranks were stopped", file=sys.stderr, flush=True)
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
