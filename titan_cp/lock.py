"""One run per dump folder, and ranks that do not outlive their launcher.

:class:`DumpLock` is the file ``<job.dump_folder>/titan_cp.lock``, created atomically
(``O_CREAT | O_EXCL``) by rank 0 when a training run starts and removed when it ends (also when
it stops on an error). It holds the holder's host, pid and start time as JSON. A second run on
the folder is refused naming them while the holder lives; a lock whose holder is a dead process
on this host (a run that was killed) is stale and taken over, with a warning. A lock held from
another host cannot be checked from here: it is refused, and the message says which file to
remove if that run is gone.

:func:`watch_launcher`: under ``torchrun`` (``TORCHELASTIC_RUN_ID`` set) a daemon thread checks
that the process's parent, the launcher's agent, is still the one that started it; once it is
gone (killed with SIGKILL, which it cannot forward) the rank says so and exits instead of
running on, holding devices, the dump folder and its lock.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

from titan_cp.errors import EXIT_FAILURE, UserError

logger = logging.getLogger(__name__)
LOCK_NAME = "titan_cp.lock"
LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class DumpLock:
    """The lock file of the dump folder ``folder`` (module docstring)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.held = False

    def _holder(self) -> dict | None:
        """The lock's holder (``host``, ``pid``, ``started``), or ``None`` when it cannot be read."""
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        ok = isinstance(holder, dict) and isinstance(holder.get("pid"), int) and isinstance(holder.get("host"), str)
        return holder if ok else None

    def _stale(self, holder: dict | None) -> bool:
        """Whether a lock held by ``holder`` may be taken over: unreadable, this process's own, or a
        process of this host that is no longer running."""
        if holder is None:
            return True
        if holder["host"] != socket.gethostname():
            return False
        return holder["pid"] == os.getpid() or not _alive(holder["pid"])

    def acquire(self) -> None:
        """Create the lock (the folder too); a ``UserError`` naming the holder when another run holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):  # a stale lock removed, then created again: retried
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and not self._stale(holder):  # (an unreadable lock is stale)
                    raise UserError(
                        f"job.dump_folder = '{self.folder}' is in use by another run (host {holder['host']}, pid "
                        f"{holder['pid']}, started {holder.get('started', '?')}): wait for it to end, or choose "
                        f"another job.dump_folder; if that run is gone, remove {self.path}"
                    ) from None
                if holder is not None and holder["pid"] != os.getpid():
                    logger.warning(
                        "%s: taking over the lock of pid %d, which is no longer running", self.path, holder["pid"]
                    )
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise UserError(
            f"{self.path} could not be created: another run is starting on job.dump_folder = '{self.folder}'"
        )

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self.held:
            holder = self._holder()
            if holder is not None and holder["pid"] == os.getpid() and holder["host"] == socket.gethostname():
                self.path.unlink(missing_ok=True)
            self.held = False


def watch_launcher(poll_s: float = 1.0) -> threading.Thread | None:
    """Under a launcher (``TORCHELASTIC_RUN_ID`` set): a daemon thread that ends this process (exit
    status 1, with one line on stderr) once its parent process is gone. ``None`` otherwise (a
    process started by hand may outlive its shell, e.g. under ``nohup``)."""
    if not os.environ.get(LAUNCHER_ENV):
        return None
    parent = os.getppid()  # 1: the launcher died before this rank got here (its orphans go to init)

    def watch() -> None:
        while os.getppid() == parent and parent != 1:
            time.sleep(poll_s)
        rank = os.environ.get("RANK", "?")
        print(f"error (rank {rank}): the launcher (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_FAILURE)

    thread = threading.Thread(target=watch, name="titan_cp-watch-launcher", daemon=True)
    thread.start()
    return thread
