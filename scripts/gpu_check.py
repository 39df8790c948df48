"""One-GPU self-check of titan_cp: kernels against fp64, a simulated ring against one native
call, and a short bf16 training run; JSON lines, a summary line last.

    python scripts/gpu_check.py                        # one CUDA device, < 4 minutes on an H200
    python scripts/gpu_check.py --device cpu --small   # the same logic on CPU at toy sizes
    python scripts/gpu_check.py --sections longest     # the longest row the GPU trains (8B's width, 4 blocks)

Without a CUDA device (and without --device cpu) it prints one line saying so and exits 0.
The summary's status is ``ok``, ``below_bar`` (everything correct, a ring efficiency under its
bar), ``error`` (a check could not run) or ``fail`` (a result is wrong); the exit status is 1 for
the last two. The environment line says which torch it runs on. See
titan_cp/tools/gpu_check.py for what is checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from titan_cp.tools.gpu_check import OPTIONAL_SECTIONS, SECTIONS, exit_code, print_json, run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--small", action="store_true", help="toy sizes (for CPU and tests)")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS + OPTIONAL_SECTIONS)} (default: {','.join(SECTIONS)})",
    )
    parser.add_argument(
        "--ring-kernel", default=None, help="kernel for the ring section (default: the device's default)"
    )
    args = parser.parse_args(argv)
    summary = run(args.device, args.small, [s for s in args.sections.split(",") if s], print_json, args.ring_kernel)
    return exit_code(summary)


if __name__ == "__main__":
    sys.exit(main())
