"""A client of the OpenAI API that measures what a prefix cache does: time to first token at
the client, and the cached tokens a server reports, or the fact that it reports none.

The benchmarks that talk to a server (server_load, cache_probe) use only this: the routes
every OpenAI-compatible server has (/v1/chat/completions, /v1/completions, /v1/models),
streamed, with stream_options.include_usage so the last chunk carries the usage. The same
command then measures this course's server, vLLM, SGLang or any other. Where OpenAI puts
the prefix cache, usage.prompt_tokens_details.cached_tokens, is optional: vLLM fills it only
when started with --enable-prompt-tokens-details. A reply without it gives cached_tokens None,
never 0, so a table can say "not reported" instead of a zero that would read as a miss.

    server = OpenAIServer("http://127.0.0.1:5000")
    reply = server.chat([{"role": "user", "content": "Hi"}], max_tokens=1)
    reply.ttft_ms, reply.prompt_tokens, reply.cached_tokens

Figures over many requests are reported as a Spread (median, p90, p99, min and max) beside
the hits and misses: a median alone hides a tail, and a mean hides the requests that found
nothing cached.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

from commands.model_flags import add_model_arguments, pool_arguments
from engine.llm_engine import Engine


NOT_REPORTED = ("[yellow]This server does not report cached tokens[/] (usage.prompt_tokens_details.cached_tokens; "
                "vLLM sends it when started with --enable-prompt-tokens-details).")


@dataclass
class Reply:
    prompt_tokens: int | None  # None: the server sent no usage
    cached_tokens: int | None  # None: the server does not report the prefix cache
    completion_tokens: int | None
    ttft_ms: float  # from sending the request to the first chunk holding text, at the client
    total_ms: float  # to the end of the stream
    text: str


@dataclass
class Spread:
    """One figure over many requests: the median beside the tail and the extremes (a warm
    TTFT with a median of 126 ms can still run from 32 ms to 2 s). Nearest-rank percentiles.

    >>> spread = Spread.of([12, 30, 31, 33, 2031])
    >>> spread.p50, spread.p99, str(spread)   # as the tables print it: p50 / p90 / p99 (min-max)
    (31, 2031, '31 / 2,031 / 2,031 (12-2,031)')
    """

    min: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float | None]) -> Spread | None:
        """The spread of some values; None when one is None (the server did not report it)."""
        if not values or None in values:
            return None
        ordered = sorted(values)

        def rank(percent: int) -> float:
            return ordered[math.ceil(percent / 100 * len(ordered)) - 1]

        return cls(ordered[0], rank(50), rank(90), rank(99), ordered[-1])

    def __str__(self) -> str:
        return f"{self.p50:,.0f} / {self.p90:,.0f} / {self.p99:,.0f} ({self.min:,.0f}-{self.max:,.0f})"

    def as_json(self) -> dict[str, float]:
        return {key: round(value, 1) for key, value in asdict(self).items()}


def hits_and_misses(replies: list[Reply]) -> tuple[int, int] | None:
    """How many of the replies found some of their prompt cached, and how many found none;
    None when the server does not report cached tokens."""
    values = [r.cached_tokens for r in replies]
    if None in values:
        return None
    hits = sum(v > 0 for v in values)
    return hits, len(values) - hits


def spread_json(values: list[float | None]) -> dict[str, float] | None:
    """Spread.of(values) as a benchmark's JSON keeps it; None: not reported."""
    spread = Spread.of(values)
    return None if spread is None else spread.as_json()


SPREAD_COLUMN = "p50 / p90 / p99 (min-max)"  # under a table's column of spreads


def spread_text(spread: dict[str, float] | None) -> str:
    """A spread from spread_json, for a table."""
    return "not reported" if spread is None else str(Spread(**spread))


class APIFailure(RuntimeError):
    """The server answered with an error status, or not at all; the message says which."""


def fresh_line(rng: random.Random | None = None) -> str:
    """A first line no earlier request began with: a prompt starting with it finds nothing
    cached, on any server, without resetting anything.

    >>> fresh_line(random.Random(0))
    'Request 629f6fbed82c07cd.'
    """
    rng = rng or random.Random()
    return f"Request {rng.getrandbits(64):016x}."


class OpenAIServer:
    """One OpenAI-compatible server: its URL, the model to ask for, the API key to send."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.model = model or self.first_model()

    def open(self, path: str, body: dict | None = None):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as err:
            method = "POST" if data else "GET"
            raise APIFailure(f"{method} {self.url + path}: {err.code} {err.read()[:300]!r}") from None
        except urllib.error.URLError as err:
            raise APIFailure(f"{self.url + path}: no answer ({err.reason})") from None

    def first_model(self) -> str:
        """The first model GET /v1/models lists: what a server serving one model serves."""
        with self.open("/v1/models") as response:
            models = json.load(response).get("data") or []
        if not models:
            raise APIFailure(f"{self.url}/v1/models lists no model; name one with --served-model")
        return models[0]["id"]

    def chat(self, messages: list[dict], max_tokens: int, **fields) -> Reply:
        return self.stream("/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, **fields})

    def complete(self, prompt: str, max_tokens: int, **fields) -> Reply:
        return self.stream("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **fields})

    def stream(self, path: str, body: dict) -> Reply:
        """POST a streamed request, greedy; time its first text and read the usage at the end."""
        body = {"model": self.model, "temperature": 0, **body, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first = None
        text, usage = [], None
        with self.open(path, body) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise APIFailure(f"{path}: the stream failed: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if piece and first is None:
                        first = time.perf_counter()
                    text.append(piece)
                usage = chunk.get("usage") or usage
        end = time.perf_counter()
        first = end if first is None else first  # a reply of no text: its first token came with the end
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return Reply(usage.get("prompt_tokens"), details.get("cached_tokens"), usage.get("completion_tokens"),
                     (first - start) * 1e3, (end - start) * 1e3, "".join(text))


# -----------------------------------------------------------------------------
# The flags of a benchmark that measures a server: the server to measure, or the one to start


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="an OpenAI-compatible server, on this machine or any other: every request of the "
                        "benchmark is sent there (default: start a server of this course in this process)")
    parser.add_argument("--served-model", help="the model field of each request (default: the first of /v1/models)")
    parser.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    add_model_arguments(parser)  # the server it starts without --url


def open_server(parser: argparse.ArgumentParser, args: argparse.Namespace, own_flags: dict[str, bool],
                **engine_options):
    """(OpenAIServer, the server this process started or None). With --url, a flag that only
    the server it would start takes (own_flags: {flag: given}) is a usage error."""
    given = [flag for flag, on in {"--model": args.model, "--num-blocks": args.num_blocks, **own_flags}.items() if on]
    if args.url and given:
        parser.error(f"{given[0]} is for the server this starts: leave out --url "
                     f"(name a served model with --served-model)")
    started, url = None, args.url
    if url is None:
        url, started, _ = start_server(args, **engine_options)
    return OpenAIServer(url, args.served_model, args.api_key), started


def start_server(args: argparse.Namespace, **engine_options):
    """A server of this course in this process, on a free loopback port, over the model and
    pool of add_model_arguments' flags: (url, the server, its engine)."""
    from server import create_app, serve_in_background

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request on the screen
    engine = Engine(args.model, device=args.device, dtype=args.dtype, **pool_arguments(args), **engine_options)
    engine.warm_up(stage_7=False)  # as server.py warms its engine
    url, server = serve_in_background(create_app(engine))
    return url, server, engine
