"""What the server shows to whom, and what it refuses from the network: tenants on /cache and
/health, API keys, the admin key, Content-Type, the Host header, the log. Real servers on
127.0.0.1 around conftest's tiny random model (its engine and url fixtures: the batching
engine, as python server.py runs it).
"""

import hashlib
import http.client
import logging

import openai
import pytest

from helpers import CHAT, MODEL, SYSTEM, call, client, paused, raw_request, serve, wait_for_log
from server import create_app

ALICE, BOB = {"Authorization": "Bearer alice-key"}, {"Authorization": "Bearer bob-key"}


def salt_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def generate(url: str, prompt: str, headers=None, **fields) -> dict:
    status, reply = call(url, "/generate", {"prompt": prompt, "max_tokens": 2, **fields}, headers=headers)
    assert status == 200, reply
    return reply


def blocks_of(engine, salt) -> list[int]:
    """Ids of the blocks the engine holds for tenant `salt` (the truth /cache is checked against)."""
    return [b.block_id for b in engine.allocator.blocks if b.token_ids and b.cache_salt == salt]


# --- cache_salt: tenants without keys ------------------------------------------------------------


def test_cache_salt_keeps_tenants_apart(engine, url):
    def cached(salt):
        return generate(url, SYSTEM, **({} if salt is None else {"cache_salt": salt}))["cached_tokens"]

    full_hit = (len(engine.tokenize(SYSTEM)) - 1) // 4 * 4
    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same prompt, other salt: a miss
    assert cached(None) == 0  # no salt is a tenant of its own: the public one
    assert cached("") == full_hit  # "" is no salt, as in vLLM
    assert cached("tenant-a") == full_hit


def test_cache_shows_public_blocks_and_no_salted_block_to_anyone(engine, url):
    generate(url, SYSTEM + "Public question.")
    generate(url, SYSTEM + "My secret question.", cache_salt="team-blue")
    held = engine.stream(SYSTEM + "Still running.", max_tokens=150, cache_salt="team-blue", request_id="blue-1")
    next(held)
    try:
        with paused(engine):  # blue-1 keeps running, one step stopped half-way, while the test reads
            snap = call(url, "/cache")[1]
            public, salted = blocks_of(engine, None), blocks_of(engine, "team-blue")
    finally:
        held.close()
    assert public and salted
    for block_id in public:
        block = snap["blocks"][block_id]
        assert not block["opaque"] and block["block_hash"]
        assert block["text"] == engine.tokenizer.decode(engine.allocator.blocks[block_id].token_ids)
    for block_id in salted:  # id, ref count and state for the picture; nothing of the content
        block = snap["blocks"][block_id]
        assert block["opaque"] and block["block_hash"] is block["text"] is block["num_tokens"] is None
        assert block["state"] in ("in_use", "cached")
    assert "secret" not in str(snap)
    assert list(snap["block_tables"]) == ["blue-1"]  # without keys the server trusts its network with ids


# --- --salt-by-api-key: a tenant per key ---------------------------------------------------------


@pytest.fixture
def keyed_url(engine):
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL, salt_by_api_key=True, admin_key="s3cret")) as base_url:
        yield base_url


def test_salt_by_api_key_isolates_keys_and_refuses_client_salts(engine, keyed_url):
    def cached_tokens(api_key: str) -> int:
        reply = client(keyed_url, api_key).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        return reply.usage.prompt_tokens_details.cached_tokens

    full_hit = (len(engine.tokenize(CHAT)) - 1) // 4 * 4
    assert cached_tokens("alice-key") == 0
    assert cached_tokens("bob-key") == 0  # bob cannot time alice's prompt: it is never a hit for him
    assert cached_tokens("alice-key") == full_hit

    with pytest.raises(openai.BadRequestError, match="derives cache_salt from your API key"):
        client(keyed_url, "bob-key").chat.completions.create(model=MODEL, messages=CHAT,
                                                             extra_body={"cache_salt": "alice"})
    for route, body in (("/generate", {"prompt": "Hi"}), ("/cache", None)):
        got, reply = call(keyed_url, route, body)  # no Authorization header
        assert got == 401 and reply["error"]["type"] == "authentication_error", route
    assert call(keyed_url, "/health") == (200, {"status": "ok"})  # a liveness probe's answer, nothing more


