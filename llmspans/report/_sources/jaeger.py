"""Jaeger v2's query API (`/api/v3/traces`): one search of one service's recent traces, as span batches.

Jaeger answers in the same OTLP-JSON encoding as the embedded default's file, one bounded page of
traces; the page is held (it is bounded) and decoded again if the analysis needs a second pass.
404 is Jaeger's answer when nothing matches: an empty result, not an error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timezone

import httpx
import msgspec

from llmspans.report._metric_points import MetricPoints
from llmspans.report._model import SkippedLine
from llmspans.report._sources import short
from llmspans.report._spans import NotOtlp, ReportInputError, Span, spans_of_json

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


class JaegerPage:
    """One answer of Jaeger's trace search, decoded into span batches on every call of `batches()`."""

    def __init__(self, base: str, service: str, body: bytes | None) -> None:
        self.base = base
        self.body = body
        self.sources = [f"Jaeger {base} (service {service!r})"]
        self.skipped: list[SkippedLine] = []
        self.metrics: MetricPoints | None = None  # Jaeger keeps traces only

    def batches(self) -> Iterator[list[Span]]:
        if self.body is None:  # 404: nothing matched
            return
        for document in _documents(self.body, self.base):
            try:
                yield spans_of_json(document) or []
            except NotOtlp as error:
                raise ReportInputError(
                    f"Jaeger at {self.base} returned something that is not OTLP JSON ({error})"
                ) from None


def fetch_jaeger(
    url: str, service: str, since_s: float, *, timeout_s: float = 10.0, client: httpx.Client | None = None
) -> JaegerPage:
    """Search Jaeger v2's `/api/v3/traces` for one service's traces of the last `since_s` seconds."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ReportInputError(f"--jaeger must be a URL like http://localhost:16686, got {url!r}")
    endpoint = base + JAEGER_TRACES_PATH
    own = client is None
    http = client or httpx.Client(timeout=timeout_s)
    try:
        response = http.get(endpoint, params=jaeger_query(service, since_s))
    except httpx.HTTPError as error:
        raise ReportInputError(
            f"cannot reach Jaeger at {base}: {short(error) or type(error).__name__}"
        ) from None
    finally:
        if own:
            http.close()
    if response.status_code == 404:
        return JaegerPage(base, service, None)
    if response.status_code != 200:
        raise ReportInputError(
            f"Jaeger at {base} answered HTTP {response.status_code} to {JAEGER_TRACES_PATH}: "
            f"{_error_message(response.text)}"
        )
    page = JaegerPage(base, service, response.content)
    for _ in _documents(page.body or b"", base):  # not JSON at all: say so now, before any analysis
        pass
    return page


def _documents(body: bytes, base: str) -> Iterator[bytes]:
    """One JSON document, or several on their own lines (a streamed gRPC-gateway answer)."""
    try:
        msgspec.json.decode(body)
        yield body
        return
    except msgspec.DecodeError:
        pass
    lines = [line for line in body.splitlines() if line.strip()]
    if not lines:
        raise ReportInputError(f"Jaeger at {base} returned an empty body, not OTLP JSON")
    for line in lines:
        try:
            msgspec.json.decode(line)
        except msgspec.DecodeError as error:
            raise ReportInputError(
                f"Jaeger at {base} returned something that is not JSON ({short(error)})"
            ) from None
        yield line


def _error_message(body: str) -> str:
    try:
        document = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return " ".join(body.split())[:200] or "(empty body)"
    error = document.get("error") if isinstance(document, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message) if message else " ".join(body.split())[:200]
