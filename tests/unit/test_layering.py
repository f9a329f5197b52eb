"""Every arrow points down: no module imports a higher floor, and no imports close a cycle.

The floors are written once, here, lowest first. A module's floor is that of the longest prefix
listed. Every ``import loom...`` counts, at the top of a file or inside a function. Python
resolves function-level imports lazily, but a function-level import still ties the two modules
together, and hiding an upward arrow inside a function is how the cycles of issue 14 survived.
Only imports under ``if TYPE_CHECKING:`` are exempt: they never run (annotations only).

``KNOWN_UPWARD`` and ``KNOWN_CYCLES`` list the violations that are left, to be removed one by one
(issue 14). The test fails on any violation that is not listed, so nothing new gets in. It also
fails on a listed one that has gone, so the lists only shrink.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import loom

FLOORS: list[tuple[str, ...]] = [
    # 0: the ground floor: plain models, data, the rank grid and the layout, pure formulas, errors,
    # the cluster description and its emulation
    ("loom.models", "loom.data", "loom.topology", "loom.layout", "loom.formulas", "loom.errors",
     "loom.cluster", "loom.emulate", "loom"),
    # 1: parallelism applied to a model from outside; schedules as data (torch-free)
    ("loom.parallel", "loom.schedule"),
    # 2: the typed config and its rules (the TOML face of a layout), and its keys' descriptions
    ("loom.config", "loom.config_rules", "loom.config_help"),
    # 3: the planner's cost model
    ("loom.sim",),
    # 4: the pipeline runtime (torch side of the schedule)
    ("loom.pipeline",),
    # 5: the trainer, and the test harness that drives it
    ("loom.train", "loom.testing"),
    # 6: the planner
    ("loom.plan",),
    # 7: the commands
    ("loom.cli", "loom.launch", "loom.supervise", "loom.generate", "loom.hf_cli", "loom.__main__",
     "loom.pipeline.cli", "loom.calibration", "loom.relaunch"),
]

def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def _imports() -> dict[str, set[str]]:
    """Module -> the Loom modules it imports (resolved to modules that exist)."""
    root = Path(loom.__file__).parent
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    # a compiled extension (its C source beside the Python, e.g. loom/schedule/_listsched.c)
    # is a module too, and a leaf: it imports nothing of Loom's
    compiled = {_module_name(p.with_suffix(".py"), root) for p in root.rglob("*.c")}
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        type_only = {id(node) for block in ast.walk(tree) if _is_type_checking(block)
                     for node in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in type_only:  # never executed: annotations only, no runtime arrow
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from loom.x import y": y may be a submodule of loom.x or a name in it
                targets = [f"{node.module}.{alias.name}"
                           if f"{node.module}.{alias.name}" in modules.keys() | compiled
                           else node.module for alias in node.names]
            for target in targets:
                if target.startswith("loom") and target != name:
                    if target in compiled:
                        edges[name].add(target)
                        continue
                    while target not in modules and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target in modules and target != name:
                        edges[name].add(target)
    return edges


def floor_of(module: str) -> int:
    best, floor = -1, None
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), level
    assert floor is not None, f"{module} is on no floor: add it to FLOORS"
    return floor


def upward_imports(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in edges.items() for b in targets
            if floor_of(b) > floor_of(a) and not b == "loom"}


def cycles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


# What issue 14 has left to untangle, written out so the list can only shrink.
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_CYCLES: set[frozenset[str]] = set()


def test_no_module_imports_a_higher_floor():
    found = upward_imports(_imports())
    new = sorted(found - KNOWN_UPWARD)
    assert not new, f"upward imports (lower floor -> higher floor): {new}"
    gone = sorted(KNOWN_UPWARD - found)
    assert not gone, f"fixed, remove from KNOWN_UPWARD: {gone}"


def test_no_imports_close_a_cycle():
    found = cycles(_imports())
    new = [sorted(c) for c in found - KNOWN_CYCLES]
    assert not new, f"import cycles: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES - found]
    assert not gone, f"fixed, remove from KNOWN_CYCLES: {gone}"


def test_the_checker_catches_an_upward_import_and_a_cycle():
    """The rules themselves: a schedule module importing the trainer, and two modules importing
    each other, are both reported."""
    edges = {"loom.schedule.ir": {"loom.train.trainer"}, "loom.train.trainer": {"loom.schedule.ir"}}
    assert upward_imports(edges) == {("loom.schedule.ir", "loom.train.trainer")}
    assert cycles(edges) == {frozenset({"loom.schedule.ir", "loom.train.trainer"})}


def _closure(edges: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(edges.get(module, ()))
    return seen


def test_the_planner_reaches_nothing_of_the_trainer_or_the_pipeline_runtime():
    """Planning (search, cost model, profiles) imports no ``loom.train`` module, even lazily;
    measuring the machine with the trainer is ``loom.calibration``'s, a command above. Its
    schedules come from ``loom.schedule`` alone, not the torch runtime in ``loom.pipeline``."""
    edges = _imports()
    reached = _closure(edges, [m for m in edges if m.startswith(("loom.plan", "loom.sim"))])
    assert not sorted(m for m in reached
                      if m.startswith(("loom.train", "loom.calibration", "loom.pipeline")))


def test_the_schedule_package_and_the_layout_import_without_torch():
    import subprocess
    import sys

    code = ("import sys, loom.schedule, loom.schedule.select, loom.schedule.render,"
            " loom.formulas.memory, loom.formulas.flops, loom.layout;"
            " assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_planner_and_the_config_import_without_torch():
    """``loom plan`` must not import torch before it needs it (issue 21: the 1T plan in about
    two seconds, of which importing torch alone would take more than one): the config and its
    rules, the model shapes and presets, the cost model and the planner's CLI are torch-free."""
    import subprocess
    import sys

    code = ("import sys, loom.config, loom.models.presets, loom.sim.cost_model, loom.plan.cli,"
            " loom.plan.search, loom.sim.varlen_cost;"
            " assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_commands_start_without_dtensor():
    """``loom train``'s launcher checks the config and the resume point before any worker
    starts; DTensor (with sympy: about 1.5 s, the parallel wrappers and DCP import it) is the
    workers' business, so a refusal, and every launch, pays torch's own import only."""
    import subprocess
    import sys

    code = ("import sys, loom.cli, loom.launch;"
            " heavy = [m for m in ('torch.distributed.tensor', 'loom.parallel', 'sympy')"
            " if m in sys.modules]; assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


MAX_LOCAL_IMPORTS = 10


def _local_imports() -> list[tuple[str, int, str]]:
    """(file, line, text) of every Loom import inside a function, outside ``TYPE_CHECKING``."""
    root = Path(loom.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        tree, lines = ast.parse(source), source.splitlines()
        type_only = {id(node) for block in ast.walk(tree) if _is_type_checking(block)
                     for node in ast.walk(block)}
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                module = node.module if isinstance(node, ast.ImportFrom) else \
                    node.names[0].name if isinstance(node, ast.Import) else None
                if module and module.startswith("loom") and id(node) not in type_only:
                    found.append((str(path.relative_to(root.parent)), node.lineno,
                                  lines[node.lineno - 1].strip()))
    return found


def test_function_level_imports_are_few_and_say_why():
    """An import inside a function hides an arrow from a reader of the module's top; the few
    left must each carry a comment saying why (an expensive import only some paths need)."""
    local = _local_imports()
    assert len(local) <= MAX_LOCAL_IMPORTS, local
    assert not [entry for entry in local if "#" not in entry[2]], local
