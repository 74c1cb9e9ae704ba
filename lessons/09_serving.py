"""
Stage 9: serving. Cached tokens over HTTP, tenants, and the timing side channel.

server.py puts the Engine behind HTTP: /generate for curl, and OpenAI's
/v1/chat/completions and /v1/completions, whose replies report the prefix cache where
OpenAI does, in usage.prompt_tokens_details.cached_tokens. `python server.py` runs the
Engine, whose requests run in stage 8's engine loop: every client's request joins the same
steps. This stage starts that server inside the process, on the same engine and a free port
of 127.0.0.1, and talks to it with plain HTTP.

A cache shared by everyone leaks. A request that finds its prefix in the pool is answered
sooner (and says cached_tokens > 0), so anyone can test whether *somebody else* has sent a
given text: send it and time the reply. The fix is the cache_salt of stage 4: hashed into
the first block, it keeps each tenant's blocks apart. A client can send one, or the server
can derive it from each API key (python server.py --salt-by-api-key), which a client
cannot forget or forge.

New in this stage (marked # NEW): create_app, requests over HTTP, per-key salts, a class
sharing the server (a question behind a long prompt; a key's own share on /health).

Read: serving/routes.py: generate and chat_completions, the routes of /generate and
      /v1/chat/completions; serving/requests.py: take_cache_salt and tenant_of, where a
      request's cache_salt comes from (printed when the stage starts).

Run:  python lessons/09_serving.py            (SmolLM2-135M; run times: lessons/README.md)
      python lessons/09_serving.py --tiny     (a random 2-layer model, faster)
"""

import json
import logging
import statistics
import threading
import time
import urllib.error
import urllib.request

from rich.console import Console
from rich.rule import Rule
from rich.table import Table

from commands.demo import DEMO_QUESTIONS, DEMO_SYSTEM_PROMPT
from lessons import models
from lessons.reading import show_code
from server import chat_completions, create_app, generate, serve_in_background
from serving.requests import JSON_HEADER, take_cache_salt, tenant_of

# The victim's secret is who sends the letter; the rest is the company's template, which
# everybody there (the attacker included) knows.
LETTER = """\
Please make this letter sound warm but firm.

From: {name}, logistics planning

Dear Ms. Okafor,

I am writing to tell you that I am resigning from my position at Harbourline Freight. My last \
working day will be four weeks from today, as my contract requires. I have accepted an offer \
from another company and will start there next month.

Thank you for the support and the opportunities I have had during my time on the team. I am \
grateful for everything I have learned, and I am proud of the projects we delivered together.

Over the coming weeks I will make the handover as smooth as I can. I will write down the state \
of every open project, train whoever takes over my work, and stay reachable for questions after \
I leave. Please let me know how you would like to organise the handover, and whether there is \
anything in particular I should finish before my last day.

I would be grateful if this stayed between us until I have told the rest of the team myself.

Kind regards"""
VICTIM = "Dana Whitfield"
GUESSES = ["Sam Ortega", VICTIM, "Priya Natarajan", "Lena Brandt"]  # the attacker's candidates


def post(url: str, body: dict, api_key: str | None = None) -> tuple[dict, float]:
    """POST a JSON body, as `curl -s url -H 'Content-Type: application/json' -d body` does:
    (the JSON reply, ms the client waited).

    An error status comes back as its JSON body too: {"error": {"message": ..., "type": ...}}.
    """
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.load(response)
    except urllib.error.HTTPError as err:
        reply = json.load(err)
    return reply, (time.perf_counter() - start) * 1e3


def cached_tokens(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]  # NEW: where OpenAI reports it


def probe(url: str, name: str, api_key: str | None = None) -> tuple[int, float]:
    """One guess of the attacker: the letter with `name` in it, one token, greedy; what the
    attacker sees is cached_tokens and how long the reply took."""
    reply, ms = post(f"{url}/v1/completions", {"prompt": LETTER.format(name=name), "max_tokens": 1,
                                               "temperature": 0}, api_key)
    return cached_tokens(reply), ms


def probe_table(console: Console, url: str, api_key: str | None) -> dict[str, tuple[int, float]]:
    """Every guess once, in GUESSES order; a table of what the attacker sees."""
    results = {name: probe(url, name, api_key) for name in GUESSES}
    table = Table("the attacker's guess", "cached_tokens", "reply ms (measured by the client)")
    for name, (cached, ms) in results.items():
        table.add_row(name, str(cached), f"{ms:,.0f}", style="bold red" if cached else None)
    console.print(table)
    return results


