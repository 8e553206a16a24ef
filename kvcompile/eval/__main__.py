"""``python -m kvcompile.eval ARGS``: lm-eval's command line with the kvcompile model and tasks (``lm_eval_cli``)."""

import sys

from kvcompile.eval.lm_eval_cli import main

sys.exit(main())
