"""The process a student's exercise files run in while the tests grade them.

    python -I tests/exercises/child.py MODE EXERCISE_DIR ROOT SCRATCH

The grader (grading.py, in the pytest process) starts this script and sends it one JSON
object a line: build an allocator, call allocate_with_prefix, gather these blocks, plan a
step. It answers each with plain data (ints, lists, strings, bytes as hex, tensors as raw
bytes), which the grader compares with the reference's answers in its own process. This
process grades nothing: it runs the code and reports what the code did.

In starter mode (MODE "starter") the student's files are loaded from EXERCISE_DIR under the
names exercises.<file>, after two locks:
  - the reference modules (the .py files of ROOT: prefix_caching, kv_pool, scheduler, ...)
    and the tests cannot be imported: their import fails, saying why;
  - an audit hook refuses the plain ways to open a file of ROOT outside the exercises and
    the installed packages (the reference's source, the tests: open, io.open, os.open by
    path) and to start a process;
  - the same hook refuses to write, create, move or delete a file anywhere but in
    EXERCISE_DIR and SCRATCH, an empty folder the grader made for this child (its home, its
    temporary folder and its working directory) and removes when it ends: a .pth or a
    sitecustomize.py in site-packages, a file in the home, would outlive the run and change
    every later one;
  - the student's code runs on a thread of its own (Worker), every call from the same loop,
    and the hook refuses the graded files the ways to this process's other frames and to
    the trace (sys._getframe, a traceback's frame, sys._current_frames, gc's object lists,
    sys.settrace): a call the grader times cannot be told from another by where it came from.
These stop a casual import or read, not a determined reader: other ways to reach a file of
the disk stay open in any Python process (exercises/README.md says so, and what applies).
In reference mode the same requests run the reference modules, so CI grades the grader.
The student's code can rewrite anything in this process, this file included; none of it
reaches the grader, which trusts nothing here but the answers.
"""

import base64
import builtins
import importlib
import itertools
import json
import os
import queue
import sys
import threading
import time
import traceback
import types
from collections import Counter

MODE, EXERCISE_DIR, ROOT, SCRATCH = sys.argv[1], *(os.path.realpath(arg) for arg in sys.argv[2:5])
REFERENCE = {"block_hash": "allocator.prefix_caching", "allocator": "allocator.prefix_caching",
             "free_queue": "allocator.prefix_caching", "gather_kv": "engine.kv_pool", "scheduler": "engine.scheduler"}
# The reference's modules and packages (every .py file and package of ROOT but exercises/), and the tests.
TOP_LEVEL = ({name[:-3] for name in os.listdir(ROOT) if name.endswith(".py")}
             | {name for name in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, name, "__init__.py"))}
             | {"tests", "lessons", "grading", "twins", "conftest"}) - {"exercises"}
PROTOCOL = os.fdopen(os.dup(1), "w")  # the answers; print() and the student's output go to stderr
os.dup2(2, 1)
sys.dont_write_bytecode = True

# --- the locks -------------------------------------------------------------------------------


