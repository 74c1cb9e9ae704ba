"""Every lesson runs to the end and prints what lessons/README.md says it prints; the claims
the allocator lessons make are pinned here too."""

import doctest
import importlib
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LESSONS = ROOT / "lessons"

STAGES = sorted(LESSONS.glob("[0-9][0-9]_*.py"))
HELPERS = ["lessons.workloads", "lessons.radix_tree", "lessons.words", "lessons.models", "lessons.reading",
           "lessons.batch_views", "benchmarks.measure"]

# Flags a stage needs to run fast in the test suite (e.g. a tiny model); none means none.
FLAGS: dict[str, list[str]] = {
    "01_naive_prefill.py": ["--tiny"],
    "02_kv_cache.py": ["--tiny"],
    "07_real_model.py": ["--tiny"],
    "08_many_requests.py": ["--tiny"],
    "09_serving.py": ["--tiny"],
    "10_going_further.py": ["--tiny"],
}

# Sentences each stage must print (compared with white space folded, so line wraps do not matter).
EXPECTED_OUTPUT = {
    "01_naive_prefill.py": ["Every step recomputed the 39-token prompt from scratch",
                            "the model embedded 340 tokens in 8 passes (counted by a hook",
                            "runs the model over 636,750 tokens", "computing each token once would be 1,523"],
    "02_kv_cache.py": ["The same 8 tokens with and without the cache", "the cache ends at 46 = 39 + 8 - 1 tokens",
                       "the model embedded 46 tokens with the cache (the prompt once, then 1 a step) and 340 without",
                       "0.5 KiB per token"],
    "07_real_model.py": ["Exercise 5: exercises/gather_kv.py", "read it once exercise 5's tests pass",
                         "The system turn is 444 tokens with the chat template: 27 full blocks of 16 and 12 tokens over",
                         "so all 5 demo prompts agree on their first 447 tokens",
                         "The block of tokens 432-447 ends with the question's first token",
                         "│ 447 │ 27 x 16 = 432 │", "│ 448 │ 28 x 16 = 448 │",
                         "(cached_tokens=448) and ran the model on 14",
                         "│ tokens the model embedded (prompt + 23 decode steps) │ 485 │ 37 │",
                         "its layer-0 key in the cache equals the pool's: True",
                         "exactness ok: logits allclose to a full forward",
                         "exactness ok: the same 24 tokens as model.generate"],
    "08_many_requests.py": ["Exercise 6: exercises/scheduler.py", "read it once exercise 6's tests pass",
                            "the two excesses multiply to about 1, and cannot both be small",
                            "peek found [0, 0, 0, 0] cached tokens for the four prompts",
                            "bob, carol and dave each found 448 tokens in the pool: the blocks alice was computing "
                            "in that very step", "shared blocks 0-27: ref count 4 (alice, bob, carol, dave)",
                            "erin's prompt came in 2 chunks, in steps 2-3, each beside the four decodes",
                            "after step 2: 508 computed, 496 findable (31 blocks)",
                            "with chunking off a prompt is never cut into pieces",
                            "Every reply is the same as with chunking: 5 of 5",
                            "the same, shared prefix read", "what the contexts hold",
                            "shared_prefix_attention in engine/batch_attention.py does this for every layer",
                            "exactness ok: the same 16 tokens as model.generate on his prompt alone",
                            "recomputed 17 of their 465 tokens: 16 in blocks the others took while they waited, 0 in a "
                            "partial last block (never cached), and 1 the token each had sampled in its last step",
                            "same tokens as in the big pool of scenes 1-2: 4 of 4",
                            "The pool is whole again: 34 of 34 blocks free",
                            "in 16 forward passes instead of 128", "681 with it against 3,817 without",
                            "grouped by length they read 1,856 (their 1,852 tokens of context, each padded to the "
                            "longest of the four, 464)"],
    "09_serving.py": ["Read: serving/routes.py", "generate", "chat_completions", "Read: serving/requests.py",
                      "take_cache_salt", "tenant_of", '"prompt_tokens_details": {"cached_tokens": 448}',
                      "Without salts the right guess comes back with cached_tokens=208",
                      "With the salt derived from each key, the right guess gets cached_tokens=0",
                      "own key still hits her blocks (cached_tokens=208)",
                      "derives cache_salt from your API key"],
    "03_paged_blocks.py": ["a contiguous allocator would refuse it", "num_cached_tokens = 0",
                           "each request's last block first: r0's [0, 1, 2] went in as [2, 1, 0]"],
    "04_block_hashes.py": ["Exercise 1: exercises/block_hash.py", "read it once exercise 1's tests pass",
                           "differs only in word 6 of 12 ('rain' for 'leaves', in block 1) hits 4 tokens",
                           "hits 0 tokens. Tenant a does the same: 12", "== salted[1] is True",
                           "'A gentle breeze stirred' at the start of a prompt is always 05dc53be"],
    "05_ref_counts.py": ["Exercise 2: exercises/allocator.py", "read it once exercise 2's tests pass",
                         "Blocks in use: 12 shared vs 24", "erin hits 16 tokens", "hits 12, not 16"],
    "06_free_queue_lru.py": ["Exercise 3: exercises/free_queue.py", "Exercise 4: exercises/allocator.py",
                             "read it once exercise 4's tests pass", "matches the design doc",
                             "free_uncached_first=False: request 2's blocks [0, 1, 2, 7, 8, 9, 4, 3], evictions 1",
                             "free_uncached_first=True : request 2's blocks [0, 1, 2, 6, 4, 7, 8, 9], evictions 0"],
    "10_going_further.py": ["free in reverse: the same", "multi_turn, blocks of 16, sized for Llama-3.1-8B",
                            "16 requests of 4,096 tokens hold 8 GiB of their own", "--num-gpu-blocks-override 4490",
                            "│ chatbot │ 300 │ 164,203 │ 93% │ 37 blocks │ 92-97% │",
                            "│ multi_turn │ 154 │ 140,726 │ 65% │ 394 blocks │ 80-95% │",
                            "│ rag │ 50 │ 117,289 │ 38% │ 2,717 blocks │ 25-40% │",
                            "│ code_completion │ 60 │ 126,357 │ 28% │ 3,862 blocks │ 15-35% │",
                            "│ batch_summaries │ 80 │ 51,685 │ 10% │ 62 blocks │ 8-15% │",
                            "│ random_prompts │ 80 │ 28,119 │ 0% │ 39 blocks │ 0-2% │",
                            "150 prompts start alike but for numbers, first at character 32",
                            "about 512 tokens are computed again per request",
                            "the probe knows nothing else about it", "cold (a fresh first line) vs warm",
                            "the side channel: tenant A sent the letter from Dana Whitfield",
                            "exists there only with VLLM_SERVER_DEV_MODE=1",
                            "his first guess (Sam Ortega) finds 0: tenant A's blocks are named with her salt",
                            "His later guesses find 16: the blocks before the name that his own first guess cached",
                            "Hit rate: round_robin 41%, cache_aware 67%", "Affinity won; the other replica idled",
                            "round_robin: each replica's working set (the analyzer's replay of the requests it got) "
                            "96 and 84 blocks of 16"],
}
# ... and must never print.
FORBIDDEN_OUTPUT = {"04_block_hashes.py": ["100-200 ns per token for SHA256.",  # an old figure, quoted as current
                                           "_encode(parent, array("],  # exercise 1's answer, held back
                    "05_ref_counts.py": ["self.touch(hits)"],  # exercise 2's
                    "06_free_queue_lru.py": ["differs from the doc", "block.prev_free.next_free = block.next_free",
                                             "for block_id in reversed(table)"],  # exercises 3 and 4's
                    "07_real_model.py": ["DynamicCache([(kv[layer, 0], kv[layer, 1])"],  # exercise 5's
                    "08_many_requests.py": ["victim = self.running.pop()"]}  # exercise 6's


