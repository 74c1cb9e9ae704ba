"""The engine under several threads: every reply equals the one its request gets alone.

The rule that matters: a cached block is never read before its K/V is written. Stage 7's
path (engine/one_request.py, run in each caller's thread over the engine's parts) caches a prompt's
full blocks when it allocates them, so allocation and prefill must be one step; these tests
force the interleaving that would break it instead of hoping a scheduler finds it. The
engine loop's callers share its steps (test_batching.py and the server's tests).
"""

import sys
import threading
from dataclasses import replace

from engine import one_request
from engine.request import SamplingParams
from helpers import wait_until_idle

SHARED = list(range(300, 316))  # 4 full blocks of 4, new to every engine these tests make


class PausingLock:
    """Stands in for engine.lock. The first time `pause_thread` lets go of it completely after
    allocating, it runs `while_paused` (another request, start to end) before going on.

    If the engine released its lock between allocating a request's blocks and writing their
    K/V, `while_paused` would run in that gap and hit blocks full of zeros."""

    def __init__(self, inner, engine):
        self.inner, self.depth = inner, 0
        self.pause_thread = self.while_paused = None
        self.allocated = False
        real_allocate = engine.allocator.allocate_with_prefix

        def allocate(*args, **kwargs):
            if threading.current_thread() is self.pause_thread:
                self.allocated = True
            return real_allocate(*args, **kwargs)

        engine.allocator.allocate_with_prefix = allocate

    def __enter__(self):
        self.inner.acquire()
        self.depth += 1
        return self

    def __exit__(self, *exc):
        self.depth -= 1
        outermost = self.depth == 0
        self.inner.release()
        if outermost and self.allocated and threading.current_thread() is self.pause_thread:
            self.allocated, run = False, self.while_paused
            self.while_paused = None
            if run is not None:
                run()


def test_a_second_request_never_hits_blocks_before_the_first_wrote_them(make_engine):
    engine = make_engine()
    a_prompt, b_prompt = SHARED + [1, 2, 3], SHARED + [7, 8]
    expected = make_engine(enable_caching=False).generate(b_prompt, max_tokens=6).token_ids

    lock = PausingLock(engine.lock, engine)
    engine.parts = replace(engine.parts, lock=lock)
    replies = {}

    def run_b():  # on its own thread, as a second client would; waited for while A is paused
        worker = threading.Thread(target=lambda: replies.setdefault(
            "b", one_request.generate(engine.parts, "b", b_prompt, SamplingParams(max_tokens=6))))
        worker.start()
        worker.join(timeout=60)

    lock.pause_thread, lock.while_paused = threading.current_thread(), run_b
    replies["a"] = one_request.generate(engine.parts, "a", a_prompt, SamplingParams(max_tokens=6))

    b = replies["b"]
    assert b.cached_tokens == 16, "B should hit the 4 blocks A computed"
    assert b.token_ids == expected, "B read K/V slots that A had not written yet"


def test_threads_sharing_a_fresh_prefix_all_get_their_answers_alone(make_engine):
    """Many clients at once on a prefix nobody computed yet, with thread switches as often as
    Python allows: every reply is the reply its request gets on an idle engine."""
    prompts = [SHARED + [20 + i, 40 + i] for i in range(6)]
    alone = make_engine(enable_caching=False)
    expected = [alone.generate(p, max_tokens=4).token_ids for p in prompts]
    engine = make_engine()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        results = [None] * len(prompts)
        start = threading.Barrier(len(prompts))

        def client(i):
            start.wait()
            results[i] = engine.generate(prompts[i], max_tokens=4).token_ids

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        sys.setswitchinterval(old)
    assert results == expected
    assert engine.allocator.stats.hit_tokens >= 16 * (len(prompts) - 1)


def test_closing_a_stream_while_holding_the_lock_does_not_deadlock(make_engine):
    engine = make_engine()
    stream = engine.stream(list(range(30)), max_tokens=200)
    next(stream)
    done = threading.Event()

    def close_under_lock():
        with engine.lock:  # reading the pool between two steps, as the docstring invites
            stream.close()
        done.set()

    threading.Thread(target=close_under_lock, daemon=True).start()
    assert done.wait(timeout=10), "close() under engine.lock deadlocked"
    wait_until_idle(engine)


def test_the_allocator_can_be_read_while_a_stage_7_forward_pass_runs(make_engine, monkeypatch):
    """engine.allocator_lock is never held across a forward pass: a page reads the allocator
    in microseconds even during a long prefill."""
    engine = make_engine()
    in_forward, release = threading.Event(), threading.Event()
    real_forward = one_request.forward

    def slow_forward(model, token_ids, past_key_values):
        in_forward.set()
        assert release.wait(timeout=30)
        return real_forward(model, token_ids, past_key_values)

    monkeypatch.setattr(one_request, "forward", slow_forward)
    worker = threading.Thread(target=lambda: one_request.generate(engine.parts, "r", SHARED + [5],
                                                                   SamplingParams(max_tokens=2)))
    worker.start()
    try:
        assert in_forward.wait(timeout=30)
        assert engine.allocator_lock.acquire(timeout=5), "allocator_lock held during a forward pass"
        try:
            assert list(engine.allocator.block_tables) == ["r"]
        finally:
            engine.allocator_lock.release()
        assert not engine.lock.acquire(timeout=0.05), "the step lock should be held for the whole prefill"
    finally:
        release.set()
        worker.join(timeout=30)
