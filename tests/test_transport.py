"""The transport layer (`llmspans/_transport.py`): attempts, retries, connections, trace context."""

from __future__ import annotations

import openai
import pytest
from opentelemetry.trace import StatusCode

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.openai_clients import MESSAGES, SECRET, async_client, call_span, sync_client
from tests.timing import (
    TOLERANCE,
    Window,
    assert_buckets_sum_to_duration,
    assert_client_view,
    attempt_spans,
    bucket,
    late,
    retry_timing,
)


def test_second_call_reuses_the_connection(server: SimulatedServer, captured: Captured) -> None:
    client = sync_client(server)
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    first, second = [s for s in captured.spans if s.name == "chat tiny"]
    assert first.attributes[names.CONNECT_REUSED] is False
    assert first.attributes[names.CONNECT_NEW] == 1
    assert bucket(first, "connect") > 0
    assert second.attributes[names.CONNECT_REUSED] is True
    assert names.CONNECT_NEW not in second.attributes  # nothing opened: nothing to count
    assert bucket(second, "connect") == 0
    assert server.connections_opened == 1


@pytest.mark.parametrize("use_async", [False, True])
@retry_timing
async def test_two_429s_then_success(server: SimulatedServer, captured: Captured, use_async: bool) -> None:
    server.enqueue(Behavior(status=429, retry_after_ms=40), Behavior(status=429, retry_after_ms=40))
    server.default = Behavior(chunks=3)
    with Window() as window:
        if use_async:
            await async_client(server).chat.completions.create(model="tiny", messages=MESSAGES)
        else:
            sync_client(server).chat.completions.create(model="tiny", messages=MESSAGES)
    span = call_span(captured)
    attempts = sorted(attempt_spans(captured), key=lambda s: s.start_time)
    assert [a.attributes.get(names.HTTP_REQUEST_RESEND_COUNT) for a in attempts] == [None, 1, 2]
    assert [a.attributes[names.HTTP_RESPONSE_STATUS_CODE] for a in attempts] == [429, 429, 200]
    assert [a.status.status_code.name for a in attempts] == ["ERROR", "ERROR", "UNSET"]
    assert all(a.parent.span_id == span.context.span_id for a in attempts)
    assert span.attributes[names.RETRY_COUNT] == 2
    assert list(span.attributes[names.RETRY_CAUSES]) == ["http_429", "http_429"]
    assert server.wait_idle()
    served = server.requests
    server_view = (served[2].arrived_ns - served[0].arrived_ns) * 1e-9
    slack = max(max(late(request) for request in served), window.beyond(server_view))
    assert_client_view(bucket(span, "retry"), server_view, slack)
    # two back-offs of 40 ms (the SDK honours retry-after-ms) plus two quick failed attempts
    assert 0.08 <= bucket(span, "retry") <= 0.08 + TOLERANCE + slack
    assert names.ERROR_TYPE not in span.attributes
    assert span.status.status_code.name == "UNSET"
    assert_buckets_sum_to_duration(span)
    causes = {
        p.attributes[names.METRIC_ATTR_RETRY_CAUSE]: p.value
        for p in captured.metric_points(names.METRIC_RETRY_ATTEMPTS)
    }
    assert causes == {"http_429": 2}


def test_traceparent_of_each_attempt_reaches_the_server(server: SimulatedServer, captured: Captured) -> None:
    server.enqueue(Behavior(status=503, retry_after_ms=1))
    sync_client(server).chat.completions.create(model="tiny", messages=MESSAGES)
    sent = [r.headers["traceparent"][:52] for r in server.requests]  # version, trace id, parent id
    first, second = sorted(attempt_spans(captured), key=lambda s: s.start_time)
    call = call_span(captured)
    # The first attempt went out before anyone knew it would fail: it named the call span. Its own
    # span was made when the second began, with its real start and end; the second names itself.
    assert sent == [
        f"00-{call.context.trace_id:032x}-{call.context.span_id:016x}",
        f"00-{second.context.trace_id:032x}-{second.context.span_id:016x}",
    ]
    assert call.start_time <= first.start_time < first.end_time <= second.start_time
    assert first.attributes[names.HTTP_RESPONSE_STATUS_CODE] == 503
    assert first.parent.span_id == second.parent.span_id == call.context.span_id