# What running each stage costs (tests/conftest.py): the model stages run the tiny model, stage 10
# behind SGLang's router; every one is an interpreter of its own.
STAGE_COSTS = {"01_naive_prefill.py": ["model"], "02_kv_cache.py": ["model"], "07_real_model.py": ["model"],
               "08_many_requests.py": ["model"], "09_serving.py": ["model", "server"],
               "10_going_further.py": ["model", "server", "router"]}


def run_stage(path: Path) -> str:
    env = {**os.environ, "COLUMNS": "160"}
    result = subprocess.run(
        [sys.executable, str(path), *FLAGS.get(path.name, [])],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )
    assert result.returncode == 0, f"{path.name} failed:\n{result.stderr[-3000:]}"
    return " ".join(result.stdout.split())


@pytest.mark.parametrize("path", [pytest.param(path, marks=[pytest.mark.model] if "model" in STAGE_COSTS.get(path.name, [])
                                                else []) for path in STAGES], ids=lambda path: path.name)
def test_stage_answers_help_with_its_usage_and_runs_nothing(path, monkeypatch, capsys):
    # In this process, as `python lessons/NN_stage.py --help` runs the file: a stage imports
    # torch and the engine at its top, which an interpreter of its own would pay for again.
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert exit.value.code in (0, None), f"{path.name} --help failed:\n{out[-3000:]}"
    assert out.startswith("usage:"), f"{path.name} --help printed no usage:\n{out[:500]}"
    # A stage that runs prints the code it teaches first, as "Read: file.py:LINE" (reading.py).
    assert not re.search(r"\.py:\d+", out), f"{path.name} --help ran the stage"