class ReferenceRefused:
    """A meta path finder that refuses the reference modules and the tests by name."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in TOP_LEVEL:
            raise ImportError(f"`import {name}` is refused while your exercises are graded: they run in a process "
                              "where the reference and the tests cannot be imported, so the code graded is yours "
                              "(exercises/README.md)")
        return None


def allowed_dirs() -> list[str]:
    dirs = [EXERCISE_DIR, os.path.join(ROOT, "exercises"), sys.prefix, sys.base_prefix]
    dirs += [p for p in sys.path if "site-packages" in p]
    return [os.path.realpath(d) for d in dirs]


ALLOWED = allowed_dirs()
PROCESS_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                  "pty.spawn")


def inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + os.sep)


# What may write: an open for writing, and the events that create, move or delete a path.
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.truncate": (0,), "os.chmod": (0,),
               "os.chown": (0,), "os.utime": (0,), "os.rename": (0, 1), "os.link": (1,), "os.symlink": (1,),
               "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (0, 1)}
WRITABLE = [EXERCISE_DIR, SCRATCH]


def written(event: str, args: tuple) -> list:
    """The paths `event` would write (create, change, move or delete)."""
    if event == "open":
        mode, flags = args[1], args[2]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & WRITE_FLAGS)
        return [args[0]] if writes else []
    return [args[i] for i in PATH_EVENTS.get(event, ()) if i < len(args)]


# What reads the stack, the objects of the process or the trace: refused when a graded file
# asks (the standard library's own uses, namedtuple's or logging's, go on). The graded code runs
# on a thread of its own (graded()) whose stack is the same in every call, so these could only
# reach this process's other frames: the request being answered.
STACK_EVENTS = ("sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile", "gc.get_objects",
                "gc.get_referrers", "gc.get_referents")
FRAME_ATTRIBUTES = ("tb_frame", "gi_frame", "cr_frame", "ag_frame")
AUDITING = threading.local()  # set while audit() looks at its caller, whose look is an event too


def asked_by_a_graded_file() -> bool:
    if getattr(AUDITING, "on", False):
        return False
    AUDITING.on = True
    try:
        caller = sys._getframe(2)  # 0 is this function, 1 audit(), 2 the code that raised the event
        return inside(os.path.realpath(caller.f_code.co_filename), EXERCISE_DIR)
    finally:
        AUDITING.on = False


def audit(event: str, args: tuple) -> None:
    stack = event in STACK_EVENTS or (event in ("object.__getattr__", "object.__setattr__")
                                      and args[1] in FRAME_ATTRIBUTES)
    if stack and asked_by_a_graded_file():
        raise PermissionError(f"{event}{' ' + args[1] if event.startswith('object.') else ''} is refused while your "
                              "exercises are graded: your code is graded on what it returns, not on where it is "
                              "called from (exercises/README.md)")
    for path in written(event, args):
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(path))
            if not any(inside(path, folder) for folder in WRITABLE):
                raise PermissionError(f"writing {path} is refused while your exercises are graded: nothing your "
                                      "code does may outlive its run, except in your own folder (exercises/README.md)")
    if event in PROCESS_EVENTS:
        raise PermissionError(f"{event} is refused while your exercises are graded: your code runs alone, "
                              "in a process that starts no other (exercises/README.md)")
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if inside(path, ROOT) and not any(inside(path, folder) for folder in ALLOWED):
            raise PermissionError(f"opening {path} is refused while your exercises are graded: only the files of "
                                  "exercises/ are yours (exercises/README.md)")


def lock_out_the_reference() -> None:
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != ROOT]
    sys.meta_path.insert(0, ReferenceRefused)
    sys.addaudithook(audit)


def load(exercise: str) -> types.ModuleType:
    """The module graded for `exercise`: the reference's, or exercises.<exercise> from EXERCISE_DIR,
    imported on the graded code's thread."""
    if MODE == "reference":
        return graded(importlib.import_module, REFERENCE[exercise])
    return graded(importlib.import_module, f"exercises.{exercise}")


# --- the graded code's thread ------------------------------------------------------------------


