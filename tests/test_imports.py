"""The package's imports point one way: a test that walks every import in toolkit/ (those inside
functions and under TYPE_CHECKING included) and fails on any cycle between its modules.

A cycle through function-level imports runs today and breaks the day someone moves an import to
the top of a file; it also means two modules cannot be understood apart.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "toolkit"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the toolkit modules it imports anywhere in its text."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x / from .a import b
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from toolkit.training import checkpoint` imports the submodule
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target and target not in files:  # toolkit.a.b.name -> toolkit.a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_function_level_imports():
    graph = import_graph()
    # session.py imports the checkpoint module only inside its methods
    assert "toolkit.training.checkpoint" in graph["toolkit.training.session"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    found = cycles(graph)

    def explain(component: list[str]) -> str:
        members = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        return "; ".join(edges)

    assert not found, "import cycles:\n" + "\n".join(explain(c) for c in found)


def test_the_memory_package_imports_no_training_code():
    """`toolkit.memory` (estimate, simulation, pre-flight) is called by training through one function
    and builds on the model, the parallel plan and the optimizer: never on training or the entry points."""
    graph = import_graph()
    forbidden = ("toolkit.training", "toolkit.finetune", "toolkit.pretrain", "toolkit.cli")
    memory = [name for name in graph if name == "toolkit.memory" or name.startswith("toolkit.memory.")]
    assert "toolkit.memory.activations" in memory
    found = sorted((name, target) for name in memory for target in graph[name]
                   if any(target == f or target.startswith(f + ".") for f in forbidden))  # fmt: skip
    assert not found, found
