"""The fleet a class is given: SGLang's real router (sglang-router, pinned in requirements.txt)
with the guards benchmarks/router.py starts it with (guard_flags), in front of two class
servers over conftest's tiny model, each with the class's keys, a cache per key and the
teacher's admin key, as `--bench router --serve` starts them. Over real HTTP on 127.0.0.1,
tried as a student who is not the teacher would:

    1. the control plane: without the teacher's key each of its routes is refused; what 0.3.2
       leaves open tells a student nothing a reply does not, and changes nothing
    2. the browser and the network: another site's page gets no CORS grant, the metrics listen
       on 127.0.0.1 only, a body over the replicas' limit is refused on its length
    3. the breaker a student cannot trip: bad requests of every kind, then honest chats are
       served; a replica's 503 and 429 reach the client once, not retried
    4. every student a tenant: a chat's prefix, cached under one key, is not found by another
"""

import json
import socket
import threading
import urllib.request
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from benchmarks.router import (
    DEFAULT_BODY_BYTES, Fleet, Keys, body_limit, guard_flags, request_counts, reset_caches, router,
)
from benchmarks.served_clients import free_port
from engine import Engine
from helpers import MODEL, StubWorker, ask, calibrated, raw_request, serve, wait_until_idle
from server import create_app

pytestmark = [pytest.mark.router, pytest.mark.server]

ROOT = Path(__file__).resolve().parents[2]
KEYS = Keys("teacher-secret", ("student-01", "student-02"))
EVIL = "http://evil.example"


@dataclass(frozen=True)
class ClassFleet:
    fleet: Fleet
    apps: tuple  # the replicas' Flask apps: their settings are what the router's limits must match
    metrics_port: int


@pytest.fixture(scope="module")
def class_fleet(tiny_model, tokenizer):
    engines = [calibrated(Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=128))
               for _ in range(2)]
    apps = tuple(create_app(engine, model_name=MODEL, salt_by_api_key=True, admin_key=KEYS.teacher,
                            api_keys=frozenset(KEYS.students)) for engine in engines)
    metrics_port = free_port()
    # As replicas() starts them: the router is their one client (no per-address cap).
    with serve(apps[0], max_connections_per_client=0) as a, serve(apps[1], max_connections_per_client=0) as b:
        with router((a, b), "cache_aware", ["--prometheus-port", str(metrics_port)], control_key=KEYS.teacher,
                    max_body_bytes=body_limit(tokenizer)) as url:
            yield ClassFleet(Fleet(url, (a, b), "cache_aware", KEYS), apps, metrics_port)
    for engine in engines:
        wait_until_idle(engine)  # every block free again, every ref count 0
        engine.close()


def chat(question: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 3, **fields}


# --- 1. the control plane ----------------------------------------------------------------------------


def test_the_control_plane_takes_the_teachers_key_only(class_fleet):
    """What a student did to the open router: registered a fake replica (POST /workers),
    removed the real ones (DELETE /workers/{id}, their ids from GET /workers), loaded a
    tokenizer from the teacher's disk (POST /v1/tokenizers), read the loads. Each is a 401
    without the teacher's key, and with a student's."""
    url = class_fleet.fleet.url
    status, text, _ = ask(url + "/workers", "GET", key=KEYS.teacher)
    assert status == 200
    worker = json.loads(text)["workers"][0]["id"]
    tried = [("POST", "/workers", {"url": "http://127.0.0.1:9"}), ("GET", "/workers", None),
             ("GET", f"/workers/{worker}", None), ("DELETE", f"/workers/{worker}", None), ("GET", "/get_loads", None),
             ("POST", "/flush_cache", {}), ("POST", "/v1/tokenizers", {"name": "t", "source": str(ROOT)}),
             ("GET", "/v1/tokenizers", None), ("GET", "/wasm", None)]
    for key in (None, KEYS.students[0]):
        refused = {(method, path): ask(url + path, method, body, key)[0] for method, path, body in tried}
        assert refused == {(method, path): 401 for method, path, _ in tried}, f"key {key}"
    status, text, _ = ask(url + "/workers", "GET", key=KEYS.teacher)
    assert len(json.loads(text)["workers"]) == 2  # nothing was removed or added
    assert ask(url + "/get_loads", "GET", key=KEYS.teacher)[0] == 200


