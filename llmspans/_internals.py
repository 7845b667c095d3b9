"""Every reach into another library's private names, in one room.

llmspans goes through public APIs where they exist. Where none does (a speed path, a fork fix, a socket to
wake), it reaches into a library's internals here and nowhere else: each reach is one name below, written
next to the versions it was checked on and what llmspans does without it. `REACHES` lists them all, and
tests/test_internals.py fails, naming the reach and the installed version, when an upgrade moved one. An
upgrade has this one module to look at.
"""

from __future__ import annotations

import collections as _collections
import importlib.metadata
import operator
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import attributes as _attributes
from opentelemetry import baggage as _baggage
from opentelemetry import context as _context
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import DEFAULT_TRACE_STATE as _DEFAULT_TRACE_STATE
from opentelemetry.trace import SpanContext as _SpanContext
from opentelemetry.trace import propagation as _propagation


@dataclass(frozen=True)
class Reach:
    """One reach: what it touches, in which distributions, the versions it was checked on, what llmspans does
    when it is gone, and a probe that says whether it is where it was in what is installed now."""

    name: str
    distributions: tuple[str, ...]
    checked: str
    fallback: str
    present: Callable[[], bool]

    def installed(self) -> str:
        """The installed versions of its distributions, as a test's message says them."""
        found = []
        for distribution in self.distributions:
            try:
                found.append(f"{distribution} {importlib.metadata.version(distribution)}")
            except importlib.metadata.PackageNotFoundError:
                found.append(f"{distribution} (not installed)")
        return ", ".join(found)


REACHES: list[Reach] = []


def _reach(
    name: str, distributions: tuple[str, ...], checked: str, fallback: str
) -> Callable[[Callable[[], bool]], Callable[[], bool]]:
    def register(probe: Callable[[], bool]) -> Callable[[], bool]:
        REACHES.append(Reach(name, distributions, checked, fallback, probe))
        return probe

    return register


def _module(name: str) -> Any:
    """An optional library's module, or None where it is not installed (its reaches then hold vacuously)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _importable(module: str, name: str) -> bool:
    return hasattr(_module(module), name)


# --- opentelemetry-api -------------------------------------------------------------------------------------

# The context keys a span and the baggage are kept under: the transport writes `traceparent` itself with
# OpenTelemetry's default propagators, reading the context as they do (`_transport._inject`). Without them
# the shortcut is off and OpenTelemetry's own `inject` writes the headers.
SPAN_KEY: str = getattr(_propagation, "_SPAN_KEY", "llmspans-unknown-key")
BAGGAGE_KEY: str = getattr(_baggage, "_BAGGAGE_KEY", "llmspans-unknown-key")
TRACEPARENT_SHORTCUT = hasattr(_propagation, "_SPAN_KEY") and hasattr(_baggage, "_BAGGAGE_KEY")


@_reach(
    "opentelemetry.trace.propagation._SPAN_KEY, opentelemetry.baggage._BAGGAGE_KEY",
    ("opentelemetry-api",),
    checked="1.45.2",
    fallback="the transport's traceparent shortcut is off: OpenTelemetry's own inject writes every header",
)
def _context_keys_present() -> bool:
    return _importable("opentelemetry.trace.propagation", "_SPAN_KEY") and _importable(
        "opentelemetry.baggage", "_BAGGAGE_KEY"
    )


def composite_members(textmap: Any) -> list[Any] | None:
    """The propagators a `CompositePropagator` holds (None when it keeps them elsewhere): the transport's
    shortcut runs only under the default pair, W3C trace context and baggage."""
    found = getattr(textmap, "_propagators", None)
    return found if isinstance(found, list) else None


@_reach(
    "CompositePropagator._propagators",
    ("opentelemetry-api",),
    checked="1.45.2",
    fallback="the transport's traceparent shortcut is off: OpenTelemetry's own inject writes every header",
)
def _composite_members_present() -> bool:
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return composite_members(CompositePropagator([TraceContextTextMapPropagator()])) is not None


# --- opentelemetry-sdk -------------------------------------------------------------------------------------


def span_attributes(span: Any) -> Mapping[str, Any]:
    """A finished SDK span's attributes as a plain mapping, without the read-only copy `span.attributes`
    builds per look-up (tail sampling looks at every span that ends). Falls back to `span.attributes`."""
    attributes = getattr(span, "_attributes", None)
    if attributes is None:
        return span.attributes or {}
    return getattr(attributes, "_dict", attributes)  # type: ignore[no-any-return]


@_reach(
    "ReadableSpan._attributes, BoundedAttributes._dict",
    ("opentelemetry-sdk",),
    checked="1.45.2",
    fallback="tail sampling reads `span.attributes`, a read-only copy per span (slower, the same decisions)",
)
def _span_attributes_present() -> bool:
    from opentelemetry.sdk.trace import TracerProvider

    span = TracerProvider().get_tracer("llmspans-probe").start_span("probe", attributes={"a": 1})
    span.end()
    attributes = getattr(span, "_attributes", None)
    return isinstance(getattr(attributes, "_dict", None), dict)


def meter_provider_config(provider: Any) -> Any:
    """A `MeterProvider`'s configuration (its resource, views, exemplar filter); None if not found."""
    return getattr(provider, "_sdk_config", None)


