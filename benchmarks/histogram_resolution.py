"""What resolution llmspans' own duration histograms need, and what it costs (issue 37).

Three ways to keep `llmspans.bucket.duration` and `llmspans.stage.duration`, measured on issue 37's scenario
(a whole recording of tests/support/sampled_scenario.py, made here unless `--from WHOLE` names one):

- conventions: the GenAI conventions' boundaries, 0.01 s doubling to 81.92 s (14; main before issue 37);
- fine: `llmspans._metrics.LATENCY_BOUNDARIES`, a quarter of a doubling apart, 0.16 ms to 81.92 s (77);
- exponential: OpenTelemetry's base-2 exponential histogram at its default 160 buckets (the scale the
  scenario's values allow), which Prometheus reads as a native histogram.

Figures:
1. quantile error: each part's p50/p95/p99 read from the histogram (the nearest rank's bucket, placed in it
   by its position, as the report does) against the exact nearest-rank figure, and the width of the bucket
   it is only known to lie in (high over low);
2. memory per series (tracemalloc): llmspans' own aggregation's series for both explicit boundary sets, with
   no exemplar and with one in every bucket; the SDK's exponential aggregation with the scenario's values;
3. cost per call of llmspans' aggregation with the scenario's values (eight values a call: the conventions'
   operation duration, the llm stage and the six buckets), sampled and unsampled, conventions against fine:
   callgrind instructions (`--instructions`, as benchmarks/floor.py counts them) or CPU time; and the cost of
   one collection's OTLP protobuf encoding per series;
4. Prometheus: the text a scrape of `opentelemetry-exporter-prometheus` serves per series, and its lines.

    python benchmarks/histogram_resolution.py                    # records the scenario (~10 s), CPU time
    python benchmarks/histogram_resolution.py --instructions     # cost in instructions under callgrind
    python benchmarks/histogram_resolution.py --from /tmp/run/whole.jsonl --json out.json
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from llmspans import _metrics  # noqa: E402
from llmspans import _names as names  # noqa: E402
from llmspans.report._estimates import Histogram, histogram_distribution  # noqa: E402
from llmspans.report._model import quantile  # noqa: E402

CONVENTIONS = names.DURATION_BOUNDARIES
FINE = _metrics.LATENCY_BOUNDARIES
EXPONENTIAL_SIZE = 160
PARTS = ("retrieval", "llm", "turn", "first_token", "post")
QUANTILES = ((0.5, "p50"), (0.95, "p95"), (0.99, "p99"))
CALLS = 1280  # per measured block: ten of the aggregation's batches


# --- the scenario's values -----------------------------------------------------------------------------


def scenario_values(whole: Path) -> dict[str, list[float]]:
    """Per part: every stage span's duration, every call's bucket, in seconds (the values the metrics saw)."""
    from llmspans.report._spans import spans_of_json

    found: dict[str, list[float]] = {part: [] for part in PARTS}
    found.update({bucket: [] for bucket in names.BUCKETS})
    for line in whole.read_bytes().splitlines():
        for span in spans_of_json(line) or []:
            if span.stage in found:
                found[span.stage].append(span.duration_ns / 1e9)
            if span.stage == names.STAGE_LLM:
                for bucket, value in zip(names.BUCKETS, span.buckets_ns, strict=True):
                    found[bucket].append(value / 1e9)
    return found


def record_scenario(folder: Path, seed: int) -> Path:
    subprocess.run(
        [sys.executable, "-m", "tests.support.sampled_scenario", str(folder), "--seed", str(seed)],
        cwd=ROOT, check=True, capture_output=True, timeout=900,
    )  # fmt: skip
    return folder / "whole.jsonl"


# --- 1. quantile error ---------------------------------------------------------------------------------


def explicit(values: Sequence[float], bounds: tuple[float, ...]) -> Histogram:
    counts = [0] * (len(bounds) + 1)
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1
    return Histogram(bounds, tuple(counts), sum(values), min(values), max(values))


def exponential_scale(values: Sequence[float], size: int = EXPONENTIAL_SIZE) -> int:
    """The largest scale (at most 20) at which the positive values' buckets fit in `size`, as the SDK
    settles on after downscaling."""
    positive = [value for value in values if value > 0]
    if not positive:
        return 20
    low, high = min(positive), max(positive)
    for scale in range(20, -11, -1):
        if _exponential_index(high, scale) - _exponential_index(low, scale) + 1 <= size:
            return scale
    return -10


def _exponential_index(value: float, scale: int) -> int:
    """The bucket (base^i, base^(i+1)] of base 2^(2^-scale) that holds `value` (> 0)."""
    return math.ceil(math.log2(value) * 2**scale) - 1


def exponential_interval(values: Sequence[float], q: float, scale: int) -> tuple[float, float, float]:
    """The nearest-rank value's bucket (low, high) and a figure placed in it, for the exponential histogram."""
    ordered = sorted(values)
    exact = quantile(ordered, q)
    if exact <= 0:
        return 0.0, 0.0, 0.0  # the zero bucket
    index = _exponential_index(exact, scale)
    base = 2 ** (2**-scale)
    low, high = max(base**index, ordered[0]), min(base ** (index + 1), ordered[-1])
    inside = [value for value in ordered if low < value <= high] or [exact]
    position = (inside.index(exact) + 0.5) / len(inside) if exact in inside else 0.5
    return low, high, low + (high - low) * position


