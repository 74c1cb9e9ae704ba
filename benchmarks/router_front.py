"""The class's door to a fleet: a small proxy in front of SGLang's router with the class server's
own connection rules, because sglang-router 0.3.2 has none of them.

    python -m benchmarks.router_front --router http://127.0.0.1:30000 --api-keys class.txt \\
        --admin-key TEACHER --host 0.0.0.0 --port 8000     # benchmarks/router.py's fleet() starts it

What the router lacks (0.3.2; docs/fleet.md has what each cost): no deadline for a
connection's head or for an idle one, no cap on connections (idle ones use up the open-file
limit, and then no chat is served), a body read whole before it is refused, and routes that
anyone may call and no flag closes (/get_server_info, /readiness, /get_model_info,
/v1/tokenize, /ha/*, ...). The door is serving.connections.ClassServer, the
class server's own: every deadline and cap of that module (a head in --head-timeout, a request in
--read-timeout, --max-connections from the open-file limit at two files a connection, its own
and its upstream's, one address's share of the unknown ones, a key's share of requests), and:

    routes       POST /v1/chat/completions, POST /v1/completions, GET /v1/models; any other is a
                 404 that names them (/generate's names /v1/completions: the router empties its body)
    keys         a key of --api-keys (or the teacher's) on every route, else a 401 here
    bodies       over --max-body-bytes (the replicas' own limit): a 413 on the Content-Length,
                 before a byte of the body is read
    the router   reached on 127.0.0.1 only, with the request's Content-Type, Accept and
                 Authorization; its reply streamed back as it comes, and the connection to the
                 router closed when the student hangs up

The router's control plane (/workers, /get_loads, ...) stays on the router's own port, on this
machine only, behind the teacher's key.
"""

from __future__ import annotations

import argparse
import http.client
import logging
import signal
import sys
import threading
from typing import Iterator
from urllib.parse import urlsplit

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import ClientDisconnected

from commands.flags import positive_float, positive_int
from serving.connections import ClassServer, connection_cap, connection_of
from serving.requests import (
    DEFAULT_HEAD_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS_PER_CLIENT, DEFAULT_MAX_REQUESTS_PER_KEY,
    DEFAULT_READ_TIMEOUT, DEFAULT_REQUEST_TIMEOUT, APIError, Asker, bearer_key, error_json, is_listed, read_api_keys,
    read_body,
)

ROUTES = {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")}
GENERATION = {"/v1/chat/completions", "/v1/completions"}
PASSED_HEADERS = ("Content-Type", "Accept", "Authorization")
# Hop-by-hop headers (RFC 9110 section 7.6.1) and the length: the door's server frames its own reply.
NOT_PASSED_BACK = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}
FILES_PER_CONNECTION = 2  # the student's socket and the one to the router
CHUNK_BYTES = 64 * 1024



