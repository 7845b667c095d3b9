"""Held spans (`llmspans/_held_span.py`): what is exported is what the SDK's own spans would have exported.

The same workload runs twice on one simulated server over real HTTP: once with llmspans' spans held (under
tail sampling: built only when their trace is kept; on a plain provider: built at their end), once as SDK
spans (`TailSampling(defer=False)`; a provider whose extra processor has an `on_start`). Every exported
span is compared field by field: name, kind, trace and span ids and parent (by place in the trace: the
ids are drawn from a counter, so equal runs draw equal ids), status, resource, scope, links, tracestate,
every attribute, every event's name and attributes, in order. What the clock decides (start and end
times, event times, the buckets' seconds) cannot be equal across two runs; those are compared for their
presence, type and order within the span. `HeldSpan` against an SDK span for the same writes, with the
times given, is compared whole, times included.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON
from opentelemetry.trace import SpanKind, Status, StatusCode

import llmspans
from llmspans import _held_span, _setup, _tail_sampling, _telemetry
from llmspans import _names as names
from llmspans._openai_wire import carries_tokens
from llmspans.testing import settle
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.golden import CountingIds
from tests.support.realservers import PhoenixServer, flatten

MESSAGES = [{"role": "user", "content": "hi"}]
# Attributes whose values the clock decides (and the id the server gives each answer, counting up across
# the runs): compared for presence and type only.
TIMED = {
    names.GEN_AI_RESPONSE_ID,
    *names.BUCKET_ATTRIBUTES, names.BUCKET_DOMINANT, names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, names.ITL_P50,
    names.ITL_P95, names.ITL_MAX, names.OUTPUT_TOKENS_PER_SECOND, names.BUDGET_OVERRUN, names.ELAPSED,
    names.RETRY_BACKOFF, names.CONNECT_DURATION, names.HEDGE_FIRST_TOKEN,
}  # fmt: skip


class _Starts(SpanProcessor):
    """A processor with an `on_start` of its own: beside it, every span is the SDK's."""

    def __init__(self) -> None:
        self.started = 0

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.started += 1


@contextmanager
def recording(held: bool, tail: bool) -> Iterator[Callable[[], list[ReadableSpan]]]:
    """Record into a provider whose spans are held (or not), under tail sampling that keeps every trace
    (ratio 1, no slower_than rule) or on a plain provider; yields what was exported, settled."""
    exported = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON, id_generator=CountingIds())
    if tail:
        sampling = llmspans.TailSampling(ratio=1.0, slower_than=None, defer=held)
        provider.add_span_processor(
            llmspans.TailSamplingProcessor(SimpleSpanProcessor(exported), sampling=sampling)
        )
    else:
        provider.add_span_processor(SimpleSpanProcessor(exported))
        if not held:
            provider.add_span_processor(_Starts())
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    tracer = provider.get_tracer(names.INSTRUMENTATION_NAME)
    plan = _held_span.plan_of(tracer)
    assert (plan is not None) is held, "the provider decides whether spans are held"
    try:
        with _telemetry.use_providers(provider, meter_provider):

            def spans(expected: int = 0) -> list[ReadableSpan]:
                """What was exported, once `expected` spans have ended: a hedge's loser (or a cut stream)
                may end on its own thread a moment after the call returned (a wait only, bounded)."""
                settle()
                deadline = time.monotonic() + 10
                while len(exported.get_finished_spans()) < expected and time.monotonic() < deadline:
                    time.sleep(0.005)
                return list(exported.get_finished_spans())

            yield spans
    finally:
        provider.shutdown()
        meter_provider.shutdown()