def test_tiny_and_model_together_are_refused(capsys):
    from lessons.models import parse_args

    with pytest.raises(SystemExit):
        parse_args("a model stage", ["--tiny", "--model", "gpt2"])
    assert "name two different models: pass one of them" in capsys.readouterr().err


def test_the_allocator_stages_exist():
    names = {path.name for path in STAGES}
    assert {"03_paged_blocks.py", "04_block_hashes.py", "05_ref_counts.py", "06_free_queue_lru.py",
            "10_going_further.py"} <= names


@pytest.mark.subprocess
@pytest.mark.parametrize("path", [pytest.param(path, marks=[getattr(pytest.mark, cost) for cost in STAGE_COSTS.get(path.name, [])])
                                  for path in STAGES], ids=lambda path: path.name)
def test_stage_runs_to_the_end(path):
    output = run_stage(path)
    for sentence in EXPECTED_OUTPUT.get(path.name, []):
        assert sentence in output, f"{path.name} no longer prints: {sentence!r}"
    for sentence in FORBIDDEN_OUTPUT.get(path.name, []):
        assert sentence not in output, f"{path.name} prints: {sentence!r}"


@pytest.mark.parametrize("name", HELPERS)
def test_helper_docstring_examples(name):
    assert doctest.testmod(importlib.import_module(name)).failed == 0


def test_the_syllabus_shows_the_curl_commands_stage_9_prints():
    stage_9 = importlib.import_module("lessons.09_serving")
    readme = (LESSONS / "README.md").read_text()
    for line in stage_9.curl_commands().splitlines():
        assert line in readme, f"lessons/README.md (stage 9) lacks: {line}"


# --- the claims of stage 10 -----------------------------------------------------------------------


@pytest.mark.slow
def test_the_radix_tree_and_the_hash_table_agree_on_whole_blocks():
    from lessons.workloads import WORKLOADS, radix_vs_hash

    for name, make in WORKLOADS.items():
        result = radix_vs_hash(make())
        assert result.evictions == 0, f"{name}: the comparison needs a pool that never evicts"
        assert result.hash_table == result.radix_blocks, name
        assert all(radix >= hashed for radix, hashed in zip(result.radix_tokens, result.hash_table)), name
    multi = radix_vs_hash(WORKLOADS["multi-turn chat"]())
    assert sum(multi.radix_tokens) > sum(multi.hash_table), "token granularity must find the partial blocks"