def quantile_errors(values: dict[str, list[float]]) -> list[dict[str, Any]]:
    rows = []
    for part in PARTS:
        found = values[part]
        if not found:
            continue
        ordered = sorted(found)
        scale = exponential_scale(found)
        for q, name in QUANTILES:
            exact = quantile(ordered, q)
            row: dict[str, Any] = {
                "part": part,
                "quantile": name,
                "exact_s": exact,
                "exponential_scale": scale,
            }
            for scheme, bounds in (("conventions", CONVENTIONS), ("fine", FINE)):
                distribution = histogram_distribution(explicit(found, bounds))
                interval = distribution.interval(name)
                assert interval is not None
                row[scheme] = _error(exact, distribution.at(q), interval.low, interval.high)
            low, high, figure = exponential_interval(found, q, scale)
            row["exponential"] = _error(exact, figure, low, high)
            rows.append(row)
    return rows


def _error(exact: float, figure: float, low: float, high: float) -> dict[str, float]:
    return {
        "figure_s": figure,
        "error": abs(figure - exact) / exact if exact > 0 else 0.0,
        "width": high / low if low > 0 else math.inf,
    }


# --- 2. memory per series -------------------------------------------------------------------------------


def _spec(bounds: tuple[float, ...]) -> _metrics.InstrumentSpec:
    base = _metrics.BUCKET_DURATION
    return _metrics.InstrumentSpec(base.index, base.name, base.unit, base.description, base.kind, bounds)


def memory_per_series(values: list[float], series: int = 500) -> dict[str, float]:
    from opentelemetry import trace

    from llmspans._aggregation import Aggregation

    found = {}
    span = trace.NonRecordingSpan(trace.SpanContext(1, 1, False, trace.TraceFlags(1)))
    for scheme, bounds in (("conventions", CONVENTIONS), ("fine", FINE)):
        spec = _spec(bounds)
        for exemplars in (False, True):
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            aggregation = Aggregation()
            for index in range(series):
                labels = _metrics.Labels({"series": index})
                sample = aggregation.sample(span, 1) if exemplars else None
                # with exemplars: one value in every bucket (the worst case); without: the scenario's values
                spread = [*bounds, bounds[-1] * 2] if exemplars else values[:200]
                aggregation.add([(spec, value, labels) for value in spread], sample)
            after = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            found[f"{scheme}{', every bucket an exemplar' if exemplars else ''}"] = (after - before) / series
            del aggregation
    found["exponential (SDK, 160 buckets)"] = _exponential_memory(values, series)
    return found


def _exponential_memory(values: list[float], series: int) -> float:
    from opentelemetry.context import Context
    from opentelemetry.sdk.metrics._internal.aggregation import (
        AggregationTemporality,
        _ExponentialBucketHistogramAggregation,
    )
    from opentelemetry.sdk.metrics._internal.exemplar import SimpleFixedSizeExemplarReservoir
    from opentelemetry.sdk.metrics._internal.measurement import Measurement

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = []
    for _ in range(series):
        aggregation = _ExponentialBucketHistogramAggregation(
            {}, lambda **_: SimpleFixedSizeExemplarReservoir(), AggregationTemporality.CUMULATIVE, 0
        )
        for value in values[:200]:
            aggregation.aggregate(Measurement(value, 0, None, Context(), {}))  # type: ignore[arg-type]
        kept.append(aggregation)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / series


