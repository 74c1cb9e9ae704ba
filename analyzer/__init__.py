"""
The workload analyzer: how much would prefix caching save on your own traffic, and how big
must the pool be? A request log read, tokenized and replayed through the allocator, offline,
on a CPU, without torch:

    python prefix_caching.py --analyze LOG        prefix_caching.py calls workload_analyzer.main
    python -m analyzer.request_logs --out DIR     the example logs of lessons/data/

Read allocator/prefix_caching.py (the allocator it replays through) and engine/prompts.py (what a prompt may
be, tokenized as the engine does) first; then, in this order, each file importing only
those above it (tests/project/test_layers.py checks it):

    request_logs.py       a request log read into prompts (OpenAI request bodies, ShareGPT
                          conversations), and example logs shaped like the article's workloads
    caching_models.py     three servers' prefix caches replayed request after request: vLLM's
                          block pool (the allocator's steps, fast), SGLang's radix tree
    llama_slots.py        the third, llama.cpp's: its slots, the KV cells they share, and its
                          prompt cache
    kv_memory.py          the memory to buy: a model's KV shape, bytes per block as vLLM
                          counts them, the flags of vLLM, SGLang and llama.cpp
    fleet.py              a fleet behind SGLang's router (sglang-router 0.3.2): the replica it
                          picks for each request, from the request's text (--replicas, --router)
    vllm_requests.py      vLLM's rewrites of a chat request before its chat template renders
                          it, which --like vllm applies
    log_replay.py         a log tokenized as it streams and replayed through the allocator:
                          hit rate vs pool size, the working set
    fleet_replay.py       a fleet's replicas replayed side by side, one request at a time or
                          with requests in flight on one clock (--in-flight)
    workload_analyzer.py  the command: the curve and the working set reported, the prefixes
                          behind the hits, warnings, a fleet's prediction

Nothing here imports torch (tests/project/test_layers.py checks that too): a log needs a tokenizer
(engine/model_files.py), never the weights, so the analyzer never waits for torch to load. Of the
engine it reads the tokenizer's files, and fleet_replay.py runs its scheduler (engine/scheduler.py,
pure Python over the allocator, like the allocator itself), never a model.
"""
