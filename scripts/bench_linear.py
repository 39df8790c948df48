"""A Gated DeltaNet layer under CP counted at full size on the meta device, and its CP overhead on a GPU by the
counting model, one JSON line per model and document mix. What is counted and how: :mod:`benchmarks.linear_model`.

    python scripts/bench_linear.py                                  # 131,072 tokens, CP 8, H200, both models and mixes
    python scripts/bench_linear.py --models qwen3_next --mixes docs_1k --balance contiguous
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed: the checkout's

from benchmarks.linear_model import MIXES, MODELS, layer_record, mix_rows  # noqa: E402
from titan_cp.layout import DEFAULT_BALANCE  # noqa: E402
from titan_cp.plan.devices import GPUS  # noqa: E402
from titan_cp.plan.linear import GATED_DELTA_FRACTION  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=131072, help="tokens of the row")
    p.add_argument("--cp", type=int, default=8, help="cp ranks")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), help="the layers' dims")
    p.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES), help="the row's documents")
    p.add_argument("--balance", default=DEFAULT_BALANCE, help="the layout's balance")
    p.add_argument("--device", default="h200", choices=sorted(GPUS), help="the device the time model prices")
    p.add_argument("--fraction", type=float, default=GATED_DELTA_FRACTION, help="the kernel's fraction of peak")
    p.add_argument("--seed", type=int, default=0, help="the document mix's draw")
    args = p.parse_args(argv)
    for model in args.models:
        for mix in args.mixes:
            rows = mix_rows(mix, args.seq_len, args.seed)
            rec = layer_record(
                MODELS[model], mix, args.seq_len, args.cp, rows, args.balance, args.device, args.fraction
            )
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
