"""Fixtures: a tiny random Llama built in a second, the real default model, engines over them
(every one checked at teardown: the KV pool is whole again), and the class server on a real
port over the tiny model. Helpers the test files share are in helpers.py."""

import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine import Engine
from helpers import MODEL, assert_pool_whole, serve, wait_until_idle
from model_loader import default_model_dir
from server import create_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lessons"))  # the lessons' helper modules
from models import tiny_llama  # noqa: E402  (what a stage's --tiny runs is what the tests check)

pytest_plugins = ["pytester"]  # test_grading.py runs the exercise tests against wrong solutions


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer: a real vocabulary and chat template (converted once, then cached)."""
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    """A 2-layer Llama with random weights and grouped-query attention (4 query heads share
    2 KV heads), in float32 so cached and uncached runs agree to ~1e-6."""
    return tiny_llama(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model, tokenizer, tmp_path_factory):
    """The tiny model saved like a Hugging Face checkpoint, for code that loads by path."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def make_engine(tiny_model, tokenizer):
    """Engine factory over the tiny model (block size 4 by default, so blocks fill fast);
    checks at teardown that every engine it made got all its blocks back."""
    engines = []

    def make(**kwargs) -> Engine:
        # A fixed budget unless a test asks for a target step time: plans the same on every machine.
        fixed = {} if "target_step_ms" in kwargs else {"max_num_batched_tokens": 2048}
        kwargs = {"block_size": 4, "num_blocks": 64, **fixed, **kwargs}
        engine = Engine(model=tiny_model, tokenizer=tokenizer, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        if engine.loop is not None:
            wait_until_idle(engine)  # a cancelled request is freed by the loop moments later
        assert_pool_whole(engine)


@pytest.fixture(scope="session")
def smollm_session():
    return Engine(num_blocks=128)  # the offline default, SmolLM2-135M-Instruct


@pytest.fixture
def smollm(smollm_session):
    """The real default model, shared by the tests that use it; the pool is checked after each."""
    yield smollm_session
    assert_pool_whole(smollm_session)


# --- the server, as python server.py runs it: the batching engine --------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    """The server's engine for a test module: batching, as python server.py's default; block
    size 4 so blocks fill fast, 64 blocks (256 tokens); a fixed budget of 2,048 tokens a step
    instead of the default target step time, so its steps are the same on every machine
    (tests/test_step_budget.py tests the target). A module may define its own."""
    return Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=64, batching=True,
                  max_num_batched_tokens=2048)


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
    assert engine.allocator.reset_prefix_cache()
    yield
    wait_until_idle(engine)
