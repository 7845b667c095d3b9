"""A local, scriptable, OpenAI-compatible HTTP server.

Tests, the demo and the benchmarks need an LLM endpoint whose timing is known to the
millisecond and whose failures can be provoked on demand; a real provider offers neither.
The server speaks real HTTP/1.1 (keep-alive, chunked SSE flushed per event) so that the
official clients exercise exactly the code paths they use in production.

Which :class:`Behavior` shapes a response (highest precedence first):

1. an ``"x_sim"`` object in the request's JSON body: its fields are applied on top of
   ``server.default``; the queue is left untouched, so concurrent requests can each pick
   their own behaviour;
2. the next behaviour queued with ``server.enqueue(...)`` (FIFO, shared by all clients);
3. ``server.default``.

Only the POST API endpoints (chat/completions, completions, embeddings, responses) with a
JSON-object body consume behaviours; ``GET /v1/models``, ``/health``, unknown paths and
malformed requests never do.

With a capacity model (``SimulatedServer(capacity=Capacity(slots=4))``, or ``--slots 4`` on the
command line), the chat, completions and Responses endpoints are timed by a vLLM-like engine instead
(``llmspans.tools.capacity``): batch slots, a FIFO queue, prefill and decode time per token, a KV
cache, and ``GET /metrics`` with vLLM's names for waiting, running and KV-cache usage. The behaviour
still chooses the answer (status, usage, tool calls, drops...), but its delays are not used: the engine
times the first token and each one after it; the output is the request's ``max_tokens`` (finish
reason ``length``) or, without one, ``chunks`` tokens.

The HTTP plumbing under it, ``HTTPCore`` (listener, connections, request parsing) and
``Exchange`` (one answer, whole or streamed), is also what the tests' vLLM simulator stands on, with
the same engine.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import http
import json
import math
import random
import select
import selectors
import signal
import socket
import struct
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Literal, TypeVar, get_args

from llmspans.tools.capacity import Capacity, Engine, EngineRequest, Stopped, words

__all__ = [
    "Behavior", "Capacity", "Exchange", "HTTPCore", "LocalServer", "RecordedRequest", "SimulatedServer",
    "UsageMode", "main",
]  # fmt: skip

UsageMode = Literal["chunk", "finish", "none", "auto"]

_HOST = "127.0.0.1"
_MAX_LINE = 65536
_MAX_HEADERS = 200
_TOOL_NAME = "simulated_tool"
# The content tokens cycle through this list: 8 chunks read "Hello, this is a simulated reply."
_VOCAB: tuple[str, ...] = ("Hello", ",", " this", " is", " a", " simulated", " reply", ".")
_VOCAB_JSON: tuple[bytes, ...] = tuple(json.dumps(t).encode() for t in _VOCAB)
_TERMINATOR = b"0\r\n\r\n"
_MODELS = ("sim-model",)


@dataclass(frozen=True, kw_only=True)
class Behavior:
    """How the server answers one API request; every field has a harmless default.

    Delays are in seconds and are deadlines, not naps: ``header_delay`` counts from the
    request's arrival (it also precedes ``reset_before_headers``), ``first_chunk_delay``
    from the moment the headers were written, ``chunk_gap`` from the previous content
    chunk's write. ``chunks`` content chunks each carry one token; with ``tool_calls``
    they carry pieces of one function call's JSON arguments instead. ``headers`` and the
    ``retry-after*`` headers are added to whatever response is sent; ``status >= 400``
    sends an OpenAI-shaped error body instead of a completion. ``role_chunk`` is ignored
    by legacy completions; Responses-API lifecycle events are always sent after headers.
    ``usage`` placement applies to chat and legacy completions streams; the Responses API
    always reports usage in its final event unless ``usage="none"``, which also drops
    usage from non-streamed bodies. ``done`` only applies to chat and completions streams
    (the Responses API never sends ``[DONE]``). ``finish_reason="length"`` makes a
    Responses-API answer ``incomplete``. ``drop_after`` closes the TCP connection after
    that many content chunks, when the next was due (for non-streamed answers: half-way through the body).
    """

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    retry_after_ms: float | None = None
    retry_after: float | None = None
    header_delay: float = 0.0
    first_chunk_delay: float = 0.0
    chunk_gap: float = 0.0
    chunks: int = 8
    role_chunk: bool = True
    usage: UsageMode = "auto"
    done: bool = True
    finish_reason: str = "stop"
    drop_after: int | None = None
    tool_calls: bool = False
    reset_before_headers: bool = False

    def __post_init__(self) -> None:
        """Reject nonsense early, so a typo in a test fails loudly instead of hanging."""
        for name in ("header_delay", "first_chunk_delay", "chunk_gap"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        if not isinstance(self.chunks, int) or self.chunks < 0:
            raise ValueError(f"chunks must be a non-negative int, got {self.chunks!r}")
        if self.drop_after is not None and (not isinstance(self.drop_after, int) or self.drop_after < 0):
            raise ValueError(f"drop_after must be None or a non-negative int, got {self.drop_after!r}")
        if self.usage not in get_args(UsageMode):
            raise ValueError(f"usage must be one of {get_args(UsageMode)}, got {self.usage!r}")
        if not isinstance(self.status, int) or not 100 <= self.status <= 599:
            raise ValueError(f"status must be an HTTP status code, got {self.status!r}")
        if not isinstance(self.headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.headers.items()
        ):
            raise ValueError("headers must map str to str")

    def with_overrides(self, overrides: Mapping[str, Any]) -> Behavior:
        """Return a copy with ``overrides`` applied; how ``x_sim`` request fields are honoured."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown Behavior field(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **overrides)