def meter_provider_resource(provider: Any) -> Any:
    """The resource a `MeterProvider` exports on (after a fork, the child's own); None if not found."""
    return getattr(meter_provider_config(provider), "resource", None)


def meter_provider_readers(provider: Any) -> Any:
    """The metric readers a `MeterProvider` collects for; None if not found."""
    return getattr(provider, "_metric_readers", None)


def meter_provider_disabled(provider: Any) -> bool:
    """Whether a `MeterProvider` was disabled (`OTEL_SDK_DISABLED`); True when that cannot be told."""
    return bool(getattr(provider, "_disabled", True))


def meter_configurator(provider: Any) -> Any:
    """The rule a `MeterProvider` configures its meters by (`_default_meter_configurator` unless changed)."""
    return getattr(provider, "_meter_configurator", None)


def reader_collect(reader: Any) -> Any:
    """The function a metric reader collects with: what llmspans' aggregation wraps to add its own points."""
    return getattr(reader, "_collect", None)


def set_reader_collect(reader: Any, collect: Callable[..., Any]) -> None:
    reader._collect = collect


def reader_choices(reader: Any) -> tuple[Mapping[type, Any], Mapping[type, Any], Mapping[type, Any]]:
    """A metric reader's temporality, aggregation and cardinality limit per instrument class (empty where not
    found): what llmspans' aggregation must give each reader to export what the SDK would have."""
    return (
        getattr(reader, "_instrument_class_temporality", {}),
        getattr(reader, "_instrument_class_aggregation", {}),
        getattr(reader, "_instrument_class_cardinality_limit", {}),
    )


def explicit_histogram_choice(aggregation: Any) -> tuple[Any, bool]:
    """An `ExplicitBucketHistogramAggregation`'s own boundaries (None: the instrument's) and whether it keeps
    min and max; `((), False)` where not found, which llmspans reads as "not ours to stand in for"."""
    return getattr(aggregation, "_boundaries", ()), bool(getattr(aggregation, "_record_min_max", False))


def reset_reader_storage(provider: Any, reader: Any) -> bool:
    """Give `reader` fresh storage in `provider` (no points, start times from now), and a fresh lock to the
    provider's measurement consumer (a fork during a collection leaves it held). False when the SDK's
    consumer is not where it was: the child then keeps the SDK's own behaviour."""
    consumer = getattr(provider, "_measurement_consumer", None)
    if consumer is None or not hasattr(consumer, "_lock"):
        return False
    import threading

    consumer._lock = threading.Lock()
    consumer.remove_metric_reader(reader)
    consumer.add_metric_reader(reader)
    return True


