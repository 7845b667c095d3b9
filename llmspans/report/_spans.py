"""OTLP-JSON documents into the compact `Span` records the analysis reads.

The embedded default's files and Jaeger's query API speak the same encoding (OTLP/JSON:
`{"resourceSpans": [...]}`, ids in hex, 64-bit integers as strings). msgspec decodes a document
straight into typed structs that name only the fields the report reads, so everything else
(other attributes, metric points, links) is skipped at C speed and never becomes a Python object;
a `Span` keeps only the attributes in `REPORTED_ATTRIBUTES`. Why msgspec: docs/report.md.

What a caller can rely on: a document that is not OTLP JSON raises `NotOtlp` with a message that
says where and why; every problem that stops the report is a `ReportInputError` whose message is one
line naming the source and the problem.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import msgspec
from opentelemetry.semconv.attributes.service_attributes import SERVICE_INSTANCE_ID, SERVICE_NAME

from llmspans import _names as names

# OTLP span kinds, as the JSON encoding may spell them (numbers, or the enum's names).
KIND_INTERNAL = 1
KIND_SERVER = 2
KIND_CLIENT = 3
_KIND_NAMES = {
    "SPAN_KIND_UNSPECIFIED": 0, "SPAN_KIND_INTERNAL": 1, "SPAN_KIND_SERVER": 2, "SPAN_KIND_CLIENT": 3,
    "SPAN_KIND_PRODUCER": 4, "SPAN_KIND_CONSUMER": 5,
}  # fmt: skip
_STATUS_ERROR = 2
_HEX = re.compile(r"[0-9a-f]+")
_HEX_DIGITS = "0123456789abcdef"

# The span attributes the analysis reads; every other one is skipped while decoding.
REPORTED_ATTRIBUTES = frozenset({
    names.STAGE, *names.BUCKET_ATTRIBUTES, names.BUDGET, names.BUDGET_EXCEEDED, names.RETRY_COUNT,
    names.RETRY_CAUSES, names.RETRY_WASTED_OUTPUT_TOKENS, names.CONNECT_NEW, names.CONNECT_REUSED,
    names.LIMITER_NAME, names.LIMITER_CAP, names.LIMITER_QUEUE_DEPTH, names.LIMITER_WAIT, names.ERROR_TYPE,
    names.GEN_AI_LATENCY_TIME_IN_QUEUE, names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
    names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, names.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE,
    names.GEN_AI_LATENCY_E2E, names.GEN_AI_LATENCY_TIME_IN_SCHEDULER, names.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD,
    names.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE, names.GEN_AI_REQUEST_STREAM, names.VLLM_KV_CACHE_USAGE,
    names.VLLM_PREEMPTION_RATE, names.VLLM_NUM_REQUESTS_WAITING, names.VLLM_PREFIX_CACHE_HIT_RATIO,
    names.LOAD_LEVEL, names.LOAD_RUN_ID, names.PROMPT_OVER_CAP, names.PROMPT_ESTIMATE_RATIO, names.PROMPT_ESTIMATOR,
    names.CACHE_NAME, names.CACHE_HIT, names.CACHE_SAVED_ESTIMATE, names.HEDGE_FIRED, names.HEDGE_AFTER,
    names.HEDGE_WON_BY, names.HEDGE_SKIPPED, names.HEDGE_WASTED_INPUT_TOKENS, names.HEDGE_WASTED_OUTPUT_TOKENS,
    names.HEDGE_ROLE, names.HEDGE_FIRST_TOKEN, names.GEN_AI_USAGE_INPUT_TOKENS,
    names.VLLM_NUM_REQUESTS_WAITING_MAX, names.STREAM_CLOSED_BEFORE_END, names.SAMPLE_WEIGHT,
})  # fmt: skip
# What `llmspans load --replay` reads of a recorded call besides (llmspans/load/_replay.py): its shape and
# what tells a shared prompt prefix without its content. No message content is ever among them.
REPLAY_ATTRIBUTES = frozenset({
    names.GEN_AI_OPERATION_NAME, names.GEN_AI_USAGE_OUTPUT_TOKENS, names.GEN_AI_REQUEST_MAX_TOKENS,
    names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, names.GEN_AI_CONVERSATION_ID, names.STREAM_CHUNKS,
})  # fmt: skip
REPORTED_ATTRIBUTES = REPORTED_ATTRIBUTES | REPLAY_ATTRIBUTES
REPORTED_EVENTS = frozenset({names.EVENT_ADMITTED})


class ReportInputError(Exception):
    """The input cannot be read at all; the message is one line naming the source and the problem."""


class NotOtlp(ValueError):
    """A JSON document that is not OTLP JSON; the message says where and why."""


# --- the wire shape (only what the report reads) -------------------------------------------------


class _AnyValue(msgspec.Struct, gc=False):
    stringValue: str | None = None
    boolValue: bool | None = None
    intValue: int | None = None  # a string in OTLP JSON: the decoder is not strict, so "3" reads as 3
    doubleValue: float | None = None
    arrayValue: _ArrayValue | None = None


class _ArrayValue(msgspec.Struct, gc=False):
    values: list[_AnyValue] = []


class _KeyValue(msgspec.Struct, gc=False):
    key: str
    value: _AnyValue = msgspec.field(default_factory=_AnyValue)


class _Event(msgspec.Struct, gc=False):
    timeUnixNano: int
    name: str = ""


class _Status(msgspec.Struct, gc=False):
    code: int | str | None = None


class _Span(msgspec.Struct, gc=False):
    traceId: str
    spanId: str
    name: str
    startTimeUnixNano: int
    endTimeUnixNano: int
    parentSpanId: str | None = None
    kind: int | str | None = None
    attributes: list[_KeyValue] = []
    events: list[_Event] = []
    status: _Status | None = None


class _ScopeSpans(msgspec.Struct, gc=False):
    spans: list[_Span] = []


class _Resource(msgspec.Struct, gc=False):
    attributes: list[_KeyValue] = []


class _ResourceSpans(msgspec.Struct, gc=False):
    resource: _Resource | None = None
    scopeSpans: list[_ScopeSpans] = []


class _Skipped(msgspec.Struct, gc=False):
    """Any JSON object, skipped unread (metric points and log records)."""


class _Document(msgspec.Struct, gc=False):
    resourceSpans: list[_ResourceSpans] | None = None
    resourceMetrics: list[_Skipped] | None = None  # read only when asked for (`_metric_points.read_metrics`)
    resourceLogs: list[_Skipped] | None = None
    result: _Document | None = None  # Jaeger's query response wraps the export request


_DECODER = msgspec.json.Decoder(_Document, strict=False)


# --- the records ---------------------------------------------------------------------------------


class Event(msgspec.Struct, frozen=True, gc=False):
    name: str
    time_ns: int


class Span(msgspec.Struct, frozen=True, gc=False):
    """One span as the report needs it: the attributes in `REPORTED_ATTRIBUTES`, decoded."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]
    events: tuple[Event, ...]
    error: bool
    service: str
    process: str  # service.instance.id when the producer set one (the SDK does), else the service
    stage: str | None  # `llmspans.stage`: an app stage, an LLM call or a turn; None for any other span
    duration_ns: int
    buckets_ns: tuple[int, ...]  # an LLM call's buckets in `names.BUCKETS` order, to the ns; () for others

    @property
    def duration_s(self) -> float:
        return self.duration_ns / 1e9


