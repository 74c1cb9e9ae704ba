"""
What a client sends to server.py, read and checked: the body, who is asking, and the
generation request. Plain functions of plain values (bytes, dicts, headers), no Flask: each
is tested without HTTP (tests/server/test_server_requests.py), and every failure is an APIError
whose message says what was wrong and what to send instead.

    parse_generation_request({"prompt": "Hi", "max_tokens": 8}, GENERATE, Settings("my-model"), headers={})

Read in this order: errors (1), the body (2), who is asking (3), a generation request (4).
server.py runs what this module reads.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from dataclasses import dataclass, field
from typing import Mapping

from allocator import check_cache_salt, check_text

DEFAULT_MAX_TOKENS_LIMIT = 512
# Limits for one laptop and a class (docs/server.md lists them; each has a flag).
DEFAULT_MAX_PROMPT_TOKENS = 4096  # a third of the default pool; seconds of prefill on a laptop CPU
DEFAULT_MAX_WAITING = 64  # requests queued behind the running ones; beyond it a 503
DEFAULT_REQUEST_TIMEOUT = 300.0  # seconds a generation request may take, its wait in the queue included
DEFAULT_READ_TIMEOUT = 10.0  # seconds a request's head and body may take in all, from the connection's start
DEFAULT_IDLE_TIMEOUT = 5.0  # seconds a new connection may wait before it sends its first byte
DEFAULT_HEAD_TIMEOUT = 5.0  # seconds a request's head may take, from the connection's start (one packet, as sent)
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 32  # connections from one IP address no key or page accounts for (0: no cap)
# Generation requests open at once for one API key: a student's loop runs one, a notebook's
# thread pool a few.
DEFAULT_MAX_REQUESTS_PER_KEY = 8
RETRY_AFTER_S = 2  # what a 503 asks a client to wait before it tries again
EXAMPLE_BODY = '{"prompt": "Hello", "max_tokens": 16}'
JSON_HEADER = "-H 'Content-Type: application/json'"

# -----------------------------------------------------------------------------
# 1. Errors that teach
#
# Every failure a client can cause becomes an APIError: a status and a message that says
# what was wrong and what to send instead. The shape is OpenAI's, so its client raises
# BadRequestError & co. with our message in it.

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """retry_after: for a 503, the seconds to wait before trying again (a Retry-After header)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


