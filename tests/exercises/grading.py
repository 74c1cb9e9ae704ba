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
    from prefix_caching import OutOfBlocksError

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
        try:
            while b"\n" not in self.buffer:
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
                self.buffer += chunk
        finally:
            selector.close()
        line, _, self.buffer = self.buffer.partition(b"\n")
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


# --- exercise 1 -------------------------------------------------------------------------------------


class RemoteBlockHash:
    """exercise 1's two functions, run in the child."""

    def __init__(self, child: Child):
        self.child = child

    def hash_block_tokens(self, parent_hash, token_ids, extra_keys=(), numpy=None):
        return self.child.call("hash_block_tokens", parent=None if parent_hash is None else parent_hash.hex(),
                               tokens=list(token_ids), keys=list(extra_keys), numpy=numpy)

    def compute_block_hashes(self, token_ids, block_size, cache_salt=None, extra_keys=(), numpy=None):
        return self.child.call("compute_block_hashes", tokens=list(token_ids), block_size=block_size, salt=cache_salt,
                               keys=list(extra_keys), numpy=numpy)

    def calls_python_hash(self, token_ids, extra_keys, cache_salt) -> list[str]:
        return self.child.call("calls_python_hash", tokens=list(token_ids), keys=list(extra_keys), salt=cache_salt)


# --- exercises 2 and 4 ------------------------------------------------------------------------------

ALLOCATOR_RULES = {
    "the answer": "allocate_with_prefix answers (num_cached_tokens, num_new_tokens), or raises OutOfBlocksError "
                  "when the free queue cannot supply the new blocks and the hits that sit in it",
    "the block tables": "a block table is the hits (cached full blocks from block 0, up to the first miss, at "
                        "most (len - 1) // block_size of them), then new blocks from the head of the free queue",
    "the free queue": "the free queue, head to tail: a hit that was free leaves it, new blocks come from its head, "
                      "freed blocks join its tail last block first",
    "the ref counts": "a block's ref_cnt is the number of block tables holding it: a hit adds one, free takes one",
    "the cached blocks": "a full block is cached (it has a hash, and the cache map holds it) from the moment it is "
                         "filled, and keeps its hash when freed, until a take evicts it",
    "the blocks sharing a hash": "blocks share a hash exactly when they hold the same tokens after the same prefix",
    "the token_ids of the blocks in use or cached": "a block's token_ids are what its slots hold: a block taken from "
                                                    "the free queue holds its new owner's tokens only",
}


def allocator_state(state: dict) -> dict:
    """The observables of an allocator's state, free of the hash encoding (exercise 1's choice)."""
    groups: dict = {}
    for block_id, block_hash in enumerate(state["hash"]):
        if block_hash is not None:
            groups.setdefault(block_hash, []).append(block_id)
    live = [i for i, (refs, block_hash) in enumerate(zip(state["ref_cnt"], state["hash"]))
            if refs > 0 or block_hash is not None]
    return {
        "the block tables": state["tables"],
        "the free queue": state["free"],
        "the ref counts": state["ref_cnt"],
        "the cached blocks": [[i for i, h in enumerate(state["hash"]) if h is not None],
                              sorted(b for ids in state["cached"].values() for b in ids)],
        "the blocks sharing a hash": sorted(ids for ids in groups.values() if len(ids) > 1),
        "the token_ids of the blocks in use or cached": {i: state["tokens"][i] for i in live},
    }


def reference_allocator_state(alloc) -> dict:
    return {
        "tables": {r: list(t) for r, t in alloc.block_tables.items()},
        "free": alloc.free_queue.block_ids(),
        "ref_cnt": [b.ref_cnt for b in alloc.blocks],
        "hash": [None if b.block_hash is None else b.block_hash.hex() for b in alloc.blocks],
        "tokens": [list(b.token_ids) for b in alloc.blocks],
        "cached": {h.hex(): sorted(v) for h, v in alloc.cached_blocks.items()},
    }