_KEY_VALUE = attrgetter("key", "value")
_NUMBERS = (int, float)  # exact types as decoded: `type(value) in _NUMBERS` leaves bools out


def _value(value: _AnyValue) -> Any:
    if value.stringValue is not None:
        return value.stringValue
    if value.boolValue is not None:
        return value.boolValue
    if value.intValue is not None:
        return value.intValue
    if value.doubleValue is not None:
        return value.doubleValue
    if value.arrayValue is not None:
        return [_value(item) for item in value.arrayValue.values]
    return None


def _hex_id(value: str | None, size: int, what: str) -> str:
    """An id as lowercase hex: OTLP/JSON and Jaeger write hex; protobuf's own JSON mapping, base64."""
    if not value:
        raise NotOtlp(f"{what} is missing")
    if len(value) == size * 2:
        lowered = value.lower()
        if _HEX.fullmatch(lowered):
            return lowered
    padded = value + "=" * (-len(value) % 4)
    try:
        raw = base64.urlsafe_b64decode(padded) if "-" in value or "_" in value else base64.b64decode(padded)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != size:
        raise NotOtlp(f"{what} {value!r} is neither {size * 2} hex digits nor base64 of {size} bytes")
    return raw.hex()


def _span_kind(value: int | str | None) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    if value in _KIND_NAMES:
        return _KIND_NAMES[value]
    raise NotOtlp(f"span kind {value!r} is not an OTLP span kind")


