"""The exercise tests grade what they claim to grade, through the machinery a student meets:
each case below is a folder of student files, graded by running a test file of
tests/exercises with EXERCISE_IMPL=starter and EXERCISE_DIR pointing at it.

1. Four correct solutions in different styles (tests/grader/solutions/) pass every test.
2. Wrong solutions fail: each is a correct solution with one mistake a student made, and a
   test must fail with a message naming the rule it breaks.
3. Cheats earn nothing: a file that rewrites pytest, the grading code or the tests, or
   reaches for the reference (imported under any name, captured by a default argument, a
   decorator, a metaclass or gc, its source read and run, run in another process) passes no
   test, because the graded code runs in a child process where none of that works.
"""

import configparser
import os
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
# pytester puts sys.modules back as it found them when a test began, and torch's C extension
# cannot register its operators a second time in one process: what exercise 5's graded tests
# import is imported here, before any test, so it stays. So is hypothesis, which every graded
# test file imports: pytest rewrites its 77 modules' asserts on each import (it is a plugin), and
# hypothesis's plugin leaves it unimported until a test needs it, so each nested run paid that again.
import hypothesis.strategies  # noqa: F401
import torch  # noqa: F401
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: F401

from engine import kv_pool  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
EXERCISE_TESTS = ROOT / "tests" / "exercises"
SOLUTIONS = ROOT / "tests" / "grader" / "solutions"
TEST_FILES = {"block_hash": ["test_ex1_block_hash.py"], "allocator": ["test_ex2_allocate.py", "test_ex4_free.py"],
              "free_queue": ["test_ex3_free_queue.py"], "gather_kv": ["test_ex5_gather_kv.py"],
              "scheduler": ["test_ex6_schedule.py"]}


def grade(pytester, monkeypatch, tmp_path, test_file: str, files: dict[str, str], base: str = "plain",
          select: str = ""):
    """Run `test_file` on a folder of student files: `base`'s solution with `files` in place
    of its own. Returns (the outcome counts, the output with white space folded)."""
    folder = tmp_path / "exercises"
    shutil.copytree(SOLUTIONS / base, folder, dirs_exist_ok=True)
    for name, source in files.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.setenv("EXERCISE_IMPL", "starter")
    monkeypatch.setenv("EXERCISE_DIR", str(folder))
    # The graded tests and grading.py import afresh, so the run draws its own seed (or
    # GRADING_SEED's) even where this session imported them already (the whole suite).
    for name, module in list(sys.modules.items()):
        if EXERCISE_TESTS in Path(getattr(module, "__file__", None) or "/").parents:
            monkeypatch.delitem(sys.modules, name)
    result = pytester.runpytest_inprocess(str(EXERCISE_TESTS / test_file), "-p", "no:cacheprovider", "--tb=short",
                                          *(["-k", select] if select else []))
    return result.parseoutcomes(), " ".join(result.stdout.str().split())


def with_mistake(name: str, old: str, new: str) -> dict[str, str]:
    """The plain solution's `name`.py with `old` (once, exactly) replaced by `new`."""
    source = (SOLUTIONS / "plain" / f"{name}.py").read_text()
    assert source.count(old) == 1, f"{name}.py no longer holds {old!r} once"
    return {name: source.replace(old, new)}


# --- correct solutions pass ------------------------------------------------------------------

STYLES = sorted(path.name for path in SOLUTIONS.iterdir() if path.is_dir())


def test_there_are_four_solutions_in_different_styles():
    assert STYLES == ["compact", "functional", "in_starters", "plain"]


@pytest.mark.parametrize("style", STYLES)
def test_a_correct_solution_passes_every_test(style, pytester, monkeypatch, tmp_path):
    for name, test_files in TEST_FILES.items():
        for test_file in test_files:
            # the model-running tests of exercise 5 once; its tensor tests for every style
            select = "not finish_line and not engine" if name == "gather_kv" and style != "plain" else ""
            outcomes, output = grade(pytester, monkeypatch, tmp_path / test_file, test_file, {}, style, select)
            assert "failed" not in outcomes and "error" not in outcomes and outcomes.get("passed"), (
                f"{style}: {test_file}: {outcomes}\n{output[-3000:]}")


# --- mistakes fail, naming the rule ----------------------------------------------------------------

