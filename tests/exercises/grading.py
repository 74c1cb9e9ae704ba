"""How the exercise tests grade: the code under test runs in a process of its own.

    python -m pytest tests/exercises                        # the reference (CI)
    EXERCISE_IMPL=starter python -m pytest tests/exercises  # the student's files in exercises/

The tests run here, in pytest's process. The code they grade runs in a child process
(child.py), one for each test file, started with the student's files (or the reference's):
a test sends it plain requests (build an allocator, allocate this prompt, plan a step) and
gets plain answers back (ints, lists, strings, hashes as bytes, tensors), never an object
of the student's classes. In starter mode the child refuses to import the reference and
the plain ways to open its files (child.py says which); and nothing it does reaches this
process, so rewriting pytest, this file or the tests from a starter changes nothing here.

Each object a test builds through the child has a twin built from the reference here
(Remote* below): every call runs on both, and the first answer or state that differs is
kept. A test's own assertions name the rule they check; a difference they did not catch
fails the test at its end (conftest.py), naming the rule of what differed.

A call the student's code takes longer than TIME_LIMIT seconds on fails, and the child is
stopped (an endless loop costs one test, not the run); the next call starts a new one. The
limits are a quiet machine's, stretched by the machine's load (tests/machine.py).

The exercises follow the stages: 1 block hash (stage 4), 2 allocate (5), 3 free queue (6),
4 free (6), 5 gather K/V (7), 6 schedule (8). An exercise's tests use the student's code
only for that exercise and the ones before it: exercise 2 runs on a stand-in free queue
(exercises/given.py), exercise 4 on the student's; exercise 6's allocator is the reference's,
here, answering the child's calls.
"""

from __future__ import annotations

import base64
import builtins
import json
import os
import random
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

import machine

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("child.py")
# On a quiet machine; each is stretched by how busy the machine is when the call starts.
TIME_LIMIT = {"block_hash": 10, "allocator": 10, "free_queue": 10, "gather_kv": 60, "scheduler": 10}
START_LIMIT = 120  # the first call of exercise 5 imports torch and transformers
NOT_WRITTEN = "is not written yet"


# --- the inputs of a run --------------------------------------------------------------------------
# Every run grades on inputs of its own: the random sequences of the tests, and the sizes and
# token ids some fixed tests draw, all come from one seed, new each run. Answers recorded in
# one run therefore answer nothing in the next; GRADING_SEED=<the seed a failure prints> runs
# the same inputs again. A failing sequence is shrunk to the smallest that fails (hypothesis
# prints it).


def grading_seed() -> int:
    chosen = os.environ.get("GRADING_SEED")
    if chosen is None and os.environ.get("PYTEST_XDIST_TESTRUNUID"):
        # make test runs the suite in two processes (pytest-xdist): the run's id, the same in both
        return int(os.environ["PYTEST_XDIST_TESTRUNUID"][:8], 16)
    if chosen is None:
        return int.from_bytes(os.urandom(4), "big")
    try:
        return int(chosen)
    except ValueError:
        raise ValueError(f"GRADING_SEED must be a whole number (the seed a failure printed), got {chosen!r}") from None


