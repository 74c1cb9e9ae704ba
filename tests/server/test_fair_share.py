"""Fair shares between students over real HTTP (engine/scheduler.py's Virtual Token Counter, the
server's tenants): the least-served student's request is admitted first, a prompt refused
after tokenizing is charged to its sender, and /health shows a student its own share.

Against a batching Engine over conftest's tiny random model, two requests running at most
(max_num_seqs=2): a third student's long reply keeps one place (and keeps a tenant with work,
so the counts are not forgotten), and the two short requests take the other in turn, so the
order they finish in is the order the scheduler admitted them. No sleep decides anything:
requests wait in the queue while a step is held (queued_together).
"""

import hashlib
import threading

import pytest

from engine import Engine
from helpers import MODEL, call, queued_together, serve, until, wait_until_idle
from server import create_app

HEAVY, STUDENT, KEEPER = "heavy-student", "honest-student", "third-student"


def app(tiny_model, tokenizer, fair_share: bool):
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=16, num_blocks=64,
                    max_num_seqs=2, max_num_batched_tokens=512, fair_share=fair_share)
    # Keys on the teacher's list: each stands for one student (a key nobody listed counts as its address).
    return engine, create_app(engine, model_name=MODEL, api_keys=frozenset({HEAVY, STUDENT, KEEPER}),
                              salt_by_api_key=True, max_prompt_tokens=200)


def salt(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()  # the tenant --salt-by-api-key gives a key


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def order_served(engine, url) -> list[str]:
    """heavy's prompt over the limit (refused, charged), then heavy's and student's requests
    queued in that order behind a held step: who ran first."""
    finished = []

    def ask(key: str):
        status, reply = call(url, "/generate", {"prompt": f"{key} asks", "max_tokens": 2}, headers=bearer(key))
        assert status == 200, reply
        finished.append(key)

    keeper = threading.Thread(target=call, args=(url, "/generate", {"prompt": "a long reply", "max_tokens": 64}),
                              kwargs={"headers": bearer(KEEPER)})
    keeper.start()
    until(lambda: len(engine.snapshot().running) == 1, what="the third student's request running")
    with queued_together(engine):
        status, reply = call(url, "/generate", {"prompt": "word " * 400, "max_tokens": 2}, headers=bearer(HEAVY))
        assert status == 400 and "--max-prompt-tokens" in reply["error"]["message"]
        status, health = call(url, "/health", headers=bearer(HEAVY))
        assert health["served_tokens"] > 400 and health["tokens_ahead_of_least_served"] > 400, health
        status, health = call(url, "/health", headers=bearer(STUDENT))
        assert health["served_tokens"] == 0 and health["tokens_ahead_of_least_served"] == 0, health
        threads = [threading.Thread(target=ask, args=(key,)) for key in (HEAVY, STUDENT)]
        for key, thread in zip((HEAVY, STUDENT), threads):  # heavy's first
            thread.start()
            until(lambda: salt(key) in {salt for _, salt in engine.snapshot().waiting}, what=f"{key}'s request queued")
    for thread in [*threads, keeper]:
        thread.join(60)
    wait_until_idle(engine)
    return finished


def test_the_least_served_student_runs_first_and_a_refused_prompt_counts(tiny_model, tokenizer):
    engine, fair = app(tiny_model, tokenizer, fair_share=True)
    with serve(fair) as url:
        assert order_served(engine, url) == [STUDENT, HEAVY]
        status, health = call(url, "/health", headers=bearer(HEAVY))
        assert health["fair_share"] is True
        assert health["served_tokens"] == 0  # nobody has work: every tenant starts equal again
    engine.close()


def test_a_key_nobody_listed_counts_as_its_address(tiny_model, tokenizer):
    """--salt-by-api-key alone takes any key, so a student could make up one per request and
    be a new tenant each time, served first: such keys count as their address. A prompt
    refused under one made-up key is charged to 127.0.0.1, and another made-up key from the
    same address sees that count as its own; a listed key is a tenant of its own."""
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=16, num_blocks=64,
                    max_num_seqs=2, max_num_batched_tokens=512)
    app = create_app(engine, model_name=MODEL, salt_by_api_key=True, max_prompt_tokens=200)
    with serve(app) as url:
        keeper = threading.Thread(target=call, args=(url, "/generate", {"prompt": "a long reply", "max_tokens": 64}),
                                  kwargs={"headers": bearer(KEEPER)})
        keeper.start()  # someone with work: the counts are kept while it runs
        until(lambda: len(engine.snapshot().running) == 1, what="the keeper's request running")
        with queued_together(engine):
            status, reply = call(url, "/generate", {"prompt": "word " * 400, "max_tokens": 2},
                                 headers=bearer("made-up-1"))
            assert status == 400
            status, health = call(url, "/health", headers=bearer("made-up-2"))
            assert status == 200 and health["served_tokens"] > 400, health
            assert engine.snapshot().served.get("127.0.0.1", 0) > 400
            assert not {salt("made-up-1"), salt("made-up-2")} & set(engine.snapshot().served)
        keeper.join(60)
    engine.close()