# --- 3. cost per call -------------------------------------------------------------------------------------


def _call_metrics(bounds: tuple[float, ...]) -> _metrics.CallMetrics:
    """A non-streamed call's eight histogram values: operation duration (the conventions' always), the llm
    stage and the six buckets (`bounds`)."""
    common = _metrics.Labels({"gen_ai.request.model": "m"})
    stage = _metrics.Labels({names.STAGE: names.STAGE_LLM})
    members = [(_metrics.OPERATION_DURATION, common), (_stage_spec(bounds), stage)]
    members += [(_spec(bounds), _metrics.Labels({names.METRIC_ATTR_BUCKET: b})) for b in names.BUCKETS]
    return _metrics.CallMetrics(members)


def _stage_spec(bounds: tuple[float, ...]) -> _metrics.InstrumentSpec:
    base = _metrics.STAGE_DURATION
    return _metrics.InstrumentSpec(base.index, base.name, base.unit, base.description, base.kind, bounds)


def _rows(values: dict[str, list[float]], calls: int) -> list[tuple[float, ...]]:
    rng = random.Random(37)
    total = values["llm"]
    return [
        (
            total[i % len(total)],
            total[i % len(total)],
            *(values[b][i % len(values[b])] for b in names.BUCKETS),
        )
        for i in (rng.randrange(len(total)) for _ in range(calls))
    ]


def cost_figures(values: dict[str, list[float]], meter: Any, repeats: int) -> dict[str, float]:
    from opentelemetry import trace
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    from llmspans._aggregation import Aggregation

    rows = _rows(values, CALLS)
    span = trace.NonRecordingSpan(trace.SpanContext(1, 1, False, trace.TraceFlags(1)))
    figures: dict[str, float] = {}
    for scheme, bounds in (("conventions", CONVENTIONS), ("fine", FINE)):
        metrics = _call_metrics(bounds)
        for sampled in (False, True):
            aggregation = Aggregation()
            sample = aggregation.sample(span, 1) if sampled else None

            def calls(
                aggregation: Aggregation = aggregation, metrics: Any = metrics, sample: Any = sample
            ) -> None:
                for row in rows:
                    aggregation.add_call(metrics, row, sample)

            calls()  # series resolved, first batches drained: what a long-running app pays from then on
            measured = [meter.measure(calls) for _ in range(repeats)]
            figures[f"{scheme}, {'sampled' if sampled else 'unsampled'}"] = (
                statistics.median(measured) / CALLS
            )
            if sampled:
                figures[f"{scheme}, one collection encoded, per series"] = _encoding(
                    meter, aggregation, len(metrics.members), AggregationTemporality.CUMULATIVE
                )
    return figures


def _encoding(meter: Any, aggregation: Any, series: int, temporality: Any) -> float:
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    def collect_and_encode() -> None:
        metrics = aggregation.collect(lambda spec: temporality)
        data = MetricsData(
            [ResourceMetrics(Resource({}), [ScopeMetrics(InstrumentationScope("x"), metrics, "")], "")]
        )
        encode_metrics(data).SerializeToString()

    return meter.measure(collect_and_encode) / series


class CpuTime:
    unit = "µs of CPU"

    def measure(self, fn: Callable[[], Any]) -> float:
        gc.collect()
        started = time.process_time()
        fn()
        return (time.process_time() - started) * 1e6


# --- 4. Prometheus' scrape ----------------------------------------------------------------------------------


