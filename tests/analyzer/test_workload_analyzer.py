"""The workload analyzer and the logs it reads: the replay counts what the engine counts,
the curve's last pool (room for the whole log) never evicts in vLLM's order, the warnings
fire on what they describe, and a bad log gets an error that names the line."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analyzer.request_logs import LogError, Writer, interleave, read_log, write_log
from analyzer.caching_models import SGLang
from analyzer.llama_slots import LlamaCpp
from analyzer.log_replay import LIKE, TokenizedLog, footprint, hit_rate_curve, replay, tokenize_log
from analyzer.workload_analyzer import (HEAD_CHARS, MIN_GROUP, VARIABLE, StartsSeen, VariableStart, first_text,
                                        prefix_tree, variable_starts)

ROOT = Path(__file__).resolve().parents[2]


def small_traffic(seed: int = 0) -> list[dict]:
    """Chat requests behind two short system prompts, a follow-up turn, a tenant with a salt
    and a few unique prompts: sharing, eviction and salts on a pool of a few dozen blocks."""
    w = Writer(seed)
    systems = ["You are a tutor. " + w.words(18), "You answer in one line. " + w.words(10)]
    records = []
    for i in range(24):
        system = systems[i % 3 == 0]
        question = w.sentence(2, 9)
        record = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        if i % 5 == 4:  # the next turn of the same chat: the history comes back
            record["messages"] += [{"role": "assistant", "content": w.words(6)}, {"role": "user", "content": "Why?"}]
        if i % 7 == 6:
            record["cache_salt"] = "tenant-b"
        records.append(record)
        if i % 4 == 3:
            records.append({"prompt": w.words(w.rng.randint(10, 40))})
    return records


@pytest.fixture
def log(tmp_path):
    path = tmp_path / "traffic.jsonl"
    write_log(path, small_traffic())
    return path


@pytest.mark.parametrize("like_engine", [True, False])
def test_the_replay_counts_the_cached_tokens_the_engine_reports(make_engine, tokenizer, log, like_engine):
    requests = read_log(log)
    prompts = tokenize_log(requests, tokenizer)
    salts = [r.cache_salt for r in requests]
    num_blocks = 40
    replayed = replay(prompts, salts, num_blocks, block_size=4, model=LIKE["engine" if like_engine else "vllm"])
    # vLLM's order: one block of the pool is the null block, hashless freed blocks go first.
    engine = make_engine(num_blocks=num_blocks if like_engine else num_blocks - 1, free_uncached_first=not like_engine)
    served = [engine.generate(r.prompt, max_tokens=1, cache_salt=r.cache_salt).cached_tokens for r in requests]
    assert replayed.cached.tolist() == served
    assert replayed.evictions > 0 and replayed.cached_tokens > 0  # the pool is tight, and shared blocks are hit


def test_replies_add_blocks_a_log_does_not_have(make_engine, tokenizer, log):
    """With replies the engine decodes into blocks the replay never sees: on a tight pool
    they evict what the replay keeps, so its counts are those of max_tokens=1."""
    requests = read_log(log)
    replayed = replay(tokenize_log(requests, tokenizer), [r.cache_salt for r in requests], 40, 4, model=LIKE["engine"])
    engine = make_engine(num_blocks=40)
    served = [engine.generate(r.prompt, max_tokens=24, cache_salt=r.cache_salt).cached_tokens for r in requests]
    assert replayed.cached.tolist() != served


def test_the_curves_last_pool_holds_the_whole_log_never_evicts_and_saves_the_most(tokenizer, log):
    requests = read_log(log)
    prompts, salts = tokenize_log(requests, tokenizer), [r.cache_salt for r in requests]
    prints = footprint(prompts, salts, block_size=4)
    curve = hit_rate_curve(prompts, salts, block_size=4)
    last = curve.replays[-1]
    assert last.num_blocks == prints.whole_log_pool and last.evictions == 0
    assert replay(prompts, salts, 10 * last.num_blocks, 4).cached == last.cached  # nothing more to find
    assert curve.replays[0].cached_tokens < last.cached_tokens
    at_working_set = curve.at(curve.working_set)
    assert at_working_set.cached_tokens >= 0.95 * last.cached_tokens
    assert all(r.cached_tokens < 0.95 * last.cached_tokens for r in curve.replays if r.num_blocks < curve.working_set)


def test_a_log_replayed_from_its_file_finds_what_the_prompts_in_memory_find(tokenizer, log):
    """The analyzer keeps a log's token ids in a file and reads them back for every replay: every
    model, the watched replay and the curve count what the same prompts in a list count."""
    requests = read_log(log)
    in_memory, salts = tokenize_log(requests, tokenizer), [r.cache_salt for r in requests]
    with TokenizedLog() as streamed:
        streamed.READ_BYTES = 64  # many reads, prompts split across them
        for ids, salt in zip(in_memory, salts):
            streamed.append(ids, salt)
        assert list(streamed) == in_memory and streamed.salts == salts and list(streamed.lengths) == list(
            map(len, in_memory))
        assert all(a == b for a, b in zip(streamed, streamed))  # two readers taking turns each read in order
        assert [streamed[i] for i in reversed(range(len(streamed)))] == in_memory[::-1]  # and one prompt by its place
        for model in (LIKE["vllm"], LIKE["engine"], SGLang(), LlamaCpp(2)):
            assert replay(streamed, salts, 40, 4, model=model).cached == replay(in_memory, salts, 40, 4,
                                                                                model=model).cached
            assert footprint(streamed, salts, 4, model) == footprint(in_memory, salts, 4, model)
        ours, theirs = (replay(p, salts, 40, 4, watch=True) for p in (streamed, in_memory))
        assert ours.prefix_blocks == theirs.prefix_blocks and ours.hot_misses == theirs.hot_misses
        ours, theirs = (hit_rate_curve(p, salts, block_size=4) for p in (streamed, in_memory))
        assert [(r.num_blocks, r.cached) for r in ours.replays] == [(r.num_blocks, r.cached) for r in theirs.replays]
        assert ours.working_set == theirs.working_set and ours.footprint == theirs.footprint


def test_the_reader_says_how_much_of_the_file_it_has_read(tmp_path):
    from analyzer.request_logs import Log

    path = tmp_path / "big.jsonl.gz"
    with gzip.open(path, "wt") as f:  # 4 MiB of text, a few chunks
        f.writelines(json.dumps({"prompt": "x" * 1000}) + "\n" for _ in range(4096))
    seen = []
    reader = Log([]).stream(path, progress=lambda done, size: seen.append((done, size)))
    assert next(reader).prompt == "x" * 1000 and seen and seen[-1][0] < path.stat().st_size  # read as it goes
    assert sum(1 for _ in reader) == 4095
    assert len(seen) > 2 and seen[-1] == (path.stat().st_size, path.stat().st_size)


def test_a_timestamp_early_in_a_shared_system_prompt_is_found(tokenizer, tmp_path):
    from analyzer.request_logs import chatbot_with_timestamp

    path = tmp_path / "stamped.jsonl"
    write_log(path, chatbot_with_timestamp(n=20))
    (found,) = variable_starts(read_log(path), tokenizer)
    assert found.requests == found.distinct == 20
    assert "09:00:00" in found.examples[0] and "09:00:01" in found.examples[1]
    assert found.tokens_after > 450  # the 500-word prompt after it, computed again every time


def test_prompts_that_differ_after_a_shared_start_are_not_a_warning(tmp_path):
    path = tmp_path / "rag.jsonl"
    from analyzer.request_logs import rag

    write_log(path, rag(n=20, num_documents=2))
    assert variable_starts(read_log(path), tokenizer=None) == []


class StartsInMemory:
    """The reference: StartsSeen as it was, every distinct start and its first text in dicts."""

    def __init__(self) -> None:
        self.groups, self.sizes, self.requests = {}, {}, 0

    def add(self, prompt) -> None:
        self.requests += 1
        if text := first_text(prompt):
            start = text[:HEAD_CHARS]
            blanked = VARIABLE.sub("#", start)
            self.groups.setdefault(blanked, {}).setdefault(start, text)
            self.sizes[blanked] = self.sizes.get(blanked, 0) + 1

    def found(self) -> list[VariableStart]:
        found = []
        for blanked, spellings in self.groups.items():
            size = self.sizes[blanked]
            if size < max(MIN_GROUP, self.requests // 100) or len(spellings) < max(2, size // 2):
                continue
            a, b = (spellings[start] for start in sorted(spellings)[:2])
            position = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            blank_a, blank_b = VARIABLE.sub("#", a), VARIABLE.sub("#", b)
            common = next((i for i, (x, y) in enumerate(zip(blank_a, blank_b)) if x != y),
                          min(len(blank_a), len(blank_b)))
            after = blank_a[len(VARIABLE.sub("#", a[:position])) : common]
            found.append(VariableStart(size, len(spellings), position,
                                       (a[max(0, position - 14):position + 24], b[max(0, position - 14):position + 24]),
                                       len(after.split())))
        return sorted(found, key=lambda v: -v.requests * v.tokens_after)


def stamped_prompts(seed: int = 0) -> list:
    """Two groups of prompts whose starts differ by numbers: one longer than HEAD_CHARS, whose
    starts come back with other tails, one of chats with a lone surrogate; unique prompts between."""
    w = Writer(seed)
    system, short = w.words(450), w.words(40)  # over 2,000 characters, and under
    prompts = []
    for i in range(60):
        prompts.append(f"Time 09:{w.rng.randrange(20):02d}:{i % 4:02d}. {system} {w.sentence(3, 8)}")
        if i % 2:
            prompts.append([{"role": "system", "content": f"Session {w.rng.randrange(10**6)}\ud800 {short}"},
                            {"role": "user", "content": "Hi"}])
        if i % 5 == 0:
            prompts.append(w.words(20))
    return prompts


@pytest.mark.parametrize("recent", [StartsSeen.RECENT, 2], ids=["remembering", "forgetting"])
def test_the_starts_kept_as_digests_and_a_file_find_what_dicts_of_every_start_find(monkeypatch, recent):
    monkeypatch.setattr(StartsSeen, "RECENT", recent)  # a start forgotten is written again: its first text still counts
    seen, reference = StartsSeen(), StartsInMemory()
    for prompt in stamped_prompts():
        seen.add(prompt)
        reference.add(prompt)
    found = seen.found(tokenizer=None)
    assert found == reference.found() and [v.requests for v in found] == [60, 30]
    assert found[0].distinct < 60 and "\ud800" in found[1].examples[0]  # starts sent again; a lone surrogate


def test_a_start_sent_again_with_another_tail_is_shown_by_its_first_text(monkeypatch):
    monkeypatch.setattr(StartsSeen, "RECENT", 1)  # forgotten at once: the second text is written too
    body = "You answer questions about our shop and nothing else. " * 40  # past HEAD_CHARS
    tails = [(0, "Red."), (0, "Blue sky today."), (1, "Blue sky today."), (2, "a"), (3, "b"), (4, "c")]
    results = []
    for order in (tails, [tails[1], tails[0], *tails[2:]]):
        seen, reference = StartsSeen(), StartsInMemory()
        for second, tail in order:
            seen.add(f"Time 09:00:0{second}. {body}{tail}")
            reference.add(f"Time 09:00:0{second}. {body}{tail}")
        (found,) = seen.found(tokenizer=None)
        assert [found] == reference.found()
        results.append(found.tokens_after)
    assert results[0] < results[1]  # "Blue sky today." first: the two examples share three words more


def test_lru_evicting_a_hot_prefix_in_a_burst_is_recorded(tokenizer):
    w = Writer(1)
    system = w.words(60)
    chats = [system + " " + w.sentence(3, 6) for _ in range(12)]
    burst = [w.words(70) for _ in range(6)]
    prompts = [tokenizer.encode(p) for p in chats[:10] + burst + chats[10:]]
    tight = replay(prompts, [None] * len(prompts), 40, 4, model=LIKE["engine"], watch=True)
    (miss,) = tight.hot_misses
    assert miss.request == 16 and miss.hits_before == 9 and miss.since_last_hit == 6
    roomy = replay(prompts, [None] * len(prompts), 400, 4, model=LIKE["engine"], watch=True)
    assert roomy.hot_misses == []


def test_the_prefix_tree_shows_the_shared_system_prompt(tokenizer, log):
    from rich.console import Console

    requests = read_log(log)
    result = replay(tokenize_log(requests, tokenizer), [r.cache_salt for r in requests], 400, 4, watch=True)
    console = Console(record=True, width=200)
    console.print(prefix_tree(result, tokenizer.decode))
    text = console.export_text()
    # Both system prompts start "<|im_start|>system\nYou" (one block), then part ways.
    root_hits = max(b.hits for b in result.prefix_blocks.values() if b.parent is None)
    assert f"hit by {root_hits:,}: <|im_start|>system\\nYou\n" in text
    assert ": are a tutor." in text.replace(":  are", ": are") and "answer in one line." in text


def test_sharegpt_conversations_give_one_request_per_user_turn_and_interleave(tmp_path):
    path = tmp_path / "chats.json"
    conversation = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                    {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "Bye"}]
    path.write_text(json.dumps([{"conversations": conversation}, {"conversations": conversation[:2]}]))
    requests = read_log(path)
    assert [len(r.prompt) for r in requests] == [2, 4, 2]
    assert requests[1].prompt[2] == {"role": "assistant", "content": "Hello!"}
    assert [r.where for r in interleave(requests, 2)] == [
        "chats.json, record 1, turn 2", "chats.json, record 2, turn 2", "chats.json, record 1, turn 4"]


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not valid JSON"),
    ('{"model": "m"}', "line 2: no 'messages', 'prompt' or 'conversations'"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "line 2: unknown chat role 'robot'"),
    ('{"prompt": "Hi", "cache_salt": "a/b"}', "line 2: cache_salt must not contain '/'"),
    ('{"conversations": [{"from": "gpt", "value": "Hi"}]}', "line 2: the conversation has no human turn"),
    ('{"body": {"prompt": ""}}', "line 2: the prompt is empty"),
])
def test_a_bad_record_is_refused_with_its_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(LogError, match=message.replace("(", r"\(")):
        read_log(path)


@pytest.mark.subprocess
def test_the_command_reports_the_curve_and_writes_the_plot(tmp_path):
    plot = tmp_path / "curve.png"
    result = subprocess.run(
        [sys.executable, "prefix_caching.py", "--analyze", "lessons/data/chatbot_with_timestamp.jsonl.xz",
         "--plot", str(plot)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "COLUMNS": "250"},
    )
    assert result.returncode == 0, result.stderr
    assert "Working set:" in result.stdout and "150 prompts start alike but for numbers" in result.stdout
    assert plot.stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (["none.jsonl"], "no such file"),
    (["lessons/data/chatbot.jsonl.xz", "--model", "no/such-model"], "could not load the model 'no/such-model'"),
    (["lessons/data/chatbot.jsonl.xz", "--num-blocks", "3"], "--num-blocks 3 cannot hold the longest prompt"),
    (["lessons/data/chatbot.jsonl.xz", "--chat-template", "none.jinja"], "--chat-template none.jinja: No such file"),
])
@pytest.mark.subprocess
def test_the_command_refuses_what_it_cannot_use_without_a_traceback(args, message):
    result = subprocess.run([sys.executable, "prefix_caching.py", "--analyze", *args], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_example_logs_are_what_the_command_writes(tmp_path):
    from analyzer.request_logs import EXAMPLE_LOGS, OTHER_LOGS

    result = subprocess.run([sys.executable, "-m", "analyzer.request_logs", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)  # the command docs/analyzer.md gives
    assert result.returncode == 0, result.stderr
    names = [*EXAMPLE_LOGS, *OTHER_LOGS]
    for name in names:
        assert (tmp_path / name).read_bytes() == (ROOT / "lessons" / "data" / name).read_bytes(), name
    assert sum((ROOT / "lessons" / "data" / name).stat().st_size for name in names) < 500_000  # small in git


@pytest.mark.subprocess
def test_the_analyzer_benchmark_times_a_log_it_keeps(tmp_path):
    from benchmarks import analyzer

    # This checkout as its own baseline: the same curve, and its own report's times read back.
    results = analyzer.main(["--quick", "--logs", str(tmp_path), "--json", str(tmp_path / "out.json"),
                             "--baseline", str(ROOT)])
    (run,) = json.loads((tmp_path / "out.json").read_text())
    assert run["requests"] == 1_000 and 400_000 < run["prompt_tokens"] < 600_000  # about 500 tokens a request
    assert run["seconds"] >= run["reading_and_tokenizing_s"] > 0 and run["working_set_blocks"] > 0
    assert run["same_curve"] and run["baseline_analysis_s"] >= run["baseline_reading_and_tokenizing_s"] > 0
    assert len(read_log(tmp_path / "chat_1000.jsonl")) == 1_000
    assert results == [run]


@pytest.mark.subprocess
def test_the_analyzer_benchmark_measures_the_peak_memory_of_a_big_log(tmp_path):
    from benchmarks import analyzer

    (run,) = analyzer.main(["--log-size", "300KiB", "--logs", str(tmp_path), "--baseline", str(ROOT),
                            "--json", str(tmp_path / "out.json")])
    assert run["log_mib"] == 0.3 and 100 < run["requests"] < 200  # 300 KiB of chat requests of about 2 KiB
    assert run["this_peak_rss_mib"] > 0 and run["baseline_peak_rss_mib"] > 0 and run["same_curve"]
    assert run["this_prompt_tokens"] == run["baseline_prompt_tokens"] > 50_000
    assert json.loads((tmp_path / "out.json").read_text())["requests"] == run["requests"]


def test_the_distinct_chat_log_sends_no_text_twice_and_is_about_the_size_asked(tmp_path):
    from benchmarks.analyzer import distinct_chat_log, main

    path = tmp_path / "distinct.jsonl"
    requests = distinct_chat_log(path, 300_000)
    lines = path.read_text().splitlines()
    assert len(lines) == requests and 100 < requests < 200  # chat requests of about 2 KiB
    assert 300_000 <= path.stat().st_size < 300_000 + len(lines[-1]) + 1  # it stops at the first record past the size
    texts = [message["content"] for line in lines for message in json.loads(line)["messages"]]
    assert len(set(texts)) == len(texts) == 2 * requests  # every system prompt and every question new
    with pytest.raises(SystemExit):
        main(["--distinct"])  # a kind of --log-size log


@pytest.mark.subprocess
def test_the_analyzer_benchmark_measures_the_peak_memory_of_a_distinct_log(tmp_path):
    from benchmarks import analyzer

    (run,) = analyzer.main(["--log-size", "200KiB", "--distinct", "--logs", str(tmp_path)])
    log = tmp_path / f"chat_distinct_{200 * 1024}_bytes.jsonl"
    assert len(read_log(log)) == run["requests"] and run["log_mib"] == 0.2 and run["this_peak_rss_mib"] > 0
    assert run["this_prompt_tokens"] > 400 * run["requests"] and len(set(log.read_text().splitlines())) == run["requests"]
    assert run["this_curve"][-1][1] == "0.0%"  # nothing to find again: no text comes back


@pytest.mark.subprocess
@pytest.mark.parametrize("flags", [["--parallel", "2", "--ctx-size", "512"], ["--ctx-size", "256"]],
                         ids=["two slots", "one unified cache"])
def test_the_llamacpp_command_with_refusals_prints_what_replay_counts(tmp_path, tokenizer, flags):
    # The command streams the log into a TokenizedLog, which has lengths but no prompt by index:
    # a refused request once crashed it here. Its figures must be replay's on the same prompts.
    # A slot holds 256 tokens with either flags (llama-server rounds -c up to 256 a slot).
    w, log = Writer(3), tmp_path / "long_and_short.jsonl"
    shared = w.words(120)
    write_log(log, [{"prompt": shared + " " + w.words(n)} for n in (10, 150, 20, 200, 15, 5)])
    parallel = int(flags[1]) if flags[0] == "--parallel" else None
    model = LlamaCpp(parallel or 4, kv_unified=parallel is None, n_ctx=int(flags[-1]))
    requests = read_log(log)
    prompts = tokenize_log(requests, tokenizer)
    with TokenizedLog() as streamed:
        for prompt, request in zip(prompts, requests):
            streamed.append(prompt, request.cache_salt)
        expected = replay(streamed, streamed.salts, 64, 16, model=model)
    assert expected.refused and len(expected.refused) < len(prompts), "the flags must refuse some requests, not all"
    assert expected.prompt_tokens == sum(map(len, prompts)) - sum(len(prompts[i]) for i in expected.refused)
    result = subprocess.run([sys.executable, "prefix_caching.py", "--analyze", str(log), "--like", "llamacpp",
                             "--num-blocks", "64", *flags], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "250"})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    out = " ".join(result.stdout.split())
    assert (f"At 64 blocks (--num-blocks): hit rate {expected.hit_rate:.1%}, {expected.cached_tokens:,} of "
            f"{expected.prompt_tokens:,} prompt tokens not computed again") in out, out[-3000:]
    assert f"{len(expected.refused):,} of {len(prompts):,} requests refused" in out, out[-3000:]
    first = expected.refused[0]
    assert f"Requests {first} ({len(prompts[first]):,} tokens)" in out


@pytest.mark.subprocess
def test_the_llamacpp_command_names_the_cached_prompts_that_found_no_room(tmp_path, tokenizer):
    # -c 512, one unified KV cache: A (300 tokens) and B (330, nothing shared) each
    # come back from the prompt cache beside the other's sequence, which leaves no room for
    # them; llama-server computes them whole. The command must say so and count what replay does.
    w, log = Writer(5), tmp_path / "two_long.jsonl"
    a, b = w.words(300), w.words(330)
    write_log(log, [{"prompt": text} for text in (a, b, a + " again", b + " again")])
    requests = read_log(log)
    with TokenizedLog() as streamed:
        for prompt, request in zip(tokenize_log(requests, tokenizer), requests):
            streamed.append(prompt, request.cache_salt)
        expected = replay(streamed, streamed.salts, 64, 16, model=LlamaCpp(n_ctx=512, n_ctx_train=8192))
        roomy = replay(streamed, streamed.salts, 64, 16, model=LlamaCpp(n_ctx=1024, n_ctx_train=8192))
    assert expected.unrestored.tolist() == [2, 3] and expected.cached_tokens == 0 and not expected.refused
    assert roomy.cached_tokens > 0 and not roomy.unrestored  # the same log where both fit
    result = subprocess.run([sys.executable, "prefix_caching.py", "--analyze", str(log), "--like", "llamacpp",
                             "--num-blocks", "64", "--ctx-size", "512"], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, env={**os.environ, "COLUMNS": "250"})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    out = " ".join(result.stdout.split())
    assert "At 64 blocks (--num-blocks): hit rate 0.0%, 0 of" in out, out[-3000:]
    assert ("2 of 4 requests found a cached prompt that did not fit in the 512 KV cells beside what the other slots "
            "held") in out and f"requests 2 ({streamed.lengths[2]:,} tokens), 3 (" in out, out[-3000:]


@pytest.mark.subprocess
@pytest.mark.parametrize("like, suffix", [("vllm", ".jsonl"), ("engine", ".jsonl.xz"), ("sglang", ".jsonl.gz")])
def test_the_command_as_typed_prints_what_replay_counts_for_each_server(tmp_path, tokenizer, like, suffix):
    # Each caching model at its defaults, on a log compressed or not, through the command a user
    # types: the streamed log it builds, replayed, against replay on the same streamed type.
    log = tmp_path / f"traffic{suffix}"
    write_log(log, small_traffic())
    requests = read_log(log)
    with TokenizedLog() as streamed:
        for prompt, request in zip(tokenize_log(requests, tokenizer), requests):
            streamed.append(prompt, request.cache_salt)
        expected = replay(streamed, streamed.salts, 24, 16, model=LIKE[like])
    assert 0 < expected.cached_tokens < expected.prompt_tokens and expected.evictions  # a pool that hits and evicts
    result = subprocess.run([sys.executable, "prefix_caching.py", "--analyze", str(log), "--like", like,
                             "--num-blocks", "24"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "250"})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    out = " ".join(result.stdout.split())
    assert (f"At 24 blocks (--num-blocks): hit rate {expected.hit_rate:.1%}, {expected.cached_tokens:,} of "
            f"{expected.prompt_tokens:,} prompt tokens not computed again, {expected.evictions:,} evictions") in out, (
        out[-3000:])
