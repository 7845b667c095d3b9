"""A stand-in for Grafana Tempo's query API on 127.0.0.1, answering from OTLP-JSON trace files.

It answers what `llmspans report --tempo` asks, the way Tempo's docs and its protobuf JSON mapping
(gogo jsonpb) write it: `GET /api/search` with a TraceQL `{ resource.service.name = "S" }`, `start`,
`end` and `limit` (trace ids in hex without leading zeros, most recent first, an empty result with no
`traces` key); `GET /api/v2/traces/<id>` (`{"trace": {"resourceSpans": [...]}}`) and
`GET /api/traces/<id>` (`{"batches": [...]}`), whose spans have base64 ids, kinds and status codes by
name, 64-bit integers as strings and empty fields left out. Knobs on the server object: `v2` (False:
a Tempo before 2.6, the v2 path is an unknown route), `vanished` (ids answered 404), `tenant` and
`token` (required `X-Scope-OrgID` and `Authorization: Bearer`), `delay_s` (before each trace answer),
`status`/`body` (a canned answer to every request). It records every request and the most traces
being answered at once.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.support.local_http import serving

_KINDS = ["SPAN_KIND_UNSPECIFIED", "SPAN_KIND_INTERNAL", "SPAN_KIND_SERVER", "SPAN_KIND_CLIENT",
          "SPAN_KIND_PRODUCER", "SPAN_KIND_CONSUMER"]  # fmt: skip
_STATUS = ["STATUS_CODE_UNSET", "STATUS_CODE_OK", "STATUS_CODE_ERROR"]
_TRACEQL = re.compile(r'^\{ resource\.service\.name = "((?:[^"\\]|\\.)*)" \}$')


@dataclass
class StoredTrace:
    trace_id: str  # 32 hex digits
    services: set[str] = field(default_factory=set)
    start_ns: int = 0
    end_ns: int = 0
    # (resource, scope) -> spans, in the order they were read
    groups: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)


def _b64(hex_id: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_id)).decode()


def _tempo_span(span: dict[str, Any]) -> dict[str, Any]:
    """One span as Tempo's jsonpb writes it."""
    out: dict[str, Any] = {"traceId": _b64(span["traceId"]), "spanId": _b64(span["spanId"])}
    if span.get("parentSpanId"):
        out["parentSpanId"] = _b64(span["parentSpanId"])
    out["name"] = span["name"]
    kind = span.get("kind", 0)
    if kind:
        out["kind"] = _KINDS[kind] if isinstance(kind, int) else kind
    out["startTimeUnixNano"] = str(span["startTimeUnixNano"])
    out["endTimeUnixNano"] = str(span["endTimeUnixNano"])
    if span.get("attributes"):
        out["attributes"] = span["attributes"]
    if span.get("events"):
        out["events"] = [{**event, "timeUnixNano": str(event["timeUnixNano"])} for event in span["events"]]
    code = (span.get("status") or {}).get("code", 0)
    out["status"] = {"code": _STATUS[code] if isinstance(code, int) else code} if code else {}
    return out


def load_traces(paths: Sequence[Path]) -> dict[str, StoredTrace]:
    """The traces of OTLP-JSON lines files, as Tempo would hold them after ingesting every line."""
    traces: dict[str, StoredTrace] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            document = json.loads(line) if line.strip() else {}
            for resource_spans in document.get("resourceSpans", []):
                resource = resource_spans.get("resource", {})
                service = next(
                    (a["value"].get("stringValue") for a in resource.get("attributes", [])
                     if a["key"] == "service.name"),
                    "unknown_service",
                )  # fmt: skip
                for scope_spans in resource_spans.get("scopeSpans", []):
                    scope = scope_spans.get("scope", {})
                    for span in scope_spans.get("spans", []):
                        trace = traces.setdefault(span["traceId"], StoredTrace(span["traceId"]))
                        start, end = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
                        trace.start_ns = min(trace.start_ns or start, start)
                        trace.end_ns = max(trace.end_ns, end)
                        trace.services.add(str(service))
                        key = (json.dumps(resource, sort_keys=True), json.dumps(scope, sort_keys=True))
                        trace.groups.setdefault(key, []).append(span)
    return traces


def resource_spans(trace: StoredTrace) -> list[dict[str, Any]]:
    """A trace's spans grouped by resource and scope, in Tempo's encoding."""
    by_resource: dict[str, list[dict[str, Any]]] = {}
    for (resource, scope), spans in trace.groups.items():
        by_resource.setdefault(resource, []).append(
            {"scope": json.loads(scope), "spans": [_tempo_span(span) for span in spans]}
        )
    return [
        {"resource": json.loads(resource), "scopeSpans": scopes} for resource, scopes in by_resource.items()
    ]


class TempoHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Tempo's Go server
    disable_nagle_algorithm = True  # as Go's net/http: else headers and body wait on delayed ACKs (40 ms)

    def do_GET(self) -> None:
        server: Any = self.server
        url = urlsplit(self.path)
        query = {key: values[0] for key, values in parse_qs(url.query).items()}
        with server.lock:
            server.requests.append((url.path, query, dict(self.headers.items())))
        if server.status is not None:
            return self._send(server.status, server.body, "text/plain")
        if server.tenant is not None and self.headers.get("X-Scope-OrgID") != server.tenant:
            return self._send(401, b"no org id\n", "text/plain")
        if server.token is not None and self.headers.get("Authorization") != f"Bearer {server.token}":
            return self._send(401, b"unauthorized\n", "text/plain")
        if url.path == "/api/search":
            return self._search(server, query)
        for prefix, version in (("/api/v2/traces/", 2), ("/api/traces/", 1)):
            if url.path.startswith(prefix):
                return self._trace(server, url.path[len(prefix) :], version)
        self._send(404, b"404 page not found\n", "text/plain")

    def _search(self, server: Any, query: dict[str, str]) -> None:
        match = _TRACEQL.match(query.get("q", ""))
        if match is None:
            return self._send(400, b"invalid TraceQL query: parse error\n", "text/plain")
        service = re.sub(r"\\(.)", r"\1", match[1])
        start_s, end_s = int(query["start"]), int(query["end"])
        limit = int(query.get("limit", "20"))
        found = server.found(service, start_s, end_s)[:limit]
        body: dict[str, Any] = {"metrics": {"inspectedBytes": "1024", "completedJobs": 1, "totalJobs": 1}}
        if found:
            body["traces"] = [
                {
                    "traceID": trace.trace_id.lstrip("0") or "0",
                    "rootServiceName": sorted(trace.services)[0],
                    "startTimeUnixNano": str(trace.start_ns),
                    "durationMs": (trace.end_ns - trace.start_ns) // 1_000_000,
                }
                for trace in found
            ]
        self._send(200, json.dumps(body).encode(), "application/json")

    def _trace(self, server: Any, trace_id: str, version: int) -> None:
        if version == 2 and not server.v2:
            return self._send(404, b"404 page not found\n", "text/plain")
        with server.lock:
            server.in_flight += 1
            server.most_in_flight = max(server.most_in_flight, server.in_flight)
        try:
            if server.delay_s:
                time.sleep(server.delay_s)
            trace = server.traces.get(trace_id.lower().rjust(32, "0"))
            if trace is None or trace.trace_id in server.vanished:
                return self._send(404, b"trace not found\n", "text/plain")
            spans = resource_spans(trace)
            body = {"trace": {"resourceSpans": spans}} if version == 2 else {"batches": spans}
            self._send(200, json.dumps(body).encode(), "application/json")
        finally:
            with server.lock:
                server.in_flight -= 1

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        try:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (
            BrokenPipeError,
            ConnectionResetError,
        ):  # the client gave up (its first failure stops the rest)
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


def _found(traces: dict[str, StoredTrace]) -> Any:
    def found(service: str, start_s: int, end_s: int) -> list[StoredTrace]:
        """Traces with a span of `service` overlapping [start, end], most recent first (Tempo's order)."""
        hits = [
            trace
            for trace in traces.values()
            if service in trace.services
            and trace.end_ns >= start_s * 10**9
            and trace.start_ns <= end_s * 10**9
        ]
        return sorted(hits, key=lambda trace: -trace.start_ns)

    return found


@contextmanager
def tempo_server(
    paths: Sequence[Path], handler: type[TempoHandler] | None = None, **knobs: Any
) -> Iterator[ThreadingHTTPServer]:
    """A Tempo stand-in serving the traces of `paths` (with `handler`, a TempoHandler that answers some
    path otherwise); `.url` is its base URL."""
    traces = load_traces(paths)
    state: dict[str, Any] = {
        "traces": traces, "found": _found(traces), "requests": [], "lock": threading.Lock(), "in_flight": 0,
        "most_in_flight": 0, "v2": True, "vanished": set(), "tenant": None, "token": None, "delay_s": 0.0,
        "status": None, "body": b"",
    }  # fmt: skip
    state.update(knobs)
    with serving(handler or TempoHandler, **state) as server:
        server.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
        yield server
