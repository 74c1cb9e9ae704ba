"""A fleet replayed in time (analyzer/fleet_replay.py, replay_in_time): one client at a time it is
the replay one request after another, request by request; with requests in flight the router
sees loads, a replica's requests share its steps, and the command says what it modelled.
benchmarks/fleet.py checks it against the real router with requests in flight."""

import json
import os
import random
import subprocess
import sys
from array import array
from pathlib import Path

import pytest

from analyzer.fleet import POLICIES, RouterFlags, route_log
from analyzer.fleet_replay import TRUST, Service, replay_fleet, replay_in_time
from analyzer.log_replay import LIKE
from analyzer.request_logs import LoggedRequest, write_log
from analyzer.workload_analyzer import main


def random_log(rng: random.Random, n: int) -> tuple[list[LoggedRequest], list[array]]:
    """Texts and token ids over a few shared prefixes, so pools hit and evict."""
    heads = [[rng.randrange(50) for _ in range(rng.choice([8, 16, 40]))] for _ in range(4)]
    log, prompts = [], []
    for i in range(n):
        head = rng.randrange(len(heads))
        tail = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        log.append(LoggedRequest(f"head {head} " + " ".join(map(str, tail)), None, f"line {i + 1}"))
        prompts.append(array("I", heads[head] + tail))
    return log, prompts


@pytest.mark.parametrize("seed", range(6))
def test_one_client_at_a_time_is_the_replay_one_request_after_another(seed):
    """Loads are 0 whenever the router picks, and each request finds what the one before left,
    whatever the budget chunks: the same replica and cached tokens for every request."""
    rng = random.Random(seed)
    log, prompts = random_log(rng, 60)
    for policy in POLICIES:
        for like in ("vllm", "engine"):
            flags = RouterFlags(policy, seed=seed)
            budget = rng.choice([4, 16, 2048])
            service = Service(max_num_batched_tokens=budget, max_num_seqs=min(budget, 8))
            serial = replay_fleet(prompts, [None] * 60, route_log(log, 3, flags), 24, 4, LIKE[like])
            in_time, timeline = replay_in_time(log, prompts, [None] * 60, 3, flags, 24, 4, 1, service, LIKE[like])
            assert in_time.routing.replica == serial.routing.replica, (policy, like)
            assert in_time.cached.tolist() == serial.cached.tolist(), (policy, like)
            assert set(timeline.loads_seen) == {(0, 0, 0)}
            assert timeline.sent == sorted(timeline.sent) and all(a > s for s, a in zip(timeline.sent, timeline.answered))