def test_the_radix_tree_splits_edges_and_matches_tokens():
    from lessons.radix_tree import RadixTree

    tree = RadixTree()
    tree.insert([1, 2, 3, 4, 5])
    tree.insert([1, 2, 3, 9])
    tree.insert([1, 2])
    assert tree.num_tokens() == 6  # 1 2 | 3 | 4 5 | 9: each shared prefix stored once
    assert [tree.match_prefix(p) for p in ([1, 2, 3, 4, 5, 6], [1, 2, 7], [2], [])] == [5, 2, 0, 0]


@pytest.mark.slow
def test_the_lessons_radix_tree_matches_the_analyzers_model_of_sglang_where_nothing_is_evicted():
    """Stage 10's tree is the idea alone; analyzer/caching_models.py's RadixTree models SGLang's
    RadixCache whole (pages, locks, eviction policies). With page size 1 and room for every
    token, both find the same prefix for every request of every workload (SGLang matches all
    but the prompt's last token, which its prefill must compute)."""
    from array import array

    from analyzer.caching_models import SGLang
    from lessons.radix_tree import RadixTree
    from lessons.workloads import WORKLOADS

    found = 0
    for name, make in WORKLOADS.items():
        prompts = [request.prompt for request in make()]
        tree, ours = RadixTree(), []
        for prompt in prompts:
            ours.append(tree.match_prefix(prompt[:-1]))
            tree.insert(prompt)
        counts = SGLang().replay([array("I", p) for p in prompts], [None] * len(prompts), max_total_tokens=10**9)
        assert counts.evictions == 0 and list(counts.cached) == ours, name
        found += sum(ours)
    assert found > 0, "workloads whose prompts share nothing would check nothing"


def test_an_lru_burst_evicts_the_hot_system_prompt_from_its_end():
    from lessons.workloads import lru_burst

    hits = [hit for _, _, hit in lru_burst([0, 8, 10, 11, 12, 16])]
    assert hits[0] == hits[1] == 512  # a small burst fits beside the prompt
    assert 0 < hits[3] < hits[2] < 512  # the prompt is eaten from its last block
    assert hits[4] == hits[5] == 0  # a big enough burst evicts all of it
    assert hits == sorted(hits, reverse=True)


@pytest.mark.slow
def test_hit_rates_follow_the_workloads():
    from lessons.workloads import hit_rate_table

    rates = hit_rate_table([256, 2048])
    assert rates["unique prompts"] == [0.0, 0.0]
    assert all(0.85 < r < 0.9 for r in rates["chatbot"])  # the ceiling: 512 shared of ~581 prompt tokens
    assert rates["multi-turn chat"][0] < rates["multi-turn chat"][1]
    assert rates["RAG"][0] < rates["RAG"][1]


def test_the_design_doc_example_with_free_uncached_first():
    from commands.walkthrough import design_doc_example

    assert design_doc_example(until=3).block_tables == {"request 0": [0, 1, 2, 3, 4], "request 1": [0, 1, 5, 6]}
    assert design_doc_example(until=5).free_queue.block_ids() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    assert design_doc_example(until=6).stats.evictions == 1
    assert design_doc_example(until=6, free_uncached_first=True).stats.evictions == 0


