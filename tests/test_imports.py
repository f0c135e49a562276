"""The import graph of monai_cache has no cycle (read from the source with ``ast``; nothing is imported).

Every ``import`` and ``from ... import`` counts, at module level or inside a function, except those under
``if TYPE_CHECKING:`` (they never run). ``from monai_cache import NAME`` counts as an import of the module that
``monai_cache.__getattr__`` loads for ``NAME`` (``_EXPORTS``). Not counted: ``importlib.import_module`` of a name
held in a variable (the switch imports the datasets it swaps in, the codec a stored object's class).
"""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "monai_cache"


def _modules() -> dict[str, str]:
    """``{dotted name: file}`` for every module of the package."""
    out = {}
    for folder, _dirs, files in os.walk(os.path.join(REPO, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = path
    return out


def _lazy_exports(init: str) -> dict[str, str]:
    """``_EXPORTS`` of the package's ``__init__.py``: the name ``monai_cache.__getattr__`` loads, and its module."""
    for node in ast.parse(open(init).read()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return dict(ast.literal_eval(node.value))
    return {}


def _runs(tree: ast.AST) -> list[ast.AST]:
    """The nodes of ``tree`` that run, i.e. all but what sits under ``if TYPE_CHECKING:``."""
    out: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if test is not None and "TYPE_CHECKING" in ast.unparse(test):
                stack.extend(child.orelse)
            else:
                stack.append(child)
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``, as the docstring of this file counts them."""
    modules = _modules()
    exports = _lazy_exports(modules[PACKAGE])
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        found: set[str] = set()
        for node in _runs(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    if name in modules:
                        found.add(name)
                    elif base == PACKAGE and alias.name in exports:
                        found.add(exports[alias.name])
                    else:
                        found.add(base)
        graph[module] = {name for name in found if name in modules and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``: each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_imports_without_a_cycle():
    graph = import_graph()
    assert {"monai_cache", "monai_cache.keeper", "monai_cache.shm_lifetime", "monai_cache.sampler"} <= set(graph)
    assert "monai_cache.shm_lifetime" in graph["monai_cache.keeper"]  # the graph sees imports inside functions too
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # it would see one


def test_the_keeper_imports_only_the_lifetime_rules_and_the_runtime():
    """The keeper is a process without torch: it needs the lifetime rules, which need nothing of the package, and no
    module it imports imports it back."""
    graph = import_graph()
    reached, todo = set(), ["monai_cache.keeper"]
    while todo:
        for name in graph[todo.pop()] - reached:
            reached.add(name)
            todo.append(name)
    assert reached == {"monai_cache.runtime", "monai_cache.shm_lifetime"}
    assert graph["monai_cache.shm_lifetime"] == set()
