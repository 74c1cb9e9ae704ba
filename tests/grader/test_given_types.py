"""exercises/given.py copies the reference's types, and this test keeps the copies in step.

The grading child process cannot import the reference modules (exercises/README.md says
why), so given.py writes out again what the starters build on: the block type, the free
queue's sentinels, the pool's tensor, the scheduler's Request, ScheduledRequest, StepPlan
and queues. Nothing else ties the two together, and a copy drifts: given.py's `finish` once
freed a request's blocks without its num_computed_tokens, which engine/scheduler.py's passes.

Each name given.py defines is compared with the one its reference module defines *now*,
whatever that is (REFERENCE below: when a type moves, say Request to engine/request.py, change its
row). For a dataclass: its fields (names, order, types, defaults) and its dataclass options.
For every class: the methods and properties it defines, with the same signatures, and for
the ones given.py copies, the same code (comments and docstrings aside). For a constant: its
value. What given.py leaves out, or writes differently, on purpose is in the tables below,
each with the reason; anything else that differs fails, naming the table to change.
"""

import ast
import dataclasses
import importlib
import inspect
import itertools
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GIVEN = ROOT / "exercises" / "given.py"

# given.py's name -> (the reference module that defines it, its name there).
REFERENCE = {
    "OutOfBlocksError": ("allocator.prefix_caching", "OutOfBlocksError"),
    "Allocation": ("allocator.prefix_caching", "Allocation"),
    "KVCacheBlock": ("allocator.prefix_caching", "KVCacheBlock"),
    "LinkedFreeQueue": ("allocator.prefix_caching", "FreeKVCacheBlockQueue"),
    "ListFreeQueue": ("allocator.prefix_caching", "FreeKVCacheBlockQueue"),
    "PoolBase": ("engine.kv_pool", "PagedKVPool"),
    "WAITING": ("engine.request", "WAITING"),
    "RUNNING": ("engine.request", "RUNNING"),
    "FINISHED": ("engine.request", "FINISHED"),
    "Request": ("engine.request", "Request"),
    "ScheduledRequest": ("engine.scheduler", "ScheduledRequest"),
    "StepPlan": ("engine.scheduler", "StepPlan"),
    "SchedulerBase": ("engine.scheduler", "Scheduler"),
}

ENGINE_SIDE = "the engine's side of a request (engine/request.py); exercise 6 plans steps, and no model runs"
FAIR_SHARE = "fair_share's tenant counters (the Virtual Token Counter): exercise 6 reads the queue in arrival order"
ANSWER = "schedule's helper: part of exercise 6's answer"

# Members of a reference class that given.py leaves out: (given name, member) -> why.
OMITTED = {
    ("LinkedFreeQueue", "appendleft"): "exercise 3b writes it",
    ("LinkedFreeQueue", "remove"): "exercise 3c writes it",
    ("LinkedFreeQueue", "popleft"): "exercise 3d writes it",
    ("LinkedFreeQueue", "_insert_after"): "the reference's helper for append and appendleft: exercise 3's answer",
    ("ListFreeQueue", "_insert_after"): "a list has no links to insert between",
    ("PoolBase", "gather"): "exercise 5b writes it",
    ("PoolBase", "tokens_of"): "exercise 5a writes it",
    ("PoolBase", "shape_from_config"): "the engines size a pool from a model; exercise 5's tests give the shape",
    ("PoolBase", "bytes_per_block"): "the engines' sizing, which no exercise uses",
    ("PoolBase", "slots"): "the batching engine's writes, which no exercise makes",
    ("PoolBase", "write_slots"): "the batching engine's writes of a step's K/V, which no exercise makes",
    ("PoolBase", "read_blocks"): "the batching engine's attention, which no exercise runs",
    ("PoolBase", "blocks"): "the padded decode step's attention (engine/static_decode.py), which no exercise runs",
    ("PoolBase", "scratch_block"): "where a padded decode step's padding goes (engine/static_decode.py); no exercise pads",
    ("PoolBase", "write"): "the engines write a step's K/V; exercise 5's tests fill the pool themselves",
    ("PoolBase", "__str__"): "the server's start-up line, which no exercise prints",
    ("Request", "reply"): ENGINE_SIDE,
    ("SchedulerBase", "schedule"): "exercise 6a writes it",
    ("SchedulerBase", "_preempt"): "exercise 6b writes it",
    ("SchedulerBase", "_lookup"): ANSWER,
    ("SchedulerBase", "_prompt_shares"): ANSWER,
    ("SchedulerBase", "_count"): "adds a step's tokens to its tenant's fair-share counter, which exercise 6 does not keep",
    ("SchedulerBase", "_blocks_coming"): ANSWER,
    ("SchedulerBase", "_hit_coming"): ANSWER,
    **{("SchedulerBase", name): FAIR_SHARE for name in ("_arrive", "least_served", "lead", "charge", "_forget_idle")},
    ("SchedulerBase", "waiting_order"): "the queue least-served tenant first under fair_share; exercise 6 reads it "
                                        "in arrival order (self.waiting as it stands)",
    ("SchedulerBase", "candidates"): "what a budget policy sees (engine/step_budget.py); exercise 6's tests give a budget",
    ("SchedulerBase", "shared_blocks"): "a view the lessons print; the grader reads the queues itself",
    ("SchedulerBase", "check_invariants"): "the grader compares the student's queues and counters with the reference's",
}