def test_without_fair_share_the_queue_runs_in_arrival_order(tiny_model, tokenizer):
    engine, plain = app(tiny_model, tokenizer, fair_share=False)
    with serve(plain) as url:
        assert order_served(engine, url) == [HEAVY, STUDENT]
    engine.close()


@pytest.mark.parametrize("flags, fair", [([], True), (["--no-fair-share"], False), (["--fair-share"], True)])
def test_the_flag_reaches_the_engine_config(flags, fair, monkeypatch):
    import server
    from commands import model_flags

    made = []

    def engine(*args, config, **kwargs):  # stands in for the model's loading: the config is what is checked
        made.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(model_flags, "Engine", engine)  # server.py loads its model through engine_from_flags
    with pytest.raises(SystemExit):
        server.main(flags)
    assert made[0].fair_share is fair


def test_a_question_behind_a_long_prompt_is_answered_before_the_prompt_is_in(tiny_model, tokenizer):
    """A prompt still prefilling takes only its share of each step: a short question sent while
    a long prompt comes in chunks is prefilled in the next step and finishes first. (Before
    the rule the running prompt took every step's budget, and the question waited for it.)"""
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=16, num_blocks=128,
                    max_num_batched_tokens=64)
    finished = []

    def ask(key: str, body: dict):
        status, reply = call(url, "/generate", body, headers=bearer(key))
        assert status == 200, reply
        finished.append(key)

    # What the loop finished, in order, and whether a prompt was still coming in at that step:
    # read inside the engine, so how fast the replies travel back over HTTP does not matter.
    runner, ended = engine.loop.runner, []
    postprocess = runner.postprocess

    def recording(plan, tokens):
        done = postprocess(plan, tokens)
        coming = any(r.num_prefill_left for r in runner.scheduler.running)
        ended.extend((len(r.prompt_ids), coming) for r in done)
        return done

    runner.postprocess = recording
    with serve(create_app(engine, model_name=MODEL, salt_by_api_key=True)) as url:
        long = threading.Thread(target=ask, args=(HEAVY, {"prompt": [5 + i % 300 for i in range(900)],
                                                          "max_tokens": 1}))
        long.start()
        until(lambda: engine.snapshot().prefilling, what="the long prompt coming in chunks")
        with engine.parts.lock:  # the loop held between two steps until the question waits in its queue
            question = threading.Thread(target=ask, args=(STUDENT, {"prompt": "A short question?", "max_tokens": 4}))
            question.start()
            until(lambda: engine.snapshot().waiting, what="the question in the queue")
        question.join(60)
        long.join(60)
    short = len(engine.tokenize("A short question?"))
    assert ended == [(short, True), (900, False)], "the question ends while the 900 tokens still come in, 64 a step"
    assert sorted(finished) == sorted([STUDENT, HEAVY])
    engine.close()
