"""``python -m timewheel.cli.bench.batch_stub``: run the batch stub (``--help``)."""

from __future__ import annotations

import sys

from .server import main

sys.exit(main())
