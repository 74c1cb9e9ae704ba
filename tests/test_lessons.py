"""Every lesson runs to the end and prints what lessons/README.md says it prints; the claims
the allocator lessons make are pinned here too."""

import doctest
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ROOT / "lessons"
sys.path.insert(0, str(LESSONS))  # the lessons' helper modules: workloads, radix_tree, words, figures, models

STAGES = sorted(LESSONS.glob("[0-9][0-9]_*.py"))
HELPERS = ["workloads", "radix_tree", "words", "models", "reading"]

# Flags a stage needs to run fast in the test suite (e.g. a tiny model); none means none.
FLAGS: dict[str, list[str]] = {
    "01_naive_prefill.py": ["--tiny"],
    "02_kv_cache.py": ["--tiny"],
    "07_real_model.py": ["--tiny"],
    "08_serving.py": ["--tiny"],
}

# Sentences each stage must print (compared with white space folded, so line wraps do not matter).
EXPECTED_OUTPUT = {
    "01_naive_prefill.py": ["Every step recomputed the 39-token prompt from scratch",
                            "runs the model over 636,750 tokens", "computing each token once would be 1,523"],
    "02_kv_cache.py": ["The same 8 tokens with and without the cache", "the cache ends at 46 = 39 + 8 - 1 tokens",
                       "0.5 KiB per token"],
    "07_real_model.py": ["(cached_tokens=448) and ran the model on 14",
                         "its layer-0 key in the cache equals the pool's: True",
                         "exactness ok: logits allclose to a full forward",
                         "exactness ok: the same 24 tokens as model.generate"],
    "08_serving.py": ['"prompt_tokens_details": {"cached_tokens": 448}',
                      "Without salts the right guess comes back with cached_tokens=208",
                      "With the salt derived from each key, the right guess gets cached_tokens=0",
                      "own key still hits her blocks (cached_tokens=208)",
                      "derives cache_salt from your API key"],
    "03_paged_blocks.py": ["a contiguous allocator would refuse it", "num_cached_tokens = 0"],
    "04_block_hashes.py": ["hits 4 tokens", "hits 0 tokens. Tenant a does the same: 12", "== salted[1] is True"],
    "05_ref_counts.py": ["Blocks in use: 12 shared vs 24", "erin hits 16 tokens", "hits 12, not 16"],
    "06_free_queue_lru.py": ["matches the design doc",
                             "free_uncached_first=False: request 2's blocks [0, 1, 2, 7, 8, 9, 4, 3], evictions 1",
                             "free_uncached_first=True : request 2's blocks [0, 1, 2, 6, 4, 7, 8, 9], evictions 0"],
    "09_going_further.py": ["free in reverse: the same"],
}
# ... and must never print.
FORBIDDEN_OUTPUT = {"06_free_queue_lru.py": ["differs from the doc"]}


def run_stage(path: Path) -> str:
    env = {**os.environ, "COLUMNS": "160"}
    result = subprocess.run(
        [sys.executable, str(path), *FLAGS.get(path.name, [])],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )
    assert result.returncode == 0, f"{path.name} failed:\n{result.stderr[-3000:]}"
    return " ".join(result.stdout.split())


def test_tiny_and_model_together_are_refused(capsys):
    from models import parse_args

    with pytest.raises(SystemExit):
        parse_args("a model stage", ["--tiny", "--model", "gpt2"])
    assert "name two different models: pass one of them" in capsys.readouterr().err


def test_the_allocator_stages_exist():
    names = {path.name for path in STAGES}
    assert {"03_paged_blocks.py", "04_block_hashes.py", "05_ref_counts.py", "06_free_queue_lru.py",
            "09_going_further.py"} <= names


