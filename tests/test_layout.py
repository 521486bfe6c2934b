"""The package's layout: imports flow one way (no cycles among kjarni modules) and every module's
file name appears once, so a reader knows a file from its name alone.

Imports are read with ast, not by importing. Module-level and function-level imports both count (a
deferred import is still a dependency; deferring one only hides a circle); imports under
``if TYPE_CHECKING:`` do not, as they never run. ``from kjarni.pkg import name`` is an edge to the
submodule ``kjarni.pkg.name`` when that file exists, else to the package ``kjarni.pkg``.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kjarni"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The kjarni modules ``module`` imports anywhere in its body except under TYPE_CHECKING."""
    found: set[str] = set()

    def target(name: str) -> str | None:
        while name and name not in modules:  # `import kjarni.gpu.ops.X` names a module's attribute
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(t for alias in node.names if (t := target(alias.name)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] == "kjarni":
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    found.add(submodule if submodule in modules else target(source))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(module)
    found.discard(None)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: _imported(ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py", modules)
        for name, path in modules.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return cycles


def test_the_cycle_finder_finds_a_circle_and_passes_a_line():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    # cli.py imports kjarni.serve only inside the command that serves
    assert "kjarni.serve" in graph["kjarni.cli"]


def test_no_import_cycles_among_kjarni_modules():
    assert import_cycles(import_graph()) == []


def test_no_two_modules_share_a_file_name():
    names = Counter(path.name for path in PACKAGE.rglob("*.py") if path.name != "__init__.py")
    assert [name for name, count in names.items() if count > 1] == []
