"""Architecture rules of ``lightning_hybrid``, read from its source with ``ast``: nothing of the package is imported.

- no import cycle between the package's modules (imports inside functions count too);
- ``models/`` stays plain model code: no ``torch.distributed``, ``lightning_hybrid.distributed``, strategy, checkpoint
  or planner import;
- ``planner/`` is arithmetic: no torch or Lightning import at any depth, and of the package only the planner, the
  model configs, the GPU table and the torch-free part of ``distributed/`` (options, sizes, schedules, stage split),
  which import no torch or Lightning at module level themselves;
- nothing outside ``strategy.py`` assigns an attribute on a strategy object or reads one of its private attributes;
- ``HybridParallelStrategy`` stays small (at most 300 lines) and marks every Lightning override with ``@override``;
- no function is longer than 60 lines;
- nothing is unpickled: ``torch.load`` only with ``weights_only=True``, no ``pickle.load``.

Every rule lists all of its offenders in its failure message.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections import deque
from pathlib import Path
from typing import NamedTuple, Optional

import pytest

PACKAGE = "lightning_hybrid"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

MAX_FUNCTION_LINES = 60
MAX_STRATEGY_LINES = 300
MODELS_MUST_NOT_IMPORT = ("torch.distributed", "lightning_hybrid.distributed", "lightning_hybrid.strategy",
                          "lightning_hybrid.checkpoint", "lightning_hybrid.planner")
# What the planner may import of the package besides itself: each of these imports no torch or Lightning at module
# level (checked below), so `lightning-hybrid plan` stays arithmetic.
PLANNER_MAY_IMPORT = ("lightning_hybrid.hardware", "lightning_hybrid.recipe_file", "lightning_hybrid.version",
                      "lightning_hybrid.models.spec", "lightning_hybrid.models.qwen2.config",
                      "lightning_hybrid.models.decoder.config", "lightning_hybrid.models.decoder.families",
                      "lightning_hybrid.models.decoder.presets", "lightning_hybrid.models.decoder.moe_config",
                      "lightning_hybrid.distributed.options", "lightning_hybrid.distributed.parallel_dims",
                      "lightning_hybrid.distributed.pipeline.schedules", "lightning_hybrid.distributed.pipeline.split")
FRAMEWORKS = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics")


class Import(NamedTuple):
    line: int
    module: str            # absolute name of the module imported (from) ...
    name: Optional[str]    # ... and, for ``from module import name``, the name


# ------------------------------------------------------------------------------------------------ reading the source

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name; a package's ``__init__.py`` is the package's own module."""
    found = {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}
    assert PACKAGE in found and len(found) > 10, f"the package's sources are not at {ROOT}"
    return found


@functools.lru_cache(maxsize=None)
def tree(module: str) -> ast.Module:
    path = modules()[module]
    return ast.parse(path.read_text(), filename=str(path))


def imports(module: str) -> list[Import]:
    """Every ``import`` and ``from ... import`` of ``module``, at any depth (functions, ``TYPE_CHECKING`` blocks)."""
    is_package = modules()[module].name == "__init__.py"
    found = []
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of this module, one level up per extra dot
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            found += [Import(node.lineno, base, alias.name) for alias in node.names]
    return found