def error_json(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error")}}


# -----------------------------------------------------------------------------
# 2. Reading the body
#
# JSON only, and only when it says so: a web page on another site can POST here without
# asking (a "simple" cross-origin request, e.g. fetch(url, {mode: "no-cors"})) only with the
# Content-Types of an HTML form or text/plain. Requiring application/json makes the browser
# ask this server first (CORS), and this server never says yes.


def check_content_type(mimetype: str) -> None:
    if mimetype != "application/json":
        sent = f"Content-Type {mimetype!r}" if mimetype else "no Content-Type"
        hint = " (what curl -d sends)" if mimetype == "application/x-www-form-urlencoded" else ""
        raise APIError(415, f"POST a JSON body with Content-Type: application/json; this request sent {sent}{hint}. "
                            f"With curl add {JSON_HEADER}, or send the body with --json (curl 7.82+)")


# How big may a body be? As big as the longest prompt --max-prompt-tokens accepts, written
# in JSON as wastefully as JSON allows, and no bigger: bounds known before a byte of it is
# read, and checked before the prompt is templated or tokenized (which costs seconds for a
# body of a few MiB). A token is at most `max_token_bytes` bytes of UTF-8 text (81 for
# SmolLM2's tokenizer: a newline and 80 spaces), and JSON spends at most 6 bytes on one byte
# of text (a control character is written "\u0001"); each message is at least one token
# (its role's), and its braces, quotes and keys take at most MESSAGE_JSON_BYTES; the other
# fields, and any whitespace between JSON's tokens, get BODY_SLACK_BYTES.

JSON_BYTES_PER_TEXT_BYTE = 6
MESSAGE_JSON_BYTES = 48  # {"role": "assistant", "content": ""}, and spaces: 38
BODY_SLACK_BYTES = 64 * 1024
SMOLLM2_TOKEN_BYTES = 81  # max_token_bytes of the default model's tokenizer
# This server's own choice (vLLM has none): a chat template is rendered message by message,
# so a chat of thousands of one-letter messages costs time before a token of it is counted.
# A class's chats are a few turns; 256 leaves room for a long conversation.
MAX_CHAT_MESSAGES = 256


@dataclass(frozen=True)
class PromptBounds:
    """The most a prompt of at most max_prompt_tokens tokens could hold: each bound a prompt
    the server accepts never exceeds (for a tokenizer that drops no text: byte-level BPE,
    SentencePiece with byte fallback). trims_content: the chat template trims a message's
    content (Jinja's `trim`), so its whitespace costs no token and is not counted.

    >>> PromptBounds.of(max_prompt_tokens=4096, max_token_bytes=81)
    PromptBounds(max_text_bytes=331776, max_messages=4096, max_body_bytes=2252800, trims_content=False)
    """

    max_text_bytes: int  # UTF-8 bytes of the prompt's text (a chat: its messages' contents)
    max_messages: int
    max_body_bytes: int
    trims_content: bool = False

    @classmethod
    def of(cls, max_prompt_tokens: int, max_token_bytes: int, trims_content: bool = False) -> PromptBounds:
        text = max_prompt_tokens * max_token_bytes
        body = JSON_BYTES_PER_TEXT_BYTE * text + MESSAGE_JSON_BYTES * max_prompt_tokens + BODY_SLACK_BYTES
        return cls(text, max_prompt_tokens, body, trims_content)


def max_token_bytes(token_texts) -> int:
    """The most UTF-8 bytes one token stands for, from the text of each token alone. A piece
    of a character (byte-level BPE splits an emoji in two) decodes to U+FFFD, 3 bytes: never
    fewer than the piece stands for.

    >>> max_token_bytes(["a", " the", "\\ufffd", "\\n" + " " * 80])
    81
    """
    return max(len(text.encode()) for text in token_texts)


def check_prompt_size(prompt: str | list, bounds: PromptBounds, max_prompt_tokens: int) -> None:
    """400 for a prompt no tokenizer could make max_prompt_tokens or fewer tokens of, or a chat
    of more than MAX_CHAT_MESSAGES messages, before it is templated or tokenized. A message's
    whitespace is counted as its chat template counts it: trimmed only where the template
    trims (SmolLM2's keeps it: a message of spaces is thousands of tokens, and seconds of
    tokenizing).

    >>> check_prompt_size("Hi" * 100, PromptBounds.of(2, 81), 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    serving.requests.APIError: the prompt's text is 200 bytes, more than a prompt of at most 2 tokens ... (162 bytes); ...
    """
    limit = f"a prompt of at most {max_prompt_tokens:,} tokens (--max-prompt-tokens) can hold"
    if isinstance(prompt, str):
        size = len(prompt.encode(errors="surrogatepass"))  # a lone surrogate is refused later, saying so
    elif not isinstance(prompt, list):
        return  # the engine refuses it, saying why
    elif all(type(t) is int for t in prompt):
        if len(prompt) > max_prompt_tokens:
            raise APIError(400, f"the prompt is {len(prompt):,} token ids, over this server's limit of "
                                f"{max_prompt_tokens:,} (--max-prompt-tokens); send a shorter one")
        return
    else:  # a chat; the engine checks each message's shape
        if len(prompt) > bounds.max_messages:
            raise APIError(400, f"the chat has {len(prompt):,} messages, more than {limit}; send fewer")
        if len(prompt) > MAX_CHAT_MESSAGES:
            raise APIError(400, f"the chat has {len(prompt):,} messages, over this server's limit of "
                                f"{MAX_CHAT_MESSAGES}; send fewer (a long conversation: its last turns)")
        contents = [m["content"] for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str)]
        if bounds.trims_content:
            contents = [content.strip() for content in contents]
        size = sum(len(content.encode(errors="surrogatepass")) for content in contents)
    if size > bounds.max_text_bytes:
        raise APIError(400, f"the prompt's text is {size:,} bytes, more than {limit} "
                            f"({bounds.max_text_bytes:,} bytes); send a shorter one")