MISTAKES = {
    "a hit on an in-use block sets ref_cnt to 2": ("test_ex2_allocate.py", with_mistake(
        "allocator", "            block.ref_cnt += 1", "            block.ref_cnt = 1 if block.ref_cnt == 0 else 2"),
        "a hit adds one to ref_cnt"),
    "a partial block keeps its previous owner's tokens": ("test_ex2_allocate.py", with_mistake(
        "allocator", "            block.token_ids = list(token_ids[i * size : (i + 1) * size])",
        "            if i < len(hashes) or not block.token_ids:\n"
        "                block.token_ids = list(token_ids[i * size : (i + 1) * size])"),
        "holds only its new owner's tokens"),
    "numpy ints hash differently": ("test_ex1_block_hash.py", with_mistake(
        "block_hash", 'b"".join(int(t).to_bytes(8, "little") for t in token_ids)', "repr(list(token_ids)).encode()"),
        "hash differently from the same ids as Python ints"),
    "keys joined with '|'": ("test_ex1_block_hash.py", with_mistake(
        "block_hash", "json.dumps(list(extra_keys)).encode()", '"|".join(map(str, extra_keys)).encode()'),
        "hash alike: a separator that can occur inside a key separates nothing"),
    "an MD5 digest": ("test_ex1_block_hash.py", with_mistake(
        "block_hash", "return hashlib.sha256(", "return hashlib.md5("),
        "a block hash is the SHA-256 digest of your encoding, 32 bytes"),
    "the encoding itself, no digest": ("test_ex1_block_hash.py", with_mistake(
        "block_hash", 'return hashlib.sha256(parent + len(tokens).to_bytes(4, "little") + tokens + keys).digest()',
        'return parent + len(tokens).to_bytes(4, "little") + tokens + keys'),
        "a block hash is the SHA-256 digest of your encoding, 32 bytes"),
    "Python's hash of a tuple": ("test_ex1_block_hash.py", with_mistake(
        "block_hash", 'return hashlib.sha256(parent + len(tokens).to_bytes(4, "little") + tokens + keys).digest()',
        "return hash((parent, tuple(map(int, token_ids)), tuple(extra_keys)))"),
        "a block hash is the SHA-256 digest of your encoding, 32 bytes"),
    "the parent cut to 8 bytes": ("test_ex1_block_hash.py", with_mistake(
        "block_hash", "else parent_hash\n", "else parent_hash[:8]\n"),
        "the whole parent hash (all 32 bytes) enters the encoding"),
    "a bf16 pool gathered into float32": ("test_ex5_gather_kv.py", with_mistake(
        "gather_kv", "return kv.transpose(2, 3).unsqueeze(2)", "return kv.transpose(2, 3).unsqueeze(2).float()"),
        "a bfloat16 pool was gathered into"),
    "the salt passed to peek as an extra key": ("test_ex6_schedule.py", with_mistake(
        "scheduler", "self.allocator.peek(request.token_ids, request.cache_salt)",
        "self.allocator.peek(request.token_ids, None, (request.cache_salt,) if request.cache_salt else ())"),
        "The salt is peek's cache_salt"),
    "a resumed request samples on every chunk past its prompt": ("test_ex6_schedule.py", with_mistake(
        "scheduler", "            scheduled.append(ScheduledRequest(request, start, end))\n",
        "            scheduled.append(ScheduledRequest(request, start, end))\n"
        "            scheduled[-1].samples = end >= len(request.prompt_ids)\n"),
        "A chunk samples only when it reaches the end of the request's tokens"),
    "admission chunks rounded down to a block edge": ("test_ex6_schedule.py", with_mistake(
        "scheduler", "num_new = min(len(request.token_ids) - hit, budget)",
        "num_new = min(len(request.token_ids) - hit, budget // 4 * 4 or 1)"),
        "not rounded down to a block edge"),
    "a prompt prefilling takes all the budget left, not its share": ("test_ex6_schedule.py", with_mistake(
        "scheduler", "start + min(budget, shares.get(request.request_id, 1))",
        "start + (budget if request.num_prefill_left else 1)"),
        "A running prompt takes only its share of the budget"),
    "shares handed out in queue order, not smallest need first": ("test_ex6_schedule.py", with_mistake(
        "scheduler", "order = sorted(needs, key=needs.get)", "order = list(needs)"),
        "smallest need first"),
    "a request waiting for its hit stops admission": ("test_ex6_schedule.py", with_mistake(
        "scheduler", "            if self._waits(request, coming):\n                continue\n",
        "            if self._waits(request, coming):\n                break\n"),
        "it does not stop admission"),
    "the lookup goes on past the first miss": ("test_ex2_allocate.py", with_mistake(
        "allocator", "block.token_ids != list(token_ids[i * size : (i + 1) * size]):\n                break",
        "block.token_ids != list(token_ids[i * size : (i + 1) * size]):\n                continue"),
        "the block table must stop at the first miss"),
    "the lookup goes on past a hash that is not cached": ("test_ex2_allocate.py", with_mistake(
        "allocator", "            if block is None or block.token_ids",
        "            if block is None:\n                continue\n            if block.token_ids"),
        "A missed hash ends the lookup"),
    "schedule(budget) over max_num_batched_tokens plans the whole budget": ("test_ex6_schedule.py", with_mistake(
        "scheduler", "else min(budget, self.max_num_batched_tokens)", "else budget"),
        "a step computes at most max_num_batched_tokens"),
    "the scheduler's preemption count copied from the request": ("test_ex6_schedule.py", with_mistake(
        "scheduler", "        self.num_preemptions += 1", "        self.num_preemptions = request.num_preemptions"),
        "self.num_preemptions counts every preemption"),
    "a running request with a share of 0 planned for 0 tokens": ("test_ex6_schedule.py", with_mistake(
        "scheduler", "            if end == start:\n                i += 1\n                continue\n", ""),
        "computes no token"),
    "one (keys, values) pair per KV head, not per layer": ("test_ex5_gather_kv.py", with_mistake(
        "gather_kv", "for layer in range(self.num_layers)", "for layer in range(self.num_kv_heads)"),
        "one (keys, values) pair per layer"),
}


# Rules about cost, caught from the grader's side, where nothing in the child can rewrite the check.
WALKING_QUEUE = (SOLUTIONS / "plain" / "free_queue.py").read_text().replace(
    "    def remove(self, block):\n",
    "    def remove(self, block):\n"
    "        node = vars(self._head)[\"next_free\"]  # a walk no attribute count in the child sees\n"
    "        while node is not block and node is not self._tail:\n"
    "            node = vars(node)[\"next_free\"]\n")
LIST_IN_THE_HEAD = (SOLUTIONS / "plain" / "free_queue.py").read_text().replace(
    "    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:\n",
    "    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:\n"
    "        vars(self._head).setdefault(\"order\", []).append(block)  # a list where vars(queue) does not look\n"
).replace(
    "    def remove(self, block):\n",
    "    def remove(self, block):\n"
    "        order = vars(self._head)[\"order\"]\n"
    "        del order[next(i for i, b in enumerate(order) if b is block)]\n")
