"""Recorded OpenAI-compatible interactions (tests/data/openai), replayed over real HTTP on 127.0.0.1.

Each recording is a `<name>.json` (what the request sent, the response's status and headers, and its
JSON body) and, for a streamed answer, a `<name>.sse` holding the body as it came off the wire. The
bodies have every field the real API sends (`usage` with its details, `system_fingerprint`,
`service_tier`, `logprobs: null`, `obfuscation`, `sequence_number`, ...). The replay server answers
any POST with the recording it is given, the stream one event per HTTP chunk (chunked transfer
encoding, flushed), and keeps the request bodies it received.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.support.local_http import serving

DATA = Path(__file__).resolve().parent.parent / "data" / "openai"


@dataclass(frozen=True)
class Recording:
    name: str
    about: str
    path: str
    """The request's path, `/v1/chat/completions` or `/v1/responses`."""
    request: dict[str, Any]
    """The request body as sent."""
    status: int
    headers: dict[str, str]
    body: bytes
    streamed: bool
    """The body is an SSE stream (`<name>.sse`)."""

    @property
    def events(self) -> list[bytes]:
        """A streamed body's events, each with its blank line."""
        return [event + b"\n\n" for event in self.body.split(b"\n\n") if event]

    def cut(self, keep: int) -> Recording:
        """The same stream ended after its first `keep` events (a connection the server closed early)."""
        return _replace(self, body=b"".join(self.events[:keep]))

    def without(self, *types: str) -> Recording:
        """The same Responses stream without the events of the given types."""
        kept = [
            event for event in self.events if not any(f"event: {kind}\n".encode() in event for kind in types)
        ]
        return _replace(self, body=b"".join(kept))


def _replace(recording: Recording, **changes: Any) -> Recording:
    return Recording(**{**recording.__dict__, **changes})


def load(name: str) -> Recording:
    record = json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))
    response = record["response"]
    sse = DATA / f"{name}.sse"
    streamed = sse.exists()
    body = (
        sse.read_bytes() if streamed else json.dumps(response["body"], ensure_ascii=False, indent=2).encode()
    )
    return Recording(
        name=name, about=record["about"], path=record["request"]["path"], request=record["request"]["body"],
        status=response["status"], headers=response["headers"], body=body, streamed=streamed,
    )  # fmt: skip


def names() -> list[str]:
    return sorted(path.stem for path in DATA.glob("*.json"))


class _Replay(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.server.received.append((self.path, json.loads(self.rfile.read(length) or b"null")))
        recording: Recording = self.server.recording
        self.send_response(recording.status)
        for key, value in recording.headers.items():
            self.send_header(key, value)
        if not recording.streamed or recording.status != 200:
            self.send_header("content-length", str(len(recording.body)))
            self.end_headers()
            self.wfile.write(recording.body)
            return
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for event in recording.events:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class ReplayServer:
    """A running replay server; `play(recording)` sets what it answers next."""

    def __init__(self, server: ThreadingHTTPServer) -> None:
        self._server = server
        self.base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"

    def play(self, recording: Recording) -> Recording:
        self._server.recording = recording  # type: ignore[attr-defined]
        self._server.received.clear()  # type: ignore[attr-defined]
        return recording

    @property
    def received(self) -> list[tuple[str, Any]]:
        return list(self._server.received)  # type: ignore[attr-defined]


@contextmanager
def replaying() -> Iterator[ReplayServer]:
    with serving(_Replay, recording=None, received=[]) as server:
        yield ReplayServer(server)
