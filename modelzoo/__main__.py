"""``python -m modelzoo predict|evaluate|export``: see :mod:`modelzoo.cli`."""

import sys

from .cli import main

sys.exit(main())
