"""A local OTLP/HTTP receiver that keeps what arrived: path, headers (lower-case) and raw body."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

import pytest

from tests.support.local_http import serving


class Received(NamedTuple):
    path: str
    body: bytes
    headers: dict[str, str]


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.received.append(Received(self.path, body, headers))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def otlp_http_receiver() -> Iterator[ThreadingHTTPServer]:
    """A receiver on 127.0.0.1; `.received` lists `Received` records, `.server_address[1]` is its port."""
    with serving(_Handler, received=[]) as server:
        yield server


@contextlib.contextmanager
def otlp_grpc_receiver(on_export: Callable[[Any, Any], None]) -> Iterator[int]:
    """An OTLP/gRPC trace receiver on 127.0.0.1 (its port, which the OS picks): `on_export(request, context)` for
    each export it takes."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
        def Export(self, request: Any, context: Any) -> Any:
            on_export(request, context)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(0)