@_reach(
    "MeterProvider._sdk_config, _metric_readers, _disabled, _meter_configurator; MetricReader._collect, "
    "_instrument_class_temporality, _instrument_class_aggregation, _instrument_class_cardinality_limit; "
    "ExplicitBucketHistogramAggregation._boundaries, _record_min_max",
    ("opentelemetry-sdk",),
    checked="1.45.2",
    fallback="llmspans' own aggregation stands aside: the SDK's instruments record its metrics (slower, the same "
    "points), said at DEBUG",
)
def _metric_parts_present() -> bool:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    temporality, aggregation, limit = reader_choices(reader)
    boundaries, _ = explicit_histogram_choice(ExplicitBucketHistogramAggregation())
    present = (
        meter_provider_config(provider) is not None
        and isinstance(meter_provider_readers(provider), (list, tuple))
        and not meter_provider_disabled(provider)
        and getattr(meter_configurator(provider), "__name__", "") == "_default_meter_configurator"
        and callable(reader_collect(reader))
        and bool(temporality) and bool(aggregation) and bool(limit)
        and boundaries is None
    )  # fmt: skip
    provider.shutdown()
    return present


@_reach(
    "MeterProvider._sdk_config, MeterProvider._measurement_consumer (its _lock)",
    ("opentelemetry-sdk",),
    checked="1.45.2",
    fallback="after a fork the child keeps the SDK's metric state (the parent's points), said at DEBUG",
)
def _meter_provider_parts_present() -> bool:
    from opentelemetry.sdk.metrics import MeterProvider

    provider = MeterProvider()
    consumer = getattr(provider, "_measurement_consumer", None)
    present = (
        meter_provider_resource(provider) is not None
        and hasattr(consumer, "_lock")
        and callable(getattr(consumer, "remove_metric_reader", None))
        and callable(getattr(consumer, "add_metric_reader", None))
    )
    provider.shutdown()
    return present


# Held spans (`_held_span`) stand in for `Tracer.start_span` and build the `ReadableSpan` an SDK span would
# have ended as. Every part of the tracer a span is made from is read here; where one is not where it was,
# `tracer_is_plain` says no and the tracer's spans stay the SDK's own (as before held spans).


def span_processors(multi: Any) -> tuple[Any, ...] | None:
    """The processors of a provider's `SynchronousMultiSpanProcessor` (a tuple replaced on each add, so
    its identity says whether they changed); None when they are kept elsewhere."""
    found = getattr(multi, "_span_processors", None)
    return found if isinstance(found, tuple) else None


processors_of = operator.attrgetter("_span_processors")
"""`span_processors` without the checks, for a processor `span_processors` already found them on."""

_new_tuple = tuple.__new__
_clean_attribute_value: Any = getattr(_attributes, "_clean_attribute_value", None)
_TRACE_ID_MAX = (1 << 128) - 1
_SPAN_ID_MAX = (1 << 64) - 1


def span_context(trace_id: int, span_id: int, flags: Any, state: Any) -> Any:
    """A local `SpanContext`, made as its `__new__` makes it (a tuple of the ids, `is_remote`, the flags, the
    state and whether the ids are valid) without its Python checks: the ids are ints from an id generator."""
    valid = 0 < trace_id <= _TRACE_ID_MAX and 0 < span_id <= _SPAN_ID_MAX
    return _new_tuple(_SpanContext, (trace_id, span_id, False, flags, state or _DEFAULT_TRACE_STATE, valid))


def tracer_is_plain(tracer: Any) -> bool:
    """A tracer a held span can stand in for: enabled by its configurator, without the SDK's own span
    metrics (`OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED`), with its limits and scope where they were."""
    try:
        from opentelemetry.sdk.trace._tracer_metrics import NoOpTracerMetrics
    except ImportError:
        return False
    config = getattr(tracer, "_tracer_config", None)
    return (
        _clean_attribute_value is not None
        and getattr(config, "is_enabled", False) is True
        and type(getattr(tracer, "_tracer_metrics", None)) is NoOpTracerMetrics
        and hasattr(tracer, "_span_limits")
        and hasattr(tracer, "_instrumentation_scope")
    )


def span_limits(tracer: Any) -> Any:
    """The `SpanLimits` the tracer's spans are made under."""
    return tracer._span_limits


def instrumentation_scope(tracer: Any) -> Any:
    return tracer._instrumentation_scope


