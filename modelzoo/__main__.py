"""``python -m modelzoo predict|evaluate|export``: see :mod:`modelzoo.cli`."""

import sys

from .cli import run

sys.exit(run())
