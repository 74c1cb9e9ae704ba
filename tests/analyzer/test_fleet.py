"""The fleet prediction's rules, replayed by hand on tiny examples: what the router reads of a
request, its tree of text, each policy's pick, what it does with a cache_salt, and the
replicas' pools side by side (analyzer/fleet.py cites the router's files for each rule).
benchmarks/fleet.py checks the same rules against the real router, request by request."""

import json
import random
import threading
import urllib.request
from array import array
from http.server import ThreadingHTTPServer

import pytest

from analyzer.fleet import (
    CacheAware, NotRoutable, PowerOfTwo, RoundRobin, RouterFlags, TextTree, route_log, routed_requests,
    routing_text,
)
from analyzer.request_logs import LoggedRequest, write_log
from analyzer.log_replay import LIKE
from analyzer.fleet_replay import replay_fleet
from analyzer.workload_analyzer import main
from helpers import StubWorker


def chat(*contents: str, salt: str | None = None, where: str = "line 1") -> LoggedRequest:
    roles = ["system", "user", "assistant"]
    return LoggedRequest([{"role": roles[i % 3], "content": c} for i, c in enumerate(contents)], salt, where)


# --- 1. the routing text ------------------------------------------------------------------------


def test_a_chat_is_routed_on_its_contents_joined_by_a_space_and_a_completion_on_its_prompt():
    assert routing_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": ""}, {"role": "user", "content": "Why?"}]) == "Be brief. Hi Why?"
    assert routing_text("Once upon a time") == "Once upon a time"
    with pytest.raises(NotRoutable, match="token ids"):
        routing_text([1, 2, 3])


def test_a_completions_request_with_a_list_of_prompts_is_routed_once_and_only_a_chat_loses_its_salt():
    log = [LoggedRequest("a", "t", "line 1"), LoggedRequest("b", "t", "line 1"), LoggedRequest("c", None, "line 2"),
           chat("s", "q", salt="t", where="line 3"), chat("s", "q", where="line 3")]
    routed = routed_requests(log)
    assert [(r.requests, r.text, r.keeps_salt) for r in routed] == [
        ([0, 1], "a b", True), ([2], "c", True), ([3], "s q", False), ([4], "s q", False)]


# --- 2. the text tree ---------------------------------------------------------------------------


def test_the_tree_counts_shared_characters_as_a_loop_over_them_would():
    # tree.rs's shared_prefix_count, which the tree reads through caching_models.common_prefix
    from analyzer.caching_models import common_prefix

    rng = random.Random(0)
    for _ in range(2000):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 40)))
        b = a[: rng.randrange(0, len(a) + 1)] + "".join(rng.choice("ab") for _ in range(rng.randrange(0, 10)))
        naive = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == common_prefix(b, a) == naive, (a, b)


def test_the_tree_splits_where_texts_part_and_names_the_replica_that_created_the_text_matched():
    tree = TextTree()
    tree.insert("abcd", 0)
    tree.insert("abxy", 1)  # "ab" splits off "cd"; the upper half keeps its creator, 0
    assert tree.match("abq") == (2, 0)
    assert tree.match("abxz") == (3, 1)  # partly into "xy": still that node's creator
    assert tree.match("zzz") == (0, None)
    assert tree.chars == {0: 4, 1: 4}  # "abcd"; "ab" (passed through) and "xy"


def test_the_text_matched_belongs_to_its_first_sender_not_its_last():
    tree = TextTree()
    tree.insert("hello world", 2)
    tree.insert("hello world", 0)
    tree.insert("hello", 1)
    assert tree.match("hello world") == (11, 2)
    assert tree.match("hello") == (5, 2)


# --- 3. the policies ----------------------------------------------------------------------------


def test_cache_aware_follows_the_text_only_above_the_threshold_else_the_least_loaded_first_of_equals():
    policy = CacheAware(3, cache_threshold=0.5)
    policy.tree.insert("abcde", 2)
    assert policy.route("abcdeXXXXX").replica == 0  # 5 of 10 characters: not above 0.5
    assert policy.tree.match("abcdeXXXXX") == (10, 0)  # inserted under replica 0: "XXXXX" is its
    assert policy.tree.match("abcde") == (5, 2)  # "abcde" is still replica 2's
    policy.tree.insert("abcdef", 2)
    choice = policy.route("abcdefYYYY")  # 6 of 10
    assert (choice.replica, choice.match_rate) == (2, pytest.approx(0.6))
    assert CacheAware(3).route("").replica == 0  # an empty text matches nothing


