"""The exercise tests grade what they claim to grade.

1. Wrong solutions fail. Each one below is the reference with one plausible mistake (its
   source with one line changed, or a short function in its place); the exercise's test file
   runs against it (all of it, but for exercise 5's model tests), and at least one test must
   fail with a message naming the rule. The default mode grades the reference, so patching
   the reference is patching what the tests grade.
2. Code that is not the student's own earns nothing: in starter mode, grading.not_your_own
   and grading.refuse_the_reference catch a deleted method, super(), the reference imported
   or called by name; the starter files as shipped pass the check (their TODOs are theirs).
"""

import configparser
import importlib
import inspect
import json
import re
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

import kv_pool
import prefix_caching
import scheduler

ROOT = Path(__file__).resolve().parents[1]
EXERCISE_TESTS = ROOT / "tests" / "exercises"
sys.path.insert(0, str(EXERCISE_TESTS))
import grading  # noqa: E402  (tests/exercises is not a package)

# The wrong solutions are mistakes in the reference, so they run in the default mode only.
pytestmark = pytest.mark.skipif(grading.IMPL != "reference", reason="grades the tests with the reference")


def with_mistake(function, old: str, new: str):
    """`function` compiled again from its source with `old` (once, exactly) replaced by `new`."""
    source = textwrap.dedent(inspect.getsource(function))
    assert source.count(old) == 1, f"{function.__qualname__}'s source no longer holds {old!r} once"
    namespace = {}
    exec(compile(source.replace(old, new), f"<{function.__qualname__} with a mistake>", "exec"),
         function.__globals__, namespace)
    return namespace[function.__name__]


def appendleft_from_the_tail(self, block):
    """appendleft that finds the head by walking the queue from its tail: right, but O(n)."""
    first = self._tail
    while first.prev_free is not self._head:
        first = first.prev_free
    self._insert_after(first.prev_free, block)


def hash_of_a_tuple(parent_hash, token_ids, extra_keys=(), algo="sha256"):
    """The tokens' bytes from Python's hash() of their tuple: 64 bits for the whole block."""
    parent = prefix_caching.NONE_HASH[algo] if parent_hash is None else parent_hash
    tokens = hash(tuple(token_ids)).to_bytes(8, "little", signed=True)
    return prefix_caching.hashlib.sha256(parent + tokens + prefix_caching._encode_extra(extra_keys)).digest()


def hashes_block_by_block(token_ids, block_size, cache_salt=None, extra_keys=(), algo="sha256"):
    """compute_block_hashes through prefix_caching.hash_block_tokens, one block at a time."""
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        keys = prefix_caching.block_extra_keys(i, cache_salt, extra_keys)
        parent = prefix_caching.hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], keys, algo)
        hashes.append(parent)
    return hashes


@dataclass
class Wrong:
    test_file: str
    patches: Callable[[], list[tuple[object, str, object]]]  # (owner, attribute, the wrong one)
    rule: str  # words of the failure message that names the rule
    select: str = ""  # a -k expression: only these tests (exercise 5's others run a model)


FREE = prefix_caching.PrefixCachingAllocator.free


def schedule_with(old: str, new: str):
    """The patches of a Scheduler.schedule with one mistake (see with_mistake)."""
    return lambda: [(scheduler.Scheduler, "schedule", with_mistake(scheduler.Scheduler.schedule, old, new))]


