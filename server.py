"""
A tiny HTTP server around the Engine: what a class can curl, what an OpenAI client can use,
and a page that shows the KV block pool live while the requests come in.

    python server.py                        # the offline default model on http://127.0.0.1:5000
    python server.py --num-blocks 64        # a small pool: watch blocks get evicted, requests wait
    python server.py --salt-by-api-key --admin-key SECRET   # a cache per API key; only SECRET resets
    python server.py --salt-by-api-key --api-keys class.txt # ... and only the keys listed there

    curl -s localhost:5000/generate -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16}'

Routes: /generate, /health, /cache, /reset_prefix_cache, the OpenAI routes /v1/chat/completions,
/v1/completions and /v1/models, and / (the live page): serving/routes.py lists what each takes.

Each client's request runs in a thread of its own, which submits it to the Engine's one
engine loop: every running request shares the same forward pass, one step after another
(engine/engine_loop.py). A request the pool has no room for now waits in a queue, or a running one
is preempted and resumed later, as in vLLM.

A class leaning on it meets limits (queue length, prompt length, deadlines, connections in
all and per address, generation requests per API key), each a flag with a default for a
laptop; a class behind one NAT or proxy is told apart by its keys (--api-keys) or by the
proxy's X-Forwarded-For (--forwarded-allow-ips); a client that hangs up costs
nothing more, and Ctrl+C lets running requests finish, then ends within --shutdown-grace + 5 s.
docs/server.md lists the limits, says what a tenant can see, and where this server differs
from vLLM's.

This file is the command: its flags, the model, and serving until Ctrl+C. The server is in
four files, each with one role, in the README's reading-order table: serving/requests.py (what
a client sends, read and checked), serving/views.py (what a caller may see),
serving/connections.py (connections, deadlines, hang-ups, Ctrl+C) and serving/routes.py
(running a request, the routes, create_app).
"""

from __future__ import annotations

import argparse
import logging

from commands.flags import positive_float, positive_int
from commands.model_flags import add_model_arguments, engine_from_flags, pool_arguments
from engine.llm_engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_TARGET_STEP_MS, EngineConfig
from engine.model_loader import DEFAULT_MODEL
from serving.connections import (
    MAX_HEAD_BYTES, MAX_HEADER_FIELDS, MOST_CONNECTIONS, ClassServer, bind_error, connection_cap, drain,
    serve_in_background,
)
from serving.requests import (
    DEFAULT_HEAD_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS_PER_CLIENT, DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_REQUESTS_PER_KEY, DEFAULT_MAX_TOKENS_LIMIT, DEFAULT_MAX_WAITING, DEFAULT_READ_TIMEOUT,
    DEFAULT_REQUEST_TIMEOUT, JSON_HEADER, MAX_CHAT_MESSAGES, read_api_keys, trusted_proxies,
)
from serving.routes import EscapeControlCharacters, chat_completions, create_app, generate

# What a lesson or test imports from here, the entry point, wherever it is defined.
__all__ = ["chat_completions", "create_app", "drain", "generate", "main", "serve_in_background"]

