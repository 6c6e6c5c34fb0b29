"""``python -m trainers.parallel.plan``: the planner's command line
(:func:`trainers.parallel.plan.cli.main`)."""

import sys

from trainers.parallel.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