class BlockView:
    """A block of the child's allocator as its last state showed it."""

    def __init__(self, owner, block_id: int):
        self.owner, self.block_id = owner, block_id

    @property
    def ref_cnt(self) -> int:
        return self.owner.state["ref_cnt"][self.block_id]

    @property
    def block_hash(self) -> bytes | None:
        value = self.owner.state["hash"][self.block_id]
        return None if value is None else bytes.fromhex(value) if _is_hex(value) else value

    @property
    def token_ids(self) -> list[int]:
        return self.owner.state["tokens"][self.block_id]

    @token_ids.setter
    def token_ids(self, tokens: list[int]) -> None:
        self.owner.set_tokens(self.block_id, tokens)


def _is_hex(value: str) -> bool:
    try:
        bytes.fromhex(value)
        return True
    except ValueError:
        return False


class QueueView:
    def __init__(self, owner):
        self.owner = owner

    def block_ids(self) -> list[int]:
        return list(self.owner.state["free"])

    def __len__(self) -> int:
        return len(self.owner.state["free"])


class RemoteAllocator(Twin):
    """The student's PrefixCachingAllocator, in the child, and its twin from prefix_caching here."""

    def __init__(self, child: Child, num_blocks: int, block_size: int, queue: str = "given"):
        super().__init__()
        import prefix_caching

        self.child, self.block_size = child, block_size
        self.handle = child.call("allocator_new", num_blocks=num_blocks, block_size=block_size, queue=queue)
        self.reference = prefix_caching.PrefixCachingAllocator(num_blocks, block_size)
        self.state = reference_allocator_state(self.reference)
        self.blocks = [BlockView(self, i) for i in range(num_blocks)]
        self.free_queue = QueueView(self)

    @property
    def block_tables(self) -> dict:
        return self.state["tables"]

    @property
    def cached_blocks(self) -> dict:
        return {bytes.fromhex(h) if _is_hex(h) else h: ids for h, ids in self.state["cached"].items()}

    def allocate_with_prefix(self, request_id: str, token_ids, cache_salt: str | None = None):
        from prefix_caching import Allocation

        result = self.run("allocate_with_prefix", [request_id, list(token_ids), cache_salt],
                          lambda: tuple(self.reference.allocate_with_prefix(request_id, list(token_ids), cache_salt)))
        return Allocation(*result)

    def free(self, request_id: str) -> None:
        self.run("free", [request_id], lambda: self.reference.free(request_id))

    def release(self, request_id: str) -> None:
        """Exercise 4's rule, written into exercise 2's tests (child.release)."""
        self.run("release", [request_id], lambda: release(self.reference, request_id))

    def set_tokens(self, block_id: int, tokens: list[int]) -> None:
        self.compared = False  # a forged block: the reference stops caching after a collision, the exercise need not
        self.run("set_tokens", [block_id, tokens], lambda: None)

    def evict(self, block_id: int) -> None:
        """As if a take had reused the block: its hash leaves the cache map, the blocks after it stay."""
        self.compared = False  # a state no sequence of calls reaches: the reference is not asked
        self.run("evict", [block_id], lambda: None)

    def run(self, method: str, args: list, on_reference):
        self.history.append(f"{method}({', '.join(map(repr, args))})")
        (answer,) = self.child.call("allocator_run", handle=self.handle, calls=[[method, args]])
        self.compare(method, answer, *outcome(on_reference))
        if "error" not in answer or answer["error"]["type"] == "OutOfBlocksError":
            self.refresh()
        else:
            self.state = self.child.call("allocator_state", handle=self.handle)
        if "error" in answer:
            raise raised(answer["error"])
        return tuple(answer["result"]) if isinstance(answer["result"], list) else answer["result"]

    def steps(self, calls: list) -> tuple[list, float]:
        """(method, args) calls of allocate_with_prefix and free, sent to the child in one call
        the way every other is, each answer compared with the reference's; (the answers, the
        seconds the call took, timed here). The allocator is compared after (refresh), outside
        the caller's clock."""
        self.history.append(f"{len(calls)} calls: " + ", ".join(f"{m}({', '.join(map(repr, a))})" for m, a in calls[:2])
                            + ", ...")
        answers, seconds = timed_call(self.child, "allocator_run", handle=self.handle, calls=calls)
        for (method, args), answer in zip(calls, answers):
            self.compare(method, answer, *outcome(getattr(self.reference, method), *args))
        return [a.get("result") for a in answers], seconds

    def compare(self, method: str, answer: dict, expected, expected_error) -> None:
        got = None if "error" in answer else answer["result"]
        got = tuple(got) if isinstance(got, list) else got
        error = answer["error"]["type"] if "error" in answer else None
        if method == "allocate_with_prefix" and (got, error) != (
                None if expected is None else tuple(expected), expected_error):
            self.differ("the answer", error or got, expected_error or expected, ALLOCATOR_RULES["the answer"])

    def refresh(self) -> None:
        """Fetch the child's allocator and compare it with the reference's."""
        self.state = self.child.call("allocator_state", handle=self.handle)
        yours, theirs = allocator_state(self.state), allocator_state(reference_allocator_state(self.reference))
        for what in yours:
            if yours[what] != theirs[what]:
                self.differ(what, yours[what], theirs[what], ALLOCATOR_RULES[what])
                break


