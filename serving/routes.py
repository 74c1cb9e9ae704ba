"""
The routes of server.py, and what runs a generation request: the app that create_app builds.

    app = create_app(Engine(), salt_by_api_key=True, admin_key="SECRET")
    url, server = serve_in_background(app)      # serving/connections.py; python server.py serves it too

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
    GET  /server_info            the served model's name, and /model_info its type, as SGLang's
    GET  /model_info             server names them: what SGLang's router asks a worker for
                                 when it registers it
    GET  /                       the live view of the pool (serving/static/index.html), polling /cache

Every error is a JSON object {"error": {"message", "type"}} with a 4xx status (5xx when the
server is at fault, or busy: a 503 says when to try again, as a 429 does for an API key
with its share of requests open). Before any work a request's size is checked against what
--max-prompt-tokens could ever accept (serving/requests.py), and who asks is counted by the
connection's caps (serving.connections.Admission).

Read serving/requests.py (what a client sends), serving/views.py (what it may see) and
serving/connections.py (its connection) first. Here: running a request (1), the routes (2),
create_app (3), the log's guard against client text (4).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Iterator

from flask import Blueprint, Flask, Response, current_app, g, request
from werkzeug.exceptions import ClientDisconnected, HTTPException

from engine.llm_engine import (
    ClientGoneError, Engine, EngineStoppedError, Generation, QueueFullError, StreamEvent,
)
from engine.request import SamplingParams
from serving.connections import AFTER_BODY_LIMIT, HangUpCheck, connection_of
from serving.requests import (
    CHAT, COMPLETIONS, DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_TOKENS_LIMIT, DEFAULT_MAX_WAITING,
    DEFAULT_REQUEST_TIMEOUT, GENERATE, LOCAL_HOSTS, RETRY_AFTER_S, APIError, Asker, GenerationRequest, PromptBounds,
    Route, Settings, bearer_key, check_admin, check_api_key, check_content_type, check_host, error_json, is_listed,
    load_json_object, max_token_bytes, parse_generation_request, parse_json_object, read_body,
)
from serving.views import PAGE_EVERY_S, ServerState

log = logging.getLogger("server")

# -----------------------------------------------------------------------------
# 1. Running a request, and the OpenAI shapes of its reply
#
# No response is sent before the request's first token, so a bad request still gets a 4xx.
# A reply then either streams (server-sent events in OpenAI's chunk shapes) or runs to the
# end, watching between two tokens whether its client is still there. Either way, closing the
# engine's stream stops the request and frees its blocks: it is cancelled in the engine loop.


def start(server: ServerState, req: GenerationRequest, request_id: str, gone: HangUpCheck,
          tenant: str | None = None) -> tuple[Iterator[StreamEvent], StreamEvent]:
    """The engine's stream and its first event (after any wait in the queue and the prefill).
    Counted for its cache_salt's tenant (/health); `tenant` is who asks, as a budget policy
    shares steps by it (Asker.tenant). The engine loop watches the client meanwhile (`gone`,
    which never raises): one that hangs up while its request waits or before a chunk of its
    prompt is computed is dropped there, its blocks freed."""
    engine, settings = server.engine, server.settings
    # the engine loop's guards (engine/engine_loop.py, EngineLoop)
    guards = {"tenant": tenant, "gone": gone, "max_waiting": settings.max_waiting, "timeout": settings.request_timeout}
    try:
        params = SamplingParams(req.max_tokens, req.temperature, req.top_p, req.seed, req.stop)
        prompt_ids = engine.tokenize(req.prompt)
        if len(prompt_ids) > settings.max_prompt_tokens:
            engine.charge(tenant, len(prompt_ids))  # tokenizing it was work done for its sender
            raise APIError(400, f"the prompt is {len(prompt_ids):,} tokens, over this server's limit of "
                                f"{settings.max_prompt_tokens:,} (--max-prompt-tokens); send a shorter one")
        events = engine.stream(prompt_ids, params, cache_salt=req.cache_salt, request_id=request_id, **guards)
        first = next(events)
    except ValueError as err:  # the engine checks every argument at the call, before any work
        raise APIError(400, str(err))
    except REFUSALS as err:
        raise refusal(err)
    server.count(req.cache_salt, len(prompt_ids), first.cached_tokens)
    return events, first


# What the engine may raise instead of an event: the request is refused or cut, not broken.
REFUSALS = (QueueFullError, EngineStoppedError, TimeoutError, ClientGoneError)


# The one answer to a client whose end of the connection closed before its reply. A client
# that shut down only its sending side (a half-close: shutdown(SHUT_WR), as `nc -N` does)
# looks the same as one that left: it still reads this; one that left reads nothing.
HUNG_UP = (f"the connection's end of stream came before the reply (the client closed it, or shut down its "
           f"sending side: a half-close, as `nc -N` does), or more than {AFTER_BODY_LIMIT:,} bytes came after the "
           f"body; this server takes either as a hang-up and stopped the request: keep the connection open, and "
           f"send nothing more, until the reply has come")


def refusal(err: Exception) -> APIError:
    """A 503 with Retry-After for what a client may try again, a 400 for a client that hung
    up (HUNG_UP)."""
    if isinstance(err, ClientGoneError):
        return APIError(400, HUNG_UP)
    if isinstance(err, QueueFullError):
        message = f"the server is busy: {err} (--max-waiting-requests); try again in a moment"
    else:  # the request's deadline (--request-timeout), or an engine that stopped
        message = str(err)
    return APIError(503, message, retry_after=RETRY_AFTER_S)


def run_to_end(events: Iterator[StreamEvent], event: StreamEvent, path: str, gone: HangUpCheck) -> Generation:
    """The whole reply; a 400 (HUNG_UP) if the client hung up first (its request is stopped there)."""
    try:
        while event.finish_reason is None:
            if gone():
                log.info("%s: the client hung up after %d tokens; stopped its request and freed its blocks",
                         path, event.num_tokens)
                raise APIError(400, HUNG_UP)
            event = next(events)
    except REFUSALS as err:  # its deadline, or an engine that stopped
        raise refusal(err)
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
    error (as vLLM does), so a client waiting for [DONE] never hangs. The key's share of
    requests is freed before [DONE] goes out (Connection.reply_generated)."""
    connection = connection_of(request.environ)
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
            refused = refusal(err)
            yield sse(error_json(refused.status, refused.message))
        except GeneratorExit:  # the client hung up: the server's next write failed and closed us
            log.info("%s: the client left after %d tokens; freeing its blocks", route.path, event.num_tokens)
            raise
        except Exception as err:  # a bug: the traceback goes to the log, a 500 event to the client
            log.exception("%s: the stream failed", route.path)
            yield sse(error_json(500, f"internal error: {type(err).__name__}: {err}"))
        finally:
            events.close()  # closing the engine's stream frees the request's blocks
            if connection is not None:
                connection.reply_generated()
        yield sse("[DONE]")

    return Response(body(), mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})



