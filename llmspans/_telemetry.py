"""Which tracer and metric recorder llmspans records into.

Normally the global providers: before `configure()` (or without it) the API's proxy tracer and
meter forward to whatever provider the application installs later, so `instrument()` and the
decorators work on an existing OpenTelemetry set-up, and metric values go through the SDK's
instruments (`_metrics.SdkRecorder`). When `configure()` built the metrics pipeline itself it
hands llmspans' own aggregation over (`aggregate_with`), and values go there. The testing helper
swaps in private providers for the length of a `capture()`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import metrics, trace

from llmspans import _names as names
from llmspans._metrics import Recorder, SdkRecorder
from llmspans._version import __version__

_lock = threading.Lock()
_override: tuple[trace.Tracer, Recorder] | None = None
_global: tuple[trace.Tracer, Recorder] | None = None


def _global_pair() -> tuple[trace.Tracer, Recorder]:
    global _global
    if _global is None:
        with _lock:
            if _global is None:
                _global = (
                    trace.get_tracer(names.INSTRUMENTATION_NAME, __version__),
                    SdkRecorder(metrics.get_meter(names.INSTRUMENTATION_NAME, __version__)),
                )
    return _global


def tracer() -> trace.Tracer:
    pair = _override or _global or _global_pair()
    return pair[0]


def recorder() -> Recorder:
    pair = _override or _global or _global_pair()
    return pair[1]


def aggregate_with(aggregation: Recorder) -> None:
    """From now on record the global metric values into llmspans' own aggregation (`configure()`).

    The gauges stay the SDK's: they were registered on the global meter with the SDK recorder.
    """
    global _global
    tracer_, _ = _global_pair()
    with _lock:
        _global = (tracer_, aggregation)


def replace_meter_provider(meter_provider: metrics.MeterProvider) -> None:
    """Inside `use_providers`, record metrics into a new provider from now on (capture's clear())."""
    global _override
    if _override is not None:
        _override = (
            _override[0],
            SdkRecorder(meter_provider.get_meter(names.INSTRUMENTATION_NAME, __version__)),
        )


@contextmanager
def use_providers(
    tracer_provider: trace.TracerProvider, meter_provider: metrics.MeterProvider
) -> Iterator[None]:
    """Record into these providers instead of the global ones inside the block."""
    global _override
    previous = _override
    _override = (
        tracer_provider.get_tracer(names.INSTRUMENTATION_NAME, __version__),
        SdkRecorder(meter_provider.get_meter(names.INSTRUMENTATION_NAME, __version__)),
    )
    try:
        yield
    finally:
        _override = previous