def internal_target(imported: Import) -> Optional[str]:
    """The package module an import loads: ``from x import y`` is module ``x.y`` when that is a module, else ``x``.

    ``import x.y.z`` of a name that is no module falls back to its longest prefix that is one.
    """
    if imported.name and f"{imported.module}.{imported.name}" in modules():
        return f"{imported.module}.{imported.name}"
    candidate = imported.module
    while candidate and candidate not in modules():
        candidate = candidate.rpartition(".")[0]
    return candidate or None


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported package module: line of its first import}; self-imports left out."""
    graph: dict[str, dict[str, int]] = {module: {} for module in modules()}
    for module in modules():
        for imported in imports(module):
            target = internal_target(imported)
            if target is not None and target != module:
                graph[module].setdefault(target, imported.line)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle ``[a, b, ..., a]`` through every strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_shortest_cycle(graph, component) for component in components if len(component) > 1]


def _shortest_cycle(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    start = min(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:  # breadth first from start, inside the component, back to start
        node = queue.popleft()
        for nxt in sorted(graph.get(node, {})):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
            if nxt in component and nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def functions() -> list[tuple[str, ast.FunctionDef]]:
    """Every function and method of the package as ``(module:Qualified.name, node)``, nested ones included."""
    found = []

    def visit(node: ast.AST, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((f"{module}:{prefix}{child.name}", child))
                visit(child, module, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, module, f"{prefix}{child.name}.")
            else:
                visit(child, module, prefix)

    for module in modules():
        visit(tree(module), module, "")
    return found


def length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


# ------------------------------------------------------------------------------------------------ import cycles

def test_the_cycle_finder_names_a_cycle_and_ignores_a_diamond():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}, "x": {"y": 1, "z": 1}, "y": {"w": 1},
             "z": {"w": 1}, "w": {}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b": 1}, "b": {"a": 1}}) == [["a", "b", "a"]]


def test_imports_resolve_to_the_module_they_load():
    graph = import_graph()
    # `from lightning_hybrid.checkpoint import sharded` loads the module checkpoint.sharded, not the package
    assert "lightning_hybrid.checkpoint.sharded" in graph["lightning_hybrid.strategy"]
    # `from lightning_hybrid.callbacks.fault_tolerant import FaultTolerantCheckpoint` loads that module
    assert "lightning_hybrid.callbacks.fault_tolerant" in graph["lightning_hybrid"]
    # a package's __init__ is a module of its own
    assert "lightning_hybrid.models" in graph and "lightning_hybrid.distributed.pipeline" in graph


def test_no_import_cycle_between_package_modules():
    graph = import_graph()
    cycles = find_cycles(graph)
    described = []
    for cycle in cycles:
        steps = ", ".join(f"{a}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:]))
        described.append(f"{' -> '.join(cycle)}\n    ({steps})")
    assert not cycles, f"{len(cycles)} import cycle(s) in {PACKAGE}:\n  " + "\n  ".join(described)


# ------------------------------------------------------------------------------------------------ layering

def _forbidden(imported: Import) -> Optional[str]:
    names = [imported.module] + ([f"{imported.module}.{imported.name}"] if imported.name else [])
    for prefix in MODELS_MUST_NOT_IMPORT:
        if any(name == prefix or name.startswith(prefix + ".") for name in names):
            return prefix
    return None


def test_models_import_no_distributed_strategy_checkpoint_or_planner_module():
    violations = [f"{module}:{imported.line} imports {imported.module}"
                  f"{'.' + imported.name if imported.name else ''} ({_forbidden(imported)})"
                  for module in modules() if module == f"{PACKAGE}.models" or module.startswith(f"{PACKAGE}.models.")
                  for imported in imports(module) if _forbidden(imported)]
    assert not violations, ("models/ must stay plain model code (no torch.distributed, lightning_hybrid.distributed, "
                            "strategy, checkpoint or planner import):\n  " + "\n  ".join(violations))


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def module_level_imports(module: str) -> list[Import]:
    """The imports ``module`` runs when it is imported: outside functions and ``if TYPE_CHECKING:`` blocks."""
    found: list[Import] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or _is_type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(i for i in imports(module) if i.line == child.lineno)
            else:
                visit(child)

    visit(tree(module))
    return found


def _framework(imported: Import) -> bool:
    return imported.module.split(".")[0] in FRAMEWORKS


def _planner_may_import(imported: Import) -> bool:
    if _framework(imported):
        return False
    target = internal_target(imported)
    return target is None or target.startswith(f"{PACKAGE}.planner") or target in PLANNER_MAY_IMPORT


def test_planner_imports_neither_torch_nor_lightning_nor_more_of_the_package_than_arithmetic():
    planner = [m for m in modules() if m == f"{PACKAGE}.planner" or m.startswith(f"{PACKAGE}.planner.")]
    violations = [f"{module}:{imported.line} imports {imported.module}{'.' + imported.name if imported.name else ''}"
                  for module in planner for imported in imports(module) if not _planner_may_import(imported)]
    # what the planner may import must itself load no framework (and nothing else of the package) when imported
    violations += [f"{module} does not exist" for module in PLANNER_MAY_IMPORT if module not in modules()]
    violations += [f"{module}:{imported.line} imports {imported.module} at module level"
                   for module in PLANNER_MAY_IMPORT if module in modules() for imported in module_level_imports(module)
                   if _framework(imported) or (imported.module.startswith(PACKAGE)
                                               and internal_target(imported) not in PLANNER_MAY_IMPORT)]
    assert not violations, ("the planner is arithmetic (no torch, no Lightning, no mesh; see DESIGN.md's rooms):\n  "
                            + "\n  ".join(violations))


# ------------------------------------------------------------------------------------------------ the strategy's state

STRATEGY_NAMES = ("strategy", "_strategy")  # names (variables, attributes, calls) that hold a strategy
STRATEGY_TYPES = ("HybridParallelStrategy", "StrategyHost")  # parameter annotations naming a strategy


def _chain(node: ast.AST) -> list[str]:
    """``a.b().c`` -> ``["a", "b", "c"]``: the names an attribute access goes through, calls included."""
    names: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            break
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def strategy_state_access(parsed: ast.Module, module: str) -> list[str]:
    """``module:line what`` for every attribute assigned on a strategy object and every private attribute read off
    one: through a name in :data:`STRATEGY_NAMES` (``strategy.x = 1``, ``trainer.strategy.guard.on = 1``,
    ``setattr(strategy, ...)``, ``strategy._spec``) or a parameter annotated with a strategy type."""
    typed = {arg.arg for node in ast.walk(parsed) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             for arg in node.args.args + node.args.kwonlyargs
             if arg.annotation is not None and any(t in ast.unparse(arg.annotation) for t in STRATEGY_TYPES)}
    refs = set(STRATEGY_NAMES) | typed
    found = []
    for node in ast.walk(parsed):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
            if isinstance(target, ast.Attribute) and refs & set(_chain(target)[:-1]):
                found.append(f"{module}:{node.lineno} assigns {ast.unparse(target)}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr") and node.args \
                and refs & set(_chain(node.args[0])):
            found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and (_chain(node.value)[-1:] or [""])[0] in refs:
            found.append(f"{module}:{node.lineno} reads {ast.unparse(node)}")
    return found


def test_nothing_outside_the_strategy_writes_into_it_or_reads_its_private_state():
    found = [line for module in modules() if module != f"{PACKAGE}.strategy"
             for line in strategy_state_access(tree(module), module)]
    assert not found, ("only strategy.py sets the strategy's attributes or reads its private ones; return what a "
                       "module made and let the strategy's hook keep it:\n  " + "\n  ".join(found))


@pytest.mark.parametrize("source, expected", [
    ("strategy.pipeline = runner\n", 1),
    ("trainer.strategy.step_guard.active = True\n", 1),
    ("a, strategy.x = 1, 2\n", 1),
    ("setattr(trainer.strategy, 'x', 1)\n", 1),
    ("spec = strategy._spec\n", 1),
    ("timeout = self.trainer.strategy._timeout\n", 1),
    ("def f(host: 'StrategyHost'):\n    host.x = 1\n    return host._spec\n", 2),
    ("strategy.enable_step_skips()\nrunner = strategy.pipeline\nrunner.cross_group = f\n", 0),
    ("self.strategy_name = 'x'\nstrategy = make()\n", 0),
])
def test_the_strategy_state_check_finds_what_it_should(source, expected):
    assert len(strategy_state_access(ast.parse(source), "example")) == expected


# ------------------------------------------------------------------------------------------------ the strategy

def _strategy_class() -> ast.ClassDef:
    found = [node for node in tree(f"{PACKAGE}.strategy").body
             if isinstance(node, ast.ClassDef) and node.name == "HybridParallelStrategy"]
    assert len(found) == 1, "lightning_hybrid/strategy.py no longer defines class HybridParallelStrategy"
    return found[0]


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", ast.unparse(node))


@functools.lru_cache(maxsize=None)
def _lightning_classes() -> dict[str, ast.ClassDef]:
    """The classes of ``lightning.pytorch.strategies`` by name, read from Lightning's installed sources."""
    spec = importlib.util.find_spec("lightning")  # a top-level package: located, not imported
    assert spec is not None and spec.submodule_search_locations, "lightning is not installed"
    folder = Path(list(spec.submodule_search_locations)[0]) / "pytorch" / "strategies"
    classes: dict[str, ast.ClassDef] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, node)
    return classes


