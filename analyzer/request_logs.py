"""
Request logs: a deployment's traffic as it is kept on disk, read into prompts; and example
logs shaped like the workloads of the long vLLM article (README, Sources).

Read engine/prompts.py first: a logged prompt is what the engine takes (a text, chat messages, or
token ids), checked by the same check_prompt. The workload analyzer (workload_analyzer.py)
tokenizes and replays what this file reads.

    1. reading a log    read_log(path), Log.read(path, max_bytes, skip_bad): JSONL or a JSON
                        array (plain, .gz, .xz or .bz2, read as it decompresses) of OpenAI
                        request bodies (every "messages" and "prompt" the chat and completions
                        APIs take, an optional "cache_salt"; an OpenAI batch file's lines,
                        whose "body" holds one) or ShareGPT conversations (one request per user
                        turn, with the history before it)
                        interleaved(requests, n): n conversations at a time, taking turns
    2. example logs     chatbot, multi-turn chat, RAG, code completion, batch summarisation,
                        random prompts, a chatbot whose system prompt opens with a
                        timestamp, and an agent that sends tools and calls them:
                        `python -m analyzer.request_logs --out DIR` writes them

    >>> [r.prompt for r in requests_from_record({"prompt": ["Hi", "Hello"]}, "line 1")]
    ['Hi', 'Hello']
    >>> [len(r.prompt) for r in requests_from_record({"conversations": [
    ...     {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
    ...     {"from": "human", "value": "How are you?"}]}, "line 1")]   # one request per user turn
    [1, 3]
"""

from __future__ import annotations

import argparse
import bz2
import codecs
import gzip
import itertools
import json
import lzma
import random
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from allocator import check_cache_salt
from engine.prompts import check_prompt

# -----------------------------------------------------------------------------
# 1. Reading a log
#
# Two shapes are common. A gateway or proxy that logs what clients send keeps OpenAI request
# bodies, one JSON object a line. Public chat datasets (ShareGPT and the benchmarks built on
# it) keep whole conversations; a chat client sends the history again at every turn, so each
# user turn is one request whose prompt is every message before it and the turn itself.
#
# A log can be far larger than its file (a 156 KB .xz file can hold 1 GiB of repeated text),
# so it is read as it decompresses, a record at a time, and refused past max_bytes.

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
DEFAULT_MAX_LOG_BYTES = 2 * 1024**3  # decompressed; --max-log-bytes
CHUNK_BYTES = 1 << 20  # read at a time
MAX_TOKEN_ID = 2**32 - 1  # the analyzer keeps token ids in 4-byte arrays; every vocabulary fits
# The content parts that hold text, and the key of their text: "text" in any message,
# "refusal" in an assistant's (OpenAI's chat API). Other parts (image_url, input_audio, file)
# are counted and left out: a multimodal model's server puts tokens of its own in their place,
# which a log of text cannot tell.
TEXT_PARTS = {"text": "text", "refusal": "refusal"}
# A message's text parts are joined with a newline, as vLLM joins them for a chat template that
# takes its content as one string, as most do (--like vllm: vllm_requests.py follows vLLM's rules).
PART_SEPARATOR = "\n"
COMPRESSED = {b"\x1f\x8b": gzip.open, b"\xfd7zXZ\x00": lzma.open, b"BZh": bz2.open}  # known by their first bytes
ZSTD = b"\x28\xb5\x2f\xfd"
NON_SPACE = re.compile(r"\S")
EXAMPLES = 3  # bad records quoted when they are skipped


@dataclass
class LoggedRequest:
    prompt: str | list  # a text, chat messages or token ids: what Engine.tokenize takes
    cache_salt: str | None  # the request's tenant, when the log has one
    where: str  # its place in the log, for messages: "line 12", "line 12, turn 3"
    conversation: str | None = None  # the turns of one ShareGPT conversation share it
    tools: list[dict] | None = None  # a chat request's "tools", as the chat template is handed them
    body: dict | None = None  # a chat's "messages" (and "tools") as sent, for vLLM's rewrites (vllm_requests.py)


class LogError(ValueError):
    """A record the analyzer cannot read; the message says where and what to change."""


