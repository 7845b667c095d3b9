"""Instrumentation never hurts the app: internal failures are logged once and swallowed.

Each test breaks one internal hook and checks that the caller sees exactly what an
uninstrumented client gives, that the error is logged once (not per chunk), and that the
call span still ends.
"""

from __future__ import annotations

import logging
from typing import Any

import openai
import pytest

import llmspans
from llmspans import _call, _guard, _transport
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer

MESSAGES = [{"role": "user", "content": "hi"}]


SERVER_BEHAVIOR = Behavior(chunks=5, usage="finish")


def chunks_of(client: openai.OpenAI) -> list[Any]:
    stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    return [c.choices[0].delta.content for c in stream if c.choices]


def broken(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("llmspans bug")


@pytest.mark.parametrize(
    ("target", "attribute", "attempt_spans"),
    [
        (_call.CallRecord, "content_chunk", None),
        (_call.CallRecord, "set_usage", None),
        (_call.CallRecord, "_record_metrics", None),
        (_call.CallRecord, "instants_ns", None),
        (_transport._AttemptScope, "on_trace_event", None),
        (_transport, "end_attempt_span", "always"),  # only an attempt that has a span gets there
    ],
)
def test_a_broken_hook_leaves_the_stream_intact(
    server: SimulatedServer, captured: Captured, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    target: type, attribute: str, attempt_spans: str | None,
) -> None:  # fmt: skip
    expected = chunks_of(openai.OpenAI(base_url=server.base_url, api_key="k"))
    monkeypatch.setattr(target, attribute, broken)
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k"), attempt_spans=attempt_spans
    )
    with caplog.at_level(logging.WARNING, logger="llmspans"):
        assert chunks_of(client) == expected
        assert chunks_of(client) == expected
    internal = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert len(internal) == 1, [r.getMessage() for r in caplog.records]
    calls = [s for s in captured.spans if s.name == "chat m"]
    assert len(calls) == 2  # ended despite the failure


@pytest.mark.parametrize(
    "site", ["openai.begin", "openai.result", "transport.begin", "transport.response", "call.finish"]
)
def test_injected_faults_at_each_site(server: SimulatedServer, captured: Captured, site: str) -> None:
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k"))
    expected = chunks_of(openai.OpenAI(base_url=server.base_url, api_key="k"))
    with _guard.inject_faults(site):
        assert chunks_of(client) == expected
        result = client.chat.completions.create(model="m", messages=MESSAGES)
    assert result.choices[0].message.content
    for span in captured.spans:
        assert span.end_time is not None


def test_user_exceptions_surface_unchanged_with_a_broken_finish(
    server: SimulatedServer, captured: Captured, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.default = Behavior(status=400)
    monkeypatch.setattr(_call.CallRecord, "_record_metrics", broken)
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k"))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert captured.spans[-1].status.status_code.name == "ERROR"


def test_a_malformed_chunk_is_passed_through(captured: Captured, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk the adapter cannot read (no `choices` attribute at all) still reaches the caller."""
    from llmspans._adapters import openai_sdk as _openai

    def odd_item(call: Any, item: Any, now: int) -> bool:
        return bool(item.not_an_attribute)

    monkeypatch.setattr(_openai, "_chat_item", odd_item)
    with SimulatedServer(Behavior(chunks=3)) as server:
        client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k"))
        assert len(chunks_of(client)) == 5  # role chunk, three tokens, finish chunk
    (call,) = [s for s in captured.spans if s.name == "chat m"]
    assert call.attributes[names.STREAM_OUTCOME] == "completed"


def test_a_broken_exporter_never_reaches_the_app(server: SimulatedServer) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter

    class Exploding(SpanExporter):
        def export(self, spans: Any) -> Any:
            raise ConnectionError("collector down")

    from opentelemetry.sdk.metrics import MeterProvider

    from llmspans import _telemetry

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Exploding()))
    with _telemetry.use_providers(provider, MeterProvider()):
        client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k"))
        assert len(chunks_of(client)) == 7
