"""What the commands print and the figures the docs quote: the walkthrough, the demo, the
benchmarks and their flags. The rules of the allocator and the engine are in their own files;
this one pins what a reader sees on screen, counts rather than times.
"""

import argparse
import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

import prefix_caching as cli
from benchmarks import attention, busy, chunked_prefill, padded_decode, paged, stalls, step_profile, throughput, ttft
from benchmarks.engines import unwatch_steps, watch_steps
from benchmarks.allocator import free_order_hit_rates
from commands import walkthrough
from commands import demo
from commands.demo import run_demo
from commands.model_flags import add_model_arguments, pool_arguments
from engine import model_runner, static_decode

ROOT = Path(__file__).resolve().parents[2]


def test_the_readmes_allocator_example_prints_what_its_comments_say():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```python\nfrom prefix_caching import PrefixCachingAllocator")
    lines = readme[start:].split("```")[1].splitlines()[1:]
    namespace: dict = {}
    checked = 0
    for line in lines:
        code, _, comment = line.partition("  # ")
        if comment:
            assert repr(eval(code.strip(), namespace)) == comment.strip(), line
            checked += 1
        else:
            exec(code, namespace)
    assert checked == 3


def test_walkthrough_prints_the_doc_example_and_agrees_everywhere():
    out = io.StringIO()
    walkthrough.walkthrough(Console(file=out, width=120))
    text = out.getvalue()
    assert "differs" not in text
    assert text.count("matches the design doc") == 12
    assert "7, 8, 9, 4, 3, 2, 6, 5, 1, 0" in text


