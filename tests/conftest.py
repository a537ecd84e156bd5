"""Shared fixtures: one real redis-server on a free loopback port per test session."""

from __future__ import annotations

import uuid

import pytest

from streamrl.buffer import EmbeddedRedis, Namespace


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def ns(redis_server) -> Namespace:
    """A fresh run namespace, so tests never see each other's keys."""
    return Namespace.open(redis_server.url, f"test-{uuid.uuid4().hex[:10]}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A small Llama with a locally trained BPE tokenizer, saved as a plain HF directory."""
    from streamrl.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))
