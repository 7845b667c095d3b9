"""What tail sampling holds in memory: turns of 10 spans at a steady rate, each open for a while.

Each turn is a root span left open for `--turn-seconds` and nine children ended at once (a call span
and eight stage spans), so tail sampling holds the children of every open turn until its root ends. A
paced loop starts `--rate` turns a second for `--seconds` (bounded: it stops then, whatever it reached)
and ends each root when due; kept traces go to a batch processor whose exporter drops them.

`--spans` says what the turns are made of:

- `held` (the default): llmspans' own spans as `configure(tail_sampling=...)` holds them, deferred
  (`_held_span`): a turn's root, a streamed call's record (an attempt, 24 content chunks, usage, a finish
  reason) and eight `@llmspans.stage` calls;
- `held-sdk`: the same with `TailSampling(defer=False)`: SDK spans;
- `sdk`: SDK spans started straight from a tracer with the attributes a call span has (issue 31's figure).

Printed: the rate reached, spans held (the processor's own count, sampled each 100 ms: median and
maximum), the process's RSS growth, CPU per turn, and the bytes one held span costs (tracemalloc over a
second, smaller pass: what the held spans allocate, divided by their number; then the call and a stage
alone), so held memory = bytes per span x spans held. The machine's load moves the rate and CPU; the
bytes do not.

    python benchmarks/tail_memory.py                      # 1,000 turns/s, 10 s, turns open 1 s
    python benchmarks/tail_memory.py --spans held-sdk     # the same turns as SDK spans
    python benchmarks/tail_memory.py --rate 1000 --seconds 20 --turn-seconds 2
"""

from __future__ import annotations

import argparse
import collections
import resource
import statistics
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

import llmspans
from llmspans import _names as names

CALL_ATTRIBUTES: dict[str, Any] = {
    "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": "gpt-4o-mini",
    "gen_ai.response.model": "gpt-4o-mini-2024-07-18", "gen_ai.response.id": "chatcmpl-0123456789abcdef",
    "gen_ai.response.finish_reasons": ("stop",), "gen_ai.usage.input_tokens": 812,
    "gen_ai.usage.output_tokens": 240, "llmspans.stage": "llm", "server.address": "127.0.0.1",
    "server.port": 8000, "llmspans.bucket.queue": 0.0, "llmspans.bucket.retry": 0.0,
    "llmspans.bucket.connect": 0.0, "llmspans.bucket.first_token": 0.231, "llmspans.bucket.stream": 0.812,
    "llmspans.bucket.post": 0.0004, "llmspans.stream.chunks": 240, "llmspans.itl.p50": 0.003,
    "llmspans.itl.p95": 0.006, "llmspans.itl.max": 0.02, "http.response.status_code": 200,
}  # fmt: skip
STAGE_ATTRIBUTES: dict[str, Any] = {"llmspans.stage": "retrieval", "code.function.name": "search"}


class _Dropping(SpanExporter):
    def __init__(self) -> None:
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def _provider(ratio: float, spans: str) -> tuple[TracerProvider, llmspans.TailSamplingProcessor, _Dropping]:
    exporter = _Dropping()
    sampling = llmspans.TailSampling(ratio=ratio, slower_than="p95", defer=spans == "held")
    processor = llmspans.TailSamplingProcessor(BatchSpanProcessor(exporter), sampling=sampling)
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(processor)
    return provider, processor, exporter


class Turns:
    """Starts turns of one kind (`--spans`): each returns its open root, its children ended."""

    def __init__(self, provider: TracerProvider, spans: str) -> None:
        from opentelemetry.sdk.metrics import MeterProvider

        from llmspans import _held_span, _telemetry

        self.spans = spans
        self.tracer = provider.get_tracer(names.INSTRUMENTATION_NAME)
        self._held_span = _held_span
        self._providers = _telemetry.use_providers(provider, MeterProvider())
        self._providers.__enter__()

        def search() -> str:
            return "doc"

        self.search = llmspans.stage("retrieval")(search)

    def close(self) -> None:
        self._providers.__exit__(None, None, None)

    def start(self) -> Any:
        if self.spans == "sdk":
            return self._sdk_turn()
        from opentelemetry import context, trace

        root = self._held_span.start_span(self.tracer, "turn chat", attributes=_TURN_ATTRIBUTES)
        token = context.attach(trace.set_span_in_context(root))
        try:
            self.call()
            for _ in range(8):
                self.search()
        finally:
            context.detach(token)
        return root

    def call(self) -> None:
        """A streamed call as the openai adapter and the transport write it, with made-up instants."""
        from llmspans._call import CallRecord

        record = CallRecord(operation="chat", model="gpt-4o-mini", provider="openai", stream=True,
                            server_address="127.0.0.1", server_port=8000)  # fmt: skip
        now = time.perf_counter_ns()
        attempt = record.attempt(now + 100_000)
        attempt.status = 200
        chunk = now + 231_000_000
        for _ in range(24):
            record.content_chunk(chunk)
            chunk += 3_000_000 + (chunk & 0xFFFFF)
        record.set_response("chatcmpl-0123456789abcdef", "gpt-4o-mini-2024-07-18")
        record.choice_finished(0, "stop")
        record.set_usage(812, 24)
        attempt.body_done_ns = chunk
        record.finish("completed", now_ns=chunk + 400_000)

    def _sdk_turn(self) -> Any:
        from opentelemetry import trace

        tracer = self.tracer
        root = tracer.start_span("turn chat", attributes={"llmspans.stage": "turn"})
        inside = trace.set_span_in_context(root)
        tracer.start_span("chat gpt-4o-mini", context=inside, attributes=CALL_ATTRIBUTES).end()
        for _ in range(8):
            tracer.start_span("retrieval search", context=inside, attributes=STAGE_ATTRIBUTES).end()
        return root


