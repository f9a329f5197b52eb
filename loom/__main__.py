"""``python -m loom ...`` and the ``loom`` script (torchrun: ``torchrun -m loom train``).

``loom schedule ...`` and ``loom plan ...`` go straight to the torch-free ``loom.pipeline.cli``
and ``loom.plan.cli``: the other commands' modules import torch and the trainer (about 2 s),
which the schedule tools and the planner never need (``loom plan --calibrate`` does: it runs
the trainer, so it takes the full path). Each path imports only its own command's modules: the
planner's (the config and its rules, about 0.3 s) would double the start-up of ``loom schedule
search``, which issue 22 wants done in 1 s."""

import sys


def main() -> int:
    if sys.argv[1:2] == ["schedule"]:
        from loom.pipeline.cli import main as schedule_main  # not the planner's 0.3 s of imports
        return schedule_main(sys.argv[1:])
    if sys.argv[1:2] == ["plan"] and "--calibrate" not in sys.argv:
        from loom.plan.cli import main as plan_main  # the config and its rules: the planner's
        return plan_main(sys.argv[1:])
    from loom.cli import main as loom_main  # torch and the trainer: for the other commands only
    return loom_main()


if __name__ == "__main__":
    sys.exit(main())
