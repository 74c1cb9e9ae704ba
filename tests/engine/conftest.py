"""The engine's own fixture: the real default model, for the exactness tests that need a real
vocabulary and real weights (the tiny model and make_engine are in tests/conftest.py)."""

import pytest


@pytest.fixture(scope="session")
def smollm_session():
    from engine import Engine

    return Engine(num_blocks=128)  # the offline default, SmolLM2-135M-Instruct


@pytest.fixture
def smollm(smollm_session):
    """The real default model, shared by the tests that use it; the pool is checked after each."""
    from helpers import assert_pool_whole

    yield smollm_session
    assert_pool_whole(smollm_session)
