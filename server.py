"""
A tiny HTTP server around the Engine: what a class can curl, what an OpenAI client can use,
and a page that shows the KV block pool live while the requests come in.

    python server.py                        # the offline default model on http://127.0.0.1:5000
    python server.py --num-blocks 64        # a small pool: watch blocks get evicted
    python server.py --salt-by-api-key      # every API key gets its own cache

    curl -s localhost:5000/generate -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16}'

Routes:
    POST /generate               {"prompt": str} or {"messages": [...]}, max_tokens, temperature,
                                 top_p, seed, cache_salt -> text, prompt_tokens, cached_tokens, ...
    GET  /health                 status, model and the cache figures (hit rate, blocks in use, ...)
    GET  /cache                  /health plus the pool: every block, the free queue, block tables
    POST /reset_prefix_cache     forget every cached block (refused while requests run)
    POST /v1/chat/completions    OpenAI's shapes, stream: true included, and
    POST /v1/completions           usage.prompt_tokens_details.cached_tokens
    GET  /v1/models
    GET  /                       the live view of the pool (static/index.html), polling /cache

Requests run concurrently in threads; the engine's lock lets one step (a prefill or one
decoded token) run at a time, so replies interleave token by token. Every error is a JSON
object {"error": {"message", "type"}} with a 4xx status (5xx when the server is at fault).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException
from werkzeug.serving import make_server

from prefix_caching import (
    DEFAULT_MODEL, Engine, Generation, OutOfBlocksError, StreamEvent, add_model_arguments, pool_arguments,
    short_hash,
)

log = logging.getLogger("server")

DEFAULT_MAX_TOKENS_LIMIT = 512
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more text than the default pool holds
EXAMPLE_BODY = '{"prompt": "Hello", "max_tokens": 16}'

# -----------------------------------------------------------------------------
# 1. Errors that teach
#
# Every failure a client can cause becomes an APIError: a status and a message that says
# what was wrong and what to send instead. The shape is OpenAI's, so its client raises
# BadRequestError & co. with our message in it.

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def error_json(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error")}}


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def read_json_object() -> dict:
    """The request body as a dict, whatever its Content-Type (curl -d without -H works too)."""
    raw = request.get_data(cache=False)  # past MAX_CONTENT_LENGTH this raises 413
    if not raw:
        raise APIError(400, f"the body is empty: send a JSON object such as {EXAMPLE_BODY}")
    try:
        # Python's json accepts NaN and Infinity; a NaN temperature would poison the sampler.
        body = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise APIError(400, f"the body is not valid JSON ({err}); send an object such as {EXAMPLE_BODY}")
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object {{...}}, got {type(body).__name__} {raw[:40]!r}")
    return body


# -----------------------------------------------------------------------------
# 2. Reading a generation request
#
# The server checks only what the engine cannot know: which fields this route takes, the
# server's max_tokens limit, where the cache_salt comes from. The engine checks the rest
# (types and ranges of max_tokens, temperature, top_p, seed, the prompt, whether it fits in
# the pool) and raises ValueError with a message, which becomes a 400 unchanged.


@dataclass
class GenerationRequest:
    prompt: str | list  # text, token ids or chat messages: whatever Engine.tokenize takes
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    cache_salt: str | None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


def take_prompt(body: dict, allowed: tuple[str, ...]) -> str | list:
    """The one of body["prompt"] / body["messages"] this route takes."""
    given = [key for key in ("prompt", "messages") if body.get(key) is not None]
    wrong = [key for key in given if key not in allowed]
    if wrong:
        raise APIError(400, f'{request.path} takes {" or ".join(allowed)}, not "{wrong[0]}"')
    if not given:
        examples = {"prompt": '{"prompt": "Hello"}', "messages": '{"messages": [{"role": "user", "content": "Hello"}]}'}
        raise APIError(400, f"the body has no prompt; send {' or '.join(examples[key] for key in allowed)}")
    if len(given) > 1:
        raise APIError(400, 'send "prompt" (text) or "messages" (a chat), not both')
    prompt = body[given[0]]
    if given == ["messages"] and not (isinstance(prompt, list) and prompt):
        raise APIError(400, f'messages must be a non-empty list such as [{{"role": "user", "content": "Hello"}}], got {prompt!r:.40}')
    if given == ["prompt"] and isinstance(prompt, list) and not all(type(t) is int for t in prompt):
        raise APIError(400, "prompt must be a string or a list of token ids (ints); a chat goes in \"messages\"")
    return prompt


def take_bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise APIError(400, f"{key} must be true or false, got {value!r}")
    return value


# -----------------------------------------------------------------------------
# 3. The OpenAI shapes
#
# The same Generation rendered as OpenAI's chat.completion / text_completion objects, and
# as the chunks of their server-sent event streams. cached_tokens goes where OpenAI puts
# it: usage.prompt_tokens_details.cached_tokens.


def usage(gen: Generation) -> dict:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": len(gen.token_ids),
        "total_tokens": gen.prompt_tokens + len(gen.token_ids),
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def log_generation(path: str, gen: Generation) -> None:
    """The one log line of a generation request."""
    log.info("%s: prompt %d tokens, cached %d, completion %d, TTFT %.0f ms, total %.0f ms", path,
             gen.prompt_tokens, gen.cached_tokens, len(gen.token_ids), gen.ttft_ms, gen.total_ms)


def sse(data: dict | str) -> bytes:
    """One server-sent event: a line `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


# -----------------------------------------------------------------------------
# 4. The app


def create_app(
    engine: Engine,
    *,
    model_name: str | None = None,
    salt_by_api_key: bool = False,
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Flask:
    """A Flask app serving `engine`. model_name defaults to the model's directory name.

    salt_by_api_key: the cache_salt of every request is derived from its bearer token, so
    clients with different keys never share cached blocks and cannot time each other's
    prompts; a client-supplied cache_salt is refused, and /cache shows no token text.
    """
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.json.sort_keys = False  # keep the order the fields are written in
    app.json.compact = False  # indented: a reply read in a terminal after curl
    alloc = engine.allocator
    model_name = model_name or Path(engine.model.name_or_path).name or "model"
    app.config["MODEL_NAME"] = model_name
    started = int(time.time())
    request_numbers = itertools.count()

    # --- errors ------------------------------------------------------------------------------

    @app.errorhandler(APIError)
    def api_error(err: APIError):
        log.warning("%s %s -> %d: %s", request.method, request.path, err.status, err.message)
        return error_json(err.status, err.message), err.status

    @app.errorhandler(HTTPException)
    def http_error(err: HTTPException):
        if err.code == 404:
            message = f"no route {request.path}; GET / shows the cache, GET /health the figures, POST /generate runs a prompt"
        elif err.code == 405:
            methods = [m for m in err.valid_methods if m not in ("HEAD", "OPTIONS")]  # Flask's automatic ones
            message = f"{request.path} does not take {request.method}; use {' or '.join(methods)}"
        elif err.code == 413:
            message = f"the body is over this server's limit of {max_body_bytes:,} bytes; send a shorter prompt"
        else:
            message = err.description
        log.warning("%s %s -> %d: %s", request.method, request.path, err.code, message)
        response = app.json.response(error_json(err.code, message))
        response.status_code = err.code
        if err.code == 405:
            response.headers["Allow"] = ", ".join(err.valid_methods)
        return response

    @app.errorhandler(Exception)
    def internal_error(err: Exception):
        log.exception("%s %s failed", request.method, request.path)  # the traceback stays here
        return error_json(500, f"internal error: {type(err).__name__}: {err}"), 500

    # --- reading and running requests ---------------------------------------------------

    def cache_salt(body: dict) -> str | None:
        if not salt_by_api_key:
            salt = body.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise APIError(400, f"cache_salt must be a non-empty string, got {salt!r}")
            return salt
        if body.get("cache_salt") is not None:
            raise APIError(400, "this server derives cache_salt from your API key (--salt-by-api-key): leave it out")
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "send an API key: 'Authorization: Bearer <key>'; each key gets its own cache")
        # A hash, so the key itself never reaches the allocator, the logs or /cache.
        return hashlib.sha256(key.strip().encode()).hexdigest()

    def parse(body: dict, prompt_keys: tuple[str, ...], openai: bool) -> GenerationRequest:
        """The fields of a generation request. The OpenAI routes follow OpenAI's defaults
        (temperature 1) and can stream; /generate is greedy by default and never streams."""
        if openai and body.get("model") not in (None, model_name):
            raise APIError(404, f"the model {body['model']!r} is not served here; this server serves {model_name!r}")
        stream = take_bool(body, "stream")
        if stream and not openai:
            raise APIError(400, f"{request.path} does not stream; use /v1/completions or /v1/chat/completions")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise APIError(400, f'stream_options must be an object such as {{"include_usage": true}}, got {options!r}')
        # OpenAI's chat clients now send max_completion_tokens; older ones max_tokens.
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = min(64, max_tokens_limit) if max_tokens is None else max_tokens
        if type(max_tokens) is int and max_tokens > max_tokens_limit:
            raise APIError(400, f"max_tokens={max_tokens} is over this server's limit of {max_tokens_limit}")
        temperature = body.get("temperature")
        return GenerationRequest(
            prompt=take_prompt(body, prompt_keys),
            max_tokens=max_tokens,
            temperature=(1.0 if openai else 0.0) if temperature is None else temperature,
            top_p=1.0 if body.get("top_p") is None else body["top_p"],
            seed=body.get("seed"),
            cache_salt=cache_salt(body),
            stream=stream,
            include_usage=take_bool(options, "include_usage"),
        )

    def start(req: GenerationRequest, request_id: str) -> tuple[Iterator[StreamEvent], StreamEvent]:
        """Run the prefill: the engine's stream and its first event. The first event comes
        before any response is sent, so a bad or unplaceable request still gets a 4xx/503."""
        try:
            events = engine.stream(req.prompt, req.max_tokens, req.temperature, req.top_p, req.seed,
                                   req.cache_salt, request_id)
            return events, next(events)
        except ValueError as err:
            raise APIError(400, str(err))
        except OutOfBlocksError as err:
            raise APIError(503, f"the KV pool is full, try again when running requests finish: {err}")

    def finish(events: Iterator[StreamEvent], event: StreamEvent) -> Generation:
        try:
            for event in events:
                pass
        except OutOfBlocksError as err:  # a decode step found no free block: the pool is full
            raise APIError(503, f"the KV pool filled up during the reply, try again later: {err}")
        log_generation(request.path, event.generation)
        return event.generation

    def stream_response(events: Iterator[StreamEvent], first: StreamEvent, request_id: str, chat: bool,
                        include_usage: bool) -> Response:
        """Server-sent events in OpenAI's chunk shapes, ending with `data: [DONE]`."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": request_id, "object": kind, "created": int(time.time()), "model": model_name}
        path = request.path  # the generator below runs after the request context is gone

        def chunk(text: str | None, finish_reason: str | None = None, role: str | None = None) -> bytes:
            if chat:  # a chat stream sends the message as deltas; the first one names the role
                delta = ({"role": role} if role else {}) | ({} if text is None else {"content": text})
                entry = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                entry = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            data = {**head, "choices": [entry]}
            return sse((data | {"usage": None}) if include_usage else data)

        def body() -> Iterator[bytes]:
            event = first
            try:
                if chat:
                    yield chunk("", role="assistant")
                for event in itertools.chain([first], events):
                    if event.text:
                        yield chunk(event.text)
                gen = event.generation
                yield chunk(None, gen.finish_reason)
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage(gen)})
                yield sse("[DONE]")
                log_generation(path, gen)
            except OutOfBlocksError as err:  # the status is already sent: say it in the stream
                yield sse(error_json(503, f"the KV pool filled up during the reply: {err}"))
            except GeneratorExit:  # the client hung up: the server's next write failed and closed us
                log.info("%s: the client left after %d tokens; freeing its blocks", path, len(event.generation.token_ids))
                raise
            finally:
                events.close()  # closing the engine's stream frees the request's blocks

        return Response(body(), mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})

    # --- the pool as JSON ----------------------------------------------------------------

    def figures() -> dict:
        """What /health reports; call with the engine's lock held."""
        return {
            "status": "ok",
            "model": model_name,
            "num_blocks": alloc.num_blocks,
            "block_size": alloc.block_size,
            "num_free_blocks": alloc.num_free_blocks,
            "num_cached_blocks": alloc.num_cached_blocks,
            "blocks_in_use": alloc.num_blocks_in_use,
            "running_requests": len(alloc.block_tables),
            **alloc.stats.as_dict(),
        }

    # --- routes ----------------------------------------------------------------------------

    @app.get("/")
    def index():
        return app.send_static_file("index.html")

    @app.get("/health")
    def health():
        with engine.lock:  # a snapshot between two steps, never in the middle of one
            return figures()

    @app.get("/cache")
    def cache():
        with engine.lock:  # copy under the lock, decode after: the engine waits only for the copy
            snapshot = figures()
            blocks = [(b.block_id, b.ref_cnt, b.block_hash, list(b.token_ids)) for b in alloc.blocks]
            snapshot["free_queue"] = alloc.free_queue_ids()  # head (evicted first) -> tail
            snapshot["block_tables"] = {rid: list(table) for rid, table in alloc.block_tables.items()}
        snapshot["blocks"] = [
            {
                "block_id": block_id,
                "ref_cnt": ref_cnt,
                "block_hash": None if block_hash is None else short_hash(block_hash),
                "num_tokens": len(token_ids),
                # Token text would show one tenant's prompts to everyone: left out when salted by key.
                "text": None if salt_by_api_key else engine.tokenizer.decode(token_ids),
            }
            for block_id, ref_cnt, block_hash, token_ids in blocks
        ]
        return snapshot

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache():
        with engine.lock:
            if not alloc.reset_prefix_cache():
                raise APIError(409, f"{alloc.num_blocks_in_use} blocks are in use by {len(alloc.block_tables)} running requests; "
                                    f"the cache can be reset only when no request runs")
            return figures()

    @app.post("/generate")
    def generate():
        req = parse(read_json_object(), ("prompt", "messages"), openai=False)
        gen = finish(*start(req, f"generate-{next(request_numbers)}"))
        return {
            "text": gen.text,
            "prompt_tokens": gen.prompt_tokens,
            "cached_tokens": gen.cached_tokens,
            "completion_tokens": len(gen.token_ids),
            "finish_reason": gen.finish_reason,
            "ttft_ms": round(gen.ttft_ms, 1),
            "total_ms": round(gen.total_ms, 1),
        }

    def openai_completion(chat: bool):
        prompt_keys = ("messages",) if chat else ("prompt",)
        req = parse(read_json_object(), prompt_keys, openai=True)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(request_numbers)}"
        events, first = start(req, request_id)
        if req.stream:
            return stream_response(events, first, request_id, chat, req.include_usage)
        gen = finish(events, first)
        if chat:
            entry = {"index": 0, "message": {"role": "assistant", "content": gen.text}}
        else:
            entry = {"index": 0, "text": gen.text}
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [entry | {"logprobs": None, "finish_reason": gen.finish_reason}],
            "usage": usage(gen),
        }

    @app.post("/v1/chat/completions")
    def chat_completions():
        return openai_completion(chat=True)

    @app.post("/v1/completions")
    def completions():
        return openai_completion(chat=False)

    @app.get("/v1/models")
    def models():
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "prefix-caching"}
        return {"object": "list", "data": [card]}

    return app


# -----------------------------------------------------------------------------
# 5. Running it


def serve_in_background(app: Flask, host: str = "127.0.0.1", port: int = 0):
    """Serve `app` from a daemon thread, for a lesson, test or benchmark that runs the server
    inside its own process; port 0 lets the OS pick a free one. Returns (base URL, server);
    server.shutdown() stops it."""
    server = make_server(host, port, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://{host}:{server.server_port}", server


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.logging import RichHandler

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 lets other machines (a class) connect")
    parser.add_argument("--port", type=int, default=5000)
    add_model_arguments(parser)  # --model, --device, --dtype, --block-size, --num-blocks
    parser.add_argument("--salt-by-api-key", action="store_true", help="isolate each bearer token's cache")
    parser.add_argument("--max-tokens-limit", type=int, default=DEFAULT_MAX_TOKENS_LIMIT)
    args = parser.parse_args(argv)
    if args.max_tokens_limit < 1:
        parser.error(f"--max-tokens-limit must be at least 1, got {args.max_tokens_limit}")

    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler(show_path=False)])
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # our own line per request instead
    console = Console(stderr=True)
    console.print(f"loading {args.model or DEFAULT_MODEL}…")  # the default's first load converts its GGUF file, and says so
    try:
        engine = Engine(args.model, device=args.device, dtype=args.dtype, **pool_arguments(args))
    except (OSError, ValueError) as err:
        parser.exit(2, f"error: {err}\n")
    engine.warm_up()
    app = create_app(engine, salt_by_api_key=args.salt_by_api_key, max_tokens_limit=args.max_tokens_limit)
    try:
        server = make_server(args.host, args.port, app, threaded=True)
    except OSError as err:
        parser.exit(2, f"error: cannot listen on {args.host}:{args.port} ({err}); pick another --port\n")

    url = f"http://{args.host}:{server.server_port}"
    console.print(f"{engine.kv}")
    console.print(f"[bold green]serving {app.config['MODEL_NAME']} on {url}[/]   (Ctrl+C stops)")
    console.print(f"  watch the cache:  open {url}/ in a browser")
    example = '{"messages": [{"role": "user", "content": "What is a cache?"}], "max_tokens": 32}'
    console.print(f"  try:  curl -s {url}/generate -d '{example}'", soft_wrap=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        console.print("stopped")


if __name__ == "__main__":
    main()
