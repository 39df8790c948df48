from titan_cp.errors import run_cli
from titan_cp.plan.cli import main

run_cli(main)
