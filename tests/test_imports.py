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


# ---- the house: each module on a floor, imports only from its floor or below -----------------------------
# Lowest first. A module is on the floor of the longest prefix that names it; a new module must be placed here.
FLOORS = {
    "ground": (  # what every part uses: errors, options and config (inert data), files, model folders, progress
        "tuneforge.errors",
        "tuneforge.options",
        "tuneforge.flags",
        "tuneforge.config",
        "tuneforge.files",
        "tuneforge.paths",
        "tuneforge.run_lock",
        "tuneforge.yaml_files",
        "tuneforge.artifacts",
        "tuneforge.progress",
        "tuneforge.weights",
        "tuneforge.schedules",
        "tuneforge.freezing",
        "tuneforge.launch",
        "tuneforge.processes",
        "tuneforge.stops",
        "tuneforge.reporting",
        "tuneforge.tracking",
        "tuneforge.callbacks",
        "tuneforge.plan",
        "tuneforge.running_batch",
        "tuneforge.slot_cache",
        "tuneforge.data.samplers",
        "tuneforge.data.mixture",
        "tuneforge.data.order_cache",
        "tuneforge.data.prefetch",
        "tuneforge.serve.detokenize",
        "tuneforge.serve.metrics",
        "tuneforge.serve.options",
        "tuneforge.harness.options",
        "tuneforge.tool_calls",
        "tuneforge.generation_defaults",
    ),
    "data": ("tuneforge.data", "tuneforge.download"),  # reading and tokenizing files; hub downloads
    "engines": (  # process groups and wrapping, adapters, checkpoints, exports, generation
        "tuneforge.backends",
        "tuneforge.adapters",
        "tuneforge.checkpoint",
        "tuneforge.environment",
        "tuneforge.export",
        "tuneforge.gguf_export",
        "tuneforge.generate",
    ),
    "tasks": ("tuneforge.tasks", "tuneforge.rewards"),  # task families, and the reward functions GRPO scores with
    "runs and services": (  # a resolved config, the training run, predict, chat, the server
        "tuneforge.configure",
        "tuneforge.training_data",
        "tuneforge.prepare",
        "tuneforge.run",
        "tuneforge.trainer",
        "tuneforge.predict",
        "tuneforge.runs",
        "tuneforge.sweep",
        "tuneforge.chat",
        "tuneforge.harness",
        "tuneforge.serve.",
    ),
    "entry points": ("tuneforge.cli", "tuneforge.serve", "tuneforge"),  # commands, the package's API
}


def floor_of(module: str) -> int:
    best = (-1, -1)  # (prefix length, floor)
    for floor, prefixes in enumerate(FLOORS.values()):
        for prefix in prefixes:
            if module == prefix or (module.startswith(prefix) and (prefix.endswith(".") or module[len(prefix)] == ".")):
                best = max(best, (len(prefix), floor))
    assert best[1] >= 0, f"{module} is on no floor: place it in FLOORS (tests/test_imports.py)"
    return best[1]


def test_no_module_imports_from_a_floor_above_it():
    names = list(FLOORS)
    upward = [
        f"{module} ({names[floor_of(module)]}) imports {target} ({names[floor_of(target)]})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if floor_of(target) > floor_of(module)
    ]
    assert not upward, "imports that run up the house:\n" + "\n".join(upward)


def test_the_floors_are_read_as_meant():
    assert floor_of("tuneforge.serve") == 5 and floor_of("tuneforge.serve.engine") == 4
    assert floor_of("tuneforge.serve.options") == 0 and floor_of("tuneforge.tasks.qa") == 3
    assert floor_of("tuneforge.data.samplers") == 0 and floor_of("tuneforge.data.chat") == 1


# ---- capabilities, not names: no task or backend is named outside its own file and its registry ------------
# the modules that serve every task and backend alike (the registries, tasks/ and backends/, may name them)
GENERIC = ("config.py", "configure.py", "cli.py", "reporting.py", "generate.py", "trainer.py", "run.py", "serve")


# A word of an outside wire format that happens to be a task's name, allowed in the one file that speaks that format,
# and only as a whole string constant (a JSON key or value, never prose): OpenAI's embeddings API calls each vector
# an "embedding" (the answer's `object` and field), which serve/routes_embeddings.py writes as OpenAI does.
WIRE_FORMAT_WORDS = {"tuneforge/serve/routes_embeddings.py": {"embedding"}}


def registered_names() -> list[str]:
    from tuneforge.backends import available_backends
    from tuneforge.tasks import TASKS

    return [name.rstrip("/") for name in TASKS] + available_backends()


def strings_in(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant in `path` except docstrings (prose about what a module serves)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def generic_files() -> list[Path]:
    root = SRC / "tuneforge"
    return sorted(
        p for entry in GENERIC for p in ([root / entry] if entry.endswith(".py") else (root / entry).glob("*.py"))
    )


def test_no_task_or_backend_name_outside_its_own_files():
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, registered_names())) + r")(?![\w-])")
    found = [
        f"{path.relative_to(SRC)}:{line}: {match[0]!r} in {text[:80]!r}"
        for path in generic_files()
        for line, text in strings_in(path)
        for match in pattern.finditer(text)
        if text not in WIRE_FORMAT_WORDS.get(path.relative_to(SRC).as_posix(), ())
    ]
    assert not found, "names that belong in a task's or backend's own file (use a capability):\n" + "\n".join(found)


def test_the_name_check_sees_names_in_strings_and_skips_docstrings(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""serves qa models."""\n\ndef f(task):\n    """for ddp."""\n    return task == "qa" or "--backend tp"\n'
    )
    assert sorted(text for _, text in strings_in(sample)) == ["--backend tp", "qa"]
    assert {"qa", "ddp", "bbc-news", "glue"} <= set(registered_names())
    assert len(generic_files()) > 10


def test_each_wire_format_word_is_a_registered_name_its_generic_file_writes():
    """No stale allowance: each allowed word is a task's name (else it needs none), its file is a generic one that
    writes the word as a whole string constant."""
    names, generic = set(registered_names()), {p.relative_to(SRC).as_posix(): p for p in generic_files()}
    for file, words in WIRE_FORMAT_WORDS.items():
        assert file in generic, f"{file} is not a generic module: it needs no allowance"
        constants = {text for _, text in strings_in(generic[file])}
        for word in words:
            assert word in names and word in constants, f"{word!r}: no task's name, or not written by {file}"
