"""OpenTelemetry's "suppress instrumentation" switch, honoured by every span and metric llmspans makes.

`opentelemetry.instrumentation.utils.suppress_instrumentation()` (or attaching the key yourself) is
how an app asks all instrumentations to stay silent for a block: health checks, warm-up requests,
an exporter's own traffic. The key is private in the API but every contrib instrumentation reads it;
if an API release drops it, nothing is suppressed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from opentelemetry import context, trace

from llmspans import _internals

_KEY = _internals.SUPPRESS_INSTRUMENTATION_KEY

# What a suppressed call, stage or turn starts its spans on: they still run and end, recording nothing.
NOOP_TRACER: Final = trace.NoOpTracer()


def suppressed_in(ctx: context.Context) -> bool:
    """`suppressed()` for a context already in hand (saves looking the current one up again)."""
    return _KEY is not None and bool(ctx.get(_KEY))


def suppressed() -> bool:
    """Whether the current context asks instrumentation to record nothing.

    Checked once when a call, stage or turn starts: a suppressed one still runs (a limiter still
    admits it), on no-op spans, with no metrics and no `traceparent` sent.
    """
    return _KEY is not None and bool(context.get_value(_KEY))


@contextmanager
def suppressing() -> Iterator[None]:
    """Record nothing inside the block, the way an app would ask it of every instrumentation."""
    if _KEY is None:
        yield
        return
    token = context.attach(context.set_value(_KEY, True))
    try:
        yield
    finally:
        context.detach(token)
