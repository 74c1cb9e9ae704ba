"""
Stage 7's engine: one request at a time, its cached prefix gathered into past_key_values.

Read allocator/prefix_caching.py (the allocator) and engine/kv_pool.py (the memory its block ids name) first.
A request, from prompt to reply:

    allocate_with_prefix   which leading blocks are cached? take them, and new blocks for the rest
    gather                 copy the hit blocks' K/V from the pool into a fresh DynamicCache
                           (on a GPU into fixed buffers instead: engine/fixed_past.py)
    forward                run the model on the uncached suffix only
    write                  copy the suffix's new K/V into the request's blocks
    sample                 the first token: time to first token (TTFT) ends here
    decode                 one token at a time: append_token, forward, write its slot, sample
    free                   the blocks go back to the pool, still cached

A sampled token goes to the allocator only when its K/V is about to be computed, so the
last token of a reply never does: no cached block ever holds a slot nobody wrote.

This is the lesson's path, run by name: stage 7 and the demo (`python allocator/prefix_caching.py
--demo`) call generate (below) over an Engine's parts, engine.parts. The Engine itself runs
every caller's requests in its engine loop (engine/engine_loop.py), many in one forward pass
(engine/batch_engine.py); both take the same EngineParts (section 1), the Engine's model, pool and
locks, and nothing else of it, so the two share one pool and its cache.

    1. the parts        EngineParts: what a request runs on
    2. one request      forward, run_request, generate
    3. the oracle       greedy_reference: what plain model.generate gives, to check every path against

References: vLLM v1 (vllm/v1/worker/gpu_model_runner.py, vllm/v1/core/kv_cache_manager.py);
transformers' DynamicCache (past_key_values).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from allocator import OutOfBlocksError, PrefixCachingAllocator
from engine.cpu_threads import GpuClock, ThreadChooser, one_pass, synchronize
from engine.kv_pool import PagedKVPool
from engine.outputs import Generation, ReplyBuilder, StreamEvent
from engine.request import SamplingParams
from engine.sampling import sample

from transformers import Cache

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# -----------------------------------------------------------------------------
# 1. The parts


@dataclass(frozen=True)
class EngineParts:
    """What a request runs on: the parts engine/llm_engine.py's Engine builds once and hands to
    run_request (below) and to engine/batch_engine.py's BatchRunner, instead of the whole Engine.

        model           the Hugging Face causal LM every forward pass runs
        tokenizer       turns sampled tokens into the reply's text (outputs.ReplyBuilder)
        stop_token_ids  tokens that end a reply with finish_reason "stop" (the model's EOS)
        allocator       the block bookkeeping (allocator/prefix_caching.py): block tables, hits, frees
        kv              the pool of K/V memory the allocator's block ids point into (engine/kv_pool.py)
        device          where the model and the pool live (model.device)
        lock            held for every step (a prefill, one decoded token, one batched step),
                        so the steps of callers in many threads never interleave inside one
        allocator_lock  held around the allocator's (and a scheduler's) bookkeeping only,
                        never across a forward pass: a status page reads them while a step runs
        threads         the ThreadChooser run_request's passes use on a CPU (engine/cpu_threads.py),
                        or None for torch's own count; a BatchRunner is given its own
        fixed           where a request's past_key_values live in buffers allocated once, so its
                        passes can be replayed as CUDA graphs (engine/fixed_past.FixedBuffers, on a
                        GPU); None: each request gathers a fresh DynamicCache
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    stop_token_ids: frozenset[int]
    allocator: PrefixCachingAllocator
    kv: PagedKVPool
    device: torch.device
    lock: threading.RLock
    allocator_lock: threading.RLock
    threads: ThreadChooser | None = None
    fixed: object | None = None  # engine/fixed_past.FixedBuffers, a layer above: not imported here


# -----------------------------------------------------------------------------
# 2. One request


class _Stopwatch:
    """Each phase of a prefill timed into `timing` (outputs.PrefillTiming): lap("gather") sets
    gather_ms to the milliseconds since the last lap. On a GPU work runs asynchronously, so
    each lap first waits for it to finish (otherwise the time lands in whichever lap waits
    next), and the phase's time on the GPU's own clock goes into timing.gpu_ms beside it."""
    def __init__(self, device, timing):
        self.device, self.timing = device, timing
        self.gpu = GpuClock(device)
        self.gpu.start()
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        gpu_ms = self.gpu.stop()
        synchronize(self.device)
        now = time.perf_counter()
        setattr(self.timing, f"{phase}_ms", (now - self.last) * 1e3)
        if gpu_ms is not None:
            self.timing.gpu_ms = (self.timing.gpu_ms or {}) | {phase: gpu_ms}
        self.gpu.start()
        self.last = now


def gather(parts: EngineParts, block_ids: list[int]):
    """The hit blocks' K/V as past_key_values: a fresh DynamicCache (PagedKVPool.gather), or,
    where the engine keeps fixed buffers (parts.fixed, on a GPU), those buffers filled with them
    (engine/fixed_past.py: the same request, its passes replayable as CUDA graphs)."""
    past = None if parts.fixed is None else parts.fixed.fill(block_ids)
    return past if past is not None else parts.kv.gather(block_ids, parts.model.config)


def forward(model, token_ids: list[int], past_key_values):
    """Logits of the last position. past_key_values grows in place by len(token_ids)
    tokens; position ids continue after what it already holds."""
    if not isinstance(past_key_values, Cache):  # fixed buffers (engine/fixed_past.py): their own padded pass
        return past_key_values.forward(model, token_ids)
    input_ids = torch.tensor([token_ids], device=model.device)
    output = model(input_ids=input_ids, past_key_values=past_key_values, use_cache=True, logits_to_keep=1)
    return output.logits[0, -1]


