"""``python -m titan_cp.generate``: see :mod:`titan_cp.generate.cli`."""

from titan_cp.errors import run_cli
from titan_cp.generate.cli import main

run_cli(main)