def read_body(stream, content_length: int | None, limit: int) -> bytes:
    """At most `limit` bytes of the body, or 413, refused on its Content-Length before a byte
    of it is read. A chunked body (content_length None) announces no length, so read one byte
    past the limit: that byte tells "exactly at the limit" from "over it"; a chunk that breaks
    the chunked framing is a 400."""
    if content_length is not None and content_length > limit:
        raise APIError(413, f"the body is {content_length:,} bytes, over this server's limit of {limit:,} "
                            f"(what --max-prompt-tokens could ever accept); send a shorter prompt")
    chunks, size = [], 0
    while size <= limit:
        try:
            chunk = stream.read(limit + 1 - size)
        except TimeoutError:  # the connection's read timeout: a chunked body that stopped coming
            raise APIError(408, f"the body stopped arriving after {size:,} bytes (--read-timeout); "
                                f"send it whole") from None
        except OSError as err:  # werkzeug's dechunker: a size line that is not hex, a chunk without its CRLF
            if content_length is not None or isinstance(err, ConnectionError):
                raise  # not a chunked body, or the client left: not a malformed request
            raise APIError(400, f"the chunked body is malformed after {size:,} bytes ({err}); send each chunk as "
                                f"its size in hex, CRLF, its bytes, CRLF, and end with 0 CRLF CRLF "
                                f"(RFC 9112 section 7.1), or send a Content-Length instead") from None
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise APIError(413, f"the body is over this server's limit of {limit:,} bytes (what --max-prompt-tokens "
                            f"could ever accept); send a shorter prompt")
    return b"".join(chunks)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def parse_json_object(raw: bytes) -> dict:
    """The body as a dict, every string of it text, or a 400 that says what is wrong with it.

    >>> parse_json_object(b'{"prompt": "Hi"}')
    {'prompt': 'Hi'}
    """
    body = load_json_object(raw)
    check_strings(body)
    return body


def load_json_object(raw: bytes) -> dict:
    """The body as a dict, its strings not checked yet: a generation request checks its size
    first (parse_generation_request), which costs less than walking 37,000 messages."""
    if not raw:
        raise APIError(400, f"the body is empty: send a JSON object such as {EXAMPLE_BODY}")
    try:
        # Python's json accepts NaN and Infinity; a NaN temperature would poison the sampler.
        body = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise APIError(400, f"the body is not valid JSON ({err}); send an object such as {EXAMPLE_BODY}")
    except RecursionError:  # json parses nested arrays by recursion: [[[[... 100,000 deep
        raise APIError(400, f"the body nests arrays or objects too deeply to parse; send an object such as {EXAMPLE_BODY}")
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object {{...}}, got {type(body).__name__} {raw[:40]!r}")
    return body


def check_strings(body: dict) -> None:
    """400 for any string of the body, or key, that is not text: JSON can escape a lone
    surrogate ("\\ud800") that UTF-8 cannot encode, and tokenizers fail on it much later.
    A loop, not recursion: a body can be nested hundreds deep.

    >>> check_strings({"messages": [{"role": "user", "content": "\\ud800"}]})
    Traceback (most recent call last):
    serving.requests.APIError: messages[0].content holds '\\ud800', a lone surrogate, which is not text; send valid UTF-8
    """
    stack: list[tuple[str, object]] = [("the body", body)]
    try:
        while stack:
            path, value = stack.pop()
            if isinstance(value, str):
                check_text(value, path)
            elif isinstance(value, dict):
                for key, item in value.items():
                    check_text(key, f"a key of {path}")
                    stack.append((key if path == "the body" else f"{path}.{key}", item))
            elif isinstance(value, list):
                stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    except ValueError as err:
        raise APIError(400, str(err)) from None


# -----------------------------------------------------------------------------
# 3. Who is asking: the Host, the tenant, the admin
#
# DNS rebinding: a page on evil.example makes its name resolve to 127.0.0.1 and then talks to
# this server as if it were the same site. The browser still sends `Host: evil.example`, so
# the server answers only to names it knows: localhost, the host it listens on, --allowed-host
# names and IP literals (an address is not a name: nobody can make it point elsewhere).

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def check_host(host: str, allowed: set[str]) -> None:
    """400 unless the Host header names this server.

    >>> check_host("127.0.0.1:5000", set()), check_host("[::1]:5000", set()), check_host("LocalHost", {"localhost"})
    (None, None, None)
    """
    # "name:port" -> name; "[v6 address]:port" -> the address
    name = host[1:].partition("]")[0] if host.startswith("[") else host.partition(":")[0]
    name = name.lower().rstrip(".")  # names are case-blind; "localhost." is localhost
    try:
        ipaddress.ip_address(name)
        return
    except ValueError:
        pass
    if name not in allowed:
        # 400, as Django answers a host it does not serve; 421 (misdirected) would make
        # browsers retry on a new connection, and a refused name will not get better.
        raise APIError(400, f"this server does not answer to the host {name!r} (a guard against DNS rebinding); "
                            f"if that name is yours, start the server with --allowed-host {name}")


