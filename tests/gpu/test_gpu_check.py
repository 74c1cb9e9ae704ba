"""`python prefix_caching.py --bench gpu`, the one command a lent GPU machine runs, here on a CPU
at its small sizes: what it prints and counts (never its times), the random weights it builds
when a model's weights are missing, and the exit status when a reply differs from
model.generate."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.model, pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def config_dir(tiny_model_dir, tmp_path):
    """The tiny model's folder without its weights: config.json and the tokenizer's files, what a
    GPU machine with no network is given."""
    for path in tiny_model_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    return tmp_path


def test_the_tiny_check_runs_end_to_end_and_prints_one_table(tmp_path):
    out = tmp_path / "gpu.json"
    result = subprocess.run([sys.executable, "prefix_caching.py", "--bench", "gpu", "--tiny", "--device", "cpu",
                             "--num-blocks", "256", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("┏") == 1 and "GPU check on" in result.stdout  # one table, its title
    results = json.loads(out.read_text())
    assert results["random_weights"] and "Random weights" in result.stdout
    assert results["torch"] in result.stdout and results["transformers"] in result.stdout and results["date"] in result.stdout
    # The demo, twice: the first question computes the system prompt, the others find it in the pool.
    demo = results["demo"]
    for rows in demo["rounds"].values():
        assert [row["cached_tokens"] > 0 for row in rows] == [False, True, True, True, True]
        assert all(set(row["phases_ms"]) == set(gpu.PHASES) and row["captures"] == 0 for row in rows)
    assert [row["computed_tokens"] for row in demo["rounds"]["steady"]] == [
        row["computed_tokens"] for row in demo["rounds"]["first"]]  # the same requests, the cache emptied first
    assert demo["pool_after_warm_up"] == {"free_blocks": 256, "blocks": 256, "cached_blocks": 0}
    assert set(demo["first_over_steady"]) == set(gpu.PHASES) and len(demo["steady_miss_over_hits"]) == 4
    hit = results["profiled_hit"]  # on a CPU: no kernel launched, no time on a GPU
    assert hit["cached_tokens"] > 0 and hit["wall_ms"] > 0 and hit["launches"] == 0 and hit["gpu_ms"] == 0
    # Every path of the engine replies as model.generate does, in fp32 (no bf16 on a CPU).
    assert results["exactness"] == {"fp32": dict.fromkeys(gpu.PATHS, results["exactness_prompts"])}
    assert [row["prefix_tokens"] for row in results["ttft"]] == list(gpu.SMALL.prefixes)
    runs = results["throughput"]["runs"]
    assert [run["requests"] for run in runs] == list(gpu.SMALL.requests)
    assert all(row["same_tokens_as_a"] == run["requests"] for run in runs for row in run["rows"])
    # Counted by the runner's plans, both engines warmed first: no capture on a CPU, (c) against its floor.
    assert all(row["steps_watched"] == row["steps_run"] > 0 and row["tokens_embedded"] == row["tokens_replies_computed"]
               and row["captures_while_timed"] == 0 for run in runs for row in run["rows"])
    assert all(run["c_over_floor"] > 0 for run in runs) and "against its floor" in result.stdout
    decode = results["decode"]
    assert decode["streams"] == gpu.SMALL.decode_streams and all(decode[k] > 0 for k in ("one_request_ms",
                                                                                     "engine_one_stream_ms", "engine_step_ms"))
    assert results["cuda_graphs"] == {"engine": None, "throughput": None}  # a CPU runs no graph
    scenes = results["long_among_short"]["rows"]  # one of 120 tokens among 3 of 6, against 4 of 6
    assert [len(row["context_tokens"]) for row in scenes.values()] == [4, 4]
    assert scenes["one long"]["context_tokens"][0] > 120 and all(row["max_logit_difference"] < 1e-4
                                                                  for row in scenes.values())
    assert results["long_among_short"]["padded_long_over_short"] > 0
    floor = results["ttft_floor"]
    assert floor["matmul_tflops"] > 0 and [row["prefix_tokens"] for row in floor["rows"]] == list(gpu.SMALL.floor_prefixes)
    assert all(row["floor_ms"] > 0 and row["cold_over_floor"] == row["cold_ms"] / row["floor_ms"] for row in floor["rows"])


@pytest.fixture
def fewer(monkeypatch):
    """One prompt, one prefix, one request, two tokens, and none of the parts after exactness
    that only time (the end-to-end test runs them): for tests of where the model comes from."""
    monkeypatch.setattr(gpu, "SMALL", gpu.Sizes(shared_prompts=1, long_prompts=(), exact_tokens=2, prefixes=(16,),
                                                repeats=1, requests=(1,), new_tokens=2, long_among_short=(20, 4, 1),
                                                floor_prefixes=(16,), decode_streams=2, repeats_long=3))
    monkeypatch.setattr(gpu, "throughput", lambda engine, sizes: [])
    monkeypatch.setattr(gpu, "decode_ms", lambda engine, tokens, streams: {
        "tokens": tokens, "streams": streams, "one_request_ms": None, "engine_one_stream_ms": None,
        "engine_step_ms": None, "engine_step_gpu_ms": None, "engine_step_streams": None})
    monkeypatch.setattr(gpu, "long_among_short", lambda *args: {"rows": {}, "padded_long_over_short": 0.0})
    monkeypatch.setattr(gpu, "ttft_against_floor", lambda *args: {"matmul_tflops": 0.0, "rows": []})


def test_without_weights_it_builds_random_ones_of_the_config_and_says_so(config_dir, capsys, fewer):
    results = gpu.main(["--config-dir", str(config_dir), "--device", "cpu", "--num-blocks", "256"])
    out = capsys.readouterr().out
    assert results["random_weights"] and "Random weights" in out and "random weights, seed 0" in results["model"]
    assert results["exactness"]["fp32"] == dict.fromkeys(gpu.PATHS, results["exactness_prompts"])


def test_a_config_dir_with_weights_loads_them(tiny_model_dir, fewer):
    results = gpu.main(["--config-dir", str(tiny_model_dir), "--device", "cpu", "--num-blocks", "256"])
    assert not results["random_weights"] and results["model"] == str(tiny_model_dir)


def test_a_reply_that_differs_from_model_generate_in_fp32_fails_the_command(fewer, monkeypatch):
    monkeypatch.setattr(gpu, "greedy_reference", lambda *args: [])  # an oracle no reply equals
    with pytest.raises(SystemExit, match="exactness failed in fp32"):
        gpu.main(["--tiny", "--device", "cpu", "--num-blocks", "256"])


def test_without_weights_or_a_config_it_says_what_to_pass(tmp_path):
    with pytest.raises(OSError, match="--config-dir DIR"):
        gpu.load(argparse.Namespace(tiny=False, model=None, config_dir=str(tmp_path), device="cpu"))
