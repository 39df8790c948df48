"""The commands' one error path (titan_cp.errors): bad input is one line and exit status 2 from
rank 0, the other ranks quiet; failures keep their traceback (exit 1); --debug or
TITAN_CP_DEBUG=1 shows a user error's traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from titan_cp import errors
from titan_cp.errors import UserError, error_exit, is_user_error, run_cli
from titan_cp.train import main

REPO = Path(__file__).resolve().parents[1]
MISSPELT = ["--job.config_file", "train_configs/debug_cp.toml", "--training.stepz", "3"]
HINT = "error: unknown config key 'training.stepz' (on the command line); did you mean 'training.steps'"


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", errors.DEBUG_ENV):
        monkeypatch.delenv(name, raising=False)


def exit_of(fn, *args) -> int:
    with pytest.raises(SystemExit) as info:
        fn(*args)
    return info.value.code


def test_bad_input_is_one_line_and_exit_status_2_with_nothing_started(capsys, tmp_path):
    dump = tmp_path / "out"
    assert exit_of(run_cli, main, MISSPELT + ["--job.dump_folder", str(dump)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [err.strip()] and err.startswith(HINT)
    assert not dist.is_initialized() and not dump.exists()


def test_other_ranks_wait_for_the_launcher_then_report_quietly(capsys, monkeypatch):
    """Rank 1 says nothing while rank 0 reports (the launcher stops it first); if it is still
    running after the grace period (the error was its own), it says so, naming its rank."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    waited = []
    monkeypatch.setattr(errors.time, "sleep", lambda s: waited.append((s, capsys.readouterr().err)))
    assert exit_of(run_cli, main, MISSPELT) == 2
    assert waited == [(errors.PEER_GRACE_SECONDS, "")]  # nothing printed before the wait
    assert capsys.readouterr().err.startswith("error (rank 1): unknown config key 'training.stepz'")


