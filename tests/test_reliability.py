"""Reliability: whatever breaks (llmspans itself, the server, the stream, the exporter), the app behaves
as it would without llmspans, and every span llmspans starts is ended exactly once.

Three parts, all over real HTTP on 127.0.0.1 with the real openai SDK (and plain httpx clients):

1. Internal faults. Each internal hook is made to raise, by the `_guard.inject_faults` switch (a
   site that is `guarded`/`swallow`ed) or by replacing the hook with one that raises. For sync and
   async clients and for each shape of call (streamed, not streamed, an HTTP error, a stream dropped
   mid-way, a refused connection) the caller gets what an uninstrumented client gives (the same
   chunks or body, or the same exception type and status), the failure is logged once however many
   calls and chunks hit it, and every span started is ended exactly once. tests/test_never_breaks.py
   has the first cut of this (sync streams, a few sites); this widens it to every site and shape.
2. Server faults and malformed SSE, from the simulated server and from a raw socket server that
   writes exact bytes: the caller sees the same chunks or the same exception type as without
   llmspans, and the call span ends with the outcome and `error.type` that fit.
3. Exporter faults: exporters and span processors that raise, and a collector that answers 503.
   (tests/test_export.py covers a closed port and a port that never answers.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import llmspans
from llmspans import _call, _exporters, _guard, _telemetry
from llmspans import _names as names
from llmspans._adapters import openai_sdk as _openai
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.local_http import serving
from tests.support.outage import OutageRun, assert_no_slower, run_outage_app

MESSAGES = [{"role": "user", "content": "hi"}]


# --- what every test checks: each span started is ended exactly once -------------------------------


class SpanLedger(SpanProcessor):
    """Sees every span start and end by id, so a span never ended (or ended twice) shows."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started: dict[int, str] = {}
        self.ends: collections.Counter[int] = collections.Counter()

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        with self._lock:
            self.started[span.context.span_id] = span.name

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            self.ends[span.context.span_id] += 1

    def never_ended(self) -> list[str]:
        with self._lock:
            return sorted(name for span_id, name in self.started.items() if span_id not in self.ends)

    def ended_twice(self) -> list[str]:
        with self._lock:
            return sorted(self.started.get(span_id, "?") for span_id, n in self.ends.items() if n > 1)


@dataclass
class Recorded:
    ledger: SpanLedger
    exporter: InMemorySpanExporter
    reader: InMemoryMetricReader

    @property
    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def calls(self) -> list[ReadableSpan]:
        return [s for s in self.spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]

    def call(self) -> ReadableSpan:
        (span,) = self.calls()
        return span

    def assert_each_span_ended_once(self) -> None:
        assert self.ledger.never_ended() == []
        assert self.ledger.ended_twice() == []


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    ledger = SpanLedger()
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(ledger)
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    with _telemetry.use_providers(tracer_provider, meter_provider):
        yield Recorded(ledger, exporter, reader)
    tracer_provider.shutdown()
    meter_provider.shutdown()


def internal_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The sites named by llmspans' "internal error" warnings, one per warning."""
    found = []
    for record in caplog.records:
        matched = re.match(r"llmspans: internal error in (\S+),", record.getMessage())
        if record.name == "llmspans" and matched:
            found.append(matched.group(1))
    return found


SERVER_BEHAVIOR = Behavior(chunks=4, usage="finish")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- 1. internal faults ----------------------------------------------------------------------------

# The shapes of call, as per-request simulator behaviours (`x_sim`); "refused" goes to a closed port.
SHAPES: dict[str, tuple[bool, dict[str, Any]]] = {
    "stream": (True, {}),
    "json": (False, {}),
    "http_error": (False, {"status": 400}),
    "dropped": (True, {"chunks": 6, "drop_after": 2}),
    "refused": (True, {}),
}
ALL_SHAPES = frozenset(SHAPES)
ANSWERED = ALL_SHAPES - {"refused"}

# Each fault site of the openai path and the shapes of call that must reach it (and so log it once).
OPENAI_SITES: dict[str, frozenset[str]] = {
    "openai.begin": ALL_SHAPES,
    "openai.result": frozenset({"stream", "json", "dropped"}),
    "call.finish": ALL_SHAPES,
    "transport.begin": ALL_SHAPES,
    "transport.attempt": ALL_SHAPES,
    "transport.trace": ALL_SHAPES,
    "transport.response": ANSWERED,
    "transport.wrap_body": ANSWERED,
    "transport.close": ALL_SHAPES - {"refused"},
    "transport.failed": frozenset({"refused"}),
}


def dump(item: Any) -> Any:
    """A response object as data, without what differs from one call to the next."""
    return item.model_dump(exclude={"id", "created"})