SEED = grading_seed()
SEED_VARIABLES = ("GRADING_SEED", "PYTEST_XDIST_TESTRUNUID")
REPRODUCE = f"GRADING_SEED={SEED} gives this run's inputs again"
GRADING = settings(database=None, deadline=None, phases=[p for p in Phase if p != Phase.explain],
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def drawn(name: str) -> random.Random:
    """The random numbers of one test's inputs in this run: the same for a name and a seed,
    whatever ran before it."""
    return random.Random(f"{SEED}/{name}")


def mode() -> str:
    impl = os.environ.get("EXERCISE_IMPL", "reference")
    if impl not in ("reference", "starter"):
        raise ValueError(f"EXERCISE_IMPL must be 'reference' or 'starter', got {impl!r}")
    return impl


def exercise_dir() -> Path:
    return Path(os.environ.get("EXERCISE_DIR", ROOT / "exercises")).resolve()


# --- the child process ---------------------------------------------------------------------------


class ChildError(Exception):
    """An exception the graded code raised that has no namesake here."""


def raised(error: dict) -> Exception:
    """The exception the graded code raised, rebuilt here from its name and message."""
    from allocator import OutOfBlocksError

    text = error["message"]
    if error["type"] == "OutOfBlocksError":
        return OutOfBlocksError(text)
    kind = getattr(builtins, error["type"], None)
    trace = f"\n--- in the graded code ---\n{error['trace']}"
    if isinstance(kind, type) and issubclass(kind, Exception) and kind not in (StopIteration, KeyboardInterrupt):
        if kind is KeyError:
            return ChildError(f"KeyError: {text}{trace}")
        try:
            return kind(text + ("" if NOT_WRITTEN in text else trace))
        except TypeError:
            pass
    return ChildError(f"{error['type']}: {text}{trace}")


def decode(value):
    if isinstance(value, list):
        if all(type(v) is int or v is None for v in value):  # a queue's 100,000 ids or links: no call per id
            return value
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "$bytes" in value:
            return bytes.fromhex(value["$bytes"])
        if "$tensor" in value:
            return decode_tensor(value)
        if "$object" in value:
            return f"<a {value['$object']} object>"
        return {k: decode(v) for k, v in value.items()}
    return value


def decode_tensor(value: dict):
    import torch

    dtype = getattr(torch, value["dtype"])
    raw = bytearray(base64.b64decode(value["$tensor"]))
    if dtype == torch.bfloat16:
        return torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16).reshape(value["shape"]).clone()
    if not raw:
        return torch.empty(value["shape"], dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(value["shape"]).clone()


def encode_tensor(tensor) -> dict:
    import torch

    tensor = tensor.detach().to("cpu").contiguous()
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    return {"$tensor": base64.b64encode(raw.numpy().tobytes()).decode(), "dtype": str(tensor.dtype).split(".")[-1],
            "shape": list(tensor.shape)}


class Child:
    """One child process running the graded code of one test file."""

    def __init__(self, exercise: str, env: dict | None = None):
        self.exercise, self.env, self.process = exercise, env or {}, None
        self.limit = TIME_LIMIT[exercise]

    def start(self) -> None:
        self.stderr = tempfile.TemporaryFile()
        # The child's home, temporary folder and working directory: empty, and gone when it stops.
        self.scratch = tempfile.TemporaryDirectory(prefix="grading-child-")
        # The seed stays with the grader: from it the child could draw every input again.
        env = {key: value for key, value in os.environ.items() if key not in SEED_VARIABLES} | self.env
        env |= {name: self.scratch.name for name in ("HOME", "TMPDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
                                                     "XDG_DATA_HOME")}
        command = [sys.executable, "-I", str(CHILD), mode(), str(exercise_dir()), str(ROOT), self.scratch.name]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        env=env, cwd=self.scratch.name)
        self.buffer = b""
        self.started = False
        self.read(START_LIMIT)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None
            self.scratch.cleanup()

    def output(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-2000:]

    def read(self, quiet_limit: float) -> dict:
        limit = round(machine.scaled(quiet_limit), 1)
        deadline = time.monotonic() + limit
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        chunks = [self.buffer]  # joined once the line ends: a state of 100,000 blocks comes in many reads
        try:
            while b"\n" not in chunks[-1]:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    self.stop()
                    pytest.fail(f"the graded code ran over the time limit of {limit} s ({quiet_limit} s on a quiet machine, "
                                f"stretched for {machine.load_note()}) on one call (an endless "
                                "loop, or a walk over every block?); its process was stopped", pytrace=False)
                chunk = os.read(self.process.stdout.fileno(), 1 << 20)
                if not chunk:
                    output = self.output()
                    self.stop()
                    pytest.fail(f"the process running the graded code ended (exit, crash or kill) before it "
                                f"answered:\n{output}", pytrace=False)
                chunks.append(chunk)
        finally:
            selector.close()
        line, _, self.buffer = b"".join(chunks).partition(b"\n")
        return json.loads(line)

    def write(self, message: dict) -> None:
        self.process.stdin.write((json.dumps(message) + "\n").encode())
        self.process.stdin.flush()

    def call(self, op: str, answer=None, **args):
        """Run one request in the child; `answer(question)` answers what it asks meanwhile
        (exercise 6's allocator calls). Raises what the graded code raised."""
        if self.process is None:
            self.start()
        self.write({"op": op, **args})
        while True:
            message = self.read(self.limit)
            if "ask" in message:
                try:
                    self.write({"answer": answer(message["ask"])})
                except Exception as err:  # noqa: BLE001  (the child's code gets it back, raised)
                    self.write({"raise": {"type": type(err).__name__, "message": str(err)}})
            elif "error" in message:
                raise raised(message["error"])
            else:
                return decode(message["reply"])


