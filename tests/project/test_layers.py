"""The course's modules import one way: each module only modules above it in the reading order
(README, "The code, in reading order"), so the allocator can be read, run and tested without
anything built on it, and no import goes in a circle. Every import counts: those inside
functions, and those under `if __name__ == "__main__":`. The root holds the two commands and
nothing else of the course's code; everything else lives in a package named for its role
(allocator/, engine/, commands/, analyzer/, serving/), whose files keep the same rule. No
module reads another's private names, and the allocator, the prompts and the analyzer never
load torch.
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
    "allocator.prefix_caching",
    "engine.model_files", "engine.model_loader", "engine.prompts", "engine.kv_pool", "engine.outputs",
    "engine.request", "engine.sampling", "engine.cpu_threads", "engine.cuda_graphs", "engine.one_request", "engine.scheduler",
    "engine.step_budget", "engine.batch_attention", "engine.static_decode", "engine.static_chunk", "engine.fixed_past",
    "engine.model_runner",
    "engine.batch_engine", "engine.engine_loop", "engine.llm_engine",
    "commands.flags", "commands.walkthrough", "commands.model_flags", "commands.demo",
    "analyzer.request_logs", "analyzer.caching_models", "analyzer.llama_slots", "analyzer.kv_memory", "analyzer.fleet", "analyzer.vllm_requests",
    "analyzer.log_replay", "analyzer.fleet_replay", "analyzer.workload_analyzer",
    "serving.requests", "serving.views", "serving.connections", "serving.routes",
    "server", "prefix_caching",
]
MODULES = ORDER
PACKAGES = list(dict.fromkeys(name.split(".")[0] for name in ORDER if "." in name))
ROOT_FILES = {path.stem for path in ROOT.glob("*.py")}
OURS = set(ORDER) | set(PACKAGES)
LESSONS = {path.stem for path in (ROOT / "lessons").glob("*.py")}
TORCH_FREE = ["prefix_caching", "allocator.prefix_caching", "commands.walkthrough", "commands.flags",
              "engine.model_files", "engine.prompts", *[name for name in ORDER if name.startswith("analyzer.")]]


def path_of(module: str) -> Path:
    return ROOT / f"{module.replace('.', '/')}.py"


def exports_of(package: str) -> dict[str, str]:
    """The names `from package import NAME` gives, and the module of ours that defines each: the
    package's own `from package.module import ...` lines, or its EXPORTS table (engine's, whose
    names load when first asked for)."""
    exports = {}
    for node in ast.walk(ast.parse((ROOT / package / "__init__.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module in ORDER:
            exports |= {alias.asname or alias.name: node.module for alias in node.names}
        elif isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["EXPORTS"]:
            exports |= ast.literal_eval(node.value)
    return exports


EXPORTS = {package: exports_of(package) for package in PACKAGES}


def imported_modules(path: Path, tree: ast.AST | None = None) -> set[str]:
    """Every module `path` imports, wherever the import sits (main blocks included): a module of
    ours by its full name ("engine.kv_pool"; `from engine import Engine` names engine.llm_engine,
    the module its package takes Engine from), anything else by its first part ("torch")."""
    found = set()
    for node in ast.walk(tree or ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name if alias.name in OURS else alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            module = node.module
            if module in PACKAGES:
                for alias in node.names:
                    inner = f"{module}.{alias.name}"
                    if inner in ORDER:
                        found.add(inner)
                    elif alias.name in EXPORTS[module]:
                        found.add(EXPORTS[module][alias.name])
                    else:  # `*`, `__all__`: every module the package takes names from
                        found |= set(EXPORTS[module].values()) or {module}
            else:
                found.add(module if module in OURS else module.split(".")[0])
    return found


def test_the_root_holds_the_two_commands_and_every_module_is_in_the_order():
    assert ROOT_FILES == {"prefix_caching", "server"}, "a new module belongs in a package (and in ORDER)"
    for package in PACKAGES:
        files = {f"{package}.{path.stem}" for path in (ROOT / package).glob("*.py")} - {f"{package}.__init__"}
        assert files == {name for name in ORDER if name.startswith(f"{package}.")}, \
            f"a new file of {package}/ belongs somewhere in ORDER (and in the README's table)"
        assert not (ROOT / f"{package}.py").exists(), f"{package}/ would shadow {package}.py"


def test_the_readme_table_lists_the_files_in_this_order():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## The code, in reading order"):]
    table = table[: table.index("\n\n", table.index("| file |"))]
    listed = [target[:-3].replace("/", ".") for target in re.findall(r"\]\(([\w/]+\.py)\)", table)]
    assert listed == ORDER


def test_each_module_imports_only_modules_below_it():
    for position, name in enumerate(ORDER):
        ours = imported_modules(path_of(name)) & OURS
        above = sorted(ours - set(ORDER[:position]))
        assert not above, f"{name} imports {above}, which come after it in the reading order"


def test_the_packages_init_files_import_only_their_own_modules():
    for package in PACKAGES:
        ours = imported_modules(ROOT / package / "__init__.py") & OURS
        assert all(name.startswith(f"{package}.") for name in ours), f"{package}/__init__.py imports {ours}"


def test_no_import_goes_in_a_circle_anywhere_in_the_repository():
    """Every module of the repository outside tests/ (the packages, the two commands, the
    benchmarks, the lessons' helpers), every import counted: no cycle, however long."""
    folders = [ROOT, *(ROOT / package for package in PACKAGES), ROOT / "benchmarks", ROOT / "lessons"]
    paths = [p for folder in folders for p in folder.glob("*.py") if not p.name[0].isdigit() and p.name != "__init__.py"]
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in paths}
    lessons = {p.stem: f"lessons.{p.stem}" for p in paths if p.parent.name == "lessons"}
    graph = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text())
        imports = imported_modules(path, tree)
        for node in ast.walk(tree):  # benchmarks.x, lessons.x and the lessons' own `import words`
            if isinstance(node, ast.ImportFrom) and node.module in ("benchmarks", "lessons"):
                imports |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imports.add(node.module)
            elif isinstance(node, ast.Import):
                imports |= {alias.name for alias in node.names}
        graph[name] = {lessons.get(i, i) for i in imports if lessons.get(i, i) in names and lessons.get(i, i) != name}
    state = {}

    def visit(name, trail):
        state[name] = "open"
        for other in sorted(graph[name]):
            assert state.get(other) != "open", f"an import cycle: {' -> '.join(trail[trail.index(other):] + [other])}"
            if other not in state:
                visit(other, trail + [other])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert len(graph) > 60