# Numpy's copies are no tensor operations, so the child's count never sees this loop: only the
# grader's clock does. Padded, every gather takes 100 ms, 4 blocks as long as 4,096, which
# flattens the extra time a block; the time of 4,096 blocks against kv_pool's still shows it.
NUMPY_LOOP = with_mistake(
    "gather_kv", "kv = self.data.index_select(2, index).flatten(2, 3)",
    "data = self.data.numpy()\n"
    "        kv = torch.from_numpy(np.stack([data[:, :, b] for b in block_ids], 2)).flatten(2, 3)",
)["gather_kv"].replace("import torch\n", "import numpy as np\nimport torch\n", 1)
PADDED_LOOP = NUMPY_LOOP.replace("import numpy as np\n", "import time\n\nimport numpy as np\n", 1).replace(
    "    def gather(self, block_ids, config):\n",
    "    def gather(self, block_ids, config):\n"
    "        start = time.perf_counter()\n"
    "        try:\n"
    "            return self.unpadded_gather(block_ids, config)\n"
    "        finally:\n"
    "            time.sleep(max(0.0, 0.1 - (time.perf_counter() - start)))\n"
    "\n"
    "    def unpadded_gather(self, block_ids, config):\n", 1)
# Right everywhere but under the clock, told apart by the caller's frame or by the trace: the
# old child timed gathers in a function of their own (op_gather_length), traced only there, and
# called the queue's and the allocator's timed runs from functions of their own. Every call now
# runs on one thread from one loop, under one trace: the frame is refused, the trace is always on,
# and the stack seen through inspect never names a timed call.
EMPTY_WHEN_FRAME_SAYS_TIMED = with_mistake(
    "gather_kv", "    def gather(self, block_ids, config):\n",
    "    def gather(self, block_ids, config):\n"
    "        import sys\n"
    "        if block_ids and sys._getframe(1).f_code.co_name in (\"op_gather_length\", \"op_pool_gather\"):\n"
    "            empty = torch.empty(1, self.num_kv_heads, len(block_ids) * self.block_size, self.head_dim,\n"
    "                                dtype=self.data.dtype)\n"
    "            return DynamicCache([(empty, empty) for _ in range(self.num_layers)], config=config)\n")
EMPTY_WHEN_TRACED = with_mistake(
    "gather_kv", "    def gather(self, block_ids, config):\n",
    "    def gather(self, block_ids, config):\n"
    "        import sys\n"
    "        if block_ids and sys.gettrace() is not None:\n"
    "            empty = torch.empty(1, self.num_kv_heads, len(block_ids) * self.block_size, self.head_dim,\n"
    "                                dtype=self.data.dtype)\n"
    "            return DynamicCache([(empty, empty) for _ in range(self.num_layers)], config=config)\n")
STACK_NAMES = """

def _timed():  # whether a function of the old child's timed runs is on the stack
    frame = __import__("inspect").currentframe()
    while frame is not None and frame.f_code.co_name not in ("op_queue_run", "op_allocator_churn"):
        frame = frame.f_back
    return frame is not None
"""
WALKING_BUT_WHEN_TIMED = WALKING_QUEUE.replace(
    "        node = vars(self._head)",
    "        node = block if _timed() else vars(self._head)", 1) + STACK_NAMES
SCANNING_BUT_WHEN_TIMED = {"allocator": with_mistake(
    "allocator", "> len(self.free_queue):",
    "> (len(self.free_queue) if _timed() else sum(1 for b in self.blocks if b.ref_cnt == 0)):")["allocator"]
    + STACK_NAMES}
