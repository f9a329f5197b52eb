"""Which implementation runs the schedule search's inner loops: Python or compiled.

The search's three list schedulers (``search_reverse.reverse_schedule``,
``search_priority.priority_schedule``, ``search_greedy.list_schedule``) and the replay behind
``replay.score`` are written in Python, and that code is their specification. The same loops
also exist in C (``loom/schedule/_listsched.c``, built by ``pip install`` where a C compiler is
found; setup.py marks it optional), decision for decision on the same doubles, so they give the
same rows, peaks and times to the bit (``tests/unit/schedule/test_compiled_schedulers.py``).
They are used when the module was built, every duration and the send time are Python floats
(the search's ``replay.Costs.of``; exact ints or Fractions stay in Python, where their
arithmetic is exact), and ``LOOM_PURE_PYTHON`` is not set to 1 in the environment (to time or
check the Python path). The compiled replay covers one route without vocabulary passes, each
action once; anything else it hands back to the Python replay.

Why: in Python the reverse and priority loops cost 2.4-3.1 us per scheduled action (measured
last session); the search's full-size rebuild of
a forward-backward order at p = 32, m = 256 and five chunks per rank (123,000 actions) took 0.7 s
of issue 22's 1 s budget for the whole command. It communicates nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType

try:
    from loom.schedule import _listsched as _built  # type: ignore[attr-defined]
except ImportError:  # no C compiler where Loom was installed: the Python loops run
    _built = None

PURE_PYTHON_VARIABLE = "LOOM_PURE_PYTHON"


def built() -> bool:
    """Whether the compiled module was built and imports."""
    return _built is not None


def loops_for(duration: Sequence[Sequence[object]], send: object
              ) -> tuple[ModuleType, list[float]] | None:
    """The compiled module and ``duration`` (a ``replay.Costs``' ``[stage][op code]``) flattened
    by stage (F, I, W, B each), when the compiled loops may run on those costs and ``send``;
    else None (the Python loops run). Takes the two fields, not the ``Costs``: ``replay``
    imports this module."""
    if _built is None or os.environ.get(PURE_PYTHON_VARIABLE) == "1":
        return None
    if type(send) is not float:
        return None
    flat: list[float] = []
    for row in duration:
        if len(row) < 4 or any(type(d) is not float for d in row[:4]):
            return None
        flat.extend(row[:4])
    return _built, flat