def lightning_methods(cls: ast.ClassDef) -> set[str]:
    """Names of the methods and properties ``cls``'s Lightning base classes define (up to ``Strategy``)."""
    classes, names, seen = _lightning_classes(), set(), set()
    pending = [_base_name(base) for base in cls.bases]
    assert pending and all(name in classes for name in pending), (
        f"bases {pending} of {cls.name} are not classes of lightning.pytorch.strategies; update this test")
    while pending:
        name = pending.pop()
        if name in seen or name not in classes:  # ABC, object, Generic: not Lightning's
            continue
        seen.add(name)
        names |= {n.name for n in classes[name].body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        pending += [_base_name(base) for base in classes[name].bases]
    assert "Strategy" in seen, f"{cls.name} does not derive from Lightning's Strategy"
    return names


def _has_override(node: ast.FunctionDef) -> bool:
    return any(_base_name(decorator) == "override" for decorator in node.decorator_list)


def test_strategy_class_body_is_at_most_300_lines():
    cls = _strategy_class()
    assert length(cls) <= MAX_STRATEGY_LINES, (
        f"HybridParallelStrategy is {length(cls)} lines (lines {cls.lineno}-{cls.end_lineno} of strategy.py), "
        f"more than {MAX_STRATEGY_LINES}: move the work into lightning_hybrid.distributed / checkpoint")


def test_every_lightning_override_of_the_strategy_carries_override():
    cls = _strategy_class()
    inherited = lightning_methods(cls)
    methods = [node for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    missing = [f"{node.name} (line {node.lineno})" for node in methods
               if node.name in inherited and not node.name.startswith("__") and not _has_override(node)]
    assert not missing, "HybridParallelStrategy overrides Lightning without @override: " + ", ".join(missing)
    # and the reverse: an @override whose Lightning method is gone (renamed hook) would silently never be called
    stale = [f"{node.name} (line {node.lineno})" for node in methods
             if _has_override(node) and node.name not in inherited]
    assert not stale, "HybridParallelStrategy marks @override what no Lightning base defines: " + ", ".join(stale)


# ------------------------------------------------------------------------------------------------ function size

def test_no_function_is_longer_than_60_lines():
    long = sorted(((length(node), name, node.lineno) for name, node in functions()
                   if length(node) > MAX_FUNCTION_LINES), reverse=True)
    assert not long, (f"{len(long)} function(s) longer than {MAX_FUNCTION_LINES} lines:\n  "
                      + "\n  ".join(f"{name} (line {line}): {lines} lines" for lines, name, line in long))


# ------------------------------------------------------------------------------------------------ no unpickling

def unpickling(parsed: ast.Module, module: str) -> list[str]:
    """``module:line what`` for every ``torch.load`` without ``weights_only=True`` and every ``pickle`` load."""
    found = []
    from_torch_load = {alias.asname or alias.name for node in ast.walk(parsed)
                       if isinstance(node, ast.ImportFrom) and node.module == "torch" for alias in node.names
                       if alias.name == "load"}
    for node in ast.walk(parsed):
        if isinstance(node, ast.ImportFrom) and node.module == "pickle":
            found += [f"{module}:{node.lineno} from pickle import {alias.name}" for alias in node.names
                      if alias.name in ("load", "loads", "Unpickler")]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "pickle" \
                and node.attr in ("load", "loads", "Unpickler"):
            found.append(f"{module}:{node.lineno} pickle.{node.attr}")
        if isinstance(node, ast.Call):
            func = node.func
            is_torch_load = (isinstance(func, ast.Attribute) and func.attr == "load"
                             and isinstance(func.value, ast.Name) and func.value.id == "torch") or (
                isinstance(func, ast.Name) and func.id in from_torch_load)
            weights_only = [k.value for k in node.keywords if k.arg == "weights_only"]
            safe = bool(weights_only) and isinstance(weights_only[0], ast.Constant) and weights_only[0].value is True
            if is_torch_load and not safe:
                found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return found


def test_nothing_is_unpickled():
    found = [line for module in modules() for line in unpickling(tree(module), module)]
    assert not found, ("torch.load without weights_only=True or pickle.load runs code from the file it reads:\n  "
                       + "\n  ".join(found))


@pytest.mark.parametrize("source, expected", [
    ("import torch\ntorch.load(p, weights_only=True)\n", 0),
    ("import torch\ntorch.load(p)\n", 1),
    ("import torch\ntorch.load(p, map_location='cpu', weights_only=False)\n", 1),
    ("from torch import load\nload(p)\n", 1),
    ("import pickle\npickle.loads(b)\n", 1),
    ("from pickle import load\n", 1),
])
def test_the_unpickling_check_finds_what_it_should(source, expected):
    assert len(unpickling(ast.parse(source), "example")) == expected