def release(alloc, request_id: str) -> None:
    for block_id in reversed(alloc.block_tables.pop(request_id)):
        block = alloc.blocks[block_id]
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            alloc.free_queue.append(block)
    alloc.requests.pop(request_id, None)


# --- exercise 3 -------------------------------------------------------------------------------------

QUEUE_RULE = ("the free queue keeps its blocks in order: popleft takes the head, append links in at the tail, "
              "appendleft at the head, remove takes a block out of anywhere; popleft on an empty queue raises "
              "IndexError, remove of a block not in it ValueError")


class QueueBlock:
    """A block of the child's queue as its last state showed it: its links are other QueueBlocks."""

    def __init__(self, owner, block_id: int):
        self.owner, self.block_id = owner, block_id

    def _link(self, side: int):
        other = self.owner.state["links"][self.block_id][side]
        return None if other is None else self.owner.sentinel if other < 0 else self.owner.blocks[other]

    @property
    def prev_free(self):
        return self._link(0)

    @property
    def next_free(self):
        return self._link(1)


class RemoteQueue(Twin):
    """The student's FreeKVCacheBlockQueue over blocks 0 to n-1 (handed to its constructor in
    `order`), in the child, and its twin here.

    Every call, one operation or a timed run of fifty, goes to the child the same way
    (op_queue_run) and every answer is compared with the reference's; the queue itself is
    fetched after the call (op_queue_state), outside any clock."""

    def __init__(self, child: Child, n: int, order: list[int] | None = None):
        super().__init__()
        import prefix_caching

        self.child = child
        self.handle = child.call("queue_new", n=n, order=order)
        self.reference_blocks = [prefix_caching.KVCacheBlock(i) for i in range(n)]
        self.reference = prefix_caching.FreeKVCacheBlockQueue(
            self.reference_blocks if order is None else [self.reference_blocks[i] for i in order])
        self.blocks = [QueueBlock(self, i) for i in range(n)]
        self.sentinel = QueueBlock(self, -1)
        self._state: dict | None = None  # fetched when first read (a timed test's queue, after its clock)

    @property
    def state(self) -> dict:
        if self._state is None:
            self.refresh()
        return self._state

    def block_ids(self) -> list[int]:
        return list(self.state["ids"])

    def __len__(self) -> int:
        return self.state["len"]

    def refresh(self) -> None:
        """Fetch the child's queue and compare it with the reference's."""
        self._state = state = self.child.call("queue_state", handle=self.handle)
        if (state["ids"], state["len"]) != (self.reference.block_ids(), len(self.reference)):
            self.differ("the queue (ids, len)", (state["ids"], state["len"]),
                        (self.reference.block_ids(), len(self.reference)), QUEUE_RULE)

    def steps(self, method: str, block_ids: list) -> tuple[list, float]:
        """`method` on each block id in turn (None for popleft), in the child, compared answer
        by answer with the reference's; (the child's answers, the seconds the call took, timed
        here). The queue is not fetched: a caller that times does so after its clock."""
        calls = [f"{method}({'' if b is None else f'block {b}'})" for b in block_ids]
        self.history.append(calls[0] if len(calls) == 1 else f"{len(calls)} calls: {', '.join(calls[:3])}, ...")
        answers, seconds = timed_call(self.child, "queue_run", handle=self.handle,
                                      steps=[[method, b] for b in block_ids])
        for i, block_id in enumerate(block_ids):
            args = [] if block_id is None else [self.reference_blocks[block_id]]
            expected, expected_error = outcome(getattr(self.reference, method), *args)
            expected = expected.block_id if expected is not None else None
            got = answers[i] if i < len(answers) else None
            error = got["error"]["type"] if isinstance(got, dict) else None
            if (None if error else got, error) != (expected, expected_error):
                self.differ(f"{method}({'' if block_id is None else f'block {block_id}'})'s answer",
                            error or got, expected_error or expected, QUEUE_RULE)
            if error or expected_error:
                break
        return answers, seconds

    def run(self, method: str, block: QueueBlock | None = None):
        (answer,), _ = self.steps(method, [None if block is None else block.block_id])
        self.refresh()
        if isinstance(answer, dict):
            raise raised(answer["error"])
        return None if answer is None else self.blocks[answer]

    def popleft(self):
        return self.run("popleft")

    def append(self, block):
        self.run("append", block)

    def appendleft(self, block):
        self.run("appendleft", block)

    def remove(self, block):
        self.run("remove", block)