# -----------------------------------------------------------------------------
# 2. The routes, on a Blueprint: each reads the request, calls the helpers above, answers.

bp = Blueprint("server", __name__)


def served() -> ServerState:
    return current_app.extensions["server"]


@bp.before_app_request
def check_request_head():
    """The Host header; with --api-keys a listed key everywhere but the page itself, a
    keyless /health (a liveness probe) and the model's name and type (what a router reads to
    register a replica); then who asks, counted by the connection's caps (a key over its
    share: a 429, before the body is read); a JSON body for a POST."""
    settings = served().settings
    check_host(request.host, settings.allowed_hosts)
    probe = request.path == "/health" and bearer_key(request.headers) is None
    if not (request.path in ("/", *ROUTER_PROBES) or probe):
        check_api_key(request.headers, settings.api_keys, settings.admin_key)
    g.asker = asker(settings)
    connection = connection_of(request.environ)
    if connection is not None:
        connection.admit(g.asker)
    if request.method == "POST" and request.routing_exception is None:  # an unknown route: 404 first
        check_content_type(request.mimetype)


@bp.after_app_request
def free_the_keys_share(response: Response) -> Response:
    """A reply that is not streamed is whole once made: its key's share of requests is free
    before the client reads it (a stream frees it before its [DONE]: stream_response)."""
    connection = connection_of(request.environ)
    if connection is not None and not response.is_streamed:
        connection.reply_generated()
    return response


ROUTER_PROBES = ("/server_info", "/model_info")  # SGLang's router asks them with no key of the class
PAGE_POLLS = ("/", "/health", "/cache")  # what the live page asks for, with its static files
GENERATION_PATHS = (GENERATE.path, COMPLETIONS.path, CHAT.path)


def asker(settings: Settings) -> Asker:
    """Who the request's head says is asking. Its key counts only where keys are in use, and
    stands for one person only where the teacher listed it (Admission says why)."""
    key = bearer_key(request.headers)
    keyed = key is not None and (settings.api_keys is not None or settings.salt_by_api_key)
    return Asker(
        address=request.remote_addr,
        key=hashlib.sha256(key.encode()).hexdigest() if keyed else None,  # as tenant_of: never the key itself
        listed=keyed and settings.api_keys is not None and is_listed(key, settings.api_keys, settings.admin_key),
        page=request.method in ("GET", "HEAD") and (request.path in PAGE_POLLS or
                                                    request.path.startswith(current_app.static_url_path + "/")),
        generation=request.method == "POST" and request.path in GENERATION_PATHS,
    )


