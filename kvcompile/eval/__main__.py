"""``python -m kvcompile.eval ARGS``: lm-eval's command line with the kvcompile model and tasks (see ``harness``)."""

import sys

from kvcompile.eval.harness import main

sys.exit(main())
