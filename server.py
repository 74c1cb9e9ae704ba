"""
A tiny HTTP server around the Engine: what a class can curl, what an OpenAI client can use,
and a page that shows the KV block pool live while the requests come in.

    python server.py                        # the offline default model on http://127.0.0.1:5000
    python server.py --num-blocks 64        # a small pool: watch blocks get evicted, requests wait
    python server.py --no-batching          # one request at a time, as stage 7's engine runs it
    python server.py --salt-by-api-key --admin-key SECRET   # a cache per API key; only SECRET resets

    curl -s localhost:5000/generate -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16}'

Routes:
    POST /generate               {"prompt": str} or {"messages": [...]}, max_tokens, temperature,
                                 top_p, seed, stop, cache_salt -> text, prompt_tokens, cached_tokens, ...
    GET  /health                 status, model, the cache figures (hit rate, blocks in use, ...)
                                 and the scheduler's (running, waiting, preemptions, the last step)
    GET  /cache                  /health plus the pool: every block, the free queue, block tables,
                                 the waiting queue
    POST /reset_prefix_cache     forget every cached block (refused while requests run)
    POST /v1/chat/completions    OpenAI's shapes, stream: true included, and
    POST /v1/completions           usage.prompt_tokens_details.cached_tokens
    GET  /v1/models
    GET  /                       the live view of the pool (static/index.html), polling /cache

Each client's request runs in a thread of its own; what the engine does with them depends
on its kind:

    batching (the default)  Engine(batching=True): an engine loop puts every running request
                            in the same forward pass, one step after another (batch_engine.py).
                            A request the pool has no room for now waits in a queue, or a
                            running one is preempted and resumed later, as in vLLM.
    --no-batching           stage 7's engine: one step (one request's prefill, or one decoded
                            token) at a time, so replies interleave token by token; a request
                            the pool has no room for is refused with a 503.

Every error is a JSON object {"error": {"message", "type"}} with a 4xx status (5xx when the
server is at fault).
docs/server.md says what a tenant can see, and where this server differs from vLLM's.

server_requests.py reads and checks what a client sends (the body, who is asking, the
generation request); this file runs it: read it first. Here: running a request (1), what a
caller may see (2), the routes (3), create_app (4), main (5).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from flask import Blueprint, Flask, Response, current_app, request
from werkzeug.exceptions import HTTPException
from werkzeug.serving import make_server

from engine import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, Engine, Generation, StreamEvent, add_model_arguments,
    pool_arguments, positive_int,
)
from model_loader import DEFAULT_MODEL
from prefix_caching import KVCacheBlock, OutOfBlocksError, short_hash
from scheduler import check_step_size
from server_requests import (
    CHAT, COMPLETIONS, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_TOKENS_LIMIT, GENERATE, JSON_HEADER, LOCAL_HOSTS,
    APIError, GenerationRequest, Route, Settings, check_admin, check_content_type, check_host, error_json,
    parse_generation_request, parse_json_object, read_body, tenant_of,
)

log = logging.getLogger("server")

# -----------------------------------------------------------------------------
# 1. Running a request, and the OpenAI shapes of its reply
#
# No response is sent before the request's first token, so a bad request still gets a 4xx
# (and, without batching, one the pool has no room for a 503). A reply then either streams
# (server-sent events in OpenAI's chunk shapes) or runs to the end, watching between two
# tokens whether its client is still there. Either way, closing the engine's stream stops the
# request and frees its blocks: in the batching engine it cancels it in the engine loop.


def start(server: ServerState, req: GenerationRequest, request_id: str) -> tuple[Iterator[StreamEvent], StreamEvent]:
    """The engine's stream and its first event (after the prefill, and with batching after
    any wait in the queue). Counted for its tenant."""
    try:
        events = server.engine.stream(req.prompt, req.max_tokens, req.temperature, req.top_p, req.seed,
                                      req.cache_salt, request_id, stop=req.stop)
        first = next(events)
    except ValueError as err:  # the engine checks every argument at the call, before any work
        raise APIError(400, str(err))
    except OutOfBlocksError as err:
        # Only the one-request-at-a-time engine (--no-batching) refuses: the batching engine
        # queues the request until blocks free up, as vLLM does.
        raise APIError(503, f"the KV pool is full, try again when running requests finish: {err}")
    server.count(req.cache_salt, first.generation)
    return events, first


def client_hung_up(environ: dict) -> bool:
    """Whether the client closed its connection: its socket is readable and a peek finds the
    end of the stream (b""). werkzeug's server puts the socket in the WSGI environ; under
    another server (or Flask's test client) there is none, and we cannot tell."""
    sock = environ.get("werkzeug.socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except ConnectionError:  # reset by the peer
        return True


def run_to_end(events: Iterator[StreamEvent], event: StreamEvent, path: str, environ: dict) -> Generation | None:
    """The whole reply; None if the client hung up first (its request is stopped there)."""
    try:
        while event.finish_reason is None:
            if client_hung_up(environ):
                log.info("%s: the client hung up after %d tokens; stopped its request and freed its blocks",
                         path, len(event.generation.token_ids))
                return None
            event = next(events)
    except OutOfBlocksError as err:  # --no-batching: a decode step found no free block
        raise APIError(503, f"the KV pool filled up during the reply, try again later: {err}")
    finally:
        events.close()  # closing the engine's stream frees the request's blocks
    log_generation(path, event.generation)
    return event.generation


def log_generation(path: str, gen: Generation) -> None:
    """The one log line of a generation request."""
    log.info("%s: prompt %d tokens, cached %d, completion %d, TTFT %.0f ms, total %.0f ms", path,
             gen.prompt_tokens, gen.cached_tokens, len(gen.token_ids), gen.ttft_ms, gen.total_ms)


def usage(gen: Generation) -> dict:
    """OpenAI's usage, with the prefix cache where OpenAI reports it."""
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": len(gen.token_ids),
        "total_tokens": gen.prompt_tokens + len(gen.token_ids),
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def sse(data: dict | str) -> bytes:
    """One server-sent event: a line `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def stream_response(events: Iterator[StreamEvent], first: StreamEvent, request_id: str, route: Route,
                    model_name: str, include_usage: bool) -> Response:
    """Server-sent events in OpenAI's chunk shapes, ending with `data: [DONE]`, also after an
    error (as vLLM does), so a client waiting for [DONE] never hangs."""
    head = {"id": request_id, "object": "chat.completion.chunk" if route.chat else "text_completion",
            "created": int(time.time()), "model": model_name}

    def chunk(text: str | None, finish_reason: str | None = None, role: str | None = None) -> bytes:
        if route.chat:  # a chat stream sends the message as deltas; the first one names the role
            delta = ({"role": role} if role else {}) | ({} if text is None else {"content": text})
            entry = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            entry = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        data = {**head, "choices": [entry]}
        return sse((data | {"usage": None}) if include_usage else data)

    def body() -> Iterator[bytes]:  # runs after the request context is gone: no `request` here
        event = first
        try:
            if route.chat:
                yield chunk("", role="assistant")
            for event in itertools.chain([first], events):
                if event.text:
                    yield chunk(event.text)
            gen = event.generation
            yield chunk(None, gen.finish_reason)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(gen)})
            log_generation(route.path, gen)
        except OutOfBlocksError as err:  # --no-batching; the status is already sent: say it in the stream
            yield sse(error_json(503, f"the KV pool filled up during the reply: {err}"))
        except GeneratorExit:  # the client hung up: the server's next write failed and closed us
            log.info("%s: the client left after %d tokens; freeing its blocks", route.path,
                     len(event.generation.token_ids))
            raise
        except Exception as err:  # a bug: the traceback goes to the log, a 500 event to the client
            log.exception("%s: the stream failed", route.path)
            yield sse(error_json(500, f"internal error: {type(err).__name__}: {err}"))
        finally:
            events.close()  # closing the engine's stream frees the request's blocks
        yield sse("[DONE]")

    return Response(body(), mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})


# -----------------------------------------------------------------------------
# 2. What a caller may see
#
# A block's tenant is the cache_salt of the request that filled it (None: public). A caller
# sees the hash and the text of its own tenant's blocks only; any other block is opaque: its
# id, ref count and state, so the page can still draw the pool, and nothing of its content.
# Under --salt-by-api-key the counters are the caller's own (the pool-wide hit counters
# would move whenever another tenant repeats a prompt), and so are the block tables and the
# request ids in the waiting queue; how many requests run and wait is everyone's to see.
# Everything is read under engine.allocator_lock, held for microseconds around the allocator's
# and the scheduler's bookkeeping, never across a forward pass: /health answers while a long
# prefill runs.


@dataclass
class TenantCounters:
    """One tenant's share of the allocator's hit counters, counted by the server."""

    requests: int = 0
    queried_tokens: int = 0  # prompt tokens looked up in the cache
    hit_tokens: int = 0  # of those, found there

    def as_dict(self) -> dict:
        hit_rate = self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
        return {**self.__dict__, "hit_rate": round(hit_rate, 4)}


@dataclass
class ServerState:
    """The engine and what the server keeps beside it; one per app."""

    engine: Engine
    settings: Settings
    started: int = field(default_factory=lambda: int(time.time()))
    request_numbers: Iterator[int] = field(default_factory=itertools.count)
    tenants: dict[str, TenantCounters] = field(default_factory=dict)
    tenants_lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, tenant: str | None, gen: Generation) -> None:
        if not self.settings.salt_by_api_key:
            return  # no tenants to keep apart: /health shows the allocator's own counters
        with self.tenants_lock:
            counters = self.tenants.setdefault(tenant, TenantCounters())
            counters.requests += 1
            counters.queried_tokens += gen.prompt_tokens
            counters.hit_tokens += gen.cached_tokens

    def figures(self, tenant: str | None) -> dict:
        """What /health reports to `tenant`."""
        engine, alloc = self.engine, self.engine.allocator
        with engine.allocator_lock:
            pool = {
                "num_blocks": alloc.num_blocks,
                "block_size": alloc.block_size,
                "num_free_blocks": alloc.num_free_blocks,
                "num_cached_blocks": alloc.num_cached_blocks,
                "blocks_in_use": alloc.num_blocks_in_use,
                "running_requests": len(alloc.block_tables),
            }
            counters = alloc.stats.as_dict()
            loop = engine.snapshot()  # under the same hold: its running requests are these
        if loop is not None:
            last = loop.last_step
            pool |= {
                "waiting_requests": len(loop.waiting),
                "prefilling_requests": len(loop.prefilling),  # running, part-way through their prompt
                "preemptions": loop.num_preemptions,
                "steps": loop.num_steps,
                "last_step": None if last is None else {
                    "requests": last.num_requests, "tokens": last.num_tokens, "prefill_tokens": last.num_prefill_tokens,
                },
                **engine.scheduler_options,  # max_num_seqs, max_num_batched_tokens, enable_chunked_prefill
            }
        if self.settings.salt_by_api_key:
            with self.tenants_lock:
                counters = self.tenants.get(tenant, TenantCounters()).as_dict()
        counted = "this API key" if self.settings.salt_by_api_key else "all requests"
        return {"status": "ok", "model": self.settings.model_name, "batching": engine.batching, **pool,
                "counted": counted, **counters}

    def snapshot(self, tenant: str | None) -> dict:
        """What /cache reports to `tenant`: figures() plus every block, the free queue, the
        block tables and the waiting queue. Copied under the lock, decoded after it."""
        alloc, keyed = self.engine.allocator, self.settings.salt_by_api_key
        with self.engine.allocator_lock:
            blocks = [KVCacheBlock(b.block_id, b.ref_cnt, b.block_hash, list(b.token_ids), b.cache_salt)
                      for b in alloc.blocks]
            free_queue = alloc.free_queue.block_ids()  # head (evicted first) -> tail
            tables = {rid: list(table) for rid, table in alloc.block_tables.items()}
            snap = self.figures(tenant)
            loop = self.engine.snapshot()
        snap["blocks"] = [self.block_view(block, tenant) for block in blocks]
        snap["free_queue"] = free_queue
        # A request's blocks all carry its salt: the first one tells whose request it is.
        snap["block_tables"] = {rid: table for rid, table in tables.items()
                                if not keyed or blocks[table[0]].cache_salt == tenant}
        if loop is not None:  # head first; another tenant's request is a null: it waits, that is all
            snap["waiting_queue"] = [rid if not keyed or salt == tenant else None for rid, salt in loop.waiting]
            salts = dict(loop.running)
            snap["prefilling"] = {rid: {"computed_tokens": done, "prompt_tokens": total}
                                  for rid, (done, total) in loop.prefilling.items() if not keyed or salts[rid] == tenant}
        return snap

    def block_view(self, block: KVCacheBlock, tenant: str | None) -> dict:
        state = "in_use" if block.ref_cnt else "cached" if block.block_hash is not None else "empty"
        view = {"block_id": block.block_id, "ref_cnt": block.ref_cnt, "state": state}
        # Another tenant's block shows neither its text nor its hash: the hash of a block
        # everybody can guess (a chat's first block) would let its salt, the key, be tested offline.
        if block.token_ids and block.cache_salt != tenant:
            return view | {"opaque": True, "block_hash": None, "num_tokens": None, "text": None}
        return view | {"opaque": False, "block_hash": None if block.block_hash is None else short_hash(block.block_hash),
                       "num_tokens": len(block.token_ids), "text": self.engine.tokenizer.decode(block.token_ids)}

    def reset_prefix_cache(self) -> bool:
        with self.engine.allocator_lock:
            if not self.engine.allocator.reset_prefix_cache():
                return False
        with self.tenants_lock:
            self.tenants.clear()  # the allocator zeroed its counters: so do we
        return True


# -----------------------------------------------------------------------------
# 3. The routes, on a Blueprint: each reads the request, calls the helpers above, answers.

bp = Blueprint("server", __name__)


def served() -> ServerState:
    return current_app.extensions["server"]


@bp.before_app_request
def check_host_and_content_type():
    check_host(request.host, served().settings.allowed_hosts)
    if request.method == "POST" and request.routing_exception is None:  # an unknown route: 404 first
        check_content_type(request.mimetype)


def read_json_object() -> dict:
    return parse_json_object(read_body(request.stream, request.content_length, served().settings.max_body_bytes))


@bp.app_errorhandler(APIError)
def api_error(err: APIError):
    log.warning("%s %s -> %d: %s", request.method, request.path, err.status, err.message)
    return error_json(err.status, err.message), err.status


@bp.app_errorhandler(HTTPException)
def http_error(err: HTTPException):
    if err.code == 404:
        message = f"no route {request.path}; GET / shows the cache, GET /health the figures, POST /generate runs a prompt"
    elif err.code == 405:
        methods = [m for m in err.valid_methods if m not in ("HEAD", "OPTIONS")]  # Flask's automatic ones
        message = f"{request.path} does not take {request.method}; use {' or '.join(methods)}"
    else:
        message = err.description
    log.warning("%s %s -> %d: %s", request.method, request.path, err.code, message)
    response = current_app.json.response(error_json(err.code, message))
    response.status_code = err.code
    if err.code == 405:
        response.headers["Allow"] = ", ".join(err.valid_methods)
    return response


@bp.app_errorhandler(Exception)
def internal_error(err: Exception):
    log.exception("%s %s failed", request.method, request.path)  # the traceback stays here
    return error_json(500, f"internal error: {type(err).__name__}: {err}"), 500


@bp.get("/")
def index():
    return current_app.send_static_file("index.html")


@bp.get("/health")
def health():
    server = served()
    return server.figures(tenant_of(request.headers, server.settings.salt_by_api_key))


@bp.get("/cache")
def cache():
    server = served()
    return server.snapshot(tenant_of(request.headers, server.settings.salt_by_api_key))


@bp.post("/reset_prefix_cache")
def reset_prefix_cache():
    server, settings = served(), served().settings
    check_admin(request.headers, settings.admin_key, settings.salt_by_api_key)
    raw = read_body(request.stream, request.content_length, settings.max_body_bytes)
    if raw.strip() and parse_json_object(raw):
        raise APIError(400, "/reset_prefix_cache takes no fields: send {} or no body")
    if not server.reset_prefix_cache():
        alloc = server.engine.allocator
        raise APIError(409, f"{alloc.num_blocks_in_use} blocks are in use by {len(alloc.block_tables)} running "
                            f"requests; the cache can be reset only when no request runs")
    return server.figures(tenant_of(request.headers, settings.salt_by_api_key))


@bp.post("/generate")
def generate():
    server = served()
    req = parse_generation_request(read_json_object(), GENERATE, server.settings, request.headers)
    events, first = start(server, req, f"generate-{next(server.request_numbers)}")
    gen = run_to_end(events, first, request.path, request.environ)
    if gen is None:
        return "", 499  # nginx's "client closed request": nobody reads it
    return {
        "text": gen.text,
        "prompt_tokens": gen.prompt_tokens,
        "cached_tokens": gen.cached_tokens,
        "completion_tokens": len(gen.token_ids),
        "finish_reason": gen.finish_reason,
        "ttft_ms": round(gen.ttft_ms, 1),
        "total_ms": round(gen.total_ms, 1),
    }


def openai_completion(route: Route):
    server = served()
    req = parse_generation_request(read_json_object(), route, server.settings, request.headers)
    request_id = f"{'chatcmpl' if route.chat else 'cmpl'}-{next(server.request_numbers)}"
    events, first = start(server, req, request_id)
    model_name = server.settings.model_name
    if req.stream:
        return stream_response(events, first, request_id, route, model_name, req.include_usage)
    gen = run_to_end(events, first, request.path, request.environ)
    if gen is None:
        return "", 499
    if route.chat:
        entry = {"index": 0, "message": {"role": "assistant", "content": gen.text}}
    else:
        entry = {"index": 0, "text": gen.text}
    return {
        "id": request_id,
        "object": "chat.completion" if route.chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [entry | {"logprobs": None, "finish_reason": gen.finish_reason}],
        "usage": usage(gen),
    }


@bp.post("/v1/chat/completions")
def chat_completions():
    return openai_completion(CHAT)


@bp.post("/v1/completions")
def completions():
    return openai_completion(COMPLETIONS)


@bp.get("/v1/models")
def models():
    server = served()
    card = {"id": server.settings.model_name, "object": "model", "created": server.started, "owned_by": "prefix-caching"}
    return {"object": "list", "data": [card]}


# -----------------------------------------------------------------------------
# 4. The app


def create_app(
    engine: Engine,
    *,
    model_name: str | None = None,
    salt_by_api_key: bool = False,
    admin_key: str | None = None,
    allowed_hosts: tuple[str, ...] = (),
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Flask:
    """A Flask app serving `engine`. model_name defaults to the model's directory name.

    salt_by_api_key: the cache_salt of every request is derived from its bearer token, so
    clients with different keys never share cached blocks and cannot time each other's
    prompts; a client-supplied cache_salt is refused, /health and /cache need a key and show
    only that key's own counters, requests and block contents.
    admin_key: needed to reset the cache (and required for a reset under salt_by_api_key).
    allowed_hosts: names besides localhost by which clients reach the server (Host header).
    """
    if admin_key is not None and not admin_key.strip():
        raise ValueError("admin_key is empty: give a secret, or None for no admin")
    app = Flask(__name__)
    # None: werkzeug would cut a chunked body at the limit and serve the rest; read_body checks.
    app.config["MAX_CONTENT_LENGTH"] = None
    app.json.sort_keys = False  # keep the order the fields are written in
    app.json.compact = False  # indented: a reply read in a terminal after curl
    settings = Settings(
        model_name=model_name or Path(engine.model.name_or_path).name or "model",
        salt_by_api_key=salt_by_api_key,
        admin_key=admin_key,
        max_tokens_limit=max_tokens_limit,
        max_body_bytes=max_body_bytes,
        allowed_hosts={*LOCAL_HOSTS, *(host.lower() for host in allowed_hosts)},
    )
    app.extensions["server"] = ServerState(engine, settings)
    app.register_blueprint(bp)
    return app


# -----------------------------------------------------------------------------
# 5. Running it


class EscapeControlCharacters(logging.Filter):
    """Client text reaches the log (a path, a field): escape its control characters, or a
    path holding ESC [2J clears the operator's terminal, and a newline forges a log line.

    >>> record = logging.makeLogRecord({"msg": "GET %s", "args": ("/\\x1b[2J",)})
    >>> EscapeControlCharacters().filter(record), record.getMessage()
    (True, 'GET /\\\\x1b[2J')
    """

    TABLE = str.maketrans({c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]})

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = record.getMessage().translate(self.TABLE), ()
        if record.exc_info and not record.exc_text:  # a traceback keeps its newlines, nothing else
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text = "\n".join(line.translate(self.TABLE) for line in text.split("\n"))
        return True


log.addFilter(EscapeControlCharacters())  # on the logger: every record of it, whatever handler shows it


def serve_in_background(app: Flask, host: str = "127.0.0.1", port: int = 0):
    """Serve `app` from a daemon thread, for a lesson, test or benchmark that runs the server
    inside its own process; port 0 lets the OS pick a free one. Returns (base URL, server);
    server.shutdown() stops it."""
    app.extensions["server"].settings.allowed_hosts.add(host.lower())
    server = make_server(host, port, app, threaded=True)
    # A thread that touches torch while the interpreter shuts down aborts the process
    # ("terminate called without an active exception"): a tensor freed there gives up the
    # GIL and cannot take it back. So the process waits for running requests at exit, and
    # shutdown() waits for the serving thread, whose last act is to drop its reference to
    # the server, the app and so the engine, which may be the last one.
    server.daemon_threads = False
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    stop_serving = server.shutdown

    def shutdown() -> None:
        stop_serving()
        thread.join()

    server.shutdown = shutdown
    return f"http://{host}:{server.server_port}", server


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.logging import RichHandler

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 lets other machines (a class) connect")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="a name clients use to reach this server, besides localhost and IP addresses "
                             "(repeat it for several); any other Host header is refused")
    add_model_arguments(parser)  # --model, --device, --dtype, --block-size, --num-blocks
    batching = parser.add_argument_group("batching (the engine loop of batch_engine.py; vLLM's flags of the same names)")
    batching.add_argument("--max-num-seqs", type=positive_int, default=None,
                          help=f"requests running in one step at most (default: {DEFAULT_MAX_NUM_SEQS})")
    batching.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                          help=f"tokens one step computes at most, at least --max-num-seqs; a longer prompt is "
                               f"prefilled in chunks (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    batching.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                          help="split a prompt longer than the step's budget across steps (default: on); "
                               "--no-enable-chunked-prefill prefills it whole, in a step of its own")
    batching.add_argument("--no-batching", action="store_true",
                          help="one request's step at a time, as stage 7's engine runs it; a full pool answers 503")
    parser.add_argument("--salt-by-api-key", action="store_true", help="isolate each bearer token's cache")
    parser.add_argument("--admin-key", help="the bearer token POST /reset_prefix_cache needs "
                                            "(required for a reset under --salt-by-api-key)")
    parser.add_argument("--max-tokens-limit", type=positive_int, default=DEFAULT_MAX_TOKENS_LIMIT)
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:  # else 70000 is served on 70000 - 65536 = 4464
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.admin_key is not None and not args.admin_key.strip():
        parser.error("--admin-key is empty: give a secret")
    scheduler_options = {name: value for name, value in vars(args).items()
                         if name in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill")
                         and value is not None}
    if args.no_batching and scheduler_options:
        flag = "--" + next(iter(scheduler_options)).replace("_", "-")
        parser.error(f"{flag} is a setting of the batching engine: leave it out, or leave out --no-batching")
    try:  # before the model loads
        check_step_size(args.max_num_seqs or DEFAULT_MAX_NUM_SEQS, args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS)
    except ValueError as err:
        parser.error(str(err).replace("max_num_", "--max-num-").replace("batched_tokens", "batched-tokens"))

    handler = RichHandler(show_path=False)
    handler.addFilter(EscapeControlCharacters())  # werkzeug's records and any library's too
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[handler])
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # our own line per request instead
    console = Console(stderr=True)
    console.print(f"loading {args.model or DEFAULT_MODEL}…")  # the default's first load converts its GGUF file, and says so
    try:
        engine = Engine(args.model, device=args.device, dtype=args.dtype, **pool_arguments(args),
                        batching=not args.no_batching, **scheduler_options)
    except (OSError, ValueError) as err:
        parser.exit(2, f"error: {err}\n")
    engine.warm_up()
    app = create_app(engine, salt_by_api_key=args.salt_by_api_key, admin_key=args.admin_key,
                     allowed_hosts=(args.host, *args.allowed_host), max_tokens_limit=args.max_tokens_limit)
    try:
        server = make_server(args.host, args.port, app, threaded=True)
    except OSError as err:
        parser.exit(2, f"error: cannot listen on {args.host}:{args.port} ({err}); pick another --port\n")

    url = f"http://{args.host}:{server.server_port}"
    console.print(f"{engine.kv}")
    if engine.batching:
        options = engine.scheduler_options
        chunks = "a longer prompt in chunks" if options["enable_chunked_prefill"] else "a longer prompt alone"
        console.print(f"batching: up to {options['max_num_seqs']} requests and {options['max_num_batched_tokens']} "
                      f"tokens a step, {chunks}; a full pool makes requests wait")
    else:
        console.print("no batching: one request's step at a time; a full pool answers 503")
    console.print(f"[bold green]serving {app.extensions['server'].settings.model_name} on {url}[/]   (Ctrl+C stops)")
    console.print(f"  watch the cache:  open {url}/ in a browser")
    example = '{"messages": [{"role": "user", "content": "What is a cache?"}], "max_tokens": 32}'
    key = " -H 'Authorization: Bearer YOUR-KEY'" if args.salt_by_api_key else ""
    console.print(f"  try:  curl -s {url}/generate {JSON_HEADER}{key} -d '{example}'", soft_wrap=True, markup=False)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        console.print("stopped")


if __name__ == "__main__":
    main()
