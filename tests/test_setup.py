"""configure(): the embedded default file, OTLP export, and respect for an existing set-up.

Each scenario runs in a fresh interpreter, because global providers can be set once per process
and flushing at interpreter exit is part of what is tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import llmspans
from llmspans import _names as names
from llmspans import _setup
from llmspans.testing import Captured
from tests.support.otlp_http import otlp_grpc_receiver

APP = """
import llmspans, time
@llmspans.retrieval
def search():
    time.sleep(0.01)
with llmspans.turn("chat", budget=2.5):
    search()
"""


def run_python(
    *parts: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    code = "\n".join(textwrap.dedent(part) for part in parts)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    result = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **(env or {})}, cwd=cwd,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result


def read_lines(path: Path) -> tuple[list[ExportTraceServiceRequest], list[ExportMetricsServiceRequest]]:
    traces, metrics = [], []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "resourceSpans" in record:
            traces.append(json_format.Parse(line, ExportTraceServiceRequest()))
        else:
            metrics.append(json_format.Parse(line, ExportMetricsServiceRequest()))
    return traces, metrics


def span_names(requests: list[ExportTraceServiceRequest]) -> list[str]:
    return [
        span.name for r in requests for rs in r.resource_spans for ss in rs.scope_spans for span in ss.spans
    ]


def test_embedded_default_writes_otlp_json_lines_flushed_at_exit(tmp_path: Path) -> None:
    run_python("import llmspans; cfg = llmspans.configure(service_name='rag'); print(cfg.mode, cfg.traces_file)", APP,
               cwd=tmp_path)  # fmt: skip
    path = tmp_path / "llmspans-traces.jsonl"
    traces, metrics = read_lines(path)
    assert sorted(span_names(traces)) == ["retrieval search", "turn chat"]
    raw = [json.loads(line) for line in path.read_text().splitlines() if "resourceSpans" in line]
    span = raw[0]["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(span["traceId"]) == 32  # OTLP JSON: ids are hex, as Jaeger's /api/v3 returns them
    int(span["traceId"], 16)
    resource = {a["key"]: a["value"] for a in raw[0]["resourceSpans"][0]["resource"]["attributes"]}
    assert resource["service.name"] == {"stringValue": "rag"}
    metric_names = {
        m.name for r in metrics for rm in r.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    assert {"llmspans.stage.duration", "llmspans.stage.budget"} <= metric_names


def test_traces_file_from_argument_and_environment(tmp_path: Path) -> None:
    run_python(f"import llmspans; llmspans.configure(traces_file={str(tmp_path / 'a.jsonl')!r})", APP)
    assert span_names(read_lines(tmp_path / "a.jsonl")[0])
    out = run_python("import llmspans; print(llmspans.configure().traces_file)", APP,
                     env={"LLMSPANS_TRACES_FILE": str(tmp_path / "sub" / "b.jsonl")})  # fmt: skip
    assert out.stdout.strip() == str(tmp_path / "sub" / "b.jsonl")
    assert span_names(read_lines(tmp_path / "sub" / "b.jsonl")[0])


def test_existing_provider_is_kept_and_configure_says_so(tmp_path: Path) -> None:
    out = run_python(
        """
        import logging
        logging.basicConfig(level=logging.INFO)
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        mine = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(mine))
        trace.set_tracer_provider(provider)
        import llmspans
        cfg = llmspans.configure()
        assert trace.get_tracer_provider() is provider
        again = llmspans.configure()
        assert again is cfg
        """,
        APP,
        """
        print(cfg.mode, sorted(s.name for s in mine.get_finished_spans()))
        """,
        cwd=tmp_path,
    )
    assert out.stdout.strip() == "existing ['retrieval search', 'turn chat']"
    assert out.stderr.count("left the application's existing TracerProvider") == 1
    assert (
        not (tmp_path / "llmspans-traces.jsonl").exists()
        or "resourceSpans" not in (tmp_path / "llmspans-traces.jsonl").read_text()
    )


def test_explicit_file_is_added_to_an_existing_sdk_provider(tmp_path: Path) -> None:
    target = tmp_path / "added.jsonl"
    run_python(
        f"""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        trace.set_tracer_provider(TracerProvider())
        import llmspans
        assert "added" in llmspans.configure(traces_file={str(target)!r}).notes[0]
        """,
        APP,
    )
    assert sorted(span_names(read_lines(target)[0])) == ["retrieval search", "turn chat"]


def test_otlp_http_endpoint_argument_exports_spans_and_metrics(
    otlp_http_receiver: ThreadingHTTPServer,
) -> None:
    port = otlp_http_receiver.server_address[1]
    run_python(f"import llmspans; llmspans.configure(endpoint='http://127.0.0.1:{port}', headers={{'x-team': 'a'}})",
               APP)  # fmt: skip
    received = otlp_http_receiver.received  # type: ignore[attr-defined]
    traces = [
        ExportTraceServiceRequest.FromString(body) for path, body, _ in received if path == "/v1/traces"
    ]
    assert sorted(span_names(traces)) == ["retrieval search", "turn chat"]
    assert any(path == "/v1/metrics" for path, _, _ in received)
    assert all(headers.get("x-team") == "a" for _, _, headers in received)


def test_otlp_environment_variables_are_respected(
    otlp_http_receiver: ThreadingHTTPServer, tmp_path: Path
) -> None:
    port = otlp_http_receiver.server_address[1]
    out = run_python(
        "import llmspans; cfg = llmspans.configure(); print(cfg.mode, cfg.protocol, cfg.service_name)", APP,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_SERVICE_NAME": "from-env",
             "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20t"},
        cwd=tmp_path,
    )  # fmt: skip
    assert out.stdout.split()[:3] == ["otlp", "http/protobuf", "from-env"]
    traces = [
        ExportTraceServiceRequest.FromString(b)
        for p, b, _ in otlp_http_receiver.received
        if p == "/v1/traces"
    ]  # type: ignore[attr-defined]
    service = {a.key: a.value.string_value for a in traces[0].resource_spans[0].resource.attributes}[
        "service.name"
    ]
    assert service == "from-env"
    assert not (tmp_path / "llmspans-traces.jsonl").exists()


def test_otlp_grpc_protocol(tmp_path: Path) -> None:
    received: list[ExportTraceServiceRequest] = []
    with otlp_grpc_receiver(lambda request, _context: received.append(request)) as port:
        run_python(
            f"import llmspans; llmspans.configure(endpoint='http://127.0.0.1:{port}', protocol='grpc')", APP
        )
    assert sorted(span_names(received)) == ["retrieval search", "turn chat"]


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"protocol": "udp"}, ValueError, "protocol must be one of"),
        ({"endpoint": "localhost"}, ValueError, "endpoint must be a URL"),
        ({"service_name": ""}, TypeError, "service_name"),
        ({"traces_file": 3}, TypeError, "traces_file must be a path"),
        ({"budgets": "retrieval=never"}, ValueError, "'retrieval'"),
        ({"budgets": 5}, TypeError, "mapping"),
        ({"capture_content": "yes"}, TypeError, "capture_content"),
        ({"headers": {"a": 1}}, TypeError, "headers"),
        ({"metric_interval": 0}, ValueError, "metric_interval"),
    ],
)
def test_bad_configure_arguments(kwargs: dict[str, object], error: type[Exception], fragment: str) -> None:
    before = _setup.current()
    with pytest.raises(error, match=fragment):
        llmspans.configure(**kwargs)  # type: ignore[arg-type]
    assert _setup.current() is before


# --- metrics only where they can go -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "environ", "destination", "endpoint"),
    [
        ({}, {}, "file", None),  # the embedded default: metrics in the file, with the spans
        ({"traces_file": "t.jsonl"}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "file", None),
        ({"endpoint": "http://c:4318"}, {}, "otlp", "http://c:4318"),
        ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "otlp", None),
        ({}, {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://m:4318/v1/metrics"}, "otlp", None),
        # A traces-only backend (Phoenix, Jaeger): no metrics sent to a default address nobody named.
        ({}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://phoenix:6006/v1/traces"}, "none", None),
        (
            {},
            {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t",
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://m",
            },
            "otlp",
            None,
        ),
        ({"endpoint": "http://c:4318"}, {"OTEL_METRICS_EXPORTER": "none"}, "none", None),
        ({"endpoint": "http://c:4318"}, {"OTEL_METRICS_EXPORTER": "prometheus"}, "none", None),
        ({"endpoint": "http://c:4318", "metrics": False}, {}, "none", None),
        ({"metrics": True}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t"}, "otlp", None),
    ],
)
def test_metrics_go_only_where_they_can(
    arguments: dict[str, Any], environ: dict[str, str], destination: str, endpoint: str | None
) -> None:
    from llmspans._setup import metrics_route

    route = metrics_route(
        endpoint=arguments.get("endpoint"), traces_file=arguments.get("traces_file"),
        metrics=arguments.get("metrics"), protocol=None, environ=environ,
    )  # fmt: skip
    assert (route.destination, route.endpoint) == (destination, endpoint)
    if destination == "none":
        assert route.why  # said in configure()'s notes


_TRACES_ONLY_APP = """
import json
import llmspans
configuration = llmspans.configure(service_name="traces-only", metric_interval=0.1)
with llmspans.turn("t"):
    pass
