"""No import cycles among kimi's modules.

The graph: an edge A -> B for every `import kimi.B` / `from kimi.B import ...` in module A, at module level and inside
functions alike (a function-level import still ties the two modules together), except under `if TYPE_CHECKING:`
(never executed). `from kimi.P import name` points at the submodule kimi.P.name when there is one, else at kimi.P.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kimi

ROOT = Path(kimi.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, package: str, modules: set[str]) -> set[str]:
    """The kimi modules `tree` imports (see the module docstring); `package`: the module's package, for relative
    imports."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "kimi")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            if base.split(".")[0] == "kimi":
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.add(sub if sub in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    """{module: the kimi modules it imports} over every module under kimi/."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {m for m in _imports(ast.parse(path.read_text()), package, modules) if m in modules} - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and "kimi.model.gpu_forward" in graph  # the walk saw the package
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_check_finds_a_cycle():
    """The detector itself: a two-module and a three-module cycle are reported, a chain is not; TYPE_CHECKING
    imports are no edge."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kimi.x\ndef f():\n    from kimi import y\n"
    assert _imports(ast.parse(src), "kimi", {"kimi.x", "kimi.y"}) == {"kimi.y"}