def test_with_requests_in_flight_a_low_match_goes_to_the_least_loaded_replica():
    """cache_aware one at a time sends two unrelated texts to replica 0 (both find it idle); with
    two in flight the second finds replica 0 busy and goes to replica 1, and a later request
    follows its text to the replica that first sent it."""
    log = [LoggedRequest(text, None, f"line {i + 1}") for i, text in enumerate(
        ["alpha " * 20, "omega " * 20, "alpha " * 20 + "more", "omega " * 20 + "more"])]
    prompts = [array("I", [i % 2] * 20 + [7] * (i // 2)) for i in range(4)]
    serial = route_log(log, 2, RouterFlags("cache_aware"))
    assert serial.replica == [0, 0, 0, 0]
    fleet, timeline = replay_in_time(log, prompts, [None] * 4, 2, RouterFlags("cache_aware"), 32, 4, in_flight=2)
    assert fleet.routing.replica == [0, 1, 0, 1]
    assert timeline.loads_seen[:2] == [(0, 0), (1, 0)]
    assert fleet.in_flight == 2


def test_requests_in_flight_share_a_replicas_steps_and_leave_its_pool_whole():
    """Three clients on one replica with a budget of 8 tokens a step: prompts come in chunks,
    requests overlap in time, every block is back in the free queue at the end, and each
    request's hit is at most its prompt less one token."""
    rng = random.Random(7)
    log, prompts = random_log(rng, 40)
    service = Service(max_num_batched_tokens=8, max_num_seqs=8, step_ms=1.0, token_ms=0.1, gap_ms=0.5)
    fleet, timeline = replay_in_time(log, prompts, [None] * 40, 1, RouterFlags("round_robin"), 40, 4, 3, service)
    overlapping = sum(1 for i in range(1, 40) if timeline.sent[i] < timeline.answered[i - 1])
    assert overlapping > 10
    assert timeline.steps[0] >= sum(len(p) - c for p, c in zip(prompts, fleet.cached)) // 8
    assert all(c <= len(p) - 1 for c, p in zip(fleet.cached, prompts))
    assert fleet.replays[0].cached.tolist() == fleet.cached.tolist()
    assert fleet.hit_rate > 0


def test_on_a_keyed_fleet_every_salt_reaches_its_replica_which_the_router_drops_from_a_chat():
    """Two tenants' chats with one system prompt on one replica: through the router a chat's
    cache_salt is dropped, so the second hits the first's blocks; on a class's fleet each is
    salted by its key at the replica, and nothing is shared."""
    log = [LoggedRequest([{"role": "user", "content": "same"}], tenant, f"line {i + 1}")
           for i, tenant in enumerate(["student-a", "student-b"])]
    prompts = [array("I", list(range(32)) + [i]) for i in range(2)]
    open_fleet, _ = replay_in_time(log, prompts, ["student-a", "student-b"], 1, RouterFlags(), 16, 16, 1)
    keyed, _ = replay_in_time(log, prompts, ["student-a", "student-b"], 1, RouterFlags(), 16, 16, 1, keyed=True)
    assert open_fleet.cached.tolist() == [0, 32] and open_fleet.routing.keeps_salt == [False, False]
    assert keyed.cached.tolist() == [0, 0] and keyed.routing.keeps_salt == [True, True]


def test_requests_that_arrive_together_run_in_the_order_made_unless_ties_are_drawn():
    """Two clients send their first requests at the same moment to an idle replica: the first
    to arrive starts a step alone, the other waits for the next. In the order made, the first
    client's goes first; drawn, either may."""
    log = [LoggedRequest(f"line {i}", None, f"line {i + 1}") for i in range(2)]
    prompts = [array("I", [i] * 20) for i in range(2)]

    def first_answered(ties):
        _, timeline = replay_in_time(log, prompts, [None] * 2, 1, RouterFlags(), 16, 4, 2, ties=ties)
        assert timeline.sent == [0.0, 0.0]
        return 0 if timeline.answered[0] < timeline.answered[1] else 1

    assert first_answered(None) == 0
    assert {first_answered(seed) for seed in range(16)} == {0, 1}


def test_bad_arguments_are_refused_before_anything_runs():
    log, prompts = [LoggedRequest("a b", None, "line 1")], [array("I", range(40))]
    with pytest.raises(ValueError, match="usable blocks"):
        replay_in_time(log, prompts, [None], 1, RouterFlags(), 5, 4, 2)  # 10 blocks of 4 in a pool of 4
    with pytest.raises(ValueError, match="--like vllm or engine"):
        replay_in_time(log, prompts, [None], 1, RouterFlags(), 64, 4, 2, model=LIKE["sglang"])
    with pytest.raises(ValueError, match="--in-flight"):
        replay_in_time(log, prompts, [None], 1, RouterFlags(), 64, 4, 0)
    for bad in ({"max_num_batched_tokens": 0}, {"step_ms": -1}, {"gap_ms": float("inf")}, {"token_ms": True},
                {"step_ms": 0, "token_ms": 0}, {"max_num_batched_tokens": 100}):  # fewer tokens than max_num_seqs
        with pytest.raises(ValueError):
            Service(**bad)


def test_the_command_replays_a_fleet_in_time_and_writes_what_it_assumed(tmp_path, capsys):
    log = tmp_path / "chats.jsonl"
    systems = ["You are a tutor. " * 20, "Answer in French. " * 20]
    write_log(log, [{"messages": [{"role": "system", "content": systems[i % 2]},
                                  {"role": "user", "content": f"Question number {i}?"}]} for i in range(6)])
    out = tmp_path / "fleet.json"
    main([str(log), "--replicas", "2", "--router", "cache_aware", "--num-blocks", "64", "--in-flight", "2",
          "--max-num-batched-tokens", "64", "--step-ms", "5", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "2 requests in flight" in printed and "in time" in printed
    written = json.loads(out.read_text())
    assert written["in_flight"] == 2
    assert written["service"] == {"max_num_batched_tokens": 64, "max_num_seqs": 64, "step_ms": 5.0, "token_ms": 0.05,
                                  "gap_ms": 1.0}
    assert [r["loads_seen"] for r in written["requests"][:2]] == [[0, 0], [1, 0]]
    assert [r["replica"] for r in written["requests"]] == [0, 1] * 3  # the second found replica 0 busy
    assert written["total"]["cached_tokens"] == sum(r["cached_tokens"] for r in written["requests"]) > 0
    assert written["trust"]["measured"] == TRUST["cache_aware", True]
    orders = written["hit_rate_over_orders"]  # the races of requests that arrive together, replayed 16 ways
    assert orders["orders"] == 16 and orders["min"] - 1e-9 <= orders["mean"] <= orders["max"] + 1e-9
    assert "Over 16 orders of the requests that reach a replica at the same moment" in " ".join(printed.split())
    assert TRUST["cache_aware", True] in " ".join(printed.split())


@pytest.mark.parametrize("argv, message", [
    (["--in-flight", "2"], "give --replicas N"),
    (["--in-flight", "2", "--replicas", "2", "--ids"], "a prompt of token ids is refused there"),
    (["--replicas", "2", "--ids"], "a prompt of token ids is refused there"),
    (["--in-flight", "2", "--replicas", "2", "--like", "sglang"], "--like vllm or engine"),
    (["--replicas", "2", "--in-flight", "2", "--step-ms", "-3"], "step_ms is a number of milliseconds"),
])
def test_the_command_refuses_a_fleet_in_time_it_cannot_replay(tmp_path, capsys, argv, message):
    log = tmp_path / "one.jsonl"
    write_log(log, [{"prompt": [1, 2, 3] if "--ids" in argv else "hello there"}])
    with pytest.raises(SystemExit):
        main([str(log), *[a for a in argv if a != "--ids"]])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("in_flight", ["1", "3"])
def test_a_router_that_draws_gets_the_hit_rates_of_many_draws_beside_one(tmp_path, capsys, in_flight):
    log = tmp_path / "chats.jsonl"
    write_log(log, [{"messages": [{"role": "system", "content": f"You are tutor {i % 3}. " * 20},
                                  {"role": "user", "content": f"Question number {i}?"}]} for i in range(12)])
    out = tmp_path / "fleet.json"
    main([str(log), "--replicas", "3", "--router", "random", "--num-blocks", "64", "--in-flight", in_flight,
          "--json", str(out)])
    assert "Over 16 draws (--router-seed 0 to 15)" in capsys.readouterr().out
    over = json.loads(out.read_text())["hit_rate_over_draws"]
    assert over["draws"] == 16 and over["min"] - 1e-9 <= over["mean"] <= over["max"] + 1e-9 and over["min"] < over["max"]
    main([str(log), "--replicas", "3", "--router", "round_robin", "--num-blocks", "64", "--in-flight", in_flight,
          "--json", str(out)])
    assert "Over 16 draws" not in capsys.readouterr().out and "hit_rate_over_draws" not in json.loads(out.read_text())


def test_what_the_command_says_of_its_trust_is_what_the_docs_measured():
    """Each policy's trust line, in the command and its --json, is a row of docs/analyzer.md's
    "How far to trust it", whose figures come from the tables above it."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "analyzer.md").read_text()
    for policy in POLICIES:
        assert f"| {policy} | {TRUST[policy, False]} | {TRUST[policy, True]} |" in docs, policy


@pytest.mark.subprocess
def test_the_command_docs_analyzer_gives_for_a_fleet_in_flight_prints_what_it_says():
    """docs/analyzer.md's command, as typed: the split and the hit rates its sentence gives."""
    root = Path(__file__).resolve().parents[2]
    command = ("prefix_caching.py --analyze lessons/data/multi_turn.jsonl.xz --conversations-at-once 8 --replicas 3 "
               "--router cache_aware --in-flight 3 --num-blocks 301").split()
    assert " ".join(command[1:]) in " ".join((root / "docs" / "analyzer.md").read_text().replace("\\\n", "").split())
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=300, cwd=root,
                            env={**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    rows = [line.split("│")[1:6] for line in result.stdout.splitlines() if line.startswith("│")]
    fleet = {r[0].strip(): [c.strip() for c in r[1:]] for r in rows if r[0].strip() in ("0", "1", "2", "fleet")}
    assert [fleet[k][0] for k in ("0", "1", "2")] == ["149", "5", "0"] and fleet["fleet"][3] == "55.1%"
    assert "3 requests in flight" in result.stdout and "one request at a time: 54.3%" in result.stdout