def test_nothing_imports_the_front_door():
    """prefix_caching.py at the top re-exports the allocator for users and runs the commands;
    every module of the course (the packages, server.py, the benchmarks, the lessons and the
    exercises) imports the package it needs instead, so the front door stays on top."""
    folders = [*(ROOT / package for package in PACKAGES), ROOT / "benchmarks", ROOT / "lessons", ROOT / "exercises"]
    for path in [ROOT / "server.py", *(p for folder in folders for p in folder.glob("*.py"))]:
        assert "prefix_caching" not in imported_modules(path), f"{path.relative_to(ROOT)} imports prefix_caching.py"


def test_no_reference_module_imports_the_lessons_or_the_tests():
    for name in ORDER:
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
        assert not imports & ({"lessons", "tests"} | (LESSONS - ROOT_FILES)), f"benchmarks/{path.name} imports lessons"


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
            if isinstance(node, ast.ImportFrom) and node.module in OURS:
                taken = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                assert not taken, f"{name} imports private {taken} from {node.module}"
            if isinstance(node, ast.Attribute) and node.attr in others:
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                assert owner in ("self", "cls"), f"{name}:{node.lineno} reads {node.attr}, private to another module"


@pytest.fixture
def module(request):
    """The module, imported while the test is set up: the first to import torch pays ~2 s for
    it, which the unmarked limit (tests/conftest.py) would count against its examples."""
    return importlib.import_module(request.param)


@pytest.mark.parametrize("module", [n for n in ORDER if n not in ("allocator.prefix_caching", "prefix_caching")],
                         indirect=True)
def test_docstring_examples(module):
    """The small worked examples in docstrings (allocator/prefix_caching.py's run in test_allocator.py)."""
    assert doctest.testmod(module).failed == 0