@dataclass
class Log:
    """A log's requests, and what reading it left out."""

    requests: list[LoggedRequest]
    bad_records: int = 0  # skip_bad: records left out
    bad_examples: list[str] = field(default_factory=list)  # the errors of the first EXAMPLES of them
    skipped_parts: Counter = field(default_factory=Counter)  # content parts that are not text, by type

    @classmethod
    def read(cls, path: str | Path, max_bytes: int = DEFAULT_MAX_LOG_BYTES, skip_bad: bool = False) -> Log:
        """Every request of the log, in its order, kept in memory (see stream)."""
        log = cls([])
        log.requests.extend(log.stream(path, max_bytes, skip_bad))
        return log

    def stream(self, path: str | Path, max_bytes: int = DEFAULT_MAX_LOG_BYTES, skip_bad: bool = False,
               progress: Callable[[int, int], None] | None = None) -> Iterator[LoggedRequest]:
        """The log's requests one at a time, in its order, as the file is read: nothing of a
        request is kept here once it is handed on. A bad record raises LogError naming its
        line; with skip_bad it is left out and its error kept in bad_records. Refused either
        way: a log larger than max_bytes decompressed, a damaged archive, and a JSON array
        whose syntax breaks (nothing says where its next element starts).
        `progress(bytes of the file read, its size)` is called as the file is read."""
        path = Path(path)
        if not path.is_file():
            raise LogError(f"{path}: no such file; give a JSONL log of OpenAI request bodies or ShareGPT conversations")
        handed = 0
        for where, record in records(path, max_bytes, progress):
            parts = Counter()  # counted only if the record is read
            try:
                if isinstance(record, LogError):
                    raise record
                requests = requests_from_record(record, where, parts)
            except LogError as err:
                if not skip_bad:
                    raise
                self.bad_records += 1
                if len(self.bad_examples) < EXAMPLES:
                    self.bad_examples.append(str(err))
                continue
            self.skipped_parts.update(parts)
            handed += len(requests)
            yield from requests
        if not handed:
            skipped = f" ({self.bad_records:,} bad records skipped)" if self.bad_records else ""
            raise LogError(f"{path}: the log holds no request{skipped}")

    def notes(self) -> list[str]:
        """What the analysis of this log leaves out, in words."""
        notes = []
        if self.bad_records:
            more = " …" if self.bad_records > len(self.bad_examples) else ""
            notes.append(f"{self.bad_records:,} bad records skipped (--skip-bad), not replayed: "
                         f"{'; '.join(self.bad_examples)}{more}")
        if self.skipped_parts:
            kinds = ", ".join(f"{n:,} {kind}" for kind, n in self.skipped_parts.most_common())
            notes.append(f"{self.skipped_parts.total():,} content parts that are not text skipped ({kinds}): only "
                         f"their messages' text is replayed; a multimodal server puts tokens of its own there")
        return notes


def read_log(path: str | Path) -> list[LoggedRequest]:
    """Every request of the log, in its order. Raises LogError naming the first bad record."""
    return Log.read(path).requests


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a command that reads a log: the log, and how to read it."""
    parser.add_argument("log", type=Path, help="JSONL or a JSON array (plain, .gz, .xz or .bz2) of OpenAI request "
                        "bodies (chat messages, content parts and tool calls included, or completion prompts) or "
                        "ShareGPT conversations")
    parser.add_argument("--max-log-bytes", type=byte_count, default=DEFAULT_MAX_LOG_BYTES, metavar="SIZE",
                        help="refuse a log larger than this, decompressed, such as 500MiB or 8GiB (default: 2GiB)")
    parser.add_argument("--skip-bad", action="store_true",
                        help="leave out a record that cannot be read, count it and say why (default: stop there)")


def byte_count(text: str) -> int:
    """A size in bytes, in KiB, MiB or GiB.

    >>> byte_count("2GiB"), byte_count("500MiB"), byte_count("4096")
    (2147483648, 524288000, 4096)
    """
    match = re.fullmatch(r"\s*(\d+)\s*(KiB|MiB|GiB)?\s*", text)
    if not match or int(match[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give bytes, or KiB, MiB or GiB, such as 2GiB")
    return int(match[1]) * {None: 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}[match[2]]


# --- The file: its bytes as they decompress, then one record at a time


def decompressed(path: Path, max_bytes: int, progress: Callable[[int, int], None] | None = None) -> Iterator[bytes]:
    """The log's bytes, CHUNK_BYTES at a time, decompressed as its first bytes say (gzip, xz,
    bzip2, or none); LogError past max_bytes, or when the file is cut short or damaged.
    `progress(bytes of the file read, its size)` after each chunk."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(ZSTD):
        raise LogError(f"{path}: zstd is not read here; decompress it (zstd -d) or compress it with xz or gzip")
    opener = next((opener for magic, opener in COMPRESSED.items() if head.startswith(magic)), None)
    total, size = 0, path.stat().st_size
    with open(path, "rb") as raw, (opener(raw, "rb") if opener else raw) as f:  # raw.tell(): how far the file is read
        while True:
            try:
                chunk = f.read(CHUNK_BYTES)
            except (OSError, EOFError, lzma.LZMAError, zlib.error) as err:
                raise LogError(f"{path}: cannot decompress it past byte {total:,} ({err or 'the file is cut short'}); "
                               f"give a whole .gz, .xz or .bz2 file, or plain text") from None
            if not chunk:
                return
            total += len(chunk)
            if total > max_bytes:
                raise LogError(f"{path}: more than {max_bytes:,} bytes decompressed, the limit of --max-log-bytes; "
                               f"raise it, or split the log")
            if progress is not None:
                progress(raw.tell(), size)
            yield chunk