# --- exercise 5 -------------------------------------------------------------------------------------

GATHER_RULE = ("gather gives a DynamicCache of one (keys, values) pair per layer, each (1, num_kv_heads, tokens, "
               "head_dim) in the pool's dtype and on its device, token p from block block_ids[p // block_size] "
               "at slot p % block_size")


LINE_COST = 10e-6  # seconds each line of the graded file costs in every gather (child.py's costly_lines)


def gathered(child: Child, handle: int, block_ids: list[int], drop: bool = False) -> dict:
    """The student's gather of `block_ids` from the child's pool `handle`: the call every gather
    of the tests makes (pool_gather), then what it returned, fetched (last_gathered)."""
    child.call("pool_gather", handle=handle, block_ids=list(block_ids), line_cost=LINE_COST)
    answer = child.call("last_gathered", handle=handle)
    if drop:
        child.call("drop", handle=handle)
    return answer


def remote_pool_class():
    """kv_pool.PagedKVPool whose gather runs the student's, in the child, on this pool's data."""
    import kv_pool
    import torch
    from transformers import DynamicCache

    class RemotePool(kv_pool.PagedKVPool):
        def __init__(self, child: Child, **shape):
            super().__init__(**shape)
            self.child, self.twin = child, Twin()

        def spec(self) -> dict:
            return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                    "num_blocks": self.num_blocks, "block_size": self.block_size,
                    "dtype": str(self.dtype).split(".")[-1]}

        def gather(self, block_ids: list[int], config):
            self.twin.history.append(f"gather({list(block_ids)}) on a {self.spec()} pool")
            try:
                answer = gathered(self.child, self.child.call("pool_new", spec=self.spec(),
                                                              data=encode_tensor(self.data)), block_ids, drop=True)
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001  (an index past a size is often a size mixed up)
                raise AssertionError(f"gather({list(block_ids)}) on a {self.spec()} pool raised {err}\n"
                                     f"What it must give: {GATHER_RULE}") from None
            expected = kv_pool.PagedKVPool.gather(self, block_ids, config)
            length = expected.get_seq_length()
            if answer["type"] != "DynamicCache":
                self.twin.differ("the type", answer["type"], "DynamicCache", GATHER_RULE)
            elif answer["length"] != length:
                self.twin.differ("the tokens cached", answer["length"], length, GATHER_RULE)
            layers = [(k, v) for k, v in answer["layers"] if k is not None and v is not None]
            if answer["type"] == "DynamicCache" and len(layers) != len(answer["layers"]):
                self.twin.differ("the layers holding keys and values", len(layers), len(expected.layers), GATHER_RULE)
            for i, (keys, values) in enumerate(layers[: len(expected.layers)]):
                for name, got, want in (("keys", keys, expected.layers[i].keys),
                                        ("values", values, expected.layers[i].values)):
                    if got.dtype != want.dtype or got.shape != want.shape:
                        self.twin.differ(f"layer {i} {name}' dtype and shape", (got.dtype, tuple(got.shape)),
                                         (want.dtype, tuple(want.shape)), GATHER_RULE)
                    elif not torch.equal(got, want):
                        self.twin.differ(f"layer {i} {name}", "other numbers", "these", GATHER_RULE)
            if not layers:
                return DynamicCache(config=config)
            return DynamicCache([(k.to(self.device), v.to(self.device)) for k, v in layers])

    return RemotePool