def static_decision(sampler: Any) -> Decision:
    """The one decision of a `StaticSampler` (ALWAYS_ON, ALWAYS_OFF)."""
    decision: Decision = sampler._decision
    return decision


def parent_based_delegates(sampler: Any) -> tuple[Any, ...] | None:
    """A `ParentBased` sampler's delegates: root, remote parent sampled / not, local parent sampled / not;
    None when they are kept elsewhere (the sampler is then asked itself)."""
    try:
        return (
            sampler._root, sampler._remote_parent_sampled, sampler._remote_parent_not_sampled,
            sampler._local_parent_sampled, sampler._local_parent_not_sampled,
        )  # fmt: skip
    except AttributeError:
        return None


def clean_attributes(attributes: Mapping[str, Any], max_length: int | None) -> Mapping[str, Any]:
    """Attributes cleaned as an SDK span cleans them when they are set (sequences become tuples, bad keys
    and values are dropped or made strings, strings cut at `max_length`)."""
    cleaned: Mapping[str, Any] = _clean_attribute_value(attributes, max_length)
    return cleaned


def on_ending_of(processor_class: type) -> Any:
    """A processor class's `_on_ending` (the SDK calls it as a span ends, before `on_end`)."""
    return getattr(processor_class, "_on_ending", None)


def sdk_span_class() -> Any:
    """The span class a `Tracer` makes (`_Span`: `Span` itself refuses to be made directly)."""
    from opentelemetry.sdk.trace import _Span

    return _Span


def tracer_provider_processors(provider: Any) -> tuple[Any, ...] | None:
    """The span processors of an SDK TracerProvider, in order (None when kept elsewhere)."""
    return span_processors(getattr(provider, "_active_span_processor", None))


def set_tracer_provider_processors(provider: Any, processors: tuple[Any, ...]) -> None:
    """Replace an SDK TracerProvider's span processors (its tracers read them through the same object):
    zero-code tail sampling puts the ones the distro set up behind it."""
    multi = provider._active_span_processor
    with multi._lock:
        multi._span_processors = processors


def fill_attributes(bounded: Any, writes: Any) -> None:
    """Each of `writes` (dicts already cleaned) into a `BoundedAttributes`, as the SDK's `set_attributes`
    does (its `_set_items`: under its limits, in order, one lock a dict), then frozen, as `Span.end` leaves it."""
    for write in writes:
        bounded._set_items(write)
    bounded._immutable = True


def end_without_processors(span: Any, end_time: int | None) -> None:
    """End an SDK span made to be read back (`HeldSpan.sdk_span`) as `Span.end` does (its end time set, its
    attributes frozen) without handing it to the processors a second time."""
    span._end_time = end_time
    span._attributes._immutable = True


@_reach(
    "Tracer._tracer_config, _tracer_metrics, _span_limits, _instrumentation_scope; "
    "TracerProvider._active_span_processor; SynchronousMultiSpanProcessor._span_processors, _lock; "
    "StaticSampler._decision; ParentBased's delegates; "
    "SpanProcessor._on_ending; opentelemetry.sdk.trace._Span, Span._end_time; SpanContext's tuple; "
    "opentelemetry.attributes._clean_attribute_value, BoundedAttributes._immutable, _set_items",
    ("opentelemetry-sdk", "opentelemetry-api"),
    checked="1.45.2",
    fallback="every span is the SDK's own (no held spans): tail sampling holds SDK spans and a head-sampled "
    "span validates each attribute as it is set, as before; LLMSPANS_TAIL_SAMPLING applies through "
    "configure() only",
)
def _held_span_parts_present() -> bool:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, DEFAULT_ON
    from opentelemetry.trace import SpanContext

    provider = TracerProvider()
    provider.add_span_processor(SpanProcessor())
    tracer = provider.get_tracer("llmspans-probe")
    span = tracer.start_span("probe")
    members = tracer_provider_processors(provider)
    present = (
        members is not None
        and hasattr(getattr(provider, "_active_span_processor", None), "_lock")
        and tracer_is_plain(tracer)
        and span_processors(getattr(tracer, "span_processor", None)) is not None
        and static_decision(ALWAYS_ON) is not None
        and parent_based_delegates(DEFAULT_ON) is not None
        and on_ending_of(SpanProcessor) is not None
        and isinstance(span, sdk_span_class())
        and hasattr(span, "_end_time")
        and hasattr(getattr(span, "_attributes", None), "_immutable")
        and callable(getattr(getattr(span, "_attributes", None), "_set_items", None))
        and clean_attributes({"a": [1]}, None) == {"a": (1,)}
        and processors_of(getattr(tracer, "span_processor", None)) is members
        and span_context(5, 6, span.get_span_context().trace_flags, None)
        == SpanContext(5, 6, False, span.get_span_context().trace_flags)
        and span_context(0, 6, span.get_span_context().trace_flags, None).is_valid is False
    )
    span.end()
    provider.shutdown()
    return present


