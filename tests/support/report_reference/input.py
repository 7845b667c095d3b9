"""The report's input: OTLP-JSON spans from the embedded default's files or Jaeger's query API.

Both speak the same encoding (OTLP/JSON: `{"resourceSpans": [...]}`, ids in hex, 64-bit
integers as strings), so both end as the same `Span` records. A file is read line by line
(the embedded default writes one export per line, spans and metric points alike); a file
holding one JSON document (a saved Jaeger response, pretty-printed or not) is read whole.

What a caller can rely on: every problem that stops the report is a `ReportInputError`
whose message is one line naming the source and the problem; a line that cannot be read
in an otherwise good file is skipped and listed in `Loaded.skipped`, never fatal.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.sdk.trace import ReadableSpan
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

# Jaeger v2's /api/v3 query parameters. Current releases take the camelCase names and accept
# the snake_case ones (the only ones older 2.x releases know) as deprecated aliases; the
# canonical name wins when both are sent, so sending both works against either.
JAEGER_TRACES_PATH = "/api/v3/traces"
JAEGER_SEARCH_DEPTH = 1000
_JAEGER_PARAMS = {
    "service": ("query.serviceName", "query.service_name"),
    "start_min": ("query.startTimeMin", "query.start_time_min"),
    "start_max": ("query.startTimeMax", "query.start_time_max"),
    "depth": ("query.searchDepth", "query.num_traces"),
}
_HEX = re.compile(r"[0-9a-fA-F]+")
_SINCE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|m|h|d)\s*$")
_SINCE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class ReportInputError(Exception):
    """The input cannot be read at all; the message is one line naming the source and the problem."""


@dataclass(frozen=True)
class Event:
    name: str
    time_ns: int


@dataclass(frozen=True)
class Span:
    """One span as the report needs it; attribute values decoded to Python values."""

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

    @property
    def duration_s(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9

    @property
    def stage(self) -> str | None:
        stage = self.attributes.get(names.STAGE)
        return stage if isinstance(stage, str) else None


@dataclass(frozen=True)
class SkippedLine:
    source: str
    line: int
    reason: str


@dataclass
class Loaded:
    """Spans read from one or more sources, and the lines that had to be skipped."""

    spans: list[Span] = field(default_factory=list)
    skipped: list[SkippedLine] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


class _Shape(ValueError):
    """A JSON document that is not OTLP JSON; the message says where and why."""


# --- decoding OTLP JSON -------------------------------------------------------------------------


def _any_value(value: Any) -> Any:
    if not isinstance(value, Mapping):
        raise _Shape(f"an attribute value is {type(value).__name__}, not an AnyValue object")
    if "stringValue" in value:
        return str(value["stringValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        items = value["arrayValue"].get("values", []) if isinstance(value["arrayValue"], Mapping) else None
        if not isinstance(items, list):
            raise _Shape("arrayValue.values is not a list")
        return [_any_value(item) for item in items]
    if "kvlistValue" in value:
        kvlist = value["kvlistValue"]
        return _attributes(kvlist.get("values", []) if isinstance(kvlist, Mapping) else None)
    if "bytesValue" in value:
        return str(value["bytesValue"])
    return None


def _attributes(items: Any) -> dict[str, Any]:
    if items is None:
        return {}
    if not isinstance(items, list):
        raise _Shape("attributes is not a list")
    decoded: dict[str, Any] = {}
    for item in items:
        if not isinstance(item, Mapping) or not isinstance(item.get("key"), str):
            raise _Shape("an attribute has no string key")
        decoded[item["key"]] = _any_value(item.get("value", {}))
    return decoded


def _hex_id(value: Any, size: int, what: str) -> str:
    """An id as lowercase hex: OTLP/JSON and Jaeger write hex; protobuf's own JSON mapping, base64."""
    if not isinstance(value, str) or not value:
        raise _Shape(f"{what} is missing")
    if len(value) == size * 2 and _HEX.fullmatch(value):
        return value.lower()
    padded = value + "=" * (-len(value) % 4)
    try:
        raw = base64.urlsafe_b64decode(padded) if "-" in value or "_" in value else base64.b64decode(padded)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != size:
        raise _Shape(f"{what} {value!r} is neither {size * 2} hex digits nor base64 of {size} bytes")
    return raw.hex()