def test_debug_flag_or_environment_shows_the_traceback(capsys, monkeypatch):
    assert exit_of(run_cli, main, [*MISSPELT, "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and "loader.py" in err and "training.stepz" in err
    monkeypatch.setenv(errors.DEBUG_ENV, "1")
    assert exit_of(run_cli, main, MISSPELT) == 2
    assert "Traceback" in capsys.readouterr().err


def raise_in_library(argv):
    return json.loads("{not json")


def raise_from_a_builtin(argv):
    return int("ten")


def raise_a_bug(argv):
    raise KeyError("internal")


@pytest.mark.parametrize(
    "fn, exc", [(raise_in_library, ValueError), (raise_from_a_builtin, ValueError), (raise_a_bug, KeyError)]
)
def test_failures_keep_their_traceback(fn, exc, capsys):
    """A ``ValueError`` from a library or a builtin is not the package's word on bad input: it
    propagates (Python prints the traceback, exit status 1), as any other exception does."""
    with pytest.raises(exc) as info:
        run_cli(fn, [])
    assert not is_user_error(info.value)
    assert capsys.readouterr().err == ""


def test_what_counts_as_a_user_error():
    with pytest.raises(ValueError) as raised:
        main(MISSPELT)  # a ValueError raised by the config loader
    assert is_user_error(raised.value)
    assert is_user_error(UserError("from anywhere"))
    assert not is_user_error(ValueError("never raised: no traceback"))


def test_exit_status_of_a_main_that_returns_one_and_of_an_interrupt(capsys):
    assert exit_of(run_cli, lambda argv: 3, []) == 3
    assert exit_of(run_cli, lambda argv: [{"step": 1}], []) == 0

    def interrupted(argv):
        raise KeyboardInterrupt

    assert exit_of(run_cli, interrupted, []) == errors.EXIT_INTERRUPTED
    assert capsys.readouterr().err == "interrupted\n"


def test_counts_in_messages_agree_with_their_nouns():
    """``plural``, and messages built with it at a count of 1 (they said "1 ranks", "1 steps")."""
    from titan_cp.config import JobConfig, Training
    from titan_cp.data import ByteTokenizer
    from titan_cp.generate.needle import needle_case

    assert (errors.plural(1, "rank"), errors.plural(0, "rank"), errors.plural(4, "GPU")) == (
        "1 rank",
        "0 ranks",
        "4 GPUs",
    )
    assert JobConfig(training=Training(steps=1)).reconcile()[0].endswith("warming up over 1 step")
    with pytest.raises(ValueError, match="generate.needle_lengths: 1 token cannot hold"):
        needle_case(ByteTokenizer(), 1, 0.0, 0)


def test_error_exit_as_a_context_manager(capsys):
    with pytest.raises(SystemExit) as info, error_exit():
        raise UserError("--top must be >= 0, got -3")
    assert info.value.code == 2 and capsys.readouterr().err == "error: --top must be >= 0, got -3\n"


def test_the_trainer_command_line(tmp_path):
    """``python -m titan_cp.train`` as a user runs it: one line on stderr, exit status 2."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(errors.DEBUG_ENV, None)
    done = subprocess.run(
        [sys.executable, "-m", "titan_cp.train", *MISSPELT, "--job.dump_folder", str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [done.stderr.strip()] and done.stderr.startswith(HINT)
    assert not (tmp_path / "out").exists()


# ---- one run per dump folder; ranks end with their launcher --------------------------------------


def test_a_held_dump_folder_is_refused_and_a_stale_lock_taken_over(tmp_path):
    """The lock names its holder; a live holder refuses the folder (from this host, or another one,
    which cannot be checked), a dead one on this host is taken over; release removes the file."""
    import socket

    from titan_cp.lock import LOCK_NAME, DumpLock

    lock = DumpLock(tmp_path / "run")
    lock.acquire()
    held = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert (held["host"], held["pid"]) == (socket.gethostname(), os.getpid())
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "run" / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": other.pid}))
        message = rf"job.dump_folder = '{tmp_path / 'run'}' is in use by another run \(host {socket.gethostname()}, pid {other.pid}"
        with pytest.raises(UserError, match=message + r".*if that run is gone, remove .*titan_cp.lock"):
            DumpLock(tmp_path / "run").acquire()
    finally:
        other.kill()
        other.wait()
    DumpLock(tmp_path / "run").acquire()  # its holder is dead: stale, taken over
    (tmp_path / "run" / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(UserError, match="in use by another run \\(host elsewhere, pid 1"):
        DumpLock(tmp_path / "run").acquire()
    (tmp_path / "run" / LOCK_NAME).unlink()
    lock = DumpLock(tmp_path / "run")
    lock.acquire()
    lock.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_the_trainer_refuses_a_dump_folder_another_run_holds(tmp_path, dist_pools):
    """A second run on a held folder stops before it builds anything; the first run's lock is released
    when it ends, on an error too (here: the refused run's own, none; the folder is left as it was)."""
    import socket

    from titan_cp.testing.trainer import tiny_run_args

    run = tmp_path / "run"
    run.mkdir()
    (run / "titan_cp.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    argv = tiny_run_args(steps=1) + ["--parallelism.context_parallel_degree", "1", "--job.dump_folder", str(run)]
    (message,) = dist_pools.run(1, _refusal, argv, timeout=300)
    assert message.startswith(f"job.dump_folder = '{run}' is in use by another run (host {socket.gethostname()}")
    assert sorted(p.name for p in run.iterdir()) == ["titan_cp.lock"]


def _refusal(rank, world, argv):
    try:
        main(argv)
    except UserError as e:
        return str(e)


def test_a_rank_exits_when_its_launcher_is_killed(tmp_path):
    """A launcher killed with SIGKILL (it cannot stop its ranks): the rank notices within a poll and exits."""
    import signal

    from titan_cp.lock import watch_launcher

    ready = tmp_path / "ready"
    launcher = os.fork()
    if launcher == 0:  # the launcher (forked: no second interpreter to start)
        try:
            rank = os.fork()
            if rank == 0:
                sys.stderr = open(tmp_path / "err", "w")  # noqa: SIM115 - the process ends in os._exit
                os.environ.update(TORCHELASTIC_RUN_ID="x", RANK="3")
                watch_launcher(0.02)
                ready.touch()
                time.sleep(30)
                os._exit(0)
            (tmp_path / "pid").write_text(str(rank))
            for _ in range(1000):
                if ready.exists():
                    break
                time.sleep(0.01)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(launcher, 0)  # killed once the rank is watching
    pid = int((tmp_path / "pid").read_text())
    for _ in range(100):  # the rank is reparented, notices, exits (a zombie until someone reaps it)
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail("the rank outlived its launcher")
    assert (tmp_path / "err").read_text().startswith("error (rank 3): the launcher (pid ")


def test_the_launcher_ends_a_user_error_on_its_line_with_status_2(tmp_path):
    """``python -m titan_cp.run --nproc-per-node 2 -m titan_cp.train ...`` (the README's launcher) with a
    misspelt key: rank 0's line, then only the agent's log lines naming the failed rank (no traceback,
    the other rank quiet), and exit status 2. Stock torchrun ends the same run on its ChildFailedError
    traceback and status 1."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in (errors.DEBUG_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    argv = ["--nproc-per-node", "2", "-m", "titan_cp.train", *MISSPELT, "--job.dump_folder", str(tmp_path / "out")]
    done = subprocess.run(
        [sys.executable, "-m", "titan_cp.run", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output and "ChildFailedError" not in output, output
    lines = done.stderr.splitlines()
    ours = [i for i, line in enumerate(lines) if line.startswith("error")]
    assert len(ours) == 1 and lines[ours[0]].startswith(HINT), output  # rank 0's line, once
    after = lines[ours[0] + 1 :]
    assert all("torch/distributed/elastic/" in line for line in after), after  # the agent's log lines only
    assert any("failed (exitcode: 2) local_rank: 0" in line for line in after), after
    assert not (tmp_path / "out").exists()


def test_the_launchers_exit_status_is_the_root_causes():
    """The first failure's status; a rank killed by a signal: 128 + the signal, as a shell reports it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from titan_cp.run import exit_status

    def failed(*code_and_time: tuple[int, int]) -> ChildFailedError:
        failures = {}
        for rank, (code, at) in enumerate(code_and_time):
            failures[rank] = ProcessFailure(rank, 100 + rank, code, "<N/A>")
            failures[rank].timestamp = at
        return ChildFailedError("titan_cp.train", failures)

    assert exit_status(failed((2, 5), (-15, 6))) == 2  # rank 0's user error; rank 1 stopped by the launcher
    assert exit_status(failed((-15, 6), (1, 5))) == 1  # rank 1 failed first
    assert exit_status(failed((-9, 4), (-15, 6))) == 137  # killed (SIGKILL)


END_OF_A_RANK = """
import atexit, sys
from titan_cp.errors import run_cli
atexit.register(lambda: print("finalized", flush=True))
def main(argv):
    print("buffered", end="")  # no newline, no flush: the exit must not lose it
    sys.stderr.write("err")
    return 3
run_cli(main, [])
"""


def test_a_rank_ends_without_the_interpreters_finalization(monkeypatch):
    """A rank's command ends through ``end_process``: its output flushed, its status kept, and no finalization
    (at-exit handlers do not run), where a gloo worker thread still dropping a finished collective's tensors
    would abort the process; a command started by hand ends as Python does (``SystemExit``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, "-c", END_OF_A_RANK],
        env={**env, "LOCAL_RANK": "0", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "buffered", "err")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as info:
        run_cli(lambda argv: 3, [])
    assert info.value.code == 3
