"""The one-GPU self-check (``python -m titan_cp.selfcheck``) with the checkout's section ``model``
added: the counting model of GPU time (``benchmarks/gpu_model.py``) beside the measured ring.

    python scripts/gpu_check.py                        # one CUDA device, < 4 minutes on an H200
    python scripts/gpu_check.py --device cpu --small   # the same logic on CPU at toy sizes

Options, sections and exit status: ``python -m titan_cp.selfcheck --help``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed: the checkout's

from benchmarks.gpu_model import check_model  # noqa: E402
from titan_cp.selfcheck import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(extra_sections={"model": check_model}))
