"""``python -m flowrl.experiments EXPERIMENT.yaml [options] [overrides]``: run an experiment and write its table."""

import sys

from flowrl.experiments.cli import main

sys.exit(main())