def number(attributes: Mapping[str, Any], attribute: str) -> float:
    """A numeric attribute as a float; 0 when absent or not a number (a bool is not one)."""
    value: Any = attributes.get(attribute)
    return float(value) if type(value) in _NUMBERS else 0.0


def _buckets_ns(attributes: Mapping[str, Any]) -> tuple[int, ...]:
    """An LLM call's buckets, to the nanosecond (negative values read as 0)."""
    values: list[Any] = [attributes.get(attribute) for attribute in names.BUCKET_ATTRIBUTES]
    return tuple([max(0, round(value * 1e9)) if type(value) in _NUMBERS else 0 for value in values])


def _id(value: str | None, size: int, what: str) -> str:
    if value and len(value) == size * 2 and not value.strip(_HEX_DIGITS):
        return value  # lowercase hex, as OTLP/JSON writes it: the common case, checked cheaply
    return _hex_id(value, size, what)


def _span(raw: _Span, service: str, process: str) -> Span:
    # The pairs by key in C (map, attrgetter, dict), then only the wanted keys' values in Python: most of
    # a span's attributes are never looked at, and this runs once per span.
    pairs = dict(map(_KEY_VALUE, raw.attributes))
    attributes: dict[str, Any] = {key: _value(pairs[key]) for key in REPORTED_ATTRIBUTES.intersection(pairs)}
    stage = attributes.get(names.STAGE)
    status = raw.status.code if raw.status is not None else None
    kind = raw.kind
    trace_id, span_id, parent_id = raw.traceId, raw.spanId, raw.parentSpanId
    if len(trace_id) != 32 or trace_id.strip(_HEX_DIGITS):
        trace_id = _hex_id(trace_id, 16, "traceId")
    if len(span_id) != 16 or span_id.strip(_HEX_DIGITS):
        span_id = _hex_id(span_id, 8, "spanId")
    if not parent_id:
        parent_id = None
    elif len(parent_id) != 16 or parent_id.strip(_HEX_DIGITS):
        parent_id = _hex_id(parent_id, 8, "parentSpanId")
    start, end = raw.startTimeUnixNano, raw.endTimeUnixNano
    return Span(  # positional: the fields in their order, the cheapest way to build a Struct
        trace_id,
        span_id,
        parent_id,
        raw.name,
        kind if isinstance(kind, int) else _span_kind(kind),
        start,
        end,
        attributes,
        tuple(Event(event.name, event.timeUnixNano) for event in raw.events if event.name in REPORTED_EVENTS)
        if raw.events
        else (),
        status == _STATUS_ERROR or status == "STATUS_CODE_ERROR",
        service,
        process,
        stage if isinstance(stage, str) else None,
        max(0, end - start),
        _buckets_ns(attributes) if stage == names.STAGE_LLM else (),
    )


def _spans(document: _Document) -> list[Span] | None:
    if document.result is not None and document.resourceSpans is None:
        document = document.result
    if document.resourceSpans is None:
        return None
    spans: list[Span] = []
    for resource_spans in document.resourceSpans:
        resource = resource_spans.resource
        resource_attributes = (
            {item.key: _value(item.value) for item in resource.attributes} if resource is not None else {}
        )
        service = str(resource_attributes.get(SERVICE_NAME, "unknown_service"))
        process = str(resource_attributes.get(SERVICE_INSTANCE_ID, service))
        for scope_spans in resource_spans.scopeSpans:
            spans.extend([_span(raw, service, process) for raw in scope_spans.spans])
    return spans


def spans_of_json(text: bytes | str) -> list[Span] | None:
    """The spans of one OTLP-JSON document; None for a metrics or logs document.

    Accepts an export request (`{"resourceSpans": [...]}`), a metrics export (its points are `decode`'s)
    and Jaeger's query response (`{"result": {"resourceSpans": [...]}}`). `msgspec.DecodeError` when the
    text is not JSON; `NotOtlp` when it is JSON of another shape.
    """
    return decode(text)[0]


