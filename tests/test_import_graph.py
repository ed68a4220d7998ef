"""The import graph of ``opencood`` has no cycle, and its base modules import nothing above them.

Imports are read from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` of an ``opencood`` module, at module level and inside functions alike (a
deferred import that closes a cycle is still one), except under ``if TYPE_CHECKING``. A
``from package import name`` counts as an import of the submodule when ``name`` is one. Imports
made by name at run time (the registries' discovery of their package) are not in the graph.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "opencood"
# Modules every layer may import: they import no other opencood module (config_schema, errors)
# or only those (registry).
BASE_MODULES = {"opencood.config_schema": set(), "opencood.errors": set(),
                "opencood.registry": {"opencood.config_schema", "opencood.errors"}}


def module_files(root: Path) -> Dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root`` (a package's is __init__.py)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _statements(tree: ast.Module):
    """Every import statement of the file, skipping ``if TYPE_CHECKING`` bodies."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if _is_type_checking(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a (possibly relative) ``from X import ...`` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(module: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The opencood modules ``module`` imports."""
    found = set()
    for node in _statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        source = _absolute(node, module, path.name == "__init__.py")
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            found.add(submodule if submodule in modules else source)
    return {name for name in found if name in modules and name != module}


def import_graph(root: Path = PACKAGE_ROOT) -> Dict[str, Set[str]]:
    modules = module_files(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import cycle as [a, b, ..., a], or [] when the graph has none (depth-first search)."""
    state: Dict[str, str] = {}          # "open" while on the current path, then "done"
    path: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = "done"
        return []

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return []


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_base_modules_import_nothing_above_them():
    graph = import_graph()
    for module, allowed in BASE_MODULES.items():
        assert graph[module] <= allowed, (module, sorted(graph[module] - allowed))


# Packages that receive the fusion strategy from the engine (opencood.strategies.choose_strategy)
# and must not look one up themselves: strategies/ imports eval/ (late_box_align's correction),
# so an import back would run upward.
STRATEGY_FREE_PACKAGES = ("opencood.data", "opencood.eval")


def test_data_and_eval_import_nothing_from_strategies():
    graph = import_graph()
    upward = sorted((module, target) for module, targets in graph.items()
                    if module.startswith(STRATEGY_FREE_PACKAGES)
                    for target in targets if target.startswith("opencood.strategies"))
    assert not upward, f"imports running upward: {upward}"


def test_strategy_names_are_compared_only_inside_strategies():
    """A strategy's behaviour is asked of its object; comparing ``fusion`` names as strings
    elsewhere re-decides what the engine chose once."""
    names = ("no", "early", "late", "intermediate", "late_box_align")
    offenders = []
    for module, path in module_files(PACKAGE_ROOT).items():
        if module.startswith(("opencood.strategies", "opencood.interop")):
            continue          # interop translates other codebases' dataset names
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            text = ast.unparse(node)
            if "fusion" in text and any(repr(name) in text for name in names):
                offenders.append(f"{module}: {text}")
    assert not offenders, offenders


def test_the_graph_reader_sees_deferred_relative_and_submodule_imports(tmp_path):
    package = tmp_path / "opencood"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from opencood.sub import leaf\n")
    (package / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import opencood.top\n"
        "def later():\n    from ..top import value\n")
    (package / "top.py").write_text("from opencood.sub.leaf import later\nvalue = 1\n")
    graph = import_graph(package)
    assert graph == {"opencood": set(), "opencood.sub": {"opencood.sub.leaf"},
                     "opencood.sub.leaf": {"opencood.top"},
                     "opencood.top": {"opencood.sub.leaf"}}
    assert find_cycle(graph) == ["opencood.sub.leaf", "opencood.top", "opencood.sub.leaf"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
