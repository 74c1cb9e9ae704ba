"""
The connections of server.py: werkzeug's threaded server (a thread per connection, one
process: one engine, one pool) with the bounds a class needs, so that no one client can take
the server down, and a hang-up check that says whether a request's client is still there.

    server = ClassServer("127.0.0.1", 5000, app, max_connections_per_client=32, max_requests_per_key=8,
                         forwarded_allow_ips=["10.0.0.5"])
    server.serve_forever()        # until Ctrl+C; then drain(server, engine, grace=10)

What a connection may hold, and for how long:

    a new connection           idle_timeout seconds to send its first byte
    its request's head         MAX_HEADER_FIELDS header lines and MAX_HEAD_BYTES bytes of them;
                               beyond either a 431 as soon as the bound is passed (RequestHead);
                               in by head_timeout seconds from the moment it connected, a
                               deadline shorter than the body's: a client sends its head at once
    its request's head & body  read_timeout seconds in all, from the moment it connected:
                               a deadline, not a timeout per read, so a client that sends one
                               byte every few seconds is cut off all the same (a watchdog
                               thread shuts down its reading side: a body cut short gets a 408)
    its reply                  read_timeout seconds for every write it does not read
    connections                max_connections open at once (by default as many as the
                               open-file limit leaves room for: connection_cap); from one
                               address, max_connections_per_client that no key of the class
                               or page poll accounts for (0: no such cap); beyond either a 503
                               from the accepting thread at once, and no thread (Admission).
                               At max_connections a new connection first takes the place of
                               the oldest one whose head is still coming in (make_room)
    generation requests        max_requests_per_key open for one API key: beyond it a 429
                               once its head is in, before the body is read
    its client's address       the peer's, or from a proxy of forwarded_allow_ips the last
                               address of X-Forwarded-For
    after its body             nothing but its end: see HangUpCheck
    after its reply            AFTER_BODY_LIMIT bytes, discarded within read_timeout; then it is
                               closed (a body refused unread is discarded until its deadline)

werkzeug answers every request with `Connection: close`, so nothing a client sends after its
body can be a next request. Read serving/views.py before, serving/routes.py after.
"""

from __future__ import annotations

import contextlib
import http
import io
import json
import logging
import selectors
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler, get_sockaddr, select_address_family

from serving.requests import (
    DEFAULT_HEAD_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS_PER_CLIENT, DEFAULT_MAX_REQUESTS_PER_KEY,
    DEFAULT_READ_TIMEOUT, RETRY_AFTER_S, APIError, Asker, error_json, forwarded_client, is_proxy, trusted_proxies,
)

if TYPE_CHECKING:  # a type only: the door (benchmarks/router_front.py) serves with no engine, and no torch
    from engine.llm_engine import Engine

AFTER_BODY_LIMIT = 4096  # bytes a client may send after its body: more is a hang-up, and after its reply, the end
# A request's head: a browser sends about 20 header lines and a few KiB of them (more with many
# cookies). 16 KiB in all is the bound of h11 (uvicorn's parser) and of Node's http server;
# http.server alone reads 100 lines of 64 KiB each, 6.4 MB, before the app sees a request.
MAX_HEADER_FIELDS = 64
MAX_HEAD_BYTES = 16 * 1024
WATCH_EVERY_S = 0.1  # how often the watchdog looks for requests past their deadline
# Connections, a thread and an open file each (a proxy's two: its client's and its upstream's).
# The open-file limit is the bound a flood of connections meets first: 1,024 on many desktops,
# 256 on macOS. A connection past it is not refused but left unaccepted, its client waiting
# without an answer, and the model's files cannot be opened either. So the cap is what the
# limit leaves after a reserve for the process's own files, and at most MOST_CONNECTIONS threads.
MOST_CONNECTIONS = 1024
FEWEST_CONNECTIONS = 32
MAKE_ROOM_AFTER_S = 0.5  # at the cap, a head still coming in after this long gives its place to a new connection
CLOSE_S = 5.0  # after the grace of a Ctrl+C: how long connections get to end before they are cut

