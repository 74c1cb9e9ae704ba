"""
A tiny HTTP server around the Engine: what a class can curl, what an OpenAI client can use,
and a page that shows the KV block pool live while the requests come in.

    python server.py                        # the offline default model on http://127.0.0.1:5000
    python server.py --num-blocks 64        # a small pool: watch blocks get evicted, requests wait
    python server.py --no-batching          # one request at a time, as stage 7's engine runs it
    python server.py --salt-by-api-key --admin-key SECRET   # a cache per API key; only SECRET resets
    python server.py --salt-by-api-key --api-keys class.txt # ... and only the keys listed there

    curl -s localhost:5000/generate -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16}'

Routes:
    POST /generate               {"prompt": str} or {"messages": [...]}, max_tokens, temperature,
                                 top_p, seed, stop, cache_salt -> text, prompt_tokens, cached_tokens, ...
    GET  /health                 status, model, the cache figures (hit rate, blocks in use, ...)
                                 and the scheduler's (running, waiting, preemptions, the last step);
                                 where keys are in use, without one: {"status": "ok"} only
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
server is at fault, or busy: a 503 says when to try again). A class leaning on it meets limits
(queue length, prompt length, timeouts, connections), each a flag with a default for a laptop;
a client that hangs up costs nothing more, and Ctrl+C lets running requests finish.
docs/server.md lists the limits, says what a tenant can see, and where this server differs
from vLLM's.

server_requests.py reads and checks what a client sends (the body, who is asking, the
generation request); this file runs it: read it first. Here: running a request (1), what a
caller may see (2), the routes (3), create_app (4), serving it: connections, Ctrl+C, main (5).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import select
import socketserver
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from flask import Blueprint, Flask, Response, current_app, request
from werkzeug.exceptions import ClientDisconnected, HTTPException
from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

from engine import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_TARGET_STEP_MS, ClientGoneError, Engine,
    EngineStoppedError, Generation, QueueFullError, StreamEvent, add_model_arguments, pool_arguments, positive_float,
    positive_int,
)
from model_loader import DEFAULT_MODEL
from prefix_caching import KVCacheBlock, OutOfBlocksError, short_hash
from scheduler import check_step_size
from server_requests import (
    CHAT, COMPLETIONS, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_TOKENS_LIMIT, DEFAULT_MAX_WAITING, DEFAULT_READ_TIMEOUT, DEFAULT_REQUEST_TIMEOUT, GENERATE,
    JSON_HEADER, LOCAL_HOSTS, RETRY_AFTER_S, APIError, GenerationRequest, Route, Settings, bearer_key, check_admin,
    check_api_key, check_content_type, check_host, error_json, is_admin, parse_generation_request, parse_json_object,
    read_api_keys, read_body, tenant_of,
)

DEFAULT_SHUTDOWN_GRACE = 10.0  # seconds running requests get to finish after Ctrl+C

log = logging.getLogger("server")

# -----------------------------------------------------------------------------
# 1. Running a request, and the OpenAI shapes of its reply
#
# No response is sent before the request's first token, so a bad request still gets a 4xx
# (and, without batching, one the pool has no room for a 503). A reply then either streams
# (server-sent events in OpenAI's chunk shapes) or runs to the end, watching between two
# tokens whether its client is still there. Either way, closing the engine's stream stops the
# request and frees its blocks: in the batching engine it cancels it in the engine loop.


def start(server: ServerState, req: GenerationRequest, request_id: str,
          environ: dict) -> tuple[Iterator[StreamEvent], StreamEvent]:
    """The engine's stream and its first event (after the prefill, and with batching after
    any wait in the queue). Counted for its tenant. With batching the engine loop watches
    the client meanwhile: one that hangs up while its request waits or before a chunk of
    its prompt is computed is dropped there, its blocks freed."""
    engine, settings = server.engine, server.settings
    guards = {}
    if engine.batching:  # the engine loop's guards (batch_engine.py, EngineLoop)
        guards = {"gone": lambda: client_hung_up(environ), "max_waiting": settings.max_waiting,
                  "timeout": settings.request_timeout}
    try:
        prompt_ids = engine.tokenize(req.prompt)
        if len(prompt_ids) > settings.max_prompt_tokens:
            raise APIError(400, f"the prompt is {len(prompt_ids):,} tokens, over this server's limit of "
                                f"{settings.max_prompt_tokens:,} (--max-prompt-tokens); send a shorter one")
        events = engine.stream(prompt_ids, req.max_tokens, req.temperature, req.top_p, req.seed,
                               req.cache_salt, request_id, stop=req.stop, **guards)
        first = next(events)
    except ValueError as err:  # the engine checks every argument at the call, before any work
        raise APIError(400, str(err))
    except REFUSALS as err:
        raise refusal(err)
    server.count(req.cache_salt, first.generation)
    return events, first


# What the engine may raise instead of an event: the request is refused or cut, not broken.
REFUSALS = (OutOfBlocksError, QueueFullError, EngineStoppedError, TimeoutError, ClientGoneError)


def refusal(err: Exception, replying: bool = False) -> APIError:
    """A 503 with Retry-After for what a client may try again, 499 for a client that left.
    replying: the reply had begun."""
    if isinstance(err, ClientGoneError):
        return APIError(499, "the client hung up before its reply")  # nginx's "client closed request"
    if isinstance(err, OutOfBlocksError):
        # Only the one-request-at-a-time engine (--no-batching) refuses: the batching engine
        # queues the request until blocks free up, as vLLM does.
        message = (f"the KV pool filled up during the reply, try again later: {err}" if replying else
                   f"the KV pool is full, try again when running requests finish: {err}")
    elif isinstance(err, QueueFullError):
        message = f"the server is busy: {err} (--max-waiting-requests); try again in a moment"
    else:  # the request's deadline (--request-timeout), or an engine that stopped
        message = str(err)
    return APIError(503, message, retry_after=RETRY_AFTER_S)


def client_hung_up(environ: dict) -> bool:
    """Whether the client closed its connection: its socket is readable and reading it finds
    the end of the stream (b""). werkzeug's server answers every request with `Connection:
    close`, so bytes a client sends after its body cannot be a next request: they are read
    and thrown away here, and cannot hide a close behind them. werkzeug puts the socket in
    the WSGI environ; under another server (or Flask's test client) there is none, and we
    cannot tell."""
    sock = environ.get("werkzeug.socket")
    if sock is None:
        return False
    try:
        for _ in range(16):  # 64 KiB at most per look: a client that keeps sending is still there
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            if sock.recv(4096) == b"":
                return True
        return False
    except OSError:  # reset by the peer, or the socket already closed
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
    except REFUSALS as err:  # --no-batching: a decode step found no free block; or its deadline
        raise refusal(err, replying=True)
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
        except REFUSALS as err:  # the status is already sent: say it in the stream
            refused = refusal(err, replying=True)
            yield sse(error_json(refused.status, refused.message))
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
# reads the hash and text of its own tenant's blocks only (without keys, every caller is the
# public tenant); any other block is opaque. Under --salt-by-api-key a tenant sees its own and
# no more: another tenant's block is its id alone, without the ref count or state that would
# tell when someone's prompt hit it (nor its place in the free queue, which tells the same);
# the counters, block tables and queued request ids are its own; the last step's token counts
# (a prompt's length, whether it hit) are left out. How many requests run and wait, and how
# many blocks are in use, are everyone's. The admin key sees everything.
# Everything is read under engine.allocator_lock, held for microseconds around the allocator's
# and the scheduler's bookkeeping, never across a forward pass: /health answers while a long
# prefill runs. /cache is the biggest answer (every block, decoded): it is rendered at most
# once per PAGE_EVERY_S for each viewer, however many poll it.

PAGE_EVERY_S = 0.25


@dataclass(frozen=True)
class Viewer:
    """Who is looking at /health or /cache."""

    tenant: str | None  # whose blocks it may read: its requests' cache_salt (None: the public cache)
    admin: bool = False  # the admin key: every block and figure
    keyed: bool = False  # a tenant of --salt-by-api-key: its own requests and figures only


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
    tenants: dict[str, TenantCounters] = field(default_factory=dict)
    tenants_lock: threading.Lock = field(default_factory=threading.Lock)
    pages: dict[Viewer, bytes] = field(default_factory=dict)  # /cache bodies rendered since pages_time
    pages_time: float = 0.0
    page_every_s: float = PAGE_EVERY_S
    pages_lock: threading.Lock = field(default_factory=threading.Lock)
    texts: dict[bytes, str] = field(default_factory=dict)  # a cached block's decoded text, by its hash

    def viewer(self, headers) -> Viewer:
        settings = self.settings
        if not settings.salt_by_api_key:
            return Viewer(None)
        if is_admin(headers, settings.admin_key):
            return Viewer(tenant_of(headers, True), admin=True)
        return Viewer(tenant_of(headers, True), keyed=True)

    def count(self, tenant: str | None, gen: Generation) -> None:
        if not self.settings.salt_by_api_key:
            return  # no tenants to keep apart: /health shows the allocator's own counters
        with self.tenants_lock:
            counters = self.tenants.setdefault(tenant, TenantCounters())
            counters.requests += 1
            counters.queried_tokens += gen.prompt_tokens
            counters.hit_tokens += gen.cached_tokens

    def failure(self) -> str | None:
        """Why the engine takes no requests any more (its loop failed for good), or None."""
        loop = self.engine.snapshot()
        return None if loop is None else loop.failure

    def figures(self, viewer: Viewer) -> dict:
        """What /health reports to `viewer`."""
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
                "restarts": loop.num_restarts,  # failures outside a step the engine loop recovered from
                **engine.scheduler_options,  # max_num_seqs, max_num_batched_tokens, enable_chunked_prefill
                "target_step_ms": engine.target_step_ms,  # None: max_num_batched_tokens every step
            }
            if loop.step_budget is not None:  # what a step costs on this machine, learned (step_budget.py)
                pool["step_costs"] = loop.step_budget["learned"]
            if not viewer.keyed:  # its token counts tell a prompt's length and whether it hit
                pool["last_step"] = None if last is None else {
                    "requests": last.num_requests, "tokens": last.num_tokens, "prefill_tokens": last.num_prefill_tokens,
                    "budget": None if loop.step_budget is None else loop.step_budget["last_budget"],
                }
        if viewer.keyed:
            with self.tenants_lock:
                counters = self.tenants.get(viewer.tenant, TenantCounters()).as_dict()
        counted = "this API key" if viewer.keyed else "all requests"
        return {"status": "ok", "model": self.settings.model_name, "batching": engine.batching, **pool,
                "counted": counted, **counters}

    def cache_page(self, viewer: Viewer) -> bytes:
        """/cache's body for `viewer` as compact JSON, rendered again only when the last
        rendering is page_every_s old: a class polling it costs a few renderings a second."""
        with self.pages_lock:  # one rendering at a time: pollers wait for it, not start their own
            now = time.monotonic()
            if now - self.pages_time >= self.page_every_s:
                self.pages, self.pages_time = {}, now
            page = self.pages.get(viewer)
            if page is None:
                page = self.pages[viewer] = json.dumps(self.snapshot(viewer), separators=(",", ":")).encode()
            return page

    def snapshot(self, viewer: Viewer) -> dict:
        """What /cache reports to `viewer`: figures() plus every block, the free queue, the
        block tables and the waiting queue. Copied under the lock, decoded after it."""
        alloc = self.engine.allocator
        with self.engine.allocator_lock:
            blocks = [KVCacheBlock(b.block_id, b.ref_cnt, b.block_hash, list(b.token_ids), b.cache_salt)
                      for b in alloc.blocks]
            free_queue = alloc.free_queue.block_ids()  # head (evicted first) -> tail
            tables = {rid: list(table) for rid, table in alloc.block_tables.items()}
            snap = self.figures(viewer)
            loop = self.engine.snapshot()
        if len(self.texts) > 2 * len(blocks):
            self.texts.clear()  # the hashes of blocks long evicted
        shown = [self.sees(viewer, block) for block in blocks]
        snap["blocks"] = [self.block_view(block, viewer, shown[block.block_id]) for block in blocks]
        snap["free_queue"] = [b for b in free_queue if shown[b] or not viewer.keyed]  # its order tells of hits
        # A request's blocks all carry its salt: the first one tells whose request it is.
        snap["block_tables"] = {rid: table for rid, table in tables.items()
                                if not viewer.keyed or table and blocks[table[0]].cache_salt == viewer.tenant}
        if loop is not None:  # head first; another tenant's request is a null: it waits, that is all
            salts = dict(loop.running)
            snap["waiting_queue"] = [rid if not viewer.keyed or salt == viewer.tenant else None
                                     for rid, salt in loop.waiting]
            snap["prefilling"] = {rid: {"computed_tokens": done, "prompt_tokens": total}
                                  for rid, (done, total) in loop.prefilling.items()
                                  if not viewer.keyed or salts[rid] == viewer.tenant}
        return snap

    @staticmethod
    def sees(viewer: Viewer, block: KVCacheBlock) -> bool:
        """Whether `viewer` may read the block: its tenant is the cache_salt it was filled
        with; a block never filled belongs to nobody while free, to someone while held."""
        if viewer.admin:
            return True
        if not block.token_ids:
            return block.ref_cnt == 0 or not viewer.keyed
        return block.cache_salt == viewer.tenant

    def block_view(self, block: KVCacheBlock, viewer: Viewer, shown: bool) -> dict:
        state = "in_use" if block.ref_cnt else "cached" if block.block_hash is not None else "empty"
        view = {"block_id": block.block_id, "ref_cnt": block.ref_cnt, "state": state, "opaque": not shown}
        if not shown:
            # Its hash and text stay hidden: the hash of a block everybody can guess (a chat's
            # first block) would let its salt, the key, be tested offline. Under keys its ref
            # count and state too: they tell when another tenant's prompt hits it.
            hidden = {"block_hash": None, "num_tokens": None, "text": None}
            return ({"block_id": block.block_id, "opaque": True} | hidden) if viewer.keyed else view | hidden
        if block.block_hash is None:  # filling up: decoded each time
            text = self.engine.tokenizer.decode(block.token_ids)
        else:  # full and cached: its text never changes while its hash stays
            text = self.texts.get(block.block_hash)
            if text is None:
                text = self.texts[block.block_hash] = self.engine.tokenizer.decode(block.token_ids)
        return view | {"block_hash": None if block.block_hash is None else short_hash(block.block_hash),
                       "num_tokens": len(block.token_ids), "text": text}

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
def check_request_head():
    """The Host header; with --api-keys a listed key everywhere but the page itself and a
    keyless /health (a liveness probe); a JSON body for a POST."""
    settings = served().settings
    check_host(request.host, settings.allowed_hosts)
    probe = request.path == "/health" and bearer_key(request.headers) is None
    if not (request.path == "/" or probe):
        check_api_key(request.headers, settings.api_keys, settings.admin_key)
    if request.method == "POST" and request.routing_exception is None:  # an unknown route: 404 first
        check_content_type(request.mimetype)


def read_raw_body() -> bytes:
    try:
        return read_body(request.stream, request.content_length, served().settings.max_body_bytes)
    except ClientDisconnected:  # werkzeug's word for a body cut short: the read timed out, or the client left
        raise APIError(408, "the body stopped arriving before its Content-Length; send it whole") from None


def read_json_object() -> dict:
    return parse_json_object(read_raw_body())


@bp.app_errorhandler(APIError)
def api_error(err: APIError):
    log.warning("%s %s -> %d: %s", request.method, request.path, err.status, err.message)
    headers = {} if err.retry_after is None else {"Retry-After": str(err.retry_after)}
    return error_json(err.status, err.message), err.status, headers


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
    """The figures; without a key, where keys are in use, whether the server is alive only
    (a probe's question, as vLLM's /health answers it). 503 once the engine cannot serve."""
    server, settings = served(), served().settings
    failure = server.failure()
    if failure is not None:
        return {"status": "error", "message": f"the engine loop failed and could not be restarted: {failure}"}, 503
    if (settings.salt_by_api_key or settings.api_keys) and bearer_key(request.headers) is None:
        return {"status": "ok"}
    return server.figures(server.viewer(request.headers))


@bp.get("/cache")
def cache():
    server = served()
    return Response(server.cache_page(server.viewer(request.headers)), mimetype="application/json")


@bp.post("/reset_prefix_cache")
def reset_prefix_cache():
    server, settings = served(), served().settings
    check_admin(request.headers, settings.admin_key, settings.salt_by_api_key)
    raw = read_raw_body()
    if raw.strip() and parse_json_object(raw):
        raise APIError(400, "/reset_prefix_cache takes no fields: send {} or no body")
    if not server.reset_prefix_cache():
        alloc = server.engine.allocator
        raise APIError(409, f"{alloc.num_blocks_in_use} blocks are in use by {len(alloc.block_tables)} running "
                            f"requests; the cache can be reset only when no request runs")
    return server.figures(server.viewer(request.headers))


def new_request_id(prefix: str) -> str:
    """Random, as vLLM's (ChatCompletionResponse.id, f"chatcmpl-{random_uuid()}", in
    vllm/entrypoints/openai/protocol.py): a counter would tell every client how many
    requests the others sent."""
    return f"{prefix}-{uuid.uuid4().hex}"


@bp.post("/generate")
def generate():
    server = served()
    req = parse_generation_request(read_json_object(), GENERATE, server.settings, request.headers)
    events, first = start(server, req, new_request_id("generate"), request.environ)
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
    request_id = new_request_id("chatcmpl" if route.chat else "cmpl")
    events, first = start(server, req, request_id, request.environ)
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
    api_keys: frozenset[str] | None = None,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    max_waiting: int = DEFAULT_MAX_WAITING,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    cache_page_every_s: float = PAGE_EVERY_S,
) -> Flask:
    """A Flask app serving `engine`. model_name defaults to the model's directory name.

    salt_by_api_key: the cache_salt of every request is derived from its bearer token, so
    clients with different keys never share cached blocks and cannot time each other's
    prompts; a client-supplied cache_salt is refused, /health and /cache need a key and show
    only that key's own counters, requests and block contents.
    admin_key: needed to reset the cache (and required for a reset under salt_by_api_key);
    under salt_by_api_key, its holder sees every tenant's figures and blocks.
    allowed_hosts: names besides localhost by which clients reach the server (Host header).
    api_keys: the keys a class may use: any other gets a 401 on every route but the page
    and a keyless /health. None: any key, or none.
    max_prompt_tokens, max_waiting (requests queued before a 503), request_timeout (seconds
    a generation request may take): the limits of docs/server.md; the last two need batching.
    cache_page_every_s: how old /cache's rendering may be before it is rendered again (0: at
    every call, for a test that reads the pool right after changing it).
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
        api_keys=api_keys,
        max_prompt_tokens=max_prompt_tokens,
        max_waiting=max_waiting,
        request_timeout=request_timeout,
    )
    app.extensions["server"] = ServerState(engine, settings, page_every_s=cache_page_every_s)
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


class RequestHandler(WSGIRequestHandler):
    """werkzeug's handler with timeouts: a new connection has idle_timeout seconds to start its
    request, then read_timeout seconds for every later read or write on it (the rest of the
    request; the reply, which a client that stops reading would hold up). werkzeug closes the
    connection after each reply, so no connection idles between requests."""

    idle_timeout = DEFAULT_IDLE_TIMEOUT
    read_timeout = DEFAULT_READ_TIMEOUT

    def handle_one_request(self) -> None:
        self.connection.settimeout(self.idle_timeout)
        super().handle_one_request()

    def parse_request(self) -> bool:  # called once the request line has come
        self.connection.settimeout(self.read_timeout)
        return super().parse_request()


class ClassServer(ThreadedWSGIServer):
    """werkzeug's threaded server (a thread per connection, one process: one engine, one pool)
    with a cap on open connections: one over the cap gets a 503 from the accepting thread at
    once, and no thread."""

    def __init__(self, host: str, port: int, app: Flask, *, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 read_timeout: float = DEFAULT_READ_TIMEOUT, idle_timeout: float = DEFAULT_IDLE_TIMEOUT):
        handler = type("Handler", (RequestHandler,), {"read_timeout": read_timeout, "idle_timeout": idle_timeout})
        super().__init__(host, port, app, handler=handler)
        self.max_connections = max_connections
        self.connection_slots = threading.BoundedSemaphore(max_connections)
        # A thread that touches torch while the interpreter shuts down aborts the process
        # ("terminate called without an active exception"): a tensor freed there gives up the
        # GIL and cannot take it back. So the server's threads are waited for, not killed.
        self.daemon_threads = False

    def log(self, type: str, message: str, *args) -> None:
        # After a read timeout (the client has its 408), werkzeug still reads what is left of
        # the body, on a socket object that refuses every read once one timed out: not news.
        if "cannot read from timed out object" not in message:
            super().log(type, message, *args)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """socketserver's loop, without werkzeug's ending (which swallows Ctrl+C and then waits
        for every connection to end): drain() decides how the connections end."""
        socketserver.BaseServer.serve_forever(self, poll_interval)

    def stop_accepting(self) -> None:
        """End serve_forever, running in another thread; returns at once if it has ended."""
        socketserver.BaseServer.shutdown(self)

    def process_request(self, request, client_address) -> None:
        if not self.connection_slots.acquire(blocking=False):
            self.refuse(request)
            return
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self.connection_slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connection_slots.release()

    def refuse(self, sock) -> None:
        body = json.dumps(error_json(503, f"this server has {self.max_connections} connections open, its most "
                                          f"(--max-connections); try again in a moment")).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER_S}\r\nConnection: close\r\n\r\n")
        try:
            sock.setblocking(False)
            sock.sendall(head.encode() + body)  # a few hundred bytes: the socket's buffer takes them at once
            with contextlib.suppress(OSError):
                sock.recv(1 << 16)  # what the client sent: closing on unread bytes would reset the connection
        except OSError:
            pass
        finally:
            self.shutdown_request(sock)
        log.warning("refused a connection: %d are open (--max-connections)", self.max_connections)


def serve_in_background(app: Flask, host: str = "127.0.0.1", port: int = 0, **limits):
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
        server.server_close()  # waits for the connections' threads

    server.shutdown = shutdown
    return f"http://{host}:{server.server_port}", server


def drain(server: ClassServer, engine: Engine, grace: float) -> None:
    """After Ctrl+C: take no new connection; requests that wait get a 503, running ones
    `grace` seconds to finish and then a last event (finish reason "abort"; a stream then
    its [DONE]); then wait for every connection's thread to end."""
    server.stop_accepting()
    server.socket.close()  # a client that connects now is refused by the OS
    engine.drain(grace)
    if not engine.batching:  # stage 7's engine: each request runs in its client's thread
        deadline = time.monotonic() + grace
        while engine.allocator.block_tables and time.monotonic() < deadline:
            time.sleep(0.05)
    server.server_close()  # joins the connections' threads


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
    budget = batching.add_mutually_exclusive_group()
    budget.add_argument("--target-step-ms", type=positive_float, default=None,
                        help=f"each step computes as many tokens as fit in this many milliseconds, learned from the "
                             f"steps run, up to {DEFAULT_MAX_NUM_BATCHED_TOKENS}: a long prompt is prefilled in chunks "
                             f"that keep every stream moving (default: {DEFAULT_TARGET_STEP_MS:g}; step_budget.py)")
    budget.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                        help="tokens every step computes at most, at least --max-num-seqs, instead of a target step "
                             "time (vLLM's flag: the same budget on every machine); a longer prompt is prefilled in "
                             "chunks")
    batching.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                          help="split a prompt longer than the step's budget across steps (default: on); "
                               "--no-enable-chunked-prefill prefills it whole, in a step of its own")
    batching.add_argument("--no-batching", action="store_true",
                          help="one request's step at a time, as stage 7's engine runs it; a full pool answers 503")
    parser.add_argument("--salt-by-api-key", action="store_true", help="isolate each bearer token's cache")
    parser.add_argument("--admin-key", help="the bearer token POST /reset_prefix_cache needs "
                                            "(required for a reset under --salt-by-api-key)")
    parser.add_argument("--api-keys", metavar="FILE",
                        help="the keys a class may use, one per line: any other key gets a 401 "
                             "(default: any bearer key is taken, or none)")
    limits = parser.add_argument_group("limits (docs/server.md)")
    limits.add_argument("--max-tokens-limit", type=positive_int, default=DEFAULT_MAX_TOKENS_LIMIT,
                        help=f"the largest max_tokens a request may ask for (default: {DEFAULT_MAX_TOKENS_LIMIT})")
    limits.add_argument("--max-prompt-tokens", type=positive_int, default=DEFAULT_MAX_PROMPT_TOKENS,
                        help=f"the longest prompt a request may send (default: {DEFAULT_MAX_PROMPT_TOKENS})")
    limits.add_argument("--max-waiting-requests", type=positive_int, default=DEFAULT_MAX_WAITING,
                        help=f"requests queued behind the running ones; beyond it a 503 with Retry-After "
                             f"(default: {DEFAULT_MAX_WAITING})")
    limits.add_argument("--request-timeout", type=positive_float, default=DEFAULT_REQUEST_TIMEOUT,
                        help=f"seconds a generation request may take, waiting included (default: {DEFAULT_REQUEST_TIMEOUT:g})")
    limits.add_argument("--read-timeout", type=positive_float, default=DEFAULT_READ_TIMEOUT,
                        help=f"seconds a connection may stay silent while it sends a request, or while it "
                             f"does not read its reply (default: {DEFAULT_READ_TIMEOUT:g})")
    limits.add_argument("--idle-timeout", type=positive_float, default=DEFAULT_IDLE_TIMEOUT,
                        help=f"seconds a new connection has to start its request (default: {DEFAULT_IDLE_TIMEOUT:g})")
    limits.add_argument("--max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS,
                        help=f"open connections, a thread each; beyond it a 503 (default: {DEFAULT_MAX_CONNECTIONS})")
    limits.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE,
                        help=f"seconds running requests get to finish after Ctrl+C (default: {DEFAULT_SHUTDOWN_GRACE:g})")
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:  # else 70000 is served on 70000 - 65536 = 4464
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.admin_key is not None and not args.admin_key.strip():
        parser.error("--admin-key is empty: give a secret")
    if args.shutdown_grace < 0:
        parser.error(f"--shutdown-grace must be 0 or more seconds, got {args.shutdown_grace:g}")
    try:
        api_keys = None if args.api_keys is None else read_api_keys(args.api_keys)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        parser.error(f"--api-keys: {err}")
    scheduler_options = {name: value for name, value in vars(args).items()
                         if name in ("max_num_seqs", "max_num_batched_tokens", "target_step_ms", "enable_chunked_prefill")
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
                     allowed_hosts=(args.host, *args.allowed_host), max_tokens_limit=args.max_tokens_limit,
                     api_keys=api_keys, max_prompt_tokens=args.max_prompt_tokens, max_waiting=args.max_waiting_requests,
                     request_timeout=args.request_timeout)
    try:
        server = ClassServer(args.host, args.port, app, max_connections=args.max_connections,
                             read_timeout=args.read_timeout, idle_timeout=args.idle_timeout)
    except OSError as err:
        parser.exit(2, f"error: cannot listen on {args.host}:{args.port} ({err}); pick another --port\n")

    url = f"http://{args.host}:{server.server_port}"
    console.print(f"{engine.kv}")
    if engine.batching:
        options = engine.scheduler_options
        chunks = "a longer prompt in chunks" if options["enable_chunked_prefill"] else "a longer prompt alone"
        budget = (f"as many tokens as fit in {engine.target_step_ms:g} ms (at most {options['max_num_batched_tokens']})"
                  if engine.target_step_ms else f"{options['max_num_batched_tokens']} tokens")
        console.print(f"batching: up to {options['max_num_seqs']} requests and {budget} a step, {chunks}; "
                      f"a full pool makes requests wait")
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
        console.print(f"stopping: waiting requests get a 503, running ones up to {args.shutdown_grace:g} s to finish…")
        drain(server, engine, args.shutdown_grace)
        console.print("stopped")


if __name__ == "__main__":
    main()
