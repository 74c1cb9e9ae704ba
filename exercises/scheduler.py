"""
Exercise 6: one step of the scheduler: decodes, preemption, admission (stage 8).

Everything but the two methods below comes from scheduler.py (Request, ScheduledRequest,
StepPlan, the waiting queue and the running list, add, finish). The allocator is
prefix_caching's: it has the two calls a scheduler needs that exercises 2 and 4 left out,
peek (how many prompt tokens would hit, changing nothing) and append_tokens (more tokens for
a running request: new blocks when the last one fills, each block cached as it fills;
OutOfBlocksError, changing nothing, when too few are free).

Worked example: 4 blocks of 4 tokens; a has 8 tokens, b has a's first 4 and 3 of its own.
    step 1  admit a: blocks [0, 1]. admit b: it hits block 0 (cached the moment a got it,
            though a computes it in this very step) and takes block 2.  plan a 0-8, b 4-7
    step 2  a decodes token 8: block 1 is full, a takes block 3.
            b decodes token 7 into block 2.                              plan a 8-9, b 7-8
    step 3  a decodes token 9 into block 3. b's token 8 needs a new block and none is
            free: preempt the most recently admitted, b itself. Block 2 is freed (full, so
            still cached), block 0 stays with a, and b goes back to the front of the
            waiting queue: it tries again next step.                     plan a 9-10

Finish line:
    EXERCISE_IMPL=starter python -m pytest tests/exercises/test_ex6_schedule.py
replays this example, then breaks each rule below in turn.
"""

import scheduler
from prefix_caching import OutOfBlocksError
from scheduler import RUNNING, WAITING, Request, ScheduledRequest, StepPlan


class Scheduler(scheduler.Scheduler):
    def schedule(self) -> StepPlan:
        """Plan one step: StepPlan(scheduled, preempted), both lists in the order things happen.

        The step may compute self.max_num_batched_tokens tokens (the budget); chunked
        prefill is always on here (the reference's enable_chunked_prefill=True).
          1. running Each running request, in order, while budget is left. n = its
                     num_computed_tokens, end = min(len(token_ids), n + budget left): a request
                     decoding gets 1 token (the one it sampled last step), one still prefilling
                     its next chunk. self.allocator.append_tokens(its id, token_ids[n:end])
                     gives those tokens slots; schedule ScheduledRequest(request, n, end). On
                     OutOfBlocksError, pop the LAST running request (the most recently
                     admitted), self._preempt it, and retry the same request, unless it was
                     the one preempted.
          2. admit   Then, while the waiting queue is not empty, fewer than self.max_num_seqs
                     run and budget is left, look at the request at its front. Stop if this step
                     preempted anyone: the pool was just too small. hit = peek(token_ids,
                     cache_salt); it computes its uncached tokens, len(token_ids) - hit, at most
                     the budget left (the rest are later chunks). allocate_with_prefix(its id,
                     token_ids[:hit + that many], cache_salt): slots for this step's tokens only,
                     so no block is cached before the step that writes it. It checks the room
                     after the prefix hit and raises OutOfBlocksError changing nothing: stop
                     then. Stop means stop, not skip: no request overtakes an earlier one.
                     Admitted: it leaves the waiting queue for the end of self.running, its
                     status is RUNNING, its num_computed_tokens the hit; at its first admission
                     only, admitted = True and num_cached_tokens = the hit (what its client is
                     told). Schedule tokens [hit, hit + that many).
        """
        # TODO exercise 6a
        raise NotImplementedError("exercise 6a: Scheduler.schedule is not written yet (exercises/scheduler.py)")

    def _preempt(self, request: Request) -> None:
        """Recompute preemption, for a request already popped from self.running.

        Free its blocks (allocator.free: last block first; its full blocks keep their hash,
        so it finds most of its tokens again when it comes back). It is WAITING again with
        num_computed_tokens 0; count the preemption (request.num_preemptions and
        self.num_preemptions). Then it goes to the FRONT of self.waiting: it arrived before
        every request still waiting.
        """
        # TODO exercise 6b
        raise NotImplementedError("exercise 6b: Scheduler._preempt is not written yet (exercises/scheduler.py)")