def test_connection_refused_counts_connect_errors(captured: Captured) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = llmspans.instrument(
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=SECRET, max_retries=1)
    )
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    span = call_span(captured)
    assert span.attributes[names.ERROR_TYPE] == "APIConnectionError"
    assert span.attributes[names.RETRY_COUNT] == 1
    assert list(span.attributes[names.RETRY_CAUSES]) == ["connect_error"]
    assert len(attempt_spans(captured)) == 2


def test_read_timeout_is_a_timeout_cause(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(header_delay=0.5)
    client = sync_client(server, max_retries=1, timeout=0.1)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    span = call_span(captured)
    assert list(span.attributes[names.RETRY_CAUSES]) == ["timeout"]
    assert span.attributes[names.ERROR_TYPE] == "APITimeoutError"


@pytest.mark.parametrize("stream", [False, True])
def test_an_attempt_whose_body_fails_after_the_headers_is_marked_failed(
    server: SimulatedServer, captured: Captured, stream: bool
) -> None:
    """A 200 whose body is cut off mid-read: the attempt failed, not just the call."""
    server.default = Behavior(chunks=6, drop_after=2)
    client = sync_client(server, {"attempt_spans": "always"}, max_retries=0)
    raised: Exception | None = None
    try:  # what the SDK raises differs between its versions (its own error or the HTTP library's)
        result = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=stream)
        for _ in result if stream else ():
            pass
    except Exception as error:
        raised = error
    assert raised is not None
    (attempt,) = attempt_spans(captured)
    assert attempt.attributes[names.HTTP_RESPONSE_STATUS_CODE] == 200
    assert attempt.status.status_code == StatusCode.ERROR
    assert attempt.attributes[names.ERROR_TYPE]  # the HTTP library's error, under the SDK's own
    assert call_span(captured).attributes[names.ERROR_TYPE] == type(raised).__qualname__


# --- vLLM reads only W3C trace context ----------------------------------------------------------


_PROPAGATION_RUN = """
import json, sys
import openai
import llmspans
from llmspans.testing import capture
from llmspans.tools.simulator import SimulatedServer

with SimulatedServer() as server, capture() as captured:
    for provider in ("vllm", "openai"):
        client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="x"), provider=provider)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    calls = [s for s in captured.spans if s.attributes.get("llmspans.stage") == "llm"]
    sent = [{k.lower(): v for k, v in r.headers.items()} for r in server.requests]
    print(json.dumps({
        "trace_ids": [format(s.context.trace_id, "032x") for s in calls],
        "headers": [{k: v for k, v in h.items() if k in ("traceparent", "b3", "x-b3-traceid")} for h in sent],
    }))
"""


def test_with_a_b3_propagator_vllm_still_gets_a_w3c_traceparent() -> None:
    """vLLM extracts only `traceparent`: with `OTEL_PROPAGATORS=b3` the client→server trace would break,
    so a `provider="vllm"` client sends W3C trace context too. Other providers get the app's choice alone."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OTEL_PROPAGATORS": "b3"}
    done = subprocess.run(
        [sys.executable, "-c", _PROPAGATION_RUN], env=env, capture_output=True, text=True, timeout=60, check=True
    )  # fmt: skip
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    (vllm_trace, openai_trace), (to_vllm, to_openai) = seen["trace_ids"], seen["headers"]
    assert to_vllm["b3"].startswith(vllm_trace)  # the app's propagator still ran
    assert to_vllm["traceparent"].split("-")[1] == vllm_trace
    assert to_openai["b3"].startswith(openai_trace)
    assert "traceparent" not in to_openai
