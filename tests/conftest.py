"""Fixtures for the engine tests: a tiny random Llama built in a second, the real default
model, and the rule every engine test ends with: the KV pool is whole again."""

import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine import Engine
from model_loader import default_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lessons"))  # the lessons' helper modules
from models import tiny_llama  # noqa: E402  (what a stage's --tiny runs is what the tests check)


def assert_pool_whole(engine: Engine) -> None:
    """No request holds a block: every block free, every ref count 0, the allocator consistent."""
    alloc = engine.allocator
    assert alloc.block_tables == {}, f"requests still hold blocks: {alloc.block_tables}"
    assert alloc.num_free_blocks == alloc.num_blocks
    assert all(alloc.ref_count(b) == 0 for b in range(alloc.num_blocks))
    alloc.check_invariants()


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
        kwargs = {"block_size": 4, "num_blocks": 64, **kwargs}
        engine = Engine(model=tiny_model, tokenizer=tokenizer, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_pool_whole(engine)


@pytest.fixture(scope="session")
def smollm_session():
    return Engine(num_blocks=128)  # the offline default, SmolLM2-135M-Instruct


@pytest.fixture
def smollm(smollm_session):
    """The real default model, shared by the tests that use it; the pool is checked after each."""
    yield smollm_session
    assert_pool_whole(smollm_session)