# --- httpx, httpx2 -----------------------------------------------------------------------------------------


def client_transport(client: Any) -> Any:
    """The transport an httpx or httpx2 client sends through (None when it keeps it elsewhere): there is no
    public way to put a wrapper around a client's transport once the client is built."""
    return getattr(client, "_transport", None)


def set_client_transport(client: Any, transport: Any) -> None:
    client._transport = transport


def client_mounts(client: Any) -> dict[Any, Any] | None:
    """The transports a client mounted per URL pattern (`mounts=`, proxies), wrapped like its own."""
    mounts = getattr(client, "_mounts", None)
    return mounts if isinstance(mounts, dict) else None


@_reach(
    "Client._transport, Client._mounts (httpx and httpx2)",
    ("httpx", "httpx2"),
    checked="httpx 0.28.1, httpx2 2.16.2",
    fallback="a client whose transport is not found is left as it is: its calls get their spans from the "
    "adapter, without attempts, connection timing or traceparent",
)
def _client_transport_present() -> bool:
    present = True
    for library in filter(None, map(_module, ("httpx", "httpx2"))):
        with library.Client() as client:
            present = present and client_transport(client) is not None and client_mounts(client) is not None
    return present


_LOWER_KEY = operator.itemgetter(1)


def add_header(headers: Any, lower_key: bytes, value: str) -> bool:
    """Add a header the request does not have yet to an httpx or httpx2 `Headers`, as its `__setitem__` would
    (raw and lowered key, the value encoded), without its scan for duplicates in Python; False when the request
    has the header already, or the headers keep their list elsewhere: the caller sets it the public way."""
    items = getattr(headers, "_list", None)
    if type(items) is not list or lower_key in map(_LOWER_KEY, items):
        return False
    encoded = value.encode(getattr(headers, "_encoding", None) or "utf-8")
    items.append((lower_key, lower_key, encoded))
    return True


@_reach(
    "Headers._list, Headers._encoding (httpx and httpx2)",
    ("httpx", "httpx2"),
    checked="httpx 0.28.1, httpx2 2.16.2",
    fallback="the transport sets traceparent through Headers.__setitem__ (a scan of the headers in Python)",
)
def _headers_list_present() -> bool:
    present = True
    for module in ("httpx", "httpx2"):
        try:
            library = importlib.import_module(module)
        except ImportError:
            continue
        headers = library.Headers({"Accept": "x"})
        present = present and add_header(headers, b"traceparent", "v") and headers.get("traceparent") == "v"
        present = (
            present
            and headers.raw[-1] == (b"traceparent", b"v")
            and not add_header(headers, b"traceparent", "w")
        )
    return present


# --- httpcore, httpcore2 -----------------------------------------------------------------------------------


def http11_network_stream(transport: Any, extensions: Mapping[str, Any]) -> Any:
    """The network stream of the HTTP/1.1 connection that holds the request whose `extensions` these are,
    in the pool of `transport` (httpx's or httpx2's `HTTPTransport`), from its placement on a connection to
    its response's close; None when it holds none now, holds an HTTP/2 connection (shared by other requests:
    not one to shut down), or the pool keeps its requests elsewhere. httpcore hands a request's trace hook
    no connection, and the response's `network_stream` extension comes only with its headers."""
    pool = getattr(transport, "_pool", None)
    placed = getattr(pool, "_requests", None)
    if not isinstance(placed, list):
        return None
    for pending in list(placed):
        request = getattr(pending, "request", None)
        if getattr(request, "extensions", None) is extensions:
            connection = getattr(getattr(pending, "connection", None), "_connection", None)
            if type(connection).__name__ != "HTTP11Connection":
                return None
            return getattr(connection, "_network_stream", None)
    return None