def bearer_key(headers: Mapping[str, str]) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    scheme, _, key = headers.get("Authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def read_api_keys(path: str) -> frozenset[str]:
    """The keys a class may use (--api-keys FILE): one per line; blank lines and lines
    starting with # are skipped."""
    with open(path, encoding="utf-8") as file:
        keys = frozenset(line.strip() for line in file if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"{path} lists no API key: write one key per line")
    return keys


def is_listed(key: str, api_keys: frozenset[str], admin_key: str | None) -> bool:
    """Whether the key is one of api_keys or the admin key. Compared with every key, each in
    constant time: how long the answer takes tells nothing of the keys."""
    known = [hmac.compare_digest(key.encode(), k.encode()) for k in (*api_keys, *([admin_key] if admin_key else []))]
    return any(known)


def check_api_key(headers: Mapping[str, str], api_keys: frozenset[str] | None, admin_key: str | None) -> None:
    """401 unless the request's key is one of api_keys (or the admin key); no list: any key."""
    if api_keys is None:
        return
    key = bearer_key(headers)
    if key is None:
        raise APIError(401, "send an API key: 'Authorization: Bearer <key>'; your teacher has the list")
    if not is_listed(key, api_keys, admin_key):
        raise APIError(401, "this API key is not on this server's list (--api-keys); check it with your teacher")


def is_admin(headers: Mapping[str, str], admin_key: str | None) -> bool:
    key = bearer_key(headers)
    return admin_key is not None and key is not None and hmac.compare_digest(key.encode(), admin_key.encode())


def tenant_of(headers: Mapping[str, str], salt_by_api_key: bool) -> str | None:
    """Whose cache a caller uses and may look at: under --salt-by-api-key the SHA-256 of its
    API key (so the key itself never reaches the allocator, the logs or /cache), else None,
    the public tenant."""
    if not salt_by_api_key:
        return None
    key = bearer_key(headers)
    if key is None:
        raise APIError(401, "send an API key: 'Authorization: Bearer <key>'; each key gets its own cache")
    return hashlib.sha256(key.encode()).hexdigest()


def check_admin(headers: Mapping[str, str], admin_key: str | None, salt_by_api_key: bool) -> None:
    """The reset wipes every tenant's cache: with keys in use only the admin may do it."""
    if admin_key is None:
        if salt_by_api_key:
            raise APIError(403, "this server keeps a cache per API key, so no key may reset everyone's; "
                                "start it with --admin-key KEY and send 'Authorization: Bearer KEY' to reset")
        return  # no keys at all: a development server on your own machine, as vLLM's dev mode
    key = bearer_key(headers)
    if key is None:
        raise APIError(401, "resetting the cache needs the admin key: send 'Authorization: Bearer <admin key>'")
    if not hmac.compare_digest(key.encode(), admin_key.encode()):  # in constant time: no timing hints
        raise APIError(403, "that is not this server's admin key (--admin-key): the cache stays as it is")


# A proxy in front of the server (nginx, Caddy, a tunnel's agent) opens every connection from
# its own address and appends the address it was reached from to X-Forwarded-For. Anyone can
# write that header, so it is read only from the proxies the teacher names
# (--forwarded-allow-ips, uvicorn's and gunicorn's flag), and only its last address, the one
# that proxy appended: every earlier one is what its client sent, and could be anything.


def trusted_proxies(values) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """The networks of --forwarded-allow-ips: addresses or networks, each value a comma list.

    >>> trusted_proxies(["127.0.0.1", "10.0.0.0/24, ::1"])
    (IPv4Network('127.0.0.1/32'), IPv4Network('10.0.0.0/24'), IPv6Network('::1/128'))
    """
    networks = []
    for value in values:
        for item in str(value).split(","):
            item = item.strip()
            if item == "*":
                raise ValueError("'*' would trust every client to name its own address (any client can write "
                                 "X-Forwarded-For); name the proxy's address, e.g. 127.0.0.1")
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or network; name the proxy's, "
                                 f"e.g. 127.0.0.1 or 10.0.0.0/24") from None
    return tuple(networks)