log = logging.getLogger("server")

# -----------------------------------------------------------------------------
# 1. Has the client gone?


class HangUpCheck:
    """Whether a request's client has gone, asked by the engine loop before each step while
    the request waits or prefills, and by its own thread between two tokens. Gone: its
    socket is readable and a read finds the end of the stream (the client closed, or shut
    down its sending side, as `nc -N` does), or it sent more than AFTER_BODY_LIMIT bytes
    after its body (junk cannot hide a close behind it: it ends the connection).

    The check never raises: a check that fails (a socket already closed) says "gone", for
    this request only; the engine loop calls it for every request, and one client's broken
    socket must not fail the others'. A selector, not select.select, which refuses a
    descriptor over 1,023 (a server with more than about 1,000 connections) and exists for
    sockets on every OS.

    >>> a, b = socket.socketpair()
    >>> check = HangUpCheck(a)
    >>> check(), b.sendall(b"x" * 10), check(), b.shutdown(socket.SHUT_WR), check()
    (False, None, False, None, True)
    >>> a.close(); HangUpCheck(a)()   # its socket closed under it: gone, no exception
    True
    >>> b.close()
    """

    def __init__(self, sock: socket.socket | None):
        self.sock = sock  # None: not served by ClassServer (Flask's test client): never gone
        self.after_body = 0  # bytes read after the body

    def __call__(self) -> bool:
        if self.sock is None:
            return False
        try:
            return self.look()
        except Exception as err:  # noqa: BLE001 (the check itself failed: this request is gone, no other)
            log.info("the hang-up check failed (%s: %s): the request is treated as gone", type(err).__name__, err)
            return True

    def look(self) -> bool:
        with selectors.DefaultSelector() as selector:
            selector.register(self.sock, selectors.EVENT_READ)
            while selector.select(timeout=0):
                data = self.sock.recv(AFTER_BODY_LIMIT + 1 - self.after_body)
                if not data:
                    return True
                self.after_body += len(data)
                if self.after_body > AFTER_BODY_LIMIT:
                    return True
        return False


# -----------------------------------------------------------------------------
# 2. What a request's head and body, and what follows its reply, may cost


class HeadTooLarge(Exception):
    """A request head over MAX_HEADER_FIELDS lines or MAX_HEAD_BYTES bytes: a 431."""


class RequestHead:
    """The reader http.server parses a request's header lines from, line by line
    (http.client.parse_headers calls readline and nothing else), with the bounds counted as
    the lines come: a head over either raises HeadTooLarge at the first line past it, having
    read at most MAX_HEAD_BYTES + 2 bytes of header lines, whatever the client still sends.

    >>> head = RequestHead(io.BytesIO(b"Host: a\\r\\nX-Pad: " + b"x" * 20_000 + b"\\r\\n\\r\\n"))
    >>> head.readline(65537)
    b'Host: a\\r\\n'
    >>> head.readline(65537)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    serving.connections.HeadTooLarge: the request's header lines are over 16 KiB, ...
    """

    def __init__(self, rfile):
        self.rfile = rfile
        self.fields = 0
        self.size = 0  # bytes of header lines read, each with its line end

    def readline(self, limit: int = -1) -> bytes:
        most = MAX_HEAD_BYTES - self.size + 2  # room for the line end of the empty line that ends the head
        line = self.rfile.readline(most if limit < 0 else min(limit, most))
        if line in (b"\r\n", b"\n", b""):  # the end of the head (or of the stream)
            return line
        self.fields += 1
        self.size += len(line)
        if self.size > MAX_HEAD_BYTES:
            raise HeadTooLarge(f"the request's header lines are over {MAX_HEAD_BYTES // 1024} KiB, this server's "
                               f"limit; send fewer or shorter headers (a browser: its cookies for this host may be "
                               f"many: open the page in a private window)")
        if self.fields > MAX_HEADER_FIELDS:
            raise HeadTooLarge(f"the request has more than {MAX_HEADER_FIELDS} header lines, this server's limit; "
                               f"send fewer")
        return line