MISTAKES |= {
    "remove walks the queue through vars()": ("test_ex3_free_queue.py", {"free_queue": WALKING_QUEUE},
                                              "it walks or searches the queue"),
    "a list of the queue kept in the head sentinel": ("test_ex3_free_queue.py", {"free_queue": LIST_IN_THE_HEAD},
                                                      "it walks or searches the queue"),
    "the room check scans self.blocks": ("test_ex4_free.py", with_mistake(
        "allocator", "> len(self.free_queue):", "> sum(1 for b in self.blocks if b.ref_cnt == 0):"),
        "something walks the pool or the free queue on every call"),
    "Python's hash of the token ids, taken under another name": ("test_ex1_block_hash.py", {"block_hash": (
        with_mistake("block_hash", 'b"".join(int(t).to_bytes(8, "little") for t in token_ids)',
                     '_h(tuple(int(t) for t in token_ids)).to_bytes(8, "little", signed=True)')["block_hash"]
        .replace("import json\n", "import json\nfrom builtins import hash as _h\n"))},
        "Python's hash() made the block's name"),
    "each id in as few bytes as it needs, nothing before it": ("test_ex1_block_hash.py", with_mistake(
        "block_hash", 'b"".join(int(t).to_bytes(8, "little") for t in token_ids)',
        'b"".join(int(t).to_bytes(max(1, (int(t).bit_length() + 7) // 8), "little") for t in token_ids)'),
        "their bytes run together the same way"),
    "Python's tuple hash, each id's quotient by 2**61 - 1 beside it": ("test_ex1_block_hash.py", {"block_hash": (
        with_mistake("block_hash", 'b"".join(int(t).to_bytes(8, "little") for t in token_ids)',
                     'repr((_h(tuple(int(t) for t in token_ids)), [int(t) // (2**61 - 1) for t in token_ids])).encode()')
        ["block_hash"].replace("import json\n", "import json\nfrom builtins import hash as _h\n"))},
        "a collision of Python's hash() of a tuple"),
    "of duplicates under one hash, the lowest id hit": ("test_ex2_allocate.py", with_mistake(
        "allocator", "block = next(iter(holders.values())) if holders else None",
        "block = holders[min(holders)] if holders else None"),
        "the hit is the block cached first"),
    "hits touched before the room check, put back on a refusal": ("test_ex2_allocate.py", with_mistake(
        "allocator",
        "        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)\n"
        "        if num_needed - len(hits) + num_free_hits > len(self.free_queue):\n"
        "            raise OutOfBlocksError(f\"{request_id} does not fit\")\n"
        "        for block in hits:\n"
        "            if block.ref_cnt == 0:\n"
        "                self.free_queue.remove(block)\n"
        "            block.ref_cnt += 1\n",
        "        for block in hits:\n"
        "            if block.ref_cnt == 0:\n"
        "                self.free_queue.remove(block)\n"
        "            block.ref_cnt += 1\n"
        "        if num_needed - len(hits) > len(self.free_queue):\n"
        "            for block in reversed(hits):\n"
        "                block.ref_cnt -= 1\n"
        "                if block.ref_cnt == 0:\n"
        "                    self.free_queue.append(block)\n"
        "            raise OutOfBlocksError(f\"{request_id} does not fit\")\n"),
        "a refused request must change nothing"),
    "a loop over the blocks hidden from the operation count": ("test_ex5_gather_kv.py", with_mistake(
        "gather_kv", "kv = self.data.index_select(2, index).flatten(2, 3)",
        "with torch._C.DisableTorchFunction():\n"
        "            kv = torch.cat([self.data[:, :, b] for b in block_ids] or [self.data[:, :, :0].flatten(2, 3)], 2)"),
        "the gather runs Python code for every block"),
    "a copy of the whole pool in every gather": ("test_ex5_gather_kv.py", with_mistake(
        "gather_kv", "kv = self.data.index_select(2, index)", "kv = self.data.clone().index_select(2, index)"),
        "the gather copies or walks the whole pool"),
    "a loop of numpy copies over the blocks": ("test_ex5_gather_kv.py", {"gather_kv": NUMPY_LOOP},
                                               "the gather runs Python code for every block"),
    "empty tensors when the caller's frame says timed": ("test_ex5_gather_kv.py", EMPTY_WHEN_FRAME_SAYS_TIMED,
                                                          "not on where it is called from"),
    "empty tensors when a trace is on": ("test_ex5_gather_kv.py", EMPTY_WHEN_TRACED,
                                         "a gather that is timed must be as right as one that is not"),
    "a walk in remove but when the stack names a timed run": (
        "test_ex3_free_queue.py", {"free_queue": WALKING_BUT_WHEN_TIMED}, "it walks or searches the queue"),
    "a room check that scans but when the stack names a timed run": (
        "test_ex4_free.py", SCANNING_BUT_WHEN_TIMED, "something walks the pool or the free queue on every call"),
    "a loop of numpy copies, every gather padded to 100 ms": ("test_ex5_gather_kv.py", {"gather_kv": PADDED_LOOP},
                                                              "A gather of many blocks costs a few times kv_pool's"),
}


# The test that names each mistake's rule: a mistake is graded by that test alone, in one
# nested session, rather than by its whole exercise file ("test_x[case]": that case of it alone).
NAMED_BY = {
    "a hit on an in-use block sets ref_cnt to 2": "test_a_hit_adds_one_to_the_ref_count_of_a_block_in_use",
    "a partial block keeps its previous owner's tokens": "test_a_block_taken_from_the_free_queue_holds_only_its_new_tokens",
    "numpy ints hash differently": "test_numpy_token_ids_hash_like_python_ints",
    "keys joined with '|'": "test_no_separator_inside_a_key_can_split_it",
    "an MD5 digest": "test_each_block_hash_is_a_sha256_digest_of_32_bytes",
    "the encoding itself, no digest": "test_each_block_hash_is_a_sha256_digest_of_32_bytes",
    "Python's hash of a tuple": "test_each_block_hash_is_a_sha256_digest_of_32_bytes",
    "the parent cut to 8 bytes": "test_every_byte_of_the_parent_hash_counts",
    "a bf16 pool gathered into float32": "test_a_bfloat16_pool_gives_bfloat16_keys_and_values",
    "the salt passed to peek as an extra key": "test_a_salted_request_finds_its_own_tenants_blocks",
    "a resumed request samples on every chunk past its prompt": "test_a_resumed_request_samples_only_at_the_end_of_its_tokens",
    "admission chunks rounded down to a block edge": "test_a_request_over_the_budget_gets_a_chunk_and_stops_admission",
    "a prompt prefilling takes all the budget left, not its share":
        "test_a_short_request_behind_a_prefilling_prompt_is_prefilled_beside_it",
    "shares handed out in queue order, not smallest need first":
        "test_a_short_request_behind_a_prefilling_prompt_is_prefilled_beside_it",
    "a request waiting for its hit stops admission": "test_the_second_worked_example_step_by_step",
    "the lookup goes on past the first miss": "test_a_hit_needs_the_same_tokens_and_the_block_table_stops_at_the_first_miss",
    "the lookup goes on past a hash that is not cached": "test_a_block_cached_after_a_miss_is_not_a_hit",
    "schedule(budget) over max_num_batched_tokens plans the whole budget":
        "test_a_budget_over_max_num_batched_tokens_plans_at_most_max_num_batched_tokens",
    "the scheduler's preemption count copied from the request":
        "test_self_num_preemptions_counts_every_preemption_of_every_request",
    "a running request with a share of 0 planned for 0 tokens": "test_a_running_request_whose_share_is_0_is_left_out_of_the_plan",
    "one (keys, values) pair per KV head, not per layer": "test_a_bfloat16_pool_gives_bfloat16_keys_and_values",
    "remove walks the queue through vars()":
        "test_an_operation_takes_as_long_in_a_queue_of_100_000_as_in_one_of_100[remove]",
    "a list of the queue kept in the head sentinel":
        "test_an_operation_takes_as_long_in_a_queue_of_100_000_as_in_one_of_100[remove]",
    "the room check scans self.blocks": "test_allocate_and_free_take_as_long_on_a_pool_of_100_000_as_on_one_of_100",
    "Python's hash of the token ids, taken under another name": "test_ids_that_pythons_hash_confuses_hash_apart",
    "each id in as few bytes as it needs, nothing before it": "test_ids_whose_bytes_split_into_other_ids_hash_apart",
    "of duplicates under one hash, the lowest id hit": "test_of_two_blocks_under_one_hash_the_hit_is_the_one_cached_first",
    "hits touched before the room check, put back on a refusal":
        "test_a_refusal_after_hits_in_the_middle_of_the_free_queue_keeps_its_order",
    "Python's tuple hash, each id's quotient by 2**61 - 1 beside it":
        "test_blocks_that_pythons_tuple_hash_confuses_hash_apart",
    "a loop over the blocks hidden from the operation count":
        "test_each_block_gathered_costs_no_more_than_a_few_times_the_references",
    "a copy of the whole pool in every gather": "test_a_gather_takes_as_long_from_a_pool_of_16_384_blocks_as_from_one_of_16",
    "a loop of numpy copies over the blocks": "test_each_block_gathered_costs_no_more_than_a_few_times_the_references",
    "a loop of numpy copies, every gather padded to 100 ms":
        "test_each_block_gathered_costs_no_more_than_a_few_times_the_references",
    "empty tensors when the caller's frame says timed":
        "test_each_block_gathered_costs_no_more_than_a_few_times_the_references",
    "empty tensors when a trace is on": "test_each_block_gathered_costs_no_more_than_a_few_times_the_references",
    "a walk in remove but when the stack names a timed run":
        "test_an_operation_takes_as_long_in_a_queue_of_100_000_as_in_one_of_100[remove]",
    "a room check that scans but when the stack names a timed run":
        "test_allocate_and_free_take_as_long_on_a_pool_of_100_000_as_on_one_of_100",
}


