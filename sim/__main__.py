"""``python -m sim``: see :mod:`sim.cli`."""
import sys

from .cli import main

sys.exit(main())
