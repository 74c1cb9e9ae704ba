"""The class's door to a fleet (benchmarks/router_front.py): what sglang-router 0.3.2 lacks, a
deadline for a head, a cap on connections, a body refused on its length, routes a student may
not call, supplied in front of it by the class server's own connection rules. The fleet as
`--bench router --serve` starts it: two class servers over conftest's tiny model, SGLang's
real router with its guards on 127.0.0.1, and the door in a process of its own under `ulimit
-n 1024`, a desktop's open-file limit. Over real HTTP, tried as a student would:

    1. a student's chat is served through the door, the same reply as the router's alone
    2. only the class's three routes pass, each with a key of the class
    3. 1,100 idle connections from 44 addresses leave 8 of 8 chats served
    4. a 100 MB body is refused on its length: neither the door nor the router reads it
"""

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.router import Keys, body_limit, front, router
from engine import Engine
from helpers import MODEL, ask, calibrated, connect_from, serve, until, wait_until_idle
from server import create_app
from serving.connections import connection_cap

pytestmark = [pytest.mark.router, pytest.mark.server]

KEYS = Keys("teacher-secret", ("student-01", "student-02"))
HARD_FILES = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
DESKTOP_FILES = min(1024, HARD_FILES)  # the door's open-file limit: a desktop's default (this machine's, if lower)
IDLE = min(1_100, HARD_FILES - 256)  # part 3's idle connections: what this process may open beside its own files


@pytest.fixture(scope="module")
def door(tiny_model, tokenizer):
    """(the door's URL, the router's URL)."""
    engines = [calibrated(Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=128))
               for _ in range(2)]
    apps = [create_app(engine, model_name=MODEL, salt_by_api_key=True, admin_key=KEYS.teacher,
                       api_keys=frozenset(KEYS.students)) for engine in engines]
    limit = body_limit(tokenizer)
    with serve(apps[0], max_connections_per_client=0) as a, serve(apps[1], max_connections_per_client=0) as b:
        with router((a, b), "cache_aware", control_key=KEYS.teacher, max_body_bytes=limit) as routed:
            # Deadlines long enough that every idle connection of part 3 is still held when its
            # chats come: only the cap, and the places made at it, decide.
            with front(routed, KEYS, limit, open_files=DESKTOP_FILES,
                       front_args=["--idle-timeout", "120", "--head-timeout", "120", "--read-timeout", "120"]) as url:
                yield url, routed
    for engine in engines:
        wait_until_idle(engine)
        engine.close()


def chat(question: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 4, "temperature": 0,
            **fields}