def curl_commands() -> str:
    """What a class types against `python server.py` (port 5000) to see the same things."""
    chat = {"messages": [{"role": "system", "content": "You are a terse tutor."},
                         {"role": "user", "content": "What is a KV cache?"}], "max_tokens": 16, "temperature": 0}
    return "\n".join([
        "python server.py    # in a terminal of its own; the commands below in another",
        "# twice: usage.prompt_tokens_details.cached_tokens is 0, then 16 (the first block)",
        f"curl -s localhost:5000/v1/chat/completions {JSON_HEADER} -d '{json.dumps(chat)}'",
        "# the same text as another tenant: 0 again",
        f"curl -s localhost:5000/v1/chat/completions {JSON_HEADER} "
        f"-d '{json.dumps({**chat, 'cache_salt': 'team-blue'})}'",
        "curl -s localhost:5000/health    # hit rate, blocks in use, evictions",
        f"curl -s localhost:5000/reset_prefix_cache {JSON_HEADER} -d '{{}}'",
        "# started as python server.py --salt-by-api-key: a cache per key, no cache_salt field",
        f"curl -s localhost:5000/v1/chat/completions -H 'Authorization: Bearer alice-key' {JSON_HEADER} "
        f"-d '{json.dumps(chat)}'",
    ])


def behind_a_long_prompt(console: Console, engine, url: str) -> None:
    """A long chat (one key), and a short question sent while it is prefilled (another key):
    the question's time to first token against the same question alone; then /health's
    share for each key."""
    question = {"prompt": "What is a KV cache?", "max_tokens": 8, "temperature": 0}
    wanted = min(2000, (engine.max_model_len or 2048) - 100)  # a long prompt, within the model's context
    essay = " ".join([DEMO_SYSTEM_PROMPT] * max(1, wanted // len(engine.tokenize(DEMO_SYSTEM_PROMPT))))
    alone = [post(f"{url}/generate", question, api_key=f"alone-{i}")[0]["ttft_ms"] for i in range(3)]
    done = {}

    def long_chat():  # NEW: a thread of its own, as another student's laptop
        done["reply"], done["ms"] = post(f"{url}/generate", {"prompt": essay, "max_tokens": 1}, api_key="erin-key")

    thread = threading.Thread(target=long_chat)
    thread.start()
    until = time.monotonic() + 30
    while not engine.snapshot().prefilling and time.monotonic() < until:  # erin's prompt is coming in chunks
        time.sleep(0.01)
    health, _ = get(f"{url}/health", api_key="erin-key")  # NEW: her own share, while her prompt comes in
    beside, _ = post(f"{url}/generate", question, api_key="frank-key")
    during = thread.is_alive()
    thread.join()
    if "error" in done["reply"]:
        raise SystemExit(f"erin's request failed: {done['reply']['error']['message']}")
    alone_ms = statistics.median(alone)
    console.print(
        f"erin sends a {done['reply']['prompt_tokens']:,}-token prompt (her reply took {done['ms']:,.0f} ms); while it "
        f"is prefilled, frank asks a {beside['prompt_tokens']}-token question"
        f"{'' if during else ' (erin was done before his reply: this machine is too quick to show it)'}. His first "
        f"token came {beside['ttft_ms']:,.0f} ms after his request reached the engine, against {alone_ms:,.0f} ms "
        f"alone (median of 3): "
        f"{beside['ttft_ms'] / alone_ms:.1f}x. He waited for the step running when he came, then for his own: "
        f"stage 8's scheduler gives a prompt still prefilling only a share of a step once someone waits behind "
        f"it (scene 2e), and the step budget has that prompt yield a newcomer's first step to it (at most FLOOR "
        f"fixed costs of steps in a row). While her "
        f"prompt came in, /health told her key: served_tokens={health['served_tokens']:,}, "
        f"tokens_ahead_of_least_served={health['tokens_ahead_of_least_served']:,}: the Virtual Token Counter's "
        f"count that orders the queue (fair_share; python server.py --no-fair-share turns it off). Measured at "
        f"the server's defaults, with many students, a heavy one and a class behind one address: "
        f"python prefix_caching.py --bench server_abuse (docs/serving.md has its figures)."
    )


def get(url: str, api_key: str | None = None) -> tuple[dict, float]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read()), (time.perf_counter() - started) * 1e3


def main(argv: list[str] | None = None) -> None:
    args = models.parse_args("Stage 9: serving, cached tokens over HTTP, tenants, the timing side channel", argv,
                             engine=True)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no access log line per request
    logging.getLogger("server").setLevel(logging.ERROR)  # nor the server's own: the lesson prints what matters
    console = Console()
    show_code(console, generate, chat_completions, take_cache_salt, tenant_of)
    engine = models.make_engine(args)  # as python server.py runs it
    console.print(models.describe(engine.model, args))
    engine.warm_up()
    # NEW: two apps over one engine, each served from a thread of this process on a free port
    url, server = serve_in_background(create_app(engine, model_name="lesson-model"))
    salted_url, salted_server = serve_in_background(create_app(engine, model_name="lesson-model", salt_by_api_key=True))
    console.print(f"serving on {url}, and with --salt-by-api-key on {salted_url} (one engine, one pool)")

    console.print(Rule("1. The cache over HTTP: usage.prompt_tokens_details.cached_tokens"))
    console.print("POST /v1/chat/completions, twice: the demo's system prompt and a question of its own each time.")
    table = Table("request", "prompt_tokens", "cached_tokens", "reply ms")
    table.add_column("reply (8 tokens)", max_width=22, no_wrap=True, overflow="ellipsis")
    for i, question in enumerate(DEMO_QUESTIONS[:2], 1):
        messages = [{"role": "system", "content": DEMO_SYSTEM_PROMPT}, {"role": "user", "content": question}]
        reply, ms = post(f"{url}/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0})
        table.add_row(f"q{i}", str(reply["usage"]["prompt_tokens"]), str(cached_tokens(reply)), f"{ms:,.0f}",
                      " ".join(reply["choices"][0]["message"]["content"].split()))
    console.print(table)
    console.print('The second reply\'s usage: "prompt_tokens_details": {"cached_tokens": '
                  f"{cached_tokens(reply)}}}: the shared system prompt came from the pool.")

    console.print(Rule("2. Tenants: a cache_salt per client"))
    document = {"prompt": LETTER.format(name="the team"), "max_tokens": 1, "temperature": 0}
    rows = [("tenant a", "tenant-a"), ("tenant b, same text", "tenant-b"), ("tenant a again", "tenant-a")]
    table = Table("request", "cache_salt", "cached_tokens")
    for label, salt in rows:
        reply, _ = post(f"{url}/v1/completions", {**document, "cache_salt": salt})
        table.add_row(label, salt, str(cached_tokens(reply)))
    console.print(table)
    console.print("The salt is hashed into block 0 and every later hash chains to it: tenant b's identical text "
                  "gets other block names and hits nothing; tenant a finds its own blocks again.")

    console.print(Rule("3. The timing side channel: a shared cache tells who sent what"))
    post(f"{url}/reset_prefix_cache", {})
    post(f"{url}/v1/completions", {"prompt": LETTER.format(name=VICTIM), "max_tokens": 8, "temperature": 0})
    console.print(f"{VICTIM} asks the assistant to polish her resignation letter (the company's template, her name "
                  f"in the header). A colleague then sends the same template with each name he suspects:")
    open_results = probe_table(console, url, api_key=None)
    hit, hit_ms = open_results[VICTIM]
    misses = [ms for name, (cached, ms) in open_results.items() if name != VICTIM]
    wrong_ms = statistics.median(misses)
    if hit_ms < 0.7 * wrong_ms:
        timing = ("The time alone gives it away, so even a server that hid cached_tokens would leak it: "
                  "the attacker now knows who is leaving.")
    else:
        timing = ("Here the times are too close to tell apart (this model computes the whole letter in a few ms); "
                  "on a real model the hit comes back several times sooner, and the time alone gives it away.")
    console.print(
        f"Without salts the right guess comes back with [bold]cached_tokens={hit}[/] in {hit_ms:,.0f} ms; the "
        f"wrong ones hit 0 tokens and take {wrong_ms:,.0f} ms (median; measured on this machine). {timing} "
        f"Real attacks go further, guessing a prompt one block at a time."
    )

    console.print(Rule("4. The fix: a salt per API key (python server.py --salt-by-api-key)"))
    post(f"{salted_url}/v1/completions", {"prompt": LETTER.format(name=VICTIM), "max_tokens": 8, "temperature": 0},
         api_key="dana-key")
    salted_results = probe_table(console, salted_url, api_key="mallory-key")
    own, _ = probe(salted_url, VICTIM, api_key="dana-key")
    refused, _ = post(f"{salted_url}/v1/completions", {"prompt": "Hi", "cache_salt": "dana"}, api_key="mallory-key")
    console.print(
        f"With the salt derived from each key, the right guess gets [bold]cached_tokens={salted_results[VICTIM][0]}[/] "
        f"and waits like the others: nothing to learn. {VICTIM}'s own key still hits her blocks "
        f"(cached_tokens={own}), so each tenant keeps the speed-up. A client cannot pick another's salt either: "
        f"{refused['error']['message']!r}."
    )
    console.print(Rule("5. A class sharing one server: a question behind a long prompt, a fair share"))
    behind_a_long_prompt(console, engine, salted_url)
    server.shutdown()
    salted_server.shutdown()

    console.print(Rule("6. The same by hand, against python server.py"))
    console.print(curl_commands(), soft_wrap=True, highlight=False, markup=False)


if __name__ == "__main__":
    main()