@_reach(
    "HTTPTransport._pool, ConnectionPool._requests, HTTPConnection._connection, "
    "HTTP11Connection._network_stream (httpx/httpcore and httpx2/httpcore2)",
    ("httpx", "httpcore", "httpx2", "httpcore2"),
    checked="httpx 0.28.1 with httpcore 1.0.9, httpx2 2.16.2 with httpcore2 2.16.2",
    fallback="a sync hedge's losing copy is not woken where it waits: it stops at its next trace event, "
    "or when its answer comes",
)
def _http11_network_stream_present() -> bool:
    present = True
    for library, core in (("httpx", "httpcore"), ("httpx2", "httpcore2")):
        try:
            transport = importlib.import_module(library).HTTPTransport()
            connection_module = importlib.import_module(f"{core}._sync.connection")
            http11 = importlib.import_module(f"{core}._sync.http11")
        except ImportError:
            continue
        pool = getattr(transport, "_pool", None)
        present = (
            present
            and isinstance(getattr(pool, "_requests", None), list)
            and "_connection" in _assigned(connection_module.HTTPConnection.__init__)
            and "_network_stream" in _assigned(http11.HTTP11Connection.__init__)
        )
        transport.close()
    return present


def _assigned(init: Any) -> set[str]:
    """The attribute names an `__init__` assigns on `self` (its code's names: no instance to build)."""
    return set(init.__code__.co_names)


# --- openai ------------------------------------------------------------------------------------------------


def openai_http_client(client: Any) -> Any:
    """The httpx or httpx2 client an openai client sends through (None when it keeps it elsewhere): the one
    the transport wraps. There is no public name for it."""
    return getattr(client, "_client", None)


@_reach(
    "OpenAI._client, AsyncOpenAI._client",
    ("openai",),
    checked="openai 3.57.0",
    fallback="an openai client whose HTTP client is not found is left uninstrumented, with one debug line",
)
def _openai_http_client_present() -> bool:
    openai = _module("openai")
    if openai is None:
        return True
    client = openai.OpenAI(api_key="probe", base_url="http://127.0.0.1:9/v1")
    present = openai_http_client(client) is not None
    client.close()
    return present


# --- opentelemetry-api: the suppress switches ----------------------------------------------------------------

# The keys OpenTelemetry's `suppress_instrumentation()` (and its HTTP variant) set: private in the API, read by
# every contrib instrumentation. None where gone: then nothing is suppressed.
SUPPRESS_INSTRUMENTATION_KEY: str | None = getattr(_context, "_SUPPRESS_INSTRUMENTATION_KEY", None)
SUPPRESS_HTTP_INSTRUMENTATION_KEY: str | None = getattr(_context, "_SUPPRESS_HTTP_INSTRUMENTATION_KEY", None)


@_reach(
    "opentelemetry.context._SUPPRESS_INSTRUMENTATION_KEY, _SUPPRESS_HTTP_INSTRUMENTATION_KEY",
    ("opentelemetry-api",),
    checked="1.45.2",
    fallback="nothing is suppressed: a suppress_instrumentation() block is recorded, and the vLLM sampler's own "
    "requests may be traced by an app's HTTP instrumentation",
)
def _suppress_keys_present() -> bool:
    return SUPPRESS_INSTRUMENTATION_KEY is not None and SUPPRESS_HTTP_INSTRUMENTATION_KEY is not None


# --- opentelemetry-sdk: spans and span processors --------------------------------------------------------------


def span_attribute_length_limit(span: Any) -> Any:
    """The attribute value length limit an SDK span was made under (`SpanLimits`); None where not found."""
    return getattr(getattr(span, "_limits", None), "max_span_attribute_length", None)