# Parameters of a reference method that given.py's copy does not take: (given name, method, parameter) -> why.
OMITTED_PARAMETERS = {
    ("SchedulerBase", "__init__", "enable_chunked_prefill"):
        "exercise 6 writes the chunked rule only (the starter's docstring); its tests never turn it off",
    ("SchedulerBase", "__init__", "fair_share"): FAIR_SHARE,
    ("SchedulerBase", "__init__", "key_cost"): "what fair share charges a key attended: no fair share here",
}

# Fields of a reference dataclass that given.py leaves out: (given name, field) -> why.
OMITTED_FIELDS = {
    ("Request", "tenant"): "whom fair_share and a budget policy (engine/step_budget.py) count a request's tokens for: "
                           "exercise 6 reads the queue in arrival order and its tests give a budget",
    **{("Request", name): ENGINE_SIDE for name in ("params", "builder", "generator", "events", "arrival", "admitted_at",
                                                   "error")},
}

# Methods given.py leaves for a student: the same signature, a body that raises NotImplementedError.
STUBS = {
    ("LinkedFreeQueue", "append"): "exercise 3a (the constructor links the blocks in with the student's append)",
}

# Methods given.py copies with code of its own, on purpose: (given name, method) -> why.
OWN_CODE = {
    ("PoolBase", "__init__"): "imports torch inside, so exercises 1-4 and 6 never load it; and keeps no read buffer "
                              "(read_blocks is not given) nor scratch block (data is its whole memory)",
    ("SchedulerBase", "__init__"): "no check_step_size (the grader's reference scheduler refuses a bad size first), "
                                   "no enable_chunked_prefill nor fair_share (OMITTED_PARAMETERS), and so no tenant "
                                   "counters (served, active)",
    ("SchedulerBase", "add"): "no fair-share counters: exercise 6 reads the queue in arrival order",
    ("SchedulerBase", "finish"): "no fair-share counters: exercise 6 reads the queue in arrival order",
}

# given.py classes that share only the reference's interface: every body is their own.
INTERFACE_ONLY = {
    "ListFreeQueue": "a stand-in free queue on a Python list (O(n) remove) for exercise 2, until exercise 3's "
                     "linked one replaces it; test_list_free_queue_behaves_like_the_reference checks its answers",
}

# How given.py spells a type the reference names by an alias it does not have.
TYPE_ALIASES = {"BlockHash": "bytes"}


# --- reading both sides --------------------------------------------------------------------------


@cache
def module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def module_path(module: str) -> Path:
    return ROOT / f"{module.replace('.', '/')}.py"


def top_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    """What a module itself defines at its top level: classes, functions, assigned names."""
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def class_node(path: Path, name: str) -> ast.ClassDef:
    node = top_level_names(module_tree(path)).get(name)
    assert isinstance(node, ast.ClassDef), f"{path.name} defines no class {name}: see REFERENCE"
    return node