# --- figures --------------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_figures_command_writes_small_pngs(tmp_path):
    result = subprocess.run([sys.executable, str(LESSONS / "figures.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("block_pool.png", "hit_rate_vs_cache_size.png"):
        size = (tmp_path / name).stat().st_size
        assert 10_000 < size < 150_000, f"{name}: {size} bytes"
        assert (ROOT / "assets" / name).exists(), f"assets/{name} is missing: run python lessons/figures.py"


# --- counts first, times worded from what was measured (benchmarks/measure.py) ----------------------


def test_a_slower_warm_run_is_never_called_faster():
    from benchmarks.measure import Runs, conclusion, how_much_faster

    cold, warm = Runs([1579.0]), Runs([5317.0])  # seen on a busy 2-core machine
    assert "faster" not in how_much_faster(warm, cold).replace("not faster", "")
    text = conclusion("Warm was faster: copying K/V costs far less than computing it.", warm, cold)
    assert "faster" not in text and "counts above still hold" in text
    busy = conclusion("Warm was faster.", Runs([5317.0, 2300.0, 5100.0]), Runs([1579.0, 1500.0, 1620.0]))
    assert "machine was busy" in busy and "faster" not in busy
    assert how_much_faster(Runs([100.0, 104.0]), Runs([800.0, 790.0])) == "7.8x faster"


def test_a_claim_is_printed_when_the_numbers_show_it_and_flagged_when_the_runs_disagree():
    from benchmarks.measure import Runs, conclusion

    quiet = conclusion("Warm beat cold.", Runs([100.0, 104.0, 98.0]), Runs([800.0, 812.0, 790.0]))
    assert quiet == "Warm beat cold."
    noisy = conclusion("Warm beat cold.", Runs([100.0, 104.0, 98.0]), Runs([800.0, 2400.0, 790.0]))
    assert noisy.startswith("Warm beat cold. The machine was busy")
    assert conclusion("Warm beat cold.", Runs([100.0]), Runs([105.0])) != "Warm beat cold."  # 5% is noise


def test_the_busy_rule_ignores_a_few_ms_between_short_runs():
    from benchmarks.measure import Runs, busy_note

    assert busy_note(Runs([16.0, 24.0, 18.0])) == ""  # 1.5x, but 8 ms: timer and memory noise
    assert "differed by up to 1.5x" in busy_note(Runs([160.0, 240.0, 180.0]))


def test_the_token_counter_counts_what_the_model_embeds(tiny_model):
    import torch
    from benchmarks.measure import TokenCounter

    with TokenCounter(tiny_model.get_input_embeddings()) as embedded, torch.inference_mode():
        tiny_model(torch.tensor([[1, 2, 3, 4, 5]]))
        tiny_model(torch.tensor([[6]]))
    assert (embedded.tokens, embedded.passes) == (6, 2)


# --- the toy tokenizer and stage 6's measurement ------------------------------------------------


def test_a_word_has_the_same_token_id_in_every_lesson():
    from allocator import compute_block_hashes
    from lessons.words import Words

    first, second = Words(), Words()
    second.encode("unrelated words seen first")
    assert first.encode("You are a helpful") == second.encode("You are a helpful")
    names = {tuple(compute_block_hashes(Words().encode(text), 4))
             for text in ("You are a helpful", "A gentle breeze stirred")}
    names.add(tuple(compute_block_hashes([0, 1, 2, 3], 4)))  # stage 6's design doc tokens
    assert len(names) == 3, "different words must give different block hashes"


def test_stage_6_times_a_removal_from_the_middle_every_time(monkeypatch):
    stage_6 = importlib.import_module("lessons.06_free_queue_lru")
    positions = []

    class RecordingList(list):
        def remove(self, block):
            positions.append(self.index(block))
            super().remove(block)

    monkeypatch.setitem(stage_6.QUEUES, "recording", RecordingList)
    stage_6.seconds_per_remove(1_000, "recording", repeats=50)
    assert positions == [500] * 50


@pytest.mark.model  # importing stage 7 loads torch and transformers
def test_stage_7s_timing_table_adds_the_gpus_clock_only_where_every_reply_has_it():
    from rich.console import Console

    from engine.outputs import Generation

    stage_7 = importlib.import_module("lessons.07_real_model")

    def reply(gpu: bool) -> Generation:
        generation = Generation("r", prompt_tokens=8, ttft_ms=5.0)
        generation.prefill.forward_ms = 4.0
        if gpu:
            generation.prefill.gpu_ms = {step: 0.5 for step in stage_7.STEPS} | {"forward": 3.0}
        return generation

    def shown(gpu: bool) -> str:
        console = Console(width=200, record=True, file=open(os.devnull, "w"))
        console.print(stage_7.timing_table({"MISS": [reply(gpu)] * 3, "HIT": [reply(gpu)] * 3}))
        return console.export_text()

    on_gpu, on_cpu = shown(True), shown(False)
    assert re.search(r"forward, GPU clock\s+│\s+3\.0\s+│\s+3\.0", on_gpu) and "gather, GPU clock" in on_gpu
    assert "GPU clock" not in on_cpu and re.search(r"forward\s+│\s+4\.0\s+│\s+4\.0", on_cpu)