def records(path: Path, max_bytes: int, progress: Callable[[int, int], None] | None = None
            ) -> Iterator[tuple[str, object]]:
    """(where, record) for each record of the log: the elements of one JSON array, or else
    one per line. A line that is not UTF-8 or not JSON comes as the LogError that says so,
    in its place, so that a caller may skip it and go on."""
    chunks = decompressed(path, max_bytes, progress)
    first = next(chunks, b"").removeprefix(codecs.BOM_UTF8)  # Windows tools open UTF-8 text with one
    chunks = prepend(first, chunks)
    if first.lstrip().startswith(b"["):  # one JSON array (how ShareGPT files are often shared)
        for number, record in enumerate(JSONArray(chunks, path.name), start=1):
            yield f"{path.name}, record {number}", record
        return
    for number, raw in lines(chunks):
        where = f"{path.name}, line {number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            yield where, LogError(f"{where}: not UTF-8 at byte {err.start + 1:,} of the line "
                                  f"({raw[err.start:err.start + 4]!r}); save the log as UTF-8")
            continue
        if text.strip():
            yield where, parse_json(text, where)


def prepend(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def lines(chunks: Iterator[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number, its bytes) as the chunks arrive: one line in memory at a time.

    >>> list(lines(iter([b'{"a"', b': 1}\\n{"b": 2}\\n', b"{}"])))
    [(1, b'{"a": 1}'), (2, b'{"b": 2}'), (3, b'{}')]
    """
    number, pieces = 0, []  # the pieces of a line that spans chunks, joined once
    for chunk in chunks:
        *ended, rest = chunk.split(b"\n")
        for line in ended:
            number += 1
            yield number, b"".join(pieces) + line
            pieces = []
        pieces.append(rest)
    if any(pieces):
        yield number + 1, b"".join(pieces)


def parse_json(text: str, where: str):
    """The record a line holds, or the LogError that says why not."""
    try:
        return json.loads(text)
    except ValueError as err:
        return LogError(f"{where}: not valid JSON ({err})")
    except RecursionError:
        return LogError(f"{where}: JSON nested too deep to be a request")


class JSONArray:
    """The elements of one JSON array, parsed as its text arrives: a ShareGPT file of a few
    GB is never in memory whole. When the text read so far ends inside an element, it is
    parsed again with twice as much text, so a large element costs a few passes, not many.
    An element that is not JSON ends the log (nothing says where the next one starts).

    >>> list(JSONArray(iter([b'[{"a": 1}, 2', b'3, "x"]']), "log.json"))
    [{'a': 1}, 23, 'x']
    """

    def __init__(self, chunks: Iterator[bytes], name: str) -> None:
        self.chunks, self.name = chunks, name
        self.decoder, self.utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
        self.text, self.at, self.line = "", 0, 1  # what is not parsed yet starts at `at`, on line `line`
        self.ended = False

    def line_at(self, position: int) -> int:
        return self.line + self.text.count("\n", 0, position)

    def read_more(self, least: int) -> None:
        """Drop the text parsed, then read at least `least` more characters (fewer at the end)."""
        self.line, self.text, self.at = self.line_at(self.at), self.text[self.at:], 0
        wanted = len(self.text) + least
        while len(self.text) < wanted and not self.ended:
            chunk = next(self.chunks, None)
            self.ended = chunk is None
            try:
                self.text += self.utf8.decode(chunk or b"", final=self.ended)
            except UnicodeDecodeError as err:
                line = self.line_at(len(self.text)) + chunk[:err.start].count(b"\n")
                raise LogError(f"{self.name}, line {line:,}: not UTF-8 ({chunk[err.start:err.start + 4]!r}); "
                               f"save the log as UTF-8") from None

    def peek(self) -> str:
        """The next character that is not white space, left in place ("" at the end)."""
        while True:
            found = NON_SPACE.search(self.text, self.at)
            if found:
                self.at = found.start()
                return found[0]
            if self.ended:
                return ""
            self.read_more(CHUNK_BYTES)

    def element(self):
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.text, self.at)
                if end < len(self.text) or self.ended:  # a number at the end of the text may go on
                    self.at = end
                    return value
            except json.JSONDecodeError as err:
                if self.ended:
                    raise LogError(f"{self.name}, line {self.line_at(err.pos):,}: not valid JSON ({err.msg})") from None
            except RecursionError:
                raise LogError(f"{self.name}, line {self.line_at(self.at):,}: JSON nested too deep") from None
            self.read_more(max(CHUNK_BYTES, len(self.text) - self.at))

    def __iter__(self) -> Iterator:
        self.peek()
        self.at += 1  # the '[' records() saw
        if self.peek() == "]":
            self.at += 1
        else:
            while True:
                yield self.element()
                separator = self.peek()
                self.at += 1
                if separator == "]":
                    break
                if separator != ",":
                    got = separator or "the end of the file"
                    raise LogError(f"{self.name}, line {self.line_at(self.at - 1):,}: the elements of an array are "
                                   f"separated by ',' and it closes with ']', not {got!r}")
        if self.peek():
            raise LogError(f"{self.name}, line {self.line_at(self.at):,}: text after the array's closing ']'")


# --- Records: what one request body, or one conversation, stands for


def requests_from_record(record, where: str, skipped_parts: Counter | None = None) -> list[LoggedRequest]:
    """The requests one record of a log stands for: one for an OpenAI body (several for a
    completions "prompt" that is a list of prompts), one per user turn for a conversation.
    Content parts that are not text are counted in skipped_parts."""
    if isinstance(record, dict) and isinstance(record.get("body"), dict):  # a line of an OpenAI batch file
        record = record["body"]
    if not isinstance(record, dict):
        raise LogError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    try:
        salt = check_cache_salt(record.get("cache_salt"))
    except (TypeError, ValueError) as err:
        raise LogError(f"{where}: {err}") from None
    tools = None
    if "messages" in record:
        prompts = [chat_messages(record["messages"], where, Counter() if skipped_parts is None else skipped_parts)]
        tools = template_tools(record.get("tools"), where)
    elif "prompt" in record:
        prompts = completion_prompts(record["prompt"], where)
    elif "conversations" in record:
        turns = conversation_turns(record["conversations"], where)
        return [LoggedRequest(messages, salt, f"{where}, turn {turn}", where, body={"messages": messages})
                for turn, messages in turns]
    else:
        raise LogError(f"{where}: no 'messages', 'prompt' or 'conversations'; each record is an OpenAI "
                       f"request body or a ShareGPT conversation")
    for prompt in prompts:
        check(prompt, where)
    body = record if "messages" in record else None
    return [LoggedRequest(prompt, salt, where, tools=tools, body=body) for prompt in prompts]


def template_tools(tools, where: str) -> list[dict] | None:
    """A chat request's tools as the chat template is handed them: each function's name,
    description and parameters, None when the request left them out, as vLLM's request model
    dumps a tool but without its `strict` and `defer_loading` (which --like vllm keeps:
    vllm_requests.vllm_tools). No tools, or an empty list: None.

    >>> template_tools([{"type": "function", "function": {"name": "now"}}], "line 1")
    [{'type': 'function', 'function': {'name': 'now', 'description': None, 'parameters': None}}]
    """
    if tools is None or tools == []:
        return None
    if not (isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise LogError(f'{where}: "tools" is a list of {{"type": "function", "function": {{"name", "description", '
                       f'"parameters"}}}}, got {tools!r:.60}')
    return [{"type": tool.get("type", "function"),
             "function": {"name": tool["function"]["name"], "description": tool["function"].get("description"),
                          "parameters": tool["function"].get("parameters")}} for tool in tools]


def chat_messages(messages, where: str, skipped_parts: Counter) -> list[dict]:
    """OpenAI chat messages as the chat template is handed them (--like vllm rewrites them
    further, as vLLM's server does: vllm_requests.py): the content one string
    (its text parts joined, null as ""), an assistant's tool_calls with their arguments
    parsed, a tool message's tool_call_id and a message's name kept. prompts.check_prompt
    checks the roles, the same check the server makes.

    >>> skipped = Counter()
    >>> chat_messages([{"role": "user", "content": [{"type": "text", "text": "Hi"},
    ...     {"type": "image_url", "image_url": {"url": "cat.png"}}, {"type": "text", "text": "What is it?"}]}],
    ...     "line 1", skipped), skipped
    ([{'role': 'user', 'content': 'Hi\\nWhat is it?'}], Counter({'image_url': 1}))
    """
    if not isinstance(messages, list) or not messages:
        raise LogError(f'{where}: "messages" is a non-empty list such as [{{"role": "user", "content": "Hi"}}], '
                       f"got {messages!r:.60}")
    rendered = []
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            raise LogError(f'{where}: messages[{i}] is an object with a "role", got {message!r:.60}')
        one = {"role": message["role"], "content": message_text(message.get("content"), f"{where}, messages[{i}]",
                                                               skipped_parts)}
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                one[key] = message[key]
        if message["role"] == "assistant" and message.get("tool_calls"):  # vLLM drops an empty list
            one["tool_calls"] = template_tool_calls(message["tool_calls"], f"{where}, messages[{i}]")
        rendered.append(one)
    return rendered


def message_text(content, where: str, skipped_parts: Counter) -> str:
    """A message's content as one string: its text parts joined, other parts counted."""
    if content is None:  # an assistant's turn that only calls tools
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise LogError(f"{where}: content is a string, a list of content parts or null, got {content!r:.60}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise LogError(f'{where}: a content part is an object with a "type", such as '
                           f'{{"type": "text", "text": "Hi"}}, got {part!r:.60}')
        if kind not in TEXT_PARTS:
            skipped_parts[kind] += 1
            continue
        text = part.get(TEXT_PARTS[kind])
        if not isinstance(text, str):
            raise LogError(f'{where}: a "{kind}" part holds its text in "{TEXT_PARTS[kind]}", got {part!r:.60}')
        texts.append(text)
    return PART_SEPARATOR.join(texts)


def template_tool_calls(calls, where: str) -> list[dict]:
    """An assistant's tool_calls as chat templates take them: each function's arguments as
    an object, where OpenAI sends a JSON string (as vLLM's _postprocess_messages parses it)."""
    if not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                            for c in calls)):
        raise LogError(f'{where}: tool_calls is a list of {{"id", "type": "function", "function": {{"name", '
                       f'"arguments"}}}}, got {calls!r:.60}')
    parsed = []
    for call in calls:
        function = dict(call["function"])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # not JSON: the template gets the text as it was sent
        parsed.append({**call, "function": function})
    return parsed


def completion_prompts(prompt, where: str) -> list:
    """The prompts of a completions request: a text, token ids, or a list of either (a
    request each).

    >>> completion_prompts("Hi", "line 1"), completion_prompts([[1, 2], [3]], "line 1")
    (['Hi'], [[1, 2], [3]])
    """
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) for p in prompt):
            return [token_ids(p, where) for p in prompt]
        if not any(isinstance(p, (str, list, dict)) for p in prompt):
            return [token_ids(prompt, where)]
    raise LogError(f'{where}: "prompt" is a text, token ids, or a list of texts or of token id lists, '
                   f"got {prompt!r:.60}")


