"""``python -m kempner_resilience.cli``: the same as the ``kempner-resilience`` command."""

import sys

from kempner_resilience.cli import main

sys.exit(main())
