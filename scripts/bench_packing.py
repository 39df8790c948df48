"""How well each packer keeps documents whole and rows full, on document-length mixes.

For every (mix, seq_len, packer) one JSON line::

    {"mix": "lognormal_2k", "seq_len": 32768, "packing": "best_fit", "lookahead": 512,
     "rows": 1024, "docs": 16100, "docs_le_seq_len": 16100, "docs_cut_fraction": 0.0,
     "padding_fraction": 0.0004, "seconds": 1.2}

``docs_cut_fraction``: documents no longer than seq_len that were cut; ``padding_fraction``:
padding tokens / all tokens (see ``titan_cp.data.lengths``). The same number of tokens is packed
at every seq_len (``--tokens``).

    python scripts/bench_packing.py                    # 3 mixes x 32768, 131072 x stream, best_fit
    python scripts/bench_packing.py --mixes agent --seq-lens 131072 --lookahead 128 512 2048
"""

from __future__ import annotations

import argparse
import json
import time

from titan_cp.data.lengths import DOC_LENGTH_MIXES, LengthSource, measure_packing
from titan_cp.data.packing import make_packer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixes", nargs="+", default=list(DOC_LENGTH_MIXES), choices=list(DOC_LENGTH_MIXES))
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--packings", nargs="+", default=["stream", "best_fit"], choices=["stream", "best_fit"])
    parser.add_argument("--lookahead", nargs="+", type=int, default=[512], help="best_fit buffer sizes (pieces)")
    parser.add_argument("--tokens", type=int, default=2**25, help="tokens packed per case (many lookahead buffers)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for mix in args.mixes:
        source = LengthSource(mix, args.seed)
        for seq_len in args.seq_lens:
            rows = max(1, args.tokens // seq_len)
            for packing in args.packings:
                for lookahead in args.lookahead if packing == "best_fit" else [None]:
                    packer = make_packer(source, seq_len, packing, lookahead or 1)
                    t0 = time.perf_counter()
                    stats = measure_packing(packer, rows, source.length)
                    record = {
                        "mix": mix,
                        "seq_len": seq_len,
                        "packing": packing,
                        "lookahead": lookahead,
                        **stats,
                        "seconds": round(time.perf_counter() - t0, 2),
                    }
                    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
