"""Shared fixtures: every test records into private providers through llmspans' own testing helper."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmspans.testing import Captured, capture, reset
from llmspans.tools.simulator import SimulatedServer


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[SimulatedServer]:
    """The simulated OpenAI-compatible server on 127.0.0.1, one per test; a test module that wants
    another default behaviour for it sets `SERVER_BEHAVIOR`."""
    with SimulatedServer(getattr(request.module, "SERVER_BEHAVIOR", None)) as running:
        yield running


@pytest.fixture
def captured() -> Iterator[Captured]:
    with capture() as result:
        yield result


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    reset()
    yield
    reset()


# Shared fixtures: a local OTLP/HTTP receiver, and the real servers (Arize Phoenix, transformers serve)
# started on demand.
from tests.support.otlp_http import otlp_http_receiver  # noqa: E402, F401
from tests.support.realservers import phoenix, real_vllm, transformers_serve  # noqa: E402, F401
