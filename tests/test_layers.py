"""The course's files import one way: each top-level module only modules above it in the
reading order (README, "The code, in reading order"), so the allocator can be read, run and
tested without anything built on it. Every import counts, those inside functions too; only
an `if __name__ == "__main__":` block may reach up (prefix_caching.py's runs cli.py).
No module reads another's private names.
"""

import ast
import doctest
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top: the order of the README's table.
ORDER = [
    "prefix_caching", "walkthrough", "model_loader", "kv_pool", "sampling", "outputs", "cpu_threads",
    "one_request", "scheduler", "step_budget", "batch_attention", "batch_engine", "engine_loop", "engine", "demo",
    "request_logs", "caching_models", "kv_memory", "workload_analyzer", "server_requests", "server_views",
    "server_connections", "server_routes", "server", "cli",
]
TOP_LEVEL = {path.stem for path in ROOT.glob("*.py")}
LESSONS = {path.stem for path in (ROOT / "lessons").glob("*.py")}


def is_main_block(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def walk_outside_main(tree: ast.AST):
    """Every node of the module, except what an `if __name__ == "__main__":` block holds."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(child for child in ast.iter_child_nodes(node) if not is_main_block(child))


def imported_modules(path: Path) -> set[str]:
    """The first part of every module name `path` imports, wherever the import sits."""
    names = set()
    for node in walk_outside_main(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_order_names_every_top_level_module():
    assert set(ORDER) == TOP_LEVEL, "a new top-level file belongs somewhere in ORDER (and in the README's table)"


def test_the_readme_table_lists_the_files_in_this_order():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## The code, in reading order"):]
    table = table[: table.index("\n\n", table.index("| file |"))]
    listed = [name for name in re.findall(r"\[`(\w+)\.py`\]", table) if name in TOP_LEVEL]
    assert listed == ORDER


def test_each_module_imports_only_modules_below_it():
    for position, name in enumerate(ORDER):
        ours = imported_modules(ROOT / f"{name}.py") & TOP_LEVEL
        above = sorted(ours - set(ORDER[:position]))
        assert not above, f"{name}.py imports {above}, which come after it in the reading order"


def test_no_reference_module_imports_the_lessons_or_the_tests():
    for name in ORDER:
        imports = imported_modules(ROOT / f"{name}.py")
        assert not imports & ({"lessons", "tests"} | LESSONS), f"{name}.py imports the course material"


def test_benchmarks_import_the_reference_only():
    for path in (ROOT / "benchmarks").glob("*.py"):
        imports = imported_modules(path)
        assert not imports & ({"lessons", "tests"} | (LESSONS - TOP_LEVEL)), f"benchmarks/{path.name} imports lessons"


def private_names(tree: ast.AST) -> set[str]:
    """Names a module keeps to itself: its _functions, _classes, _methods and self._attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_another_modules_private_names():
    trees = {name: ast.parse((ROOT / f"{name}.py").read_text()) for name in ORDER}
    private = {name: private_names(tree) for name, tree in trees.items()}
    for name, tree in trees.items():
        others = set().union(*(names for other, names in private.items() if other != name)) - private[name]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in TOP_LEVEL:
                taken = [a.name for a in node.names if a.name.startswith("_")]
                assert not taken, f"{name}.py imports private {taken} from {node.module}"
            if isinstance(node, ast.Attribute) and node.attr in others:
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                assert owner in ("self", "cls"), f"{name}.py:{node.lineno} reads {node.attr}, private to another module"


@pytest.mark.parametrize("name", [n for n in ORDER if n not in ("prefix_caching", "cli")])
def test_docstring_examples(name):
    """The small worked examples in docstrings (prefix_caching.py's run in test_allocator.py)."""
    assert doctest.testmod(importlib.import_module(name)).failed == 0