class Worker:
    """The one thread that runs the graded code. Every call a test makes of it, timed by the
    grader or not, one of fifty or alone, starts from this same loop with the same locals, and
    in exercise 5 under the same trace (TRACE): nothing on its stack says why it was called.
    The requests being answered, with their sizes and counts, live on the main thread, whose
    frames the audit hook keeps from the graded file."""

    def __init__(self):
        self.jobs, self.done = queue.SimpleQueue(), queue.SimpleQueue()
        self.thread = threading.Thread(target=self.serve, name="graded", daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while True:
            function, args, kwargs = self.jobs.get()
            sys.settrace(TRACE[0])
            try:
                result = (True, function(*args, **kwargs))
            except BaseException as err:  # noqa: BLE001  (raised again on the main thread)
                result = (False, err)
            finally:
                sys.settrace(None)
            self.done.put(result)

    def __call__(self, function, *args, **kwargs):
        if threading.current_thread() is self.thread:  # a call of this module's already on the thread
            return function(*args, **kwargs)
        self.jobs.put((function, args, kwargs))
        ok, value = self.done.get()
        if not ok:
            raise value
        return value


TRACE = [None]  # the trace every graded call runs under: exercise 5's costly_lines, else none
graded = Worker()


# --- plain data in and out ---------------------------------------------------------------------


def encode(value):
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, (list, tuple)):
        if all(type(v) is int or v is None for v in value):  # a queue's 100,000 ids or links: no call per id
            return list(value)
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if type(value).__name__ == "Tensor":
        return encode_tensor(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"$object": type(value).__name__}


def encode_tensor(tensor) -> dict:
    import torch

    tensor = tensor.detach().to("cpu").contiguous()
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    return {"$tensor": base64.b64encode(raw.numpy().tobytes()).decode(), "dtype": str(tensor.dtype).split(".")[-1],
            "shape": list(tensor.shape)}


def decode_tensor(value: dict):
    import torch

    dtype = getattr(torch, value["dtype"])
    raw = bytearray(base64.b64decode(value["$tensor"]))
    if dtype == torch.bfloat16:
        return torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16).reshape(value["shape"]).clone()
    return torch.frombuffer(raw, dtype=dtype).reshape(value["shape"]).clone()


def send(message: dict) -> None:
    PROTOCOL.write(json.dumps(message) + "\n")
    PROTOCOL.flush()


def ask(question: dict):
    """Ask the grader (the scheduler's allocator lives there); raise what it raised."""
    send({"ask": question})
    answer = json.loads(sys.stdin.readline())
    if "raise" in answer:
        kind, message = answer["raise"]["type"], answer["raise"]["message"]
        known = {"OutOfBlocksError": OBJECTS.get("OutOfBlocksError")}
        raise (known.get(kind) or getattr(builtins, kind, RuntimeError))(message)
    return answer["answer"]


# --- exercise 1: the block hash ----------------------------------------------------------------


def as_tokens(token_ids: list[int], kind: str | None):
    """The same ids as a Python list, a list of numpy ints or a numpy array."""
    if kind is None:
        return token_ids
    import numpy as np

    if kind == "numpy ints":
        return [np.int64(t) for t in token_ids]
    return np.array(token_ids, dtype=kind)


def keys_of(keys: list) -> tuple:
    """Extra keys as a tuple; a tagged key (a list in JSON) as a tuple too."""
    return tuple(tuple(k) if isinstance(k, list) else k for k in keys)


def parent_of(value):
    return None if value is None else bytes.fromhex(value)


def op_hash_block_tokens(parent, tokens, keys, numpy=None):
    return graded(load("block_hash").hash_block_tokens, parent_of(parent), as_tokens(tokens, numpy), keys_of(keys))


def op_compute_block_hashes(tokens, block_size, salt=None, keys=(), numpy=None):
    return graded(load("block_hash").compute_block_hashes, as_tokens(tokens, numpy), block_size, salt, keys_of(keys))


def op_calls_python_hash(tokens, keys, salt):
    """Run both functions with builtins.hash replaced: did either call it?"""
    module, called = load("block_hash"), []
    original = builtins.hash

    def spy(obj):
        called.append(type(obj).__name__)
        return original(obj)

    builtins.hash = spy
    try:
        graded(module.hash_block_tokens, None, tokens, tuple(keys))
        graded(module.compute_block_hashes, tokens, 4, salt, tuple(keys))
    finally:
        builtins.hash = original
    return called


# --- exercises 2 and 4: the allocator ----------------------------------------------------------


def holders(value) -> list:
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (list, tuple, set)):
        return list(value)
    return [value]