def token_ids(ids: list, where: str) -> list[int]:
    bad = [t for t in ids if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID]
    if bad or not ids:
        raise LogError(f"{where}: token ids are integers from 0 to {MAX_TOKEN_ID:,} (2^32 - 1), got "
                       f"{bad[:3] if bad else 'none'}")
    return ids


def conversation_turns(turns, where: str) -> list[tuple[int, list[dict]]]:
    """(turn number, messages) for each user turn of a ShareGPT conversation."""
    if not isinstance(turns, list):
        raise LogError(f"{where}: 'conversations' must be a list of {{\"from\", \"value\"}} turns")
    messages, requests = [], []
    for number, turn in enumerate(turns, start=1):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise LogError(f"{where}, turn {number}: a turn is {{\"from\": one of {', '.join(SHAREGPT_ROLES)}, "
                           f"\"value\": text}}, got {turn!r:.80}")
        messages.append({"role": role, "content": turn.get("value")})
        if role == "user":
            check(messages, f"{where}, turn {number}")
            requests.append((number, list(messages)))
    if not requests:
        raise LogError(f"{where}: the conversation has no human turn, so no request")
    return requests


def check(prompt, where: str) -> None:
    try:
        check_prompt(prompt)
    except ValueError as err:
        raise LogError(f"{where}: {err}") from None