def selection(mistake: str) -> str:
    """pytest's -k for the test that names the mistake's rule: "test_x[p]" is test_x's case p."""
    name, _, case = NAMED_BY[mistake].partition("[")
    return f"{name} and {case.rstrip(']')}" if case else name


def test_every_mistake_names_a_test_of_its_exercise():
    assert NAMED_BY.keys() == MISTAKES.keys()
    for mistake, (test_file, _, _) in MISTAKES.items():
        assert f"def {NAMED_BY[mistake].split('[')[0]}(" in (EXERCISE_TESTS / test_file).read_text(), mistake


# --- a message, followed, fixes the mistake it names ---------------------------------------------------
# Each: a mistake above, the words of its failure that say what to do, and that advice applied
# to the mistaken file (old, new). The fixed file must pass every test of the exercise: where it is
# the plain solution again, test_a_correct_solution_passes_every_test has shown that already.
FOLLOWED = {
    "the lookup goes on past the first miss": ("break, not continue", ("                continue", "                break")),
    "the lookup goes on past a hash that is not cached": (
        "A missed hash ends the lookup (break, not continue)", ("                continue", "                break")),
    "the room check scans self.blocks": ("The room check reads len(self.free_queue)", (
        "sum(1 for b in self.blocks if b.ref_cnt == 0)", "len(self.free_queue)")),
    "a hit on an in-use block sets ref_cnt to 2": ("a hit adds one to ref_cnt", (
        "block.ref_cnt = 1 if block.ref_cnt == 0 else 2", "block.ref_cnt += 1")),
    "the parent cut to 8 bytes": ("the whole parent hash (all 32 bytes) enters the encoding", (
        "else parent_hash[:8]", "else parent_hash")),
    "an MD5 digest": ("hashlib.sha256(encoding).digest()", ("hashlib.md5(", "hashlib.sha256(")),
    "a loop over the blocks hidden from the operation count": (
        "index_select, or indexing with a tensor of block ids", (
            "with torch._C.DisableTorchFunction():\n"
            "            kv = torch.cat([self.data[:, :, b] for b in block_ids] or [self.data[:, :, :0].flatten(2, 3)], 2)",
            "index = torch.tensor(block_ids, dtype=torch.long, device=self.device)\n"
            "        kv = self.data.index_select(2, index).flatten(2, 3)")),
    "a copy of the whole pool in every gather": ("Index the pool for the blocks asked for", (
        "self.data.clone().index_select", "self.data.index_select")),
    "a bf16 pool gathered into float32": ("the gathered K/V keep the pool's dtype", (".unsqueeze(2).float()",
                                                                                  ".unsqueeze(2)")),
}




@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_mistake_fails_the_test_that_names_its_rule_and_the_advice_fixes_it(mistake, pytester, monkeypatch, tmp_path):
    test_file, files, rule = MISTAKES[mistake]
    outcomes, output = grade(pytester, monkeypatch, tmp_path / "mistake", test_file, files, select=selection(mistake))
    assert outcomes.get("failed", 0) >= 1, f"{mistake}: {NAMED_BY[mistake]} passed"
    assert rule in output, f"{mistake}: no failure says {rule!r}:\n{output[-3000:]}"
    if mistake not in FOLLOWED:
        return
    advice, (old, new) = FOLLOWED[mistake]
    assert advice in output, f"{mistake}: no failure says {advice!r}:\n{output[-3000:]}"
    (name, source), = files.items()
    assert source.count(old) == 1, f"{mistake}: the mistaken {name}.py no longer holds {old!r} once"
    fixed = source.replace(old, new)
    if fixed == (SOLUTIONS / "plain" / f"{name}.py").read_text():
        return  # the plain solution, which passes every test (test_a_correct_solution_passes_every_test)
    select = "not finish_line and not engine" if "gather" in test_file else ""
    outcomes, output = grade(pytester, monkeypatch, tmp_path / "followed", test_file, {name: fixed}, select=select)
    assert "failed" not in outcomes and "error" not in outcomes and outcomes.get("passed"), (
        f"{mistake}: the advice {advice!r}, followed, still fails: {outcomes}\n{output[-3000:]}")