def workload(server: SimulatedServer) -> None:
    """The calls a held span must not change: streamed, retried, hedged, limited, over budget, failed, a
    stage, a turn, an exception in a stage; and the app writing on llmspans' spans itself."""
    server.default = Behavior(chunks=3, usage="finish")
    plain = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))
    retrying = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=2))
    hedged = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), hedge=llmspans.Hedge(after=0.25)
    )  # (late enough that the primary's request is the server's first, on a busy machine too)
    limited = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0),
        limiter=llmspans.Limiter(2, name="lane"), budget=0.000001, phase_spans="never",
    )  # fmt: skip  # (which phases an over-budget call's spans show is the clock's doing)

    @llmspans.retrieval
    def search() -> str:
        trace.get_current_span().set_attribute("app.note", ["written", "by the app"])
        return "doc"

    @llmspans.tool
    def broken() -> None:
        raise ValueError("no")

    with llmspans.turn("chat", budget=60) as root:
        root.set_attribute("app.user", "u1")
        search()
        for _chunk in plain.chat.completions.create(model="sim-model", messages=MESSAGES, stream=True):
            pass
        plain.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=5, temperature=0.5)
    server.enqueue(Behavior(status=503, retry_after_ms=1), Behavior(chunks=2))
    retrying.chat.completions.create(model="sim-model", messages=MESSAGES)
    server.enqueue(Behavior(header_delay=1.0), Behavior(chunks=2))
    hedged.chat.completions.create(model="sim-model", messages=MESSAGES)
    limited.chat.completions.create(model="sim-model", messages=MESSAGES)
    with pytest.raises(openai.APIStatusError):
        plain.chat.completions.create(
            model="sim-model", messages=MESSAGES, extra_body={"x_sim": {"status": 500}}
        )
    with pytest.raises(ValueError, match="no"), llmspans.turn("tools"):
        broken()
    assert server.wait_idle(10)


def _places(spans: list[ReadableSpan]) -> dict[int, str]:
    """Each span id's place: its trace's root name and the path of names down to it, with the span's rank
    among same-named siblings (by start): what makes two runs' spans the same span."""
    by_id = {span.context.span_id: span for span in spans}  # type: ignore[union-attr]
    children: dict[int | None, list[ReadableSpan]] = {}
    for span in spans:
        parent = span.parent.span_id if span.parent is not None else None
        children.setdefault(parent if parent in by_id else None, []).append(span)
    places: dict[int, str] = {}

    def walk(parent: int | None, path: str) -> None:
        seen: dict[str, int] = {}
        for span in sorted(children.get(parent, []), key=lambda s: s.start_time or 0):
            rank = seen[span.name] = seen.get(span.name, -1) + 1
            place = f"{path}/{span.name}#{rank}"
            places[span.context.span_id] = place  # type: ignore[union-attr]
            walk(span.context.span_id, place)  # type: ignore[union-attr]

    walk(None, "")
    return places


def _shown(span: ReadableSpan, places: dict[int, str]) -> dict[str, Any]:
    """A span as compared: the clock's values as their type, every other field as it is."""

    def value(key: str, found: Any) -> Any:
        timed = key in TIMED or key.startswith(names.TURN_STAGE_PREFIX)
        return type(found).__name__ if timed else found

    context = span.context
    assert context is not None
    assert span.start_time is not None
    assert span.end_time is not None
    assert span.start_time <= span.end_time
    events = []
    for event in span.events:
        assert span.start_time <= event.timestamp, (span.name, event.name)
        events.append((event.name, {k: value(k, v) for k, v in (event.attributes or {}).items()}))
    return {
        "place": places[context.span_id],
        "name": span.name,
        "kind": span.kind,
        "parent": places.get(span.parent.span_id) if span.parent is not None else None,
        "remote parent": span.parent.is_remote if span.parent is not None else None,
        "flags": int(context.trace_flags),
        "tracestate": context.trace_state.to_header(),
        "status": (span.status.status_code, span.status.description),
        "attributes": {key: value(key, found) for key, found in (span.attributes or {}).items()},
        "dropped attributes": span.dropped_attributes,
        "events": events,
        "links": [(link.context, dict(link.attributes or {})) for link in span.links],
        "resource": dict(span.resource.attributes),
        "scope": span.instrumentation_scope,
    }


@pytest.mark.parametrize("tail", [True, False], ids=["tail sampling", "plain provider"])
def test_held_spans_export_what_sdk_spans_export_field_by_field(server: SimulatedServer, tail: bool) -> None:
    runs = []
    for held in (True, False):
        with recording(held, tail) as spans:
            workload(server)
            found = spans(14)
        runs.append(found)
    held_spans, sdk_spans = runs
    assert len(held_spans) == len(sdk_spans) == 14, (
        sorted(s.name for s in held_spans),
        sorted(s.name for s in sdk_spans),
    )
    held_shown = _same(held_spans, sdk_spans)
    kinds = {s["name"] for s in held_shown}
    assert {
        "turn chat",
        "retrieval workload.<locals>.search",
        "chat sim-model",
        "execute_tool broken",
        "POST",
    } <= kinds
    weights = {s["attributes"].get(names.SAMPLE_WEIGHT) for s in held_shown}
    assert weights == ({1.0} if tail else {None})


