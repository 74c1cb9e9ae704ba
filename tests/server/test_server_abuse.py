"""One student cannot take the class server down: each attack, over real HTTP on
127.0.0.1 (attackers connect from 127.0.0.2, a second address of this machine), against a
batching Engine over conftest's tiny random model.

    1. connections that drip their headers (a deadline; a cap per client address)
    2. junk after a body, to hide a hang-up
    3. bodies too big for --max-prompt-tokens, refused before any tokenizing
    4. a client that half-closes after its request (nc -N): a 400 it can read
    5. Ctrl+C while a connection drips headers
    6. what another tenant's request shows a keyed tenant
    7. a hang-up check that cannot work (descriptors over 1,023) fails no one
    8. made-up keys polling /cache

No sleep decides anything: the tests poll for what they wait for, with a deadline; a drip's
pauses only give the server the chance to misbehave.
"""

import concurrent.futures
import contextlib
import json
import os
import resource
import socket
import threading

import pytest

from engine import Engine
from helpers import (
    MODEL, SYSTEM, EmbeddingCounter, call, connect_from, queued_together, raw_request, serve, until, wait_for_log,
    wait_until_idle,
)
from server import create_app, drain, serve_in_background
from serving.connections import AFTER_BODY_LIMIT
from serving.views import ServerState

ATTACKER = "127.0.0.2"
MALLORY, BOB = ({"Authorization": f"Bearer {key}"} for key in ("mallory-key", "bob-key"))


def post_head(path: str, body: bytes) -> list[str]:
    return [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(body)}"]


def request_bytes(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return "\r\n".join(post_head(path, data)).encode() + b"\r\n\r\n" + data


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset after some bytes ends it too)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def drip(sock: socket.socket, stop: threading.Event, every: float = 0.2, most: int = 100_000) -> int:
    """A request line, then one header byte every `every` seconds until the server closes the
    connection, `stop` is set or `most` bytes are sent; the header bytes sent."""
    sock.sendall(b"GET /health HTTP/1.1\r\n")
    sent = 0
    while sent < most and not stop.wait(every):
        try:
            sock.sendall(b"X")
        except OSError:
            return sent
        sent += 1
    return sent


# --- 1. one student cannot hold every connection ----------------------------------------------------


def test_connections_that_drip_headers_are_cut_at_their_deadline(engine):
    with serve(create_app(engine, model_name=MODEL), read_timeout=1.0, idle_timeout=1.0) as url:
        sock = connect_from(url, ATTACKER)
        # Every byte comes well within the old per-read timeout (1 s): only a deadline ends it.
        sent = drip(sock, threading.Event(), every=0.2, most=100)
        sock.close()
        assert sent < 100  # cut after about 5 bytes, not after the 100 of 20 s
        assert call(url, "/health")[0] == 200


def test_one_address_holds_at_most_its_share_of_the_connections(engine):
    limits = {"max_connections": 6, "max_connections_per_client": 2, "read_timeout": 60, "idle_timeout": 60}
    with serve(create_app(engine, model_name=MODEL), **limits) as url:
        stop = threading.Event()
        attackers = [connect_from(url, ATTACKER) for _ in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            drips = [pool.submit(drip, sock, stop) for sock in attackers]
            try:
                refused = until(lambda: [f for f in drips if f.done()] if sum(f.done() for f in drips) >= 6 else None,
                                what="six of the eight dripping connections refused")
                assert len(refused) == 6  # two held, six refused with a 503 at once
                # The honest class, from another address, is served all the same.
                for _ in range(3):
                    status, reply = call(url, "/generate", {"prompt": "Hi", "max_tokens": 2})
                    assert status == 200
            finally:
                stop.set()
        for sock in attackers:
            sock.close()
    wait_until_idle(engine)


def test_the_per_address_refusal_says_which_flag(engine):
    limits = {"max_connections_per_client": 1, "read_timeout": 60, "idle_timeout": 60}
    with serve(create_app(engine, model_name=MODEL), **limits) as url:
        held = connect_from(url, ATTACKER)
        held.sendall(b"GET /health HTTP/1.1\r\n")
        second = connect_from(url, ATTACKER)
        reply = read_all(second).decode()
        assert reply.startswith("HTTP/1.1 503") and "Retry-After: 2" in reply
        assert "127.0.0.2 has 1 connections open" in reply and "--max-connections-per-client" in reply
        held.close()
        second.close()


# --- 2. junk after a body does not hide a hang-up ----------------------------------------------------


def test_junk_after_a_body_ends_the_request_before_its_prefill_runs_through(tiny_model, tokenizer, caplog):
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=128,
                    max_num_seqs=4, max_num_batched_tokens=16)
    counter = EmbeddingCounter(engine.model)
    body = json.dumps({"prompt": list(range(100, 200)), "max_tokens": 4}).encode()  # 100 tokens: 7 chunks
    junk = b"x" * (512 << 10)  # then a close: the old check read 64 KiB a look, and took more as "still there"

    def attack(url):
        with contextlib.suppress(OSError):  # the server ends the connection under it
            sock = raw_request(url, post_head("/generate", body), body)
            sock.sendall(junk)
            sock.close()

    with serve(create_app(engine, model_name=MODEL)) as url, caplog.at_level("INFO", logger="server"):
        threading.Thread(target=attack, args=(url,)).start()
        wait_for_log(caplog, "POST /generate -> 400")
        wait_until_idle(engine)
    counter.handle.remove()
    assert counter.count < 100  # dropped before its whole prompt was computed
    assert engine.allocator.stats.requests <= 1


