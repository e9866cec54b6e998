"""`python -m eval.report RESULTS_DIR [--out DIR] [--trained-context N]` (eval/report/build.py)."""

import sys

from eval.report.build import main

sys.exit(main())
