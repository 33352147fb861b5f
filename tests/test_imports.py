"""No import cycle anywhere in src/tuneforge, counting imports inside functions too.

A function-local import hides a cycle from Python (the module is complete by the time the
function runs) but not from a reader: each module should be understandable from the modules
below it. Registries count as imports too: a string naming a tuneforge module (tasks' table of
"module:Class") and an f-string `importlib` target such as f"tuneforge.backends.{name}" (every
module of that package). Imports under `if TYPE_CHECKING:` are for annotations only.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The tuneforge modules that `path` imports, at any depth of the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if is_type_checking_block(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = re.fullmatch(r"(tuneforge(?:\.\w+)+)(?::\w+)?", node.value)
            if named:
                found.add(named[1])
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            prefix = str(node.values[0].value)
            if prefix.startswith("tuneforge.") and prefix.endswith("."):
                found.update(m for m in modules if m.startswith(prefix))
            return
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in modules and m != own}


def import_graph() -> dict[str, set[str]]:
    files = sorted((SRC / "tuneforge").rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imported_modules(f, modules) for f in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := dfs(start)):
            return cycle
    return None


def test_the_walker_sees_function_local_imports_registries_and_cycles():
    graph = import_graph()
    assert "tuneforge.trainer" in graph["tuneforge.cli"]  # imported inside cmd_train
    assert "tuneforge.backends.ddp" in graph["tuneforge.backends"]  # importlib.import_module(f"...{name}")
    assert "tuneforge.tasks.clm" in graph["tuneforge.tasks"]  # "module:Class" table
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_src():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