def _same(held_spans: list[ReadableSpan], sdk_spans: list[ReadableSpan]) -> list[dict[str, Any]]:
    """Held and SDK spans compared field by field, by place; the held ones as shown."""
    held_shown = sorted((_shown(span, _places(held_spans)) for span in held_spans), key=lambda s: s["place"])
    sdk_shown = sorted((_shown(span, _places(sdk_spans)) for span in sdk_spans), key=lambda s: s["place"])
    for one, other in zip(held_shown, sdk_shown, strict=True):
        differing = {key: (one[key], other[key]) for key in one if one[key] != other[key]}
        if "attributes" in differing:
            a, b = differing["attributes"]
            differing["attributes"] = {k: (a.get(k), b.get(k)) for k in {*a, *b} if a.get(k) != b.get(k)}  # type: ignore[assignment]
        assert not differing, (one["place"], differing)
    # Ids are drawn as the SDK draws them: the same counter gives both runs the same ids, span for span.
    assert sorted(s.context.span_id for s in held_spans) == sorted(s.context.span_id for s in sdk_spans)  # type: ignore[union-attr]
    return held_shown


async def async_workload(server: SimulatedServer) -> None:
    """The ends a stream can have, async and sync: read to its end, closed after one chunk, its task
    cancelled while it waits for the next, cut by the server after one chunk; and a failed async call."""
    # Chunks 50 ms apart, the first 50 ms after the role chunk: a stream closed or cancelled at its first
    # content chunk has read exactly that one in both runs (back to back, one TCP read could hold more).
    server.default = Behavior(chunks=3, usage="finish", chunk_gap=0.05, first_chunk_delay=0.05)
    client = llmspans.instrument(openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0))
    plain = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))
    with llmspans.turn("async chat"):
        async for _chunk in await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, stream=True
        ):
            pass
        stream = await client.chat.completions.create(model="sim-model", messages=MESSAGES, stream=True)
        async for chunk in stream:
            if carries_tokens(chunk):
                break
        await stream.close()
    # (the server's wait ends with the connection)
    server.enqueue(Behavior(chunks=3, chunk_gap=30.0, first_chunk_delay=0.05))
    first = asyncio.Event()

    async def read() -> None:
        async for chunk in await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, stream=True
        ):
            if carries_tokens(chunk):
                first.set()

    task = asyncio.create_task(read())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The cut comes a gap after the first chunk: that chunk is read in both runs, not lost with the reset.
    server.enqueue(Behavior(chunks=3, drop_after=1, chunk_gap=0.05))
    with pytest.raises(openai.APIError):
        async for _chunk in await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, stream=True
        ):
            pass
    sync_stream = plain.chat.completions.create(model="sim-model", messages=MESSAGES, stream=True)
    next(chunk for chunk in sync_stream if carries_tokens(chunk))
    sync_stream.close()
    with pytest.raises(openai.APIStatusError):
        await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, extra_body={"x_sim": {"status": 500}}
        )
    await client.close()


@pytest.mark.parametrize("tail", [True, False], ids=["tail sampling", "plain provider"])
def test_async_and_cut_streams_end_their_held_spans_as_sdk_spans_end(
    server: SimulatedServer, tail: bool
) -> None:
    runs = []
    for held in (True, False):
        with recording(held, tail) as spans:
            asyncio.run(async_workload(server))
            found = spans(7)
        runs.append(found)
    held_spans, sdk_spans = runs
    assert len(held_spans) == len(sdk_spans) == 7, sorted(span.name for span in held_spans)
    outcomes = sorted(
        str(s["attributes"].get(names.STREAM_OUTCOME))
        for s in _same(held_spans, sdk_spans)
        if s["kind"] == SpanKind.CLIENT and s["name"] != "POST"
    )
    assert outcomes == sorted(["completed", "abandoned", "cancelled", "error", "abandoned", "None"]), outcomes


class _BrokenEnd(SpanProcessor):
    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("a broken processor")


class _BrokenExporter(InMemorySpanExporter):
    def export(self, spans: Any) -> Any:
        raise RuntimeError("a broken exporter")