def _nanos(value: Any, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise _Shape(f"{what} {value!r} is not an integer of nanoseconds") from None


def _kind(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value in _KIND_NAMES:
        return _KIND_NAMES[value]
    raise _Shape(f"span kind {value!r} is not an OTLP span kind")


def _is_error(status: Any) -> bool:
    if not isinstance(status, Mapping):
        return False
    code = status.get("code")
    return code == _STATUS_ERROR or code == "STATUS_CODE_ERROR"


def _span(raw: Any, service: str, process: str) -> Span:
    if not isinstance(raw, Mapping):
        raise _Shape("a span is not an object")
    parent = raw.get("parentSpanId")
    events_raw = raw.get("events") or []
    if not isinstance(events_raw, list):
        raise _Shape("events is not a list")
    events = tuple(
        Event(str(event.get("name", "")), _nanos(event.get("timeUnixNano"), "event timeUnixNano"))
        for event in events_raw
        if isinstance(event, Mapping)
    )
    name = raw.get("name")
    if not isinstance(name, str):
        raise _Shape("a span has no name")
    return Span(
        trace_id=_hex_id(raw.get("traceId"), 16, "traceId"),
        span_id=_hex_id(raw.get("spanId"), 8, "spanId"),
        parent_id=_hex_id(parent, 8, "parentSpanId") if parent else None,
        name=name,
        kind=_kind(raw.get("kind")),
        start_ns=_nanos(raw.get("startTimeUnixNano"), "startTimeUnixNano"),
        end_ns=_nanos(raw.get("endTimeUnixNano"), "endTimeUnixNano"),
        attributes=_attributes(raw.get("attributes")),
        events=events,
        error=_is_error(raw.get("status")),
        service=service,
        process=process,
    )


def spans_of_document(document: Any) -> list[Span] | None:
    """The spans of one OTLP-JSON document; None for a metrics document; `_Shape` for anything else.

    Accepts an export request (`{"resourceSpans": [...]}`), a metrics export (ignored) and
    Jaeger's query response (`{"result": {"resourceSpans": [...]}}`).
    """
    if not isinstance(document, Mapping):
        raise _Shape(f"a JSON {type(document).__name__}, not an object with resourceSpans")
    if "result" in document and isinstance(document["result"], Mapping):
        document = document["result"]
    if "resourceSpans" not in document:
        if "resourceMetrics" in document or "resourceLogs" in document:
            return None
        keys = ", ".join(sorted(str(key) for key in document)[:4]) or "none"
        raise _Shape(f"an object without resourceSpans or resourceMetrics (keys: {keys})")
    resource_spans = document["resourceSpans"]
    if not isinstance(resource_spans, list):
        raise _Shape("resourceSpans is not a list")
    spans: list[Span] = []
    for resource_span in resource_spans:
        if not isinstance(resource_span, Mapping):
            raise _Shape("a resourceSpans entry is not an object")
        resource = resource_span.get("resource") or {}
        resource_attributes = _attributes(
            resource.get("attributes") if isinstance(resource, Mapping) else None
        )
        service = str(resource_attributes.get(SERVICE_NAME, "unknown_service"))
        process = str(resource_attributes.get(SERVICE_INSTANCE_ID, service))
        scope_spans = resource_span.get("scopeSpans", [])
        if not isinstance(scope_spans, list):
            raise _Shape("scopeSpans is not a list")
        for scope_span in scope_spans:
            raw_spans = scope_span.get("spans", []) if isinstance(scope_span, Mapping) else None
            if not isinstance(raw_spans, list):
                raise _Shape("spans is not a list")
            spans.extend(_span(raw, service, process) for raw in raw_spans)
    return spans


# --- files --------------------------------------------------------------------------------------


def _short(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def read_file(path: Path, into: Loaded) -> None:
    """Add the spans of one OTLP-JSON lines file (or one-document file) to `into`."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportInputError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise ReportInputError(f"{source}: is a directory, not an OTLP-JSON file") from None
    except UnicodeDecodeError:
        raise ReportInputError(f"{source}: not OTLP JSON (not UTF-8 text)") from None
    except OSError as error:
        raise ReportInputError(f"{source}: cannot be read ({error.strerror or _short(error)})") from None
    into.sources.append(source)
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ReportInputError(f"{source}: empty file, no OTLP-JSON lines in it")
    whole = _whole_document(text) if len(lines) > 1 else None
    if whole is not None:
        try:
            into.spans.extend(spans_of_document(whole) or ())
        except _Shape as error:
            raise ReportInputError(f"{source}: not OTLP JSON ({error})") from None
        return
    skipped: list[SkippedLine] = []
    good = 0
    for number, line in lines:
        try:
            document = json.loads(line)
        except ValueError as error:
            skipped.append(SkippedLine(source, number, f"not JSON ({_short(error)})"))
            continue
        try:
            spans = spans_of_document(document)
        except _Shape as error:
            skipped.append(SkippedLine(source, number, f"not OTLP JSON ({error})"))
            continue
        good += 1
        into.spans.extend(spans or ())
    if not good:
        first = skipped[0]
        more = f" (and {len(skipped) - 1} more lines like it)" if len(skipped) > 1 else ""
        raise ReportInputError(f"{source}: not OTLP JSON: line {first.line} is {first.reason}{more}")
    into.skipped.extend(skipped)


def _whole_document(text: str) -> Any:
    """The file as one JSON document when its first line alone is not one (pretty-printed JSON)."""
    first = text.lstrip().split("\n", 1)[0]
    try:
        json.loads(first)
        return None
    except ValueError:
        pass
    try:
        return json.loads(text)
    except ValueError:
        return None


def read_files(paths: Sequence[Path]) -> Loaded:
    loaded = Loaded()
    for path in paths:
        read_file(path, loaded)
    return loaded


# --- Jaeger -------------------------------------------------------------------------------------


def parse_since(value: str) -> float:
    """`"90s"`, `"30m"`, `"1h"`, `"2d"` as seconds; ValueError says what to pass."""
    match = _SINCE.match(value)
    seconds = float(match.group(1)) * _SINCE_UNITS[match.group(2)] if match else 0.0
    if seconds <= 0:
        raise ValueError(
            f"--since must be a positive duration like '90s', '30m', '1h' or '2d', got {value!r}"
        )
    return seconds


def _rfc3339(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def jaeger_query(service: str, since_s: float, now_s: float | None = None) -> tuple[tuple[str, str], ...]:
    """The query parameters of a trace search, under both spellings Jaeger v2 has used."""
    now = time.time() if now_s is None else now_s
    values = {
        "service": service,
        "start_min": _rfc3339(now - since_s),
        "start_max": _rfc3339(now + 1),
        "depth": str(JAEGER_SEARCH_DEPTH),
    }
    return tuple((name, values[key]) for key, spellings in _JAEGER_PARAMS.items() for name in spellings)


def fetch_jaeger(
    url: str, service: str, since_s: float, *, timeout_s: float = 10.0, client: httpx.Client | None = None
) -> Loaded:
    """Search Jaeger v2's `/api/v3/traces` for one service's traces of the last `since_s` seconds.

    404 is Jaeger's answer when nothing matches: an empty result, not an error.
    """
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ReportInputError(f"--jaeger must be a URL like http://localhost:16686, got {url!r}")
    endpoint = base + JAEGER_TRACES_PATH
    loaded = Loaded(sources=[f"Jaeger {base} (service {service!r})"])
    own = client is None
    http = client or httpx.Client(timeout=timeout_s)
    try:
        response = http.get(endpoint, params=jaeger_query(service, since_s))
    except httpx.HTTPError as error:
        raise ReportInputError(
            f"cannot reach Jaeger at {base}: {_short(error) or type(error).__name__}"
        ) from None
    finally:
        if own:
            http.close()
    if response.status_code == 404:
        return loaded
    if response.status_code != 200:
        raise ReportInputError(
            f"Jaeger at {base} answered HTTP {response.status_code} to {JAEGER_TRACES_PATH}: "
            f"{_error_message(response.text)}"
        )
    for document in _documents(response.text, base):
        try:
            loaded.spans.extend(spans_of_document(document) or ())
        except _Shape as error:
            raise ReportInputError(
                f"Jaeger at {base} returned something that is not OTLP JSON ({error})"
            ) from None
    return loaded


def _documents(body: str, base: str) -> Iterator[Any]:
    """One JSON document, or several on their own lines (a streamed gRPC-gateway answer)."""
    try:
        yield json.loads(body)
        return
    except ValueError:
        pass
    lines = [line for line in body.splitlines() if line.strip()]
    if not lines:
        raise ReportInputError(f"Jaeger at {base} returned an empty body, not OTLP JSON")
    for line in lines:
        try:
            yield json.loads(line)
        except ValueError as error:
            raise ReportInputError(
                f"Jaeger at {base} returned something that is not JSON ({_short(error)})"
            ) from None


def _error_message(body: str) -> str:
    try:
        document = json.loads(body)
    except ValueError:
        return " ".join(body.split())[:200] or "(empty body)"
    error = document.get("error") if isinstance(document, Mapping) else None
    message = error.get("message") if isinstance(error, Mapping) else None
    return str(message) if message else " ".join(body.split())[:200]


# --- selection ------------------------------------------------------------------------------------


def select(spans: Iterable[Span], *, service: str | None = None, since_s: float | None = None) -> list[Span]:
    """Whole traces that involve `service` and started in the last `since_s` seconds.

    Traces, not spans, are kept or dropped, so a vLLM server's spans stay with the client's.
    """
    spans = list(spans)
    if service is None and since_s is None:
        return spans
    by_trace: dict[str, list[Span]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    cutoff_ns = None if since_s is None else int((time.time() - since_s) * 1e9)
    kept: list[Span] = []
    for trace_spans in by_trace.values():
        if service is not None and not any(span.service == service for span in trace_spans):
            continue
        if cutoff_ns is not None and min(span.start_ns for span in trace_spans) < cutoff_ns:
            continue
        kept.extend(trace_spans)
    return kept


def spans_of_readable(spans: Sequence[ReadableSpan]) -> list[Span]:
    """SDK spans held in memory, through the same OTLP-JSON encoding the embedded default writes."""
    from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans

    if not spans:
        return []
    return spans_of_document(encode_spans(spans).to_dict()) or []