@pytest.mark.subprocess
def test_walkthrough_command_runs():
    result = subprocess.run(
        [sys.executable, "prefix_caching.py", "--walkthrough"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "Time 6" in result.stdout and "differs" not in result.stdout


@pytest.mark.parametrize("mode", [["--demo"], ["--bench", "ttft"], ["--bench", "allocator"]])
def test_help_after_a_mode_lists_that_modes_flags(mode, capsys):
    # cli.main is what `python prefix_caching.py` runs (test_no_mode_is_a_usage_error runs the file
    # itself); in this process, so the modes' imports of torch are paid once.
    with pytest.raises(SystemExit) as exit:
        cli.main([*mode, "--help"])
    out = capsys.readouterr().out
    assert exit.value.code in (0, None), out
    assert f"prefix_caching.py {' '.join(mode)}" in out  # the mode's own usage line
    if mode == ["--demo"]:
        assert "--no-cache" in out and "--long-prefix" in out


@pytest.mark.subprocess
def test_no_mode_is_a_usage_error():
    result = subprocess.run([sys.executable, "prefix_caching.py"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--walkthrough, --demo, --analyze LOG or --bench" in result.stderr


@pytest.mark.subprocess
def test_allocator_benchmark_runs_and_reports_every_figure(tmp_path):
    out = tmp_path / "alloc.json"
    result = subprocess.run(
        [sys.executable, "prefix_caching.py", "--bench", "allocator", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert {"sha256_ns_per_token", "xxhash_ns_per_token", "miss", "hit_heavy", "free_order"} <= data.keys()
    assert data["miss"]["overhead_ns_per_token"] == pytest.approx(
        data["miss"]["caching_on_ns_per_token"] - data["miss"]["caching_off_ns_per_token"]
    )
    assert "100k / 1k throughput" in result.stdout


@pytest.mark.slow
def test_freeing_hashless_blocks_to_the_head_keeps_more_of_a_tight_pool_cached():
    # The figures the README, stage 6 and the syllabus quote from --bench allocator: counts, not times.
    rates = free_order_hit_rates(20_000)
    assert round(rates["tail"]["hit_rate"], 3) == 0.538
    assert round(rates["head"]["hit_rate"], 3) == 0.784 and rates["head"]["evictions"] == 0


@pytest.mark.parametrize("no_cache", [False, True], ids=["cache", "no-cache"])
def test_the_demo_hits_from_the_second_question_on_unless_caching_is_off(tiny_model_dir, tmp_path, capsys, no_cache):
    args = argparse.Namespace(model=str(tiny_model_dir), device="cpu", dtype=None, block_size=16,
                              num_blocks=256, no_cache=no_cache, json=str(tmp_path / "demo.json"))
    replies = run_demo(args)
    hits = [reply.cached_tokens > 0 for reply in replies]
    assert hits == ([False] * 5 if no_cache else [False, True, True, True, True])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines
    assert "MISS" in out and ("HIT" in out) != no_cache and "hit rate" in out
    assert "course reader" not in out and "GPU clock" not in out  # a CPU's demo: nothing more unless asked
    # The sentence about the shared prompt counts as the table does: every hit is its full blocks,
    # or one block more where a question's first tokens fill the next block as an earlier one's did.
    shared, full, over = map(int, re.search(r"The first (\d+) tokens .*?: (\d+) full blocks of 16, and (\d+) tokens", out).groups())
    assert shared == 16 * full + over
    for reply in replies[1:]:
        assert reply.cached_tokens in ((0,) if no_cache else (16 * full, 16 * (full + 1)))
        assert f"{reply.cached_tokens} + {reply.computed_prompt_tokens}" in out
    assert [r["ttft_ms"] for r in json.loads((tmp_path / "demo.json").read_text())] == [
        round(r.ttft_ms, 2) for r in replies]


def test_the_demos_long_prefix_is_the_course_reader_behind_the_system_prompt(tokenizer):
    """What the demo asks behind on a GPU: at least 4,000 tokens every question shares."""
    from engine.prompts import tokenize_prompts

    system = f"{demo.DEMO_SYSTEM_PROMPT}\n\n{demo.COURSE_READER}"
    ids = tokenize_prompts(tokenizer, [demo.demo_prompt(system, q) for q in demo.DEMO_QUESTIONS], None)
    assert demo.shared_tokens(ids) >= 4000 and max(map(len, ids)) < 8192 - demo.DEMO_MAX_TOKENS


def test_the_demo_asks_again_behind_the_course_reader_when_asked_with_the_gpus_clock(tiny_model_dir, capsys,
                                                                                   monkeypatch, gpu_clock_on):
    """--long-prefix (a GPU's default): the same questions behind a long shared prefix (the
    reader, cut to fit the tiny model's 1,024 tokens): a MISS with nothing cached (the cache
    emptied first), then HITs of its full blocks, then the crossover's MISS and HIT at each
    length, and where the HIT paid. And, as on a GPU, each request's table gets its gather,
    forward and write on the wall's clock and on the GPU's (CUDA events, faked here: the two
    clocks are one)."""
    monkeypatch.setenv("COLUMNS", "200")  # each table's columns on one line each
    monkeypatch.setattr(demo, "COURSE_READER", demo.COURSE_READER[:1800])
    short = []  # the command as typed (cli.main is what python prefix_caching.py runs), its replies kept
    monkeypatch.setattr(demo, "run_demo", lambda args: short.extend(run_demo(args)))
    cli.main(["--demo", "--long-prefix", "--model", str(tiny_model_dir), "--device", "cpu", "--num-blocks", "256"])
    out = capsys.readouterr().out
    assert [r.cached_tokens > 0 for r in short] == [False, True, True, True, True]
    assert " ".join(out.split()).count("wall / GPU clock") == 10  # the short questions' tables, then the reader's
    for reply in short:
        wall = sum(getattr(reply.prefill, f"{phase}_ms") for phase in ("gather", "forward", "write"))
        gpu = sum(reply.prefill.gpu_ms[phase] for phase in ("gather", "forward", "write"))
        assert f"{wall:,.1f} / {gpu:,.1f} ms" in out and gpu <= wall
    shared = int(re.search(r"prompt, ([\d,]+) shared tokens", out).group(1).replace(",", ""))
    assert 600 < shared < 1000 and "The cache is emptied first" in " ".join(out.split())
    rows = re.findall(r"│\s+([\d,]+)\s+│\s+[\d.,]+ ms\s+│\s+[\d.,]+ ms \(([\d,]+) cached\)\s+│\s+([\d.]+)x", out)
    assert [int(n.replace(",", "")) for n, _, _ in rows] == [256, 512, shared]
    assert [int(c.replace(",", "")) for _, c, _ in rows] == [256, 512, shared // 16 * 16]
    sentence = re.search(r"a HIT came 2x sooner than its MISS (from ([\d,]+) tokens|at none)", " ".join(out.split()))
    paid = [int(n.replace(",", "")) for n, _, ratio in rows if float(ratio) >= 2.0]
    assert sentence and (sentence.group(2) == f"{paid[0]:,}" if paid else sentence.group(1) == "at none")


def test_the_ttft_benchmark_reports_every_figure(tiny_model_dir, tmp_path):
    out = tmp_path / "ttft.json"
    argv = ["--model", str(tiny_model_dir), "--num-blocks", "64", "--quick",
            "--plot", str(tmp_path / "ttft.png"), "--json", str(out)]
    results = ttft.main(argv)
    assert json.loads(out.read_text()) == results
    assert [row["prefix_tokens"] for row in results["cold_vs_warm"]] == [64, 128]
    assert all(row["captures_while_timed"] == 0 for row in results["cold_vs_warm"])
    assert set(results["cold_vs_warm"][0]["warm_breakdown_ms"]) == {"lookup_ms", "gather_ms", "forward_ms", "write_ms", "sample_ms"}
    assert "overhead" in results["no_sharing"] and (tmp_path / "ttft.png").stat().st_size > 0


def test_the_pool_flags_take_blocks_or_memory_not_both(capsys):
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--kv-memory-gb", "0.25", "--block-size", "8"])
    assert pool_arguments(args) == {"block_size": 8, "num_blocks": None, "kv_memory_gb": 0.25}
    with pytest.raises(SystemExit):
        parser.parse_args(["--num-blocks", "10", "--kv-memory-gb", "1"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_throughput_benchmark_checks_every_way_gives_the_same_tokens(tiny_model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    results = throughput.main(["--model", str(tiny_model_dir), "--num-blocks", "256", "--quick",
                               "--plot", str(tmp_path / "t.png"), "--json", str(out)])
    assert json.loads(out.read_text()) == results
    rows = results["runs"][0]["rows"]
    assert [r["name"][:3] for r in rows] == ["(a)", "(b)", "(c)", "(d)"]
    assert all(r["same_tokens_as_a"] == r["requests"] == 4 for r in rows)
    embedded = {r["name"][:3]: r["tokens_embedded"] for r in rows}
    # Four requests behind one system prompt, admitted in one step. Here the three behind the first hit
    # the blocks it computes in that step, so (c) computes as little as one after another with caching
    # (a). transformers registers a block only after the forward pass that computes it: in (d) each
    # of the four computes the system prompt, as with caching off (b).
    assert embedded["(c)"] == embedded["(a)"] < embedded["(d)"] == embedded["(b)"], embedded
    assert (tmp_path / "t.png").stat().st_size > 0


def test_the_throughput_benchmark_counts_every_step_with_the_padded_decode_forced(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    """Decode steps padded as a GPU runs them (where a replayed graph calls no hook), eagerly on
    this CPU: each way's counts are the steps its runner ran and the tokens its replies say were
    computed, and (c)'s floor runs as many passes."""
    padded = []
    monkeypatch.setattr(model_runner, "forward", lambda *args: padded.append(args[2:]) or static_decode.forward(*args))
    results = throughput.main(["--model", str(tiny_model_dir), "--num-blocks", "256", "--quick", "--padded-decode",
                               "--skip-transformers", "--plot", str(tmp_path / "t.png")])
    (run,) = results["runs"]
    rows = {r["name"][:3]: r for r in run["rows"]}
    assert set(rows) == {"(a)", "(b)", "(c)"} and all(r["same_tokens_as_a"] == 4 for r in rows.values())
    for row in rows.values():
        assert row["steps_watched"] == row["steps_run"] > 0
        assert row["tokens_embedded"] == row["tokens_replies_computed"] > 0
        assert row["captures_while_timed"] == 0  # a CPU captures nothing
    assert run["forward_passes"] == rows["(c)"]["steps_run"]
    assert padded, "no decode step ran padded"
    assert rows["(c)"]["tokens_embedded"] < rows["(b)"]["tokens_embedded"]  # the system prompt computed once


def test_the_benchmarks_count_the_steps_the_scheduler_planned_padded_decodes_too(make_engine):
    # The padded decode step, as a GPU runs it (there replayed as a CUDA graph, which no hook on
    # the model sees), forced on here: every step is counted, with the tokens it computed.
    engine = make_engine(num_blocks=64, static_decode=True)
    prompts = [[7 + i] + list(range(20, 30 + 3 * i)) for i in range(4)]  # no two share a block
    steps = watch_steps(engine)
    replies = engine.generate_batch(prompts, max_tokens=5)
    unwatch_steps(engine)
    assert not {"step", "postprocess"} & set(vars(engine.loop.runner))  # unwatched: the runner's own again
    assert not any(r.cached_tokens or r.num_preemptions for r in replies)
    # each prompt token computed once, then each token but the last fed back as a decode
    assert sum(s.tokens for s in steps) == sum(r.prompt_tokens + len(r.token_ids) - 1 for r in replies)
    assert sum(s.samples for s in steps) == sum(len(r.token_ids) for r in replies)
    assert any(s.tokens == s.samples == 4 and not s.prefill_tokens for s in steps)  # the four decoding together
    assert all(s.start <= s.end for s in steps)


def test_the_chunked_prefill_benchmark_runs_the_scene_both_ways(tiny_model_dir, tmp_path):
    results = chunked_prefill.main(["--model", str(tiny_model_dir), "--num-blocks", "256", "--quick",
                                    "--json", str(tmp_path / "c.json")])
    on, off = results["runs"]
    assert (on["chunked"], off["chunked"]) == (True, False) and on["long_tokens"] == off["long_tokens"]
    # Counted in steps from the long prompt's arrival (budget 8, two clients): unchunked, it waits
    # for the clients to drain and the requests behind it wait for it; chunked, those share its
    # steps (engine/scheduler.py: a prompt prefilling takes only its share) and are done far sooner.
    assert off["clients_done_step"] < off["long_first_token_step"]
    assert on["behind_done_step"] < off["behind_done_step"]


def test_the_attention_benchmark_counts_what_a_step_reads(tiny_model_dir, tmp_path):
    results = attention.main(["--model", str(tiny_model_dir), "--num-blocks", "256", "--quick",
                              "--json", str(tmp_path / "a.json")])
    short, mixed = results["rows"]["short"], results["rows"]["mixed"]
    assert mixed["slots_read"] <= 1.25 * mixed["slots_needed"] and short["slots_read"] <= 1.25 * short["slots_needed"]
    for row in results["cascade"].values():
        assert row["on"]["slots_needed"] == row["off"]["slots_needed"]
        assert row["on"]["slots_read"] <= row["off"]["slots_read"]
    on, off = results["cascade"]["4 sharing 448"]["on"], results["cascade"]["4 sharing 448"]["off"]
    assert on["slots_read"] < off["slots_read"]
    chats = results["chats"]
    assert chats["one conversation"]["slots_needed"] > chats["chats"]["slots_needed"] + 500


def test_the_paged_benchmark_runs_both_caches_over_the_same_numbers(tiny_model_dir, tmp_path):
    results = paged.main(["--model", str(tiny_model_dir), "--decodes", "4", "2", "--context", "40", "--steps", "2",
                          "--json", str(tmp_path / "p.json")])
    for row, n in zip(results["rows"], (4, 2)):
        assert row["decodes"] == n and row["max_logit_difference"] < 1e-5  # the same K/V, the same logits
        assert row["slots_needed"] == n * (40 + 3)  # the last timed step: each prompt and 3 tokens after it
        assert row["slots_copied"] == n * 48  # whole blocks of 16: three a request
        assert row["paged_ms"] > 0 and row["contiguous_ms"] > 0


def test_the_padded_decode_benchmark_times_the_same_step_both_ways(tiny_model_dir, tmp_path):
    results = padded_decode.main(["--model", str(tiny_model_dir), "--num-blocks", "256", "--quick", "--repeats", "3",
                                  "--json", str(tmp_path / "d.json")])
    equal, long, chunk = results["rows"]
    # prefilled one a step (20 tokens each), the first ones decoding meanwhile
    assert equal["context_tokens"] == [25, 23, 22, 21] and equal["padded_slots_copied"] == 8 * 16
    assert all(row["max_logit_difference"] < 1e-4 and row["captures_in_timed_region"] == 0 for row in results["rows"])
    assert not equal["graphed"] and equal["padded_ms"] > 0 and equal["packed_ms"] > 0  # a CPU pads eagerly
    # One context of 122 among three of 7, blocks of 16: the padded step reads the long one's own
    # 8 blocks and one each for the others, 11 padded to 16; every row reading the longest row's
    # blocks would be 4 x 8.
    assert long["context_tokens"] == [122, 7, 7, 7]
    assert long["padded_slots_copied"] == 16 * 16 < 4 * 8 * 16
    # Three decodes beside a new prompt's 29 tokens: 32 tokens, no padding tokens; the three
    # contexts' 2 blocks each and the prompt's 2
    assert chunk["tokens"] == 32 and chunk["padded_to"] == (32, 8) and chunk["requests"] == 4
    assert chunk["padded_slots_copied"] == 8 * 16
    assert json.loads((tmp_path / "d.json").read_text())["rows"][1]["scene"] == "one long"


@pytest.mark.parametrize("http", [False, True], ids=["in-process", "http"])
def test_the_stalls_benchmark_measures_both_budgets_beside_streams(tiny_model_dir, tmp_path, http):
    argv = ["--model", str(tiny_model_dir), "--num-blocks", "512", "--quick", "--json", str(tmp_path / "s.json")]
    results = stalls.main(argv + (["--http"] if http else []))
    assert set(results["ways"]) == {"target", "fixed"} and results["http"] == http
    for way in results["ways"].values():
        assert way["gap_longest_during_ms"] > 0 and way["ttft_s"] > 0 and way["ttft_alone_s"] > 0
        assert way["captures_while_timed"] == 0


def test_the_step_profile_splits_a_step_into_parts(tiny_model_dir, tmp_path):
    results = step_profile.main(["--model", str(tiny_model_dir), "--num-blocks", "512", "--requests", "4",
                                 "--steps", "2", "--json", str(tmp_path / "p.json")])
    (row,) = results["rows"]
    assert set(row["shares"]) == {"linear", "attention", "model", "engine"}
    assert all(share >= 0 for share in row["shares"].values()) and 0.9 < sum(row["shares"].values()) < 1.1
    assert row["shares"]["linear"] > 0 and row["shares"]["attention"] > 0 and row["captures_while_timed"] == 0
    (python,) = results["engine_python"]  # the loop's runner, decode steps after the last prompt's
    assert python["requests"] == 4 and 1 <= python["decodes"] <= 4 and python["steps"] >= 2
    assert set(python["ms"]) == {"schedule", "forward", "sample", "record", "postprocess"}
    assert all(ms > 0 for ms in python["ms"].values())
    assert python["schedule_sample_record_ms"] == sum(python["ms"][k] for k in ("schedule", "sample", "record"))


def test_the_busy_benchmark_starts_and_stops_its_busy_programs(tiny_model_dir, tmp_path, monkeypatch):
    started = []
    real = busy.busy_programs

    @contextlib.contextmanager
    def watched(n):
        with real(n) as programs:
            started.extend(programs)
            assert all(p.poll() is None for p in programs)  # running while the busy ways run
            yield programs

    monkeypatch.setattr(busy, "busy_programs", watched)
    # The programs' lives and the report are checked, not how slow they make the ways: one that
    # spins would take a core from the other test worker for the whole run.
    monkeypatch.setattr(busy, "SPIN", "import time; time.sleep(600)")
    results = busy.main(["--model", str(tiny_model_dir), "--num-blocks", "256", "--quick", "--fixed-threads",
                         "--json", str(tmp_path / "b.json")])
    assert len(started) == 1 and all(p.poll() is not None for p in started)  # stopped after
    assert set(results["busy"]) == {"c", "d", "c fixed", "one", "one fixed", "demo"}
    assert set(results["quiet"]) == {"c", "d", "one", "demo"} and results["quiet"]["c"]["requests"] == 4
    for when in ("quiet", "busy"):  # the demo's four HITs, each against its MISS (from the demo's --json)
        demo = results[when]["demo"]
        assert len(demo["hit_speedups"]) == 4 and demo["slowest_hit_speedup"] == min(demo["hit_speedups"]) > 0
