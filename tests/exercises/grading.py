"""Which code the exercise tests grade.

    python -m pytest tests/exercises                        # the reference (CI)
    EXERCISE_IMPL=starter python -m pytest tests/exercises  # the student's files in exercises/

Each exercise file in exercises/ uses the same names as its reference module, so grading the
reference needs no adapter: `exercise("block_hash")` is either module.

The exercises follow the stages: 1 block hash (stage 4), 2 allocate (5), 3 free queue (6),
4 free (6), 5 gather K/V (7), 6 schedule (8). An exercise's tests use the student's code
only for that exercise and the ones before it; a piece that a later exercise writes comes
from the reference (exercise 2 runs on prefix_caching's free queue), so exercises can be
done, and graded, one at a time in order.
"""

import importlib
import os

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


def exercise(exercise_name: str):
    """The module under test for one exercise."""
    return importlib.import_module(module_name(exercise_name))
