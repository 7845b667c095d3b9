"""The real-server test infrastructure works, independently of llmspans.

Checks the facts about `transformers serve` and Phoenix that llmspans' integration tests rely on.
Needs LLMSPANS_REAL_SERVERS_DIR (see tests/support/realservers.py): skipped without it, failed in CI.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from tests.support import realservers
from tests.support.realservers import PhoenixServer, TransformersServer

# The session fixtures; redundant (but harmless: one server either way) once conftest.py registers
# `pytest_plugins = ["tests.support.realservers"]`.
phoenix = realservers.phoenix
transformers_serve = realservers.transformers_serve

MAX_TOKENS = 8


def _exporter(server: PhoenixServer, protocol: str) -> SpanExporter:
    if protocol == "http":
        return HttpSpanExporter(endpoint=server.traces_url, timeout=10)
    return GrpcSpanExporter(endpoint=server.grpc_endpoint, insecure=True, timeout=10)


@pytest.fixture
def openai_client(transformers_serve: TransformersServer) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=transformers_serve.base_url, api_key="x", max_retries=0)
    yield client
    client.close()


# --------------------------------------------------------------------------------------------------
# transformers serve


def _stream_once(server: TransformersServer, client: openai.OpenAI) -> tuple[list[Any], list[float]]:
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    arrivals: list[float] = []
    chunks = []
    for chunk in stream:
        arrivals.append(time.perf_counter() - started)
        chunks.append(chunk)
    return chunks, arrivals


def test_transformers_stream_shape(
    transformers_serve: TransformersServer, openai_client: openai.OpenAI
) -> None:
    for attempt in ("first request", "second request"):
        chunks, arrivals = _stream_once(transformers_serve, openai_client)

        # A role-only first chunk, one chunk per token, then a finish chunk that carries the usage.
        assert len(chunks) == 1 + MAX_TOKENS + 1, [c.model_dump(exclude_none=True) for c in chunks]
        first, tokens, last = chunks[0], chunks[1:-1], chunks[-1]
        assert first.choices[0].delta.role == "assistant"
        assert not first.choices[0].delta.content
        assert first.usage is None
        for chunk in tokens:
            assert chunk.choices[0].delta.content
            assert chunk.choices[0].finish_reason is None
            assert chunk.usage is None
        assert last.choices[0].finish_reason == "length"  # special tokens are unreachable: max_tokens decides
        assert not last.choices[0].delta.content
        assert last.usage is not None  # sent although stream_options.include_usage was not asked for
        assert last.usage.completion_tokens == MAX_TOKENS
        assert last.usage.prompt_tokens > 0
        assert last.usage.total_tokens == last.usage.prompt_tokens + MAX_TOKENS
        assert {chunk.id for chunk in chunks} == {first.id}
        assert first.model.startswith(transformers_serve.model)  # the server answers "<path>@main"
        gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals[1:-1])]
        print(
            f"\ntransformers serve, {attempt}: role chunk {arrivals[0] * 1000:.1f} ms, "
            f"first token {arrivals[1] * 1000:.1f} ms, finish chunk {arrivals[-1] * 1000:.1f} ms, "
            f"mean gap between tokens {sum(gaps) / len(gaps) * 1000:.2f} ms, model {first.model!r}"
        )


def test_transformers_stream_raw_sse(
    transformers_serve: TransformersServer, openai_client: openai.OpenAI
) -> None:
    """On the wire: `data:` events only, the last one the finish chunk: no `data: [DONE]`."""
    with openai_client.chat.completions.with_streaming_response.create(
        model=transformers_serve.model,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=3,
        temperature=0,
        stream=True,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert "data: [DONE]" not in lines
    events: list[dict[str, Any]] = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert len(events) == 1 + 3 + 1
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 3
    assert all("usage" not in event for event in events[:-1])


def test_transformers_deterministic(
    transformers_serve: TransformersServer, openai_client: openai.OpenAI
) -> None:
    def complete() -> str:
        response = openai_client.chat.completions.create(
            model=transformers_serve.model,
            messages=[{"role": "user", "content": "Say hello"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert response.choices[0].finish_reason == "length"
        assert response.usage is not None
        assert response.usage.completion_tokens == MAX_TOKENS
        return response.choices[0].message.content or ""

    first = complete()
    assert first
    assert complete() == first


# --------------------------------------------------------------------------------------------------
# Phoenix


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_phoenix_roundtrip(phoenix: PhoenixServer, protocol: str) -> None:
    project = f"realservers-{protocol}-{uuid.uuid4().hex[:12]}"
    provider = TracerProvider(
        resource=Resource.create({"openinference.project.name": project, "service.name": "realservers-test"})
    )
    provider.add_span_processor(SimpleSpanProcessor(_exporter(phoenix, protocol)))
    tracer = provider.get_tracer("tests.realservers")
    try:
        with tracer.start_as_current_span("parent", kind=SpanKind.CLIENT) as parent:
            parent.set_attributes(
                {
                    "test.int": 42,
                    "test.float": 0.25,
                    "test.bool": True,
                    "test.str": "hello",
                    "test.str_list": ["a", "b"],
                    "test.int_list": [1, 2, 3],
                }
            )
            with tracer.start_as_current_span("child") as child:
                child.add_event("something", {"n": 1})
                child.set_status(Status(StatusCode.ERROR, "boom"))
    finally:
        provider.shutdown()
    trace_id = parent.get_span_context().trace_id

    spans = phoenix.wait_for_spans(project, lambda found: len(found) >= 2, timeout=15, trace_id=trace_id)
    by_name = {span["name"]: span for span in spans}
    assert sorted(by_name) == ["child", "parent"]
    parent_span, child_span = by_name["parent"], by_name["child"]

    assert parent_span["context"]["trace_id"] == format(trace_id, "032x")
    assert parent_span["context"]["span_id"] == format(parent.get_span_context().span_id, "016x")
    assert parent_span["parent_id"] is None
    assert child_span["context"]["trace_id"] == parent_span["context"]["trace_id"]
    assert child_span["parent_id"] == parent_span["context"]["span_id"]

    attributes = parent_span["attributes"]
    assert attributes["test.int"] == 42
    assert type(attributes["test.int"]) is int
    assert attributes["test.float"] == 0.25
    assert type(attributes["test.float"]) is float
    assert attributes["test.bool"] is True
    assert attributes["test.str"] == "hello"
    assert attributes["test.str_list"] == ["a", "b"]
    assert attributes["test.int_list"] == [1, 2, 3]
    assert "service.name" not in attributes  # resource attributes are not stored

    assert child_span["status_code"] == "ERROR"
    assert child_span["status_message"] == "boom"
    assert [(event["name"], event["attributes"]) for event in child_span["events"]] == [
        ("something", {"n": 1})
    ]

    # The same spans without the trace filter; nothing in a project that was never written to.
    assert {span["name"] for span in phoenix.spans(project)} == {"child", "parent"}
    assert phoenix.spans(f"{project}-empty") == []


def test_phoenix_pagination(phoenix: PhoenixServer) -> None:
    project = f"realservers-pages-{uuid.uuid4().hex[:12]}"
    provider = TracerProvider(resource=Resource.create({"openinference.project.name": project}))
    provider.add_span_processor(SimpleSpanProcessor(_exporter(phoenix, "http")))
    tracer = provider.get_tracer("tests.realservers")
    try:
        for index in range(5):
            with tracer.start_as_current_span(f"span-{index}"):
                time.sleep(0.002)
    finally:
        provider.shutdown()
    phoenix.wait_for_spans(project, lambda found: len(found) == 5)
    names = [span["name"] for span in phoenix.spans(project, page_size=2)]
    assert names == [f"span-{index}" for index in range(5)]  # oldest start first, across 3 pages


def test_wait_for_spans_times_out_with_names(phoenix: PhoenixServer) -> None:
    with pytest.raises(AssertionError, match="condition not met"):
        phoenix.wait_for_spans(f"realservers-none-{uuid.uuid4().hex[:12]}", timeout=0.3)


# --------------------------------------------------------------------------------------------------
# The servers themselves


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on ``port``, from /proc/net/tcp{,6} (hex, as there)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].rpartition(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.add(address)
    return found


_LOOPBACK = {
    "0100007F",  # 127.0.0.1
    "0000000000000000FFFF00000100007F",  # ::ffff:127.0.0.1
    "00000000000000000000000001000000",  # ::1
}


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_servers_listen_on_loopback_only(
    phoenix: PhoenixServer, transformers_serve: TransformersServer
) -> None:
    ports = {
        "phoenix http": int(phoenix.http_endpoint.rsplit(":", 1)[1]),
        "phoenix grpc": int(phoenix.grpc_endpoint.rsplit(":", 1)[1]),
        "transformers serve": int(transformers_serve.root_url.rsplit(":", 1)[1]),
    }
    for name, port in ports.items():
        addresses = _listening_addresses(port)
        assert addresses, f"{name}: nothing listens on {port}"
        assert addresses <= _LOOPBACK, f"{name} listens on {addresses}"


def test_context_manager_stops_process_group() -> None:
    with realservers.transformers_server(warm_up=False) as server:
        port = int(server.root_url.rsplit(":", 1)[1])
        os.killpg(server.pid, 0)  # running, leading its own process group
        workdir = server.log_path.parent
        assert workdir.is_dir()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    assert not workdir.exists()


# --------------------------------------------------------------------------------------------------
# Skip or fail when the servers are missing (no servers needed)


@pytest.mark.parametrize(
    ("env", "outcome"),
    [
        ({}, pytest.skip.Exception),
        ({"CI": "true"}, pytest.fail.Exception),
        ({realservers.ENV_REQUIRE_REAL_SERVERS: "1"}, pytest.fail.Exception),
    ],
)
def test_missing_servers_skip_or_fail(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], outcome: type[BaseException]
) -> None:
    for name in ("CI", realservers.ENV_REQUIRE_REAL_SERVERS):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    monkeypatch.delenv(realservers.ENV_REAL_SERVERS_DIR, raising=False)
    with pytest.raises(outcome, match=r"install-real-servers\.sh"):
        realservers.find_install("phoenix")

    monkeypatch.setenv(realservers.ENV_REAL_SERVERS_DIR, str(tmp_path))
    with pytest.raises(outcome, match="tiny-model"):
        realservers.find_install("transformers")
