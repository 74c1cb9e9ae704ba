"""
Request logs: a deployment's traffic as it is kept on disk, read into prompts; and example
logs shaped like the workloads of the long vLLM article (README, Sources).

Read engine.py's tokenize_prompts first: a logged prompt is what the engine takes (a text,
chat messages, or token ids). The workload analyzer (workload_analyzer.py) tokenizes and
replays what this file reads.

    1. reading a log    read_log(path): JSONL or a JSON array (plain, .gz or .xz) of OpenAI
                        request bodies ("messages" or "prompt", an optional "cache_salt"; an
                        OpenAI batch file's lines, whose "body" holds one) or ShareGPT
                        conversations (one request per user turn, with the history before it)
                        interleave(requests, n): n conversations at a time, taking turns
    2. example logs     chatbot, multi-turn chat, RAG, code completion, batch summarisation,
                        random prompts, and a chatbot whose system prompt opens with a
                        timestamp: `python request_logs.py --out DIR` writes them

    >>> [r.prompt for r in requests_from_record({"prompt": ["Hi", "Hello"]}, "line 1")]
    ['Hi', 'Hello']
    >>> [len(r.prompt) for r in requests_from_record({"conversations": [
    ...     {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
    ...     {"from": "human", "value": "How are you?"}]}, "line 1")]   # one request per user turn
    [1, 3]
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import random
from dataclasses import dataclass
from pathlib import Path

from engine import check_prompt
from prefix_caching import check_cache_salt

# -----------------------------------------------------------------------------
# 1. Reading a log
#
# Two shapes are common. A gateway or proxy that logs what clients send keeps OpenAI request
# bodies, one JSON object a line. Public chat datasets (ShareGPT and the benchmarks built on
# it) keep whole conversations; a chat client sends the history again at every turn, so each
# user turn is one request whose prompt is every message before it and the turn itself.

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass
class LoggedRequest:
    prompt: str | list  # a text, chat messages or token ids: what Engine.tokenize takes
    cache_salt: str | None  # the request's tenant, when the log has one
    where: str  # its place in the log, for messages: "line 12", "line 12, turn 3"
    conversation: str | None = None  # the turns of one ShareGPT conversation share it


class LogError(ValueError):
    """A record the analyzer cannot read; the message says where and what to change."""


def open_log(path: Path):
    """The log as text, decompressing .gz and .xz files by their name."""
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(path.suffix, open)
    return opener(path, "rt", encoding="utf-8")


def read_log(path: str | Path) -> list[LoggedRequest]:
    """Every request of the log, in its order. Raises LogError naming the first bad record."""
    path = Path(path)
    if not path.is_file():
        raise LogError(f"{path}: no such file; give a JSONL log of OpenAI request bodies or ShareGPT conversations")
    try:
        with open_log(path) as f:
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError, lzma.LZMAError) as err:
        raise LogError(f"{path}: cannot read it as text ({err}); "
                       f"give JSONL, optionally compressed as .gz or .xz") from None
    if text.lstrip().startswith("["):  # one JSON array (how ShareGPT files are often shared)
        records = enumerate(parse_json(text, f"{path}"), start=1)
        unit = "record"
    else:
        records = ((n, parse_json(line, f"{path}, line {n}"))
                   for n, line in enumerate(text.splitlines(), 1) if line.strip())
        unit = "line"
    requests = []
    for number, record in records:
        requests.extend(requests_from_record(record, f"{path.name}, {unit} {number}"))
    if not requests:
        raise LogError(f"{path}: the log holds no request")
    return requests


def parse_json(text: str, where: str):
    try:
        return json.loads(text)
    except ValueError as err:
        raise LogError(f"{where}: not valid JSON ({err})") from None


def requests_from_record(record, where: str) -> list[LoggedRequest]:
    """The requests one record of a log stands for: one for an OpenAI body (several for a
    completions "prompt" that is a list of texts), one per user turn for a conversation."""
    if isinstance(record, dict) and isinstance(record.get("body"), dict):  # a line of an OpenAI batch file
        record = record["body"]
    if not isinstance(record, dict):
        raise LogError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    try:
        salt = check_cache_salt(record.get("cache_salt"))
    except (TypeError, ValueError) as err:
        raise LogError(f"{where}: {err}") from None
    if "messages" in record:
        prompts = [record["messages"]]
    elif "prompt" in record:
        prompt = record["prompt"]
        several = isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)
        prompts = list(prompt) if several else [prompt]
    elif "conversations" in record:
        turns = conversation_turns(record["conversations"], where)
        return [LoggedRequest(messages, salt, f"{where}, turn {turn}", where) for turn, messages in turns]
    else:
        raise LogError(f"{where}: no 'messages', 'prompt' or 'conversations'; each record is an OpenAI "
                       f"request body or a ShareGPT conversation")
    for prompt in prompts:
        check(prompt, where)
    return [LoggedRequest(prompt, salt, where) for prompt in prompts]


def conversation_turns(turns, where: str) -> list[tuple[int, list[dict]]]:
    """(turn number, messages) for each user turn of a ShareGPT conversation."""
    if not isinstance(turns, list):
        raise LogError(f"{where}: 'conversations' must be a list of {{\"from\", \"value\"}} turns")
    messages, requests = [], []
    for number, turn in enumerate(turns, start=1):
        role = SHAREGPT_ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
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


def interleave(requests: list[LoggedRequest], at_once: int) -> list[LoggedRequest]:
    """The log's conversations `at_once` at a time, taking turns: users who chat at the same
    time, whose next turn comes after the others' (a request outside a conversation is one
    of a single turn). A file of conversations lists each one's turns back to back, which
    no server sees: a pool must hold every live history between two of its turns.

    >>> log = [LoggedRequest("", None, w, conversation=w[0]) for w in ("a1", "a2", "b1", "b2", "c1")]
    >>> [r.where for r in interleave(log, 2)]
    ['a1', 'b1', 'a2', 'b2', 'c1']
    """
    conversations: dict[object, list[LoggedRequest]] = {}
    for i, request in enumerate(requests):
        conversations.setdefault(request.conversation or i, []).append(request)
    waiting = [iter(turns) for turns in conversations.values()][::-1]
    live, order = [], []
    while live or waiting:
        while waiting and len(live) < at_once:
            live.append(waiting.pop())
        for turns in list(live):
            request = next(turns, None)
            if request is None:
                live.remove(turns)
            else:
                order.append(request)
    return order


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


def rag(n: int = 50, num_documents: int = 80, seed: int = 0) -> list[dict]:
    """256 shared instruction tokens, then one retrieved document of about 2K tokens and a
    question. Each request retrieves any of `num_documents` alike: the fewer there are, the
    more often one comes back (the article does not say how many; 80 is ours)."""
    w = Writer(seed)
    instruction = "Answer from the document below only. " + w.words(250)
    documents = [w.words(w.rng.randint(1500, 2500)) for _ in range(num_documents)]
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


def write_log(path: Path, records: list[dict]) -> None:
    """JSONL, one record a line; compressed by the file's name (.gz, .xz) like read_log reads it.
    xz finds a document repeated far apart in the file, which gzip's 32 KiB window cannot."""
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(path.suffix, open)
    with opener(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="request_logs.py", description="Write the example request logs (seeded).")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "lessons" / "data",
                        help="folder for the logs (default: lessons/data)")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    for name, (make, _) in EXAMPLE_LOGS.items():
        write_log(out / name, make())
        print(f"wrote {out / name} ({(out / name).stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
