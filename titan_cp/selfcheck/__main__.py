"""``python -m titan_cp.selfcheck``: the one-GPU self-check (:mod:`titan_cp.selfcheck`)."""

import sys

from titan_cp.selfcheck import main

sys.exit(main())