def interleave(requests: Iterable[LoggedRequest], at_once: int) -> list[LoggedRequest]:
    """interleaved(requests, at_once) as a list."""
    return list(interleaved(requests, at_once))


def interleaved(requests: Iterable[LoggedRequest], at_once: int) -> Iterator[LoggedRequest]:
    """The log's conversations `at_once` at a time, taking turns: users who chat at the same
    time, whose next turn comes after the others' (a request outside a conversation is one
    of a single turn). A file of conversations lists each one's turns back to back, which
    no server sees: a pool must hold every live history between two of its turns. Read as
    the log streams: only the live conversations are held (a conversation is the run of
    requests that name it, as the reader hands them).

    >>> log = [LoggedRequest("", None, w, conversation=w[0]) for w in ("a1", "a2", "b1", "b2", "c1")]
    >>> [r.where for r in interleaved(log, 2)]
    ['a1', 'b1', 'a2', 'b2', 'c1']
    """
    runs = itertools.groupby(enumerate(requests), key=lambda pair: pair[1].conversation or pair[0])
    waiting = ([request for _, request in run] for _, run in runs)
    live: list[Iterator[LoggedRequest]] = []
    while True:
        while len(live) < at_once:
            turns = next(waiting, None)
            if turns is None:
                break
            live.append(iter(turns))
        if not live:
            return
        for turns in list(live):
            request = next(turns, None)
            if request is None:
                live.remove(turns)
            else:
                yield request