def front_app(router_url: str, api_keys: frozenset[str], admin_key: str, max_body_bytes: int,
              request_timeout: float = DEFAULT_REQUEST_TIMEOUT) -> Flask:
    """The door's WSGI app: the checks of the module's docstring, then the request passed to
    the router at router_url (on 127.0.0.1) and its reply streamed back."""
    upstream = urlsplit(router_url)
    if upstream.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the router must listen on this machine only (127.0.0.1), got {router_url}")
    app = Flask(__name__)
    named = ", ".join(f"{method} {path}" for method, path in sorted(ROUTES, key=lambda r: r[1]))

    @app.errorhandler(APIError)
    def api_error(err: APIError):
        reply = jsonify(error_json(err.status, err.message))
        reply.status_code = err.status
        if err.retry_after is not None:
            reply.headers["Retry-After"] = str(err.retry_after)
        return reply

    @app.before_request
    def check():
        if (request.method, request.path) not in ROUTES:
            hint = " (this course's /generate: the router empties its body; send /v1/completions)" \
                if request.path == "/generate" else ""
            raise APIError(404, f"{request.method} {request.path} is not served through this fleet{hint}; "
                                f"the class's routes: {named}")
        key = bearer_key(request.headers)
        if key is None or not is_listed(key, api_keys, admin_key):
            raise APIError(401, "send a key of the class: an Authorization: Bearer KEY header, with the key "
                                "the teacher gave you")
        g.key = key
        connection = connection_of(request.environ)
        if connection is not None:  # counted by its key, not its address (serving.connections.Admission)
            connection.admit(Asker(request.remote_addr, key=key, listed=True,
                                   generation=request.path in GENERATION))

    @app.route("/v1/models", methods=["GET"])
    @app.route("/v1/chat/completions", methods=["POST"])
    @app.route("/v1/completions", methods=["POST"])
    def forward():
        body = read_whole_body()
        headers = {name: request.headers[name] for name in PASSED_HEADERS if name in request.headers}
        conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=request_timeout)
        try:
            conn.request(request.method, request.path, body=body or None, headers=headers)
            reply = conn.getresponse()
        except OSError as err:
            conn.close()
            raise APIError(502, f"the router did not answer ({err}); tell the teacher") from None
        passed = [(name, value) for name, value in reply.getheaders() if name.lower() not in NOT_PASSED_BACK]
        return Response(stream_reply(conn, reply), status=reply.status, headers=passed, direct_passthrough=True)

    def read_whole_body() -> bytes:
        if request.method != "POST":
            return b""
        try:
            raw = read_body(request.stream, request.content_length, max_body_bytes)
        except ClientDisconnected:
            raise APIError(408, "the body stopped arriving before its Content-Length (or its last chunk), or did "
                                "not arrive within --read-timeout; send it whole, at once") from None
        connection = connection_of(request.environ)
        if connection is not None:
            connection.body_read()
        return raw

    return app


def stream_reply(conn: http.client.HTTPConnection, reply: http.client.HTTPResponse) -> Iterator[bytes]:
    """The router's reply as it comes (a stream's events one by one); closing it, as the server
    does when the student hangs up, closes the connection to the router."""
    try:
        while chunk := reply.read1(CHUNK_BYTES):
            yield chunk
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_front", description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", required=True, help="the router's URL, on 127.0.0.1")
    parser.add_argument("--host", default="127.0.0.1", help="where the class reaches the door (default: 127.0.0.1)")
    parser.add_argument("--port", type=positive_int, required=True)
    parser.add_argument("--api-keys", required=True, metavar="FILE", help="the students' keys, one a line")
    parser.add_argument("--admin-key", required=True, help="the teacher's key")
    parser.add_argument("--max-body-bytes", type=positive_int, required=True, help="the replicas' body limit")
    parser.add_argument("--max-connections", type=positive_int, default=None,
                        help=f"open connections (default: what the open-file limit leaves, two files each: "
                             f"{connection_cap(FILES_PER_CONNECTION)} here)")
    parser.add_argument("--max-connections-per-client", type=int, default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT)
    parser.add_argument("--max-requests-per-key", type=positive_int, default=DEFAULT_MAX_REQUESTS_PER_KEY)
    parser.add_argument("--idle-timeout", type=positive_float, default=DEFAULT_IDLE_TIMEOUT)
    parser.add_argument("--head-timeout", type=positive_float, default=DEFAULT_HEAD_TIMEOUT)
    parser.add_argument("--read-timeout", type=positive_float, default=DEFAULT_READ_TIMEOUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        api_keys = read_api_keys(args.api_keys)
        app = front_app(args.router, api_keys, args.admin_key, args.max_body_bytes)
    except (OSError, ValueError) as err:
        parser.exit(2, f"error: {err}\n")
    server = ClassServer(args.host, args.port, app,
                         max_connections=args.max_connections or connection_cap(FILES_PER_CONNECTION),
                         max_connections_per_client=args.max_connections_per_client,
                         max_requests_per_key=args.max_requests_per_key, idle_timeout=args.idle_timeout,
                         head_timeout=args.head_timeout, read_timeout=args.read_timeout)
    server.daemon_threads = True  # no engine here: nothing to drain
    stopping = threading.Event()

    def stop(*_):
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.stop_accepting).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"the door on http://{args.host}:{server.server_port}, in front of {args.router}", flush=True)
    server.serve_forever()
    server.close_connections(1.0)


if __name__ == "__main__":
    sys.exit(main())