def hex_or_none(block_hash):
    if block_hash is None:
        return None
    return block_hash.hex() if isinstance(block_hash, bytes) else repr(block_hash)


def allocator_state(alloc) -> dict:
    return {
        "tables": {r: list(t) for r, t in alloc.block_tables.items()},
        "free": [b.block_id for b in alloc.free_queue],
        "ref_cnt": [b.ref_cnt for b in alloc.blocks],
        "hash": [hex_or_none(b.block_hash) for b in alloc.blocks],
        "tokens": [[int(t) for t in b.token_ids] for b in alloc.blocks],
        "cached": {hex_or_none(h): sorted(b.block_id for b in holders(v)) for h, v in alloc.cached_blocks.items()},
    }


def op_allocator_new(num_blocks, block_size, queue):
    module = load("allocator")
    original = module.FreeKVCacheBlockQueue
    if queue == "yours":
        module.FreeKVCacheBlockQueue = load("free_queue").FreeKVCacheBlockQueue
    try:
        return new_object(graded(module.PrefixCachingAllocator, num_blocks, block_size))
    finally:
        module.FreeKVCacheBlockQueue = original


def release(alloc, request_id):
    """Exercise 4's rule, for exercise 2's tests: ref counts down, last block first; a block
    that reaches 0 joins the tail of the free queue and keeps its hash and tokens."""
    for block_id in reversed(alloc.block_tables.pop(request_id)):
        block = alloc.blocks[block_id]
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            alloc.free_queue.append(block)
    getattr(alloc, "requests", {}).pop(request_id, None)


def evict(alloc, block) -> None:
    """Take `block` out of the cache map, whatever holds the blocks there, and drop its hash."""
    holding = alloc.cached_blocks[block.block_hash]
    if isinstance(holding, dict):
        left = {key: b for key, b in holding.items() if b is not block}
    elif isinstance(holding, (list, tuple, set)):
        left = type(holding)(b for b in holding if b is not block)
    else:
        left = None
    if left:
        alloc.cached_blocks[block.block_hash] = left
    else:
        del alloc.cached_blocks[block.block_hash]
    block.block_hash = None


def allocator_call(alloc, method: str, args: list):
    if method == "allocate_with_prefix":
        result = alloc.allocate_with_prefix(*args)
        return [int(result[0]), int(result[1])]
    if method == "free":
        return alloc.free(*args)
    if method == "release":
        return release(alloc, *args)
    if method == "set_tokens":  # the tests forge a block's content to play a hash collision
        block_id, tokens = args
        alloc.blocks[block_id].token_ids = list(tokens)
        return None
    if method == "evict":  # the tests evict one block of a chain, and keep the blocks after it
        return evict(alloc, alloc.blocks[args[0]])
    raise ValueError(f"no allocator call {method!r}")


def op_allocator_run(handle, calls):
    """Run (method, args) calls on an allocator built by allocator_new, one after the other;
    answer each call's result, up to the first that raises, whose error ends the answer. Every
    call of a test on an allocator runs here, one or forty, timed by the grader or not, and
    every answer is checked, and the allocator after them (allocator_state), against the
    reference's: a file cannot tell the timed calls apart by where it is called from."""
    alloc = OBJECTS[handle]
    answers = []
    for method, args in calls:
        try:
            answers.append({"result": graded(allocator_call, alloc, method, args)})
        except Exception as err:  # noqa: BLE001  (reported to the grader, which judges it)
            answers.append({"error": describe(err)})
            break
    return answers


def op_allocator_state(handle):
    return graded(allocator_state, OBJECTS[handle])


# --- exercise 3: the free queue ----------------------------------------------------------------


def queue_state(queue, blocks) -> dict:
    def link(block):
        return None if block is None else block.block_id

    return {"ids": queue.block_ids(), "len": len(queue), "prev_free": [link(b.prev_free) for b in blocks],
            "next_free": [link(b.next_free) for b in blocks]}


