"""The graded code runs in a child process, one per test file (grading.py); a test gets it
as the fixture `child`. After a test's own assertions pass, the first difference with the
reference that any of its objects showed fails it, naming the rule of what differed."""

import pytest

import grading


@pytest.fixture(scope="module")
def child(request):
    """The child process running the graded code of this test file's exercise (EXERCISE in the file)."""
    process = grading.Child(request.module.EXERCISE)
    yield process
    process.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    grading.DIFFERENCES.clear()
    result = yield  # raises when the test failed: its own message names the rule
    if grading.DIFFERENCES:
        pytest.fail(f"the graded code differs from the reference: {grading.DIFFERENCES[0]}", pytrace=False)
    return result