def prometheus_scrape(values: list[float]) -> dict[str, dict[str, float]]:
    """What opentelemetry-exporter-prometheus serves per series: bytes of text and lines, and the CPU of
    one generation for 100 series."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import REGISTRY, generate_latest

    found = {}
    for scheme, bounds in (("conventions", CONVENTIONS), ("fine", FINE)):
        reader = PrometheusMetricReader()
        provider = MeterProvider(metric_readers=[reader])
        histogram = provider.get_meter("x").create_histogram(
            "llmspans.bucket.duration", unit="s", explicit_bucket_boundaries_advisory=bounds
        )
        for index in range(100):
            for value in values[:50]:
                histogram.record(value, {"series": index})
        started = time.process_time()
        text = generate_latest(REGISTRY)
        cpu = time.process_time() - started
        lines = [line for line in text.decode().splitlines() if line.startswith("llmspans_bucket_duration")]
        found[scheme] = {"bytes_per_series": len(text) / 100, "lines_per_series": len(lines) / 100,
                         "generation_ms_per_100_series": cpu * 1e3}  # fmt: skip
        provider.shutdown()  # unregisters the reader's collector
    return found


# --- the run --------------------------------------------------------------------------------------------


def _cost_under_callgrind(whole: Path, repeats: int) -> dict[str, float]:
    from floor import Instructions, _build_shim

    with tempfile.TemporaryDirectory(prefix="llmspans-resolution-") as tmp:
        shim = _build_shim(Path(tmp))
        out_file = str(Path(tmp) / "cost.callgrind")
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}",
                   sys.executable, __file__, "--from", str(whole), "--cost-only", "--shim", str(shim),
                   "--out-file", out_file, "--repeats", str(repeats)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        del Instructions
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--from", dest="whole", type=Path, help="a whole recording of the scenario")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--instructions", action="store_true", help="cost in callgrind instructions")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--cost-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shim", help=argparse.SUPPRESS)
    parser.add_argument("--out-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmspans-resolution-") as tmp:
        whole = args.whole or record_scenario(Path(tmp), args.seed)
        values = scenario_values(whole)
        if args.cost_only:
            from floor import Instructions

            meter = Instructions(args.shim, args.out_file)
            print(json.dumps(cost_figures(values, meter, args.repeats)))
            return 0
        if args.instructions:
            if shutil.which("valgrind") is None or not os.path.exists("/usr/include/valgrind/callgrind.h"):
                print("--instructions needs valgrind and its headers", file=sys.stderr)
                return 2
            cost, unit = _cost_under_callgrind(whole, args.repeats), "instructions"
        else:
            cost, unit = cost_figures(values, CpuTime(), args.repeats), CpuTime.unit
        errors = quantile_errors(values)
        memory = memory_per_series(values["first_token"])
        scrape = prometheus_scrape(values["first_token"])
    _print(errors, memory, cost, unit, scrape)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"quantile_errors": errors, "memory_bytes_per_series": memory, "cost_per_call": cost, "cost_unit": unit,
             "prometheus": scrape}, indent=1))  # fmt: skip
    return 0


def _print(
    errors: list[dict[str, Any]], memory: dict[str, float], cost: dict[str, float], unit: str,
    scrape: dict[str, dict[str, float]],
) -> None:  # fmt: skip
    print("1. Quantiles read from each histogram against the exact nearest-rank figure: error, and the width")
    print("   (high/low) of the bucket the quantile is only known to lie in\n")
    print(f"{'part':<12} {'q':<4} {'exact':>9} | {'conventions':>22} | {'fine':>22} | {'exponential':>22}")
    for row in errors:
        cells = [f"{row[s]['error']:>6.1%} in x{row[s]['width']:<6.2f} {row[s]['figure_s'] * 1e3:>6.1f}ms"
                 for s in ("conventions", "fine", "exponential")]  # fmt: skip
        print(f"{row['part']:<12} {row['quantile']:<4} {row['exact_s'] * 1e3:>7.2f}ms | " + " | ".join(cells))
    scales = sorted({row["exponential_scale"] for row in errors})
    print(
        f"   (exponential: scale {', '.join(map(str, scales))} at {EXPONENTIAL_SIZE} buckets for these values)"
    )
    worst = {s: max(row[s]["error"] for row in errors) for s in ("conventions", "fine", "exponential")}
    print("   worst error: " + ", ".join(f"{s} {e:.1%}" for s, e in worst.items()) + "\n")
    print("2. Memory per series (bytes)")
    for name, value in memory.items():
        print(f"   {name:<45} {value:>8,.0f}")
    print(f"\n3. llmspans' aggregation per call (eight histogram values), {unit}")
    for name, value in cost.items():
        shown = f"{value / 1000:,.2f}k" if unit == "instructions" else f"{value:.2f}"
        print(f"   {name:<45} {shown:>10}")
    print("\n4. opentelemetry-exporter-prometheus' scrape, per series")
    for scheme, figures in scrape.items():
        print(f"   {scheme:<12} {figures['bytes_per_series']:>8,.0f} bytes, {figures['lines_per_series']:.0f} lines; "
              f"{figures['generation_ms_per_100_series']:.1f} ms of CPU to serve 100 series")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