# -----------------------------------------------------------------------------
# 2. Example logs, shaped like the article's workloads
#
# The article gives each workload's shared prefix (a 512-token system prompt; 1,024 to 4,096
# tokens of history; 256 shared tokens before 2K unique ones; ...). These logs have those
# shapes in plain English words (about one SmolLM2 token each), with real OpenAI bodies or
# ShareGPT conversations, and are small enough to keep in the repository. Seeded: the same
# files every time.

WORDS = (
    "the a of to and in is it that for on with as at by from this be are was can will not or but all one so if "
    "no more time data model block cache token request prompt user system answer query server memory layer batch "
    "step queue pool hash page table key result file line code test function return list read write send reply "
    "text word note order count rate size small large fast slow new old first last next each every many few long "
    "short high low good bad part share reuse keep drop find miss hit load run serve train learn make take give "
    "show tell ask help work use need want like know think look come go say see get put set start stop open close "
    "move turn call build check plan price report review summary document section chapter customer product account "
    "invoice payment city river mountain garden kitchen window music story color light water stone paper letter "
    "number question reason example method process policy"
).split()
_WEIGHTS = [1 / (rank + 1) ** 0.7 for rank in range(len(WORDS))]  # a few words common, most rare, as in text


class Writer:
    """Seeded text: `words(n)` gives n words, about n SmolLM2 tokens."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def words(self, n: int) -> str:
        return " ".join(self.rng.choices(WORDS, _WEIGHTS, k=n))

    def sentence(self, low: int, high: int) -> str:
        return self.words(self.rng.randint(low, high)).capitalize() + "?"


def chat(system: str, question: str) -> dict:
    return {"model": "any", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def chatbot(n: int = 300, seed: int = 0) -> list[dict]:
    """One fixed system prompt of about 512 tokens, then a short question: every request."""
    w = Writer(seed)
    system = "You are the support assistant of a shop. " + w.words(500)
    return [chat(system, w.sentence(8, 40)) for _ in range(n)]


def chatbot_with_timestamp(n: int = 150, seed: int = 0) -> list[dict]:
    """The chatbot's system prompt, opened by the time and a session id: a common mistake."""
    w = Writer(seed)
    system = "You are the support assistant of a shop. " + w.words(500)
    requests = []
    for i in range(n):
        stamp = f"Current time: 2026-11-25 09:{i // 60 % 60:02d}:{i % 60:02d}. Session {w.rng.getrandbits(32):08x}.\n"
        requests.append(chat(stamp + system, w.sentence(8, 40)))
    return requests


