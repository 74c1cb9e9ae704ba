"""The exercises' twins: each object a test builds in the child (the student's code, or the
reference's), with its twin built from the reference in this process, every call run on both.

Read grading.py first: the child process, the inputs of a run, the timing of how the work
grows, and Twin (a remote object's history and its first difference). An exercise's tests
import its Remote* from here: 1 RemoteBlockHash, 2 and 4 RemoteAllocator, 3 RemoteQueue,
5 remote_pool_class, 6 RemoteScheduler.
"""

from __future__ import annotations

from grading import Child, Twin, decode, encode_tensor, outcome, raised, timed_call


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
        from allocator import Allocation

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

    def _link(self, side: str):
        other = self.owner.state[side][self.block_id]
        return None if other is None else self.owner.sentinel if other < 0 else self.owner.blocks[other]

    @property
    def prev_free(self):
        return self._link("prev_free")

    @property
    def next_free(self):
        return self._link("next_free")


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
    from engine import kv_pool
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
        from engine import scheduler

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
        from engine import scheduler

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