def http_reply(status: int, message: str, retry_after: int | None = None) -> bytes:
    """A whole JSON error reply, for a connection the app never sees (refused when accepted,
    or a head that broke a bound): the same body as the app's errors.

    >>> http_reply(431, "too big").split(b"\\r\\n")[0]
    b'HTTP/1.1 431 Request Header Fields Too Large'
    """
    body = json.dumps(error_json(status, message)).encode()
    retry = "" if retry_after is None else f"Retry-After: {retry_after}\r\n"
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{retry}Connection: close\r\n\r\n")
    return head.encode() + body


def discard_pending(sock: socket.socket) -> None:
    """Read what the client has sent by now, unread: a socket closed on unread bytes is reset
    (RFC 9293 section 3.6), and a reset can reach the client before the reply it was sent."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.recv(1 << 16)


class ContinueFirst(io.RawIOBase):
    """A request's body that says "100 Continue" before its first byte is read.

    A client that sends `Expect: 100-continue` waits for that word before it sends its body
    (RFC 9110 section 10.1.1). The app reads a body only once its head passed every check
    (Host, key, Content-Type, a Content-Length within the limit), so saying it at the first
    read says it only for a head that will be served; a refused head gets its 4xx instead,
    and its client never sends the 3 MB it announced.
    """

    def __init__(self, body, say_continue):
        super().__init__()
        self.body, self.say_continue = body, say_continue

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.say_continue is not None:
            self.say_continue()
            self.say_continue = None
        if hasattr(self.body, "readinto"):
            return self.body.readinto(buffer)
        data = self.body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class AfterReply:
    """What werkzeug reads once a reply is sent: it discards what the client sends next, so
    that a client still sending sees its reply rather than a reset (a socket closed on
    unread bytes is reset, RFC 9293 section 3.6). Alone it reads up to 10 MB a time and waits
    for them, each read with a fresh timeout: a client that drips a byte every few seconds
    after its reply held its connection and thread for ever.

    Here: once the body was read (or there was none), at most AFTER_BODY_LIMIT bytes, what has
    come by then, within read_timeout of the reply; then end of stream, and werkzeug closes
    the connection. A body refused unread (a 413 on its Content-Length, a 415) is still the
    request's: it is discarded until the request's own deadline, when the watchdog cuts it.
    """

    def __init__(self, rfile, connection: Connection, read_timeout: float):
        self.rfile, self.connection, self.read_timeout = rfile, connection, read_timeout
        self.deadline: float | None = None  # set at the first read after the reply
        self.discarded = 0

    def read(self, size: int = -1) -> bytes:
        if self.connection.reading:  # a body refused unread: the watchdog ends it at its deadline
            return self.rfile.read(size)
        if self.deadline is None:
            self.deadline = time.monotonic() + self.read_timeout
        left, wait = AFTER_BODY_LIMIT - self.discarded, self.deadline - time.monotonic()
        if left <= 0 or wait <= 0:
            return b""
        try:
            self.connection.sock.settimeout(wait)
            data = self.rfile.read1(left if size < 0 else min(size, left))  # what has come, not 10 MB
        except OSError:  # its timeout, or a reset: either way the end
            return b""
        self.discarded += len(data)
        return data

    def close(self) -> None:
        self.rfile.close()


# -----------------------------------------------------------------------------
# 3. One connection, and who may hold one


def open_file_limit() -> int | None:
    """The process's soft limit on open files (ulimit -n); None where it has none to read."""
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def connection_cap(files_per_connection: int = 1, limit: int | None = None) -> int:
    """--max-connections's default: what the open-file limit leaves after an eighth of it (at
    least 64 files) for the process's own, between FEWEST_CONNECTIONS and MOST_CONNECTIONS.

    >>> connection_cap(limit=1024), connection_cap(2, limit=1024), connection_cap(limit=256), connection_cap(limit=20_000)
    (896, 448, 192, 1024)
    """
    limit = open_file_limit() if limit is None else limit
    if limit is None:
        return MOST_CONNECTIONS
    spare = limit - max(64, limit // 8)
    return max(FEWEST_CONNECTIONS, min(MOST_CONNECTIONS, spare // files_per_connection))


@dataclass(eq=False)
class Connection:
    """One open connection as the server tracks it, from its accept to the end of its thread."""

    sock: socket.socket
    peer: str  # the IP address it comes from
    deadline: float  # time.monotonic() by which its request's head and body must be in
    head_deadline: float = float("inf")  # by which its head must be in
    address: str = ""  # the client's IP address: the peer's, or from a proxy the one it forwarded
    admission: Admission | None = None  # the caps it is counted under, once accepted
    unknown_at: str | None = None  # the address whose share of connections it holds (Admission)
    key: str | None = None  # the API key whose share of generation requests it holds
    reading: bool = True  # still reading its request: the deadline applies
    head_in: bool = False  # its request's head has been read
    cut_off: bool = False  # cut while its request was being read (its deadline came, or its place was given away)
    leaving: bool = False  # cut to make room for a new connection (Admission.make_room), not yet ended
    thread: threading.Thread | None = None  # its own, once started

    def __post_init__(self) -> None:
        self.address = self.address or self.peer
        self.opened = time.monotonic()

    def late(self, now: float) -> str | None:
        """Which deadline its request has passed, if any: "head" or "request"."""
        if not self.reading:
            return None
        if now > self.deadline:
            return "request"
        return "head" if not self.head_in and now > self.head_deadline else None

    def admit(self, asker: Asker) -> None:
        """Its head is in: count it as what the head says (Admission.admit); an APIError if not."""
        if self.admission is not None:
            self.admission.admit(self, asker)

    def reply_generated(self) -> None:
        """Its reply is whole (the last event of a stream, or a reply that was not streamed):
        the key's share of requests is free before the client can read the end of it, so a
        student's next request, sent on the reply's last byte, is not refused (Admission)."""
        if self.admission is not None:
            self.admission.free_key(self)

    def body_read(self) -> None:
        """The request is all in: from now on only its reply is timed (per write)."""
        self.reading = False

    def cut(self, how: int = socket.SHUT_RD) -> None:
        """Shut the socket down under its thread: a read waiting there returns at once.
        SHUT_RD leaves the writing side, so a body cut short still gets its 408."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(how)


FULL = "this server has its most connections open (--max-connections); try again in a moment"


class Admission:
    """Who may hold the server's connections: three caps, counted under one lock from a
    connection's accept to the end of its thread.

        max_connections             connections in all (a thread each)
        max_connections_per_client  per address, the connections nothing else accounts for: a
                                    head still coming in, and a request that shows no key of
                                    --api-keys and is not one of the live page's polls
        max_requests_per_key        per API key, generation requests open (waiting, running,
                                    streaming), where keys are in use: counted from its head
                                    until its reply is whole (Connection.reply_generated),
                                    before the client reads its last byte

    Why not every connection of an address: a class behind one NAT, tunnel or proxy reaches
    the server from one address, so a cap on all of them refused that class (thirty streams
    and eight pages' polls passed 32), and turned off it let one student take every
    connection. What tells students apart there is their key. A connection whose head shows a
    key of --api-keys leaves its address's count and is counted by its key instead; a poll of
    the page leaves it too (it ends at once). What stays counted by address is what an attack
    on the connections holds: heads that never finish, requests that name no one. A key anyone
    can make up (--salt-by-api-key without --api-keys) stands for no one: its requests stay
    counted by address too, or one student with a fresh key for each connection would hold them
    all.

    An address's count is checked when a connection is accepted, so a refused one costs no
    thread; from a proxy of --forwarded-allow-ips, whose client is known only from the head,
    once the head is in. The cost: a poll too is refused while its address holds its share of
    unknown connections, for at accept nothing tells a poll from a slow head.

    >>> caps = Admission(max_connections=8, max_connections_per_client=2, max_requests_per_key=1)
    >>> a, b, c = (Connection(None, "10.0.0.1", deadline=0.0) for _ in range(3))
    >>> caps.accept(a), caps.accept(b)  # two heads coming in from 10.0.0.1: its share
    (None, None)
    >>> print(caps.accept(c))  # doctest: +ELLIPSIS
    10.0.0.1 has 2 connections open, the most one address may (--max-connections-per-client; ...
    >>> alice = Asker("10.0.0.1", key="sha-256 of alice's key", listed=True, generation=True)
    >>> caps.admit(a, alice)  # a's head shows Alice's key: counted by her key, not by 10.0.0.1
    >>> caps.accept(c) is None
    True
    >>> caps.admit(b, alice)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    serving.requests.APIError: this API key has 1 generation requests open ...
    """

    def __init__(self, max_connections: int, max_connections_per_client: int, max_requests_per_key: int,
                 proxies=()):
        self.max_connections, self.max_connections_per_client = max_connections, max_connections_per_client
        self.max_requests_per_key = max_requests_per_key
        self.proxies = trusted_proxies(proxies)  # --forwarded-allow-ips
        self.open = 0
        self.leaving = 0  # of them, cut to make room and not yet ended: their places are taken
        self.unknown: dict[str, int] = {}  # by address: connections no key or page accounts for
        self.requests: dict[str, int] = {}  # by API key: generation requests open
        self.lock = threading.Lock()

    def accept(self, connection: Connection) -> str | None:
        """Count a new connection, or say why it is refused (a 503 from the accepting thread)."""
        with self.lock:
            if self.open - self.leaving >= self.max_connections:
                return FULL
            if not is_proxy(connection.peer, self.proxies):  # a proxy's client is known once its head is in
                if self.address_full(connection.peer):
                    return self.too_many(connection.peer)
                self.hold_address(connection, connection.peer)
            self.open += 1
            connection.admission = self
        return None

    def admit(self, connection: Connection, asker: Asker) -> None:
        """Count an accepted connection as its head says: a 503 for its address's share (from
        a proxy), a 429 for its key's."""
        with self.lock:
            if asker.page or asker.listed:
                self.free_address(connection)
            elif connection.unknown_at is None:  # from a proxy: its client is known only now
                if self.address_full(asker.address):
                    raise APIError(503, self.too_many(asker.address), retry_after=RETRY_AFTER_S)
                self.hold_address(connection, asker.address)
            if asker.generation and asker.key is not None:
                held = self.requests.get(asker.key, 0)
                if held >= self.max_requests_per_key:
                    raise APIError(429, f"this API key has {held} generation requests open (waiting, running or "
                                        f"streaming), the most one key may (--max-requests-per-key); send the next "
                                        f"one when one has finished", retry_after=RETRY_AFTER_S)
                self.requests[asker.key] = held + 1
                connection.key = asker.key

    def make_room(self, connection: Connection) -> bool:
        """Give `connection`'s place to a new one: it is cut at once (its head was not in), and
        its place counts as free from now, not from when its thread has ended."""
        with self.lock:
            if connection.head_in:  # it came in meanwhile
                return False
            connection.leaving, connection.reading, connection.cut_off = True, False, True  # no request, when it ends
            self.leaving += 1
        connection.cut(socket.SHUT_RDWR)
        return True

    def free_key(self, connection: Connection) -> None:
        """Its generation request is done: its key's share is free (once; the connection may
        still be sending the reply's last bytes)."""
        with self.lock:
            self.free_request(connection)

    def release(self, connection: Connection) -> None:
        """The connection has ended: what it held is free."""
        with self.lock:
            self.open -= 1
            if connection.leaving:
                self.leaving -= 1
            self.free_address(connection)
            self.free_request(connection)

    # --- under the lock ---

    def address_full(self, address: str) -> bool:
        cap = self.max_connections_per_client
        return bool(cap) and self.unknown.get(address, 0) >= cap

    def too_many(self, address: str) -> str:
        return (f"{address} has {self.max_connections_per_client} connections open, the most one address may "
                f"(--max-connections-per-client; the live page's polls and requests with a key of --api-keys "
                f"are not counted); try again in a moment")

    def hold_address(self, connection: Connection, address: str) -> None:
        self.unknown[address] = self.unknown.get(address, 0) + 1
        connection.unknown_at = address

    def free_request(self, connection: Connection) -> None:
        if connection.key is not None:
            self.requests[connection.key] -= 1
            if not self.requests[connection.key]:
                del self.requests[connection.key]
            connection.key = None

    def free_address(self, connection: Connection) -> None:
        address, connection.unknown_at = connection.unknown_at, None
        if address is not None:
            self.unknown[address] -= 1
            if not self.unknown[address]:
                del self.unknown[address]


# -----------------------------------------------------------------------------
# 4. Its handler, and the server


CONNECTION = "class_server.connection"  # the WSGI environ key of a request's Connection


def connection_of(environ: dict) -> Connection | None:
    """The request's Connection; None under another server (or Flask's test client)."""
    return environ.get(CONNECTION)


class RequestHandler(WSGIRequestHandler):
    """werkzeug's handler on a tracked Connection: a new connection has idle_timeout seconds
    to start its request, every later read or write read_timeout seconds (the watchdog
    holds the whole request to its deadline meanwhile)."""

    idle_timeout = DEFAULT_IDLE_TIMEOUT
    read_timeout = DEFAULT_READ_TIMEOUT

    def setup(self) -> None:
        super().setup()
        self.tracked = self.server.connection_for(self.connection)
        self.tracked.thread = threading.current_thread()

    def handle_one_request(self) -> None:
        self.connection.settimeout(self.idle_timeout)
        self.expects_continue = False
        super().handle_one_request()

    def parse_request(self) -> bool:  # called once the request line has come
        self.connection.settimeout(self.read_timeout)
        rfile, self.rfile = self.rfile, RequestHead(self.rfile)
        try:
            parsed = super().parse_request()  # reads the headers
            self.tracked.head_in = True
        except HeadTooLarge as err:
            self.answer(431, str(err))
            return False
        finally:
            self.rfile = rfile
        if self.tracked.cut_off:  # its head did not come by the deadline: it is no request
            self.close_connection = True
            return False
        if parsed:
            try:
                self.tracked.address = forwarded_client(self.tracked.peer, self.headers.get_all("X-Forwarded-For"),
                                                        self.server.admission.proxies)
            except APIError as err:
                self.answer(err.status, err.message)
                return False
        if parsed and "Expect" in self.headers:
            # http.server answered none (handle_expect_100 below); werkzeug would answer one
            # more, before the app has seen the head: ContinueFirst answers it, once.
            self.expects_continue = self.headers["Expect"].strip(" \t").lower() == "100-continue"
            del self.headers["Expect"]
        return parsed

    def answer(self, status: int, message: str) -> None:
        """Answer a head that never reaches the app, and end the connection."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.write(http_reply(status, message))
            self.wfile.flush()
        discard_pending(self.connection)
        log.warning("%s: %d: %s", self.tracked.address, status, message)

    def handle_expect_100(self) -> bool:
        """http.server's answer to `Expect: 100-continue` comes as soon as the head is in,
        whatever the head says; here the body's first read says it (ContinueFirst)."""
        return True

    def say_continue(self) -> None:
        # RFC 9110 section 10.1.1: a client that sends this expectation in HTTP/1.0 gets no 100.
        if self.request_version >= "HTTP/1.1":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()

    def make_environ(self) -> dict:
        environ = super().make_environ()
        environ[CONNECTION] = self.tracked
        environ["REMOTE_ADDR"] = self.tracked.address  # the client's, as werkzeug's ProxyFix would set it
        # werkzeug reads a chunked body (wsgi.input_terminated) when Transfer-Encoding names
        # chunked in any case, as RFC 9112 section 7 says a coding's name is matched: the
        # deadline holds for exactly the bodies it reads.
        if environ.get("CONTENT_LENGTH") in (None, "", "0") and not environ.get("wsgi.input_terminated"):
            self.tracked.body_read()  # no body to wait for
        elif self.expects_continue:
            environ["wsgi.input"] = ContinueFirst(environ["wsgi.input"], self.say_continue)
        # wsgi.input holds the socket's reader now; werkzeug's own reads from here on are what
        # follows the reply.
        self.rfile = AfterReply(self.rfile, self.tracked, self.read_timeout)
        return environ


def bind_error(host: str, port: int) -> OSError | None:
    """What binding host:port as ClassServer does fails with right now, or None. server.py asks
    before the model loads, so a port another program holds is said at once instead of after
    the load (a bind later can still lose a race, and fails the same way)."""
    family = select_address_family(host, port)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as werkzeug's server (allow_reuse_address)
        try:
            probe.bind(get_sockaddr(host, port, family))
        except OSError as err:
            return err
    return None


class ClassServer(ThreadedWSGIServer):
    """werkzeug's threaded server with the bounds of this module's docstring."""

    def __init__(self, host: str, port: int, app, *, max_connections: int | None = None,
                 max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                 max_requests_per_key: int = DEFAULT_MAX_REQUESTS_PER_KEY, forwarded_allow_ips=(),
                 read_timeout: float = DEFAULT_READ_TIMEOUT, idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
                 head_timeout: float = DEFAULT_HEAD_TIMEOUT):
        handler = type("Handler", (RequestHandler,), {"read_timeout": read_timeout, "idle_timeout": idle_timeout})
        super().__init__(host, port, app, handler=handler)
        max_connections = connection_cap() if max_connections is None else max_connections
        self.admission = Admission(max_connections, max_connections_per_client, max_requests_per_key,
                                   forwarded_allow_ips)
        self.read_timeout = read_timeout
        self.head_timeout = min(head_timeout, read_timeout)
        self.connections: dict[socket.socket, Connection] = {}  # by socket, from accept to the end of its thread
        self.connections_lock = threading.Lock()
        # A thread that touches torch while the interpreter shuts down aborts the process
        # ("terminate called without an active exception"): a tensor freed there gives up the
        # GIL and cannot take it back. So the server's threads are waited for, not killed;
        # drain() makes sure they end.
        self.daemon_threads = False
        self.closing = threading.Event()  # set: the watchdog stops
        self.watchdog = threading.Thread(target=self.watch, name="deadlines", daemon=True)

    def log(self, type: str, message: str, *args) -> None:
        # After a read timeout (the client has its 408), werkzeug still reads what is left of
        # the body, on a socket object that refuses every read once one timed out: not news.
        if "cannot read from timed out object" not in message:
            super().log(type, message, *args)

    # --- accepting, and refusing ---

    def process_request(self, request, client_address) -> None:
        now = time.monotonic()
        connection = Connection(request, client_address[0], now + self.read_timeout, now + self.head_timeout)
        refusal = self.admission.accept(connection)
        if refusal is FULL and self.make_room(now):
            refusal = self.admission.accept(connection)
        if refusal is not None:
            self.refuse(request, refusal)
            return
        with self.connections_lock:
            self.connections[request] = connection
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self.release(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.release(request)

    def release(self, sock: socket.socket) -> None:
        with self.connections_lock:
            connection = self.connections.pop(sock)
        self.admission.release(connection)

    def refuse(self, sock, message: str) -> None:
        try:
            sock.setblocking(False)
            sock.sendall(http_reply(503, message, RETRY_AFTER_S))  # a few hundred bytes: the buffer takes them at once
            discard_pending(sock)
        except OSError:
            pass
        finally:
            self.shutdown_request(sock)
        log.warning("refused a connection: %s", message)

    # --- the connections, their deadlines, and their end ---

    def make_room(self, now: float) -> bool:
        """At max_connections: cut the oldest connection whose head has been coming in for more
        than MAKE_ROOM_AFTER_S, so that a new one takes its place. A client sends its head as
        soon as it connects, so the heads still coming in after that are what a flood of idle
        or dripping connections holds; an honest client meets it only on a network so slow
        that its head takes half a second."""
        with self.connections_lock:
            waiting = [c for c in self.connections.values()
                       if not c.head_in and not c.leaving and now - c.opened > MAKE_ROOM_AFTER_S]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.opened)
        if not self.admission.make_room(oldest):
            return False
        log.warning("%s: its head was not in after %.1f s, and a new connection needed its place "
                    "(--max-connections %d): cut", oldest.address, now - oldest.opened, self.admission.max_connections)
        return True

    def connection_for(self, sock: socket.socket) -> Connection:
        with self.connections_lock:
            return self.connections[sock]

    def open_connections(self) -> list[Connection]:
        with self.connections_lock:
            return list(self.connections.values())

    def watch(self) -> None:
        """The watchdog: a request whose head and body are not in by its deadline is cut."""
        while not self.closing.wait(WATCH_EVERY_S):
            now = time.monotonic()
            for connection in self.open_connections():
                late = connection.late(now)
                if late is not None:
                    connection.reading, connection.cut_off = False, True
                    connection.cut()
                    log.warning("%s: its request's %s was not in within %g s (%s): cut off", connection.address, late,
                                *((self.head_timeout, "--head-timeout") if late == "head" else
                                  (self.read_timeout, "--read-timeout")))

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """socketserver's loop, without werkzeug's ending (which swallows Ctrl+C and then waits
        for every connection to end): drain() decides how the connections end."""
        if not self.watchdog.is_alive():
            self.watchdog.start()
        socketserver.BaseServer.serve_forever(self, poll_interval)

    def stop_accepting(self) -> None:
        """End serve_forever, running in another thread; returns at once if it has ended."""
        socketserver.BaseServer.shutdown(self)

    def close_connections(self, wait: float) -> None:
        """Give the open connections `wait` seconds to end, then shut each down (a client that
        reads no reply, or sends nothing), and wait for every thread. Requests still being
        read are cut at once: nothing will serve them now."""
        for connection in self.open_connections():
            if connection.reading:
                connection.cut()
        deadline = time.monotonic() + wait
        for connection in self.open_connections():
            if connection.thread is not None:
                connection.thread.join(max(0.0, deadline - time.monotonic()))
        for connection in self.open_connections():
            connection.cut(socket.SHUT_RDWR)
        self.closing.set()
        self.server_close()  # joins the connections' threads: each has nothing left to wait for


def serve_in_background(app, host: str = "127.0.0.1", port: int = 0, **limits):
    """Serve `app` from a daemon thread, for a lesson, test or benchmark that runs the server
    inside its own process; port 0 lets the OS pick a free one. limits: ClassServer's.
    Returns (base URL, server); server.shutdown() stops it."""
    app.extensions["server"].settings.allowed_hosts.add(host.lower())
    server = ClassServer(host, port, app, **limits)
    # shutdown() waits for the serving thread, whose last act is to drop its reference to the
    # server, the app and so the engine, which may be the last one (see ClassServer).
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def shutdown() -> None:
        server.stop_accepting()
        thread.join()
        server.close_connections(CLOSE_S)

    server.shutdown = shutdown
    return f"http://{host}:{server.server_port}", server


def drain(server: ClassServer, engine: Engine, grace: float) -> None:
    """After Ctrl+C, done within grace + CLOSE_S seconds whatever the clients do: take no new
    connection; requests that wait get a 503, running ones `grace` seconds to finish and then
    a last event (finish reason "abort"; a stream then its [DONE]); then every connection
    gets CLOSE_S seconds to end before it is shut down."""
    server.stop_accepting()
    server.socket.close()  # a client that connects now is refused by the OS
    for connection in server.open_connections():
        if connection.reading:  # a request still coming in: nothing will serve it now
            connection.cut()
    engine.drain(grace)
    server.close_connections(CLOSE_S)
