"""The course's files import one way: each top-level module only modules above it in the
reading order (README, "The code, in reading order"), so the allocator can be read, run and
tested without anything built on it. Every import counts, those inside functions too; only
an `if __name__ == "__main__":` block may reach up (prefix_caching.py's runs cli.py).
A package of the course (analyzer/) is one row of the table and one place in the order; its
files keep the same rule among themselves, in the order its row lists them. No module reads
another's private names, and the allocator, the prompts and the analyzer never load torch.
"""

import ast
import doctest
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top: the order of the README's table.
ORDER = [
    "prefix_caching", "walkthrough", "flags", "model_files", "model_loader", "prompts", "kv_pool", "outputs",
    "request", "sampling", "cpu_threads", "one_request", "scheduler", "step_budget", "batch_attention",
    "static_decode", "model_runner", "batch_engine", "engine_loop", "engine", "model_flags", "demo", "analyzer",
    "server_requests", "server_views", "server_connections", "server_routes", "server", "cli",
]
# A package's place in ORDER, and its own files bottom to top (its row of the table lists them so).
PACKAGES = {"analyzer": ["request_logs", "caching_models", "kv_memory", "fleet", "log_replay", "workload_analyzer"]}
TOP_LEVEL = {path.stem for path in ROOT.glob("*.py")} | set(PACKAGES)
LESSONS = {path.stem for path in (ROOT / "lessons").glob("*.py")}


def modules_of(name: str) -> list[str]:
    """A top-level module's name, or a package's modules in their order ("analyzer.request_logs", ...)."""
    return [f"{name}.{inner}" for inner in PACKAGES[name]] if name in PACKAGES else [name]


MODULES = [module for name in ORDER for module in modules_of(name)]  # every module, bottom to top
TORCH_FREE = ["prefix_caching", "walkthrough", "flags", "model_files", "prompts", *modules_of("analyzer")]


def path_of(module: str) -> Path:
    return ROOT / f"{module.replace('.', '/')}.py"


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
    """The first part of every module name `path` imports, wherever the import sits, and each
    module of a package of ours it names ("analyzer.request_logs")."""
    full = set()
    for node in walk_outside_main(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            full |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module if node.level == 0 else ".".join(filter(None, [path.parent.name, node.module]))
            full |= {module} | {f"{module}.{alias.name}" for alias in node.names if module in PACKAGES}
    return {name.split(".")[0] for name in full} | (full & set(MODULES))


def test_the_order_names_every_top_level_module():
    assert set(ORDER) == TOP_LEVEL, "a new top-level file belongs somewhere in ORDER (and in the README's table)"
    for package, inner in PACKAGES.items():
        files = {path.stem for path in (ROOT / package).glob("*.py")} - {"__init__"}
        assert set(inner) == files, f"a new file of {package}/ belongs somewhere in PACKAGES (and in its row)"


def test_the_readme_table_lists_the_files_in_this_order():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## The code, in reading order"):]
    table = table[: table.index("\n\n", table.index("| file |"))]
    listed = [name for name in re.findall(r"\[`(\w+)(?:\.py|/)`\]", table) if name in TOP_LEVEL]
    assert listed == ORDER
    for package, inner in PACKAGES.items():
        (row,) = [line for line in table.splitlines() if line.startswith(f"| [`{package}/`]")]
        assert re.findall(rf"\[`(\w+)\.py`\]\({package}/", row) == inner, f"{package}/'s row lists its files in order"


def test_each_module_imports_only_modules_below_it():
    for position, name in enumerate(MODULES):
        ours = imported_modules(path_of(name)) & (TOP_LEVEL | set(MODULES))
        above = sorted(ours - set(MODULES[:position]) - set(PACKAGES))  # a package's modules are checked one by one
        assert not above, f"{name} imports {above}, which come after it in the reading order"


def test_no_reference_module_imports_the_lessons_or_the_tests():
    for name in MODULES:
        imports = imported_modules(path_of(name))
        assert not imports & ({"lessons", "tests"} | LESSONS), f"{name} imports the course material"


@pytest.mark.subprocess
def test_the_allocator_the_prompts_and_the_analyzer_load_without_torch():
    """A fresh interpreter (this one has torch already): `--analyze` never waits for it."""
    code = f"import sys, {', '.join(TORCH_FREE)}; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"one of {TORCH_FREE} imports torch:\n{result.stderr}"


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
    trees = {name: ast.parse(path_of(name).read_text()) for name in MODULES}
    private = {name: private_names(tree) for name, tree in trees.items()}
    for name, tree in trees.items():
        others = set().union(*(names for other, names in private.items() if other != name)) - private[name]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in TOP_LEVEL | set(MODULES):
                taken = [a.name for a in node.names if a.name.startswith("_")]
                assert not taken, f"{name} imports private {taken} from {node.module}"
            if isinstance(node, ast.Attribute) and node.attr in others:
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                assert owner in ("self", "cls"), f"{name}:{node.lineno} reads {node.attr}, private to another module"


@pytest.fixture
def module(request):
    """The module, imported while the test is set up: the first to import torch pays ~2 s for
    it, which the unmarked limit (tests/conftest.py) would count against its examples."""
    return importlib.import_module(request.param)


@pytest.mark.parametrize("module", [n for n in MODULES if n not in ("prefix_caching", "cli")], indirect=True)
def test_docstring_examples(module):
    """The small worked examples in docstrings (prefix_caching.py's run in test_allocator.py)."""
    assert doctest.testmod(module).failed == 0