async def openai_outcome(client: Any, shape: str) -> tuple[Any, ...]:
    """What the caller of one call sees: ("ok", data) or ("raised", type, status, chunks before)."""
    stream, behaviour = SHAPES[shape]
    create = client.chat.completions.create
    seen: list[Any] = []
    try:
        result = create(model="m", messages=MESSAGES, stream=stream, extra_body={"x_sim": behaviour})
        if asyncio.iscoroutine(result):
            result = await result
        if not stream:
            return ("ok", dump(result))
        if isinstance(client, openai.AsyncOpenAI):
            async for chunk in result:
                seen.append(dump(chunk))
        else:
            for chunk in result:
                seen.append(dump(chunk))
        return ("ok", seen)
    except Exception as error:
        return ("raised", type(error), getattr(error, "status_code", None), seen)


def openai_client(kind: str, base_url: str, instrumented: bool = True) -> Any:
    cls = openai.AsyncOpenAI if kind == "async" else openai.OpenAI
    client = cls(base_url=base_url, api_key="sk-test", max_retries=0)
    return llmspans.instrument(client) if instrumented else client


async def close_client(client: Any) -> None:
    result = client.aclose() if hasattr(client, "aclose") else client.close()
    if asyncio.iscoroutine(result):
        await result


def base_url_for(shape: str, server: SimulatedServer) -> str:
    return f"http://127.0.0.1:{closed_port()}/v1" if shape == "refused" else server.base_url


