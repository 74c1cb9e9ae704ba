"""A class behind one address: thirty laptops behind a school's NAT, an SSH tunnel or a
proxy reach the server from one IP address. Over real HTTP on 127.0.0.1, against a batching
Engine over conftest's tiny random model.

    1. keyed students and the live page's polls do not use up their address's connections
    2. one key has at most --max-requests-per-key generation requests open (a 429, before any work)
    3. X-Forwarded-For, trusted only from the proxies of --forwarded-allow-ips
    4. thirty students streaming and eight pages polling, for a few seconds: nothing refused
    5. heads dripping from 130 addresses beside the class: the cap follows the open-file limit,
       and at the cap a new connection takes the place of the oldest head still coming in

No sleep decides anything: held requests wait in the engine's queue (queued_together) while
the test looks; only part 4 runs for a while, and asserts what was served, never how fast.
"""

import concurrent.futures
import contextlib
import http.client
import json
import socket
import threading
import time

import pytest

from engine import Engine
from helpers import (
    MODEL, calibrated, call, call_with_headers, connect_from, queued_together, serve, until, wait_until_idle,
)
from server import create_app
from serving.connections import connection_cap

STUDENTS = [f"student-{i:02}" for i in range(30)]
TEACHER = "teacher-secret"


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    """Room for thirty chats at once: 256 blocks of 16 tokens, the default policy on a held calibration."""
    return calibrated(Engine(model=tiny_model, tokenizer=tokenizer, block_size=16, num_blocks=256))


def class_app(engine, **options):
    return create_app(engine, model_name=MODEL, api_keys=frozenset(STUDENTS), admin_key=TEACHER, **options)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def chat(question: str, max_tokens: int = 4) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "stream": True}


def stream(url: str, body: dict, headers: dict | None = None, source: str = "127.0.0.1") -> tuple[int, bytes]:
    """POST a streaming chat from the local address `source`; (status, the whole reply body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60, source_address=(source, 0))
    try:
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"Content-Type": "application/json", **(headers or {})})
        except OSError:  # refused when accepted: the 503 came, and the connection closed, before the request went
            head, _, reply = read_all(conn.sock).partition(b"\r\n\r\n")
            return int(head.split()[1]), reply
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def read_all(sock) -> bytes:
    """What the server sent before it closed (a reset after its reply ends it too)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def served_whole(reply: tuple[int, bytes]) -> bool:
    status, body = reply
    # An error event, not a reply whose text is "error" (the tiny model samples that token too).
    return status == 200 and body.endswith(b"data: [DONE]\n\n") and b'data: {"error"' not in body


# --- 1. a class behind one address ------------------------------------------------------------------