def block_class():
    return load_given().KVCacheBlock if MODE == "starter" else load("free_queue").KVCacheBlock


def op_queue_new(n, order=None):
    """A queue of blocks 0 to n-1, handed to the constructor in `order` (by id when None)."""
    module = load("free_queue")
    kind = block_class()
    blocks = [kind(i) for i in range(n)]
    given = blocks if order is None else [blocks[i] for i in order]
    return new_object((graded(module.FreeKVCacheBlockQueue, given), blocks))


def op_queue_run(handle, steps):
    """Run (method, block id or None) steps on a queue built by queue_new; answer each step's
    result (popleft's block id, else None), up to the first that raises, whose error ends the
    answer. Every call of a test on a queue runs here, one step or fifty, timed or not: the
    grader times some from its side and checks every answer, and the queue after them
    (queue_state), against the reference's, so a file cannot tell the timed calls apart by
    where it is called from, nor gain by doing so."""
    queue, blocks = OBJECTS[handle]
    answers = []
    for method, block in steps:
        try:
            got = graded(getattr(queue, method), *([] if block is None else [blocks[block]]))
        except Exception as err:  # noqa: BLE001  (reported to the grader, which judges it)
            answers.append({"error": describe(err)})
            break
        answers.append(None if got is None else getattr(got, "block_id", repr(got)))
    return answers


def op_queue_state(handle):
    queue, blocks = OBJECTS[handle]
    return graded(queue_state, queue, blocks)


def op_queue_cost(n, operation):
    """Link reads and block comparisons of one operation in the middle of a queue of n."""
    module = load("free_queue")
    counts = Counter()

    class CountingBlock(block_class()):
        def __getattribute__(self, name):
            if name in ("prev_free", "next_free"):
                counts["reads"] += 1
            return super().__getattribute__(name)

        def __eq__(self, other):
            counts["comparisons"] += 1
            return self is other

        __hash__ = object.__hash__

    blocks = [CountingBlock(i) for i in range(n)]
    queue = graded(module.FreeKVCacheBlockQueue, blocks)
    middle = blocks[n // 2]
    if operation in ("append", "appendleft"):
        graded(queue.remove, middle)
    counts.clear()
    graded(getattr(queue, operation), *([] if operation == "popleft" else [middle]))
    return dict(counts)


def op_queue_sizes(n):
    """The length of every sized attribute of a queue of n blocks."""
    return graded(queue_sizes, n)


def queue_sizes(n):
    module, kind = load("free_queue"), block_class()
    queue = module.FreeKVCacheBlockQueue([kind(i) for i in range(n)])
    return {name: [type(v).__name__, len(v)] for name, v in vars(queue).items()
            if hasattr(v, "__len__") and not isinstance(v, (str, bytes))}


# --- exercise 5: the gather --------------------------------------------------------------------


def make_pool(spec: dict, data):
    import torch

    module = load("gather_kv")
    dtype = getattr(torch, spec.pop("dtype", "float32"))
    pool = graded(module.PagedKVPool, **spec, dtype=dtype)
    if data == "numbered":
        pool.data.copy_(torch.arange(pool.data.numel(), dtype=pool.data.dtype).view_as(pool.data))
    elif data is not None:
        pool.data.copy_(decode_tensor(data))
    return pool


def config_of(spec: dict):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=spec["num_layers"], num_attention_heads=spec["num_kv_heads"],
                       num_key_value_heads=spec["num_kv_heads"], hidden_size=spec["num_kv_heads"] * spec["head_dim"])


def op_pool_new(spec, data=None):
    """A pool whose gathers the tests call (op_pool_gather): its data sent by the grader, or
    every number its own flat index (numbered) for the timed gathers, so that what a timed
    gather returned can be checked after it (op_last_gathered). Torch runs on one thread from
    here on: on a busy machine, a kernel split between threads waits for the other thread's
    core, and the timings would measure the machine, not the code."""
    import torch

    torch.set_num_threads(1)
    return new_object((make_pool(dict(spec), "numbered" if data is None else data), config_of(spec)))


