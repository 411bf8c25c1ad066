"""``python -m nccl_pg.diagnostics.trace DIR``: the same as ``nccl-pg trace DIR``."""

import sys

from .cli import main

sys.exit(main())
