"""`llmspans report` on tail-sampled traces: counts and quantiles weighted by `llmspans.sample.weight`.

The end-to-end test records one seeded workload over real HTTP twice in the same run (whole, and
through tail sampling at 5 %) and holds the sampled file's report to the whole file's within a stated
statistical tolerance (`_count_tolerance`, `_rank_tolerance`).
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

import llmspans
from llmspans import _exporters, _telemetry
from llmspans import _names as names
from llmspans.report._analysis import analyse
from llmspans.report._spans import spans_of_readable
from llmspans.report._traces import Trace
from llmspans.tools.simulator import Behavior, SimulatedServer

RATIO = 0.05
SEED = 31
TURNS = 3000
QUANTILES = {"p50": 0.5, "p95": 0.95}


# --- the arithmetic -----------------------------------------------------------------------------------


def _turns(provider: TracerProvider, durations_and_weights: list[tuple[float, float | None]]) -> None:
    tracer = provider.get_tracer("test")
    start = 1_000_000_000_000
    for duration, weight in durations_and_weights:
        attributes: dict[str, Any] = {names.STAGE: names.STAGE_TURN}
        if weight is not None:
            attributes[names.SAMPLE_WEIGHT] = weight
        span = tracer.start_span("turn chat", start_time=start, attributes=attributes)
        span.end(end_time=start + round(duration * 1e9))
        start += 10_000_000_000


def test_counts_and_quantiles_count_each_trace_as_many_times_as_its_weight() -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _turns(provider, [(1.0, 1.0)] * 10 + [(2.0, 30.0)])
    weighted = analyse(spans_of_readable(exporter.get_finished_spans()))
    exporter.clear()
    _turns(provider, [(1.0, None)] * 10 + [(2.0, None)])
    plain = analyse(spans_of_readable(exporter.get_finished_spans()))

    (turn,) = weighted.stages
    assert (turn.durations.count, turn.durations.p50, turn.durations.p95) == (40, 2.0, 2.0)
    assert (weighted.traces, weighted.traces_read) == (40, 11)
    assert weighted.notes[0].startswith(f"weighted by {names.SAMPLE_WEIGHT} (tail sampling): the 11 traces")
    assert weighted.to_dict()["traces_read"] == 11
    from llmspans.report._html import render

    assert f"weighted by {names.SAMPLE_WEIGHT} (tail sampling)" in render(weighted)
    assert [slow.duration_s for slow in weighted.slowest].count(2.0) == 1  # listed once, however weighted
    (turn,) = plain.stages
    assert (turn.durations.count, turn.durations.p50, turn.durations.p95) == (11, 1.0, 2.0)
    assert (plain.traces_read, plain.notes) == (None, ())
    assert "traces_read" not in plain.to_dict()


def test_a_fractional_weight_is_counted_as_often_as_it_says_on_average() -> None:
    rng = random.Random(SEED)

    def trace(weight: float) -> Trace:
        trace_id = f"{rng.getrandbits(128):032x}"
        from llmspans.report._spans import Span

        span = Span(
            trace_id, "1" * 16, None, "turn chat", 1, 0, 1, {names.SAMPLE_WEIGHT: weight}, (), False, "s", "s",
            names.STAGE_TURN, 1, (),
        )  # fmt: skip
        return Trace(0, trace_id, [span])

    copies = [trace(1 / 0.3).copies() for _ in range(3000)]
    assert set(copies) == {3, 4}
    mean, sd = 1 / 0.3, math.sqrt((1 / 3) * (2 / 3) / 3000)  # 3 + Bernoulli(1/3)
    assert abs(sum(copies) / len(copies) - mean) < 5 * sd


# --- a seeded workload recorded whole and tail-sampled in the same run --------------------------------


@dataclass(frozen=True)
class Plan:
    retrieval_s: float
    header_s: float
    gap_s: float


def _plans() -> list[Plan]:
    rng = random.Random(SEED)
    return [
        Plan(rng.lognormvariate(math.log(0.002), 0.6), rng.lognormvariate(math.log(0.004), 0.8),
             rng.lognormvariate(math.log(0.0005), 0.5))
        for _ in range(TURNS)
    ]  # fmt: skip


@dataclass
class Recorded:
    whole: Path
    sampled: Path
    bucket_values: dict[str, list[float]]  # the whole run's, sorted
    stage_values: dict[str, list[float]]


def _record(tmp: Path) -> Recorded:
    whole_path, sampled_path = tmp / "whole.jsonl", tmp / "sampled.jsonl"
    whole_exporter, _ = _exporters.file_exporters(whole_path)
    sampled_exporter, _ = _exporters.file_exporters(sampled_path)
    provider = TracerProvider(sampler=ALWAYS_ON)
    whole_processor = BatchSpanProcessor(whole_exporter, max_queue_size=200_000)
    provider.add_span_processor(whole_processor)
    sampled = llmspans.TailSamplingProcessor(
        BatchSpanProcessor(sampled_exporter, max_queue_size=200_000), ratio=RATIO, slower_than="p95"
    )
    provider.add_span_processor(sampled)
    meter_provider = MeterProvider()

    @llmspans.retrieval
    def search(delay: float) -> str:
        time.sleep(delay)
        return "doc"

    @llmspans.stage("prompt")
    def build() -> str:
        return "prompt"

    with SimulatedServer(Behavior(chunks=3), record=False) as server:
        client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))

        def turn(plan: Plan) -> None:
            with llmspans.turn("chat"):
                search(plan.retrieval_s)
                build()
                stream = client.chat.completions.create(
                    model="sim-model", messages=[{"role": "user", "content": "q"}], stream=True,
                    extra_body={"x_sim": {"header_delay": plan.header_s, "chunk_gap": plan.gap_s}},
                )  # fmt: skip
                for _ in stream:
                    pass

        with _telemetry.use_providers(provider, meter_provider), ThreadPoolExecutor(12) as pool:
            list(pool.map(turn, _plans()))
    provider.force_flush()
    provider.shutdown()
    meter_provider.shutdown()
    return Recorded(whole_path, sampled_path, *_whole_values(whole_path))


def _whole_values(path: Path) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    buckets: dict[str, list[float]] = {bucket: [] for bucket in names.BUCKETS}
    stages: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        for resource in json.loads(line).get("resourceSpans", []):
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    attributes = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
                    stage = attributes.get(names.STAGE)
                    if stage is None:
                        continue
                    duration = (int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])) / 1e9
                    stages.setdefault(stage, []).append(duration)
                    if stage == names.STAGE_LLM:
                        for bucket in names.BUCKETS:
                            buckets[bucket].append(float(attributes[f"llmspans.bucket.{bucket}"]))
    return {k: sorted(v) for k, v in buckets.items()}, {k: sorted(v) for k, v in stages.items()}


def _report(*arguments: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "llmspans", "report", "--json", *arguments],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _count_tolerance(by_chance: int) -> float:
    """4 standard deviations of an estimated count: `by_chance` traces kept with probability RATIO, each
    standing for 1/RATIO (a Horvitz-Thompson estimate: variance n(1-r)/r, n estimated by by_chance/r)."""
    return 4 * math.sqrt(by_chance / RATIO * (1 - RATIO) / RATIO)


def _rank_tolerance(q: float, effective: int) -> float:
    """4 standard deviations of the rank of a q-quantile read from `effective` independent draws."""
    return 4 * math.sqrt(q * (1 - q) / effective)


def _rank_interval(ordered: list[float], value: float) -> tuple[float, float]:
    """The share of the whole run's values below `value`, and at or below it."""
    import bisect

    return bisect.bisect_left(ordered, value) / len(ordered), bisect.bisect_right(ordered, value) / len(
        ordered
    )