@dataclass(kw_only=True)
class RecordedRequest:
    """What arrived and when each part of the answer left, for assertions on timing and reuse.

    All ``*_ns`` values come from ``time.perf_counter_ns()`` in the server's process, so
    in-process tests can compare them with their own clock. ``headers_sent_ns`` and
    ``finished_ns`` are stamped immediately before the write that sends the headers and
    the last bytes, so they are visible by the time a client has seen them;
    ``chunk_sent_ns`` gets one stamp right after each content chunk was written. A
    dropped response gets ``finished_ns`` when the connection was closed. ``behavior`` is
    the one that was applied (None for non-API requests). Use ``server.wait_idle()``
    before asserting, as the server may still be finishing when the client is done.
    """

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    arrived_ns: int
    connection_id: int
    behavior: Behavior | None = None
    status: int | None = None
    headers_sent_ns: int | None = None
    chunk_sent_ns: list[int] = field(default_factory=list)
    # When each content chunk was due: its write began no earlier, so no client can have read it before.
    chunk_due_ns: list[int] = field(default_factory=list)
    finished_ns: int | None = None
    raw_body: bytes = field(default=b"", repr=False)  # as received, for bodies that are not JSON
    # How late the latest-waking of this answer's timed writes woke (its own stamp minus the time it
    # was due): how much a busy machine delayed the threads of this very exchange, for tests to allow.
    late_ns: int = 0
    # When the server saw that the client had gone away before the answer was complete: it closed its
    # end while the server waited to send (a real server aborts the request there), or a write failed.
    disconnected_ns: int | None = None


class _Drop(Exception):
    """Unwinds a handler so that its connection is closed without completing the response."""


class _BadRequest(Exception):
    """A request the server cannot parse; answered with 400 and the connection closed."""


class _Template:
    """Pre-encoded JSON with holes, so a chunk costs a few byte joins instead of ``json.dumps``."""

    def __init__(self, obj: Any, *slots: str) -> None:
        rest = _dumps(obj)
        parts: list[bytes] = []
        for slot in slots:
            before, sep, rest = rest.partition(_dumps(slot))
            if not sep:
                raise ValueError(f"slot {slot!r} missing or out of order")
            parts.append(before)
        parts.append(rest)
        self._parts = parts

    def fill(self, *values: bytes) -> bytes:
        out = [self._parts[0]]
        for value, part in zip(values, self._parts[1:], strict=True):
            out.append(value)
            out.append(part)
        return b"".join(out)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _sse(payload: bytes, event: str | None = None) -> bytes:
    """One SSE event wrapped in one HTTP chunk, ready for a single ``sendall``."""
    data = b"data: " + payload + b"\n\n"
    if event is not None:
        data = b"event: " + event.encode() + b"\n" + data
    return b"%x\r\n%b\r\n" % (len(data), data)


_DONE_FRAME = _sse(b"[DONE]")


def _token(i: int) -> str:
    return _VOCAB[i % len(_VOCAB)]


def _text(n: int) -> str:
    return "".join(_token(i) for i in range(n))


def _tool_arguments(n: int) -> str:
    return '{"text": "' + _text(n) + '"}'


def _tool_piece(i: int, n: int) -> str:
    """Piece ``i`` of ``n`` of the tool arguments; the pieces concatenate to valid JSON."""
    piece = _token(i)
    if i == 0:
        piece = '{"text": "' + piece
    if i == n - 1:
        piece += '"}'
    return piece


def _prompt(body: dict[str, Any]) -> list[str]:
    """The prompt's tokens: the words of its instructions, messages, prompt and input."""
    return words([body.get(k) for k in ("instructions", "messages", "prompt", "input")])


def _embedding(item: Any, dims: int) -> list[float]:
    """A deterministic pseudo-embedding, so equal inputs give equal vectors across runs."""
    rng = random.Random(json.dumps(item, sort_keys=True))
    return [round(rng.uniform(-1.0, 1.0), 6) for _ in range(dims)]


def _format_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _head(status: int, headers: Sequence[tuple[str, str]]) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    lines = [f"HTTP/1.1 {status} {phrase}"]
    lines.extend(f"{name}: {value}" for name, value in headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")


def _error_body(status: int, message: str | None = None) -> bytes:
    """An OpenAI-shaped error, so clients map it to the same exception types as the real API."""
    if status == 429:
        err_type, code = "requests", "rate_limit_exceeded"
    elif status == 401:
        err_type, code = "invalid_request_error", "invalid_api_key"
    elif status >= 500:
        err_type, code = "server_error", "server_error"
    else:
        err_type, code = "invalid_request_error", None
    if message is None:
        message = f"Simulated error {status}"
    return _dumps({"error": {"message": message, "type": err_type, "param": None, "code": code}})


@dataclass
class _Full:
    body: bytes
    status: int = 200


@dataclass
class _Stream:
    prelude: list[bytes]
    content: Callable[[int], bytes]
    tail: list[bytes]


@dataclass
class _Ctx:
    """The parsed facts a response builder needs, computed once per request."""

    body: dict[str, Any]
    behavior: Behavior
    seq: int
    created: int
    model: str
    prompt_tokens: int
    stream: bool
    usage_mode: str

    @classmethod
    def build(cls, body: dict[str, Any], behavior: Behavior, seq: int) -> _Ctx:
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        mode: str = behavior.usage
        if mode == "auto":
            mode = "chunk" if include_usage else "none"
        return cls(
            body=body,
            behavior=behavior,
            seq=seq,
            created=int(time.time()),
            model=str(body.get("model") or _MODELS[0]),
            prompt_tokens=max(1, len(_prompt(body))),
            stream=body.get("stream") is True,
            usage_mode=mode,
        )

    def usage(self, details: bool = False) -> dict[str, Any]:
        """Token counts; `details` adds chat's `prompt_tokens_details` / `completion_tokens_details`."""
        n = self.behavior.chunks
        counts: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
        }
        if details:
            counts["prompt_tokens_details"] = {"cached_tokens": 0}
            counts["completion_tokens_details"] = {"reasoning_tokens": 0}
        return counts

    def service_tier(self) -> str:
        """The tier the answer says it ran on: the one asked for, `default` for none or `auto`."""
        asked = self.body.get("service_tier")
        return asked if isinstance(asked, str) and asked != "auto" else "default"