@pytest.mark.parametrize("broken", [_BrokenEnd, _BrokenExporter], ids=["processor", "exporter"])
def test_a_broken_processor_or_exporter_beside_held_spans_never_reaches_the_app(
    server: SimulatedServer, broken: type
) -> None:
    """Held spans built at their end (the provider's processors are all quiet at start): a processor whose
    `on_end` raises, or an exporter that does, reaches neither a sync nor an async call, a stage or a turn;
    the healthy processor before it still gets every span, ended."""
    server.default = Behavior(chunks=2, usage="finish")
    exported = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(SimpleSpanProcessor(exported))
    provider.add_span_processor(broken() if broken is _BrokenEnd else SimpleSpanProcessor(broken()))
    assert _held_span.plan_of(provider.get_tracer(names.INSTRUMENTATION_NAME)) is not None  # held
    plain = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))

    @llmspans.stage("prompt")
    def prompt() -> str:
        return "p"

    async def asking() -> None:
        client = llmspans.instrument(openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0))
        async for _chunk in await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, stream=True
        ):
            pass
        await client.close()

    with _telemetry.use_providers(provider, MeterProvider()), llmspans.turn("chat"):
        prompt()
        for _chunk in plain.chat.completions.create(model="sim-model", messages=MESSAGES, stream=True):
            pass
        asyncio.run(asking())
    settle()
    spans = exported.get_finished_spans()
    assert sorted(span.name for span in spans) == ["chat sim-model", "chat sim-model", "prompt", "turn chat"]
    assert all(span.end_time is not None for span in spans)
    provider.shutdown()


def test_a_dropped_trace_builds_nothing_and_a_kept_one_is_built_once(server: SimulatedServer) -> None:
    """ratio 0, no slower_than: an ordinary turn is dropped (its held spans never built, its facts never
    written), a failed one kept whole; metrics count both."""
    built: list[str] = []
    original = _held_span.HeldSpan.build

    def counting(self: _held_span.HeldSpan, *args: Any, **kwargs: Any) -> ReadableSpan:
        built.append(self.name)
        return original(self, *args, **kwargs)

    exported = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(
        llmspans.TailSamplingProcessor(SimpleSpanProcessor(exported), ratio=0.0, slower_than=None)
    )
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))
    written: list[str] = []
    write_span = llmspans._call.CallFacts.write_span

    def spying(self: Any, span: Any) -> None:
        written.append(self.response_model or "")
        write_span(self, span)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_held_span.HeldSpan, "build", counting)
        patch.setattr(llmspans._call.CallFacts, "write_span", spying)
        with _telemetry.use_providers(provider, meter_provider):

            @llmspans.stage("prompt")
            def prompt() -> str:
                return "p"

            with llmspans.turn("ordinary"):
                prompt()
                client.chat.completions.create(model="sim-model", messages=MESSAGES)
            assert built == []
            assert written == []

            def failed() -> None:
                with llmspans.turn("failed"):
                    prompt()
                    client.chat.completions.create(
                        model="sim-model", messages=MESSAGES, extra_body={"x_sim": {"status": 500}}
                    )

            with pytest.raises(openai.APIStatusError):
                failed()
            settle()
    assert sorted(built) == ["chat sim-model", "prompt", "turn failed"]
    assert len(written) == 1
    assert sorted(span.name for span in exported.get_finished_spans()) == sorted(built)
    data = reader.get_metrics_data()
    counts = {
        point.attributes.get(names.STAGE): point.count  # type: ignore[union-attr]
        for resource in data.resource_metrics  # type: ignore[union-attr]
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == names.METRIC_STAGE_DURATION
        for point in metric.data.data_points
    }
    assert counts == {"prompt": 2, names.STAGE_LLM: 2, names.STAGE_TURN: 2}
    provider.shutdown()
    meter_provider.shutdown()


def test_an_app_processor_added_beside_tail_sampling_sees_sdk_spans() -> None:
    """What an app's own processor on configure()'s provider sees: every span, an SDK span from its start;
    spans are held only while tail sampling is the provider's one processor."""
    exported = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(llmspans.TailSamplingProcessor(SimpleSpanProcessor(exported), ratio=1.0))
    tracer = provider.get_tracer(names.INSTRUMENTATION_NAME)
    assert type(_held_span.start_span(tracer, "before")) is _held_span.HeldSpan
    seen = _Starts()
    provider.add_span_processor(seen)
    span = _held_span.start_span(tracer, "after")
    assert type(span) is not _held_span.HeldSpan
    assert seen.started == 1
    provider.shutdown()


