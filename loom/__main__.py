"""``python -m loom ...`` is the ``loom`` command (used by torchrun: ``torchrun -m loom train``)."""

import sys

from loom.cli import main

sys.exit(main())
