"""A lean HTTP/1.1 transport under the load tool's `httpx2.AsyncClient`: one body piece per socket read.

Why: a streamed answer arrives as one HTTP chunk per server-sent event. httpcore2 and h11 turn each into
its own event, passed up through five layers of the client: about 30 µs of CPU per event, most of what a
streamed request cost the generator (docs/load.md, "What the generator costs"). This transport sends the
request in one write, reads what the socket has, undoes the chunked encoding, and hands the client every
byte that came in that read as one piece, stamped by llmspans' transport wrapper at that read, as
`vllm bench serve`'s aiohttp client does. llmspans' instrumentation wraps it like any other transport: the
call span, its buckets and attempts are the ones an app with a plain httpx2 client gets. It says when it
opens a connection through the request's `trace` extension (`connection.connect_tcp.*`, as httpcore2 does),
so the connect bucket is right.

Plain HTTP only (the load tool's targets), keep-alive connections pooled per host; `timeout` bounds a whole
request (connect, headers and body).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import httpx2

_HEADERS_END = b"\r\n\r\n"
_MAX_HEADER_BYTES = 64 * 1024
_READ_SIZE = 256 * 1024


class _Connection:
    __slots__ = ("key", "reader", "writer")

    def __init__(
        self, key: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.key = key
        self.reader = reader
        self.writer = writer

    def abort(self) -> None:
        transport = self.writer.transport
        if not transport.is_closing():
            transport.abort()


class _Deadline:
    """A request's whole-request timeout: when it fires, its connection is aborted and the read fails."""

    __slots__ = ("connection", "expired")

    def __init__(self) -> None:
        self.connection: _Connection | None = None
        self.expired = False

    def fire(self) -> None:
        self.expired = True
        if self.connection is not None:
            self.connection.abort()


