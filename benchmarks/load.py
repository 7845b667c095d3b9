"""Is the load generator cheap enough to keep its schedule? Its lag at 200 requests/s, against a zero-delay server.

`llmspans load`'s open loop counts each request's latency from when it was due, so a generator that falls
behind inflates every figure; DESIGN §5 asks that its schedule lag p99 stay under 5 ms at 200 requests/s
against a server that answers at once. This runs the open loop exactly as the command does (one event
loop, the instrumented `openai.AsyncOpenAI`, the call spans exported in batches as `configure()` would,
here to a sink) against llmspans' simulator (4 streamed chunks, no delay) in a child process, so the server
takes none of this process's time, and prints the lag's percentiles with the target, and whether the run
kept the rate.

    python benchmarks/load.py               # 200 requests/s for 10 s (2,000 requests)
    python benchmarks/load.py --quick       # 2 s: checks that it runs (CI)
    python benchmarks/load.py --rate 400 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from llmspans import _telemetry
from llmspans.load._model import SHAPE_RATE, Level
from llmspans.load._runner import Runner
from llmspans.load._stats import BEHIND_SCHEDULE_S
from llmspans.load._workload import Plan, Workload

ROOT = Path(__file__).resolve().parents[1]
TARGET_P99_S = BEHIND_SCHEDULE_S


class _Sink(SpanExporter):
    def export(self, spans: Sequence[object]) -> SpanExportResult:  # type: ignore[override]
        return SpanExportResult.SUCCESS


def _server() -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "llmspans.tools.simulator", "--chunks", "4"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second (200)")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of arrivals (10)")
    parser.add_argument("--quick", action="store_true", help="2 s of arrivals: checks that it runs (CI)")
    args = parser.parse_args(argv)
    seconds = 2.0 if args.quick else args.seconds
    count = int(args.rate * seconds)
    process, base_url = _server()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(_Sink()))
    meter_provider = MeterProvider()
    try:
        with _telemetry.use_providers(tracer_provider, meter_provider):
            workload = Workload(model="sim-model", max_tokens=4, prompt_tokens=16)
            level = Level(SHAPE_RATE, args.rate)
            plan = Plan(shape=SHAPE_RATE, levels=(level,), requests_per_level=count, max_seconds=seconds + 60)
            runner = Runner(workload, plan, base_url=base_url, tracer_provider=tracer_provider, max_retries=0)
            started = time.perf_counter()
            outcome = asyncio.run(runner.run())
            elapsed = time.perf_counter() - started
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()
        process.terminate()
        process.wait(10)
    (stats,) = outcome.levels
    lag = stats.lag
    assert lag is not None
    records = outcome.records[level.label]
    issued = sorted(record.issued_ns for record in records if record.issued_ns)
    sent_rate = (len(issued) - 1) / ((issued[-1] - issued[0]) / 1e9) if len(issued) > 1 else 0.0
    print(
        f"llmspans load's open loop at {args.rate:g} requests/s for {seconds:g} s against a zero-delay server"
    )
    print(
        f"  requests: {stats.requests} issued, {stats.completed} completed, {stats.failed} failed ({elapsed:.1f} s)"
    )
    print(
        f"  sent at {sent_rate:.1f} requests/s (asked {args.rate:g}); completed {stats.requests_per_s:.1f}/s"
    )
    print(
        f"  schedule lag: p50 {lag.p50 * 1e3:.2f} ms, p95 {lag.p95 * 1e3:.2f} ms, p99 {lag.p99 * 1e3:.2f} ms, "
        f"max {lag.max * 1e3:.2f} ms (target: p99 under {TARGET_P99_S * 1e3:.0f} ms)"
    )
    kept = lag.p99 <= TARGET_P99_S and sent_rate >= 0.95 * args.rate
    if kept:
        print("  the generator kept its schedule")
    else:
        print(
            "  the generator could NOT keep the rate on this machine: its lag is in every latency it reports "
            "(run fewer requests/s per process, or several processes)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