def ip_of(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as the networks compare it: an IPv4 client of an IPv6 socket as IPv4."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        return ip.ipv4_mapped
    return ip


def is_proxy(peer: str, proxies) -> bool:
    return bool(proxies) and any(ip_of(peer) in network for network in proxies)


def forwarded_client(peer: str, forwarded_for: list[str] | None, proxies) -> str:
    """The client's address: the peer's own, unless the peer is one of `proxies`; then the
    last address of its X-Forwarded-For headers (the peer's own if it sent none), or a 400.

    >>> proxies = trusted_proxies(["127.0.0.1"])
    >>> forwarded_client("127.0.0.1", ["203.0.113.9, 10.0.0.7"], proxies)  # the proxy appended 10.0.0.7
    '10.0.0.7'
    >>> forwarded_client("10.0.0.5", ["1.2.3.4"], proxies)  # not a proxy: its header says nothing
    '10.0.0.5'
    """
    if not forwarded_for or not is_proxy(peer, proxies):
        return peer
    last = ",".join(forwarded_for).rsplit(",", 1)[-1].strip()
    try:
        return str(ip_of(last))
    except ValueError:
        raise APIError(400, f"the X-Forwarded-For from the proxy at {peer} ends in {last!r}, not an IP address; "
                            f"the proxy must append its client's address alone (a proxy of --forwarded-allow-ips "
                            f"is trusted to say who its client is)") from None


@dataclass(frozen=True)
class Asker:
    """Who a request's head says is asking: what the connection caps count it as
    (serving.connections.Admission), read once the head is in and its key checked."""

    address: str  # the client's IP address (from a proxy of --forwarded-allow-ips: the one it forwarded)
    key: str | None = None  # the SHA-256 of its API key, where keys are in use (--api-keys, --salt-by-api-key)
    listed: bool = False  # its key is on --api-keys (or the admin's): handed out, so it stands for one person
    page: bool = False  # one of the live page's polls (GET /, /health, /cache, a static file)
    generation: bool = False  # a generation request (POST /generate, /v1/completions, /v1/chat/completions)

    @property
    def tenant(self) -> str:
        """Who asks, as fair share counts it: a key on the teacher's list (one person), else
        the address. A key nobody listed (--salt-by-api-key takes any) is free to make up,
        one per request, and a new tenant is served first: it counts as its address."""
        return self.key if self.listed else self.address


# -----------------------------------------------------------------------------
# 4. Reading a generation request
#
# The server checks what the engine cannot know: which fields a route takes, the server's
# max_tokens limit, where the cache_salt comes from, OpenAI's rules for stop. The engine
# checks the rest (types and ranges of max_tokens, temperature, top_p, seed, the prompt,
# whether it fits in the pool) and raises ValueError, which becomes a 400 unchanged.
# Nothing is ignored in silence: a field a route does not take is refused by name.


@dataclass(frozen=True)
class Route:
    path: str
    prompt_keys: tuple[str, ...]  # "prompt", "messages" or both
    fields: tuple[str, ...]  # every field it takes
    openai: bool  # OpenAI's defaults (temperature 1) and shapes; can stream

    @property
    def chat(self) -> bool:
        return self.prompt_keys == ("messages",)


SAMPLING = ("max_tokens", "temperature", "top_p", "seed", "stop", "cache_salt")
OPENAI = ("model", "stream", "stream_options", "user")  # user: an end-user id, changes no output
GENERATE = Route("/generate", ("prompt", "messages"), ("prompt", "messages", *SAMPLING, "stream"), openai=False)
COMPLETIONS = Route("/v1/completions", ("prompt",), ("prompt", *SAMPLING, *OPENAI), openai=True)
CHAT = Route("/v1/chat/completions", ("messages",), ("messages", *SAMPLING, "max_completion_tokens", *OPENAI),
             openai=True)

# OpenAI fields this server does not implement, taken only at a value that changes nothing.
NO_OP_VALUES = {
    "n": (1,), "best_of": (1,), "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "suffix": (),
    "tools": ([],), "functions": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
}
# SGLang's own fields, which SGLang's router (sglang-router 0.3.2) writes into every OpenAI body
# it forwards, at SGLang's defaults: each says what this server does anyway (a stop string is
# trimmed, EOS ends a reply, special tokens are left out of the text, no reasoning to separate).
NO_OP_VALUES |= {
    "no_stop_trim": (False,), "ignore_eos": (False,), "skip_special_tokens": (True,),
    "continue_final_message": (False,), "separate_reasoning": (True,), "stream_reasoning": (True,),
    "return_hidden_states": (False,),
}
# OpenAI's limit on the count: "Up to 4 sequences" (the openai client's completion_create_params.py).
MAX_STOP_STRINGS = 4
# This server's own choice (vLLM has none): a stop string is a marker ("\n\nQuestion:"), not a
# page, and every token's check looks at the reply's last characters up to a stop's length.
MAX_STOP_CHARS = 1000


@dataclass
class Settings:
    """What create_app was told; every request is read against it."""

    model_name: str
    salt_by_api_key: bool = False
    admin_key: str | None = None
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    bounds: PromptBounds = PromptBounds.of(DEFAULT_MAX_PROMPT_TOKENS, SMOLLM2_TOKEN_BYTES)  # create_app: the model's
    allowed_hosts: set[str] = field(default_factory=lambda: set(LOCAL_HOSTS))
    api_keys: frozenset[str] | None = None  # the keys a class may use; None: any key (or none)
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    max_waiting: int = DEFAULT_MAX_WAITING
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT


@dataclass
class GenerationRequest:
    prompt: str | list  # text, token ids or chat messages: whatever Engine.tokenize takes
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    cache_salt: str | None  # also the tenant the request counts for
    stop: str | list[str] | None = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


def parse_generation_request(body: dict, route: Route, settings: Settings,
                             headers: Mapping[str, str]) -> GenerationRequest:
    """The fields of a generation request, or an APIError naming the one that is wrong.
    The OpenAI routes follow OpenAI's defaults (temperature 1) and can stream; /generate is
    greedy by default and never streams.

    >>> parse_generation_request({"prompt": "Hi", "stop": "."}, GENERATE, Settings("m"), {})
    GenerationRequest(prompt='Hi', max_tokens=64, temperature=0.0, top_p=1.0, seed=None, cache_salt=None, stop='.', stream=False, include_usage=False)
    """
    prompt = take_prompt(body, route)
    check_prompt_size(prompt, settings.bounds, settings.max_prompt_tokens)  # before the costlier checks
    check_strings(body)
    stream = take_bool(body, "stream")
    if stream and not route.openai:
        raise APIError(400, f"{route.path} does not stream; use /v1/completions or /v1/chat/completions")
    check_fields(body, route)
    if route.openai and body.get("model") not in (None, settings.model_name):
        raise APIError(404, f"the model {body['model']!r} is not served here; this server serves {settings.model_name!r}")
    if not isinstance(body.get("user", ""), str):
        raise APIError(400, f"user must be a string (an id of your end user), got {body['user']!r}")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise APIError(400, "stream_options is for streams: send it with \"stream\": true, or leave it out")
    if not (options is None or isinstance(options, dict) and set(options) <= {"include_usage"}):
        raise APIError(400, f'stream_options must be an object such as {{"include_usage": true}}, got {options!r}')
    temperature = body.get("temperature")
    return GenerationRequest(
        prompt=prompt,
        max_tokens=take_max_tokens(body, settings.max_tokens_limit),
        temperature=(1.0 if route.openai else 0.0) if temperature is None else temperature,
        top_p=1.0 if body.get("top_p") is None else body["top_p"],
        seed=body.get("seed"),
        cache_salt=take_cache_salt(body, settings.salt_by_api_key, headers),
        stop=take_stop(body),
        stream=stream,
        include_usage=take_bool(options or {}, "include_usage"),
    )


def check_fields(body: dict, route: Route) -> None:
    """Refuse a field the route does not take, and an unimplemented OpenAI field set to
    anything but its no-op value ("n": 2 would promise two choices and get one)."""
    for key, value in body.items():
        if route.openai and key in NO_OP_VALUES:
            no_ops = (None, *NO_OP_VALUES[key])
            # == would let True pass for 1 and False for 0: a bool matches only a bool.
            if not any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in no_ops):
                allowed = " or ".join(json.dumps(ok) for ok in no_ops)
                raise APIError(400, f"this server does not implement {key!r} (got {json.dumps(value)[:40]}); "
                                    f"leave it out or send {allowed}")
        elif key not in route.fields:
            raise APIError(400, f"{route.path} does not take the field {key!r}; it takes {', '.join(route.fields)}")


