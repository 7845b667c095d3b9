"""Shared fixtures: every test records into private providers through llmspans' own testing helper."""

from __future__ import annotations

import os
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

# --- pytest-xdist: which tests share a worker -------------------------------------------------------------
# `.ci/run` runs the suite on two workers (`-n 2 --dist loadgroup`): much of it waits on servers, sleeps and
# scrapes rather than on the CPU. A real server is started once per worker that asks for it, so every test
# of one server kind goes to one worker: the real vLLM (the session's, and test_load_peer's own pinned one,
# which must not run beside it), and Phoenix with transformers serve. Every other module is one group, so a
# module's fixtures are set up once. A test that names its own `xdist_group` keeps it.
SERVER_GROUPS = {"real_vllm": "vllm", "phoenix": "servers", "transformers_serve": "servers"}
MODULE_GROUPS = {"test_load_peer": "vllm"}
FIRST = ("vllm", "servers")
"""Handed out first (xdist gives a worker the next group when it runs low): the longest groups, so that
the last minutes are short modules on both workers, not one worker alone on the real vLLM."""


def _group(item: pytest.Item) -> str:
    module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else item.nodeid
    fixtures = getattr(item, "fixturenames", ())
    for fixture, group in SERVER_GROUPS.items():
        if fixture in fixtures:
            return group
    return MODULE_GROUPS.get(module, module)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's collection order is the order groups go out
        first = {group: rank for rank, group in enumerate(FIRST)}

        def rank(item: pytest.Item) -> int:
            marker = item.get_closest_marker("xdist_group")
            name = (marker.args[0] if marker.args else marker.kwargs.get("name")) if marker else None
            return first.get(str(name), len(first))

        items.sort(key=rank)