WRONG = {
    "ex1: extra keys joined with ','": Wrong("test_ex1_block_hash.py", lambda: [
        (prefix_caching, "_encode_extra", lambda keys: ",".join(map(str, keys)).encode())],
        "('a,b',) and ('a', 'b') hash alike"),
    "ex1: extra keys hashed as a sorted set": Wrong("test_ex1_block_hash.py", lambda: [
        (prefix_caching, "_encode_extra", lambda keys: json.dumps(sorted(set(map(str, keys)))).encode())],
        "('a', 'b') and ('b', 'a') hash alike"),
    "ex1: hash(tuple(ids))": Wrong("test_ex1_block_hash.py", lambda: [
        (prefix_caching, "hash_block_tokens", hash_of_a_tuple),
        (prefix_caching, "compute_block_hashes", hashes_block_by_block)],
        "hashing called Python's hash()"),
    "ex1: the salt untagged among the extra keys": Wrong("test_ex1_block_hash.py", lambda: [
        (prefix_caching, "block_extra_keys", with_mistake(
            prefix_caching.block_extra_keys, '("cache_salt", cache_salt)', "cache_salt"))],
        "cache_salt 'lora-1' and extra key 'lora-1' give block 0 the same hash"),
    "ex2: every hit counted as a free block": Wrong("test_ex2_allocate.py", lambda: [
        (prefix_caching.PrefixCachingAllocator, "_check_room", with_mistake(
            prefix_caching.PrefixCachingAllocator._check_room, "sum(1 for b in hits if b.ref_cnt == 0)", "len(hits)"))],
        "b was refused, but it fits"),
    "ex3: appendleft walks from the tail": Wrong("test_ex3_free_queue.py", lambda: [
        (prefix_caching.FreeKVCacheBlockQueue, "appendleft", appendleft_from_the_tail)],
        "appendleft read"),
    "ex4: free in descending block id order": Wrong("test_ex4_free.py", lambda: [
        (prefix_caching.PrefixCachingAllocator, "free",
         with_mistake(FREE, "reversed(table)", "sorted(table, reverse=True)"))],
        "it does not sort the block ids"),
    "ex5: the index made on the CPU": Wrong("test_ex5_gather_kv.py", lambda: [
        (kv_pool.PagedKVPool, "tokens_of", with_mistake(
            kv_pool.PagedKVPool.tokens_of, "dtype=torch.long, device=self.device", "dtype=torch.long"))],
        "build the index on the pool's device", select="device"),
    "ex6: allocate_with_prefix without the salt": Wrong("test_ex6_schedule.py", schedule_with(
        "tokens[: num_cached + num_new], request.cache_salt)", "tokens[: num_cached + num_new])"),
        "pass the request's cache_salt to allocate_with_prefix"),
    "ex6: peek without the salt": Wrong("test_ex6_schedule.py", schedule_with(
        "alloc.peek(tokens, request.cache_salt)", "alloc.peek(tokens)"),
        "without the salt, the hit is another tenant's"),
    "ex6: a resumed request charged for its prompt only": Wrong("test_ex6_schedule.py", schedule_with(
        "budget -= num_new", "budget -= min(num_new, len(request.prompt_ids) - num_cached)"),
        "a resumed request's sampled tokens too"),
    "ex6: allocate the whole prompt, then free what is over the budget": Wrong("test_ex6_schedule.py", schedule_with(
        "alloc.allocate_with_prefix(request.request_id, tokens[: num_cached + num_new], request.cache_salt)",
        "alloc.allocate_with_prefix(request.request_id, tokens, request.cache_salt)\n"
        "            if num_cached + num_new < len(tokens):\n"
        "                alloc.free(request.request_id)\n"
        "                alloc.allocate_with_prefix(request.request_id, tokens[: num_cached + num_new],"
        " request.cache_salt)"),
        "blocks whose K/V nobody has written yet are cached"),
}


@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_solution_fails_its_exercise_with_the_rule(name, pytester, monkeypatch):
    wrong = WRONG[name]
    for owner, attribute, value in wrong.patches():
        monkeypatch.setattr(owner, attribute, value)
    select = ["-k", wrong.select] if wrong.select else []
    result = pytester.runpytest_inprocess(str(EXERCISE_TESTS / wrong.test_file), "-p", "no:cacheprovider", *select)
    output = result.stdout.str()
    assert result.parseoutcomes().get("failed", 0) >= 1, f"{name}: every test of {wrong.test_file} passed:\n{output}"
    assert wrong.rule in " ".join(output.split()), f"{name}: no failure says {wrong.rule!r}:\n{output[-3000:]}"


# --- the student's own code -------------------------------------------------------------------


def starter(exercise_name: str, source: str) -> types.ModuleType:
    """A module named like a starter file (exercises.<name>) made from `source`."""
    module = types.ModuleType(f"exercises.{exercise_name}")
    module.__file__ = f"<exercises/{exercise_name}.py>"
    exec(compile(textwrap.dedent(source), module.__file__, "exec"), module.__dict__)
    return module


QUEUE_METHODS = [f"FreeKVCacheBlockQueue.{name}" for name in ("append", "appendleft", "remove", "popleft")]
TRICKS = {
    "super()": ("scheduler", ["Scheduler.schedule"], """
        import scheduler
        class Scheduler(scheduler.Scheduler):
            def schedule(self):
                return super().schedule()
        """, "calls super()"),
    "a method deleted": ("free_queue", QUEUE_METHODS, """
        import prefix_caching
        class FreeKVCacheBlockQueue(prefix_caching.FreeKVCacheBlockQueue):
            def append(self, block): ...
            def remove(self, block): ...
            def popleft(self): ...
        """, "FreeKVCacheBlockQueue.appendleft is not defined in exercises.free_queue"),
    "functions imported": ("block_hash", ["hash_block_tokens", "compute_block_hashes"], """
        from prefix_caching import compute_block_hashes, hash_block_tokens
        """, "hash_block_tokens is the function of prefix_caching"),
    "the class imported": ("scheduler", ["Scheduler.schedule"], """
        from scheduler import Scheduler
        """, "Scheduler is imported from scheduler"),
    "the reference under another name": ("block_hash", ["hash_block_tokens"], """
        from prefix_caching import hash_block_tokens as reference
        def hash_block_tokens(parent_hash, token_ids, extra_keys=()):
            return reference(parent_hash, token_ids, extra_keys)
        """, "calls reference, which is the reference's"),
    "the reference's method put in the class": ("gather_kv", ["PagedKVPool.tokens_of"], """
        import kv_pool
        class PagedKVPool(kv_pool.PagedKVPool):
            tokens_of = kv_pool.PagedKVPool.tokens_of
        """, "PagedKVPool.tokens_of is the function of kv_pool"),
}