def take_prompt(body: dict, route: Route) -> str | list:
    """The one of body["prompt"] / body["messages"] this route takes."""
    given = [key for key in ("prompt", "messages") if body.get(key) is not None]
    wrong = [key for key in given if key not in route.prompt_keys]
    if wrong:
        raise APIError(400, f'{route.path} takes {" or ".join(route.prompt_keys)}, not "{wrong[0]}"')
    if not given:
        examples = {"prompt": '{"prompt": "Hello"}', "messages": '{"messages": [{"role": "user", "content": "Hello"}]}'}
        raise APIError(400, f"the body has no prompt; send {' or '.join(examples[key] for key in route.prompt_keys)}")
    if len(given) > 1:
        raise APIError(400, 'send "prompt" (text) or "messages" (a chat), not both')
    prompt = body[given[0]]
    if given == ["messages"] and not (isinstance(prompt, list) and prompt):
        raise APIError(400, f'messages must be a non-empty list such as [{{"role": "user", "content": "Hello"}}], got {prompt!r:.40}')
    if given == ["prompt"] and isinstance(prompt, list) and not all(type(t) is int for t in prompt):
        raise APIError(400, "prompt must be a string or a list of token ids (ints); a chat goes in \"messages\"")
    return prompt


def take_max_tokens(body: dict, limit: int) -> int:
    """OpenAI's chat clients now send max_completion_tokens, older ones max_tokens: the one
    that is not null counts; both at once must agree."""
    given = {key: body[key] for key in ("max_completion_tokens", "max_tokens") if body.get(key) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise APIError(400, f"max_completion_tokens={given['max_completion_tokens']!r} and "
                            f"max_tokens={given['max_tokens']!r} disagree; send one of them")
    max_tokens = next(iter(given.values()), min(64, limit))
    if type(max_tokens) is int and max_tokens > limit:
        raise APIError(400, f"max_tokens={max_tokens} is over this server's limit of {limit}")
    return max_tokens  # its type and lower bound: the engine checks


def take_bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise APIError(400, f"{key} must be true or false, got {value!r}")
    return value


def take_stop(body: dict) -> str | list[str] | None:
    """OpenAI's stop: a string or a list of up to 4, each non-empty and at most MAX_STOP_CHARS
    characters; the reply ends before the first one it would contain."""
    stop = body.get("stop")
    if stop is None:
        return stop
    if not (isinstance(stop, str) and stop or isinstance(stop, list) and 1 <= len(stop) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and s for s in stop)):
        raise APIError(400, f'stop must be a non-empty string or a list of 1 to {MAX_STOP_STRINGS} of them, such as '
                            f'["\\n", "Question:"]; got {json.dumps(stop)[:60]}')
    longest = max([stop] if isinstance(stop, str) else stop, key=len)
    if len(longest) > MAX_STOP_CHARS:
        raise APIError(400, f"a stop string is {len(longest):,} characters, over this server's limit of "
                            f"{MAX_STOP_CHARS:,}; send a shorter marker, such as its first line")
    return stop


def take_cache_salt(body: dict, salt_by_api_key: bool, headers: Mapping[str, str]) -> str | None:
    if salt_by_api_key:
        if body.get("cache_salt") is not None:
            raise APIError(400, "this server derives cache_salt from your API key (--salt-by-api-key): leave it out")
        return tenant_of(headers, salt_by_api_key=True)
    try:
        return check_cache_salt(body.get("cache_salt"))  # vLLM's rules; "" is no salt
    except (TypeError, ValueError) as err:
        raise APIError(400, str(err))
