"""`opentelemetry-instrument` support: llmspans as an OpenTelemetry instrumentor, zero code.

Registered under the `opentelemetry_instrumentor` entry point as `llmspans`, so with
`opentelemetry-instrumentation` installed (`pip install 'llmspans[instrumentation]'`),
`opentelemetry-instrument python app.py` instruments the openai SDK's client classes
(`llmspans.instrument_all()`) before the app builds a client, and
`OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=llmspans` switches it off. Settings come from the environment as
they do for `configure()` (`LLMSPANS_BUDGETS`, `LLMSPANS_PHASE_SPANS`, the GenAI content switch); spans
and metrics go to whatever providers the distro set up. `LLMSPANS_TAIL_SAMPLING` (e.g. `ratio=0.01,slower_than=p95`)
puts the distro's span processors behind tail sampling.

Installed beside `opentelemetry-instrumentation-openai-v2`, both instrument the SDK and each call gets
both instrumentations' spans (theirs nests in ours). Keep one: `OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=openai_v2`
keeps llmspans' buckets, `=llmspans` the official one.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from llmspans import _setup
from llmspans._instrument import instrument_all, uninstrument_all

__all__ = ["LlmspansInstrumentor"]


class LlmspansInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Instruments the openai SDK's client classes; `instrument(**settings)` takes `instrument()`'s."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("openai >= 1.40",)

    def _instrument(self, **kwargs: Any) -> None:
        settings = {
            key: value for key, value in kwargs.items() if key not in ("tracer_provider", "meter_provider")
        }
        instrument_all(**settings)
        _setup.tail_sample_the_global_provider()  # LLMSPANS_TAIL_SAMPLING, on the distro's provider

    def _uninstrument(self, **kwargs: Any) -> None:
        uninstrument_all()
