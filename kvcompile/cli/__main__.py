"""``python -m kvcompile.cli ARGS``: the ``kvcompile`` command."""

import sys

from kvcompile.cli import main

sys.exit(main())