def multi_turn(n: int = 40, seed: int = 0) -> list[dict]:
    """ShareGPT conversations of 4 to 10 turns behind a 200-token system prompt: each turn
    sends the history again, 1,000 to 4,000 tokens of it by the last turns."""
    w = Writer(seed)
    system = "You are a patient tutor. " + w.words(200)
    conversations = []
    for _ in range(n):
        turns = [{"from": "system", "value": system}]
        for _ in range(w.rng.randint(2, 5)):
            turns.append({"from": "human", "value": w.sentence(20, 120)})
            turns.append({"from": "gpt", "value": w.words(w.rng.randint(150, 500)) + "."})
        conversations.append({"conversations": turns})
    return conversations


def rag(n: int = 50, num_documents: int = 80, seed: int = 0, words: tuple[int, int] = (1500, 2500)) -> list[dict]:
    """256 shared instruction tokens, then one retrieved document (of 1,500 to 2,500 `words`,
    about 2K tokens) and a question. Each request retrieves any of `num_documents` alike: the
    fewer there are, the more often one comes back (the article does not say how many; 80 is ours)."""
    w = Writer(seed)
    instruction = "Answer from the document below only. " + w.words(250)
    documents = [w.words(w.rng.randint(*words)) for _ in range(num_documents)]
    requests = []
    for _ in range(n):
        document = w.rng.choice(documents)
        prompt = f"{instruction}\nDocument: {document}\nQuestion: {w.sentence(8, 30)}\nAnswer:"
        requests.append({"model": "any", "prompt": prompt})
    return requests