import time; time.sleep(0.5)
print(json.dumps({"metrics_mode": configuration.metrics_mode, "notes": configuration.notes}))
"""


def test_a_traces_only_endpoint_gets_spans_and_no_metric_is_sent_anywhere(tmp_path: Path) -> None:
    """Only OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set (Phoenix, a traces-only backend): the spans reach it, no
    metric export is attempted there or at localhost:4318, and configure() says why."""
    import json
    import os
    import subprocess
    import sys
    from http.server import BaseHTTPRequestHandler

    from tests.support.local_http import serving

    class Receiver(BaseHTTPRequestHandler):
        server: Any

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.server.paths.append(self.path)
            self.send_response(200 if self.path == "/v1/traces" else 405)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    with serving(Receiver, paths=[]) as receiver:
        env = {
            key: value for key, value in os.environ.items()
            if not key.startswith(("OTEL_", "LLMSPANS_"))
        }  # fmt: skip
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
        done = subprocess.run(
            [sys.executable, "-c", _TRACES_ONLY_APP], env=env, capture_output=True, text=True, timeout=60, check=True
        )  # fmt: skip
        paths = list(receiver.paths)  # type: ignore[attr-defined]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["metrics_mode"] == "none"
    assert any("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT" in note for note in said["notes"])
    assert "/v1/traces" in paths
    assert "/v1/metrics" not in paths
    assert "4318" not in done.stderr  # nothing tried the default metrics address


def test_openinference_kinds_and_project_only_when_asked(captured: Captured) -> None:
    from llmspans import _openinference

    @llmspans.stage("guardrail")
    def check() -> bool:
        return True

    @llmspans.tool
    def lookup() -> str:
        return "x"

    with llmspans.turn("plain"):
        check()
    assert all(names.OPENINFERENCE_SPAN_KIND not in (s.attributes or {}) for s in captured.spans)
    captured.clear()
    _openinference.configure(True)
    try:
        with llmspans.turn("phoenix"):
            check()
            lookup()
        assert _openinference.project_attributes("svc") == {names.OPENINFERENCE_PROJECT_NAME: "svc"}
    finally:
        _openinference.reset()
    kinds = {
        s.name.split(".")[-1]: (s.attributes or {}).get(names.OPENINFERENCE_SPAN_KIND) for s in captured.spans
    }
    assert kinds == {"check": "GUARDRAIL", "execute_tool lookup": None, "turn phoenix": "CHAIN"}
    assert _openinference.project_attributes("svc") == {}