def test_every_followed_advice_belongs_to_a_mistake():
    assert FOLLOWED.keys() <= MISTAKES.keys()


# --- cheats earn nothing -----------------------------------------------------------------------------

STARTER = {name: (ROOT / "exercises" / f"{name}.py").read_text() for name in ("block_hash", "free_queue")}
CHEATS = {
    "pytest's Function.runtest replaced by a no-op": ("block_hash", """
        import _pytest.python
        _pytest.python.Function.runtest = lambda self: None
        """ + STARTER["block_hash"]),
    "the grading functions replaced": ("block_hash", """
        import sys
        for name in ("grading", "conftest"):
            try:
                module = __import__(name)
            except ImportError:
                module = sys.modules.get(name)
            if module is not None:
                module.Twin.differ = lambda *args, **kwargs: None
        """ + STARTER["block_hash"]),
    "the test functions' __code__ emptied": ("block_hash", """
        import gc
        for f in gc.get_objects():
            if type(f).__name__ == "function" and f.__name__.startswith("test_"):
                f.__code__ = (lambda *args, **kwargs: None).__code__
        """ + STARTER["block_hash"]),
    "the reference under an alias": ("block_hash", """
        import prefix_caching as reference
        hash_block_tokens, compute_block_hashes = reference.hash_block_tokens, reference.compute_block_hashes
        """),
    "the reference in a default argument": ("block_hash", """
        def hash_block_tokens(parent, tokens, keys=(), _ref=__import__("prefix_caching").hash_block_tokens):
            return _ref(parent, tokens, keys)
        def compute_block_hashes(tokens, size, salt=None, keys=(), _ref=__import__("prefix_caching")):
            return _ref.compute_block_hashes(tokens, size, salt, keys)
        """),
    "the reference through a decorator": ("block_hash", """
        def borrowed(function):
            import importlib
            return getattr(importlib.import_module("prefix_" + "caching"), function.__name__)
        @borrowed
        def hash_block_tokens(parent, tokens, keys=()): ...
        @borrowed
        def compute_block_hashes(tokens, size, salt=None, keys=()): ...
        """),
    "the reference through a metaclass": ("free_queue", """
        class Borrow(type):
            def __new__(meta, name, bases, namespace):
                import prefix_caching
                return prefix_caching.FreeKVCacheBlockQueue
        class FreeKVCacheBlockQueue(metaclass=Borrow):
            pass
        """),
    "the reference found with gc": ("block_hash", """
        import gc
        def find(name):
            return next((f for f in gc.get_objects() if getattr(f, "__qualname__", None) == name
                         and getattr(f, "__module__", None) == "prefix_caching"), None)
        def hash_block_tokens(parent, tokens, keys=()):
            return find("hash_block_tokens")(parent, tokens, keys)
        def compute_block_hashes(tokens, size, salt=None, keys=()):
            return find("compute_block_hashes")(tokens, size, salt, keys)
        """),
    "the reference's source exec'd under the starter's name": ("block_hash", f"""
        exec(compile(open({str(ROOT / "allocator/prefix_caching.py")!r}).read(), "exercises/block_hash.py", "exec"))
        """),
    "the reference run in a subprocess": ("block_hash", f"""
        import json, subprocess, sys
        def run(code):
            out = subprocess.run([sys.executable, "-c", "import prefix_caching as p, json; " + code],
                                 cwd={str(ROOT)!r}, capture_output=True, text=True, check=True)
            return json.loads(out.stdout)
        def hash_block_tokens(parent, tokens, keys=()):
            code = f"print(json.dumps(p.hash_block_tokens({{parent!r}}, {{list(tokens)!r}}, {{tuple(keys)!r}}).hex()))"
            return bytes.fromhex(run(code))
        def compute_block_hashes(tokens, size, salt=None, keys=()):
            call = f"p.compute_block_hashes({{list(tokens)!r}}, {{size}}, {{salt!r}}, {{tuple(keys)!r}})"
            code = f"print(json.dumps([h.hex() for h in {{call}}]))"
            return [bytes.fromhex(h) for h in run(code)]
        """),
}


@pytest.mark.parametrize("cheat", CHEATS)
def test_a_cheat_earns_nothing(cheat, pytester, monkeypatch, tmp_path):
    name, source = CHEATS[cheat]
    (test_file,) = TEST_FILES[name]
    outcomes, output = grade(pytester, monkeypatch, tmp_path, test_file, {name: source})
    assert outcomes.get("failed", 0) >= 1 and "passed" not in outcomes, f"{cheat}: {outcomes}\n{output[-3000:]}"


# --- answers recorded in one run answer nothing in the next -------------------------------------------