class LeanTransport(httpx2.AsyncBaseTransport):
    """Keep-alive HTTP/1.1 connections to plain-HTTP targets; `timeout`: seconds for a whole request."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx2.UnsupportedProtocol(f"llmspans load's transport speaks plain http, not {url.scheme}")
        host = url.host
        key = (host, url.port or 80)
        loop = asyncio.get_running_loop()
        connection: _Connection | None = None
        deadline = _Deadline()
        timer = loop.call_later(self.timeout, deadline.fire)
        try:
            idle = self._idle.get(key)
            while idle:
                candidate = idle.pop()
                if not candidate.writer.transport.is_closing() and not candidate.reader.at_eof():
                    connection = candidate
                    break
                self._drop(candidate)
            if connection is None:
                connection = await self._connect(key, request)
            deadline.connection = connection
            if deadline.expired:
                raise httpx2.ConnectTimeout("no connection within the request's timeout", request=request)
            connection.writer.write(_head(request) + _body(request))
            status, headers, rest = await _read_head(connection.reader)
        except (asyncio.CancelledError, httpx2.HTTPError):  # the deadline's cancel, or the client's own error
            timer.cancel()
            if connection is not None:
                self._drop(connection)
            if deadline.expired:
                raise httpx2.ReadTimeout("no answer within the request's timeout", request=request) from None
            raise
        except (OSError, EOFError, asyncio.IncompleteReadError, ValueError) as error:
            timer.cancel()
            if connection is not None:
                self._drop(connection)
            if deadline.expired:
                raise httpx2.ReadTimeout("no answer within the request's timeout", request=request) from None
            raise httpx2.ReadError(f"{type(error).__name__}: {error}", request=request) from None
        stream = _Body(self, connection, request, headers, rest, timer, deadline, request.method == "HEAD")
        return httpx2.Response(
            status, headers=headers, stream=stream, request=request, extensions={"http_version": b"HTTP/1.1"}
        )

    async def _connect(self, key: tuple[str, int], request: httpx2.Request) -> _Connection:
        trace = request.extensions.get("trace")
        info = {"host": key[0], "port": key[1]}
        if trace is not None:
            await trace("connection.connect_tcp.started", info)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(key[0], key[1], limit=_MAX_HEADER_BYTES * 4), self.timeout
            )
        except TimeoutError:
            raise httpx2.ConnectTimeout(
                "no connection within the request's timeout", request=request
            ) from None
        except OSError as error:
            if trace is not None:
                await trace("connection.connect_tcp.failed", {**info, "exception": error})
            raise httpx2.ConnectError(f"{type(error).__name__}: {error}", request=request) from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if trace is not None:
            await trace("connection.connect_tcp.complete", {**info, "return_value": None})
        connection = _Connection(key, reader, writer)
        self._open.add(connection)
        return connection

    def release(self, connection: _Connection, reusable: bool) -> None:
        if reusable and not connection.writer.transport.is_closing():
            self._idle.setdefault(connection.key, []).append(connection)
        else:
            self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        self._open.discard(connection)
        connection.abort()

    async def aclose(self) -> None:
        for connection in list(self._open):
            self._drop(connection)
        self._idle.clear()


def _head(request: httpx2.Request) -> bytes:
    url = request.url
    target = url.raw_path
    lines = [request.method.encode() + b" " + target + b" HTTP/1.1"]
    for name, value in request.headers.raw:
        lines.append(name + b": " + value)
    return b"\r\n".join(lines) + _HEADERS_END


def _body(request: httpx2.Request) -> bytes:
    try:
        return request.content
    except httpx2.RequestNotRead:
        raise httpx2.LocalProtocolError("llmspans load sends bodies it has in memory only") from None


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    buffer = b""
    while True:
        end = buffer.find(_HEADERS_END)
        if end >= 0:
            break
        if len(buffer) > _MAX_HEADER_BYTES:
            raise httpx2.RemoteProtocolError("the response's headers are over 64 KiB")
        piece = await reader.read(_READ_SIZE)
        if not piece:
            raise httpx2.RemoteProtocolError("the server closed the connection before answering")
        buffer += piece
    lines = buffer[:end].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise httpx2.RemoteProtocolError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip(), value.strip()))
    return int(parts[1]), headers, buffer[end + len(_HEADERS_END) :]


class _Body(httpx2.AsyncByteStream):
    """The response body, de-chunked, one piece per socket read; its close gives the connection back."""

    def __init__(
        self, transport: LeanTransport, connection: _Connection, request: httpx2.Request,
        headers: list[tuple[bytes, bytes]], rest: bytes, timer: asyncio.TimerHandle, deadline: _Deadline, head_only: bool,
    ) -> None:  # fmt: skip
        self._transport = transport
        self._connection = connection
        self._request = request
        self._rest = rest
        self._timer = timer
        self._deadline = deadline
        self._done = False
        self._closed = False
        self._reusable = True
        length: int | None = None
        chunked = False
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length" and value.isdigit():
                length = int(value)
            elif lower == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif lower == b"connection" and value.lower() == b"close":
                self._reusable = False
        self._chunked = chunked
        self._left = 0 if head_only else length  # None with neither: the body runs to the close
        if self._left is None and not chunked:
            self._reusable = False
        # The chunked decoder's state: bytes left of the current chunk's data (-1: a size line is next).
        self._chunk_left = -1
        self._pending = b""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        reader = self._connection.reader
        piece = self._rest
        self._rest = b""
        try:
            while not self._done:
                if piece:
                    data = self._dechunk(piece) if self._chunked else self._plain(piece)
                    if data:
                        yield data
                    if self._done:
                        break
                piece = await reader.read(_READ_SIZE)
                if not piece:
                    if not self._chunked and self._left is None:
                        self._done = True  # a body that runs to the close
                        self._reusable = False
                        break
                    raise httpx2.RemoteProtocolError("the server closed the connection mid-body")
        except (OSError, asyncio.IncompleteReadError) as error:
            if self._deadline.expired:
                raise httpx2.ReadTimeout(
                    "no answer within the request's timeout", request=self._request
                ) from None
            raise httpx2.ReadError(f"{type(error).__name__}: {error}", request=self._request) from None
        except httpx2.RemoteProtocolError:
            if self._deadline.expired:
                raise httpx2.ReadTimeout(
                    "no answer within the request's timeout", request=self._request
                ) from None
            raise

    def _plain(self, piece: bytes) -> bytes:
        left = self._left
        if left is None:
            return piece
        if len(piece) >= left:
            self._done = True
            if len(piece) > left:
                self._reusable = False  # more than the body: the connection's state is unknown
            return piece[:left]
        self._left = left - len(piece)
        return piece

    def _dechunk(self, piece: bytes) -> bytes:
        buffer = self._pending + piece if self._pending else piece
        self._pending = b""
        out: list[bytes] = []
        at, size = 0, len(buffer)
        left = self._chunk_left
        while at < size:
            if left > 0:  # inside a chunk's data
                take = min(left, size - at)
                out.append(buffer[at : at + take])
                at += take
                left -= take
                if left == 0:
                    left = -2  # its CRLF is next
                continue
            if left == -2:  # the CRLF after a chunk's data
                if size - at < 2:
                    break
                at += 2
                left = -1
                continue
            start = at
            end = buffer.find(b"\r\n", at)  # a size line
            if end < 0:
                break
            line = buffer[at:end].split(b";", 1)[0].strip()
            try:
                length = int(line, 16)
            except ValueError:
                raise httpx2.RemoteProtocolError(f"a bad chunk size line: {line[:40]!r}") from None
            at = end + 2
            if length == 0:  # the last chunk: trailers (none expected) end at an empty line
                trailer_end = buffer.find(b"\r\n", at)
                if trailer_end == at:
                    self._done = True
                    at += 2
                    if at < size:
                        self._reusable = False
                    break
                if trailer_end < 0 or buffer.find(_HEADERS_END, at - 2) < 0:
                    self._pending = buffer[start:]  # wait for the trailers' end
                    self._chunk_left = -1
                    return b"".join(out)
                self._done = True
                break
            left = length
        if not self._done and at < size:
            self._pending = buffer[at:]
        self._chunk_left = left
        return b"".join(out)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()
        self._transport.release(self._connection, self._done and self._reusable)