def test_what_the_router_leaves_open_tells_a_student_nothing_new(class_fleet):
    """0.3.2 keeps these routes outside its control plane (its public routes): they answer
    anyone, and on this fleet they tell the model's name and how many replicas are healthy,
    which every reply tells too. /ha/shutdown, which would stop a router of a mesh, does
    nothing here: 0.3.2's command line starts no mesh."""
    url = class_fleet.fleet.url
    answers = {(method, path): ask(url + path, method, body)[:2] for method, path, body in [
        ("GET", "/v1/models", None), ("GET", "/get_server_info", None), ("GET", "/readiness", None),
        ("GET", "/get_model_info", None), ("GET", "/engine_metrics", None), ("POST", "/v1/tokenize", {"prompt": "Hi"}),
        ("POST", "/ha/shutdown", {}), ("GET", "/ha/status", None)]}
    assert [m["id"] for m in json.loads(answers["GET", "/v1/models"][1])["data"]] == [MODEL]
    assert json.loads(answers["GET", "/get_server_info"][1]) == {"router_manager": True, "routers_count": 1,
                                                                 "workers_count": 2}
    assert json.loads(answers["GET", "/readiness"][1]) == {"status": "ready", "healthy_workers": 2, "total_workers": 2}
    assert answers["GET", "/get_model_info"][0] == 401  # passed to a replica, which asks for a class's key
    assert answers["GET", "/engine_metrics"][0] == 500  # the replicas' /metrics: this server has none
    assert answers["POST", "/v1/tokenize"][0] == 400  # no tokenizer: loading one takes the teacher's key
    assert answers["POST", "/ha/shutdown"] == answers["GET", "/ha/status"] == (503, '{"error":"mesh not enabled"}')


# --- 2. the browser and the network ------------------------------------------------------------------


def test_another_sites_page_gets_no_cors_grant(class_fleet):
    url = class_fleet.fleet.url
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    for path in ("/v1/chat/completions", "/workers"):
        _, _, headers = ask(url + path, "OPTIONS", headers={"Origin": EVIL} | preflight)
        assert headers.get("access-control-allow-origin") is None, path
    _, _, headers = ask(url + "/v1/models", "GET", headers={"Origin": EVIL})
    assert headers.get("access-control-allow-origin") is None
    # The list restricts, rather than being ignored: the one origin on it is granted.
    _, _, headers = ask(url + "/v1/chat/completions", "OPTIONS", headers={"Origin": url} | preflight)
    assert headers.get("access-control-allow-origin") == url


def this_machines_address() -> str | None:
    """An address of this machine other than 127.0.0.1, as another machine would reach it (a
    UDP socket's connect sends nothing), or None on a machine with none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere
        except OSError:
            return None
        address = sock.getsockname()[0]
    return None if address.startswith("127.") else address


def test_the_metrics_listen_on_this_machine_only(class_fleet):
    port = class_fleet.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
    address = this_machines_address()
    if address is None:
        pytest.skip("this machine has no address but 127.0.0.1")
    with pytest.raises(ConnectionRefusedError):  # on 0.0.0.0 it would answer here
        socket.create_connection((address, port), timeout=10).close()


def test_a_body_over_the_replicas_limit_is_refused_on_its_length(class_fleet, tokenizer):
    settings = class_fleet.apps[0].extensions["server"].settings
    assert body_limit(tokenizer) == settings.bounds.max_body_bytes == DEFAULT_BODY_BYTES  # SmolLM2's tokenizer
    host = class_fleet.fleet.url.removeprefix("http://")
    # The head alone, announcing a body one byte over: the answer comes before a byte of it.
    sock = raw_request(class_fleet.fleet.url, ["POST /v1/chat/completions HTTP/1.1", f"Host: {host}",
                                               "Content-Type: application/json",
                                               f"Content-Length: {settings.bounds.max_body_bytes + 1}"])
    with sock:
        assert sock.recv(4096).split(b"\r\n")[0].startswith(b"HTTP/1.1 413")


def test_the_fleet_pages_router_by_hand_has_every_guard():
    """docs/fleet.md's by-hand router command carries each flag of guard_flags, the body limit
    at the default model's figure."""
    page = (ROOT / "docs" / "fleet.md").read_text()
    section = page[page.index("## Several replicas behind a router"):]
    command = section[section.index("python -m sglang_router.launch_router"):]
    command = command[: command.index("```")]
    flags = [flag for flag in guard_flags("URL", "KEY", DEFAULT_BODY_BYTES) if flag.startswith("--")]
    assert [flag for flag in flags if flag not in command] == []
    assert f"--max-payload-size {DEFAULT_BODY_BYTES}" in command
    assert "--host 127.0.0.1" in command.split("benchmarks.router_front")[0]  # the router: this machine only
    door = command[command.index("python -m benchmarks.router_front"):]
    assert all(flag in door for flag in ("--router http://127.0.0.1:8001", "--api-keys", "--admin-key",
                                         f"--max-body-bytes {DEFAULT_BODY_BYTES}"))