def decode(text: bytes | str) -> tuple[list[Span] | None, bool]:
    """The spans of one OTLP-JSON document (None when it has none), and whether it holds metric points
    (skipped here: `_metric_points.read_metrics` reads them when the report needs them), with
    `spans_of_json`'s errors."""
    try:
        document = _DECODER.decode(text)
    except msgspec.ValidationError as error:
        raise NotOtlp(_shape_problem(text, error)) from None
    spans = _spans(document)
    inner = document.result or document
    other_signal = inner.resourceMetrics is not None or inner.resourceLogs is not None
    if (
        spans is None
        and not other_signal
        and document.resourceMetrics is None
        and document.resourceLogs is None
    ):
        raise NotOtlp(_shape_problem(text, None))
    return spans, bool(inner.resourceMetrics)


def spans_of_document(document: Any) -> list[Span] | None:
    """The spans of a document already parsed into Python values (a test's hand-built dict)."""
    return spans_of_json(msgspec.json.encode(document))


def _shape_problem(text: bytes | str, error: msgspec.ValidationError | None) -> str:
    """Why a JSON document is not OTLP JSON, in words."""
    try:
        top = msgspec.json.decode(text)
    except msgspec.DecodeError:
        top = None
    if not isinstance(top, dict):
        kind = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(
            type(top), "null"
        )
        return f"a JSON {kind}, not an object with resourceSpans"
    if error is None:
        keys = ", ".join(sorted(str(key) for key in top)[:4]) or "none"
        return f"an object without resourceSpans or resourceMetrics (keys: {keys})"
    message = str(error)
    what, _, where = message.partition(" - at `")
    where = where.rstrip("`") or "$"
    field = where.rsplit(".", 1)[-1].split("[", 1)[0] if where != "$" else "the document"
    expected = what.partition("Expected `")[2].partition("`")[0]
    got = what.partition("got `")[2].partition("`")[0]
    shape = "a list" if "array" in expected else "an object" if "object" in expected else expected or "valid"
    found = f"{got}, " if got else ""
    return f"{field} is not {shape} ({found}at {where})"


def spans_of_readable(spans: Sequence[Any]) -> list[Span]:
    """SDK spans held in memory (`ReadableSpan`), read as the embedded default's OTLP-JSON encoding of them
    would be (tests/test_report.py holds the two equal), without encoding them: the load tool reads every
    span of every level this way."""
    out: list[Span] = []
    resources: dict[int, tuple[str, str]] = {}
    for span in spans:
        resource = span.resource
        names_of = resources.get(id(resource))
        if names_of is None:
            attributes_of = resource.attributes if resource is not None else {}
            service = str(attributes_of.get(SERVICE_NAME, "unknown_service"))
            names_of = resources[id(resource)] = (
                service,
                str(attributes_of.get(SERVICE_INSTANCE_ID, service)),
            )
        out.append(_readable(span, *names_of))
    return out


def _readable(span: Any, service: str, process: str) -> Span:
    given = span.attributes or {}
    attributes: dict[str, Any] = {key: _plain(given[key]) for key in REPORTED_ATTRIBUTES.intersection(given)}
    stage = attributes.get(names.STAGE)
    context, parent = span.context, span.parent
    start, end = span.start_time or 0, span.end_time or 0
    status = span.status
    return Span(
        f"{context.trace_id if context else 0:032x}",
        f"{context.span_id if context else 0:016x}",
        f"{parent.span_id:016x}" if parent is not None else None,
        span.name,
        span.kind.value + 1,  # the SDK counts kinds from INTERNAL = 0; OTLP from UNSPECIFIED = 0
        start,
        end,
        attributes,
        tuple(Event(event.name, event.timestamp) for event in span.events if event.name in REPORTED_EVENTS),
        status is not None and status.status_code.value == _STATUS_ERROR,
        service,
        process,
        stage if isinstance(stage, str) else None,
        max(0, end - start),
        _buckets_ns(attributes) if stage == names.STAGE_LLM else (),
    )


def _plain(value: Any) -> Any:
    """An SDK attribute value as OTLP JSON carries it to the report: sequences as lists, nothing else kept
    but strings, booleans and numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None  # as JSON has no such number
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        return [_plain(item) for item in value]
    return None