def members(node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    """The methods and properties a class statement writes itself (not what @dataclass adds)."""
    return {item.name: item for item in node.body if isinstance(item, ast.FunctionDef)}


def code_of(function: ast.FunctionDef) -> str:
    """A method's decorators and statements, without its docstring and comments."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return ast.dump(ast.Module(body=[*function.decorator_list, *body], type_ignores=[]))


def is_stub(function: ast.FunctionDef) -> bool:
    statements = [ast.unparse(s) for s in function.body if not isinstance(s, ast.Expr)]
    return len(statements) == 1 and statements[0].startswith("raise NotImplementedError(")


def reference(name: str):
    module, ref_name = REFERENCE[name]
    return getattr(importlib.import_module(module), ref_name)


def given_module():
    """exercises.given, imported without leaving a __pycache__ in exercises/ (a student's folder,
    which test_grading.py reads file by file)."""
    previous, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        return importlib.import_module("exercises.given")
    finally:
        sys.dont_write_bytecode = previous


@pytest.fixture(scope="module", autouse=True)
def imported():
    """The reference modules and given.py imported before the first test (kv_pool and given.py
    import torch): no single test pays for it."""
    for module, _ in REFERENCE.values():
        importlib.import_module(module)
    given_module()


def given_names() -> dict[str, ast.AST]:
    return {name: node for name, node in top_level_names(module_tree(GIVEN)).items() if not name.startswith("_")}


def signature_without(function, dropped: set[str]) -> list[tuple]:
    """A signature as (name, kind, default): annotations left aside, since given.py cannot
    always name the reference's types (PrefixCachingAllocator)."""
    params = inspect.signature(function).parameters.values()
    return [(p.name, p.kind.name, p.default) for p in params if p.name not in dropped]


def annotation(text) -> str:
    text = str(text)
    for alias, spelled in TYPE_ALIASES.items():
        text = text.replace(alias, spelled)
    return text


CLASSES = [name for name, node in given_names().items() if isinstance(node, ast.ClassDef)]
DATACLASSES = [name for name in CLASSES if dataclasses.is_dataclass(getattr(given_module(), name))]


# --- the table ----------------------------------------------------------------------------------


def test_every_name_given_defines_has_its_reference():
    missing = sorted(set(given_names()) - set(REFERENCE))
    assert not missing, (f"exercises/given.py defines {missing}, which REFERENCE (tests/grader/test_given_types.py) does "
                         "not map to the reference: add a row naming the module and name it copies")
    stale = sorted(set(REFERENCE) - set(given_names()))
    assert not stale, f"REFERENCE maps {stale}, which exercises/given.py no longer defines: drop the rows"


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_the_table_names_the_module_that_defines_it(name):
    module, ref_name = REFERENCE[name]
    assert ref_name in top_level_names(module_tree(module_path(module))), (
        f"{module_path(module).relative_to(ROOT)} no longer defines {ref_name} (given.py's {name}): point REFERENCE at the module that "
        f"does now (grep -rn '^class {ref_name}\\b\\|^{ref_name} =' --include=*.py .)")


def test_given_says_which_reference_files_it_copies():
    docstring = ast.get_docstring(module_tree(GIVEN))
    for module in sorted({module for module, _ in REFERENCE.values()}):
        path = module_path(module).relative_to(ROOT)
        assert str(path) in docstring, (
            f"exercises/given.py's docstring should name {path}, where some of the types it copies live now")


def test_every_table_entry_is_still_about_something():
    for table, entries in (("OMITTED", OMITTED), ("STUBS", STUBS), ("OWN_CODE", OWN_CODE)):
        for given_name, member in entries:
            ref_name = REFERENCE[given_name][1]
            ref_members = members(class_node(module_path(REFERENCE[given_name][0]), ref_name))
            assert member in ref_members, f"{table} lists {given_name}.{member}, which {ref_name} no longer has"
    for (given_name, method, param) in OMITTED_PARAMETERS:
        assert param in inspect.signature(getattr(reference(given_name), method)).parameters, (
            f"OMITTED_PARAMETERS lists {param} of {given_name}.{method}, which the reference no longer takes")
    for (given_name, field_name) in OMITTED_FIELDS:
        assert field_name in {f.name for f in dataclasses.fields(reference(given_name))}, (
            f"OMITTED_FIELDS lists {given_name}.{field_name}, which the reference no longer has")


# --- constants and plain classes ------------------------------------------------------------------


@pytest.mark.parametrize("name", [name for name in sorted(REFERENCE) if name not in CLASSES])
def test_a_constant_has_the_reference_value(name):
    assert getattr(given_module(), name) == reference(name), f"given.{name} differs from {REFERENCE[name]}"


def test_the_exception_has_the_reference_bases():
    assert given_module().OutOfBlocksError.__bases__ == reference("OutOfBlocksError").__bases__


def test_the_named_tuple_has_the_reference_fields():
    ours, theirs = given_module().Allocation, reference("Allocation")
    assert ours._fields == theirs._fields and ours._field_defaults == theirs._field_defaults
    assert {k: annotation(v) for k, v in ours.__annotations__.items()} == \
           {k: annotation(v) for k, v in theirs.__annotations__.items()}


# --- dataclasses ------------------------------------------------------------------------------------


def field_view(f: dataclasses.Field) -> str:
    """A field as a class statement writes it: `name: type = default`, field() options spelled out."""
    options = [f"default={f.default!r}"] if f.default is not dataclasses.MISSING else []
    if f.default_factory is not dataclasses.MISSING:
        options.append(f"default_factory={getattr(f.default_factory, '__name__', f.default_factory)}")
    options += [f"{o}={getattr(f, o)}" for o, usual in (("init", True), ("repr", True), ("compare", True),
                                                          ("kw_only", False)) if getattr(f, o) != usual]
    if options == [f"default={f.default!r}"]:
        return f"{f.name}: {annotation(f.type)} = {f.default!r}"
    return f"{f.name}: {annotation(f.type)}" + (f" = field({', '.join(options)})" if options else "")


DATACLASS_OPTIONS = ("init", "repr", "eq", "order", "unsafe_hash", "frozen")


@pytest.mark.parametrize("name", DATACLASSES)
def test_a_dataclass_has_the_reference_fields_in_order(name):
    ours, theirs = getattr(given_module(), name), reference(name)
    assert dataclasses.is_dataclass(theirs), f"{REFERENCE[name]} is no longer a dataclass; given.{name} is"
    kept = [f for f in dataclasses.fields(theirs) if (name, f.name) not in OMITTED_FIELDS]
    expected = [field_view(f) for f in kept]
    got = [field_view(f) for f in dataclasses.fields(ours)]
    lines = [f"  {'' if a == b else '!'} given: {a:<55} reference: {b}"
             for a, b in itertools.zip_longest(got, expected, fillvalue="-")]
    assert got == expected, (
        f"given.{name}'s fields differ from {'.'.join(REFERENCE[name])}'s, less OMITTED_FIELDS (! marks a "
        "difference):\n" + "\n".join(lines) + "\ncopy the reference's fields into exercises/given.py, or list a "
        "field the grading child must go without in OMITTED_FIELDS (tests/grader/test_given_types.py) with the reason")
    options = [(o, getattr(ours.__dataclass_params__, o), getattr(theirs.__dataclass_params__, o))
               for o in DATACLASS_OPTIONS]
    assert all(a == b for _, a, b in options), f"given.{name}'s @dataclass options differ: {options}"


# --- methods ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CLASSES)
def test_a_class_has_the_reference_methods(name):
    module, ref_name = REFERENCE[name]
    ours = members(class_node(GIVEN, name))
    theirs = members(class_node(module_path(module), ref_name))
    extra = sorted(set(ours) - set(theirs))
    assert not extra, f"given.{name} has {extra}, which {module}.{ref_name} does not: drop them or copy them there"
    missing = sorted(m for m in set(theirs) - set(ours) if (name, m) not in OMITTED)
    assert not missing, (f"given.{name} lacks {module}.{ref_name}'s {missing}: copy them into exercises/given.py, "
                         "or add them to OMITTED (tests/grader/test_given_types.py) with the reason a starter goes without")
    listed = sorted(m for (n, m) in OMITTED if n == name and m in ours)
    assert not listed, f"OMITTED lists given.{name}'s {listed}, which given.py has now: drop the entries"


def shared_methods(name: str):
    module, ref_name = REFERENCE[name]
    if not module_path(module).exists() or ref_name not in top_level_names(module_tree(module_path(module))):
        return []  # test_the_table_names_the_module_that_defines_it says where to look
    ours = members(class_node(GIVEN, name))
    theirs = members(class_node(module_path(module), ref_name))
    return [(name, method, ours[method], theirs[method]) for method in sorted(set(ours) & set(theirs))]


SHARED = [case for name in CLASSES for case in shared_methods(name)]


@pytest.mark.parametrize("name, method, ours, theirs", SHARED, ids=[f"{c[0]}.{c[1]}" for c in SHARED])
def test_a_method_has_the_reference_signature(name, method, ours, theirs):
    given_attr = inspect.getattr_static(getattr(given_module(), name), method)
    ref_attr = inspect.getattr_static(reference(name), method)
    assert type(given_attr) is type(ref_attr), (
        f"given.{name}.{method} is a {type(given_attr).__name__}, the reference's a {type(ref_attr).__name__}")
    if isinstance(given_attr, property):
        given_attr, ref_attr = given_attr.fget, ref_attr.fget
    elif isinstance(given_attr, (staticmethod, classmethod)):
        given_attr, ref_attr = given_attr.__func__, ref_attr.__func__
    dropped = {param for (n, m, param) in OMITTED_PARAMETERS if (n, m) == (name, method)}
    assert signature_without(given_attr, set()) == signature_without(ref_attr, dropped), (
        f"given.{name}.{method}{inspect.signature(given_attr)} differs from the reference's "
        f"{inspect.signature(ref_attr)}: copy the reference's, or list a parameter in OMITTED_PARAMETERS")


@pytest.mark.parametrize("name, method, ours, theirs", SHARED, ids=[f"{c[0]}.{c[1]}" for c in SHARED])
def test_a_copied_method_has_the_reference_code(name, method, ours, theirs):
    """The same statements, comments and docstrings aside; a stub stays a stub."""
    if (name, method) in STUBS:
        assert is_stub(ours), f"given.{name}.{method} is in STUBS, for a student to write: it should only raise"
        return
    if name in INTERFACE_ONLY or (name, method) in OWN_CODE:
        assert code_of(ours) != code_of(theirs), (
            f"given.{name}.{method} is the reference's code again: drop it from OWN_CODE")
        return
    module, ref_name = REFERENCE[name]
    assert code_of(ours) == code_of(theirs), (
        f"given.{name}.{method} is not {module}.{ref_name}.{method}'s code:\n--- given.py\n{ast.unparse(ours)}\n"
        f"--- {module_path(module).relative_to(ROOT)}\n{ast.unparse(theirs)}\ncopy the reference's code into exercises/given.py, or, if the "
        "grading child needs its own, list it in OWN_CODE (tests/grader/test_given_types.py) with the reason")


# --- what the copies do ---------------------------------------------------------------------------------


def test_the_free_queue_starts_with_the_reference_sentinels():
    """Exercise 3 builds on the sentinels: two blocks with id -1, linked to each other when empty."""
    ours, theirs = given_module().LinkedFreeQueue([]), reference("LinkedFreeQueue")([])

    def view(queue):
        return {name: (value.block_id, value.prev_free is not None, value.next_free is not None)
                if hasattr(value, "block_id") else value for name, value in vars(queue).items()}

    assert view(ours) == view(theirs)
    assert ours._head.next_free is ours._tail and ours._tail.prev_free is ours._head


def test_list_free_queue_behaves_like_the_reference():
    """The stand-in answers what the linked queue answers, errors included, on one script."""
    script = [("popleft",), ("remove", 3), ("append", 3), ("appendleft", 0), ("popleft",), ("remove", 3),
              ("popleft",), ("popleft",), ("popleft",), ("popleft",), ("popleft",), ("append", 1), ("appendleft", 4)]
    given = given_module()
    runs = []
    for block_type, queue_type in ((given.KVCacheBlock, given.ListFreeQueue),
                                   (reference("KVCacheBlock"), reference("ListFreeQueue"))):
        blocks = [block_type(i) for i in range(5)]
        queue, answers = queue_type(blocks), []
        for op, *block in script:
            try:
                result = getattr(queue, op)(*[blocks[i] for i in block])
                answers.append(getattr(result, "block_id", result))
            except (ValueError, IndexError) as err:
                answers.append(type(err).__name__)
            answers.append((queue.block_ids(), len(queue), [b.block_id for b in queue]))
        runs.append(answers)
    assert runs[0] == runs[1]


def test_the_pool_has_the_reference_shape():
    import torch

    shape = dict(num_layers=2, num_kv_heads=3, head_dim=4, num_blocks=5, block_size=2, dtype=torch.bfloat16)
    ours, theirs = given_module().PoolBase(**shape), reference("PoolBase")(**shape)
    assert ours.data.shape == theirs.data.shape and ours.dtype == theirs.dtype and ours.device == theirs.device
    public = {k for k in vars(theirs) if not k.startswith("_")}
    assert {k for k in vars(ours) if not k.startswith("_")} == public
    assert all(getattr(ours, k) == getattr(theirs, k) for k in public - {"data"})