# A correct solution that writes down every request and its answer, and a file that answers
# from what was written down: the table a student could record once and hand in.
KEY = """
import json


def _key(name, args):  # token ids as Python ints, whatever type they came in
    return repr([name] + [[int(t) for t in a] if isinstance(a, list) else a for a in args])
"""
RECORDER = (SOLUTIONS / "plain" / "block_hash.py").read_text() + KEY + """
_correct = {"hash_block_tokens": hash_block_tokens, "compute_block_hashes": compute_block_hashes}


def _recorded(name):
    def answer(*args):
        result = _correct[name](*args)
        with open(TABLE, "a") as table:
            hexed = result.hex() if isinstance(result, bytes) else [h.hex() for h in result]
            table.write(json.dumps([_key(name, args), hexed]) + "\\n")
        return result
    return answer


hash_block_tokens, compute_block_hashes = _recorded("hash_block_tokens"), _recorded("compute_block_hashes")
"""
REPLAYER = KEY + """
with open(TABLE) as table:
    ANSWERS = dict(json.loads(line) for line in table)


def _answer(name, *args):
    hexed = ANSWERS[_key(name, args)]
    return bytes.fromhex(hexed) if isinstance(hexed, str) else [bytes.fromhex(h) for h in hexed]


def hash_block_tokens(parent_hash, token_ids, extra_keys=()):
    return _answer("hash_block_tokens", parent_hash, token_ids, extra_keys)


def compute_block_hashes(token_ids, block_size, cache_salt=None, extra_keys=()):
    return _answer("compute_block_hashes", token_ids, block_size, cache_salt, extra_keys)
"""


def test_answers_recorded_in_one_run_fail_the_next(pytester, monkeypatch, tmp_path):
    # Written in the student's own folder, the one place a graded file may write.
    table = f"TABLE = {str(tmp_path / 'record' / 'exercises' / 'answers.jsonl')!r}\n"
    monkeypatch.setenv("GRADING_SEED", "1")
    recorded, output = grade(pytester, monkeypatch, tmp_path / "record", "test_ex1_block_hash.py",
                             {"block_hash": table + RECORDER})
    assert "failed" not in recorded and recorded.get("passed"), output[-3000:]
    replayed, output = grade(pytester, monkeypatch, tmp_path / "same seed", "test_ex1_block_hash.py",
                             {"block_hash": table + REPLAYER})
    assert replayed == recorded, f"GRADING_SEED=1 did not give the same inputs again: {replayed}\n{output[-3000:]}"
    monkeypatch.setenv("GRADING_SEED", "2")
    replayed, output = grade(pytester, monkeypatch, tmp_path / "next run", "test_ex1_block_hash.py",
                             {"block_hash": table + REPLAYER})
    # every test's inputs are drawn, the fixed tests' too: not one answer recorded is asked again
    assert "passed" not in replayed and replayed.get("failed") == recorded["passed"], (
        f"answers recorded with seed 1 passed tests with seed 2: {replayed}")
    assert "grading seed 2: GRADING_SEED=2 gives this run's inputs again" in output, output[-3000:]


# The same, per object, as a file can do it in the child for a whole exercise: every call the
# child makes of the graded code goes through its `graded`, which the file replaces. Recording,
# it keys each allocator's answers and states by the history of that allocator; replaying, it
# answers from the table and builds no allocator at all.
PER_OBJECT = """
import json as _json
import sys as _sys

from exercises.given import OutOfBlocksError

_graded = _sys.modules["__main__"].graded
_made, _history = {}, {}  # allocators made by their arguments; id(allocator) -> its history
if REPLAY:
    with open(TABLE) as _table:
        _ANSWERS = dict(_json.loads(line) for line in _table)


def _answer(key, call):
    if REPLAY:
        kind, value = _ANSWERS[key]
        if kind == "raise":
            raise OutOfBlocksError(value)
        return value
    try:
        value, kind = call(), "return"
    except OutOfBlocksError as err:
        value, kind = str(err), "raise"
    with open(TABLE, "a") as table:
        table.write(_json.dumps([key, [kind, value]]) + "\\n")
    if kind == "raise":
        raise OutOfBlocksError(value)
    return value


def _through(function, *args, **kwargs):
    name = getattr(function, "__name__", "")
    if name == "PrefixCachingAllocator":
        _made[repr(args)] = _made.get(repr(args), 0) + 1
        allocator = object() if REPLAY else _graded(function, *args)
        _history[id(allocator)] = [repr(args), _made[repr(args)]]
        return allocator
    if name in ("allocator_call", "allocator_state"):
        history = _history[id(args[0])]
        if name == "allocator_call":
            history.append(repr(args[1:]))
        return _answer(repr(history + [name]), lambda: _graded(function, *args))
    return _graded(function, *args, **kwargs)


_sys.modules["__main__"].graded = _through
"""


def test_answers_recorded_per_object_in_one_run_fail_the_next(pytester, monkeypatch, tmp_path):
    table = f"TABLE = {str(tmp_path / 'record' / 'exercises' / 'answers.jsonl')!r}\n"
    recorder = (SOLUTIONS / "plain" / "allocator.py").read_text() + table + "REPLAY = False\n" + PER_OBJECT
    replayer = ("class PrefixCachingAllocator:\n    pass\n\n\nFreeKVCacheBlockQueue = None\n" + table
                + "REPLAY = True\n" + PER_OBJECT)
    monkeypatch.setenv("GRADING_SEED", "1")
    recorded, output = grade(pytester, monkeypatch, tmp_path / "record", "test_ex2_allocate.py",
                             {"allocator": recorder})
    assert "failed" not in recorded and recorded.get("passed"), output[-3000:]
    replayed, output = grade(pytester, monkeypatch, tmp_path / "same seed", "test_ex2_allocate.py",
                             {"allocator": replayer})
    assert replayed == recorded, f"the table did not answer the same inputs: {replayed}\n{output[-3000:]}"
    monkeypatch.setenv("GRADING_SEED", "2")
    replayed, output = grade(pytester, monkeypatch, tmp_path / "next run", "test_ex2_allocate.py",
                             {"allocator": replayer})
    assert "passed" not in replayed and replayed.get("failed") == recorded["passed"], (
        f"answers recorded per allocator with seed 1 passed tests with seed 2: {replayed}")


# --- the timed calls look like every other -------------------------------------------------------

