"""Build hook for the one compiled module (everything else is in pyproject.toml).

``loom.schedule._listsched`` runs the schedule search's list schedulers and its scoring replay in C
(``loom/schedule/compiled.py`` says why and when). ``optional=True``: where no C compiler is
found the build goes on without it and Loom runs the same schedulers in Python, only slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("loom.schedule._listsched", ["loom/schedule/_listsched.c"],
                             optional=True)])