def test_one_request_at_a_time_cache_aware_sends_everything_to_the_first_replica():
    log = [chat("You are a tutor.", f"Question {i}?") for i in range(4)] + [LoggedRequest("unrelated text", None, "x")]
    assert route_log(log, 3, RouterFlags("cache_aware")).replica == [0, 0, 0, 0, 0]


def test_with_requests_in_flight_a_low_match_goes_to_the_least_loaded_and_balancing_overrides_the_tree():
    policy = CacheAware(3, loads=[1, 0, 0])
    assert policy.route("new text").replica == 1  # the least loaded: the first of the idle ones
    policy.loads = [70, 0, 0]  # 70 - 0 > 64 and 70 > 0 x 1.5: imbalanced
    policy.tree.insert("system prompt", 0)
    assert policy.route("system prompt").replica == 1
    policy.loads = [70, 10, 10]  # 60 is not above 64: the tree decides
    assert policy.route("system prompt").replica == 0


def test_round_robin_counts_through_the_replicas_in_order():
    policy = RoundRobin(3)
    assert [policy.route("same text").replica for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_power_of_two_with_equal_loads_takes_its_first_draw():
    rng = random.Random(7)
    expected = []
    for _ in range(20):
        expected.append(rng.randrange(4))
        rng.randrange(3)  # the second replica, drawn and never taken on a tie
    policy = PowerOfTwo(4, random.Random(7))
    assert [policy.route("x").replica for _ in range(20)] == expected
    assert PowerOfTwo(1).route("x").replica == 0


def test_random_draws_every_replica_from_its_seed_and_says_its_picks_are_not_the_routers():
    log = [LoggedRequest("x", None, f"{i}") for i in range(60)]
    routing = route_log(log, 3, RouterFlags("random", seed=1))
    assert routing.replica == route_log(log, 3, RouterFlags("random", seed=1)).replica
    assert set(routing.replica) == {0, 1, 2} and not routing.predictable
    assert route_log(log, 3, RouterFlags("round_robin")).predictable


def test_a_tree_past_max_tree_size_is_flagged_where_it_passes():
    log = [LoggedRequest("a" * 10, None, "1"), LoggedRequest("b" * 10, None, "2"), LoggedRequest("c" * 10, None, "3")]
    assert route_log(log, 2, RouterFlags("cache_aware", max_tree_size=15)).over_tree_size == 1
    assert route_log(log, 2, RouterFlags("cache_aware")).over_tree_size is None


def test_bad_router_flags_are_refused_with_what_to_give():
    with pytest.raises(ValueError, match="--router must be one of"):
        RouterFlags("least_busy")
    with pytest.raises(ValueError, match="from 0 to 1"):
        RouterFlags(cache_threshold=1.5)


# --- 4. the replicas' pools ----------------------------------------------------------------------


def test_each_replica_caches_only_what_it_was_sent():
    shared = list(range(32))  # two blocks of 16
    prompts = [array("I", shared + [i]) for i in range(4)]
    log = [LoggedRequest(f"text {i}", None, f"{i}") for i in range(4)]
    routing = route_log(log, 2, RouterFlags("round_robin"))
    fleet = replay_fleet(prompts, [None] * 4, routing, num_blocks=8, block_size=16)
    assert fleet.cached.tolist() == [0, 0, 32, 32]  # each replica computes the shared blocks once
    assert [len(r.cached) for r in fleet.replays] == [2, 2]


def test_the_router_ignores_salts_and_drops_a_chats_while_a_completions_salt_separates_the_replicas_pool():
    shared = list(range(32))
    prompts = [array("I", shared + [i]) for i in range(2)]
    chats = [chat("the same system prompt", "q", salt="student-a"), chat("the same system prompt", "q", salt="student-b")]
    routing = route_log(chats, 2, RouterFlags("cache_aware"))
    assert routing.replica == [0, 0]  # the same text: the same replica, whatever the salt
    fleet = replay_fleet(prompts, ["student-a", "student-b"], routing, num_blocks=8, block_size=16)
    assert fleet.cached.tolist() == [0, 32]  # the salt never reached the replica: the pool shares
    completions = [LoggedRequest("same text", "student-a", "1"), LoggedRequest("same text", "student-b", "2")]
    routing = route_log(completions, 2, RouterFlags("cache_aware"))
    assert routing.replica == [0, 0] and routing.keeps_salt == [True, True]
    fleet = replay_fleet(prompts, ["student-a", "student-b"], routing, num_blocks=8, block_size=16)
    assert fleet.cached.tolist() == [0, 0]  # the replica's pool keeps the tenants apart
    sglang = replay_fleet(prompts, ["student-a", "student-b"], routing, num_blocks=8, block_size=16,
                          model=LIKE["sglang"])
    assert sglang.cached.tolist() == [0, 0]


# --- 5. the command ------------------------------------------------------------------------------


def test_the_command_predicts_a_fleet_and_writes_each_requests_prediction(tmp_path, capsys):
    log = tmp_path / "chats.jsonl"
    write_log(log, [{"messages": [{"role": "system", "content": "You are a tutor. " * 20},
                                  {"role": "user", "content": f"Question number {i}?"}]} for i in range(6)])
    out = tmp_path / "fleet.json"
    main([str(log), "--replicas", "2", "--router", "round_robin", "--num-blocks", "64", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "2 replicas" in printed and "fleet" in printed
    written = json.loads(out.read_text())
    assert [r["replica"] for r in written["requests"]] == [0, 1, 0, 1, 0, 1]
    assert written["total"]["cached_tokens"] == sum(r["cached_tokens"] for r in written["requests"]) > 0
    assert [p["requests"] for p in written["per_replica"]] == [3, 3]
    assert written["requests"][0]["cached_tokens"] == written["requests"][1]["cached_tokens"] == 0


def test_json_without_replicas_is_refused(tmp_path, capsys):
    log = tmp_path / "one.jsonl"
    write_log(log, [{"prompt": "hello there"}])
    with pytest.raises(SystemExit):
        main([str(log), "--json", str(tmp_path / "x.json")])
    assert "give --replicas N too" in capsys.readouterr().err


# --- 6. the tree's rules against the real router, with requests held in flight --------------------
#
# One request at a time the real router sends everything to one replica (benchmarks/fleet.py
# checks that), which leaves the tree's rules unseen. Here workers that hold a request until
# told to make loads differ: then a low match goes to the first idle replica, and a later
# text follows the replica that first sent it. A request held by a worker has been routed, and
# counts as load, from the moment the worker has it (the router adds the load as it picks);
# a request answered has freed it (a reply not streamed frees it before the router answers).

HOLD = " [hold]"


class HoldingWorker(StubWorker):
    """A worker that names itself in each reply, and holds a prompt that ends with HOLD until
    `release` is set."""

    model_name = "m"
    arrived = threading.Semaphore(0)
    release = threading.Event()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.arrived.release()
        if body["prompt"].endswith(HOLD):
            assert self.release.wait(60)
        self.reply({"id": str(self.server.server_port), "object": "text_completion", "model": "m",
                    "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.mark.router
def test_with_loads_held_the_real_router_picks_what_the_model_picks():
    from benchmarks.router import router

    HoldingWorker.arrived, HoldingWorker.release = threading.Semaphore(0), threading.Event()
    workers = [ThreadingHTTPServer(("127.0.0.1", 0), HoldingWorker) for _ in range(3)]
    for worker in workers:
        threading.Thread(target=worker.serve_forever, daemon=True).start()
    # (text, held?): four texts sent while others are held, then texts that follow them or not
    steps = [("apples " * 10 + HOLD, True), ("bananas " * 10, False), ("cherries " * 10 + HOLD, True),
             ("dates " * 10, False), None,  # None: release the held requests
             ("apples " * 10 + "and more", False), ("dates " * 10 + "x", False), ("cherries " * 10 + "y", False),
             ("bananas " * 10 + "z", False), ("eggs " * 10, False),
             ("dates dates " + "q" * 40, False),  # 12 of 52 characters: under the threshold, the first replica
             ("dates dates dates " + "q" * 20, False)]  # 18 of 38: above it, dates' replica
    model = CacheAware(3)
    predicted, real, held = [], {}, []  # real: the worker's port of each request, by its place
    try:
        with router([f"http://127.0.0.1:{w.server_port}" for w in workers], "cache_aware") as url:
            def send(i: int, text: str) -> None:
                request = urllib.request.Request(url + "/v1/completions", json.dumps(
                    {"model": "m", "prompt": text, "max_tokens": 1}).encode(), {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=60) as response:
                    real[i] = int(json.load(response)["id"])

            for step in steps:
                if step is None:
                    HoldingWorker.release.set()
                    for thread in held:
                        thread.join(60)
                    model.loads = [0, 0, 0]
                    continue
                text, hold = step
                choice = model.route(text)
                predicted.append(choice.replica)
                if hold:
                    model.loads[choice.replica] += 1
                    held.append(threading.Thread(target=send, args=(len(predicted) - 1, text)))
                    held[-1].start()
                    assert HoldingWorker.arrived.acquire(timeout=60)  # routed, and counted as load
                else:
                    send(len(predicted) - 1, text)
                    assert HoldingWorker.arrived.acquire(timeout=60)
    finally:
        HoldingWorker.release.set()
        for worker in workers:
            worker.shutdown()
    assert predicted == [0, 1, 1, 2, 0, 2, 1, 1, 0, 0, 2]
    order = {}  # the router's order of its workers: each named by the first request it took
    for i, replica in enumerate(predicted):
        order.setdefault(replica, real[i])
    assert [order[replica] for replica in predicted] == [real[i] for i in range(len(predicted))]
    assert len(set(order.values())) == 3


@pytest.mark.router
def test_the_fleet_benchmark_finds_the_prediction_equal_to_the_real_router_where_it_does_not_draw(tmp_path):
    from benchmarks.fleet import main as bench

    out = tmp_path / "fleet.json"
    runs = bench(["--replicas", "2", "--policies", "round_robin", "cache_aware", "--requests", "12", "--num-blocks",
                  "200", "--json", str(out)])
    assert [(r["log"].split()[0], r["policy"]) for r in runs] == [
        ("multi_turn", "round_robin"), ("multi_turn", "cache_aware"), ("agent", "round_robin"), ("agent", "cache_aware")]
    for run in runs:
        assert run["requests"] == run["both"] == run["same_prompt_tokens"] == 12, run["log"]
    assert json.loads(out.read_text())["runs"][0]["per_request"][0]["cached"] == 0


@pytest.mark.router
def test_the_fleet_benchmark_sends_requests_in_flight_and_compares_runs_with_each_other(tmp_path):
    # Three at a time through the real router, twice, on a class's fleet (keyed replicas behind
    # the router and the door, each tenant sending with a student's key): every request is seen
    # by exactly one replica (replay_in_flight raises otherwise) with its whole prompt counted,
    # each run after the first is compared with the first, and both predictions salt every
    # request by its key.
    from benchmarks.fleet import main as bench

    out = tmp_path / "fleet.json"
    runs = bench(["--replicas", "2", "--policies", "cache_aware", "--requests", "9", "--num-blocks", "200",
                  "--in-flight", "3", "--runs", "2", "--keys", "--logs", "agent", "--json", str(out)])
    assert [(r["log"], r["run"]) for r in runs] == [("agent", 1), ("agent", 2)]
    for run in runs:
        assert run["same_prompt_tokens"] == 9 and 0 <= run["like_run_1"]["both"] <= 9
        assert run["run"] == 2 or run["like_run_1"]["both"] == 9  # the first run is its own reference
        assert 0 <= run["in_time"]["both"] <= 9 and 0 <= run["hit_rate_in_time"] <= 1  # the prediction in time
    # six agents, each its own tenant, the first three in flight together: none shares a cached block
    assert all(r["cached"] == 0 for r in runs[0]["per_request"][:3])
    written = json.loads(out.read_text())
    assert written["in_flight"] == 3 and written["keys"] is True
    service = written["service"]  # measured before the runs, on this fleet
    assert service["max_num_batched_tokens"] == 2048 and service["step_ms"] > 0 and service["gap_ms"] >= 0


@pytest.mark.model  # importing benchmarks.fleet loads the server, torch and transformers (seconds, when first)
def test_a_replica_notes_the_seed_of_each_request_and_hands_its_app_the_body_unread():
    import io

    from benchmarks.fleet import noting

    bodies = []

    def app(environ, start_response):
        bodies.append(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))
        return [b""]

    served: dict[int, list[int]] = {}
    wrapped = noting(app, served, 2)
    for body in (b'{"prompt": "Hi", "seed": 7}', b"not json", b'["a list"]', b""):
        wrapped({"CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body)}, None)
    assert bodies == [b'{"prompt": "Hi", "seed": 7}', b"not json", b'["a list"]', b""] and served == {7: [2]}


def test_the_agent_log_grows_each_sessions_history_and_gives_each_session_its_own_salt():
    from analyzer.request_logs import agent

    records = agent(n=4, at_once=2)
    sessions: dict[str, list[list[dict]]] = {}
    for record in records:
        sessions.setdefault(record["cache_salt"], []).append(record["messages"])
    assert len(sessions) == 4
    for steps in sessions.values():
        for before, after in zip(steps, steps[1:]):
            assert after[: len(before)] == before and len(after) == len(before) + 2  # an action and its output
    assert [r["cache_salt"] for r in records[:4]] == ["customer-0", "customer-1", "customer-0", "customer-1"]