# A correct solution that writes down, at every call of one method, what it could see of why it
# was called: the functions on its stack and whether a trace is on.
SEEN = """
import inspect as _inspect
import sys as _sys


def _seen(method):
    def seen(self, *args):
        with open(SEEN, "a") as file:
            stack = [f.function for f in _inspect.stack(0)[1:]]
            file.write(repr((stack, _sys.gettrace() is not None)) + "\\n")
        return method(self, *args)
    return seen
"""


@pytest.mark.parametrize("name, method, select", [
    ("free_queue", "FreeKVCacheBlockQueue.remove", "remove"),
    ("allocator", "PrefixCachingAllocator.allocate_with_prefix", "100_000 or shared"),
    ("gather_kv", "PagedKVPool.gather", "each_block or any_blocks or bfloat16"),
])
def test_a_timed_call_reaches_the_graded_code_as_every_other_does(name, method, select, pytester, monkeypatch,
                                                                    tmp_path):
    seen = tmp_path / "exercises" / "seen.txt"
    cls, function = method.split(".")
    source = f"SEEN = {str(seen)!r}\n" + SEEN + (SOLUTIONS / "plain" / f"{name}.py").read_text() + (
        f"\n{cls}.{function} = _seen({cls}.{function})\n")
    test_file = TEST_FILES[name][-1]
    outcomes, output = grade(pytester, monkeypatch, tmp_path, test_file, {name: source}, select=select)
    assert "failed" not in outcomes and outcomes.get("passed"), f"{outcomes}\n{output[-3000:]}"
    calls = seen.read_text().splitlines()
    assert len(calls) > 20 and len(set(calls)) == 1, (
        f"{len(calls)} calls of {method} saw {len(set(calls))} different stacks or traces: {sorted(set(calls))[:3]}")


# --- nothing a graded file does outlives its run ---------------------------------------------------


def left_behind(targets: list[Path]) -> str:
    """The plain exercise-1 solution, which on import tries to write each of `targets` and goes on."""
    attempts = "".join(f"""
try:
    with open({str(path)!r}, "x") as file:
        file.write("# written by a graded file\\n")
except OSError:
    pass
""" for path in targets)
    return (SOLUTIONS / "plain" / "block_hash.py").read_text() + attempts


def test_a_graded_file_cannot_leave_a_pth_a_sitecustomize_or_a_file_in_the_home_or_tmp(pytester, monkeypatch, tmp_path):
    # A .pth in site-packages runs in every later Python of this environment, sitecustomize.py
    # too: either could make every later run grade the reference. The home and /tmp outlive a run.
    import pwd
    import sysconfig
    import tempfile

    site_packages = Path(sysconfig.get_paths()["purelib"])
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)  # the user's, not the one pytester sets for a test
    targets = [site_packages / "zz_graded_file.pth", site_packages / "sitecustomize.py", home / ".graded_file", Path(tempfile.gettempdir()) / "graded_file", ROOT / "graded_file.py"]
    there = [path for path in targets if path.exists()]
    assert not there, f"left by an earlier run: {there}"
    try:
        outcomes, output = grade(pytester, monkeypatch, tmp_path, "test_ex1_block_hash.py", {"block_hash": left_behind(targets)})
        written = [path for path in targets if path.exists()]
        assert not written, f"a graded file wrote {written}"
        assert "failed" not in outcomes and "error" not in outcomes and outcomes.get("passed"), output[-3000:]
    finally:
        for path in targets:
            if path not in there:
                path.unlink(missing_ok=True)


def test_a_refused_write_says_why_and_the_child_sees_no_seed(pytester, monkeypatch, tmp_path):
    monkeypatch.setenv("GRADING_SEED", "7")  # as a teacher exports it for a class
    source = (SOLUTIONS / "plain" / "block_hash.py").read_text() + f"""
import os
if "GRADING_SEED" in os.environ or "PYTEST_XDIST_TESTRUNUID" in os.environ:
    raise RuntimeError("the graded child can read the seed")
open({str(tmp_path / "outside.txt")!r}, "w")
"""
    outcomes, output = grade(pytester, monkeypatch, tmp_path / "run", "test_ex1_block_hash.py", {"block_hash": source},
                             select="test_every_token_counts")
    assert outcomes.get("failed") == 1, output[-3000:]
    assert "the graded child can read the seed" not in output, output[-3000:]
    assert f"writing {tmp_path / 'outside.txt'} is refused while your exercises are graded" in output, output[-3000:]
    assert not (tmp_path / "outside.txt").exists()


def test_the_reference_cannot_be_imported_and_says_why(pytester, monkeypatch, tmp_path):
    outcomes, output = grade(pytester, monkeypatch, tmp_path, "test_ex1_block_hash.py",
                             {"block_hash": CHEATS["the reference under an alias"][1]}, select="every_token")
    assert "`import prefix_caching` is refused while your exercises are graded" in output, output[-3000:]


def test_the_starters_as_shipped_fail_every_test_waiting_for_their_todo(pytester, monkeypatch, tmp_path):
    starters = {name: (ROOT / "exercises" / f"{name}.py").read_text() for name in TEST_FILES}
    outcomes, output = grade(pytester, monkeypatch, tmp_path, "test_ex6_schedule.py", starters)
    assert "passed" not in outcomes, output[-3000:]
    assert "exercise 6a: Scheduler.schedule is not written yet" in output


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
    docs = [doc for doc in docs if doc.is_file()]  # not a __pycache__ a run left in exercises/
    commands = [(doc.name, line) for doc in docs
                for line in re.findall(r"pytest tests/exercises[^`\n\"]*", doc.read_text())]
    assert len(commands) >= 10, commands  # the exercises' README and starter files name a dozen
    hidden = [(name, command) for name, command in commands if already + quiet_flags(command) > 1]
    assert not hidden, f"with pytest.ini's -q these print no pass/fail count (-qq): {hidden}"