def op_pool_gather(handle, block_ids, line_cost):
    """Gather from a pool built by pool_new; answer the tokens cached and the layers, and keep
    the cache for op_last_gathered. Every gather of the tests runs here, timed by the grader
    or not, and under the same trace, where each line of Python run outside the installed
    packages (the graded file's) costs `line_cost` seconds (costly_lines): a file cannot tell
    a timed gather from another, and what any gather returns is checked."""
    pool, config = OBJECTS[handle]
    if TRACE[0] is None:
        TRACE[0] = costly_lines(line_cost)
    LAST_GATHERED[handle] = cache = graded(pool.gather, block_ids, config)
    return [int(cache.get_seq_length()), len(cache.layers)]


LAST_GATHERED: dict = {}  # pool handle -> the cache its last gather returned


def op_last_gathered(handle):
    """What the pool's last gather returned, the very objects it returned: its type, the tokens
    it holds and each layer's keys and values."""
    cache = LAST_GATHERED.pop(handle)
    length = int(cache.get_seq_length())
    layers = [[layer.keys, layer.values] for layer in cache.layers] if length else []
    return {"type": type(cache).__name__, "length": length, "layers": layers}


def op_drop(handle):
    OBJECTS.pop(handle, None)
    LAST_GATHERED.pop(handle, None)


LIBRARIES = tuple(os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix})
GRADED_CODE: dict = {}  # code object: whether costly_lines makes its lines cost


def costly_lines(cost: float):
    """A trace function under which every line of Python outside the installed packages and
    the standard library (the graded file's) waits `cost` seconds. A vectorized gather runs the
    same few lines for 4 blocks as for 4,096, so its cost a block does not change; a loop over
    the blocks, of numpy's copies or torch's, whose few hundred nanoseconds a block are too
    close to what index_select spends on each id, runs a line or more a block and shows."""
    def line(frame, event, arg):
        if event == "line":
            end = time.perf_counter() + cost
            while time.perf_counter() < end:
                pass
        return line

    def call(frame, event, arg):
        code = frame.f_code
        if code not in GRADED_CODE:
            path = code.co_filename
            GRADED_CODE[code] = not (path.startswith("<frozen ") or os.path.realpath(path).startswith(LIBRARIES)
                                     or os.path.realpath(path) == os.path.realpath(__file__))
        return line if GRADED_CODE[code] else None

    return call


def counted_gather(ops, pool, block_ids, config) -> None:
    with ops:
        pool.gather(block_ids, config)


