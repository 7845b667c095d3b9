"""The headers a call is sent with: with OpenTelemetry's default propagators the transport writes
`traceparent` (and `tracestate`) itself (issue 32), exactly as the propagators would; with baggage in the
context, or another propagator installed, the propagators write them. Over real HTTP, and header for header
against the SDK's own `propagate.inject` for the same context."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from opentelemetry import baggage, context, propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

import llmspans
from llmspans import _names as names
from llmspans import _transport
from llmspans.testing import Captured
from llmspans.tools.simulator import SimulatedServer

MESSAGES = [{"role": "user", "content": "hi"}]


def _parent(sampled: bool, state: TraceState | None = None) -> Any:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    span_context = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=flags, trace_state=state)
    return trace.set_span_in_context(NonRecordingSpan(span_context))


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "unsampled"])
@pytest.mark.parametrize(
    "state", [None, TraceState([("vendor", "v1"), ("other", "x")])], ids=["", "tracestate"]
)
@pytest.mark.parametrize("with_baggage", [False, True], ids=["", "baggage"])
def test_the_headers_are_the_propagators_own(
    sampled: bool, state: TraceState | None, with_baggage: bool
) -> None:
    tracer = TracerProvider().get_tracer("t")
    parent = _parent(sampled, state)
    if with_baggage:
        parent = baggage.set_baggage("tenant", "a b", context=parent)
    span = tracer.start_span("call", context=parent)
    inside = trace.set_span_in_context(span, parent)
    ours: dict[str, str] = {}
    _transport._inject(ours, inside, w3c_too=True)
    theirs: dict[str, str] = {}
    propagate.inject(theirs, context=inside)
    assert ours == theirs
    assert ours["traceparent"].endswith("-01" if sampled else "-00")
    assert ("tracestate" in ours) is (state is not None)
    assert ("baggage" in ours) is with_baggage


def test_an_unsampled_providers_call_sends_its_trace_as_not_sampled(server: SimulatedServer) -> None:
    from opentelemetry.sdk.metrics import MeterProvider

    from llmspans import _telemetry

    with _telemetry.use_providers(TracerProvider(sampler=ALWAYS_OFF), MeterProvider()):
        client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))
        client.chat.completions.create(model="m", messages=MESSAGES)
    server.wait_idle()
    (request,) = [r for r in server.requests if r.path.endswith("/chat/completions")]
    version, trace_id, span_id, flags = request.headers["traceparent"].split("-")
    assert version == "00"
    assert (len(trace_id), len(span_id)) == (32, 16)
    assert not int(flags, 16) & TraceFlags.SAMPLED  # (the SDK may set its random-trace-id flag, 0x02)


def test_baggage_and_tracestate_reach_the_server(server: SimulatedServer, captured: Captured) -> None:
    parent = baggage.set_baggage("tenant", "acme", context=_parent(True, TraceState([("vendor", "v1")])))
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))
    token = context.attach(parent)
    try:
        client.chat.completions.create(model="m", messages=MESSAGES)
    finally:
        context.detach(token)
    server.wait_idle()
    (request,) = [r for r in server.requests if r.path.endswith("/chat/completions")]
    (call,) = [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]
    assert request.headers["traceparent"] == f"00-{call.context.trace_id:032x}-{call.context.span_id:016x}-01"
    assert request.headers["tracestate"] == "vendor=v1"
    assert request.headers["baggage"] == "tenant=acme"
