"""Grafana Tempo's HTTP API: one TraceQL search of one service's recent traces, then each trace by id.

Tempo's search answers with trace ids, not spans, so the report asks for each trace it found: the v2
path (`/api/v2/traces/<id>`, Tempo 2.6 and later, the trace under `trace`) first, and the older path
(`/api/traces/<id>`, the resource spans under `batches`) when a server answers v2 with 404 before any
v2 answer came back. Both carry OTLP JSON as Tempo's protobuf JSON mapping writes it (ids in base64,
kinds and status codes by name, 64-bit integers as strings), which `_spans.py` reads like a file.

Bounded on every side: one search with `limit`, at most that many traces fetched, `CONCURRENCY` at a
time, every answer cut off at a size cap. A trace Tempo no longer has (404 on every path) is counted
and skipped; any other failure is one line naming the URL and what came back. The `--header` values
(credentials) are sent and never appear in a message: any echo of them is blanked first.
Which Tempo versions each path covers, and what was chosen where Tempo's docs are silent: docs/report.md.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
import msgspec

from llmspans.report._metric_points import MetricPoints
from llmspans.report._model import SkippedLine
from llmspans.report._sources import short
from llmspans.report._spans import NotOtlp, ReportInputError, Span, spans_of_json

SEARCH_PATH = "/api/search"
TRACE_V2_PATH = "/api/v2/traces/"
TRACE_V1_PATH = "/api/traces/"
TENANT_HEADER = "X-Scope-OrgID"
DEFAULT_LIMIT = 500
CONCURRENCY = 8  # traces fetched at once: enough to hide a round trip, few enough not to load a Tempo
MAX_SEARCH_BYTES = 32 << 20  # a search answer of 500 traces is well under 1 MB
MAX_TRACE_BYTES = 64 << 20  # Tempo refuses traces over 5 MB of protobuf by default; JSON is ~3x that
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


_ABSENT = msgspec.Raw()  # a field left out (msgspec.Raw takes no None: an empty Raw stands for it)


class _Found(msgspec.Struct, gc=False):
    traceID: str  # hex, leading zeros left out; the rest of a found trace is not needed


class _Search(msgspec.Struct, gc=False):
    traces: list[_Found] | None = None
    metrics: msgspec.Raw = _ABSENT


class _TraceV2(msgspec.Struct, gc=False):
    trace: msgspec.Raw = _ABSENT
    resourceSpans: msgspec.Raw = _ABSENT  # not Tempo's shape, but a bare trace is read rather than refused
    status: str | int | None = None  # PartialStatus: COMPLETE (0, left out) or PARTIAL (1)


class _TraceV1(msgspec.Struct, gc=False):
    batches: msgspec.Raw = _ABSENT
    resourceSpans: msgspec.Raw = _ABSENT


_SEARCH = msgspec.json.Decoder(_Search, strict=False)
_V2 = msgspec.json.Decoder(_TraceV2, strict=False)
_V1 = msgspec.json.Decoder(_TraceV1, strict=False)


def traceql_service(service: str) -> str:
    """The TraceQL that selects the traces with a span of `service` (a string literal, escaped)."""
    literal = service.replace("\\", "\\\\").replace('"', '\\"')
    return f'{{ resource.service.name = "{literal}" }}'


def search_params(service: str, since_s: float, limit: int, now_s: float | None = None) -> dict[str, str]:
    """The one search's query parameters: TraceQL, the window in unix seconds, the limit."""
    now = time.time() if now_s is None else now_s
    return {
        "q": traceql_service(service),
        "start": str(math.floor(now - since_s)),
        "end": str(math.ceil(now) + 1),
        "limit": str(limit),
    }


def shown_url(url: str) -> str:
    """The URL as messages show it: no credentials in it, no trailing slash."""
    parts = urlsplit(url.rstrip("/"))
    if "@" in parts.netloc:
        parts = parts._replace(netloc="REDACTED:REDACTED@" + parts.netloc.rpartition("@")[2])
    return urlunsplit(parts)