def _sdk_and_held(
    limits: SpanLimits | None, write: Callable[[Callable[..., Any]], None]
) -> list[ReadableSpan]:
    """The same writes through the SDK's tracer and through held spans, ids from two equal counters."""
    found = []
    for held in (False, True):
        exported = InMemorySpanExporter()
        provider = TracerProvider(id_generator=CountingIds(), span_limits=limits)
        provider.add_span_processor(SimpleSpanProcessor(exported))
        tracer = provider.get_tracer("probe", "1.0")

        def start(name: str, tracer: Any = tracer, held: bool = held, **options: Any) -> Any:
            return (
                _held_span.start_span(tracer, name, **options) if held else tracer.start_span(name, **options)
            )

        write(start)
        found.append(list(exported.get_finished_spans()))
        provider.shutdown()
    sdk, held_spans = found
    assert [type(s).__name__ for s in held_spans] == ["ReadableSpan"] * len(sdk)
    return [*sdk, *held_spans]


def _whole(span: ReadableSpan) -> dict[str, Any]:
    return {
        "name": span.name, "context": span.context, "parent": span.parent, "kind": span.kind,
        "start": span.start_time, "end": span.end_time, "attributes": list((span.attributes or {}).items()),
        "dropped": span.dropped_attributes, "status": (span.status.status_code, span.status.description),
        "events": [(e.name, e.timestamp, dict(e.attributes or {}), e.dropped_attributes) for e in span.events],
        "links": [(link.context, dict(link.attributes or {})) for link in span.links],
        "resource": span.resource, "scope": span.instrumentation_scope,
    }  # fmt: skip


@pytest.mark.parametrize(
    "limits", [None, SpanLimits(max_span_attributes=3, max_span_attribute_length=2, max_events=1)],
    ids=["default limits", "tight limits"],
)  # fmt: skip
def test_a_held_span_is_the_sdk_span_for_the_same_writes_times_included(limits: SpanLimits | None) -> None:
    def write(start: Callable[..., Any]) -> None:
        root = start("root", kind=SpanKind.CLIENT, attributes={"a": 1, "b": "xyz"}, start_time=100)
        root.set_attribute("c", [1, 2])
        root.set_attributes({"b": "again", "d": 2.5, "": 3, "e": object()})
        root.add_event("one", {"k": "v", "list": ["x"]}, 150)
        child = start("child", context=trace.set_span_in_context(root), start_time=110)
        child.set_status(Status(StatusCode.ERROR, "bad"))
        try:
            raise KeyError("boom")
        except KeyError as error:
            child.record_exception(error, {"extra": 1}, timestamp=160)
        child.end(170)
        root.update_name("root renamed")
        root.add_event("two", None, 180)
        root.set_status(StatusCode.OK)
        root.set_status(StatusCode.ERROR)  # OK is final
        root.add_link(child.get_span_context(), {"l": 1})
        root.end(200)
        root.set_attribute("late", 1)  # after the end: ignored
        root.end(300)

    spans = _sdk_and_held(limits, write)
    half = len(spans) // 2
    for sdk, held in zip(spans[:half], spans[half:], strict=True):
        assert _whole(held) == _whole(sdk)


