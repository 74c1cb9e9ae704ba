"""The graded code runs in a child process, one per test file (grading.py); a test gets it
as the fixture `child`. After a test's own assertions pass, the first difference with the
reference that any of its objects showed fails it, naming the rule of what differed.

Every run draws its inputs from one seed (grading.SEED): it opens and closes the run, follows
every failure, and GRADING_SEED=<seed> runs the same inputs again."""

from pathlib import Path

import pytest
from hypothesis import seed

import grading
import machine


def pytest_sessionstart(session):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:  # before the first test, even under -q, which hides pytest's header
        reporter.write_line(f"grading seed {grading.SEED}: {grading.REPRODUCE}")


def pytest_collection_modifyitems(items):
    # Every random sequence of hypothesis in the graded tests comes from the run's seed. The
    # hook sees the whole session's items: the other test files' keep their own settings.
    here = Path(__file__).parent
    for item in items:
        function = getattr(item, "obj", None)
        function = getattr(function, "__func__", function)  # a test written as a method
        if here in item.path.parents and getattr(function, "is_hypothesis_test", False):
            seed(grading.SEED)(function)


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        report.sections.append(("grading seed", f"grading seed {grading.SEED}: {grading.REPRODUCE}"))
        # The timed rules compare the fastest of several runs, which a busy machine slows alike;
        # the load is here so that a failure can be read against it.
        report.sections.append(("load", f"graded at {machine.load_note()}"))
    return report


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"grading seed {grading.SEED}: {grading.REPRODUCE}")