# --- 3. refusals cost no work -----------------------------------------------------------------------


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": "a"}] * 1_000}, "the chat has 1,000 messages, more than a prompt of "
                                                               "at most 64 tokens (--max-prompt-tokens) can hold"),
    ({"prompt": "中文" * 3_000}, "the prompt's text is 18,000 bytes, more than a prompt of at most 64 tokens"),
    ({"prompt": "😀" * 2_000}, "the prompt's text is 8,000 bytes"),
    ({"prompt": list(range(65))}, "the prompt is 65 token ids, over this server's limit of 64"),
], ids=["37k-style messages", "CJK", "emoji", "token ids"])
def test_a_prompt_too_big_for_max_prompt_tokens_is_refused_before_it_is_tokenized(engine, tokenized, body, words):
    with serve(create_app(engine, model_name=MODEL, max_prompt_tokens=64)) as url:
        status, reply = call(url, "/generate", body)
    assert status == 400 and words in reply["error"]["message"]
    assert tokenized == []


def test_a_body_over_what_max_prompt_tokens_accepts_is_refused_on_its_content_length(engine, tokenized):
    with serve(create_app(engine, model_name=MODEL, max_prompt_tokens=64)) as url:
        # 64 tokens x 81 bytes x 6 + 64 messages x 48 + 64 KiB: 99,712 bytes
        sock = raw_request(url, post_head("/generate", b"x" * 100_000), b"")  # the head only: nothing more is read
        reply = read_all(sock).decode()
    assert reply.startswith("HTTP/1.1 413") and "over this server's limit of 99,712" in reply
    assert tokenized == []


def test_the_longest_prompt_max_prompt_tokens_accepts_is_not_refused_by_the_bounds(engine):
    longest = max((tokenizer_text := engine.tokenizer.batch_decode([[i] for i in range(len(engine.tokenizer))])),
                  key=lambda text: len(text.encode()))
    prompt = longest * 16  # each repeat one token of the most bytes any token stands for
    assert len(engine.tokenize(prompt)) <= 16 and len(tokenizer_text) == len(engine.tokenizer)
    with serve(create_app(engine, model_name=MODEL, max_prompt_tokens=16)) as url:
        assert call(url, "/generate", {"prompt": prompt, "max_tokens": 1})[0] == 200
        chat = [{"role": "user", "content": "\u0001" * 2}] * 2  # 6 bytes of JSON for each byte of text
        status, reply = call(url, "/generate", {"messages": chat, "max_tokens": 1})
        message = reply["error"]["message"]  # refused by the tokenizer's count, not by the bounds
        assert status == 400 and "tokens, over this server's limit of 16 (--max-prompt-tokens)" in message
    wait_until_idle(engine)


# --- 4. a half-closed client reads its answer -------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/generate", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}),
])
def test_a_client_that_half_closes_after_its_request_reads_a_400_that_says_why(engine, path, body):
    with serve(create_app(engine, model_name=MODEL)) as url:
        sock = connect_from(url, "127.0.0.1")
        with queued_together(engine):  # it waits in the queue while its end of stream arrives
            sock.sendall(request_bytes(path, body))
            sock.shutdown(socket.SHUT_WR)  # as `nc -N` does
            until(lambda: len(engine.snapshot().waiting) == 1, what="the request in the queue")
        reply = read_all(sock).decode()
        sock.close()
    head, _, text = reply.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 400")
    assert "half-close, as `nc -N` does" in json.loads(text)["error"]["message"]
    wait_until_idle(engine)


