"""
The engine: a Hugging Face model served with automatic prefix caching over the allocator's
blocks. Its modules, each with one role, in reading order (the README's table lists them):
the model's files and loader, the prompt, the KV pool, the outputs and the request, the
sampler, the thread policy, stage 7's one-request path, then stage 8's scheduler, step
budget, attention, graphs, model runner, batch runner and loop, and llm_engine.py, the
Engine every caller uses.

    from engine import Engine

Engine and the names beside it are loaded when first asked for, so that importing one
torch-free module of the package (engine.prompts, engine.model_files) loads no torch.
"""

import importlib

# The names `from engine import ...` gives, and the module that defines each.
EXPORTS = {
    "Engine": "engine.llm_engine", "EngineConfig": "engine.llm_engine", "EngineClosedError": "engine.llm_engine",
    "DEFAULT_KV_MEMORY_GB": "engine.llm_engine", "DEFAULT_MAX_NUM_SEQS": "engine.llm_engine",
    "SamplingParams": "engine.request", "Generation": "engine.outputs", "StreamEvent": "engine.outputs",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS": "engine.scheduler", "DEFAULT_TARGET_STEP_MS": "engine.step_budget",
}
__all__ = list(EXPORTS)


def __getattr__(name: str):
    if name not in EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(EXPORTS[name]), name)
