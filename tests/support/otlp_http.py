"""A local OTLP/HTTP receiver that keeps what arrived: path, headers (lower-case) and raw body."""

from __future__ import annotations

from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple

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