def test_more_than_a_few_bytes_after_a_body_end_the_request(engine):
    with serve(create_app(engine, model_name=MODEL)) as url:
        sock = connect_from(url, "127.0.0.1")
        with queued_together(engine):
            sock.sendall(request_bytes("/generate", {"prompt": "Hi", "max_tokens": 2}))
            until(lambda: len(engine.snapshot().waiting) == 1, what="the request in the queue")
            sock.sendall(b"x" * (AFTER_BODY_LIMIT + 1))  # after the body, past what the server's read buffer took
        reply = read_all(sock).decode()
        sock.close()
    assert reply.startswith("HTTP/1.1 400") and f"more than {AFTER_BODY_LIMIT:,} bytes came after the body" in reply
    wait_until_idle(engine)


# --- 5. Ctrl+C ends, whatever the connections do ------------------------------------------------------


def test_ctrl_c_ends_while_a_connection_drips_its_headers(tiny_model, tokenizer):
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=64)
    url, server = serve_in_background(create_app(engine, model_name=MODEL), read_timeout=600, idle_timeout=600)
    sock = connect_from(url, ATTACKER)
    stop = threading.Event()
    dripping = threading.Thread(target=drip, args=(sock, stop))
    dripping.start()
    until(lambda: server.open_connections(), what="the dripping connection open")
    stopping = threading.Thread(target=drain, args=(server, engine, 0.5))  # what Ctrl+C starts
    stopping.start()
    stopping.join(60)  # grace + 5 s is the promise; a drip of one byte in 0.2 s never ends by itself
    stop.set()
    dripping.join(30)
    sock.close()
    assert not stopping.is_alive() and server.open_connections() == []


# --- 6. a keyed tenant sees nothing of another's traffic -----------------------------------------------


def test_a_keyed_tenant_sees_nothing_move_when_another_tenants_prompt_runs(engine):
    app = create_app(engine, cache_page_every_s=0, model_name=MODEL, salt_by_api_key=True, admin_key="s3cret")
    with serve(app) as url:
        call(url, "/generate", {"prompt": "Mallory's own.", "max_tokens": 1}, headers=MALLORY)
        health, page = call(url, "/health", headers=MALLORY)[1], call(url, "/cache", headers=MALLORY)[1]
        for _ in range(2):  # Bob's prompt misses, then hits
            assert call(url, "/generate", {"prompt": SYSTEM * 3, "max_tokens": 2}, headers=BOB)[0] == 200
            assert call(url, "/health", headers=MALLORY)[1] == health
            assert call(url, "/cache", headers=MALLORY)[1] == page
        assert call(url, "/health", headers=BOB)[1]["num_cached_blocks"] > 0  # Bob sees his own
    wait_until_idle(engine)


# --- 7. one client's broken check fails no one else ----------------------------------------------------


def test_hang_up_checks_on_descriptors_over_1023_fail_no_request(tiny_model, tokenizer):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this process may open {hard} files: too few to reach descriptor 1,024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=64)
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # select.select refuses the server's sockets now
    try:
        with serve(create_app(engine, model_name=MODEL)) as url:
            with concurrent.futures.ThreadPoolExecutor(3) as pool, queued_together(engine):
                replies = [pool.submit(call, url, "/generate", {"prompt": f"Hi {i}", "max_tokens": 2})
                           for i in range(3)]
                until(lambda: len(engine.snapshot().waiting) == 3, what="three requests in the queue")
            assert [r.result(60)[0] for r in replies] == [200] * 3
            assert call(url, "/health")[1]["status"] == "ok"
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    wait_until_idle(engine)


# --- 8. made-up keys share one rendering of /cache -----------------------------------------------------


def test_made_up_keys_polling_cache_share_one_rendering(engine, monkeypatch):
    renders = []
    snapshot = ServerState.snapshot
    monkeypatch.setattr(ServerState, "snapshot", lambda self, viewer: renders.append(1) or snapshot(self, viewer))
    app = create_app(engine, model_name=MODEL, salt_by_api_key=True, cache_page_every_s=3600)
    with serve(app) as url:
        keys = [{"Authorization": f"Bearer made-up-{i}"} for i in range(16)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            pages = list(pool.map(lambda headers: call(url, "/cache", headers=headers), keys))
    assert len(renders) == 1 and all(page == pages[0] for page in pages)