def _choice_count(body: dict[str, Any]) -> int | None:
    """The request's `n` (how many answers), as OpenAI accepts it: an int from 1 to 128, 1 by
    default; None for anything else (answered 400, as OpenAI does)."""
    n = body.get("n", 1)
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128:
        return None
    return n


def _chat(c: _Ctx) -> _Full | _Stream:
    """A chat completion; with `n` > 1, `chunks` content chunks dealt round-robin over the choices
    (chunk i goes to choice i % n), each choice with its own role chunk and finish chunk."""
    b = c.behavior
    n = b.chunks
    answers = _choice_count(c.body)
    if answers is None:
        return _Full(_error_body(400, "'n' must be an integer from 1 to 128"), 400)
    call_id = f"call_sim{c.seq}"
    base: dict[str, Any] = {"id": f"chatcmpl-sim{c.seq}", "object": "chat.completion.chunk"}
    base.update(created=c.created, model=c.model, service_tier=c.service_tier(), system_fingerprint="fp_sim")
    if not c.stream:
        choices = []
        for index in range(answers):
            share = len(range(index, n, answers))
            message: dict[str, Any] = {"role": "assistant", "content": _text(share), "refusal": None}
            if b.tool_calls and share:
                function = {"name": _TOOL_NAME, "arguments": _tool_arguments(share)}
                message.update(
                    content=None,
                    tool_calls=[
                        {
                            "id": f"{call_id}_{index}" if index else call_id,
                            "type": "function",
                            "function": function,
                        }
                    ],
                )
            choices.append(
                {"index": index, "message": message, "logprobs": None, "finish_reason": b.finish_reason}
            )
        obj = {**base, "object": "chat.completion", "choices": choices}
        if b.usage != "none":
            obj["usage"] = c.usage(details=True)
        return _Full(_dumps(obj))

    def chunk(delta: Any, finish: str | None = None, index: int = 0, **extra: Any) -> dict[str, Any]:
        return {
            **base,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
        } | extra

    prelude = (
        [_sse(_dumps(chunk({"role": "assistant"}, index=k))) for k in range(answers)] if b.role_chunk else []
    )
    content: Callable[[int], bytes]
    if b.tool_calls:
        firsts, rests = [], []
        for k in range(answers):
            call = {
                "index": 0,
                "id": f"{call_id}_{k}" if k else call_id,
                "type": "function",
                "function": {"name": _TOOL_NAME, "arguments": "$"},
            }
            firsts.append(_Template(chunk({"tool_calls": [call]}, index=k), "$"))
            rests.append(
                _Template(chunk({"tool_calls": [{"index": 0, "function": {"arguments": "$"}}]}, index=k), "$")
            )
        shares = [len(range(k, n, answers)) for k in range(answers)]

        def content(i: int) -> bytes:
            k, j = i % answers, i // answers  # the choice, and this chunk's place in its answer
            return _sse(
                (firsts[k] if j == 0 else rests[k]).fill(json.dumps(_tool_piece(j, shares[k])).encode())
            )

    else:
        templates = [_Template(chunk({"content": "$"}, index=k), "$") for k in range(answers)]

        def content(i: int) -> bytes:
            return _sse(templates[i % answers].fill(_VOCAB_JSON[i % len(_VOCAB_JSON)]))

    tail = []
    for k in range(answers):
        finish = chunk({}, b.finish_reason, index=k)
        if c.usage_mode == "finish" and k == answers - 1:
            finish["usage"] = c.usage(details=True)
        tail.append(_sse(_dumps(finish)))
    if c.usage_mode == "chunk":
        tail.append(_sse(_dumps({**base, "choices": [], "usage": c.usage(details=True)})))
    if b.done:
        tail.append(_DONE_FRAME)
    return _Stream(prelude, content, tail)


