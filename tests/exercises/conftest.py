"""In starter mode, every exercise test first checks that the code it grades is the student's
own (grading.py): each test file names that code in GRADED, next to its `impl`, and a test of
a file whose graded code is not the student's fails before it runs."""

import pytest

import grading


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    graded = getattr(item.module, "GRADED", None)
    assert graded, f"{item.module.__name__} must name the code its exercise writes in GRADED"
    if grading.IMPL != "starter":
        return
    problems = grading.not_your_own(item.module.impl, graded)
    if problems:
        pytest.fail(f"{grading.NOT_YOURS}: " + "; ".join(problems), pytrace=False)


@pytest.fixture(autouse=True)
def the_reference_is_refused(request, monkeypatch):
    """In starter mode the reference's graded functions fail if anything calls them."""
    if grading.IMPL == "starter":
        grading.refuse_the_reference(request.module.impl, request.module.GRADED, monkeypatch)
