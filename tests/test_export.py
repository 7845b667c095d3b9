"""OTLP export from `configure()`: compression, headers, and an endpoint that is down or never answers.

Each scenario runs the application in a fresh interpreter (global providers are set once per
process, and exit is part of what is tested). Compression and headers are checked twice: against
a real OTLP backend (Arize Phoenix, which sorts spans into the project its `x-project-name` header
names), and against a small local receiver that shows the bytes and headers that arrived. An outage
is a closed port, or a port that accepts connections and never answers: the app's calls must take
no longer than uninstrumented calls made in the same process, nothing may raise, exactly one
warning may be logged, memory must stay flat over 5,000 spans, and the process must exit within
`SHUTDOWN_BOUND_S`.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import llmspans
from llmspans import _exporters, _setup
from tests.support.otlp_http import otlp_grpc_receiver
from tests.support.outage import assert_no_slower, run_outage_app
from tests.support.realservers import PhoenixServer, flatten

APP = """
import llmspans, openai
from llmspans.tools.simulator import Behavior, SimulatedServer
llmspans.configure(service_name="export-test", **CONFIGURE)
with SimulatedServer(Behavior(chunks=3, usage="finish")) as server:
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="sk-never-exported"))
    with llmspans.turn("chat"):
        list(client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], stream=True))
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    return {**env, **extra}


