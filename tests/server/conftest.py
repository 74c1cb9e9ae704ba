"""The server, as python server.py runs it: the batching engine over the tiny model, on a real
port of 127.0.0.1. A module may define its own engine and url."""

import pytest
from engine import Engine
from helpers import MODEL, calibrated, serve, wait_until_idle
from server import create_app


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    """The server's engine for a test module, python server.py's default policy on a held
    calibration (helpers.calibrated: its steps the same on every machine); block size 4 so
    blocks fill fast, 64 blocks (256 tokens)."""
    return calibrated(Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=64))


@pytest.fixture(scope="module")
def url(engine):
    with serve(create_app(engine, cache_page_every_s=0, model_name=MODEL, max_tokens_limit=300)) as base_url:
        yield base_url


@pytest.fixture
def tokenized(engine, monkeypatch):
    """The prompts the server's engine tokenized during the test: a refusal before any work adds none."""
    calls = []
    tokenize = engine.tokenize
    monkeypatch.setattr(engine, "tokenize", lambda prompt: calls.append(prompt) or tokenize(prompt))
    return calls


@pytest.fixture(autouse=True)
def fresh_pool(request):
    """Each test that uses the module's server engine starts with an empty cache and leaves
    every block free."""
    if "engine" not in request.fixturenames:
        yield
        return
    engine = request.getfixturevalue("engine")
    wait_until_idle(engine)
    assert engine.reset_prefix_cache()  # the engine's: /health shows the pool as it is
    yield
    wait_until_idle(engine)