def read_raw_body() -> bytes:
    connection = connection_of(request.environ)
    late = APIError(408, "the body stopped arriving before its Content-Length (or its last chunk), or did not "
                         "arrive within --read-timeout; send it whole, at once")
    try:
        raw = read_body(request.stream, request.content_length, served().settings.bounds.max_body_bytes)
    except ClientDisconnected:  # werkzeug's word for a body cut short: its deadline came, or the client left
        raise late from None
    except APIError as err:
        # A chunked body cut at its deadline ends in the middle of a chunk: late, not malformed.
        if err.status == 400 and connection is not None and connection.cut_off:
            raise late from None
        raise
    if connection is not None:
        connection.body_read()  # in: its read deadline no longer applies
    return raw


def hang_up_check() -> HangUpCheck:
    connection = connection_of(request.environ)
    return HangUpCheck(None if connection is None else connection.sock)


def read_json_object() -> dict:
    """A generation request's body; parse_generation_request checks its strings, after its size."""
    return load_json_object(read_raw_body())


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
        return {"status": "error", "message": f"the engine loop failed; restart the server: {failure}"}, 503
    if (settings.salt_by_api_key or settings.api_keys) and bearer_key(request.headers) is None:
        return {"status": "ok"}
    return server.figures(server.viewer(request.headers, g.asker.tenant))


@bp.get("/cache")
def cache():
    server = served()
    return Response(server.cache_page(server.viewer(request.headers, g.asker.tenant)), mimetype="application/json")


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
    return server.figures(server.viewer(request.headers, g.asker.tenant))


def new_request_id(prefix: str) -> str:
    """Random, as vLLM's (ChatCompletionResponse.id, f"chatcmpl-{random_uuid()}", in
    vllm/entrypoints/openai/protocol.py): a counter would tell every client how many
    requests the others sent."""
    return f"{prefix}-{uuid.uuid4().hex}"


@bp.post("/generate")
def generate():
    server = served()
    req = parse_generation_request(read_json_object(), GENERATE, server.settings, request.headers)
    gone = hang_up_check()
    events, first = start(server, req, new_request_id("generate"), gone, g.asker.tenant)
    gen = run_to_end(events, first, request.path, gone)
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
    gone = hang_up_check()
    events, first = start(server, req, request_id, gone, g.asker.tenant)
    model_name = server.settings.model_name
    if req.stream:
        return stream_response(events, first, request_id, route, model_name, req.include_usage)
    gen = run_to_end(events, first, request.path, gone)
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


@bp.get("/server_info")
def server_info():
    """The served model's name, in SGLang's field: SGLang's router (sglang-router 0.3.2) reads
    served_model_name from a worker's /server_info when it registers it and writes that name
    into every chat request it forwards without one; a worker that does not answer is
    registered as the model "unknown", which /v1/chat/completions here refuses with a 404."""
    return {"served_model_name": served().settings.model_name}


@bp.get("/model_info")
def model_info():
    """The model's type and architectures, in SGLang's fields: the router keeps them on the
    model's card (and asks /get_model_info, SGLang's older name, where this route is missing)."""
    config = served().engine.model.config
    return {"model_type": config.model_type, "architectures": config.architectures or [], "is_generation": True}


# -----------------------------------------------------------------------------
# 3. The app


def create_app(
    engine: Engine,
    *,
    model_name: str | None = None,
    salt_by_api_key: bool = False,
    admin_key: str | None = None,
    allowed_hosts: tuple[str, ...] = (),
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
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
    a generation request may take): the limits of docs/server.md.
    A body may be as big as the longest prompt max_prompt_tokens accepts (PromptBounds).
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
        bounds=PromptBounds.of(max_prompt_tokens, tokenizer_token_bytes(engine.tokenizer),
                               trims_content=template_trims(engine.tokenizer)),
        allowed_hosts={*LOCAL_HOSTS, *(host.lower() for host in allowed_hosts)},
        api_keys=api_keys,
        max_prompt_tokens=max_prompt_tokens,
        max_waiting=max_waiting,
        request_timeout=request_timeout,
    )
    app.extensions["server"] = ServerState(engine, settings, page_every_s=cache_page_every_s)
    app.register_blueprint(bp)
    return app




@functools.lru_cache(maxsize=4)
def tokenizer_token_bytes(tokenizer) -> int:
    """max_token_bytes of a tokenizer's whole vocabulary (a quarter of a second: once each)."""
    return max_token_bytes(tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))


def template_trims(tokenizer) -> bool:
    """Whether the tokenizer's chat template may trim a message's content (Jinja's `trim`
    filter, as Llama 3's `message['content'] | trim`): then its whitespace costs no token,
    and the early size check leaves it out. SmolLM2's template keeps every space."""
    return "trim" in (getattr(tokenizer, "chat_template", None) or "")



# -----------------------------------------------------------------------------
# 4. The log


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