def run_app(configure: dict[str, Any], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = f"CONFIGURE = {configure!r}\n" + textwrap.dedent(APP)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env or clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result


def span_names(request: ExportTraceServiceRequest) -> list[str]:
    return [span.name for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]


# ----------------------------------------------------------------------------------------------
# Against a real backend


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_gzip_and_headers_reach_phoenix(phoenix: PhoenixServer, protocol: str) -> None:
    """Over HTTP the project comes from the `x-project-name` header we send; Phoenix reads that header
    only over HTTP, so over gRPC it comes from the resource attribute."""
    project = f"llmspans-export-{uuid.uuid4().hex[:8]}"
    configure: dict[str, Any] = {"protocol": protocol, "compression": "gzip", "attempt_spans": "always"}
    env = clean_env()
    if protocol == "http/protobuf":
        configure.update(endpoint=phoenix.http_endpoint, headers={"x-project-name": project})
    else:
        configure.update(endpoint=phoenix.grpc_endpoint)
        env["OTEL_RESOURCE_ATTRIBUTES"] = f"openinference.project.name={project}"
    run_app(configure, env)
    spans = phoenix.wait_for_spans(project, lambda found: len(found) >= 3, timeout=20)
    by_name = {span["name"]: span for span in spans}
    assert set(by_name) == {"turn chat", "chat sim", "POST"}
    assert by_name["chat sim"]["parent_id"] == by_name["turn chat"]["context"]["span_id"]
    assert flatten(by_name["chat sim"]["attributes"])["llmspans.stream.chunks"] == 3
    assert "sk-never-exported" not in json.dumps(spans)


# ----------------------------------------------------------------------------------------------
# Against a local receiver that shows what arrived


@pytest.fixture
def receiver(otlp_http_receiver: ThreadingHTTPServer) -> ThreadingHTTPServer:
    return otlp_http_receiver


@pytest.mark.parametrize("source", ["argument", "environment"])
def test_gzip_and_headers_over_http(receiver: ThreadingHTTPServer, source: str) -> None:
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    env = clean_env(OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer%20t0k3n,x-team=from-env")
    if source == "argument":
        configure = {"endpoint": endpoint, "compression": "gzip", "headers": {"x-team": "from-argument"}}
    else:
        configure = {}
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_COMPRESSION="gzip")
    run_app(configure, env)
    received = receiver.received  # type: ignore[attr-defined]
    assert {path for path, _, _ in received} == {"/v1/traces", "/v1/metrics"}
    for _path, body, headers in received:
        assert headers["content-encoding"] == "gzip"
        assert body[:2] == b"\x1f\x8b"  # really gzip, not just labelled so
        assert headers["authorization"] == "Bearer t0k3n"  # the variable's header, alongside ...
        assert headers["x-team"] == (
            "from-argument" if source == "argument" else "from-env"
        )  # ... and the argument's
    traces = [
        ExportTraceServiceRequest.FromString(gzip.decompress(b)) for p, b, _ in received if p == "/v1/traces"
    ]
    assert sorted(name for request in traces for name in span_names(request)) == ["chat sim", "turn chat"]


def test_headers_from_the_argument_and_the_environment_over_grpc() -> None:
    metadata: list[dict[str, str]] = []
    names: list[str] = []

    def exported(request: ExportTraceServiceRequest, context: Any) -> None:
        metadata.append(dict(context.invocation_metadata()))
        names.extend(span_names(request))

    with otlp_grpc_receiver(exported) as port:
        run_app(
            {"endpoint": f"http://127.0.0.1:{port}", "protocol": "grpc", "compression": "gzip",
             "headers": {"X-Team": "from-argument"}},
            clean_env(OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer%20t0k3n,x-team=from-env"),
        )  # fmt: skip
    assert sorted(names) == ["chat sim", "turn chat"]
    assert all(m["authorization"] == "Bearer t0k3n" and m["x-team"] == "from-argument" for m in metadata)


@pytest.mark.parametrize(
    ("kwargs", "env", "fragment"),
    [
        ({"compression": "brotli"}, {}, "compression must be one of"),
        ({"compression": 1}, {}, "compression must be one of"),
        (
            {"endpoint": "http://127.0.0.1:9"},
            {"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"},
            "OTEL_EXPORTER_OTLP_COMPRESSION",
        ),
    ],
)
def test_bad_compression_is_a_clear_value_error(
    kwargs: dict[str, Any], env: dict[str, str], fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if env:  # a bad variable is only read when an exporter is built: check it in a fresh interpreter
        code = f"import llmspans\ntry:\n    llmspans.configure(**{kwargs!r})\nexcept ValueError as e:\n    print(e)\n"
        out = subprocess.run(
            [sys.executable, "-c", code], env=clean_env(**env), capture_output=True, text=True, timeout=60
        )
        assert fragment in out.stdout, out
        assert "'zstd'" in out.stdout, out
        return
    before = _setup.current()
    with pytest.raises(ValueError, match=fragment):
        llmspans.configure(**kwargs)
    assert _setup.current() is before


# ----------------------------------------------------------------------------------------------
# An endpoint that is down, or that never answers


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never answers (nor reads)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    listener.settimeout(0.1)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    for connection in held:
        connection.close()
    listener.close()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # closed again when the block ends: connections are refused


class Clock:
    """`time.monotonic` for `_exporters`, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_at_exit_no_signal_starts_an_export_after_the_first_export_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The exit's bound is shared: an endpoint not known down still gets its final flush at once, a
    down one none, and past `EXPORT_TIMEOUT_S` after the exit began no signal starts a real export, so
    the export in flight and one more end within `SHUTDOWN_BOUND_S` whatever the signals' states."""
    clock = Clock()
    monkeypatch.setattr(_exporters, "time", clock)
    spans = _exporters.ExportHealth("spans", "http://127.0.0.1:1/v1/traces", warn=False)
    metrics = _exporters.ExportHealth("metrics", "http://127.0.0.1:1/v1/metrics", warn=False)
    spans.failed(1, "Connection refused")
    assert metrics.should_attempt()
    assert not spans.should_attempt()  # they wait for their next probe
    _exporters.mark_closing((spans, metrics))
    clock.now += 0.1
    assert metrics.should_attempt(), "a final flush to an endpoint not known down"
    clock.now += _exporters.PROBE_INTERVAL_S
    assert not spans.should_attempt(), "a down endpoint is not probed at exit"
    clock.now = 1000.0 + _exporters.SHUTDOWN_BOUND_S - _exporters.EXPORT_TIMEOUT_S + 0.01
    assert not metrics.should_attempt(), "started this late, an export could outlast the bound"


CALLS = 25


@pytest.mark.parametrize(
    ("protocol", "outage"),
    [("http/protobuf", "closed"), ("http/protobuf", "silent"), ("grpc", "silent")],
)
def test_an_unreachable_endpoint_costs_the_app_nothing(protocol: str, outage: str, silent_port: int) -> None:
    port = closed_port() if outage == "closed" else silent_port
    endpoint = f"http://127.0.0.1:{port}"
    run = run_outage_app(endpoint, protocol, "outage", CALLS)
    result, exit_took, stderr = run.result, run.exit_took, run.stderr

    # The calls: no slower than uninstrumented ones beside them in the same process (a tolerance for the
    # instrumentation itself), although the exporter thread was failing or hanging all along.
    assert_no_slower(result)
    # Memory: 5,000 more spans while the queue is full; an unbounded queue grows about 15 MB here.
    assert result["rss_growth"] < 4_000_000, result
    assert result["dropped"] >= _exporters.SPAN_BATCH_SIZE, result  # counted, not silently lost
    # Exit: bounded, although nothing was ever delivered.
    assert exit_took < _exporters.SHUTDOWN_BOUND_S + 1.5, exit_took

    records = run.records()
    warnings = run.warnings()
    target = f"{endpoint}/v1/traces" if protocol == "http/protobuf" else endpoint
    assert len(warnings) == 1, stderr
    assert warnings[0].startswith(f"llmspans: could not export spans to {target} (")
    assert ("Connection refused" if outage == "closed" else "no answer within") in warnings[0]
    assert "spans are being dropped" in warnings[0]
    # The OpenTelemetry SDK's own records are kept, each message at most once (they repeat per retry).
    sdk_messages = [
        (name, re.sub(r"\d+(\.\d+)?", "N", message))
        for name, _, message in records
        if name.startswith("opentelemetry")
    ]
    assert len(sdk_messages) == len(set(sdk_messages)), stderr