@dataclass(frozen=True)
class _Runs:
    recorded: Recorded
    whole: dict[str, Any]
    sampled: dict[str, Any]


_cache: list[_Runs] = []


def _runs(tmp: Path) -> _Runs:
    if not _cache:
        recorded = _record(tmp)
        _cache.append(_Runs(recorded, _report(str(recorded.whole)), _report(str(recorded.sampled))))
    return _cache[0]


def _by_chance(sampled_path: Path) -> int:
    traces = set()
    for line in sampled_path.read_text().splitlines():
        for resource in json.loads(line).get("resourceSpans", []):
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    for attribute in span["attributes"]:
                        if attribute["key"] == names.SAMPLE_WEIGHT and attribute["value"]["doubleValue"] > 1:
                            traces.add(span["traceId"])
    return len(traces)


def test_a_file_sampled_at_5_percent_reports_what_the_whole_run_does(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    whole, sampled = runs.whole, runs.sampled
    by_chance = _by_chance(runs.recorded.sampled)
    assert whole["traces"] == TURNS
    assert sampled["traces_read"] < TURNS / 3  # it really was sampled...
    assert 0.5 * TURNS * RATIO < by_chance < 1.5 * TURNS * RATIO
    assert any(note.startswith(f"weighted by {names.SAMPLE_WEIGHT}") for note in sampled["notes"])
    assert abs(sampled["traces"] - TURNS) <= _count_tolerance(by_chance)

    whole_stages = {row["stage"]: row for row in whole["stages"]}
    for row in sampled["stages"]:
        expected = whole_stages[row["stage"]]["durations"]["count"]
        assert abs(row["durations"]["count"] - expected) <= _count_tolerance(by_chance), row["stage"]
    assert whole_stages.keys() == {row["stage"] for row in sampled["stages"]}

    # Each quantile read from the sample sits at the right rank of the whole run's values, within the
    # tolerance of `by_chance` draws (the traces kept by a rule are all there, which only narrows it).
    checked = []
    for row in sampled["buckets"]:
        ordered = runs.recorded.bucket_values[row["bucket"]]
        for label, q in QUANTILES.items():
            low, high = _rank_interval(ordered, row["values"][label])
            tolerance = _rank_tolerance(q, by_chance)
            assert low - tolerance <= q <= high + tolerance, (row["bucket"], label, low, high, q)
            checked.append((row["bucket"], label, round(low, 3), round(high, 3)))
    for row in sampled["stages"]:
        ordered = runs.recorded.stage_values[row["stage"]]
        for label, q in QUANTILES.items():
            low, high = _rank_interval(ordered, row["durations"][label])
            assert low - _rank_tolerance(q, by_chance) <= q <= high + _rank_tolerance(q, by_chance), row[
                "stage"
            ]
    print("rank of each weighted quantile in the whole run:", checked)


def test_the_baseline_compares_a_weighted_run_with_an_unweighted_one(tmp_path: Path) -> None:
    """The same run both ways, so every true change is 0. The comparison reads the weighted quantiles (an
    unweighted reading of the kept traces is biased towards the slow ones a rule kept), and its intervals
    are as wide as the traces read: each change lies within 4.5 of its standard errors (the interval's
    half-width over 1.96) of 0, where intervals built from every copy of a weighted trace would be several
    times too narrow."""
    runs = _runs(tmp_path)
    compared = _report(str(runs.recorded.sampled), "--baseline", str(runs.recorded.whole))["comparison"]
    changes = [c for c in compared["changes"] if c["verdict"] != "unchanged"]
    assert len(changes) >= 12
    sampled_stages = {row["stage"]: row["durations"] for row in runs.sampled["stages"]}
    for change in changes:
        standard_error = (change["high_s"] - change["low_s"]) / (2 * 1.96)
        assert abs(change["change_s"]) <= 4.5 * standard_error + 1e-9, change
        if change["kind"] == "stage":
            assert change["after_s"] == sampled_stages[change["name"]][change["quantile"]]
    # What the weights correct: the kept turns read as they are, each once, are much slower at p50.
    kept_turns = sorted(_turn_durations(runs.recorded.sampled))
    raw_p50 = kept_turns[math.ceil(0.5 * len(kept_turns)) - 1]
    whole_p50 = runs.whole["stages"][-1]["durations"]["p50"]
    assert runs.whole["stages"][-1]["stage"] == "turn"
    weighted_p50 = sampled_stages["turn"]["p50"]
    assert abs(raw_p50 - whole_p50) > 2 * abs(weighted_p50 - whole_p50), (raw_p50, weighted_p50, whole_p50)


def _turn_durations(path: Path) -> list[float]:
    durations = []
    for line in path.read_text().splitlines():
        for resource in json.loads(line).get("resourceSpans", []):
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    if span["name"] == "turn chat":
                        durations.append(
                            (int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])) / 1e9
                        )
    return durations