def step_pass(parts: EngineParts, num_new: int, num_cached: int):
    """The context of one step of a request: the cached K/V copied in (a prefill), the
    forward pass, the new K/V copied out to the pool. On a CPU every tensor operation of it
    runs with the thread count the chooser picks (engine/cpu_threads.py): the copies too, since
    beside busy programs a copy with all the cores waits for a core as a matrix product
    does. Steps about as big are timed against each other; a long prefill never probes."""
    kind = ("one request", num_new > 1, num_new.bit_length(), num_cached.bit_length())
    return one_pass(parts.threads, parts.device, kind, may_probe=num_new == 1)


def run_request(parts: EngineParts, request_id: str, prompt_ids: list[int], params: SamplingParams,
                cache_salt: str | None, arrival: float) -> Iterator[StreamEvent]:
    """Yield a StreamEvent per generated token of one request, run in the caller's thread.

    parts: what it runs on (EngineParts). It holds parts.lock for every step (a prefill, or
    one decoded token) and parts.allocator_lock around the allocator's bookkeeping only.
    """
    alloc, kv, model = parts.allocator, parts.kv, parts.model
    block_size = alloc.block_size
    reply = Generation(request_id, prompt_tokens=len(prompt_ids))
    builder = ReplyBuilder(reply, parts.tokenizer, parts.stop_token_ids, params.stop, params.max_tokens)
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    allocated = False
    num_computed = 0  # tokens whose K/V are in the pool
    try:
        # Allocation and prefill are one step, under one hold of the lock. allocate_with_prefix
        # caches the prompt's full blocks at once; if the lock were let go before their K/V
        # is written, another request could hit them and read slots nobody wrote yet.
        with parts.lock, torch.inference_mode():
            clock = _Stopwatch(model.device, reply.prefill)
            with parts.allocator_lock:
                try:
                    num_cached, _ = alloc.allocate_with_prefix(request_id, prompt_ids, cache_salt=cache_salt)
                except OutOfBlocksError as err:
                    raise OutOfBlocksError(f"{err} (num_blocks / --num-blocks). Now: {kv}") from err
                table = list(alloc.block_tables[request_id])
            allocated = True
            reply.cached_tokens = num_computed = num_cached
            clock.lap("lookup")  # reply.prefill.lookup_ms, and the others below
            with step_pass(parts, len(prompt_ids) - num_cached, num_cached):
                past_key_values = gather(parts, table[: num_cached // block_size])
                clock.lap("gather")
                logits = forward(model, prompt_ids[num_cached:], past_key_values)
                clock.lap("forward")
                kv.write(past_key_values, table, num_cached, len(prompt_ids))
                num_computed = len(prompt_ids)
                clock.lap("write")
            token = sample(logits, params, generator)
            clock.lap("sample")
        reply.ttft_ms = (time.perf_counter() - arrival) * 1e3

        while True:
            text, finish_reason = builder.add(token)
            if finish_reason:
                break
            yield reply.event(token, text)
            with parts.lock, torch.inference_mode():
                with parts.allocator_lock:
                    alloc.append_token(request_id, token)  # its K/V is computed right below
                    table = list(alloc.block_tables[request_id])
                with step_pass(parts, 1, num_computed):
                    logits = forward(model, [token], past_key_values)
                    kv.write(past_key_values, table, num_computed, num_computed + 1)
                num_computed += 1
                token = sample(logits, params, generator)
    finally:
        if allocated:
            with parts.allocator_lock:
                # Normally every token is computed by now; after a failure, free un-caches
                # the blocks whose slots were never written.
                alloc.free(request_id, num_computed_tokens=num_computed)
    # The last event comes after the free, so whoever sees finish_reason sees the pool whole.
    reply.total_ms = (time.perf_counter() - arrival) * 1e3
    yield reply.event(token, text)


def generate(parts: EngineParts, request_id: str, prompt_ids: list[int], params: SamplingParams,
             cache_salt: str | None = None) -> Generation:
    """run_request to its end, timed from this call: the reply's Generation. What stage 7
    and the demo run, over an Engine's checked parts (engine.parts, engine.tokenize):

        reply = generate(engine.parts, "q1", engine.tokenize(prompt), SamplingParams(max_tokens=48))
    """
    for event in run_request(parts, request_id, prompt_ids, params, cache_salt, time.perf_counter()):
        pass
    return event.generation


# -----------------------------------------------------------------------------
# 3. The oracle


def greedy_reference(model, prompt_ids: list[int], max_tokens: int,
                     stop_token_ids: frozenset[int] | None = None) -> list[int]:
    """What plain model.generate replies, greedy, on the whole prompt, with no cache across
    requests: the oracle every path of the engine is checked against (the lessons, the tests,
    the GPU check), on the model's own device. stop_token_ids: where the engine stops
    (EngineParts.stop_token_ids; the stop token kept, as the engine keeps it); None: where the
    model's generation_config stops."""
    input_ids = torch.tensor([prompt_ids], device=model.device)
    stops = {} if stop_token_ids is None else {"eos_token_id": sorted(stop_token_ids)}
    pad = model.generation_config.pad_token_id
    if pad is None and stop_token_ids:
        pad = min(stop_token_ids)
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_tokens, pad_token_id=pad, **stops)
    return out[0, len(prompt_ids):].tolist()
