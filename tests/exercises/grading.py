"""Which code the exercise tests grade, and whether it is the student's own.

    python -m pytest tests/exercises                        # the reference (CI)
    EXERCISE_IMPL=starter python -m pytest tests/exercises  # the student's files in exercises/

Each exercise file in exercises/ uses the same names as its reference module, so grading the
reference needs no adapter: `exercise("block_hash")` is either module.

The exercises follow the stages: 1 block hash (stage 4), 2 allocate (5), 3 free queue (6),
4 free (6), 5 gather K/V (7), 6 schedule (8). An exercise's tests use the student's code
only for that exercise and the ones before it; a piece that a later exercise writes comes
from the reference (exercise 2 runs on prefix_caching's free queue), so exercises can be
done, and graded, one at a time in order.

Each test file names what its exercise writes in GRADED, and in starter mode every one of its
tests fails unless that code is the student's own (conftest.py runs the two checks below): a
method deleted from the starter (so the reference's inherited one runs), one that calls
super() or the reference, or a function imported from the reference earns nothing.
not_your_own reads the starter's code; refuse_the_reference makes the reference's graded
functions fail while a test runs, whatever route reaches them.
"""

import dis
import importlib
import os
from functools import partial
from types import CodeType, FunctionType, ModuleType

import pytest

IMPL = os.environ.get("EXERCISE_IMPL", "reference")
# exercise file -> the module that holds the reference solution (a new exercise adds a line)
REFERENCE = {
    "block_hash": "prefix_caching",
    "allocator": "prefix_caching",
    "free_queue": "prefix_caching",
    "gather_kv": "kv_pool",
    "scheduler": "scheduler",
}


def module_name(exercise_name: str) -> str:
    if IMPL == "reference":
        return REFERENCE[exercise_name]
    if IMPL == "starter":
        return f"exercises.{exercise_name}"
    raise ValueError(f"EXERCISE_IMPL must be 'reference' or 'starter', got {IMPL!r}")


def exercise(exercise_name: str) -> ModuleType:
    """The module under test for one exercise."""
    return importlib.import_module(module_name(exercise_name))


def not_your_own(module: ModuleType, graded: list[str]) -> list[str]:
    """Why each graded name of `module` ("function" or "Class.method") is not code written in
    that module; [] when all of it is.

    Written there means: the class and the function are defined in the module itself (in its
    __dict__, or the class's, not inherited and not imported), and the function calls neither
    super() nor the reference's function imported under any name. (A call through the
    reference module, `scheduler.Scheduler.schedule(self)`, is refused while it runs:
    `refuse_the_reference`.)
    """
    reference = importlib.import_module(REFERENCE[module.__name__.rpartition(".")[2]])
    borrowed = {id(vars(owner).get(short)) for owner, short in map(partial(locate, reference), graded)}
    problems = []
    for name in graded:
        owner, short = locate(module, name)
        if owner is not module and owner.__module__ != module.__name__:
            problems.append(f"{owner.__name__} is imported from {owner.__module__}, not written in {module.__name__}")
            continue
        function = vars(owner).get(short)
        if not isinstance(function, FunctionType):
            problems.append(f"{name} is not defined in {module.__name__}: the reference's runs instead of yours")
        elif function.__module__ != module.__name__ or function.__code__.co_filename != module.__file__:
            problems.append(f"{name} is the function of {function.__module__}, not one written in {module.__name__}")
        else:
            problems += [f"{name} {why}" for why in calls_elsewhere(function, borrowed)]
    return problems


def locate(module: ModuleType, name: str) -> tuple[type | ModuleType, str]:
    """Where a graded name lives: (the class, "method") for "Class.method", (the module, name)."""
    class_name, _, short = name.rpartition(".")
    return (getattr(module, class_name) if class_name else module), short


def calls_elsewhere(function: FunctionType, borrowed: set[int]) -> list[str]:
    """What in `function`'s bytecode (nested functions included) hands its work to other code:
    super(), or a global bound to one of the `borrowed` objects."""
    why = []
    for code in codes(function.__code__):
        for instruction in dis.get_instructions(code):
            if instruction.opname != "LOAD_GLOBAL":
                continue
            if instruction.argval == "super":
                why.append("calls super(): the reference's method does the work")
            elif id(function.__globals__.get(instruction.argval)) in borrowed:
                why.append(f"calls {instruction.argval}, which is the reference's")
    return sorted(set(why))


def codes(code: CodeType):
    """A code object and every code object nested in it (inner functions, comprehensions)."""
    yield code
    for constant in code.co_consts:
        if isinstance(constant, CodeType):
            yield from codes(constant)


def refuse_the_reference(module: ModuleType, graded: list[str], monkeypatch) -> None:
    """For one test, replace the reference's graded functions with one that fails: whatever
    route a starter takes to them (an inherited method, super(), the reference module by
    name) ends in a failure that says so."""
    reference = importlib.import_module(REFERENCE[module.__name__.rpartition(".")[2]])
    for name in graded:
        def refused(*args, name=name, **kwargs):
            pytest.fail(f"{NOT_YOURS}: {name} ran the reference's code ({reference.__name__}.{name})", pytrace=False)

        monkeypatch.setattr(*locate(reference, name), refused)


NOT_YOURS = "the graded code must be your own"
