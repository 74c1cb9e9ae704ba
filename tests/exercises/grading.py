"""Which code the exercise tests grade.

    python -m pytest tests/exercises                        # the reference, prefix_caching.py (CI)
    EXERCISE_IMPL=starter python -m pytest tests/exercises  # the student's files in exercises/

Each exercise file in exercises/ uses the same names as prefix_caching.py, so grading the
reference needs no adapter: `exercise("block_hash")` is either module.
"""

import importlib
import os

IMPL = os.environ.get("EXERCISE_IMPL", "reference")
# exercise file -> the module that holds the reference solution (a new exercise adds a line)
REFERENCE = {
    "block_hash": "prefix_caching",
    "free_queue": "prefix_caching",
    "allocator": "prefix_caching",
    "gather_kv": "prefix_caching",
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
