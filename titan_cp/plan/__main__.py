import sys

from titan_cp.plan.cli import main

sys.exit(main())
