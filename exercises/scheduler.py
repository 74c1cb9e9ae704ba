"""
Exercise 6: one step of the scheduler: decodes, preemption, admission (stage 8).

Everything but the two methods below comes from exercises/given.py (Request,
ScheduledRequest, StepPlan, the waiting queue and the running list, add, finish). The
allocator, self.allocator, is prefix_caching's; the four calls a scheduler makes:

    allocate_with_prefix(request_id, token_ids, cache_salt=None) -> Allocation(num_cached_tokens, num_new_tokens)
        a new request: token_ids are the tokens that get slots now, its hit found among them
    append_tokens(request_id, token_ids)
        more tokens for a request that holds blocks: new blocks when the last one fills,
        each block cached as it fills
    peek(token_ids, cache_salt=None) -> int
        how many of these tokens would hit right now, changing nothing
    free(request_id)
        its blocks back to the free queue, last block first; full ones stay cached

allocate_with_prefix and append_tokens raise OutOfBlocksError, changing nothing, when too
few blocks are free.

(scheduler.py's answer also keeps each request's block hashes on it, so a request waiting at
the head of a full pool is not hashed again every step: request.block_hashes =
allocator.hash_blocks(request.token_ids, request.cache_salt, request.block_hashes), then
block_hashes=request.block_hashes to peek and allocate_with_prefix. Optional here: the plans
and the pool come out the same either way, and that is what is graded.)

The rules a step keeps (vLLM v1's Scheduler.schedule; stage 8 shows them at work):
  - Budget: a step computes at most `budget` tokens (max_num_batched_tokens, or less when
    schedule is given one). Every token computed counts: a decode's one, a chunk's, a resumed
    request's recomputed ones. Cached tokens cost nothing. A prompt longer than what is left
    gets exactly what is left now and the rest in later steps (chunked prefill).
  - Who first: requests already running come before new ones, in the order they were
    admitted; waiting requests are admitted in arrival order, and none overtakes an earlier
    one. At most max_num_seqs run at once.
  - Slots: a step gives slots (and so cached blocks) only to the tokens it computes, so no
    block can be hit before the step that writes its K/V. The allocator checks the room after
    the prefix hit; do not count blocks yourself.
  - Out of blocks: a running request that needs a block when none is free takes one from the
    request with the least work to lose, the one admitted last, by recompute preemption: its
    blocks are freed (full ones stay cached, so it finds them again) and it waits again, ahead
    of everyone who arrived after it. A step that preempted admits nobody (the pool just
    proved too small).
  - Tenants: a request's cache_salt goes wherever its prompt is looked up or allocated.
  - What the client sees: num_cached_tokens is the hit at a request's first admission.

Invariants after every step: a request is in exactly one of self.waiting and self.running,
with status WAITING or RUNNING; the allocator's block tables are exactly the running
requests'; a running request's num_computed_tokens counts its tokens with slots.

Worked example: 4 blocks of 4 tokens; a has 8 tokens, b has a's first 4 and 3 of its own.
    step 1  plan a 0-8, b 4-7    a gets blocks [0, 1]; b hits block 0 (cached the moment a
                                 got it, though a computes it in this very step), gets 2
    step 2  plan a 8-9, b 7-8    both decode: a's token 8 starts block 3, b's token 7 fills 2
    step 3  plan a 9-10          b's token 8 needs a fifth block: b, admitted last, is
                                 preempted; block 2 is freed (still cached), block 0 stays
                                 with a, b waits at the front of the queue for the next step
    step 4  plan a 10-11         the pool is still full: b waits (a frees nothing by decoding)

Finish line:
    EXERCISE_IMPL=starter python -m pytest tests/exercises/test_ex6_schedule.py
replays this example, then breaks each rule above in turn, then runs random scripts of
requests against the reference.
"""

from exercises.given import RUNNING, WAITING, OutOfBlocksError, Request, SchedulerBase, ScheduledRequest, StepPlan


class Scheduler(SchedulerBase):
    def schedule(self, budget: int | None = None) -> StepPlan:
        """Plan one step: StepPlan(scheduled, preempted), both lists in the order things
        happen. budget: the tokens this step may compute, at most self.max_num_batched_tokens
        (the default). Each ScheduledRequest(request, start, end) asks the model to compute
        tokens [start, end) of request.token_ids; the engine then sets num_computed_tokens to
        end and, when end reaches the end of its tokens, appends the token it samples."""
        # TODO exercise 6a
        raise NotImplementedError("exercise 6a: Scheduler.schedule is not written yet (exercises/scheduler.py)")

    def _preempt(self, request: Request) -> None:
        """Recompute preemption of `request`, already taken out of self.running: afterwards it
        holds no blocks, waits again with nothing computed, and counts one more preemption
        (request.num_preemptions and self.num_preemptions)."""
        # TODO exercise 6b
        raise NotImplementedError("exercise 6b: Scheduler._preempt is not written yet (exercises/scheduler.py)")