@_reach(
    "Span._limits",
    ("opentelemetry-sdk",),
    checked="1.45.2",
    fallback="captured content is cut at MAX_CONTENT_CHARS alone, whatever attribute length limit the provider has",
)
def _span_limits_present() -> bool:
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider

    span = (
        TracerProvider(span_limits=SpanLimits(max_span_attribute_length=7))
        .get_tracer("probe")
        .start_span("p")
    )
    span.end()
    return bool(span_attribute_length_limit(span) == 7)


def batch_queue_full(processor: Any) -> bool | None:
    """Whether a `BatchSpanProcessor`'s queue is full (or it shut down): a span ended now is dropped. None where
    the queue is not found: the span is queued all the same, only not counted."""
    batch = getattr(processor, "_batch_processor", None)
    queue = getattr(batch, "_queue", None)
    if queue is None:
        return None
    return bool(len(queue) == queue.maxlen) or bool(getattr(batch, "_shutdown", False))


@_reach(
    "BatchSpanProcessor._batch_processor (its _queue, _shutdown)",
    ("opentelemetry-sdk",),
    checked="1.45.2",
    fallback="spans a full export queue drops are no longer counted (they are still dropped as before)",
)
def _batch_queue_present() -> bool:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    processor = BatchSpanProcessor(SpanExporter())
    present = batch_queue_full(processor) is False
    processor.shutdown()  # type: ignore[no-untyped-call]
    return present


def exporter_preferences(exporter: Any) -> tuple[Any, Any]:
    """The temporality and aggregation a metric exporter asks its reader for (None each where not found: the
    reader's defaults)."""
    return getattr(exporter, "_preferred_temporality", None), getattr(
        exporter, "_preferred_aggregation", None
    )


def reset_exporter_lock(exporter: Any) -> None:
    """After a fork, a fresh lock for the writer inside an OTLP-JSON file exporter (a fork mid-write leaves it
    held); nothing where it keeps none."""
    inner = getattr(exporter, "_exporter", None)
    if inner is not None and hasattr(inner, "_lock"):
        import threading

        inner._lock = threading.Lock()


@_reach(
    "MetricExporter._preferred_temporality, _preferred_aggregation; the OTLP-JSON file exporters' _exporter._lock",
    ("opentelemetry-sdk", "opentelemetry-exporter-otlp-json-file"),
    checked="opentelemetry-sdk 1.45.2, opentelemetry-exporter-otlp-json-file as installed",
    fallback="an OTLP metric exporter's reader takes the SDK's default temporality; a forked child's file "
    "exporter keeps its parent's lock",
)
def _exporter_parts_present() -> bool:
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

    exporter = ConsoleMetricExporter()
    present = hasattr(exporter, "_preferred_temporality") and hasattr(exporter, "_preferred_aggregation")
    files = _module("opentelemetry.exporter.otlp.json.file")
    if files is None:
        return present
    import io

    inner = getattr(files.FileSpanExporter(stream=io.StringIO()), "_exporter", None)
    return present and inner is not None and hasattr(inner, "_lock")


# --- the standard library --------------------------------------------------------------------------------------


def _count_in_python(counts: dict[Any, int], items: Any) -> None:
    for item in items:
        counts[item] = counts.get(item, 0) + 1


# `Counter`'s own C loop: counts a list's items into a dict.
count_elements: Callable[[dict[Any, int], Any], None] = getattr(
    _collections, "_count_elements", _count_in_python
)


@_reach(
    "collections._count_elements",
    ("python",),
    checked="CPython 3.11",
    fallback="histogram counts are tallied by a Python loop (slower, the same counts)",
)
def _count_elements_present() -> bool:
    return count_elements is not _count_in_python