def _completions(c: _Ctx) -> _Full | _Stream:
    b = c.behavior
    base: dict[str, Any] = {"id": f"cmpl-sim{c.seq}", "object": "text_completion"}
    base.update(created=c.created, model=c.model)

    def obj(text: str, finish: str | None) -> dict[str, Any]:
        return {**base, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

    if not c.stream:
        full = obj(_text(b.chunks), b.finish_reason)
        if b.usage != "none":
            full["usage"] = c.usage()
        return _Full(_dumps(full))
    template = _Template(obj("$", None), "$")

    def content(i: int) -> bytes:
        return _sse(template.fill(_VOCAB_JSON[i % len(_VOCAB_JSON)]))

    finish = obj("", b.finish_reason)
    if c.usage_mode == "finish":
        finish["usage"] = c.usage()
    tail = [_sse(_dumps(finish))]
    if c.usage_mode == "chunk":
        tail.append(_sse(_dumps({**base, "choices": [], "usage": c.usage()})))
    if b.done:
        tail.append(_DONE_FRAME)
    return _Stream([], content, tail)


def _embeddings(c: _Ctx) -> _Full | _Stream:
    raw = c.body.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw)):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        return _Full(_error_body(400, "'input' must be a non-empty string or array"), 400)
    dims = c.body.get("dimensions")
    if not isinstance(dims, int) or not 1 <= dims <= 4096:
        dims = 8
    as_base64 = c.body.get("encoding_format") == "base64"
    data = []
    for index, item in enumerate(items):
        vector = _embedding(item, dims)
        value: Any = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode() if as_base64 else vector
        data.append({"object": "embedding", "index": index, "embedding": value})
    usage = {"prompt_tokens": c.prompt_tokens, "total_tokens": c.prompt_tokens}
    return _Full(_dumps({"object": "list", "data": data, "model": c.model, "usage": usage}))


_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MAX_TOKENS_KEYS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def _responses(c: _Ctx) -> _Full | _Stream:
    b = c.behavior
    n = b.chunks
    rid, item_id = f"resp_sim{c.seq}", (f"fc_sim{c.seq}" if b.tool_calls and n else f"msg_sim{c.seq}")
    text = _text(n)
    final_status = "incomplete" if b.finish_reason == "length" else "completed"
    usage = None
    if b.usage != "none":
        usage = {
            "input_tokens": c.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": c.prompt_tokens + n,
        }
    instructions = c.body.get("instructions")

    def response(status: str, output: list[Any]) -> dict[str, Any]:
        done = status != "in_progress"
        return {
            "id": rid,
            "object": "response",
            "created_at": c.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": instructions if isinstance(instructions, str) else None,
            "metadata": {},
            "model": c.model,
            "output": output,
            "service_tier": c.service_tier(),
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "usage": usage if done else None,
        }

    part_done = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    if b.tool_calls and n:
        item: dict[str, Any] = {"type": "function_call", "id": item_id, "call_id": f"call_sim{c.seq}"}
        item.update(name=_TOOL_NAME, arguments=_tool_arguments(n), status="completed")
        item_added = {**item, "arguments": "", "status": "in_progress"}
    else:
        item = {"type": "message", "id": item_id, "role": "assistant", "status": "completed"}
        item["content"] = [part_done]
        item_added = {**item, "status": "in_progress", "content": []}
    if not c.stream:
        return _Full(_dumps(response(final_status, [item])))

    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return _sse(_dumps({"type": kind, "sequence_number": seq - 1, **fields}), kind)

    prelude = [
        event("response.created", response=response("in_progress", [])),
        event("response.in_progress", response=response("in_progress", [])),
        event("response.output_item.added", output_index=0, item=item_added),
    ]
    where: dict[str, Any] = {"item_id": item_id, "output_index": 0}
    is_message = item["type"] == "message"
    extra: dict[str, Any] = {}
    if is_message:
        where["content_index"] = 0
        part_added = {**part_done, "text": ""}
        prelude.append(event("response.content_part.added", **where, part=part_added))
        kind, extra["logprobs"] = "response.output_text.delta", []
    else:
        kind = "response.function_call_arguments.delta"
    first_delta_seq = seq
    template = _Template({"type": kind, "sequence_number": "#", **where, "delta": "$", **extra}, "#", "$")
    seq += n

    def content(i: int) -> bytes:
        delta = _VOCAB_JSON[i % len(_VOCAB_JSON)] if is_message else json.dumps(_tool_piece(i, n)).encode()
        return _sse(template.fill(b"%d" % (first_delta_seq + i), delta), kind)

    if is_message:
        tail = [
            event("response.output_text.done", **where, text=text, logprobs=[]),
            event("response.content_part.done", **where, part=part_done),
        ]
    else:
        tail = [event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
    tail.append(event("response.output_item.done", output_index=0, item=item))
    tail.append(event(f"response.{final_status}", response=response(final_status, [item])))
    return _Stream(prelude, content, tail)


_API_ROUTES: dict[str, Callable[[_Ctx], _Full | _Stream]] = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completions,
    "/v1/embeddings": _embeddings,
    "/v1/responses": _responses,
}
_HEALTH_PATHS = ("/health", "/v1/health")