def test_under_keys_a_caller_sees_its_own_counters_blocks_and_requests_only(engine, keyed_url):
    generate(keyed_url, SYSTEM + "Alice asks.", ALICE)
    generate(keyed_url, SYSTEM + "Alice asks.", ALICE)
    alice = call(keyed_url, "/health", headers=ALICE)[1]
    assert alice["counted"] == "this API key" and alice["requests"] == 2 and alice["hit_tokens"] > 0
    assert "evictions" not in alice and "blocks_cached" not in alice  # everyone's history: left out

    # Bob repeats a prompt of his own: his counters move, Alice's do not.
    generate(keyed_url, SYSTEM + "Bob asks.", BOB)
    generate(keyed_url, SYSTEM + "Bob asks.", BOB)
    counters = ("requests", "queried_tokens", "hit_tokens", "hit_rate")
    assert [call(keyed_url, "/health", headers=ALICE)[1][k] for k in counters] == [alice[k] for k in counters]
    bob = call(keyed_url, "/health", headers=BOB)[1]
    assert bob["requests"] == 2 and bob["hit_tokens"] > 0
    bobs_cached = sum(b.block_hash is not None for b in engine.allocator.blocks if b.cache_salt == salt_of("bob-key"))
    assert 0 < bob["num_cached_blocks"] == bobs_cached < engine.allocator.num_cached_blocks  # his own blocks only
    assert bob["num_blocks"] == engine.allocator.num_blocks and bob["num_free_blocks"] is None  # the size, not the use

    held = engine.stream(SYSTEM + "Bob waits.", max_tokens=150, cache_salt=salt_of("bob-key"), request_id="bob-1")
    next(held)
    try:
        with paused(engine):  # bob-1 keeps running, one step stopped half-way, while the test reads
            seen_by_alice = call(keyed_url, "/cache", headers=ALICE)[1]
            seen_by_bob = call(keyed_url, "/cache", headers=BOB)[1]
            alice_blocks, bob_blocks = blocks_of(engine, salt_of("alice-key")), blocks_of(engine, salt_of("bob-key"))
    finally:
        held.close()
    assert seen_by_alice["block_tables"] == {} and list(seen_by_bob["block_tables"]) == ["bob-1"]
    assert seen_by_alice["running_requests"] == 0 and seen_by_bob["running_requests"] == 1  # each counts its own
    for block_id in alice_blocks:
        assert seen_by_alice["blocks"][block_id]["text"] and seen_by_alice["blocks"][block_id]["block_hash"]
        assert seen_by_bob["blocks"][block_id]["opaque"]
    for block_id in bob_blocks:
        block = seen_by_alice["blocks"][block_id]
        assert block["opaque"] and block["block_hash"] is None and block["text"] is None  # no hash to test keys on
    assert "Bob" not in str(seen_by_alice) and "Alice" not in str(seen_by_bob)


# --- the reset: open in dev mode, the admin's otherwise ---------------------------------------------


def test_reset_needs_the_admin_key_when_one_is_set(engine, keyed_url):
    generate(keyed_url, SYSTEM, ALICE)
    got, reply = call(keyed_url, "/reset_prefix_cache", {})
    assert got == 401 and "admin key" in reply["error"]["message"]
    got, reply = call(keyed_url, "/reset_prefix_cache", {}, headers=ALICE)  # a tenant's key is not the admin's
    assert got == 403 and reply["error"]["type"] == "permission_error"
    assert engine.allocator.num_cached_blocks > 0
    got, reply = call(keyed_url, "/reset_prefix_cache", {}, headers={"Authorization": "Bearer s3cret"})
    assert got == 200 and reply["num_cached_blocks"] == 0
    assert call(keyed_url, "/health", headers=ALICE)[1]["requests"] == 0  # the counters went with the cache


def test_under_keys_without_an_admin_key_nobody_resets(engine):
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL, salt_by_api_key=True)) as url:
        got, reply = call(url, "/reset_prefix_cache", {}, headers=ALICE)
        assert got == 403 and "start it with --admin-key" in reply["error"]["message"]
    with pytest.raises(ValueError, match="admin_key is empty"):
        create_app(engine, cache_page_every_s=0, admin_key="")


# --- what the network may send ------------------------------------------------------------------

POSTS = ["/generate", "/v1/completions", "/v1/chat/completions", "/reset_prefix_cache"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_every_post_needs_a_json_content_type(engine, url, content_type):
    """What a page on another site can send without asking (fetch with mode "no-cors") is refused."""
    generate(url, SYSTEM)
    cached, requests = engine.allocator.num_cached_blocks, engine.allocator.stats.requests
    for route in POSTS:
        headers = {"Content-Type": content_type} if content_type else {}
        conn = http.client.HTTPConnection(*url.removeprefix("http://").split(":"), timeout=30)
        conn.request("POST", route, body=b'{"prompt": "Hi", "messages": []}', headers=headers)
        response = conn.getresponse()
        message = response.read().decode()
        assert response.status == 415, route
        assert "-H 'Content-Type: application/json'" in message and "--json" in message
    assert (engine.allocator.num_cached_blocks, engine.allocator.stats.requests) == (cached, requests)


@pytest.mark.parametrize("host, status", [
    ("evil.example", 400), ("evil.example:5000", 400), ("localhost:5000", 200), ("127.0.0.1", 200),
    ("[::1]:5000", 200), ("192.168.1.20:5000", 200), ("class-server.local", 200),
])
def test_the_host_header_must_name_this_server(engine, host, status):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 still says
    `Host: evil.example`. Names the server was not given are refused; addresses cannot be rebound."""
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL, allowed_hosts=("Class-Server.local",))) as url:
        conn = http.client.HTTPConnection(*url.removeprefix("http://").split(":"), timeout=30)
        conn.putrequest("GET", "/health", skip_host=True)
        conn.putheader("Host", host)
        conn.endheaders()
        response = conn.getresponse()
        reply = response.read().decode()
    assert response.status == status
    if status == 400:
        assert "DNS rebinding" in reply and "--allowed-host evil.example" in reply


def test_control_characters_from_clients_are_escaped_in_the_log(url, caplog):
    with caplog.at_level(logging.INFO, logger="server"):
        with raw_request(url, ["GET /\x1b[2J\x1b[1;1Hall-fine HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]) as sock:
            assert sock.recv(4096).startswith(b"HTTP/1.1 404")
        line = wait_for_log(caplog, "all-fine")
    assert "\x1b" not in line and "/\\x1b[2J\\x1b[1;1Hall-fine" in line  # shown, not obeyed by the terminal
    assert not any("\x1b" in r.getMessage() for r in caplog.records if r.name == "server")
