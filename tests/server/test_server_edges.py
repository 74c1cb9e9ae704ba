"""The edges of HTTP/1.1 that a class finds: each over real HTTP on 127.0.0.1, byte for byte,
against a batching Engine over conftest's tiny random model.

    1. what follows a reply: a few KiB discarded within --read-timeout, then the connection closes
    2. Transfer-Encoding as HTTP matches it: chunked in any case, its deadline, its malformed chunks
    3. Expect: 100-continue: one "100 Continue", and only for a head the server will read a body for
    4. what a request may cost before any work: whitespace counted as the chat template counts it,
       a chat's messages counted, a request head's header lines and bytes bounded (431)

No sleep decides anything: a drip's pauses only give the server the chance to misbehave.
"""

import contextlib
import json
import select
import socket
import threading

import pytest

from helpers import MODEL, call, raw_request, serve, wait_until_idle
from server import create_app
from serving.connections import AFTER_BODY_LIMIT, MAX_HEAD_BYTES, MAX_HEADER_FIELDS
from serving.requests import MAX_CHAT_MESSAGES

BODY = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()


def post_head(*extra: str, path: str = "/generate") -> list[str]:
    return [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json", *extra]


def read_reply(sock: socket.socket) -> bytes:
    """One reply, head and Content-Length body, without waiting for the connection to end."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection ended before a whole reply: {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def closed(sock: socket.socket) -> bool:
    """Whether the server has ended the connection (its end of stream, or a reset)."""
    try:
        return bool(select.select([sock], [], [], 0)[0]) and sock.recv(1) == b""
    except ConnectionError:
        return True


# --- 1. what follows a reply ----------------------------------------------------------------------


def test_a_client_that_drips_bytes_after_its_reply_is_closed(engine):
    # Each byte comes well within the per-read timeout (2 s): only a bound on what follows the reply ends it.
    with serve(create_app(engine, model_name=MODEL), read_timeout=2.0) as url:
        sock = raw_request(url, ["GET /health HTTP/1.1", "Host: 127.0.0.1"])
        assert read_reply(sock).startswith(b"HTTP/1.1 200")
        stop, sent = threading.Event(), 0
        while sent < 40 and not closed(sock):  # 40 bytes: 10 s at 4 a second
            try:
                sock.sendall(b"x")
            except ConnectionError:
                break
            sent += 1
            stop.wait(0.25)
        sock.close()
        assert sent < 40, "the connection stayed open while the client dripped after its reply"


def test_a_client_that_streams_after_its_reply_is_cut_after_a_few_kib(engine):
    with serve(create_app(engine, model_name=MODEL)) as url:
        sock = raw_request(url, ["GET /health HTTP/1.1", "Host: 127.0.0.1"])
        assert read_reply(sock).startswith(b"HTTP/1.1 200")
        sent, piece = 0, b"x" * AFTER_BODY_LIMIT
        try:
            while sent < (64 << 20):  # werkzeug alone discards up to 10 GB of it
                sock.sendall(piece)
                sent += len(piece)
        except ConnectionError:
            pass
        sock.close()
        # Cut after AFTER_BODY_LIMIT bytes; what the sockets' buffers took before the reset came is the rest.
        assert sent < (64 << 20), "the server read on after its reply"


def test_an_honest_client_gets_its_reply_whole(engine, url):
    sock = raw_request(url, post_head(f"Content-Length: {len(BODY)}"), BODY)
    reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 200") and json.loads(reply.partition(b"\r\n\r\n")[2])["completion_tokens"] == 2
    sock.close()


# --- 2. Transfer-Encoding: chunked, matched as HTTP does ----------------------------------------


@pytest.mark.parametrize("coding", ["chunked", "Chunked", "CHUNKED"])
def test_a_chunked_body_in_any_case_is_served(url, coding):
    sock = raw_request(url, post_head(f"Transfer-Encoding: {coding}"), b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY))
    assert read_reply(sock).startswith(b"HTTP/1.1 200")
    sock.close()


@pytest.mark.parametrize("coding", ["chunked", "Chunked"])
def test_a_slow_chunked_body_gets_a_408_at_its_deadline(engine, coding):
    # RFC 9112 section 6.1: a transfer coding's name is case-insensitive, so the deadline is the same.
    with serve(create_app(engine, model_name=MODEL), read_timeout=1.0) as url:
        sock = raw_request(url, post_head(f"Transfer-Encoding: {coding}"), b"400\r\n")  # a chunk of 1,024 bytes
        dripped, stop = 0, threading.Event()
        # One byte every 0.2 s: well within the per-read timeout (1 s), never within the deadline.
        while dripped < 50 and not select.select([sock], [], [], 0)[0] and not stop.wait(0.2):
            sock.sendall(b" ")
            dripped += 1
        reply = read_reply(sock)
        sock.close()
        assert dripped < 50, "the body was still being read 10 s after its deadline"
        assert reply.startswith(b"HTTP/1.1 408") and b"--read-timeout" in reply
    wait_until_idle(engine)


@pytest.mark.parametrize("body, words", [
    (b"zz\r\n{}\r\n0\r\n\r\n", b"Invalid chunk header"),  # a size that is not hex
    (b"2\r\n{}XX0\r\n\r\n", b"Missing chunk terminating newline"),  # a chunk longer than its size
])
def test_malformed_chunks_get_a_400_that_says_how_to_send_them(engine, url, body, words):
    sock = raw_request(url, post_head("Transfer-Encoding: chunked"), body)
    reply = read_reply(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 400") and words in reply and b"RFC 9112" in reply
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["type"] == "invalid_request_error"


# --- 3. Expect: 100-continue ------------------------------------------------------------------------

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def test_an_acceptable_head_gets_one_100_continue_then_its_reply(url):
    sock = raw_request(url, post_head(f"Content-Length: {len(BODY)}", "Expect: 100-continue"))
    interim = b""
    while len(interim) < len(CONTINUE):
        interim += sock.recv(len(CONTINUE) - len(interim))
    assert interim == CONTINUE
    sock.sendall(BODY)
    reply = read_reply(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]  # not a second 100 Continue


@pytest.mark.parametrize("length, content_type, status", [
    (3_000_000, "application/json", b"413"),  # over what --max-prompt-tokens could accept
    (len(BODY), "text/plain", b"415"),  # not JSON
])
def test_a_head_refused_gets_its_refusal_and_no_100_continue(url, length, content_type, status):
    head = ["POST /generate HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {content_type}", f"Content-Length: {length}",
            "Expect: 100-continue"]
    sock = raw_request(url, head)  # and no body: a client that waits for its 100 Continue
    reply = read_reply(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 " + status), reply[:200]


def test_an_expectation_is_not_a_body(url):
    status, reply = call(url, "/health", headers={"Expect": "100-continue"})
    assert status == 200 and reply["status"] == "ok"


# --- 4. what a request may cost before any work --------------------------------------------------------


def test_a_chat_of_spaces_is_counted_as_its_template_keeps_them(engine, url):
    # SmolLM2's chat template keeps every space: 400,000 of them are thousands of tokens.
    chat = {"messages": [{"role": "user", "content": " " * 400_000 + "Hi"}], "max_tokens": 2}
    status, reply = call(url, "/generate", chat)
    assert status == 400 and "the prompt's text is 400,002 bytes" in reply["error"]["message"]
    assert engine.allocator.stats.requests == 0


def test_a_chat_of_more_messages_than_the_limit_is_refused_before_its_template(engine, url, tokenized):
    # 257 one-letter messages: far within --max-prompt-tokens' bounds (4,096 messages, 331,776 bytes).
    chat = {"messages": [{"role": "user", "content": "a"}] * (MAX_CHAT_MESSAGES + 1), "max_tokens": 2}
    status, reply = call(url, "/generate", chat)
    assert status == 400 and reply["error"]["message"].startswith(
        f"the chat has {MAX_CHAT_MESSAGES + 1} messages, over this server's limit of {MAX_CHAT_MESSAGES}")
    assert tokenized == [] and engine.allocator.stats.requests == 0
    at_the_limit = {"messages": [{"role": "user", "content": "a"}] * MAX_CHAT_MESSAGES, "max_tokens": 1}
    status, reply = call(url, "/generate", at_the_limit)  # past the bound: the tokenizer and the pool decide
    assert tokenized and "over this server's limit of" not in reply.get("error", {}).get("message", "")


def head_of(fields: int, size: int = 0) -> list[str]:
    """A POST of BODY whose head has `fields` header lines in all, the last padded to make the
    header lines (each with its CRLF) `size` bytes in all."""
    head = post_head(f"Content-Length: {len(BODY)}")
    head += [f"X-Field-{i}: {i}" for i in range(fields - len(head) + 1)]
    used = sum(len(line) + 2 for line in head[1:])
    if size > used:
        head[-1] += "x" * (size - used)
    return head


def test_a_head_at_its_bounds_is_served(engine, url):
    sock = raw_request(url, head_of(MAX_HEADER_FIELDS, MAX_HEAD_BYTES), BODY)
    assert read_reply(sock).startswith(b"HTTP/1.1 200")
    sock.close()


@pytest.mark.parametrize("fields, size, words", [
    (MAX_HEADER_FIELDS + 1, 0, f"more than {MAX_HEADER_FIELDS} header lines"),
    (MAX_HEADER_FIELDS, MAX_HEAD_BYTES + 1, f"over {MAX_HEAD_BYTES // 1024} KiB"),
    (3, 64 << 10, f"over {MAX_HEAD_BYTES // 1024} KiB"),  # one line of 64 KiB: http.server alone took it
], ids=["fields", "bytes", "one long line"])
def test_a_head_over_its_bounds_gets_a_431_and_no_work(engine, url, tokenized, fields, size, words):
    sock = raw_request(url, head_of(fields, size), BODY)
    reply = read_reply(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 431 Request Header Fields Too Large")
    error = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert tokenized == [] and engine.allocator.stats.requests == 0


def test_98_headers_of_64_kib_are_refused_after_16_kib_of_them(engine, url, tokenized):
    # 98 header lines, 6.2 MB: within http.server's own bounds (100 lines, each at most 64 KiB).
    head = post_head(f"Content-Length: {len(BODY)}") + [f"X-Pad-{i}: " + "x" * 65_000 for i in range(95)]
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)

    def send() -> None:
        with contextlib.suppress(OSError):  # the server stops reading, and closes, long before the end
            sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + BODY)

    sending = threading.Thread(target=send)
    sending.start()
    reply = read_reply(sock)
    sending.join(30)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 431") and f"over {MAX_HEAD_BYTES // 1024} KiB".encode() in reply
    assert tokenized == [] and engine.allocator.stats.requests == 0
