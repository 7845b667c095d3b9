"""Which tracer and metric recorder llmspans records into, and whether anything listens at all.

Normally the global providers, looked up when a call, stage or turn starts: until the application
installs one, nothing listens and llmspans records nothing (`sinks()` is None; a provider installed
later is picked up by the next call). Spans go to the installed provider's own tracer. Metric values
go to llmspans' own aggregation wherever it can stand in for the SDK's instruments without changing
what the readers export: when `configure()` built the pipeline (`aggregate_with`), and on an
application's own SDK MeterProvider (`_aggregation.attach`, which says when it cannot: views, other
aggregations...); elsewhere through the SDK's instruments (`_metrics.SdkRecorder`). The testing
helper swaps in private providers for the length of a `capture()`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.trace import INVALID_SPAN, Span

from llmspans import _names as names
from llmspans import _suppress
from llmspans._metrics import CallMetrics, Labels, Recorder, Sample, SdkRecorder, register_gauges
from llmspans._version import __version__

Sinks = tuple[trace.Tracer, Recorder]

_lock = threading.Lock()
_override: Sinks | None = None
_global: Sinks | None = None  # once the application installed both global providers
_tracer_found: trace.Tracer | None = None
_recorder_found: Recorder | None = None
# Metric pipelines `configure()` built, and the recorder chosen for each MeterProvider met so far.
_configured: weakref.WeakKeyDictionary[Any, Recorder] = weakref.WeakKeyDictionary()
_recorders: weakref.WeakKeyDictionary[Any, Recorder] = weakref.WeakKeyDictionary()
_NOOP_TRACER = trace.NoOpTracer()


class _Discard:
    """Where metric values go while no MeterProvider is installed (the API's proxies drop them too)."""

    trace_based = True

    def sample(self, span: trace.Span, time_ns: int) -> Sample | None:
        return None

    def add(self, records: Sequence[Any], sample: Sample | None) -> None:
        pass

    def add_call(self, metrics: CallMetrics, values: Sequence[float], sample: Sample | None) -> None:
        pass

    def chunk_recorder(self, labels: Labels, sample: Sample | None) -> None:
        return None

    def add_distribution(self, *args: Any) -> None:
        pass


DISCARD = _Discard()
_QUIET: Sinks = (_NOOP_TRACER, DISCARD)


def sinks() -> Sinks | None:
    """The tracer and recorder to record into now; None when no provider is installed anywhere."""
    return _override or _global or _resolve()


LOOK_UP: Any = object()  # "look the sinks up now" (a default argument)


def recording_sinks() -> Sinks | None:
    """What a call or stage starting now records into; None when nothing would: no provider anywhere, or
    the context asks instrumentation for silence (`_suppress`)."""
    found = _override or _global or _resolve()
    if found is None or _suppress.suppressed():
        return None
    return found


def _resolve() -> Sinks | None:
    """Look for the global providers the application may have installed since the last call."""
    global _global, _tracer_found, _recorder_found
    tracer = _tracer_found
    if tracer is None:
        tracer_provider = trace.get_tracer_provider()
        if not isinstance(tracer_provider, trace.ProxyTracerProvider):
            with _lock:
                tracer = _tracer_found = _tracer_found or tracer_provider.get_tracer(
                    names.INSTRUMENTATION_NAME, __version__
                )
    recorder = _recorder_found
    if recorder is None:
        meter_provider = metrics.get_meter_provider()
        if type(meter_provider).__name__ != "_ProxyMeterProvider":
            with _lock:
                recorder = _recorder_found = _recorder_found or _recorder_of(meter_provider)
    if tracer is None and recorder is None:
        return None
    found = (tracer or _NOOP_TRACER, recorder or DISCARD)
    if tracer is not None and recorder is not None:
        _global = found
    return found


def pick_up_providers() -> None:
    """Look for the global providers now (configure() installed them: its gauges start reporting)."""
    if _global is None:
        _resolve()


def _recorder_of(meter_provider: metrics.MeterProvider) -> Recorder:
    """The recorder for one MeterProvider, chosen once: configure()'s aggregation, ours attached to the
    application's provider, or the SDK's instruments. The gauges are the SDK's on every path."""
    found = _recorders.get(meter_provider)
    if found is not None:
        return found
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from llmspans import _aggregation

    recorder: Recorder | None = _configured.get(meter_provider)
    if recorder is None:
        scope = InstrumentationScope(names.INSTRUMENTATION_NAME, __version__)
        recorder = _aggregation.attach(meter_provider, scope)
    meter = meter_provider.get_meter(names.INSTRUMENTATION_NAME, __version__)
    if recorder is None:
        recorder = SdkRecorder(meter)  # registers the gauges with the instruments
    else:
        register_gauges(meter)
    _recorders[meter_provider] = recorder
    return recorder


def tracer() -> trace.Tracer:
    return (_override or _global or _resolve() or _QUIET)[0]


def recorder() -> Recorder:
    return (_override or _global or _resolve() or _QUIET)[1]


def span_of(sinks_now: Sinks | None, suppressed: bool, name: str, **start: Any) -> Span:
    """A span from `sinks_now`'s tracer; the invalid span (records nothing, costs nothing) when nothing
    listens or the context asks for silence."""
    if sinks_now is None or suppressed:
        return INVALID_SPAN
    return sinks_now[0].start_span(name, **start)


def aggregate_with(meter_provider: metrics.MeterProvider, aggregation: Recorder) -> None:
    """Record the metric values of `meter_provider` (configure()'s, before it is installed) into
    llmspans' own aggregation, which its reader collects."""
    with _lock:
        _configured[meter_provider] = aggregation


def replace_meter_provider(meter_provider: metrics.MeterProvider) -> None:
    """Inside `use_providers`, record metrics into a new provider from now on (capture's clear())."""
    global _override
    if _override is not None:
        with _lock:
            _override = (_override[0], _recorder_of(meter_provider))


@contextmanager
def use_providers(
    tracer_provider: trace.TracerProvider, meter_provider: metrics.MeterProvider
) -> Iterator[None]:
    """Record into these providers instead of the global ones inside the block."""
    global _override
    previous = _override
    with _lock:
        found = (
            tracer_provider.get_tracer(names.INSTRUMENTATION_NAME, __version__),
            _recorder_of(meter_provider),
        )
    _override = found
    try:
        yield
    finally:
        _override = previous
