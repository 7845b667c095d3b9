"""Shared fixtures: every test records into private providers through llmspans' own testing helper."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmspans import _budget, _guard
from llmspans.testing import Captured, capture


@pytest.fixture
def captured() -> Iterator[Captured]:
    with capture() as result:
        yield result


@pytest.fixture(autouse=True)
def _fresh_budgets() -> Iterator[None]:
    _budget.registry.reset()
    _guard._reported.clear()
    yield
    _budget.registry.reset()


# Shared fixtures: a local OTLP/HTTP receiver, and the real servers (Arize Phoenix, transformers serve)
# started on demand.
from tests.support.otlp_http import otlp_http_receiver  # noqa: E402, F401
from tests.support.realservers import phoenix, transformers_serve  # noqa: E402, F401