def get_status(url: str, path: str) -> int:
    """GET a path that answers HTML, not JSON: its status."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_thirty_keyed_streams_and_eight_pages_from_one_address_are_all_served(engine):
    # More than --max-connections-per-client (32) from 127.0.0.1 at once: each student's request
    # shows its key, each page's poll is a poll, so none counts against the address.
    pages = [(key, path) for key in [TEACHER, *STUDENTS[:7]] for path in ("/health", "/cache")]
    with serve(class_app(engine)) as url:
        with (concurrent.futures.ThreadPoolExecutor(len(STUDENTS)) as students,
              concurrent.futures.ThreadPoolExecutor(len(pages)) as pollers):
            with queued_together(engine):  # every stream waits in the queue, its connection open
                streams = [students.submit(stream, url, chat(f"Question {i}?"), bearer(key))
                           for i, key in enumerate(STUDENTS)]
                until(lambda: len(engine.snapshot().waiting) == len(STUDENTS), what="thirty streams waiting")
                polls = list(pollers.map(lambda page: call(url, page[1], headers=bearer(page[0]))[0], pages))
                assert polls == [200] * len(pages)
                assert get_status(url, "/") == 200  # the page itself
            assert all(served_whole(s.result(60)) for s in streams)
    wait_until_idle(engine)


def test_requests_without_a_key_of_the_class_still_count_against_their_address(engine):
    with serve(create_app(engine, model_name=MODEL), max_connections_per_client=2) as url:
        with concurrent.futures.ThreadPoolExecutor(3) as pool, queued_together(engine):
            held = [pool.submit(stream, url, chat(f"Held {i}"), source="127.0.0.2") for i in range(2)]
            until(lambda: len(engine.snapshot().waiting) == 2, what="two keyless streams waiting")
            status, reply = stream(url, chat("A third"), source="127.0.0.2")
            assert status == 503 and b"127.0.0.2 has 2 connections open" in reply
            assert call(url, "/health")[0] == 200  # another address is served
        assert all(served_whole(h.result(60)) for h in held)
    wait_until_idle(engine)


# --- 2. a key's share -------------------------------------------------------------------------------


def test_a_key_over_its_share_of_requests_gets_a_429_before_any_work(engine, tokenized):
    with serve(class_app(engine), max_requests_per_key=2) as url:
        alice, bob = bearer(STUDENTS[0]), bearer(STUDENTS[1])
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            with queued_together(engine):
                held = [pool.submit(stream, url, chat(f"Alice {i}"), alice) for i in range(2)]
                until(lambda: len(engine.snapshot().waiting) == 2, what="Alice's two streams waiting")
                before = len(tokenized)
                status, reply, headers = call_with_headers(url, "/v1/chat/completions", chat("A third"), headers=alice)
                assert status == 429 and headers["Retry-After"] == "2"
                assert "has 2 generation requests open" in reply["error"]["message"]
                assert "--max-requests-per-key" in reply["error"]["message"]
                assert len(tokenized) == before  # the third was never tokenized
                assert call(url, "/cache", headers=alice)[0] == 200  # her page still polls
                bobs = pool.submit(stream, url, chat("Bob's"), bob)  # another key is served
                until(lambda: len(engine.snapshot().waiting) == 3, what="Bob's stream waiting")
            assert all(served_whole(h.result(60)) for h in [*held, bobs])
        assert served_whole(stream(url, chat("Alice again"), alice))  # her requests ended: her share is free
    wait_until_idle(engine)


def test_a_keys_share_is_free_once_its_reply_is_whole_before_its_connection_ends(engine, monkeypatch):
    """A student sends the next request on the last byte of a reply: the share the reply held
    is free already, whatever the server's thread still does with the connection (here: its
    end held back until the test lets it go)."""
    from serving.connections import ClassServer

    let_go, real = threading.Event(), ClassServer.release

    def held_back(self, sock):
        let_go.wait(30)
        real(self, sock)

    monkeypatch.setattr(ClassServer, "release", held_back)
    with serve(class_app(engine), max_requests_per_key=1) as url:
        alice = bearer(STUDENTS[0])
        try:
            assert served_whole(stream(url, chat("A stream"), alice))
            status, reply = call(url, "/v1/chat/completions", chat("Not streamed") | {"stream": False}, headers=alice)
            assert status == 200, reply
            assert served_whole(stream(url, chat("A stream after it"), alice))
        finally:
            let_go.set()


# --- 3. a proxy's X-Forwarded-For --------------------------------------------------------------------


@pytest.fixture
def tenants(engine, monkeypatch):
    """The tenant of every request the server hands the engine (the server's come with a hang-up check)."""
    seen = []
    stream_of = engine.stream

    def stream_seen(*args, **kwargs):
        if "gone" in kwargs:
            seen.append(kwargs.get("tenant"))
        return stream_of(*args, **kwargs)

    monkeypatch.setattr(engine, "stream", stream_seen)
    return seen


def forwarded(url: str, source: str, forwarded_for: str | None, question: str) -> tuple[int, bytes]:
    headers = {} if forwarded_for is None else {"X-Forwarded-For": forwarded_for}
    return stream(url, chat(question), headers, source=source)


def test_from_a_named_proxy_the_client_is_the_last_address_of_x_forwarded_for(engine, tenants):
    limits = {"forwarded_allow_ips": ["127.0.0.1"], "max_connections_per_client": 1}
    with serve(create_app(engine, model_name=MODEL), **limits) as url:
        with concurrent.futures.ThreadPoolExecutor(2) as pool, queued_together(engine):
            # What the client wrote first (203.0.113.9) is anyone's guess; the proxy appended 10.0.0.7.
            first = pool.submit(forwarded, url, "127.0.0.1", "203.0.113.9, 10.0.0.7", "From 10.0.0.7")
            until(lambda: len(engine.snapshot().waiting) == 1, what="10.0.0.7's stream waiting")
            status, reply = forwarded(url, "127.0.0.1", "10.0.0.7", "From 10.0.0.7 again")
            assert status == 503 and b"10.0.0.7 has 1 connections open" in reply
            other = pool.submit(forwarded, url, "127.0.0.1", "10.0.0.8", "From 10.0.0.8")
            until(lambda: len(engine.snapshot().waiting) == 2, what="10.0.0.8's stream waiting")
        assert served_whole(first.result(60)) and served_whole(other.result(60))
    assert tenants == ["10.0.0.7", "10.0.0.8"]  # with no keys, the tenant is the client's address
    wait_until_idle(engine)


def test_from_anyone_else_x_forwarded_for_is_ignored(engine, tenants):
    limits = {"forwarded_allow_ips": ["127.0.0.1"], "max_connections_per_client": 1}
    with serve(create_app(engine, model_name=MODEL), **limits) as url:
        with concurrent.futures.ThreadPoolExecutor(1) as pool, queued_together(engine):
            first = pool.submit(forwarded, url, "127.0.0.2", "10.0.0.7", "From 127.0.0.2")
            until(lambda: len(engine.snapshot().waiting) == 1, what="127.0.0.2's stream waiting")
            status, reply = forwarded(url, "127.0.0.2", "10.0.0.8", "A made-up address")
            assert status == 503 and b"127.0.0.2 has 1 connections open" in reply
        assert served_whole(first.result(60))
    assert tenants == ["127.0.0.2"]
    wait_until_idle(engine)


@pytest.mark.parametrize("value", ["10.0.0.7, not-an-address", "10.0.0.7:5555", ""])
def test_a_proxy_that_forwards_no_address_gets_a_400_that_names_the_header(engine, tenants, value):
    with serve(create_app(engine, model_name=MODEL), forwarded_allow_ips=["127.0.0.0/8"]) as url:
        status, reply = forwarded(url, "127.0.0.1", value, "Hi")
    assert status == 400 and b"X-Forwarded-For" in reply and b"--forwarded-allow-ips" in reply
    assert tenants == []


# --- 4. a class, for a few seconds --------------------------------------------------------------------

SECONDS = 4.0


def test_thirty_students_streaming_and_eight_pages_polling_from_one_address_are_all_served(engine):
    """Thirty students, each a loop of short streaming chats with a key of its own, and eight
    live pages polling /health and /cache every second, every one from 127.0.0.1."""
    streams, polls, refused = [0] * len(STUDENTS), [0] * 8, []
    lock, start, stop = threading.Lock(), threading.Barrier(len(STUDENTS) + 8), threading.Event()

    def student(i: int) -> None:
        start.wait()
        n = 0
        while not stop.is_set():
            reply = stream(url, chat(f"Question {n} from {i}", max_tokens=2 + (i + n) % 7), bearer(STUDENTS[i]))
            with lock:
                if served_whole(reply):
                    streams[i] += 1
                else:
                    refused.append(reply)
            n += 1

    def page(i: int) -> None:
        key = TEACHER if i == 0 else STUDENTS[i]
        start.wait()
        while True:
            for path in ("/health", "/cache"):
                status, reply = call(url, path, headers=bearer(key))
                with lock:
                    if status == 200:
                        polls[i] += 1
                    else:
                        refused.append((status, reply))
            if stop.wait(1.0):
                return

    with serve(class_app(engine)) as url:
        threads = [threading.Thread(target=student, args=(i,)) for i in range(len(STUDENTS))]
        threads += [threading.Thread(target=page, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        time.sleep(SECONDS)  # how long the class runs, not a condition anything waits for
        stop.set()
        for thread in threads:
            thread.join(120)
    print(f"\n30 students and 8 pages from one address for {SECONDS:g} s: {sum(streams)} streams and "
          f"{sum(polls)} polls served, {len(refused)} refused")
    assert refused == []
    assert min(streams) >= 1 and min(polls) >= 2  # every student streamed, every page polled both routes
    wait_until_idle(engine)


# --- 5. a slowloris from many addresses ------------------------------------------------------------


class Drippers:
    """`n` connections, each from an address of its own (127.0.1.x: no per-address cap tells
    them apart), each sending a request line and then a header byte every 0.2 s, never the
    head's end. With `again`, one the server closes is opened again, as an attack keeps its
    count."""

    def __init__(self, url: str, n: int, again: bool):
        self.url, self.again = url, again
        self.addresses = [f"127.0.1.{i}" for i in range(1, n + 1)]
        self.socks = [self.connect(address) for address in self.addresses]
        self.closed = 0  # connections the server ended
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.drip)
        self.thread.start()

    def connect(self, address: str) -> socket.socket | None:
        try:
            sock = connect_from(self.url, address)
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            return sock
        except OSError:  # refused at accept, and closed before the line went
            return None

    def drip(self) -> None:
        while not self.stop.wait(0.2):
            for i, sock in enumerate(self.socks):
                try:
                    if sock is None:
                        raise OSError
                    sock.send(b"X")
                except OSError:
                    if sock is not None:
                        sock.close()
                        self.closed += 1
                    self.socks[i] = self.connect(self.addresses[i]) if self.again else None

    def end(self) -> None:
        self.stop.set()
        self.thread.join()
        for sock in self.socks:
            if sock is not None:
                sock.close()


def honest_and_class(url: str) -> tuple[list[int], list[tuple[int, bytes]]]:
    """32 keyless /health requests from two other addresses and thirty keyed students' streams
    from 127.0.0.1, all at once; their statuses and replies."""
    def health(i: int) -> int:
        conn = http.client.HTTPConnection(*url.removeprefix("http://").split(":"), timeout=30,
                                          source_address=(f"127.0.0.{2 + i % 2}", 0))
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            return response.status
        except OSError:
            return 0
        finally:
            conn.close()

    with concurrent.futures.ThreadPoolExecutor(62) as pool:
        healths = [pool.submit(health, i) for i in range(32)]
        streams = [pool.submit(stream, url, chat(f"Question {i}?"), bearer(key)) for i, key in enumerate(STUDENTS)]
        return [h.result(60) for h in healths], [s.result(60) for s in streams]


def test_heads_dripping_from_130_addresses_leave_the_honest_and_the_class_behind_one_address_served(engine):
    # At the defaults: the cap follows the open-file limit (896 under ulimit -n 1024), far above
    # the 128 that 130 drippers filled (16 of 32 honest requests were served then).
    assert connection_cap() >= 192
    with serve(class_app(engine)) as url:
        drippers = Drippers(url, 130, again=True)
        try:
            healths, streams = honest_and_class(url)
        finally:
            drippers.end()
    assert healths == [200] * 32
    assert all(served_whole(s) for s in streams)
    wait_until_idle(engine)


def test_at_the_cap_every_new_connection_takes_the_place_of_a_dripping_head(engine):
    # The old default cap, 128, full of heads that never end; each new connection cuts the
    # oldest that has been coming in for half a second.
    with serve(class_app(engine), max_connections=128) as url:
        drippers = Drippers(url, 130, again=False)
        try:
            until(lambda: sum(sock is None for sock in drippers.socks) == 2, what="the 129th and 130th refused")
            time.sleep(0.6)  # MAKE_ROOM_AFTER_S: the drippers are now old enough to give way
            healths, streams = honest_and_class(url)
        finally:
            drippers.end()
    assert healths == [200] * 32
    assert all(served_whole(s) for s in streams)
    assert drippers.closed >= 1  # places were made (as many as were needed at once)
    wait_until_idle(engine)