class HitCounter(set[str]):
    """The fault switch's set of sites, counting each time a site in it is reached (so raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: collections.Counter[str] = collections.Counter()

    def __contains__(self, site: object) -> bool:
        found = super().__contains__(site)
        if found:
            self.hits[str(site)] += 1
        return found


async def calls_under_fault(
    kind: str, shape: str, server: SimulatedServer, fault: Callable[[], Any]
) -> tuple[tuple[Any, ...], list[tuple[Any, ...]]]:
    """What an uninstrumented client gets, and what two calls with `fault` in force get."""
    base_url = base_url_for(shape, server)
    plain = openai_client(kind, base_url, instrumented=False)
    client = openai_client(kind, base_url)
    try:
        expected = await openai_outcome(plain, shape)
        with fault():
            got = [await openai_outcome(client, shape), await openai_outcome(client, shape)]
    finally:
        await close_client(plain)
        await close_client(client)
    return expected, got


def site_shapes(sites: dict[str, Any]) -> list[Any]:
    """One test case per fault site and each shape of call that reaches it."""
    return [pytest.param(site, shape) for site, shapes in sorted(sites.items()) for shape in sorted(shapes)]


def assert_unharmed(
    got: list[Any], expected: Any, site: str, counter: HitCounter, caplog: pytest.LogCaptureFixture,
    recorded: Recorded, stands_aside: bool,
) -> None:  # fmt: skip
    """Both faulted calls gave what the uninstrumented one gave; the site was reached on both and said
    once; every span ended once; and a call whose begin failed has no span at all."""
    assert got == [expected, expected]
    assert counter.hits[site] >= 2  # reached on both calls ...
    assert internal_errors(caplog) == [site]  # ... and said once
    recorded.assert_each_span_ended_once()
    assert len(recorded.calls()) == (0 if stands_aside else 2)


@pytest.mark.parametrize(("site", "shape"), site_shapes(OPENAI_SITES))
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_an_injected_fault_at_each_site_leaves_the_call_as_it_was(
    kind: str, site: str, shape: str, server: SimulatedServer, recorded: Recorded,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    counter = HitCounter()
    monkeypatch.setattr(_guard, "faults", counter)
    with caplog.at_level(logging.WARNING, logger="llmspans"):
        expected, got = await calls_under_fault(kind, shape, server, lambda: _guard.inject_faults(site))
    # A failed begin means llmspans stands aside for that call: no span at all, which is fine.
    assert_unharmed(got, expected, site, counter, caplog, recorded, stands_aside=site == "openai.begin")


STREAMED = ("stream", "dropped")
# Hooks replaced by one that raises: the call record's stamps and its metrics, the metric
# instruments, and the stream interceptor's item reader; with the shapes of call that reach them.
RAW_FAULTS: dict[str, tuple[Any, str, tuple[str, ...]]] = {
    "call.content_chunk": (_call.CallRecord, "content_chunk", STREAMED),
    "call.set_usage": (_call.CallRecord, "set_usage", ("stream", "json")),
    "call.set_response": (_call.CallRecord, "set_response", ("stream", "json", "dropped")),
    "call.record_metrics": (_call.CallRecord, "_record_metrics", tuple(sorted(SHAPES))),
    "metric.recorder": (_telemetry, "recorder", tuple(sorted(SHAPES))),
    "stream.item_reader": (_openai, "_chat_item", STREAMED),
}
FAULT_SHAPES = [(fault, shape) for fault, (_, _, shapes) in sorted(RAW_FAULTS.items()) for shape in shapes]


@pytest.mark.parametrize(("fault", "shape"), FAULT_SHAPES)
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_raising_hook_leaves_the_call_as_it_was(
    kind: str, fault: str, shape: str, server: SimulatedServer, recorded: Recorded,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    target, attribute, _ = RAW_FAULTS[fault]
    raised = collections.Counter[str]()

    def raising(*args: Any, **kwargs: Any) -> Any:
        raised[fault] += 1
        raise RuntimeError("llmspans bug")

    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        with monkeypatch.context() as patch:
            patch.setattr(target, attribute, raising)
            yield

    with caplog.at_level(logging.WARNING, logger="llmspans"):
        expected, got = await calls_under_fault(kind, shape, server, patched)
    assert got == [expected, expected]
    assert raised[fault] >= 2
    logged = internal_errors(caplog)
    assert logged, "the failure was not logged"
    assert len(logged) == len(set(logged)), logged  # once per site, not once per chunk or call
    if attribute in ("content_chunk", "_chat_item") and shape == "stream":
        assert raised[fault] >= 8  # it raised on every chunk of both calls, and was logged once
    recorded.assert_each_span_ended_once()
    assert len(recorded.calls()) == 2


@pytest.mark.parametrize("shape", ["stream", "json", "http_error", "dropped"])
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_limiter_slot_is_handed_back_whatever_fails(
    kind: str, shape: str, server: SimulatedServer, recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    """With a cap of one, a slot kept by a failed hook would block the next call for ever."""
    limiter = llmspans.Limiter(1, name="reliability")
    client = llmspans.instrument(
        (openai.AsyncOpenAI if kind == "async" else openai.OpenAI)(
            base_url=server.base_url, api_key="sk-test", max_retries=0
        ),
        limiter=limiter,
    )
    sites = ("call.admitted", "call.finish", "openai.result", "transport.response")
    with caplog.at_level(logging.WARNING, logger="llmspans"), _guard.inject_faults(*sites):
        for _ in range(3):
            await asyncio.wait_for(openai_outcome(client, shape), timeout=10)
    await close_client(client)
    assert limiter.in_flight == 0
    recorded.assert_each_span_ended_once()
    assert len(recorded.calls()) == 3
    assert len(internal_errors(caplog)) == len(set(internal_errors(caplog)))


async def httpx_outcome(client: Any, shape: str) -> tuple[Any, ...]:
    """What the caller of a plain client sees: ("ok", status, body) or ("raised", type)."""
    stream, behaviour = SHAPES[shape]
    body = {"model": "m", "messages": MESSAGES, "stream": stream, "x_sim": behaviour}
    try:
        if isinstance(client, httpx.AsyncClient):
            async with client.stream("POST", "/chat/completions", json=body) as response:
                data = b"".join([piece async for piece in response.aiter_bytes()])
        else:
            with client.stream("POST", "/chat/completions", json=body) as response:
                data = b"".join(response.iter_bytes())
    except Exception as error:
        return ("raised", type(error))
    return ("ok", response.status_code, re.sub(rb'sim\d+|"created":\d+', b"", data))


PLAIN_SITES: dict[str, frozenset[str]] = {
    "httpx.begin": ALL_SHAPES,
    "transport.begin": ALL_SHAPES,
    "transport.attempt": ALL_SHAPES,
    "transport.response": ANSWERED,
    "transport.observe": ANSWERED,
    "transport.observer": ALL_SHAPES,
    "call.finish": ALL_SHAPES,
}


@pytest.mark.parametrize(("site", "shape"), site_shapes(PLAIN_SITES))
@pytest.mark.parametrize("kind", ["httpx.Client", "httpx.AsyncClient"])
async def test_an_injected_fault_leaves_a_plain_client_call_as_it_was(
    kind: str, site: str, shape: str, server: SimulatedServer, recorded: Recorded,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    counter = HitCounter()
    monkeypatch.setattr(_guard, "faults", counter)
    cls = httpx.AsyncClient if kind == "httpx.AsyncClient" else httpx.Client
    base_url = base_url_for(shape, server)
    plain, client = cls(base_url=base_url), llmspans.instrument(cls(base_url=base_url))
    with caplog.at_level(logging.WARNING, logger="llmspans"):
        expected = await httpx_outcome(plain, shape)
        with _guard.inject_faults(site):
            got = [await httpx_outcome(client, shape), await httpx_outcome(client, shape)]
    for each in (plain, client):
        await close_client(each)
    # A plain client's call is opened in begin: when begin fails, llmspans stands aside for that request.
    assert_unharmed(
        got,
        expected,
        site,
        counter,
        caplog,
        recorded,
        stands_aside=site in ("httpx.begin", "transport.begin"),
    )


def broken(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("llmspans bug")


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_failing_end_hook_still_ends_the_stream_call(
    kind: str, server: SimulatedServer, recorded: Recorded, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    @contextlib.contextmanager
    def failing_end() -> Iterator[None]:
        with monkeypatch.context() as patch:
            patch.setattr(_openai, "_finish", broken)
            yield

    with caplog.at_level(logging.WARNING, logger="llmspans"):
        expected, got = await calls_under_fault(kind, "stream", server, failing_end)
    assert got == [expected, expected]
    assert len(internal_errors(caplog)) == 1
    recorded.assert_each_span_ended_once()


@pytest.mark.parametrize("kind", ["openai", "httpx"])
async def test_a_raising_propagator_leaves_no_span_open(
    kind: str, server: SimulatedServer, recorded: Recorded, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from opentelemetry import propagate

    monkeypatch.setattr(propagate, "inject", broken)  # a custom propagator with a bug
    with caplog.at_level(logging.WARNING, logger="llmspans"):
        if kind == "openai":
            client: Any = llmspans.instrument(
                openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
            )
            assert client.chat.completions.create(model="m", messages=MESSAGES).choices
        else:
            client = llmspans.instrument(httpx.Client(base_url=server.base_url))
            assert (
                client.post("/chat/completions", json={"model": "m", "messages": MESSAGES}).status_code == 200
            )
    client.close()
    assert len(internal_errors(caplog)) == 1
    recorded.assert_each_span_ended_once()


@pytest.mark.parametrize("kind", ["httpx.Client", "httpx.AsyncClient"])
async def test_a_raising_redaction_hook_on_a_plain_client_leaves_no_span_open(
    kind: str, server: SimulatedServer, recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    def redact(messages: Any) -> Any:
        raise ValueError("redaction hook bug")

    cls = httpx.AsyncClient if kind == "httpx.AsyncClient" else httpx.Client
    plain, client = (
        cls(base_url=server.base_url),
        llmspans.instrument(cls(base_url=server.base_url), capture_content=redact),
    )
    with caplog.at_level(logging.WARNING, logger="llmspans"):
        expected = await httpx_outcome(plain, "stream")
        assert await httpx_outcome(client, "stream") == expected
    for each in (plain, client):
        await close_client(each)
    recorded.assert_each_span_ended_once()
    assert len(recorded.calls()) == 1


@llmspans.tool
def forecast(city: str) -> str:
    if city == "nowhere":
        raise LookupError(city)
    return f"sunny in {city}"


@llmspans.tool
async def forecast_async(city: str) -> str:
    await asyncio.sleep(0)
    return f"rainy in {city}"


@llmspans.retrieval
def documents(query: str) -> Iterator[str]:
    yield from (f"{query} {n}" for n in range(3))


async def a_turn() -> tuple[Any, ...]:
    with llmspans.turn("chat"):
        first = [forecast("paris") for _ in range(3)]
        second = await forecast_async("oslo")
        third = list(documents("q"))
        try:
            forecast("nowhere")
        except LookupError as error:
            fourth: Any = ("raised", type(error), error.args)
    return (first, second, third, fourth)


async def test_a_fault_in_the_stage_and_turn_hooks_leaves_the_app_as_it_was(
    recorded: Recorded, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = await a_turn()
    recorded.exporter.clear()
    counter = HitCounter()
    monkeypatch.setattr(_guard, "faults", counter)
    with (
        caplog.at_level(logging.WARNING, logger="llmspans"),
        _guard.inject_faults("stage.finish", "turn.finish"),
    ):
        assert await a_turn() == expected
        assert await a_turn() == expected
    assert counter.hits["stage.finish"] >= 12
    assert counter.hits["turn.finish"] == 2
    assert sorted(internal_errors(caplog)) == ["stage.finish", "turn.finish"]
    recorded.assert_each_span_ended_once()
    assert len([s for s in recorded.spans if s.name == "turn chat"]) == 2


# --- 2. server faults and malformed streams -------------------------------------------------------


async def openai_call(client: Any, stream: bool) -> tuple[Any, ...]:
    """One chat call as its caller sees it: ("ok", data) or ("raised", type, chunks before it)."""
    seen: list[Any] = []
    try:
        result = client.chat.completions.create(model="m", messages=MESSAGES, stream=stream)
        if asyncio.iscoroutine(result):
            result = await result
        if not stream:
            return ("ok", result.model_dump())
        if isinstance(client, openai.AsyncOpenAI):
            async for chunk in result:
                seen.append(chunk.model_dump())
        else:
            for chunk in result:
                seen.append(chunk.model_dump())
        return ("ok", seen)
    except Exception as error:
        return ("raised", type(error), seen)


def without_ids(outcome: tuple[Any, ...]) -> tuple[Any, ...]:
    """The simulator numbers ids per request and stamps `created`: equal answers differ only there."""
    text = json.dumps(outcome[1:], default=repr)
    return (outcome[0], re.sub(r'"(id|created)": ("[^"]*"|\d+)', "", text))


# A stall the client's 0.15 s timeout must see as one: the simulator stops waiting as soon as the client
# leaves, so it costs nothing, and only a client thread kept off the CPU for the whole of it (not the 0.45 s
# that a 0.6 s stall left, which a loaded machine did take) could find the next bytes already there.
STALL = 5.0
NETWORK_FAULTS: dict[str, tuple[Behavior | None, float | None, type[Exception], str]] = {
    # fault: (what the simulator does or None for a closed port, client timeout, exception, error.type)
    "connection_refused": (None, None, openai.APIConnectionError, "APIConnectionError"),
    "reset_before_headers": (Behavior(reset_before_headers=True), None, openai.APIConnectionError, "APIConnectionError"),
    "dropped_mid_stream": (Behavior(chunks=6, drop_after=2), None, openai.APIConnectionError, "APIConnectionError"),
    "slow_headers": (Behavior(header_delay=STALL), 0.15, openai.APITimeoutError, "APITimeoutError"),
    "stalled_mid_stream": (Behavior(chunks=4, chunk_gap=STALL), 0.15, openai.APITimeoutError, "APITimeoutError"),
}  # fmt: skip


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("fault", sorted(NETWORK_FAULTS))
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_network_faults_surface_unchanged(
    kind: str, fault: str, stream: bool, recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    behaviour, timeout, exception, error_type = NETWORK_FAULTS[fault]
    if fault == "stalled_mid_stream" and not stream:
        behaviour = Behavior(header_delay=STALL)  # a whole body that comes too late
    with contextlib.ExitStack() as stack:
        if behaviour is None:
            base_url = f"http://127.0.0.1:{closed_port()}/v1"
        else:
            base_url = stack.enter_context(SimulatedServer(behaviour)).base_url
        cls = openai.AsyncOpenAI if kind == "async" else openai.OpenAI
        options: dict[str, Any] = {"base_url": base_url, "api_key": "sk-test", "max_retries": 0}
        if timeout is not None:
            options["timeout"] = timeout
        plain = cls(**options)
        client = llmspans.instrument(cls(**options))
        expected = await openai_call(plain, stream)
        got = await openai_call(client, stream)
        await close_client(plain)
        await close_client(client)
    assert expected[0] == "raised"
    assert issubclass(expected[1], exception), expected
    assert without_ids(got) == without_ids(expected)  # same type, same chunks before it
    recorded.assert_each_span_ended_once()
    span = recorded.call()
    assert span.status.status_code.name == "ERROR"
    assert span.attributes[names.ERROR_TYPE] == error_type
    if stream:
        assert span.attributes[names.STREAM_OUTCOME] == "error"
        assert span.attributes[names.STREAM_CHUNKS] == (
            2 if fault == "dropped_mid_stream" else 1 if fault == "stalled_mid_stream" else 0
        )
    assert "internal error" not in caplog.text


class RawServer:
    """Answers every request with exactly the writes it was given, each with its own `sendall`,
    then closes the connection: for the byte-exact streams the simulator never sends."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.pause = 0.0  # seconds between writes, so each arrives in a read of its own
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}/v1"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._answer, args=(connection,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _answer(self, connection: socket.socket) -> None:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with connection, connection.makefile("rb") as reader:
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            reader.read(length)
            try:
                for piece in self.writes:
                    connection.sendall(piece)
                    if self.pause:
                        time.sleep(self.pause)
                connection.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the client gave up first

    def close(self) -> None:
        self._stop.set()
        self._accepting.join(5)
        for thread in self._threads:
            thread.join(5)
        self._listener.close()