# --- exercise 6 -------------------------------------------------------------------------------------

SCHEDULER_RULES = {
    "the plan": "a step: running requests first, in admission order (a decode takes 1 token, a prompt still "
                "prefilling its share: what the decodes leave, shared smallest need first with the other prompts "
                "prefilling and the waiting requests that could be admitted); then waiting requests in arrival "
                "order, each computing its uncached tokens up to the budget left, while max_num_seqs and the pool "
                "allow; the first that does not fit stops admission, but one whose next block a prompt prefilling "
                "had yet to compute when the step began waits for that hit without stopping it; nobody is "
                "admitted in a step that preempts",
    "who was preempted": "when a running request needs a block and none is free, the last of self.running (the most "
                         "recently admitted) is preempted, and the request that needed the block tries again",
    "the running requests": "admitted requests join the end of self.running; preempted ones leave it",
    "the waiting requests": "admission takes the front of the waiting queue; a preempted request goes back to its "
                            "front",
    "the requests' counters": "an admitted request is RUNNING with num_computed_tokens = its hit; num_cached_tokens "
                              "and admitted are set at its first admission only; a preempted one is WAITING with "
                              "num_computed_tokens 0 and one more preemption",
    "the allocator": "a step gives slots only to the tokens it computes (allocate_with_prefix on the tokens of this "
                     "step, append_tokens for a running request's), with the request's cache_salt; a preempted "
                     "request's blocks are freed",
}


class RequestView:
    """A request of the child's scheduler, as its latest state shows it."""

    def __init__(self, owner, request_id: str):
        self.owner, self.request_id = owner, request_id

    def view(self) -> dict:
        return next(v for v in self.owner.state["running"] + self.owner.state["waiting"] if v["id"] == self.request_id)

    status = property(lambda self: self.view()["status"])
    num_computed_tokens = property(lambda self: self.view()["computed"])
    num_cached_tokens = property(lambda self: self.view()["cached"])
    num_preemptions = property(lambda self: self.view()["preemptions"])
    admitted = property(lambda self: self.view()["admitted"])
    output_ids = property(lambda self: self.view()["outputs"])


def request_view(r) -> dict:
    return {"id": r.request_id, "status": r.status, "computed": r.num_computed_tokens, "cached": r.num_cached_tokens,
            "preemptions": r.num_preemptions, "admitted": r.admitted, "outputs": list(r.output_ids)}


def scheduler_observables(plan, preempted, state, alloc) -> dict:
    def counters(views):
        return [{k: v[k] for k in ("id", "status", "computed", "cached", "preemptions", "admitted")} for v in views]

    return {
        "the plan": [tuple(p) for p in plan],
        "who was preempted": preempted,
        "the running requests": [v["id"] for v in state["running"]],
        "the waiting requests": [v["id"] for v in state["waiting"]],
        "the requests' counters": counters(state["running"]) + counters(state["waiting"]),
        "the allocator": {k: v for k, v in reference_allocator_state(alloc).items() if k != "cached"},
    }