def test_held_spans_follow_the_providers_sampler_and_parents() -> None:
    """Unsampled, a remote parent that is not sampled, a remote sampled one: as the SDK decides, same ids."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    remote_sampled = SpanContext(7, 8, True, TraceFlags(TraceFlags.SAMPLED))
    remote_not = SpanContext(9, 10, True, TraceFlags(TraceFlags.DEFAULT))
    for sampler in (ALWAYS_OFF, ParentBased(ALWAYS_ON), ParentBased(TraceIdRatioBased(0.5)), ALWAYS_ON):
        for parent in (None, remote_sampled, remote_not):
            made = []
            for held in (False, True):
                provider = TracerProvider(sampler=sampler, id_generator=CountingIds())
                provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
                tracer = provider.get_tracer("probe")
                context = trace.set_span_in_context(NonRecordingSpan(parent)) if parent is not None else None
                start = _held_span.start_span if held else lambda t, n, c: t.start_span(n, context=c)
                span = start(tracer, "s", context)
                made.append((span.is_recording(), span.get_span_context()))
                span.end()
            assert made[0] == made[1], (sampler, parent)


def test_no_held_span_is_left_in_a_reference_cycle(server: SimulatedServer) -> None:
    """A held span holds its owner (the call record, the stage, the turn) for its facts; the owner lets go
    of the span at its end: a dropped trace's held spans are freed by reference counting."""
    import gc

    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(
        llmspans.TailSamplingProcessor(
            SimpleSpanProcessor(InMemorySpanExporter()), ratio=0.0, slower_than=None
        )
    )
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))

    @llmspans.stage("prompt")
    def prompt() -> str:
        return "p"

    def turns(count: int) -> None:
        for _ in range(count):
            with llmspans.turn("chat"):
                prompt()
                for _chunk in client.chat.completions.create(
                    model="sim-model", messages=MESSAGES, stream=True
                ):
                    pass

    with _telemetry.use_providers(provider, meter_provider):
        turns(5)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            turns(20)
            gc.collect()
            found = [
                item
                for item in gc.garbage
                if isinstance(item, (_held_span.HeldSpan, llmspans._call.CallRecord))
            ]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert found == []
    provider.shutdown()
    meter_provider.shutdown()


# --- LLMSPANS_TAIL_SAMPLING --------------------------------------------------------------------------------


def test_the_environment_is_read_by_tail_samplings_own_checks() -> None:
    read = _tail_sampling.tail_sampling_from_text
    assert read("ratio=0.01,slower_than=p95") == llmspans.TailSampling(ratio=0.01, slower_than="p95")
    assert read(
        " ratio = 0.5 , slower_than = 2500ms , max_age = 60s , defer = false "
    ) == llmspans.TailSampling(ratio=0.5, slower_than=2.5, max_age=60.0, defer=False)
    assert read("on") == llmspans.TailSampling()
    assert read("off") is None
    assert read("") is None
    assert read("slower_than=none").slower_than is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("ratio=lots", "ratio must be a number from 0 to 1"),
        ("ratio=2", "ratio must be from 0 to 1"),
        ("slower_than=p101", "slower_than must be seconds or a percentile"),
        ("rate=0.1", "must be one of ratio=..."),
        ("max_held_spans=many", "max_held_spans must be a whole number"),
        ("defer=perhaps", "defer must be true or false"),
    ],
)
def test_a_bad_environment_value_is_one_warning_naming_the_variable(
    value: str, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="llmspans"):
        assert _tail_sampling.tail_sampling_from_environment({names.ENV_TAIL_SAMPLING: value}) is None
    (record,) = caplog.records
    assert names.ENV_TAIL_SAMPLING in record.getMessage()
    assert says in record.getMessage()
    assert "tail sampling is off" in record.getMessage()


_ENV_APP = """
import openai
from llmspans.tools.simulator import SimulatedServer

with SimulatedServer() as server:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)  # never instrument()ed here
    for status in (200, 500, 200):
        try:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"x_sim": {"status": status}})
        except openai.APIStatusError:
            pass
"""