def process_of(port: int) -> int:
    """The pid of the process listening on 127.0.0.1:port (the router renames its process, so
    its command line cannot tell): the socket's inode in /proc/net/tcp, then whose it is."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                    return int(entry.name)
            except OSError:
                continue
    raise AssertionError(f"no process listens on port {port}")


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def fate(sock: socket.socket) -> str:
    """What the door did with an idle connection: "refused" (a 503, then closed), "cut" (closed
    without a word: its place was given away) or "held"."""
    sock.setblocking(False)
    try:
        data = sock.recv(65536)
    except BlockingIOError:
        return "held"
    except ConnectionResetError:
        return "cut"
    return "refused" if data.startswith(b"HTTP/1.1 503") else "cut"


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# --- 1. served through the door ---------------------------------------------------------------------


def test_the_door_loads_no_engine():
    """The door is a process of its own beside the replicas: flask and the connection rules,
    not torch (4 s of a core to import, and a second copy of its memory)."""
    from benchmarks.router import ROOT

    check = "import sys, benchmarks.router_front; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    found = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]", found.stdout + found.stderr


def test_a_students_chat_through_the_door_is_the_routers_reply(door):
    url, routed = door
    status, text, _ = ask(url + "/v1/chat/completions", "POST", chat("What is a KV cache?"), KEYS.students[0])
    assert status == 200
    through = json.loads(text)["choices"][0]["message"]["content"]
    status, text, _ = ask(routed + "/v1/chat/completions", "POST", chat("What is a KV cache?"), KEYS.students[1])
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == through
    status, text, headers = ask(url + "/v1/chat/completions", "POST", chat("Stream it", stream=True), KEYS.students[0])
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert text.rstrip().endswith("data: [DONE]")
    status, text, _ = ask(url + "/v1/models", key=KEYS.students[1])
    assert status == 200 and json.loads(text)["data"][0]["id"] == MODEL


# --- 2. the class's routes, with the class's keys ------------------------------------------------------


def test_only_the_class_routes_pass_and_each_takes_a_key_of_the_class(door):
    url, _ = door
    # What the router answers anyone, or its control plane answers the teacher: none of it through the door.
    closed = [("GET", "/workers"), ("POST", "/workers"), ("GET", "/get_loads"), ("GET", "/get_server_info"),
              ("GET", "/readiness"), ("GET", "/health"), ("GET", "/get_model_info"), ("POST", "/v1/tokenize"),
              ("POST", "/v1/tokenizers"), ("GET", "/ha/status"), ("POST", "/flush_cache"), ("GET", "/metrics")]
    for method, path in closed:
        status, text, _ = ask(url + path, method, {} if method == "POST" else None, KEYS.teacher)
        assert status == 404 and "/v1/chat/completions" in text, (method, path, status, text)
    status, text, _ = ask(url + "/generate", "POST", {"prompt": "Hi"}, KEYS.students[0])
    assert status == 404 and "send /v1/completions" in text
    for key in (None, "made-up-key"):
        for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")):
            status, text, _ = ask(url + path, method, chat("Hi") if method == "POST" else None, key)
            assert status == 401 and "key of the class" in text, (key, path)
    # Another site's page: its preflight gets no grant.
    status, _, headers = ask(url + "/v1/chat/completions", "OPTIONS", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert status != 200 and "Access-Control-Allow-Origin" not in headers


# --- 3. idle connections ------------------------------------------------------------------------------


def test_1100_idle_connections_leave_every_chat_served_under_a_desktops_open_file_limit(door):
    url, _ = door
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert IDLE > connection_cap(2, limit=DESKTOP_FILES), "the idle connections must be more than the door's cap"
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    idle = []
    try:
        # 25 from each of 44 addresses: under the door's cap for one address (32), over its cap
        # in all (448 under ulimit -n 1024, two files each).
        for i in range(IDLE):
            try:
                idle.append(connect_from(url, f"127.0.2.{i // 25 + 1}"))
            except OSError:  # refused at once: the door was full and none of its heads was old enough to go
                pass
        time.sleep(0.6)  # MAKE_ROOM_AFTER_S: the idle ones are old enough to give way
        served = [ask(url + "/v1/chat/completions", "POST", chat(f"Question {i}?"), KEYS.students[i % 2])[0]
                  for i in range(8)]
        assert served == [200] * 8
        door_pid = process_of(port_of(url))
        assert len(os.listdir(f"/proc/{door_pid}/fd")) < DESKTOP_FILES  # it never ran out of files
        fates = [fate(sock) for sock in idle]
        assert fates.count("held") <= connection_cap(2, limit=DESKTOP_FILES)  # 448
        assert fates.count("cut") >= 1  # places were made for the chats
    finally:
        for sock in idle:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- 4. a body too big ------------------------------------------------------------------------------


def test_a_100_mb_body_is_refused_on_its_length_and_no_process_grows(door):
    url, routed = door
    pids = [process_of(port_of(url)), process_of(port_of(routed))]
    before = [resident_mib(pid) for pid in pids]
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEYS.students[0]}\r\nContent-Length: {100 * 2**20}\r\n\r\n").encode()
    sock = connect_from(url, "127.0.0.1")
    sock.sendall(head)
    sent, reply = 0, b""
    sock.settimeout(0.05)
    chunk = b"x" * 2**16
    while sent < 100 * 2**20 and b"\r\n\r\n" not in reply:
        try:
            reply += sock.recv(65536)
        except TimeoutError:
            try:
                sock.sendall(chunk)
                sent += len(chunk)
            except OSError:
                break
    sock.settimeout(10)
    while b"\r\n\r\n" not in reply and (more := sock.recv(65536)):
        reply += more
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert sent < 10 * 2**20  # answered long before the 100 MB were sent
    after = [resident_mib(pid) for pid in pids]
    assert all(a - b < 20 for a, b in zip(after, before)), (before, after)
    assert until(lambda: ask(url + "/v1/models", key=KEYS.teacher)[0] == 200)


# --- 5. the command a teacher types --------------------------------------------------------------------


def test_serve_starts_the_door_in_front_and_stops_on_ctrl_c(tiny_model_dir):
    """`python prefix_caching.py --bench router --serve` as docs/fleet.md runs it, on the tiny
    model: the keys it prints open the door, the door passes a chat and nothing of the
    router's, the router's control plane answers the teacher on this machine, and Ctrl+C
    stops every process."""
    from benchmarks.router import ROOT, default_sigint
    from benchmarks.served_clients import free_port

    port = free_port()
    command = [sys.executable, "prefix_caching.py", "--bench", "router", "--serve", "--replicas", "1",
               "--students", "2", "--model", str(tiny_model_dir), "--port", str(port)]
    # preexec_fn: Ctrl+C's signal as a terminal delivers it, even where this test runs in a
    # background job, whose children inherit SIGINT ignored (the command then never stops).
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}, start_new_session=True,
                               preexec_fn=default_sigint)
    printed = []
    try:
        for line in process.stdout:
            printed.append(line.rstrip())
            if "Ctrl+C stops them all" in line:
                break
        text = "\n".join(printed)
        assert f"the class's door on http://127.0.0.1:{port}" in text, text
        student = printed[printed.index(next(p for p in printed if "one for each student" in p)) + 1].strip()
        teacher = next(p for p in printed if "the teacher's key (keep it):" in p).split(": ")[-1].strip()
        routed = re.search(r"the router \(cache_aware\) on (http://127\.0\.0\.1:\d+)", text).group(1)
        door = f"http://127.0.0.1:{port}"
        model = json.loads(ask(door + "/v1/models", key=student)[1])["data"][0]["id"]
        status, reply, _ = ask(door + "/v1/chat/completions", "POST", chat("Hi") | {"model": model}, student)
        assert status == 200, reply
        assert ask(door + "/workers", key=teacher)[0] == 404
        assert ask(routed + "/workers", key=teacher)[0] == 200 and ask(routed + "/workers", key=student)[0] == 401
    finally:
        os.killpg(process.pid, signal.SIGINT)
        stopping = ""
        for line in process.stdout:  # an impatient teacher: Ctrl+C again while the fleet stops
            stopping += line
            if "stopping the door, the router and the replicas" in line:
                os.killpg(process.pid, signal.SIGINT)
                break
        rest = stopping + process.communicate(timeout=60)[0]
    assert process.returncode == 0, "\n".join(printed) + rest
    assert "stopping the door, the router and the replicas" in rest and "Traceback" not in rest, rest
