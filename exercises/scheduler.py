"""
Exercise 6: one step of the scheduler: decodes, shares, preemption, admission (stage 8).

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

and it reads self.allocator.block_size, the tokens of one block.

allocate_with_prefix and append_tokens raise OutOfBlocksError, changing nothing, when too
few blocks are free.

(engine/scheduler.py's answer also keeps each request's block hashes on it, so a request waiting at
the head of a full pool is not hashed again every step: request.block_hashes =
allocator.hash_blocks(request.token_ids, request.cache_salt, request.block_hashes), then
block_hashes=request.block_hashes to peek and allocate_with_prefix. Optional here: the plans
and the pool come out the same either way, and that is what is graded. The same goes for
"waiting for its hit" below: compare tokens, or compare block hashes; both give the same plans.)

The rules a step keeps (vLLM v1's Scheduler.schedule, with Sarathi-Serve's stall-free batching;
stage 8 shows them at work):
  - Budget: a step computes at most `budget` tokens (max_num_batched_tokens, or less when
    schedule is given one). Every token computed counts: a decode's one, a chunk's, a resumed
    request's recomputed ones. Cached tokens cost nothing.
  - Who first: requests already running come before new ones, in the order they were
    admitted. A decoding one takes 1 token (the one it sampled last step); one still
    prefilling (request.num_prefill_left > 0: a prompt, or a resumed request's tokens, that
    comes in chunks) takes its share (below), at most what the budget has left; a share of
    0 schedules nothing for it this step. Then waiting requests are admitted in arrival
    order, each computing its uncached tokens, len(token_ids) - its hit, up to the budget
    left (the rest in later steps: chunked prefill), while max_num_seqs and the pool allow.
    The first that does not fit stops admission: none overtakes an earlier one, except one
    waiting for its hit (below). At most max_num_seqs run at once.
  - Shares, worked out before anyone gets a token. The tokens the decodes leave (the budget
    less 1 for each running request that is decoding, never below 0) are shared between the
    running requests still prefilling, each needing len(token_ids) - num_computed_tokens,
    and the waiting requests that could be admitted: of those not waiting for a hit (below),
    the first max_num_seqs - len(self.running) in the queue, each needing len(token_ids) -
    peek(token_ids, cache_salt), each listed only while fewer needs than tokens are listed
    (so each could have one). Smallest need first, each gets the smaller of its need and an
    equal share, rounded up, of the tokens still left among those still to serve, so what a
    small need leaves goes to the larger ones. Ties keep the order listed: running requests
    in admission order, then waiting ones in queue order. Example, 10 tokens; long (running)
    needs 20, short (waiting) 2, mid (running) 7:
        short  min(2, ceil(10 / 3)) = 2        8 tokens left for 2
        mid    min(7, ceil(8 / 2))  = 4        4 tokens left for 1
        long   min(20, ceil(4 / 1)) = 4
    Only the running requests' shares are used (long 4, mid 4); the waiting ones are then
    admitted as above, with whatever budget is left, each hit looked up again as its turn
    comes (a chunk of this step may have filled blocks it hits). Alone, a prompt's share is
    all the decodes leave; a short request that arrives behind a long prompt is prefilled
    whole in the next step, beside the long prompt's next chunk.
  - Waiting for its hit: a waiting request whose next block (the first it does not hit) is
    one a prompt still prefilling has yet to compute waits for that hit rather than compute
    the shared prefix a second time. It keeps its place, and admission goes on with the
    requests behind it. In tokens: with hit = peek(w.token_ids, w.cache_salt) and end = hit
    + block_size, waiting request w waits when end <= len(w.token_ids) (that block is full)
    and a request r that was running and still prefilling when the step began (not one
    admitted in this step) has the same cache_salt, the same first `end` tokens, and
    r.num_computed_tokens < end (schedule never moves num_computed_tokens: the engine does,
    after the step). Check it twice: when the shares are worked out (one that waits is not
    counted) and when its turn to be admitted comes. Only w's hit changes between the two,
    looked up again: if a chunk of this step filled the block w waited for, w hits it now and
    is admitted in this very step, unless its next block is also still to compute. (r's
    num_computed_tokens has not moved, so a block r fills in this step is still one r has
    yet to compute: if w cannot hit it, as when it is w's last block and all of w is cached,
    since a hit always leaves a token to compute, w waits until the next step.)
    With block hashes: w.block_hashes[hit // block_size] is one of
    r.block_hashes[r.num_computed_tokens // block_size:].
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

Worked example 1, a hit and a preemption: 4 blocks of 4 tokens; a has 8 tokens, b has a's
first 4 and 3 of its own.
    step 1  plan a 0-8, b 4-7    a gets blocks [0, 1]; b hits block 0 (cached the moment a
                                 got it, though a computes it in this very step), gets 2
    step 2  plan a 8-9, b 7-8    both decode: a's token 8 starts block 3, b's token 7 fills 2
    step 3  plan a 9-10          b's token 8 needs a fifth block: b, admitted last, is
                                 preempted; block 2 is freed (still cached), block 0 stays
                                 with a, b waits at the front of the queue for the next step
    step 4  plan a 10-11         the pool is still full: b waits (a frees nothing by decoding)

Worked example 2, shares and a wait: blocks of 4 tokens, a budget of 8, blocks to spare.
long has 19 tokens; after step 1, twin (long's first 16 tokens, then 2 of its own) and then
small (2 tokens) arrive.
    step 1  plan long 0-8        long is admitted with the whole budget: its first chunk
    step 2  plan long 8-14,      twin hits long's tokens 0-7; its next block, tokens 8-11,
                 small 0-2       long has yet to compute: twin waits, and is not counted.
                                 long needs 11 and small 2: small takes 2 (under its equal
                                 share of 4), long the 6 left. long's chunk fills tokens
                                 8-11, so at admission twin hits 12 tokens, but its next
                                 block, 12-15, is still to compute: twin waits again, and
                                 small, behind it, is admitted
    step 3  plan long 14-19,     small decodes (1); long needs 5 of the 7 left (twin waits
                 small 2-3,      for tokens 12-15, and is not counted); long's chunk fills
                 twin 16-18      them, so at admission twin hits 16 tokens and its next
                                 block (16-17) is not full: it is admitted, and computes
                                 only its own 2 tokens, with the 2 left

Finish line:
    EXERCISE_IMPL=starter python -m pytest tests/exercises/test_ex6_schedule.py
replays these examples, then breaks each rule above in turn, then runs random scripts of
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
