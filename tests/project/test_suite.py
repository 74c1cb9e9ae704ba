"""The suite's own rules (tests/conftest.py): the root conftest imports no torch, a test that
uses a model, a server or a child gets its cost marker from its fixtures, an unmarked test that
takes over its second fails naming the markers, and --fast leaves out every heavy test."""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# The root conftest as a module of its own name: every folder has a conftest.py.
_spec = importlib.util.spec_from_file_location("root_conftest", TESTS / "conftest.py")
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


@pytest.mark.subprocess
def test_the_root_conftest_and_the_allocators_and_the_exercises_tests_load_without_torch():
    # Exercise 5 grades a gather of tensors: its tests import torch; the others do not.
    code = textwrap.dedent("""
        import sys
        import pytest
        collected = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/allocator", "tests/exercises",
                                 "--ignore", "tests/exercises/test_ex5_gather_kv.py"])
        print(int(collected), sorted(name for name in ("torch", "transformers", "flask", "openai") if name in sys.modules))
        """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "0 []", result.stdout[-3000:]  # collected, and none of them loaded


def test_every_heavy_marker_is_a_declared_cost():
    assert conftest.HEAVY <= conftest.COSTS.keys()
    assert set().union(*conftest.FIXTURE_COSTS.values()) <= conftest.HEAVY
    assert "--strict-markers" in (ROOT / "pytest.ini").read_text()  # a marker not in COSTS is an error


def test_every_folder_of_tests_is_ordered_by_its_cost():
    folders = {path.parent.name for path in TESTS.glob("*/test_*.py")}
    assert folders == set(conftest.FOLDERS_BY_COST)


def suite(pytester, limit: float) -> None:
    """A suite in pytester's folder with this project's root conftest, its unmarked limit set to `limit`."""
    source = (TESTS / "conftest.py").read_text()
    assert "UNMARKED_LIMIT_S = 1.0" in source
    pytester.makeconftest(source.replace("UNMARKED_LIMIT_S = 1.0", f"UNMARKED_LIMIT_S = {limit}"))
    pytester.makepyfile(machine=(TESTS / "machine.py").read_text())
    pytester.makepyfile(test_costs="""
        import time
        import pytest

        def test_quick():
            pass

        def test_slow_and_unmarked():
            time.sleep(0.5)

        @pytest.mark.slow
        def test_slow_and_marked():
            time.sleep(0.5)

        @pytest.fixture
        def tokenizer():  # stands in for the real one: its name gives the marker
            return None

        def test_with_a_model(tokenizer):
            time.sleep(0.5)
        """)


@pytest.mark.subprocess
def test_an_unmarked_test_over_its_limit_fails_naming_the_markers_and_the_load(pytester, monkeypatch):
    monkeypatch.delenv("EXERCISE_IMPL", raising=False)
    suite(pytester, 0.01)  # 0.01 s on a quiet machine: half a second is over it at any load under 50 a core
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=3, failed=1)
    output = " ".join(result.stdout.str().split())
    assert "test_slow_and_unmarked has no cost marker and took" in output
    assert "mark it with what it costs, one of model, real_model, server" in output
    assert "scaled by load" in output and "cores" in output


@pytest.mark.subprocess
def test_fast_leaves_out_what_a_fixture_marks_heavy(pytester):
    suite(pytester, 10.0)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--fast", "-v")
    result.assert_outcomes(passed=3, deselected=1)
    assert "test_with_a_model" not in result.stdout.str().replace("deselected", "")


@pytest.mark.subprocess
def test_a_students_slow_code_is_judged_by_the_grader_not_by_the_unmarked_limit(pytester, monkeypatch):
    suite(pytester, 0.01)
    monkeypatch.setenv("EXERCISE_IMPL", "starter")  # the graded tests time the student's code
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=4)