DEFAULT_SHUTDOWN_GRACE = 10.0  # seconds running requests get to finish after Ctrl+C


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
    batching = parser.add_argument_group("batching (the engine loop of engine/engine_loop.py; vLLM's flags of the same names)")
    batching.add_argument("--max-num-seqs", type=positive_int, default=None,
                          help=f"requests running in one step at most (default: {DEFAULT_MAX_NUM_SEQS})")
    budget = batching.add_mutually_exclusive_group()
    budget.add_argument("--target-step-ms", type=positive_float, default=None,
                        help=f"each step computes as many tokens as fit in this many milliseconds, learned from the "
                             f"steps run, up to {DEFAULT_MAX_NUM_BATCHED_TOKENS}: a long prompt is prefilled in chunks "
                             f"that keep every stream moving (default: {DEFAULT_TARGET_STEP_MS:g}; engine/step_budget.py)")
    budget.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                        help="tokens every step computes at most, at least --max-num-seqs, instead of a target step "
                             "time (vLLM's flag: the same budget, hence the same plans, on every machine, where a "
                             "class needs to compare them); a longer prompt is prefilled in chunks")
    batching.add_argument("--fair-share", action=argparse.BooleanOptionalAction, default=None,
                          help="serve tenants (an API key's, or an address's without keys) least-served first, and "
                               "hold one far ahead to a small share of each step while others decode (default: on; "
                               "engine/scheduler.py, engine/step_budget.py); --no-fair-share: arrival order, for benches and "
                               "comparisons")
    batching.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                          help="split a prompt longer than the step's budget across steps (default: on); "
                               "--no-enable-chunked-prefill prefills it whole, in a step of its own")
    parser.add_argument("--salt-by-api-key", action="store_true", help="isolate each bearer token's cache")
    parser.add_argument("--admin-key", help="the bearer token POST /reset_prefix_cache needs "
                                            "(required for a reset under --salt-by-api-key)")
    parser.add_argument("--api-keys", metavar="FILE",
                        help="the keys a class may use, one per line: any other key gets a 401 "
                             "(default: any bearer key is taken, or none). With keys in use, open the live page as "
                             "/#key=KEY: it keeps the key for its tab and takes it out of the address bar")
    limits = parser.add_argument_group(
        "limits (docs/server.md)",
        f"besides these, fixed bounds checked before any work: a request head of at most {MAX_HEADER_FIELDS} header "
        f"lines and {MAX_HEAD_BYTES // 1024} KiB of them (431), a chat of at most {MAX_CHAT_MESSAGES} messages (400)")
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
                        help=f"seconds a request's head and body may take in all, from the moment its connection "
                             f"opens (a deadline), and a client may leave its reply unread (default: "
                             f"{DEFAULT_READ_TIMEOUT:g})")
    limits.add_argument("--idle-timeout", type=positive_float, default=DEFAULT_IDLE_TIMEOUT,
                        help=f"seconds a new connection has to start its request (default: {DEFAULT_IDLE_TIMEOUT:g})")
    limits.add_argument("--head-timeout", type=positive_float, default=DEFAULT_HEAD_TIMEOUT,
                        help=f"seconds a request's head may take, from the moment its connection opens (a deadline); "
                             f"at --max-connections a new connection takes the place of the oldest whose head is "
                             f"still coming in (default: {DEFAULT_HEAD_TIMEOUT:g})")
    limits.add_argument("--max-connections", type=positive_int, default=None,
                        help=f"open connections, a thread and an open file each; beyond it a 503 (default: what the "
                             f"open-file limit, ulimit -n, leaves after an eighth of it for the server's own files, "
                             f"at most {MOST_CONNECTIONS}: {connection_cap()} here)")
    limits.add_argument("--max-connections-per-client", type=int, default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                        help=f"open connections from one IP address that are not the live page's polls and show no "
                             f"key of --api-keys (requests still coming in, requests without such a key); beyond it "
                             f"a 503; 0: no such cap. A class behind one NAT, tunnel or proxy, hence one address, "
                             f"needs --api-keys, a key each (default: {DEFAULT_MAX_CONNECTIONS_PER_CLIENT})")
    limits.add_argument("--max-requests-per-key", type=positive_int, default=DEFAULT_MAX_REQUESTS_PER_KEY,
                        help=f"generation requests one API key may have open at once (waiting, running or "
                             f"streaming), where keys are in use (--api-keys, --salt-by-api-key); beyond it a 429 "
                             f"with Retry-After, before any work (default: {DEFAULT_MAX_REQUESTS_PER_KEY})")
    parser.add_argument("--forwarded-allow-ips", action="append", default=[], metavar="ADDR",
                        help="a proxy in front of this server (an address or network: 10.0.0.5, 10.0.0.0/24; repeat "
                             "it, or give a comma list): from it, a request's client is the last address of "
                             "X-Forwarded-For, which that proxy appended (for --max-connections-per-client and, without keys, "
                             "as who asks); from anyone else the header is ignored (default: no proxy is trusted)")
    limits.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE,
                        help=f"seconds running requests get to finish after Ctrl+C (default: {DEFAULT_SHUTDOWN_GRACE:g})")
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:  # else 70000 is served on 70000 - 65536 = 4464
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.admin_key is not None and not args.admin_key.strip():
        parser.error("--admin-key is empty: give a secret")
    if args.max_connections_per_client < 0:
        parser.error(f"--max-connections-per-client must be 0 (no cap) or more, got {args.max_connections_per_client}")
    if args.shutdown_grace < 0:
        parser.error(f"--shutdown-grace must be 0 or more seconds, got {args.shutdown_grace:g}")
    try:
        api_keys = None if args.api_keys is None else read_api_keys(args.api_keys)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        parser.error(f"--api-keys: {err}")
    try:
        proxies = trusted_proxies(args.forwarded_allow_ips)
    except ValueError as err:
        parser.error(f"--forwarded-allow-ips: {err}")
    scheduler_options = {name: value for name, value in vars(args).items()
                         if name in ("max_num_seqs", "max_num_batched_tokens", "target_step_ms", "enable_chunked_prefill",
                                     "fair_share")
                         and value is not None}
    try:  # every engine option checked at once, before the model loads
        config = EngineConfig(**pool_arguments(args), **scheduler_options)
    except ValueError as err:
        parser.error(str(err).replace("max_num_", "--max-num-").replace("batched_tokens", "batched-tokens"))

    taken = bind_error(args.host, args.port)  # before the model loads, which takes a while
    if taken is not None:
        parser.exit(2, f"error: cannot listen on {args.host}:{args.port} ({taken}); pick another --port\n")

    handler = RichHandler(show_path=False)
    handler.addFilter(EscapeControlCharacters())  # werkzeug's records and any library's too
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[handler])
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # our own line per request instead
    console = Console(stderr=True)
    console.print(f"loading {args.model or DEFAULT_MODEL}…")  # the default's first load converts its GGUF file, and says so
    try:
        engine = engine_from_flags(args, config=config)
    except (OSError, ValueError) as err:
        parser.exit(2, f"error: {err}\n")
    engine.warm_up(stage_7=False)  # every request of the server goes through the engine's loop
    app = create_app(engine, salt_by_api_key=args.salt_by_api_key, admin_key=args.admin_key,
                     allowed_hosts=(args.host, *args.allowed_host), max_tokens_limit=args.max_tokens_limit,
                     api_keys=api_keys, max_prompt_tokens=args.max_prompt_tokens, max_waiting=args.max_waiting_requests,
                     request_timeout=args.request_timeout)
    try:
        server = ClassServer(args.host, args.port, app, max_connections=args.max_connections,
                             max_connections_per_client=args.max_connections_per_client,
                             max_requests_per_key=args.max_requests_per_key, forwarded_allow_ips=proxies,
                             read_timeout=args.read_timeout, idle_timeout=args.idle_timeout,
                             head_timeout=args.head_timeout)
    except OSError as err:
        parser.exit(2, f"error: cannot listen on {args.host}:{args.port} ({err}); pick another --port\n")

    url = f"http://{args.host}:{server.server_port}"
    console.print(f"{engine.kv}")
    options = engine.scheduler_options
    chunks = "a longer prompt in chunks" if options["enable_chunked_prefill"] else "a longer prompt alone"
    budget = (f"as many tokens as fit in {engine.target_step_ms:g} ms (at most {options['max_num_batched_tokens']})"
              if engine.target_step_ms else f"{options['max_num_batched_tokens']} tokens")
    console.print(f"batching: up to {options['max_num_seqs']} requests and {budget} a step, {chunks}; "
                  f"a full pool makes requests wait")
    console.print(f"[bold green]serving {app.extensions['server'].settings.model_name} on {url}[/]   (Ctrl+C stops)")
    if args.salt_by_api_key or api_keys is not None:
        console.print(f"  watch the cache:  open {url}/#key=YOUR-KEY in a browser (the key leaves the address bar)")
    else:
        console.print(f"  watch the cache:  open {url}/ in a browser")
    example = '{"messages": [{"role": "user", "content": "What is a cache?"}], "max_tokens": 32}'
    key = " -H 'Authorization: Bearer YOUR-KEY'" if args.salt_by_api_key else ""
    console.print(f"  try:  curl -s {url}/generate {JSON_HEADER}{key} -d '{example}'", soft_wrap=True, markup=False)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        console.print(f"stopping: waiting requests get a 503, running ones up to {args.shutdown_grace:g} s to finish…")
        try:
            drain(server, engine, args.shutdown_grace)
        except KeyboardInterrupt:  # a second Ctrl+C: no more grace
            console.print("stopping now: running requests end with finish reason abort")
            drain(server, engine, 0.0)
        console.print("stopped")


if __name__ == "__main__":
    main()