# --- how the work grows with the size ---------------------------------------------------------------
# Three rules are about cost, not answers: a free-queue operation is O(1), allocate and free do
# not walk the pool, a gather runs no Python loop over its blocks. Each is checked from this
# process: the same work is timed at two sizes far apart (a queue of 100 blocks and one of
# 100,000), the child having built both in earlier calls, and the times compared. An O(1) or
# vectorized answer takes about as long at both sizes; one that walks the queue or loops over
# the blocks takes hundreds of times longer at the large one. Nothing the graded code does in
# its process changes this clock, which is why these checks stand where the counts taken in
# the child (link reads, lists kept, tensor operations) could be rewritten. A loop of numpy
# copies over the gather's blocks costs too little more a block than index_select does to show
# by itself, so in those gathers the child makes each line of the graded file cost 10 µs
# (child.py's costly_lines, which the graded code could undo: a help, not a lock).

SCALING_LIMIT = 10  # the large size's time over the small one's: about 1 to 3 when the cost is flat


REPEATS = 5  # timed runs of each size


def fastest_times(small, big, repeats: int = REPEATS) -> tuple[float, float]:
    """The fastest of `repeats` runs of small(r) and of big(r), taken in turn; each returns the
    seconds its timed call took (timed_call). Other programs on the machine can only slow a call
    down, so the fastest is the nearest to the code's own cost."""
    times: tuple[list, list] = ([], [])
    for r in range(repeats):
        times[0].append(small(r))
        times[1].append(big(r))
    return min(times[0]), min(times[1])


def timed_call(child: Child, op: str, **args) -> tuple:
    """(the answer, the seconds the call took), timed here: the request sent, run, answered."""
    start = time.perf_counter()
    answer = child.call(op, **args)
    return answer, time.perf_counter() - start


def times(ratio: float) -> str:
    return f"{ratio:.1f} times" if ratio < 10 else f"{ratio:,.0f} times"


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds * 1e3:,.0f} ms"


# --- differences with the reference ----------------------------------------------------------------

DIFFERENCES: list[str] = []  # the first difference of each object in the running test (conftest.py)


def recorded(history: list[str], what: str, yours, reference, rule: str) -> str:
    calls = "\n".join(f"  {i + 1}. {call}" for i, call in enumerate(history))
    return (f"{rule}\nafter these calls:\n{calls}\n{what}: yours {yours}, the reference's {reference}")


class Twin:
    """What every remote object shares: its history and its first difference."""

    def __init__(self):
        self.history: list[str] = []
        self.difference: str | None = None
        self.compared = True

    def differ(self, what: str, yours, reference, rule: str) -> None:
        if self.compared and self.difference is None:
            self.difference = recorded(self.history, what, yours, reference, rule)
            DIFFERENCES.append(self.difference)

    def check(self) -> None:
        """Raise the first difference with the reference (for hypothesis, which shrinks it)."""
        if self.difference:
            raise AssertionError(self.difference)


def outcome(function, *args):
    """(result, None) or (None, the exception's type name)."""
    try:
        return function(*args), None
    except Exception as err:  # noqa: BLE001
        return None, type(err).__name__