@pytest.fixture
def raw() -> Iterator[RawServer]:
    running = RawServer()
    yield running
    running.close()


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"connection: close\r\n\r\n"
)


def http_chunk(piece: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(piece), piece)


def event(delta: Any = None, *, choices: Any = ..., finish: str | None = None, **extra: Any) -> bytes:
    if choices is ...:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": choices,
        **extra,
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def content(text: str) -> bytes:
    return event({"content": text})


ROLE = event({"role": "assistant"})
FINISH = event({}, finish="stop")
DONE = b"data: [DONE]\n\n"
TEN_MB = "x" * (10 * 1024 * 1024)

# name: (the SSE body's pieces, complete (chunked terminator sent), content chunks it holds,
#        outcome, error.type or None)
MALFORMED: dict[str, tuple[list[bytes], bool, int, str, str | None]] = {
    "non_json_data_line": ([ROLE, content("a"), b"data: this is not json\n\n", content("b"), FINISH, DONE], True, 1, "error", "JSONDecodeError"),
    "truncated_json_in_an_event": ([ROLE, content("a"), b'data: {"id": "c1", "choi\n\n', DONE], True, 1, "error", "JSONDecodeError"),
    "body_ends_mid_event": ([ROLE, content("a"), content("b"), content("c")[:30]], True, 2, "error", "incomplete_stream"),
    "connection_closed_mid_event": ([ROLE, content("a"), content("b")[:30]], False, 1, "error", "APIConnectionError"),
    "event_split_across_writes": ([*[bytes([b]) for b in ROLE + content("a") + content("b")], FINISH, DONE], True, 2, "completed", None),
    "crlf_line_endings": ([p.replace(b"\n", b"\r\n") for p in (ROLE, content("a"), content("b"), FINISH, DONE)], True, 2, "completed", None),
    "comments_and_keep_alives": ([b": keep-alive\n\n", ROLE, b":\n", b"\n\n", content("a"), b": ping\n\n\n", content("b"), FINISH, DONE], True, 2, "completed", None),
    "unknown_fields": ([b"id: 7\nretry: 1000\nfoo: bar\n" + event({"role": "assistant", "x_delta": 1}, x_top={"k": [1]}), b"event: ignored-name\n" + content("a"), event({"content": "b", "x_vendor": True}, finish=None), FINISH, DONE], True, 2, "completed", None),
    "empty_choices": ([ROLE, event(choices=[]), content("a"), event(choices=[]), content("b"), event(choices=[], usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}), DONE], True, 2, "completed", None),
    "null_deltas": ([ROLE, event(None), content("a"), event({"content": None}), event(choices=None), content("b"), FINISH, DONE], True, 2, "completed", None),
    "ten_mb_chunk": ([ROLE, content("a"), content(TEN_MB), content("b"), FINISH, DONE], True, 3, "completed", None),
    "error_event_mid_stream": ([ROLE, content("a"), b'data: {"error": {"message": "overloaded", "type": "server_error"}}\n\n', DONE], True, 1, "error", "APIError"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_malformed_streams_reach_the_caller_as_without_llmspans(
    kind: str, case: str, raw: RawServer, recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    pieces, complete, chunks, outcome, error_type = MALFORMED[case]
    raw.writes = [SSE_HEAD, *(http_chunk(piece) for piece in pieces), *([b"0\r\n\r\n"] if complete else [])]
    raw.pause = 0.001 if case == "event_split_across_writes" else 0.0
    cls = openai.AsyncOpenAI if kind == "async" else openai.OpenAI
    plain = cls(base_url=raw.base_url, api_key="sk-test", max_retries=0)
    client = llmspans.instrument(cls(base_url=raw.base_url, api_key="sk-test", max_retries=0))
    expected = await openai_call(plain, stream=True)
    got = await openai_call(client, stream=True)
    await close_client(plain)
    await close_client(client)
    assert got == expected  # the same chunks, and the same exception type after them
    # A stream cut short at an event boundary raises nothing in the app: only its span says so.
    raises = error_type not in (None, names.ERROR_INCOMPLETE_STREAM)
    assert (expected[0] == "raised") == raises, expected[:2]
    recorded.assert_each_span_ended_once()
    span = recorded.call()
    assert span.attributes[names.STREAM_OUTCOME] == outcome
    assert span.attributes[names.STREAM_CHUNKS] == chunks
    assert span.attributes.get(names.ERROR_TYPE) == error_type
    assert "internal error" not in caplog.text


# The same bytes read by a plain client: it sees bytes, not parsed chunks, so a line that is not JSON
# or an error event is no error to it (the call completes), and a cut connection is httpx's own error.
PLAIN_MALFORMED: dict[str, tuple[int, str, str | None]] = {
    "non_json_data_line": (2, "completed", None),
    "truncated_json_in_an_event": (1, "completed", None),
    "connection_closed_mid_event": (1, "error", "RemoteProtocolError"),
    "error_event_mid_stream": (1, "completed", None),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("kind", ["httpx.Client", "httpx.AsyncClient"])
async def test_malformed_streams_reach_a_plain_client_as_without_llmspans(
    kind: str, case: str, raw: RawServer, recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    pieces, complete, chunks, outcome, error_type = MALFORMED[case]
    chunks, outcome, error_type = PLAIN_MALFORMED.get(case, (chunks, outcome, error_type))
    raw.writes = [SSE_HEAD, *(http_chunk(piece) for piece in pieces), *([b"0\r\n\r\n"] if complete else [])]
    raw.pause = 0.001 if case == "event_split_across_writes" else 0.0
    cls = httpx.AsyncClient if kind == "httpx.AsyncClient" else httpx.Client
    plain, client = cls(base_url=raw.base_url), llmspans.instrument(cls(base_url=raw.base_url))
    expected = await httpx_outcome(plain, "stream")
    got = await httpx_outcome(client, "stream")
    for each in (plain, client):
        await close_client(each)
    assert got == expected  # the same bytes, or the same exception type
    recorded.assert_each_span_ended_once()
    span = recorded.call()
    assert span.attributes[names.STREAM_OUTCOME] == outcome
    assert span.attributes[names.STREAM_CHUNKS] == chunks
    assert span.attributes.get(names.ERROR_TYPE) == error_type
    assert "internal error" not in caplog.text


# --- 3. exporter faults ----------------------------------------------------------------------------


class RaisingSpanExporter(SpanExporter):
    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Any) -> Any:
        self.calls += 1
        raise ConnectionError("collector down")


class RaisingMetricExporter(MetricExporter):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self.calls += 1
        raise ConnectionError("collector down")

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


@llmspans.tool
def lookup(city: str) -> str:
    return city.upper()


async def one_of_each(base_url: str, instrumented: bool) -> list[Any]:
    """A streamed and a non-streamed call, sync and async, an HTTP error, and a tool: what the app sees."""
    seen: list[Any] = []
    for kind in ("sync", "async"):
        client = openai_client(kind, base_url, instrumented)
        for shape in ("stream", "json", "http_error"):
            seen.append(await openai_outcome(client, shape))
        await close_client(client)
    try:
        seen.append(("ok", lookup("paris")))
    except Exception as error:
        seen.append(("raised", type(error)))
    return seen


async def test_exporters_that_raise_never_reach_the_app(
    server: SimulatedServer, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = SpanLedger()
    span_exporter, metric_exporter = RaisingSpanExporter(), RaisingMetricExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(ledger)
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter, schedule_delay_millis=10))
    reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=20)
    meter_provider = MeterProvider(metric_readers=[reader])
    expected = await one_of_each(server.base_url, instrumented=False)
    with caplog.at_level(logging.WARNING), _telemetry.use_providers(tracer_provider, meter_provider):
        got = await one_of_each(server.base_url, instrumented=True)
        assert tracer_provider.force_flush(5_000)
        meter_provider.force_flush(5_000)
    tracer_provider.shutdown()
    meter_provider.shutdown()
    assert without_ids(("ok", got)) == without_ids(("ok", expected))
    assert span_exporter.calls >= 1
    assert metric_exporter.calls >= 1
    assert ledger.never_ended() == []
    assert ledger.ended_twice() == []
    assert internal_errors(caplog) == []


class RaisingSpanProcessor(SpanProcessor):
    """A third-party span processor with a bug in `on_end` (the SDK calls it unguarded, from `span.end()`)."""

    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("span processor bug")


async def test_a_span_processor_that_raises_never_reaches_the_app(
    server: SimulatedServer, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = SpanLedger()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(ledger)  # sees each end before the broken processor raises
    tracer_provider.add_span_processor(RaisingSpanProcessor())
    expected = await one_of_each(server.base_url, instrumented=False)
    limiter = llmspans.Limiter(1, name="processor")
    with caplog.at_level(logging.WARNING), _telemetry.use_providers(tracer_provider, MeterProvider()):
        got = await one_of_each(server.base_url, instrumented=True)
        client = llmspans.instrument(
            openai_client("async", server.base_url, instrumented=False), limiter=limiter
        )
        limited = []
        for _ in range(2):  # a slot kept by the failed end would block the second call
            try:
                limited.append(await asyncio.wait_for(openai_outcome(client, "json"), 5))
            except asyncio.TimeoutError:
                limited.append(("blocked by the limiter",))
    assert without_ids(("ok", got)) == without_ids(("ok", expected))
    assert [outcome[0] for outcome in limited] == ["ok", "ok"], limited
    assert limiter.in_flight == 0
    assert ledger.never_ended() == []
    assert len(internal_errors(caplog)) == len(set(internal_errors(caplog)))


class _Collector503(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that is up but answers every export with 503 (overloaded, retry later)."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        self.server.posts.append((self.path, len(body)))  # type: ignore[attr-defined]
        self.send_response(503)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def collector_503() -> Iterator[ThreadingHTTPServer]:
    with serving(_Collector503, posts=[]) as server:
        yield server


@dataclass
class Outage503(OutageRun):
    posts: list[tuple[str, int]]
    """(path, status) of every request the collector answered."""


@pytest.fixture(scope="module")
def outage_503(collector_503: ThreadingHTTPServer) -> Outage503:
    """The outage app, run once against the 503 collector; the tests below read what it did."""
    endpoint = f"http://127.0.0.1:{collector_503.server_address[1]}"
    run = run_outage_app(endpoint, "http/protobuf", "collector-503", calls=25)
    posts = list(collector_503.posts)  # type: ignore[attr-defined]
    return Outage503(run.result, run.exit_took, run.stderr, posts)


def test_a_collector_answering_503_costs_the_app_nothing(outage_503: Outage503) -> None:
    result = outage_503.result
    # The app's calls: no slower than uninstrumented ones beside them in the same process.
    assert_no_slower(result)
    # The queue is bounded: 5,000 more spans while it is full grow memory by far less than they weigh.
    assert result["rss_growth"] < 4_000_000, result
    assert result["dropped"] >= _exporters.SPAN_BATCH_SIZE, result
    # The collector is not hammered: one export is retried within its timeout, then probed now and then.
    assert 1 <= len([p for p, _ in outage_503.posts if p == "/v1/traces"]) <= 20, outage_503.posts
    assert outage_503.exit_took < _exporters.SHUTDOWN_BOUND_S + 1.5, outage_503.exit_took
    (warning,) = outage_503.warnings()
    assert "spans are being dropped" in warning


def test_the_warning_names_the_503(outage_503: Outage503) -> None:
    (warning,) = outage_503.warnings()
    assert "(HTTP 503)" in warning, warning


@pytest.mark.parametrize(
    ("reason", "cause"),
    [
        ("Too Many Requests", "HTTP 429"),
        ("Bad Gateway", "HTTP 502"),
        ("Service Unavailable", "HTTP 503"),
        ("Gateway Timeout", "HTTP 504"),
        ("some proxy's own words", "no answer within 5.0 s"),  # not a status: the timeout is what is known
    ],
)
def test_a_retried_status_is_named_by_its_code(reason: str, cause: str) -> None:
    """The OTLP/HTTP client's retry log (its format strings, verbatim) names a status by its phrase."""
    exporter_logger = "opentelemetry.exporter.otlp.proto.http.trace_exporter.test-cause"
    for message, args in [
        (
            "Transient error %s encountered while exporting %s batch, retrying in %.2fs.",
            (reason, "spans", 1.0),
        ),
        ("Failed to export %s batch due to timeout, max retries or shutdown.", ("spans",)),
    ]:
        record = logging.LogRecord(exporter_logger, logging.WARNING, __file__, 1, message, args, None)
        _exporters._repeat_filter.filter(record)
    try:
        assert _exporters._failure_cause(None, 5.0, exporter_logger) == cause
    finally:
        _exporters._repeat_filter.recent.pop(exporter_logger, None)


def test_every_span_lost_to_a_503_collector_is_counted(outage_503: Outage503) -> None:
    assert outage_503.result["dropped"] == outage_503.result["created"], outage_503.result


# The embedded default: its file cannot be written (a full disk), or cannot be created at all.

DISK_FULL_APP = """
import json, time, llmspans, openai
from llmspans.tools.simulator import Behavior, SimulatedServer
from opentelemetry import trace

llmspans.configure(service_name="disk-full", traces_file="/dev/full", metric_interval=0.2)  # writes fail: ENOSPC

@llmspans.stage("work")
def work():
    return 42

answers = []
with SimulatedServer(Behavior(chunks=3)) as server:
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))
    for _ in range(5):
        answers.append(work())
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        answers.append(len(list(stream)))
        trace.get_tracer_provider().force_flush(2_000)  # a batch written (and failed) per round
        time.sleep(0.25)
print(json.dumps(answers), flush=True)
"""


@pytest.fixture(scope="module")
def disk_full() -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DISK_FULL_APP)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_full_disk_never_reaches_the_app(disk_full: subprocess.CompletedProcess[str]) -> None:
    assert disk_full.returncode == 0, disk_full.stderr
    assert json.loads(disk_full.stdout) == [42, 5] * 5


def test_a_full_disk_is_said_once(disk_full: subprocess.CompletedProcess[str]) -> None:
    assert disk_full.stderr.count("Traceback") <= 1, disk_full.stderr[-2000:]


def test_an_unwritable_default_traces_file_does_not_stop_the_app() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    code = "import llmspans\nllmspans.configure(service_name='read-only')\nprint('started', flush=True)\n"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd="/proc", capture_output=True, text=True, timeout=60
    )  # /proc: a directory nobody, root included, can create a file in
    assert result.returncode == 0, result.stderr[-2000:]
    assert "started" in result.stdout
