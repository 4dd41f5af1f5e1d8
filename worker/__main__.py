"""``python -m worker``: the same as the ``worker`` console script."""

import sys

from worker.cli import main

sys.exit(main())
