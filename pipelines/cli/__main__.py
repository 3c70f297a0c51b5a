"""``python -m pipelines.cli``: the ``maxdiff`` command."""

import sys

from pipelines.cli import main

sys.exit(main())
