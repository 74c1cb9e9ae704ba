"""The suite's shape, and the fixtures every folder shares.

The folders mirror the code: allocator/, engine/, gpu/ (the padded, graph-ready paths forced
on a CPU), server/ (the server and the router in front of it), analyzer/, course/ (lessons,
notebooks, commands), exercises/ (the graded tests students run), grader/ (the grader's own
tests) and project/ (the layers, the figures the prose writes). Each folder's conftest.py
holds the fixtures only it needs.

What a test costs is a marker, declared once here (COSTS); a test that uses a fixture in
FIXTURE_COSTS gets that fixture's markers without writing them. A test with no cost marker
must finish in a second (scaled by the machine's load): one that takes longer fails, naming
the marker to add. `pytest --fast` (make test-fast) runs only the tests whose markers are
not in HEAVY: the allocator, the request, the scheduler, the exercises' reference and the
analyzer's pure parts.

This file imports no torch: the allocator's tests and those of exercises 1 to 4 and 6 start in a
second. The model fixtures below import the engine inside their bodies, when a test first asks
for one.
"""

import os
from pathlib import Path

import pytest

import machine

pytest_plugins = ["pytester"]  # grader/test_grading.py runs the exercise tests against wrong solutions

COSTS = {
    "model": "builds or runs a model (the tiny random Llama, or SmolLM2): imports torch and transformers",
    "real_model": "runs SmolLM2-135M-Instruct, the offline default model, from its package (no network)",
    "server": "starts a server on a port of 127.0.0.1",
    "router": "starts SGLang's router (sglang-router) in front of servers",
    "subprocess": "starts a Python interpreter of its own: a command, a lesson, a grading session",
    "notebook": "runs a notebook on a Jupyter kernel",
    "gpu": "runs a GPU path (padded shapes, graph-ready buffers) forced on, on the CPU",
    "slow": "pure Python that takes over a second (many random examples): the fast loop keeps it",
}
HEAVY = {"model", "real_model", "server", "router", "subprocess", "notebook", "gpu"}  # not in --fast
FIXTURE_COSTS = {
    "tokenizer": {"model"}, "tiny_model": {"model"}, "tiny_model_dir": {"model"}, "make_engine": {"model"},
    "smollm": {"model", "real_model"}, "smollm_session": {"model", "real_model"},
    "engine": {"model"}, "url": {"model", "server"}, "pytester": {"subprocess"},
}
UNMARKED_LIMIT_S = 1.0  # on a quiet machine; scaled by the load (machine.py)
# make test runs the suite in two processes (pytest-xdist, a file at a time): the folders whose
# files take longest go first, so that both processes finish at about the same time.
FOLDERS_BY_COST = ["course", "grader", "server", "gpu", "engine", "analyzer", "exercises", "project", "allocator"]


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help=f"run only the tests with none of the markers {', '.join(sorted(HEAVY))} (under a minute)")


def pytest_configure(config):
    for name, description in COSTS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


def costs(item) -> set[str]:
    return {mark.name for mark in item.iter_markers() if mark.name in COSTS}


def folder_cost(item) -> int:
    folder = Path(item.path).parent.name
    return FOLDERS_BY_COST.index(folder) if folder in FOLDERS_BY_COST else len(FOLDERS_BY_COST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=folder_cost)  # stable: a file's tests keep their order
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            for name in sorted(FIXTURE_COSTS.get(fixture, set()) - costs(item)):
                item.add_marker(name)
    if config.getoption("--fast"):
        kept = [item for item in items if not costs(item) & HEAVY]
        config.hook.pytest_deselected(items=[item for item in items if costs(item) & HEAVY])
        items[:] = kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    # Graded in starter mode, a test's time is the student's code's, which the grader's own
    # limits judge (tests/exercises/grading.py): a slow solution is not a test to mark.
    grading_a_student = os.environ.get("EXERCISE_IMPL") == "starter"
    if call.when == "call" and report.passed and not costs(item) and not grading_a_student:
        limit = machine.scaled(UNMARKED_LIMIT_S)
        if call.duration > limit:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} has no cost marker and took {call.duration:.2f} s, over the {limit:.2f} s an unmarked "
                f"test may take ({UNMARKED_LIMIT_S} s scaled by {machine.load_note()}): mark it with what it costs, "
                f"one of {', '.join(COSTS)} (tests/conftest.py says what each means)")
    return report


# --- the models the engine, server, analyzer, course and GPU tests share ------------------------


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer: a real vocabulary and chat template (converted once, then cached)."""
    from transformers import AutoTokenizer

    from engine.model_loader import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    """A 2-layer Llama with random weights and grouped-query attention (4 query heads share
    2 KV heads), in float32 so cached and uncached runs agree to ~1e-6: what a stage's --tiny
    runs is what the tests check."""
    from lessons.models import tiny_llama

    return tiny_llama(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model, tokenizer, tmp_path_factory):
    """The tiny model saved like a Hugging Face checkpoint, for code that loads by path."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def make_engine(tiny_model, tokenizer):
    """Engine factory over the tiny model (block size 4 by default, so blocks fill fast);
    checks at teardown that every engine it made got all its blocks back."""
    from engine import Engine
    from helpers import assert_pool_whole, calibrated, wait_until_idle

    engines = []

    def make(**kwargs) -> Engine:
        # The default budget policy, on a held calibration unless a test asks for a target step
        # time of its own (then it learns, as an engine does): plans the same on every machine.
        engine = Engine(model=tiny_model, tokenizer=tokenizer, **{"block_size": 4, "num_blocks": 64, **kwargs})
        if "target_step_ms" not in kwargs:
            calibrated(engine)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        if engine.closed:  # its pool is given back: nothing to check
            continue
        wait_until_idle(engine)  # a cancelled request is freed by the loop moments later
        assert_pool_whole(engine)


class FakeEvent:
    """Stands in for torch.cuda.Event on a CPU: records the wall clock, so a GpuClock reads the
    wall's time and a phase's two readings can be compared."""

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        import time

        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other) -> float:
        return (other.at - self.at) * 1e3


@pytest.fixture
def gpu_clock_on(monkeypatch):
    """engine/cpu_threads.GpuClock reading (faked) CUDA events on this CPU, as it does on a GPU."""
    import torch

    from engine.cpu_threads import GpuClock

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(GpuClock, "__init__", lambda self, device: setattr(self, "on", True))