class RemoteScheduler(Twin):
    """The student's Scheduler, in the child, over an allocator here; and the reference's twin."""

    ALLOCATOR_METHODS = {"peek", "hash_blocks", "allocate_with_prefix", "append_tokens", "append_token", "free",
                         "num_tokens", "ref_count", "slot"}
    ALLOCATOR_VALUES = {"num_free_blocks", "num_blocks", "block_size", "block_tables", "num_blocks_in_use",
                        "num_cached_blocks"}

    def __init__(self, child: Child, num_blocks: int, block_size: int = 4, **options):
        super().__init__()
        import prefix_caching
        import scheduler

        self.child, self.options = child, options
        self.allocator = prefix_caching.PrefixCachingAllocator(num_blocks=num_blocks, block_size=block_size)
        self.reference = scheduler.Scheduler(prefix_caching.PrefixCachingAllocator(num_blocks, block_size), **options)
        self.max_num_seqs = self.reference.max_num_seqs
        self.max_num_batched_tokens = self.reference.max_num_batched_tokens
        self.handle = f"scheduler {id(self)}"
        child.call("scheduler_new", handle=self.handle, options=options)
        self.state = {"running": [], "waiting": [], "num_preemptions": 0}

    @property
    def running(self) -> list[RequestView]:
        return [RequestView(self, v["id"]) for v in self.state["running"]]

    @property
    def waiting(self) -> list[RequestView]:
        return [RequestView(self, v["id"]) for v in self.state["waiting"]]

    @property
    def num_preemptions(self) -> int:
        return self.state["num_preemptions"]

    def answer(self, question: dict):
        """An allocator call of the child's scheduler, run on self.allocator."""
        if question.get("value") in self.ALLOCATOR_VALUES:
            return getattr(self.allocator, question["value"])
        if question.get("method") not in self.ALLOCATOR_METHODS:
            raise AttributeError(f"the allocator has no {question.get('method') or question.get('value')!r}")
        args, kwargs = decode(question["args"]), decode(question["kwargs"])  # block hashes came as {"$bytes": hex}
        result = getattr(self.allocator, question["method"])(*args, **kwargs)
        if question["method"] == "hash_blocks":
            return [{"$bytes": h.hex()} for h in result]
        return list(result) if isinstance(result, tuple) else result

    def add(self, request) -> None:
        import scheduler

        fields = {"request_id": request.request_id, "prompt_ids": list(request.prompt_ids),
                  "cache_salt": request.cache_salt, "output_ids": list(request.output_ids),
                  "num_preemptions": request.num_preemptions, "admitted": request.admitted}
        self.history.append(f"add(Request({', '.join(f'{k}={v!r}' for k, v in fields.items() if v)}))")
        self.state = self.child.call("scheduler_add", answer=self.answer, handle=self.handle, request=fields)
        self.reference.add(scheduler.Request(**{**fields, "prompt_ids": list(fields["prompt_ids"]),
                                                "output_ids": list(fields["output_ids"])}))

    def step(self, budget: int | None = None, token: int = 7) -> tuple[list, list]:
        """schedule(budget), then play the model: every scheduled request has its tokens
        computed, and one whose chunk reached the end of its tokens samples `token`."""
        self.history.append("schedule()" if budget is None else f"schedule(budget={budget})")
        answer = self.child.call("scheduler_step", answer=self.answer, handle=self.handle, budget=budget, token=token)
        self.state = answer["state"]
        ref = self.reference
        plan = ref.schedule() if budget is None else ref.schedule(budget)
        expected_plan = [[r.request.request_id, r.start, r.end, r.samples] for r in plan.scheduled]
        for r in plan.scheduled:
            r.request.num_computed_tokens = r.end
            if r.samples:
                r.request.append_output(token)
        expected_state = {"running": [request_view(r) for r in ref.running],
                          "waiting": [request_view(r) for r in ref.waiting]}
        self.compare(answer["plan"], answer["preempted"], self.state,
                     expected_plan, [r.request_id for r in plan.preempted], expected_state)
        self.history[-1] += f" -> {[tuple(p[:3]) for p in answer['plan']]}"
        return answer["plan"], answer["preempted"]

    def finish(self, request) -> None:
        request_id = request if isinstance(request, str) else request.request_id
        self.history.append(f"finish({request_id!r})")
        self.state = self.child.call("scheduler_finish", answer=self.answer, handle=self.handle, request_id=request_id)
        ref = self.reference
        ref.finish(next(r for r in [*ref.running, *ref.waiting] if r.request_id == request_id))

    def compare(self, plan, preempted, state, expected_plan, expected_preempted, expected_state) -> None:
        yours = scheduler_observables(plan, preempted, state, self.allocator)
        theirs = scheduler_observables(expected_plan, expected_preempted, expected_state, self.reference.allocator)
        for what in yours:
            if yours[what] != theirs[what]:
                self.differ(what, yours[what], theirs[what], SCHEDULER_RULES[what])
                return