# --- 3. the breaker a student cannot trip ------------------------------------------------------------


def test_bad_requests_leave_the_fleet_serving(class_fleet):
    """The open router's breaker counted a replica's 4xx as its failures: 20 bad requests
    closed both replicas for a minute. Here 30 of each kind, then 8 of 8 honest chats served."""
    url, student = class_fleet.fleet.url, KEYS.students[0]
    bad = [("/generate", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}, student),  # body emptied
           ("/v1/chat/completions", chat("Hi", ignore_eos=True), student),  # a field the replicas refuse
           ("/v1/chat/completions", chat("Hi"), "student-99")]  # a key nobody listed
    for path, body, key in bad:
        statuses = {ask(url + path, "POST", body, key)[0] for _ in range(30)}
        assert statuses <= {400, 401}, (path, statuses)
    served = [ask(url + "/v1/chat/completions", "POST", chat(f"Question {i}?"), student)[0] for i in range(8)]
    assert served == [200] * 8


class BusyWorker(StubWorker):
    """A replica that is always busy: a 503 (its queue full) or a 429 (the key's share taken),
    as the chat's one message says; it counts the requests that reach it."""

    arrived: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status = int(body["messages"][0]["content"])
        self.arrived.append(status)
        data = json.dumps({"error": {"message": "busy", "type": "service_unavailable_error"}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Retry-After", "2")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_a_busy_replicas_answer_reaches_the_client_once():
    """The router retries a 503 and a 429 up to 5 times by default: each student's request
    would knock 5 times on a replica that asked them to wait. With retries off, once."""
    worker = ThreadingHTTPServer(("127.0.0.1", 0), BusyWorker)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    try:
        with router([f"http://127.0.0.1:{worker.server_port}"], "round_robin") as url:
            for status in (503, 429):
                got, _, headers = ask(url + "/v1/chat/completions", "POST", chat(str(status)))
                assert (got, headers.get("retry-after")) == (status, "2")
    finally:
        worker.shutdown()
    assert BusyWorker.arrived == [503, 429]


# --- 4. every student a tenant -------------------------------------------------------------------------

PRIVATE = [{"role": "system", "content": "Alice's private notes: the exam's third question is about eviction. " * 3},
           {"role": "user", "content": "Summarise my notes."}]


def test_a_chat_cached_under_one_key_is_not_found_by_another(class_fleet):
    """A chat's cache_salt is dropped by the router; the key is not. cache_aware sends Mallory's
    copy of Alice's chat to the replica that holds Alice's prefix, where her key's salt hides it."""
    url, replicas, (alice, mallory) = class_fleet.fleet.url, class_fleet.fleet.replica_urls, KEYS.students
    reset_caches(replicas, KEYS.teacher)

    def served(key: str) -> tuple[int, int]:
        """(the replica that served the chat, the tokens it found cached)"""
        before = request_counts(replicas, KEYS.teacher)
        status, text, _ = ask(url + "/v1/chat/completions", "POST", {"model": MODEL, "messages": PRIVATE,
                                                                      "max_tokens": 1}, key)
        assert status == 200, text
        (replica,) = [i for i, (a, b) in enumerate(zip(before, request_counts(replicas, KEYS.teacher))) if a != b]
        return replica, json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"]

    home, found = served(alice)
    assert found == 0
    assert served(mallory) == (home, 0)  # the same tokens on the same replica, another key: nothing found
    replica, found = served(alice)
    assert replica == home and found > 0  # her own prefix is still there for her
