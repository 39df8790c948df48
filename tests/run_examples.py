"""Run several ``examples/*.py`` in one ``torchrun`` launch, each as it runs alone (for tests/test_examples.py).

    torchrun --nproc-per-node N tests/run_examples.py examples/a.py examples/b.py ...

Each worker executes the scripts' imports once (torch, transformers, TRL: most of a launch's time on a
CPU), then forks one child per script, one after another, which runs the script as ``__main__``: a
fresh process for each script (its own process group, its own accelerate state), as under its own
``torchrun``. Each script's process group meets on a port of its own (``EXAMPLE_PORTS``, one per
script, the same in every worker) with rank 0 hosting the store, since the launch's agent store
still holds the previous script's rendezvous keys. Rank 0 prints ``== <script>`` before each
script's output; the launch exits 1 when any script fails.
"""

from __future__ import annotations

import ast
import os
import runpy
import sys
import traceback


def _imports(path: str) -> None:
    """Execute the top-level imports of ``path`` (those of an ``if`` / ``try`` aside)."""
    tree = ast.parse(open(path).read(), path)
    nodes = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), {"__name__": "__imports__"})


def main(paths: list[str]) -> int:
    ports = os.environ["EXAMPLE_PORTS"].split(",")
    assert len(ports) == len(paths), (ports, paths)
    for path in paths:
        _imports(path)
    failed = 0
    for path, port in zip(paths, ports):
        if os.environ.get("RANK", "0") == "0":
            print(f"== {path}", flush=True)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: the script, then exit without returning into this loop
            code = 0
            os.environ.update(MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="False")
            sys.argv = [path]
            try:
                runpy.run_path(path, run_name="__main__")
            except BaseException:  # noqa: BLE001 - reported, and the exit status says it failed
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            print(f"{path} exited {os.waitstatus_to_exitcode(status)}", file=sys.stderr, flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