def _environ_parts() -> tuple[dict[Any, Any], Callable[[str], Any], Callable[[Any], str]] | None:
    """`os.environ`'s stored mapping and its key and value codecs, where CPython keeps them; else None."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    encodekey = getattr(environ, "encodekey", None)
    decodevalue = getattr(environ, "decodevalue", None)
    if type(data) is not dict or encodekey is None or decodevalue is None:
        return None
    return data, encodekey, decodevalue


def environment_reader(name: str) -> tuple[Callable[[], Any], Callable[[Any], str]]:
    """(read, decode) for one environment variable as `os.environ` holds it now: `read()` is its stored value
    (`os.environ._data`: bytes on POSIX; None when unset) without `os.environ`'s Python layers, a key for a
    cache, and `decode` makes it the str `os.environ` gives. Without the private mapping, `read` is
    `os.environ.get` and `decode` takes its str as it is."""
    parts = _environ_parts()
    if parts is None:
        environ = os.environ
        return (lambda: environ.get(name)), str
    data, encodekey, decodevalue = parts
    key = encodekey(name)
    return (lambda: data.get(key)), decodevalue


@_reach(
    "os.environ._data",
    ("python",),
    checked="CPython 3.11",
    fallback="the environment is read through os.environ.get (slower, the same values)",
)
def _environ_data_present() -> bool:
    parts = _environ_parts()
    if parts is None:
        return False
    data, encodekey, _ = parts
    key = encodekey("PATH")
    return key in data if "PATH" in os.environ else key not in data


# --- openai: raw responses -------------------------------------------------------------------------------------


def openai_raw_response_types() -> tuple[type, ...]:
    """The classes of what `with_raw_response` and `with_streaming_response` return: two public, and the legacy
    one `with_raw_response` still returns, which the SDK does not export."""
    import openai

    found: list[type] = [openai.APIResponse, openai.AsyncAPIResponse]
    try:
        from openai import _legacy_response

        found.append(_legacy_response.LegacyAPIResponse)
    except (ImportError, AttributeError):
        pass
    return tuple(found)


@_reach(
    "openai._legacy_response.LegacyAPIResponse",
    ("openai",),
    checked="openai 3.57.0",
    fallback="a `with_raw_response` call's answer is not read by llmspans: its span lacks the answer's usage",
)
def _legacy_response_present() -> bool:
    return _module("openai") is None or len(openai_raw_response_types()) == 3


# --- ray (only `llmspans load --ray`; never the instrumentation runtime) ---------------------------------------


def ray_bootstrap_address(address: str) -> str | None:
    """The cluster's `host:port` that `address` means (`auto`: `RAY_ADDRESS`, then the cluster `ray start` made
    on this machine), as `ray.init` would find it, before connecting: `ray.init` waits minutes on an address
    where no cluster is. Ray's own error when it finds none is raised as it is; None where this Ray has no
    such function."""
    services = _module("ray._private.services")
    canonical = getattr(services, "canonicalize_bootstrap_address_or_die", None)
    return None if canonical is None else str(canonical(address))


@_reach(
    "ray._private.services.canonicalize_bootstrap_address_or_die",
    ("ray",),
    checked="ray 2.60",
    fallback="--ray takes the address as given: a host:port works, `auto` is refused in one line",
)
def _ray_bootstrap_present() -> bool:
    return _ray_defines("services", "canonicalize_bootstrap_address_or_die")


def quiet_ray_worker_logs() -> bool:
    """Turn off the driver's echo of its raylets' messages (a generator's death) on stdout, which holds a
    load run's result (`--json`) alone; False where this Ray keeps the switch elsewhere (the echo stays)."""
    worker = _module("ray._private.worker")
    if worker is None or not hasattr(worker, "_worker_logs_enabled"):
        return False
    worker._worker_logs_enabled = False
    return True


@_reach(
    "ray._private.worker._worker_logs_enabled",
    ("ray",),
    checked="ray 2.60",
    fallback="Ray's messages about a lost generator are echoed on the driver's stdout, beside a --json result",
)
def _ray_worker_logs_present() -> bool:
    return _ray_defines("worker", "_worker_logs_enabled")


def _ray_defines(module: str, name: str) -> bool:
    """Whether the installed Ray's `ray._private.<module>` defines `name` at its top level, read from its source:
    importing Ray here would fix its environment for the process (a test's cluster set-up comes later). True
    where Ray is not installed."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        return True
    source = Path(spec.origin).parent / "_private" / f"{module}.py"
    if not source.is_file():
        return False
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return True
    return False