_TURN_ATTRIBUTES = {"llmspans.stage": "turn"}


def steady(rate: float, seconds: float, turn_seconds: float, ratio: float, spans: str) -> dict[str, float]:
    provider, processor, exporter = _provider(ratio, spans)
    turns_of = Turns(provider, spans)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    open_turns: collections.deque[tuple[float, Any]] = collections.deque()
    held: list[int] = []
    started = time.monotonic()
    cpu_started = time.process_time()
    turns = 0
    next_sample = started
    while True:
        now = time.monotonic()
        elapsed = now - started
        if elapsed >= seconds:
            break
        due = int(elapsed * rate) - turns
        for _ in range(min(due, 200)):
            open_turns.append((now + turn_seconds, turns_of.start()))
            turns += 1
        while open_turns and open_turns[0][0] <= now:
            open_turns.popleft()[1].end()
        if now >= next_sample:
            held.append(processor.held_spans)
            next_sample = now + 0.1
        if due <= 0:
            time.sleep(0.0005)
    cpu = time.process_time() - cpu_started
    wall = time.monotonic() - started
    for _, root in open_turns:
        root.end()
    provider.force_flush()
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    turns_of.close()
    provider.shutdown()
    steady_held = held[len(held) // 2 :] or [0]
    return {
        "turns": turns,
        "rate": turns / wall,
        "held_median": statistics.median(steady_held),
        "held_max": max(held or [0]),
        "rss_growth_mb": (rss_after - rss_before) / 1024,
        "cpu_per_turn_us": cpu / max(1, turns) * 1e6,
        "exported_spans": exporter.exported,
    }


def bytes_per_held_span(spans: str, turns: int = 300) -> dict[str, float]:
    """tracemalloc's count of what `turns` open turns' held children allocate, per held span; and of a call
    and of a stage alone (their own turns' roots held open, not counted)."""
    provider, processor, _ = _provider(0.01, spans)
    turns_of = Turns(provider, spans)
    for _ in range(150):  # warm: first-use allocations are not per span (and the percentile's window)
        turns_of.start().end()
    figures: dict[str, float] = {}
    for part in ("turn", "call", "stage"):
        roots: list[Any] = []
        if part != "turn" and spans != "sdk":
            from opentelemetry import context, trace

            roots = [turns_of._held_span.start_span(turns_of.tracer, "turn chat") for _ in range(turns)]
        held_before = processor.held_spans
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        if part == "turn":
            roots = [turns_of.start() for _ in range(turns)]
        elif spans != "sdk":
            for root in roots:
                token = context.attach(trace.set_span_in_context(root))
                turns_of.call() if part == "call" else turns_of.search()
                context.detach(token)
        after = tracemalloc.take_snapshot()
        held = processor.held_spans - held_before
        grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        tracemalloc.stop()
        for root in roots:
            root.end()
        if held:
            figures[part] = grown / held
    turns_of.close()
    provider.shutdown()
    # A turn's open roots themselves are the app's (it holds them), not tail sampling's: left in, as an
    # upper bound.
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="turns started per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the steady load runs")
    parser.add_argument(
        "--turn-seconds", type=float, default=1.0, help="how long each turn's root stays open"
    )
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--spans", choices=("held", "held-sdk", "sdk"), default="held")
    args = parser.parse_args(argv)
    parts = bytes_per_held_span(args.spans)
    per_span = parts["turn"]
    figures = steady(args.rate, args.seconds, args.turn_seconds, args.ratio, args.spans)
    print(f"spans: {args.spans}")
    print(
        f"target {args.rate:,.0f} turns/s of 10 spans, each open {args.turn_seconds} s, for {args.seconds} s"
    )
    print(
        f"reached {figures['rate']:,.0f} turns/s ({figures['turns']:,} turns), CPU {figures['cpu_per_turn_us']:.0f} µs/turn"
    )
    print(
        f"spans held: median {figures['held_median']:,.0f} (second half of the run), max {figures['held_max']:,.0f}"
    )
    print(f"bytes per held span (tracemalloc, root included): {per_span:,.0f}")
    if "call" in parts:
        print(
            f"  a held call span alone: {parts['call']:,.0f} bytes; a held stage span alone: {parts['stage']:,.0f}"
        )
    print(
        f"held memory: about {per_span * figures['held_median'] / 2**20:,.1f} MB at the median, "
        f"{per_span * figures['held_max'] / 2**20:,.1f} MB at the max; RSS grew {figures['rss_growth_mb']:,.1f} MB"
    )
    print(f"exported spans (kept traces): {figures['exported_spans']:,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