def op_gather_count(spec, block_ids_list):
    """The torch operations each gather runs, and the devices of the tensors they make."""
    from torch.overrides import TorchFunctionMode

    class Operations(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names, self.devices = Counter(), {}

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            self.names[name] += 1
            result = func(*args, **(kwargs or {}))
            if type(result).__name__ == "Tensor":
                self.devices.setdefault(name, set()).add(result.device.type)
            return result

    counted = []
    for block_ids in block_ids_list:
        pool = make_pool(dict(spec), None)
        config = config_of(spec)
        ops = Operations()
        graded(counted_gather, ops, pool, block_ids, config)
        counted.append({"names": dict(ops.names), "devices": {k: sorted(v) for k, v in ops.devices.items()}})
    return counted


# --- exercise 6: the scheduler -----------------------------------------------------------------


class RemoteAllocator:
    """The scheduler's allocator. It lives in the grader: every call is a question to it."""

    METHODS = ("peek", "hash_blocks", "allocate_with_prefix", "append_tokens", "append_token", "free", "num_tokens",
               "ref_count", "slot")
    VALUES = ("num_free_blocks", "num_blocks", "block_size", "block_tables", "num_blocks_in_use",
              "num_cached_blocks")

    def __init__(self, handle):
        self._handle = handle

    def __getattr__(self, name):
        if name in self.VALUES:
            return ask({"handle": self._handle, "value": name})
        if name not in self.METHODS:
            raise AttributeError(f"the allocator has no {name!r}: a scheduler uses {', '.join(self.METHODS)} and "
                                 f"reads {', '.join(self.VALUES)}")

        def call(*args, **kwargs):
            answer = ask({"handle": self._handle, "method": name, "args": encode(list(args)), "kwargs": encode(kwargs)})
            if name == "hash_blocks":  # block hashes travel as {"$bytes": hex}
                return [bytes.fromhex(h["$bytes"]) for h in answer]
            if name == "allocate_with_prefix":
                from exercises.given import Allocation

                return Allocation(*answer)
            return answer

        return call


def request_view(request) -> dict:
    return {"id": request.request_id, "status": request.status, "computed": request.num_computed_tokens,
            "cached": request.num_cached_tokens, "preemptions": request.num_preemptions,
            "admitted": request.admitted, "outputs": list(request.output_ids)}


def scheduler_state(s) -> dict:
    return {"running": [request_view(r) for r in s.running], "waiting": [request_view(r) for r in s.waiting],
            "num_preemptions": s.num_preemptions}


def op_scheduler_new(handle, options):
    module = load("scheduler")
    OBJECTS["OutOfBlocksError"] = getattr(module, "OutOfBlocksError", None) or load_given().OutOfBlocksError
    OBJECTS[handle] = graded(module.Scheduler, RemoteAllocator(handle), **options)
    return handle


def load_given():
    return importlib.import_module("exercises.given")


def op_scheduler_add(handle, request):
    kind = load_given().Request if MODE == "starter" else load("scheduler").Request
    graded(OBJECTS[handle].add, kind(**request))
    return graded(scheduler_state, OBJECTS[handle])


def op_scheduler_step(handle, budget, token):
    return graded(scheduler_step, OBJECTS[handle], budget, token)


def scheduler_step(s, budget, token):
    plan = s.schedule() if budget is None else s.schedule(budget)
    scheduled = [[r.request.request_id, r.start, r.end, bool(r.samples)] for r in plan.scheduled]
    for r in plan.scheduled:  # play the model: the tokens are computed, the last one samples
        r.request.num_computed_tokens = r.end
        if r.samples:
            r.request.append_output(token)
    return {"plan": scheduled, "preempted": [r.request_id for r in plan.preempted], "state": scheduler_state(s)}


def op_scheduler_finish(handle, request_id):
    return graded(scheduler_finish, OBJECTS[handle], request_id)


def scheduler_finish(s, request_id):
    s.finish(next(r for r in [*s.running, *s.waiting] if r.request_id == request_id))
    return scheduler_state(s)


# --- the loop ----------------------------------------------------------------------------------

OBJECTS: dict = {}
HANDLES = itertools.count(1)


def new_object(obj) -> int:
    handle = next(HANDLES)
    OBJECTS[handle] = obj
    return handle


def describe(err: BaseException) -> dict:
    trace = traceback.format_exception(err)
    return {"type": type(err).__name__, "message": str(err)[:2000], "trace": "".join(trace[-6:])[-3000:]}


def main() -> None:
    if MODE == "starter":
        package = types.ModuleType("exercises")
        package.__path__ = [EXERCISE_DIR, os.path.join(ROOT, "exercises")]
        sys.modules["exercises"] = package
        lock_out_the_reference()
    # else the reference's modules import as installed (setup.sh installs the course editable)
    operations = {name[3:]: f for name, f in globals().items() if name.startswith("op_")}
    send({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            send({"reply": encode(operations[request.pop("op")](**request))})
        except Exception as err:  # noqa: BLE001  (the grader judges it)
            send({"error": describe(err)})


if __name__ == "__main__":
    main()