class _Gone(Exception):
    """The trace is not (or no longer) in Tempo: 404 on every path asked."""


class _TooLarge(Exception):
    """An answer over its size cap; reading stopped at the cap."""


@dataclass
class _Counts:
    found: int = 0
    read: int = 0
    gone: int = 0
    too_large: int = 0
    partial: int = 0


@dataclass
class TempoTraces:
    """The traces one search found, read and decoded; `batches()` yields one whole trace at a time."""

    sources: list[str]
    skipped: list[SkippedLine] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    traces: list[list[Span]] = field(default_factory=list)
    counts: _Counts = field(default_factory=_Counts)
    metrics: MetricPoints | None = (
        None  # Tempo keeps traces only (with --prometheus, the metrics are asked there)
    )

    def batches(self) -> Iterator[list[Span]]:
        yield from self.traces


class _Tempo:
    """The HTTP calls to one Tempo; every failure a one-line ReportInputError."""

    def __init__(
        self, url: str, *, tenant: str | None, headers: Sequence[tuple[str, str]], timeout_s: float
    ) -> None:
        self.base = url.rstrip("/")
        self.shown = shown_url(url)
        if not self.base.startswith(("http://", "https://")):
            raise ReportInputError(f"--tempo must be a URL like http://localhost:3200, got {self.shown!r}")
        sent = httpx.Headers()
        for name, value in headers:  # a later one replaces an earlier one of the same name, in any case
            sent[name] = value
        if tenant:
            sent[TENANT_HEADER] = tenant
        # A credential's whole value, and its token without the scheme ("Bearer ..."), are never printed.
        values = [value for _, value in headers] + [value.partition(" ")[2] for _, value in headers]
        self.secrets = sorted((value for value in values if len(value) >= 4), key=len, reverse=True)
        self.timeout_s = timeout_s
        self.http = httpx.Client(
            headers=sent,
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY),
        )
        self.v2: bool | None = None  # does this Tempo serve /api/v2/traces? unknown until it answers
        self.lock = threading.Lock()

    def close(self) -> None:
        self.http.close()

    def fail(self, message: str) -> ReportInputError:
        for secret in self.secrets:  # a proxy may echo a header back: never print it
            message = message.replace(secret, "(redacted)")
        return ReportInputError(message)

    def get(self, path: str, cap: int, params: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        """(status, body) of one GET, the body read up to `cap` bytes (decoded); _TooLarge past it."""
        try:
            with self.http.stream("GET", self.base + path, params=params) as response:
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > cap and response.status_code == 200:
                    raise _TooLarge
                chunks: list[bytes] = []
                size = 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > cap:
                        raise _TooLarge
                    chunks.append(chunk)
                return response.status_code, b"".join(chunks)
        except httpx.TimeoutException:
            raise self.fail(
                f"Tempo at {self.shown} did not answer {path} within {self.timeout_s:g} s"
            ) from None
        except httpx.HTTPError as error:
            raise self.fail(f"cannot reach Tempo at {self.shown}: {short(error)}") from None

    def answered(self, status: int, path: str, body: bytes) -> ReportInputError:
        return self.fail(f"Tempo at {self.shown} answered HTTP {status} to {path}: {_message(body)}")

    def search(self, params: Mapping[str, str]) -> list[str]:
        """The trace ids the search found, in Tempo's order, each once."""
        try:
            status, body = self.get(SEARCH_PATH, MAX_SEARCH_BYTES, params)
        except _TooLarge:
            raise self.fail(
                f"Tempo at {self.shown} answered {SEARCH_PATH} with more than {MAX_SEARCH_BYTES >> 20} MB"
            ) from None
        if status != 200:
            raise self.answered(status, SEARCH_PATH, body)
        try:
            found = _SEARCH.decode(body)
        except msgspec.ValidationError as error:
            raise self.fail(
                f"Tempo at {self.shown} answered {SEARCH_PATH} with JSON that is not a Tempo search result "
                f"({short(error)})"
            ) from None
        except msgspec.DecodeError as error:
            raise self.fail(
                f"Tempo at {self.shown} answered {SEARCH_PATH} with something that is not JSON "
                f"({short(error)}): {_message(body)}"
            ) from None
        if found.traces is None and not found.metrics and not _empty_search(body):
            raise self.fail(
                f"Tempo at {self.shown} answered {SEARCH_PATH} with JSON that is not a Tempo search result "
                f"(no traces, no metrics): {_message(body)}"
            )
        ids: dict[str, str] = {}  # each id once (in any case), asked back as Tempo wrote it
        for trace in found.traces or ():
            trace_id = trace.traceID
            if not trace_id or len(trace_id) > 32 or not _HEX_DIGITS.issuperset(trace_id):
                raise self.fail(
                    f"Tempo at {self.shown} answered {SEARCH_PATH} with a trace id that is not hex: "
                    f"{trace_id[:40]!r}"
                )
            ids.setdefault(trace_id.lower(), trace_id)
        return list(ids.values())

    def trace(self, trace_id: str) -> tuple[list[Span], bool]:
        """(spans, partial) of one trace; _Gone when no path has it, _TooLarge past the cap."""
        quoted = quote(trace_id, safe="")
        if self.v2 is not False:
            status, body = self.get(TRACE_V2_PATH + quoted, MAX_TRACE_BYTES)
            if status == 200:
                self.v2 = True
                return self._v2(trace_id, body)
            if status != 404:
                raise self.answered(status, TRACE_V2_PATH + "<id>", body)
            if self.v2:  # this Tempo serves v2: its 404 says the trace is gone
                raise _Gone
        status, body = self.get(TRACE_V1_PATH + quoted, MAX_TRACE_BYTES)
        if status == 200:
            with self.lock:
                if self.v2 is None:
                    self.v2 = False  # v2 answered 404 and v1 has the trace: a Tempo before 2.6
            return self._v1(trace_id, body), False
        if status == 404:
            raise _Gone
        raise self.answered(status, TRACE_V1_PATH + "<id>", body)

    def _v2(self, trace_id: str, body: bytes) -> tuple[list[Span], bool]:
        path = TRACE_V2_PATH + trace_id
        try:
            answer = _V2.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            raise self._not_trace(path, body, error) from None
        partial = answer.status in ("PARTIAL", 1)
        if answer.trace and bytes(answer.trace) != b"null":
            return self._spans(path, bytes(answer.trace)), partial
        if answer.resourceSpans:
            return self._spans(path, body), partial
        raise self._not_trace(path, body, None)

    def _v1(self, trace_id: str, body: bytes) -> list[Span]:
        path = TRACE_V1_PATH + trace_id
        try:
            answer = _V1.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            raise self._not_trace(path, body, error) from None
        if answer.batches and bytes(answer.batches) != b"null":
            return self._spans(path, b'{"resourceSpans":' + bytes(answer.batches) + b"}")
        if answer.resourceSpans:
            return self._spans(path, body)
        raise self._not_trace(path, body, None)

    def _spans(self, path: str, document: bytes) -> list[Span]:
        try:
            return spans_of_json(document) or []
        except NotOtlp as error:
            raise self.fail(
                f"Tempo at {self.shown} answered {path} with JSON that is not OTLP ({error})"
            ) from None
        except msgspec.DecodeError as error:
            raise self._not_trace(path, document, error) from None

    def _not_trace(self, path: str, body: bytes, error: Exception | None) -> ReportInputError:
        why = f" ({short(error)})" if error is not None else ""
        if isinstance(error, msgspec.DecodeError):
            return self.fail(
                f"Tempo at {self.shown} answered {path} with something that is not JSON{why}: {_message(body)}"
            )
        return self.fail(f"Tempo at {self.shown} answered {path} with JSON that is not a Tempo trace{why}")


def fetch_tempo(
    url: str,
    service: str,
    since_s: float,
    *,
    limit: int = DEFAULT_LIMIT,
    tenant: str | None = None,
    headers: Sequence[tuple[str, str]] = (),
    timeout_s: float = 10.0,
    now_s: float | None = None,
) -> TempoTraces:
    """Search Tempo for one service's traces of the last `since_s` seconds and read each of them."""
    if limit < 1:
        raise ValueError(f"--limit must be 1 or more, got {limit}")
    tempo = _Tempo(url, tenant=tenant, headers=headers, timeout_s=timeout_s)
    window = _window(since_s)
    try:
        ids = tempo.search(search_params(service, since_s, limit, now_s))[:limit]
        result = TempoTraces(sources=[])
        result.counts.found = len(ids)
        fetched = _fetch_all(tempo, ids, result.counts)
    finally:
        tempo.close()
    # The order the embedded default writes spans in (when each ended), so that wherever the order of the
    # input decides something (the order of stages, ties), the report from Tempo reads like the file's.
    for spans in fetched:
        spans.sort(key=_end)
    fetched.sort(key=lambda spans: spans[0].end_ns if spans else 0)
    result.traces = fetched
    counts = result.counts
    # At the limit the window may hold more: said where the source is named, not as a note, so that a report
    # of all 500 traces of a file and one of the same 500 from Tempo stay equal but for their sources.
    limited = "; the search's limit, the window may hold more (--limit N)" if counts.found >= limit else ""
    result.sources = [
        f"Tempo {tempo.shown} (service {service!r}, last {window}: {counts.read} of {counts.found} traces "
        f"found{limited})"
    ]
    if not counts.found:
        result.notes.append(
            f"Tempo's search found no trace of service {service!r} in the last {window} "
            f"({traceql_service(service)})"
        )
    if counts.gone:
        result.notes.append(
            f"{counts.gone} of the {counts.found} traces Tempo's search found were gone when fetched "
            "(HTTP 404): skipped"
        )
    if counts.too_large:
        result.notes.append(
            f"{counts.too_large} traces were larger than {MAX_TRACE_BYTES >> 20} MB of JSON: skipped"
        )
    if counts.partial:
        result.notes.append(
            f"{counts.partial} traces came back partial from Tempo (over its trace size limit): "
            "read as far as they went"
        )
    return result


def _end(span: Span) -> int:
    return span.end_ns


def _fetch_all(tempo: _Tempo, ids: list[str], counts: _Counts) -> list[list[Span]]:
    """Every trace of `ids`, CONCURRENCY at a time; the first failure stops the rest and is raised."""

    def one(trace_id: str) -> list[Span] | None:
        try:
            spans, partial = tempo.trace(trace_id)
        except _Gone:
            with tempo.lock:
                counts.gone += 1
            return None
        except _TooLarge:
            with tempo.lock:
                counts.too_large += 1
            return None
        with tempo.lock:
            counts.read += 1
            counts.partial += partial
        return spans

    if not ids:
        return []
    pool = ThreadPoolExecutor(max_workers=min(CONCURRENCY, len(ids)), thread_name_prefix="llmspans-tempo")
    try:
        futures = [pool.submit(one, trace_id) for trace_id in ids]
        out = []
        for future in futures:
            spans = future.result()
            if spans:
                out.append(spans)
        return out
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _window(since_s: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if since_s >= size and since_s % size == 0:
            return f"{since_s / size:g}{unit}"
    return f"{since_s:g}s"


def _empty_search(body: bytes) -> bool:
    """`{}`, `{"traces": null}`: a search that found nothing (Tempo leaves an empty list out)."""
    document = msgspec.json.decode(body)
    return isinstance(document, dict) and (not document or "traces" in document)


def _message(body: bytes) -> str:
    """What an answer said, as one short line (Tempo's errors are plain text)."""
    text = body.decode("utf-8", "replace")
    try:
        document = msgspec.json.decode(body)
    except msgspec.DecodeError:
        document = None
    if isinstance(document, dict):
        for key in ("message", "error"):
            if isinstance(document.get(key), str) and document[key]:
                text = document[key]
                break
    return " ".join(text.split())[:200] or "(empty body)"