@pytest.mark.parametrize("path", STAGES, ids=lambda path: path.name)
def test_stage_runs_to_the_end(path):
    output = run_stage(path)
    for sentence in EXPECTED_OUTPUT.get(path.name, []):
        assert sentence in output, f"{path.name} no longer prints: {sentence!r}"
    for sentence in FORBIDDEN_OUTPUT.get(path.name, []):
        assert sentence not in output, f"{path.name} prints: {sentence!r}"


@pytest.mark.parametrize("name", HELPERS)
def test_helper_docstring_examples(name):
    assert doctest.testmod(importlib.import_module(name)).failed == 0


def test_the_syllabus_shows_the_curl_commands_stage_8_prints():
    stage_8 = importlib.import_module("08_serving")
    readme = (LESSONS / "README.md").read_text()
    for line in stage_8.curl_commands().splitlines():
        assert line in readme, f"lessons/README.md (stage 8) lacks: {line}"


# --- the claims of stage 9 ------------------------------------------------------------------------


def test_the_radix_tree_and_the_hash_table_agree_on_whole_blocks():
    from workloads import WORKLOADS, radix_vs_hash

    for name, make in WORKLOADS.items():
        result = radix_vs_hash(make())
        assert result.evictions == 0, f"{name}: the comparison needs a pool that never evicts"
        assert result.hash_table == result.radix_blocks, name
        assert all(radix >= hashed for radix, hashed in zip(result.radix_tokens, result.hash_table)), name
    multi = radix_vs_hash(WORKLOADS["multi-turn chat"]())
    assert sum(multi.radix_tokens) > sum(multi.hash_table), "token granularity must find the partial blocks"


def test_the_radix_tree_splits_edges_and_matches_tokens():
    from radix_tree import RadixTree

    tree = RadixTree()
    tree.insert([1, 2, 3, 4, 5])
    tree.insert([1, 2, 3, 9])
    tree.insert([1, 2])
    assert tree.num_tokens() == 6  # 1 2 | 3 | 4 5 | 9: each shared prefix stored once
    assert [tree.match_prefix(p) for p in ([1, 2, 3, 4, 5, 6], [1, 2, 7], [2], [])] == [5, 2, 0, 0]


def test_an_lru_burst_evicts_the_hot_system_prompt_from_its_end():
    from workloads import lru_burst

    hits = [hit for _, _, hit in lru_burst([0, 8, 10, 11, 12, 16])]
    assert hits[0] == hits[1] == 512  # a small burst fits beside the prompt
    assert 0 < hits[3] < hits[2] < 512  # the prompt is eaten from its last block
    assert hits[4] == hits[5] == 0  # a big enough burst evicts all of it
    assert hits == sorted(hits, reverse=True)


def test_hit_rates_follow_the_workloads():
    from workloads import hit_rate_table

    rates = hit_rate_table([256, 2048])
    assert rates["unique prompts"] == [0.0, 0.0]
    assert all(0.85 < r < 0.9 for r in rates["chatbot"])  # the ceiling: 512 shared of ~581 prompt tokens
    assert rates["multi-turn chat"][0] < rates["multi-turn chat"][1]
    assert rates["RAG"][0] < rates["RAG"][1]


def test_the_design_doc_example_with_free_uncached_first():
    from walkthrough import design_doc_example

    assert design_doc_example(until=3).block_tables == {"request 0": [0, 1, 2, 3, 4], "request 1": [0, 1, 5, 6]}
    assert design_doc_example(until=5).free_queue_ids() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    assert design_doc_example(until=6).stats.evictions == 1
    assert design_doc_example(until=6, free_uncached_first=True).stats.evictions == 0


# --- figures --------------------------------------------------------------------------------------


def test_figures_command_writes_small_pngs(tmp_path):
    result = subprocess.run([sys.executable, str(LESSONS / "figures.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("block_pool.png", "hit_rate_vs_cache_size.png"):
        size = (tmp_path / name).stat().st_size
        assert 10_000 < size < 150_000, f"{name}: {size} bytes"
        assert (ROOT / "assets" / name).exists(), f"assets/{name} is missing: run python lessons/figures.py"
