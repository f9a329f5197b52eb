"""``python -m loom ...`` and the ``loom`` script (torchrun: ``torchrun -m loom train``).

``loom schedule ...`` goes straight to the torch-free ``loom.pipeline.cli``: the other commands'
modules import torch and the trainer (about 2 s), which the schedule tools never need."""

import sys

from loom.pipeline.cli import main as schedule_main


def main() -> int:
    if sys.argv[1:2] == ["schedule"]:
        return schedule_main(sys.argv[1:])
    from loom.cli import main as loom_main  # torch and the trainer: for the other commands only
    return loom_main()


if __name__ == "__main__":
    sys.exit(main())