def code_completion(n: int = 60, num_files: int = 50, seed: int = 0) -> list[dict]:
    """A file's text up to the cursor (500 to 4,000 tokens): requests on the same file share
    the part before the earlier cursor (the number of files is ours)."""
    w = Writer(seed)
    files = []
    for number in range(num_files):
        lines = [f"def {w.rng.choice(WORDS)}_{i}(x):\n    return {w.words(w.rng.randint(4, 12)).replace(' ', '_')}(x)\n"
                 for i in range(w.rng.randint(40, 260))]
        files.append((f"src/module_{number}.py", lines))
    requests = []
    for _ in range(n):
        path, lines = w.rng.choice(files)
        cursor = w.rng.randint(len(lines) // 10, len(lines))
        requests.append({"model": "any", "prompt": f"# {path}\n" + "".join(lines[:cursor]), "max_tokens": 32})
    return requests


def batch_summaries(n: int = 80, seed: int = 0) -> list[dict]:
    """A 64-token instruction, then a document nobody else sends (300 to 900 tokens)."""
    w = Writer(seed)
    instruction = "Summarise the report below in three sentences for a busy reader. " + w.words(52)
    return [{"model": "any", "prompt": f"{instruction}\nReport: {w.words(w.rng.randint(300, 900))}\nSummary:"}
            for _ in range(n)]


def random_prompts(n: int = 80, seed: int = 0) -> list[dict]:
    """Nothing shared: every prompt is new words (100 to 600 tokens)."""
    w = Writer(seed)
    return [{"model": "any", "prompt": w.words(w.rng.randint(100, 600))} for _ in range(n)]


def agent(n: int = 6, at_once: int = 3, seed: int = 0) -> list[dict]:
    """Agents at work: each session a system prompt of about 600 tokens with its tools, a
    task, then 8 to 14 steps of an action and its output (80 to 200 tokens), every step
    sending the whole history again (up to about 3,500 tokens). Sessions run `at_once` at a
    time, their steps in turn, in the order a server would get them; each session is its
    own tenant (cache_salt), as a platform running several customers' agents gives them."""
    w = Writer(seed)
    system = "You are an agent that works in a repository with tools: read_file, run_tests, edit. " + w.words(600)
    sessions = []
    for number in range(n):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Task: " + w.sentence(20, 40)}]
        steps = []
        for _ in range(w.rng.randint(8, 14)):
            steps.append({"model": "any", "messages": list(messages), "cache_salt": f"customer-{number}"})
            messages += [{"role": "assistant", "content": f"Action: {w.rng.choice(['read_file', 'run_tests', 'edit'])}"
                                                          f"({w.words(w.rng.randint(3, 8))})"},
                         {"role": "user", "content": "Output: " + w.words(w.rng.randint(80, 200))}]
        sessions.append(steps)
    waiting, live, records = sessions[::-1], [], []
    while live or waiting:  # interleave()'s turn taking, on request bodies
        while waiting and len(live) < at_once:
            live.append(iter(waiting.pop()))
        for steps in list(live):
            step = next(steps, None)
            if step is None:
                live.remove(steps)
            else:
                records.append(step)
    return records


TOOL_NAMES = ("search_orders", "get_customer", "refund_payment", "track_parcel", "update_address", "list_products",
              "check_stock", "open_ticket", "send_email")


def agent_with_tools(n: int = 252, seed: int = 0) -> list[dict]:
    """An agent's chat requests (OpenAI bodies): one system prompt and the same 9 tools in
    every request, a task, then rounds of the assistant calling a tool (no text, or a line
    of it) and the tool's answer, each round one more request that sends the whole history
    back. The tools' definitions are longer than the system prompt: a template without a
    tool block leaves most of what a tool-aware server computes out."""
    w = Writer(seed)
    system = "You are the operations agent of a shop. Use the tools to act; answer briefly. " + w.words(120)
    tools = [{"type": "function", "function": {
        "name": name, "description": w.sentence(15, 30),
        "parameters": {"type": "object", "properties": {
            field: {"type": kind, "description": w.sentence(4, 10)}
            for field, kind in (("id", "string"), ("limit", "integer"), ("note", "string"))[: w.rng.randint(1, 3)]},
            "required": ["id"]}}} for name in TOOL_NAMES]
    requests: list[dict] = []
    session = 0
    while len(requests) < n:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": w.sentence(10, 40)}]
        requests.append({"model": "any", "messages": list(messages), "tools": tools})
        for step in range(w.rng.randint(2, 5)):
            call_id = f"call_{session}_{step}"
            tool = w.rng.choice(tools)["function"]
            arguments = {"id": f"{w.rng.choice(WORDS)}-{w.rng.randint(100, 999)}", "limit": w.rng.randint(1, 20)}
            messages.append({"role": "assistant", "content": None if w.rng.random() < 0.7 else w.sentence(4, 12),
                             "tool_calls": [{"id": call_id, "type": "function",
                                             "function": {"name": tool["name"], "arguments": json.dumps(arguments)}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": w.words(w.rng.randint(30, 150))})
            requests.append({"model": "any", "messages": list(messages), "tools": tools})
        session += 1
    return requests[:n]


# The file name of each example log, its maker, and the article's hit rate for its workload.
EXAMPLE_LOGS = {
    "chatbot.jsonl.xz": (chatbot, "92-97%"),
    "multi_turn.jsonl.xz": (multi_turn, "80-95%"),
    "rag.jsonl.xz": (rag, "25-40%"),
    "code_completion.jsonl.xz": (code_completion, "15-35%"),
    "batch_summaries.jsonl.xz": (batch_summaries, "8-15%"),
    "random_prompts.jsonl.xz": (random_prompts, "0-2%"),
    "chatbot_with_timestamp.jsonl.xz": (chatbot_with_timestamp, "(not in the article)"),
}
OTHER_LOGS = {"agent_with_tools.jsonl.xz": agent_with_tools}  # workloads the article's table has no row for


def write_log(path: Path, records: list[dict]) -> None:
    """JSONL, one record a line; compressed by the file's name (.gz, .xz, .bz2), which read_log reads.
    xz finds a document repeated far apart in the file, which gzip's 32 KiB window cannot."""
    opener = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}.get(path.suffix, open)
    with opener(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m analyzer.request_logs", description="Write the example request logs (seeded).")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "lessons" / "data",
                        help="folder for the logs (default: lessons/data)")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    makers = {name: make for name, (make, _) in EXAMPLE_LOGS.items()} | OTHER_LOGS
    for name, make in makers.items():
        write_log(out / name, make())
        print(f"wrote {out / name} ({(out / name).stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