def test_the_environment_sets_tail_sampling_for_zero_code_use(tmp_path: Path) -> None:
    """`opentelemetry-instrument` with the distro's own providers (exporting OTLP-JSON to stdout) and
    LLMSPANS_TAIL_SAMPLING=ratio=0: of three calls only the failed one's trace is exported, weighted."""
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(_ENV_APP))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    env.update({names.ENV_TAIL_SAMPLING: "ratio=0,slower_than=none", "OTEL_TRACES_EXPORTER": "otlp_json_file",
                "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
                "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "openai_v2"})  # fmt: skip
    launcher = Path(sys.executable).with_name("opentelemetry-instrument")
    done = subprocess.run(
        [str(launcher), sys.executable, str(app)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    spans = [
        span
        for line in done.stdout.splitlines()
        if line.startswith("{")
        for resource in json.loads(line).get("resourceSpans", [])
        for scope in resource["scopeSpans"]
        if scope.get("scope", {}).get("name") == names.INSTRUMENTATION_NAME
        for span in scope["spans"]
    ]
    assert [span["name"] for span in spans] == ["chat tiny"], done.stderr[-2000:]
    attributes = {a["key"]: a["value"] for a in spans[0]["attributes"]}
    assert attributes[names.ERROR_TYPE] == {"stringValue": "InternalServerError"}
    assert attributes[names.SAMPLE_WEIGHT] == {"doubleValue": 1.0}


def test_configure_takes_tail_sampling_from_the_environment_unless_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    given: list[Any] = []
    monkeypatch.setattr(_setup, "_current", None)
    monkeypatch.setattr(_setup, "_set_up", lambda *arguments: given.append(arguments[-1]) or "configured")
    monkeypatch.setenv(names.ENV_TAIL_SAMPLING, "ratio=0.05,slower_than=p99")
    assert llmspans.configure() == "configured"
    monkeypatch.setattr(_setup, "_current", None)
    explicit = llmspans.TailSampling(ratio=0.5)
    llmspans.configure(tail_sampling=explicit)
    assert given == [llmspans.TailSampling(ratio=0.05, slower_than="p99"), explicit]


def test_zero_code_tail_sampling_says_what_it_did_to_the_distros_provider(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(names.ENV_TAIL_SAMPLING, "ratio=0.1")
    monkeypatch.setattr(_setup, "_current", None)
    provider = TracerProvider()
    exporting = SimpleSpanProcessor(InMemorySpanExporter())
    provider.add_span_processor(exporting)
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    note = _setup.tail_sample_the_global_provider()
    assert note is not None
    assert "behind tail sampling" in note
    (member,) = provider._active_span_processor._span_processors  # type: ignore[attr-defined]
    assert isinstance(member, llmspans.TailSamplingProcessor)
    assert member.sampling.ratio == 0.1
    assert _setup.tail_sample_the_global_provider() is None  # once: already behind it
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.NoOpTracerProvider())
    assert "no SDK TracerProvider" in (_setup.tail_sample_the_global_provider() or "")
    provider.shutdown()


# --- a real OTLP receiver ----------------------------------------------------------------------------------

_PHOENIX_APP = """
import sys
import openai
import llmspans
from llmspans.tools.simulator import Behavior, SimulatedServer

endpoint, project, defer = sys.argv[1], sys.argv[2], sys.argv[3] == "held"
llmspans.configure(endpoint=endpoint, headers={"x-project-name": project}, metrics=False,
                   tail_sampling=llmspans.TailSampling(ratio=0.0, slower_than=None, defer=defer))

@llmspans.stage("prompt")
def prompt():
    return "p"

with SimulatedServer(Behavior(chunks=2, usage="finish")) as server:
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0))
    for status in (200, 500, 200):
        try:
            with llmspans.turn("chat"):
                prompt()
                for chunk in client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}],
                                                            stream=True, extra_body={"x_sim": {"status": status}}):
                    pass
        except openai.APIStatusError:
            pass
"""


def test_held_spans_reach_phoenix_as_sdk_spans_do(phoenix: PhoenixServer, tmp_path: Path) -> None:
    """configure()'s OTLP/HTTP export to a real Phoenix, spans held and not: Phoenix stores the same kept
    trace (the failed turn) both ways, attribute for attribute, and nothing of the dropped ones."""
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(_PHOENIX_APP))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    stored = {}
    for mode in ("held", "sdk"):
        project = f"llmspans-held-{mode}-{uuid.uuid4().hex[:8]}"
        subprocess.run(
            [sys.executable, str(app), phoenix.http_endpoint, project, mode], env=env, check=True, timeout=120,
            capture_output=True, text=True,
        )  # fmt: skip
        spans = phoenix.wait_for_spans(project, lambda found: len(found) >= 3, timeout=30)
        stored[mode] = {
            span["name"]: {
                "kind": span["span_kind"], "status": span["status_code"],
                "parent": span["parent_id"] is not None,
                "attributes": sorted(flatten(span["attributes"])), "events": [e["name"] for e in span["events"]],
                "error": flatten(span["attributes"]).get(names.ERROR_TYPE),
            }
            for span in spans
        }  # fmt: skip
    assert stored["held"] == stored["sdk"]
    assert set(stored["held"]) == {"turn chat", "prompt", "chat sim"}
    assert stored["held"]["chat sim"]["status"] == "ERROR"
    assert (
        stored["held"]["chat sim"]["error"] == "InternalServerError"
    )  # the SDK raised it; the 500 is the attempt span's