class Exchange:
    """One request/response on a connection: precise waits and stamped writes.

    What a responder (see `HTTPCore`) answers with: `send_full()` for a whole response, or
    `start_stream()`, `send()` per frame and `end_stream()` for a chunked one. A write to a
    client that went away raises `OSError`; a wait during `stop()` unwinds the handler.
    """

    def __init__(self, sock: socket.socket, rec: RecordedRequest, stopping: threading.Event) -> None:
        self.sock = sock
        self.rec = rec
        self._stopping = stopping

    def wait_until(self, deadline_ns: int) -> None:
        """Sleep precisely, but wake at once when the server stops, so ``stop()`` stays prompt, or when the
        client closes its end, as a real server notices a client that went away (``rec.disconnected_ns``)."""
        remaining = deadline_ns - time.perf_counter_ns()
        if remaining > 0 and self._client_left(deadline_ns):
            self.rec.disconnected_ns = time.perf_counter_ns()
            raise _Drop
        if self._stopping.is_set():
            raise _Drop
        if remaining > 0:
            late = time.perf_counter_ns() - deadline_ns
            if late > self.rec.late_ns:
                self.rec.late_ns = late

    def _client_left(self, deadline_ns: int) -> bool:
        """Wait until `deadline_ns`; True as soon as the client closed its end. `stop()` shuts every
        connection down, which wakes this wait too: that is the server going, not the client."""
        remaining = deadline_ns - time.perf_counter_ns()
        # poll, not select: a server with more than 1,024 connections open has descriptors select cannot take
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        readable = poller.poll(max(0, math.ceil(remaining / 1e6)))
        if not readable or self._stopping.is_set():
            return False
        try:
            peeked = self.sock.recv(1, socket.MSG_PEEK)
        except OSError:  # reset by the client
            return True
        if peeked:  # the client sent more (a pipelined request): wait out the rest without watching
            self._stopping.wait(max(0.0, (deadline_ns - time.perf_counter_ns()) / 1e9))
            return False
        return True

    def drop(self) -> None:
        self.rec.finished_ns = time.perf_counter_ns()
        raise _Drop

    def send_full(
        self,
        status: int,
        body: bytes,
        headers: list[tuple[str, str]],
        delay: float = 0.0,
        content_type: str = "application/json",
    ) -> None:
        self.rec.status = status
        data = _head(status, [("content-type", content_type), ("content-length", str(len(body))), *headers])
        data += body
        drop = self.rec.behavior is not None and self.rec.behavior.drop_after is not None
        if drop:
            data = data[: len(data) - len(body) + len(body) // 2]
        self.wait_until(self.rec.arrived_ns + int(delay * 1e9))
        now = time.perf_counter_ns()
        self.rec.headers_sent_ns = now
        self.rec.finished_ns = now
        self.sock.sendall(data)
        if drop:
            raise _Drop

    def send_stream(self, b: Behavior, plan: _Stream, headers: list[tuple[str, str]]) -> None:
        """Write each event with its own ``sendall`` as it is due (frames are built before the wait).

        Only the chunked-body terminator shares a write with the last event, so a client that
        drains the body after ``[DONE]`` (the async openai SDK does) finds it complete at once
        and can reuse the connection.
        """
        rec, sock = self.rec, self.sock
        sse_headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
        self.wait_until(rec.arrived_ns + int(b.header_delay * 1e9))
        self.start_stream(b.status, [*sse_headers, *headers])
        assert rec.headers_sent_ns is not None
        for frame in plan.prelude:
            sock.sendall(frame)
        deadline = rec.headers_sent_ns + int(b.first_chunk_delay * 1e9)
        gap_ns = int(b.chunk_gap * 1e9)
        stamps = rec.chunk_sent_ns
        content = plan.content
        for i in range(b.chunks):
            if i == b.drop_after:
                self.wait_until(deadline)  # the server dies when the next chunk was due, not with the last
                self.drop()
            frame = content(i)
            rec.chunk_due_ns.append(deadline)
            self.wait_until(deadline)
            sock.sendall(frame)
            now = time.perf_counter_ns()
            stamps.append(now)
            deadline = now + gap_ns
        if b.drop_after is not None:
            self.drop()
        tail = plan.tail
        for frame in tail[:-1]:
            sock.sendall(frame)
        self.end_stream(tail[-1] if tail else b"")

    def start_stream(self, status: int, headers: list[tuple[str, str]]) -> None:
        """Send the head of a chunked response at once; frames follow with `send()`."""
        self.rec.status = status
        head = _head(status, [*headers, ("transfer-encoding", "chunked")])
        self.rec.headers_sent_ns = time.perf_counter_ns()
        self.sock.sendall(head)

    def send(self, frame: bytes) -> None:
        """One ready-made HTTP chunk (see `_sse`), in one write."""
        self.sock.sendall(frame)

    def end_stream(self, last: bytes = b"") -> None:
        """The last chunk (if any) and the terminator, in one write."""
        self.rec.finished_ns = time.perf_counter_ns()
        self.sock.sendall(last + _TERMINATOR)


class HTTPCore:
    """The HTTP/1.1 server both simulators stand on (this module's, and the tests' vLLM one).

    A listener on 127.0.0.1 and one thread per connection with keep-alive; each request is
    parsed into a `RecordedRequest` (its JSON body decoded when it has one) and handed to
    `respond(exchange, seq, keep_alive)`, which answers through the `Exchange`. `stop()`
    closes every connection, streams included, and joins the threads. `record=False` keeps
    long runs from accumulating request records.
    """

    def __init__(
        self, respond: Callable[[Exchange, int, bool], None], *, port: int = 0, record: bool = True
    ) -> None:
        self._respond = respond
        self._requested_port = port
        self._record = record
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._requests: list[RecordedRequest] = []
        self._connections_opened = 0
        self._next_connection_id = 0
        self._next_seq = 0
        self._inflight = 0
        self._conns: dict[int, socket.socket] = {}
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._accept_thread: threading.Thread | None = None
        self._port: int | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Bind and begin serving."""
        if self._listener is not None or self._stopping.is_set():
            raise RuntimeError("a simulated server can be started only once")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((_HOST, self._requested_port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._port = listener.getsockname()[1]
        self._wake = socket.socketpair()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"llmspans-sim-accept-{self._port}", daemon=True
        )
        self._accept_thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listener and every open connection (streams included), then join threads."""
        if self._listener is None or self._stopping.is_set():
            return
        self._stopping.set()
        assert self._wake is not None
        assert self._accept_thread is not None
        with contextlib.suppress(OSError):
            self._wake[1].send(b"x")
        self._accept_thread.join(timeout)
        with self._lock:
            for conn in self._conns.values():
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        for sock in self._wake:
            sock.close()
        with self._idle:
            self._idle.notify_all()

    # -- public state ------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("server not started")
        return self._port

    @property
    def url(self) -> str:
        """The server root, for clients that add ``/v1`` themselves."""
        return f"http://{_HOST}:{self.port}"

    @property
    def requests(self) -> list[RecordedRequest]:
        """A snapshot of the recorded requests, in arrival order."""
        with self._lock:
            return list(self._requests)

    @property
    def connections_opened(self) -> int:
        with self._lock:
            return self._connections_opened

    def clear(self) -> None:
        """Forget recorded requests and the connection count (connection ids stay unique)."""
        with self._lock:
            self._requests.clear()
            self._connections_opened = 0

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until no request is being handled, so records are final before asserting on them."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    # -- serving -----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        assert self._wake is not None
        listener = self._listener
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            selector.register(self._wake[0], selectors.EVENT_READ)
            while not self._stopping.is_set():
                for key, _ in selector.select():
                    if key.fileobj is not listener:
                        return
                    try:
                        conn, _addr = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        if self._stopping.is_set():
                            return
                        continue
                    self._adopt(conn)

    def _adopt(self, conn: socket.socket) -> None:
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self._stopping.is_set():
                conn.close()
                return
            self._next_connection_id += 1
            cid = self._next_connection_id
            self._connections_opened += 1
            self._conns[cid] = conn
            self._threads = [t for t in self._threads if t.is_alive()]
            thread = threading.Thread(
                target=self._serve_connection, args=(conn, cid), name=f"llmspans-sim-conn-{cid}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _serve_connection(self, conn: socket.socket, cid: int) -> None:
        rfile = conn.makefile("rb")
        try:
            while not self._stopping.is_set() and self._serve_one(conn, rfile, cid):
                pass
        except _BadRequest:
            with contextlib.suppress(OSError):
                conn.sendall(_head(400, [("content-length", "0"), ("connection", "close")]))
        except (OSError, ValueError, _Drop):
            pass
        finally:
            with self._lock:
                self._conns.pop(cid, None)
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            rfile.close()
            conn.close()

    def _serve_one(self, conn: socket.socket, rfile: BinaryIO, cid: int) -> bool:
        """Read and answer one request; False means the connection must be closed."""
        line = rfile.readline(_MAX_LINE + 1)
        if not line:
            return False
        arrived = time.perf_counter_ns()
        if line in (b"\r\n", b"\n"):
            return True
        parts = line.decode("latin-1").split()
        if len(line) > _MAX_LINE or len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest
        method, target, version = parts
        headers = _read_headers(rfile)
        raw_body = _read_body(rfile, headers)
        connection = headers.get("connection", "").lower()
        keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        body: Any = None
        if raw_body:
            try:
                body = json.loads(raw_body)
            except ValueError:
                body = None
        rec = RecordedRequest(
            method=method,
            path=target.split("?", 1)[0],
            headers=headers,
            body=body,
            arrived_ns=arrived,
            connection_id=cid,
            raw_body=raw_body,
        )
        with self._lock:
            if self._record:
                self._requests.append(rec)
            self._inflight += 1
            self._next_seq += 1
            seq = self._next_seq
        try:
            self._respond(Exchange(conn, rec, self._stopping), seq, keep_alive)
        except OSError:  # a write to a client that went away
            if rec.disconnected_ns is None:
                rec.disconnected_ns = time.perf_counter_ns()
            raise
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()
        return keep_alive


_Served = TypeVar("_Served", bound="LocalServer")


class LocalServer:
    """A server on an `HTTPCore` in background threads: start and stop, a context manager, its URLs.

    What this module's server and the tests' vLLM one share; each sets `_core` and may extend `stop()`.
    """

    _core: HTTPCore

    def start(self: _Served) -> _Served:
        """Bind and begin serving; returns ``self`` for chaining."""
        self._core.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listener and every open connection (streams included), then join threads."""
        self._core.stop(timeout)

    def __enter__(self: _Served) -> _Served:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._core.port

    @property
    def url(self) -> str:
        """The server root, for clients that add ``/v1`` themselves (and where ``/metrics`` is)."""
        return self._core.url

    @property
    def base_url(self) -> str:
        """What to pass as an OpenAI client's ``base_url``."""
        return f"{self.url}/v1"

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until no request is being handled, so records are final before asserting on them."""
        return self._core.wait_idle(timeout)


class SimulatedServer(LocalServer):
    """An OpenAI-compatible server on 127.0.0.1 running in background threads.

    Use as a context manager or call :meth:`start` / :meth:`stop`. ``default`` may be
    reassigned at any time; see the module docstring for how behaviours are chosen.
    ``record=False`` keeps long benchmark runs from accumulating request records. ``capacity``
    gives it batch slots, a queue and per-token timing (see the module docstring); ``engine`` is
    then the engine, whose ``state()`` is (waiting, running, KV-cache usage, deferred).
    """

    def __init__(
        self,
        default: Behavior | None = None,
        *,
        port: int = 0,
        record: bool = True,
        capacity: Capacity | None = None,
    ) -> None:
        self.default: Behavior = default if default is not None else Behavior()
        self._lock = threading.Lock()
        self._queue: deque[Behavior] = deque()
        self._core = HTTPCore(self._dispatch, port=port, record=record)
        self.engine: Engine | None = Engine(capacity) if capacity is not None else None

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listener and every open connection (streams included), then join threads."""
        if self.engine is not None:
            self.engine.stop()
        self._core.stop(timeout)

    # -- public state ------------------------------------------------------------------

    def enqueue(self, *behaviors: Behavior) -> None:
        """Script the next API requests, in order; the default applies once the queue is empty."""
        with self._lock:
            self._queue.extend(behaviors)

    @property
    def requests(self) -> list[RecordedRequest]:
        """A snapshot of the recorded requests, in arrival order."""
        return self._core.requests

    @property
    def connections_opened(self) -> int:
        return self._core.connections_opened

    def clear(self) -> None:
        """Forget recorded requests and the connection count (connection ids stay unique)."""
        self._core.clear()

    # -- answering ---------------------------------------------------------------------

    def _choose(self, body: dict[str, Any]) -> Behavior:
        overrides = body.get("x_sim")
        if overrides is not None:
            if not isinstance(overrides, dict):
                raise ValueError("x_sim must be a JSON object of Behavior fields")
            return self.default.with_overrides(overrides)
        with self._lock:
            if self._queue:
                return self._queue.popleft()
        return self.default

    def _dispatch(self, ex: Exchange, seq: int, keep_alive: bool) -> None:
        rec = ex.rec
        common = [("x-request-id", f"req_sim{seq}")]
        if not keep_alive:
            common.append(("connection", "close"))
        if rec.path in _HEALTH_PATHS and rec.method == "GET":
            ex.send_full(200, b'{"status":"ok"}', common)
            return
        if rec.path == "/metrics" and rec.method == "GET" and self.engine is not None:
            ex.send_full(200, self.engine.metrics_text(), common, content_type=_METRICS_TYPE)
            return
        if rec.path == "/v1/models" and rec.method == "GET":
            models = [
                {"id": m, "object": "model", "created": 0, "owned_by": "llmspans-simulator"} for m in _MODELS
            ]
            ex.send_full(200, _dumps({"object": "list", "data": models}), common)
            return
        builder = _API_ROUTES.get(rec.path)
        if builder is None or rec.method != "POST":
            status = 404 if builder is None else 405
            message = f"Invalid URL ({rec.method} {rec.path})"
            ex.send_full(status, _error_body(status, message), common)
            return
        if not isinstance(rec.body, dict):
            ex.send_full(400, _error_body(400, "request body must be a JSON object"), common)
            return
        try:
            behavior = self._choose(rec.body)
        except (TypeError, ValueError) as err:
            ex.send_full(400, _error_body(400, f"invalid x_sim: {err}"), common)
            return
        rec.behavior = behavior
        headers = [*common, *behavior.headers.items()]
        if behavior.retry_after_ms is not None:
            headers.append(("retry-after-ms", _format_seconds(behavior.retry_after_ms)))
        if behavior.retry_after is not None:
            headers.append(("retry-after", _format_seconds(behavior.retry_after)))
        if behavior.reset_before_headers:
            ex.wait_until(rec.arrived_ns + int(behavior.header_delay * 1e9))
            ex.drop()
        if behavior.status >= 400:
            ex.send_full(behavior.status, _error_body(behavior.status), headers, behavior.header_delay)
            return
        if self.engine is not None and builder is not _embeddings:
            try:
                self._through_engine(self.engine, ex, builder, behavior, seq, headers)
            except Stopped:
                raise _Drop from None  # the server is stopping: close the connection
            return
        plan = builder(_Ctx.build(rec.body, behavior, seq))
        if isinstance(plan, _Full):
            status = behavior.status if plan.status == 200 else plan.status
            ex.send_full(status, plan.body, headers, behavior.header_delay)
            return
        ex.send_stream(behavior, plan, headers)

    def _through_engine(
        self,
        engine: Engine,
        ex: Exchange,
        builder: Callable[[_Ctx], _Full | _Stream],
        behavior: Behavior,
        seq: int,
        headers: list[tuple[str, str]],
    ) -> None:
        """Answer through the capacity model: queued for a slot, the first token after the prefill, one
        token every decode step; the output is `max_tokens` (finish `length`) or `chunks` tokens."""
        rec, body = ex.rec, ex.rec.body
        prompt = _prompt(body) or ["."]
        asked = next((body[key] for key in _MAX_TOKENS_KEYS if body.get(key) is not None), None)
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
            ex.send_full(400, _error_body(400, f"max_tokens must be at least 1, got {asked!r}"), headers)
            return
        target = asked if asked is not None else max(1, behavior.chunks)
        if not engine.fits_alone(len(prompt), target):
            message = "The request needs more KV-cache blocks than the server has."
            ex.send_full(400, _error_body(400, message), headers)
            return
        if engine.rejects():
            message = "The server is at capacity: its waiting queue is full."
            ex.send_full(503, _error_body(503, message), headers)
            return
        shaped = dataclasses.replace(
            behavior, chunks=target, finish_reason="length" if asked is not None else behavior.finish_reason
        )
        plan = builder(_Ctx.build(body, shaped, seq))
        if isinstance(plan, _Full) and plan.status != 200:
            ex.send_full(plan.status, plan.body, headers)
            return
        arrival = rec.arrived_ns / 1e9
        request = EngineRequest(
            request_id=f"req_sim{seq}", path=rec.path, headers=dict(rec.headers), body=body,
            stream=isinstance(plan, _Stream), words=prompt, max_tokens=asked, target_tokens=target,
            arrival_time=time.time() - (time.perf_counter() - arrival), arrival=arrival,
        )  # fmt: skip
        if isinstance(plan, _Full):
            engine.run(request, lambda tokens, last: None)
            ex.send_full(shaped.status, plan.body, headers)
            return
        sse_headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
        ex.start_stream(shaped.status, [*sse_headers, *headers])
        for frame in plan.prelude:
            ex.send(frame)
        sent = 0

        def emit(tokens: int, last: bool) -> None:
            nonlocal sent
            for index in range(sent, sent + tokens):
                if index == shaped.drop_after:
                    ex.drop()
                rec.chunk_due_ns.append(int(request.token_ts[min(index, len(request.token_ts) - 1)] * 1e9))
                ex.send(plan.content(index))
                rec.chunk_sent_ns.append(time.perf_counter_ns())
            sent += tokens

        engine.run(request, emit)
        if shaped.drop_after is not None:
            ex.drop()
        for frame in plan.tail[:-1]:
            ex.send(frame)
        ex.end_stream(plan.tail[-1] if plan.tail else b"")


def _read_headers(rfile: BinaryIO) -> dict[str, str]:
    headers: dict[str, str] = {}
    for _ in range(_MAX_HEADERS):
        line = rfile.readline(_MAX_LINE + 1)
        if not line:
            raise _Drop
        if line in (b"\r\n", b"\n"):
            return headers
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep or len(line) > _MAX_LINE:
            raise _BadRequest
        key, value = name.strip().lower(), value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    raise _BadRequest


def _read_body(rfile: BinaryIO, headers: Mapping[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        pieces = []
        while True:
            size_line = rfile.readline(_MAX_LINE + 1)
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _BadRequest from None
            if size == 0:
                break
            piece = rfile.read(size + 2)
            if len(piece) < size + 2:
                raise _Drop
            pieces.append(piece[:size])
        while rfile.readline(_MAX_LINE + 1) not in (b"\r\n", b"\n", b""):
            pass  # trailers
        return b"".join(pieces)
    try:
        length = int(headers.get("content-length", "0") or 0)
    except ValueError:
        raise _BadRequest from None
    if length < 0:
        raise _BadRequest
    body = rfile.read(length) if length else b""
    if len(body) < length:
        raise _Drop
    return body


def main(argv: Sequence[str] | None = None) -> int:
    """Serve in the foreground, so benchmarks can keep the server out of the measured process."""
    parser = argparse.ArgumentParser(
        prog="python -m llmspans.tools.simulator", description="Serve a simulated OpenAI-compatible API."
    )
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0: ephemeral)")
    parser.add_argument("--chunks", type=int, default=Behavior().chunks)
    parser.add_argument("--header-delay", type=float, default=0.0)
    parser.add_argument("--first-chunk-delay", type=float, default=0.0)
    parser.add_argument("--chunk-gap", type=float, default=0.0)
    parser.add_argument("--usage", choices=get_args(UsageMode), default="auto")
    model = parser.add_argument_group(
        "capacity model", "batch slots, a queue, per-token timing and vLLM's /metrics (on with --slots)"
    )
    model.add_argument(
        "--slots", type=int, metavar="N", help="requests running at once (vLLM's --max-num-seqs)"
    )
    model.add_argument(
        "--prefill-per-token", type=float, metavar="S", help="seconds per prompt token (0.001)"
    )
    model.add_argument("--decode-per-token", type=float, metavar="S", help="seconds per output token (0.01)")
    model.add_argument("--kv-blocks", type=int, metavar="N", help="KV-cache blocks (1024)")
    model.add_argument("--block-size", type=int, metavar="N", help="tokens per KV-cache block (16)")
    model.add_argument("--max-waiting", type=int, metavar="N", help="reject (503) past this many waiting")
    model.add_argument("--model", metavar="NAME", help="the model_name label of /metrics (sim-model)")
    args = parser.parse_args(argv)
    given = {
        name: getattr(args, name)
        for name in (
            "prefill_per_token",
            "decode_per_token",
            "kv_blocks",
            "block_size",
            "max_waiting",
            "model",
        )
        if getattr(args, name) is not None
    }
    capacity = None
    if args.slots is not None:
        try:
            capacity = Capacity(slots=args.slots, **given)
        except ValueError as error:
            parser.error(str(error))
    elif given:
        parser.error(f"--{next(iter(given)).replace('_', '-')} is part of the capacity model: add --slots N")
    behavior = Behavior(
        chunks=args.chunks,
        header_delay=args.header_delay,
        first_chunk_delay=args.first_chunk_delay,
        chunk_gap=args.chunk_gap,
        usage=args.usage,
    )
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (what process managers send) ends the server as cleanly as Ctrl-C.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    with SimulatedServer(behavior, port=args.port, record=False, capacity=capacity) as server:
        print(server.base_url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