@pytest.mark.parametrize("trick", TRICKS)
def test_code_that_is_not_the_students_own_is_named(trick):
    exercise_name, graded, source, why = TRICKS[trick]
    problems = grading.not_your_own(starter(exercise_name, source), graded)
    assert any(why in problem for problem in problems), f"{trick}: expected {why!r} among {problems}"


def test_calling_the_reference_through_its_module_fails_while_a_test_runs(monkeypatch):
    cheat = starter("scheduler", """
        import scheduler
        class Scheduler(scheduler.Scheduler):
            def schedule(self):
                return scheduler.Scheduler.schedule(self)
        """)
    assert grading.not_your_own(cheat, ["Scheduler.schedule"]) == []  # nothing to see in its own code ...
    grading.refuse_the_reference(cheat, ["Scheduler.schedule"], monkeypatch)
    s = cheat.Scheduler(prefix_caching.PrefixCachingAllocator(num_blocks=4, block_size=4))
    with pytest.raises(pytest.fail.Exception, match="the graded code must be your own: Scheduler.schedule ran"):
        s.schedule()  # ... but it runs the reference, which fails


SHIPPED = {"block_hash": "test_ex1_block_hash", "allocator": "test_ex2_allocate", "free_queue": "test_ex3_free_queue",
           "gather_kv": "test_ex5_gather_kv", "scheduler": "test_ex6_schedule"}


@pytest.mark.parametrize("exercise_name", SHIPPED)
def test_the_starter_files_as_shipped_are_the_students_own(exercise_name):
    module = importlib.import_module(f"exercises.{exercise_name}")
    graded = importlib.import_module(SHIPPED[exercise_name]).GRADED
    if exercise_name == "allocator":
        graded = graded + importlib.import_module("test_ex4_free").GRADED
    assert grading.not_your_own(module, graded) == []


def test_starter_mode_fails_every_test_of_a_file_whose_code_is_not_the_students(pytester, monkeypatch):
    module = starter("scheduler", """
        import scheduler
        class Scheduler(scheduler.Scheduler):
            def schedule(self):
                return super().schedule()
            def _preempt(self, request):
                return super()._preempt(request)
        """)
    monkeypatch.setitem(sys.modules, "exercises.scheduler", module)
    monkeypatch.setattr(grading, "IMPL", "starter")
    monkeypatch.delitem(sys.modules, "test_ex6_schedule", raising=False)
    result = pytester.runpytest_inprocess(str(EXERCISE_TESTS / "test_ex6_schedule.py"), "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) > 0 and "passed" not in outcomes, result.stdout.str()[-3000:]
    assert ("the graded code must be your own: Scheduler.schedule calls super(): the reference's method does the "
            "work; Scheduler._preempt calls super()") in result.stdout.str()



# --- the score is visible ------------------------------------------------------------------


def quiet_flags(command: str) -> int:
    """How many -q a pytest command line adds (-q, -qq, --quiet)."""
    return sum(word.count("q") if re.fullmatch(r"-q+", word) else word == "--quiet" for word in command.split())


def test_every_documented_grading_command_prints_the_count():
    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini")
    already = quiet_flags(ini["pytest"]["addopts"])  # pytest.ini's own -q
    docs = [ROOT / "README.md", ROOT / "lessons" / "README.md", *(ROOT / "exercises").glob("*"),
            *(ROOT / "notebooks").glob("*.ipynb")]
    commands = [(doc.name, line) for doc in docs
                for line in re.findall(r"pytest tests/exercises[^`\n\"]*", doc.read_text())]
    assert len(commands) >= 10, commands  # the exercises' README and starter files name a dozen
    hidden = [(name, command) for name, command in commands if already + quiet_flags(command) > 1]
    assert not hidden, f"with pytest.ini's -q these print no pass/fail count (-qq): {hidden}"
