"""`llmspans load` against the vLLM simulator: the knee found where the server's limits put it and named
for what grew there, the open loop's latency growing under overload where the closed loop's does not,
and its figures computed the way `vllm bench serve` defines them.

Each scenario's costs are tens of milliseconds per request (prefill and decode), so the effect the test
looks for (a request waiting a whole service time for a slot) is several times the scheduling noise of a
busy 2-core machine; every run is bounded to a few dozen requests and a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import llmspans
from llmspans import _names as names
from llmspans import _telemetry
from llmspans.load._cli import build_result
from llmspans.load._html import render as render_html
from llmspans.load._model import SHAPE_CONCURRENCY, SHAPE_RATE, Level, LevelStats, Result
from llmspans.load._requests import RequestRecord
from llmspans.load._runner import Runner, RunOutcome
from llmspans.load._text import render as render_text
from llmspans.load._workers import WorkerExport, deal_closed, deal_open
from llmspans.load._workload import Plan, Workload, parse_levels
from llmspans.report._analysis import analyse
from llmspans.report._model import FINDING_QUEUE
from llmspans.report._spans import Span, spans_of_readable
from llmspans.report._triage import FINDING_MEMORY_BOUND, FINDING_SERVER_QUEUE
from llmspans.tools.simulator import Behavior, SimulatedServer
from llmspans.vllm import ServerMetrics
from tests.support.realservers import TransformersServer
from tests.support.vllm_sim import EngineConfig, VLLMSimulator
from tests.timing import CLIENT_SIDE, retry_timing


@dataclass
class Ran:
    outcome: RunOutcome
    result: Result
    spans: list[ReadableSpan]


@contextmanager
def providers() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider()
    try:
        with _telemetry.use_providers(tracer_provider, meter_provider):
            yield tracer_provider, exporter
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()


async def run_load(
    sim: VLLMSimulator,
    levels: str,
    *,
    shape: str = SHAPE_CONCURRENCY,
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    limiter: llmspans.Limiter | None = None,
    sample_server: bool = True,
    slo: dict[str, float] | None = None,
) -> Ran:
    workload = Workload(model=sim.config.model, max_tokens=max_tokens, prompt_tokens=prompt_tokens)
    plan = Plan(
        shape=shape, levels=parse_levels(levels, shape), requests_per_level=requests, max_seconds=60,
        slo=slo or {},
    )  # fmt: skip
    server = ServerMetrics(sim.base_url, interval=0.1) if sample_server else None
    try:
        with providers() as (tracer_provider, exporter):
            runner = Runner(
                workload, plan, base_url=sim.base_url, tracer_provider=tracer_provider, limiter=limiter,
                provider="vllm" if server else None, server_metrics=server, max_retries=0,
            )  # fmt: skip
            outcome = await runner.run()
            spans = list(exporter.get_finished_spans())
    finally:
        if server is not None:
            server.close()
    result = build_result(
        outcome.levels, workload=workload, plan=plan, target=sim.base_url, run_id=runner.run_id,
        interrupted=outcome.interrupted, notes=outcome.notes,
    )  # fmt: skip
    assert all(stats.completed == stats.requests for stats in outcome.levels), render_text(result)
    return Ran(outcome, result, spans)


@pytest.fixture
async def batch_slots() -> AsyncIterator[VLLMSimulator]:
    """Four batch slots; a request costs 150 ms of prefill (100 words) and 8 decode steps of 15 ms."""
    config = EngineConfig(
        max_num_seqs=4, prefill_per_token=0.0015, decode_per_token=0.015, num_kv_blocks=4096
    )
    with VLLMSimulator(config) as sim:
        yield sim


@retry_timing
async def test_a_server_out_of_batch_slots_puts_the_knee_between_4_and_8_and_names_its_queue(
    batch_slots: VLLMSimulator,
) -> None:
    ran = await run_load(batch_slots, "2,4,8", requests=12, prompt_tokens=100, max_tokens=8)
    result = ran.result
    text = render_text(result)
    assert result.knee is not None, text
    assert (result.knee.before.label, result.knee.at.label) == ("concurrency=4", "concurrency=8"), text
    assert result.verdict is not None
    assert result.verdict.grew == "first_token", text
    assert result.verdict.finding == FINDING_SERVER_QUEUE, text
    # The queue is on the server: vLLM's waiting requests rose while its running ones stayed at the cap.
    by_level = {stats.level.label: stats for stats in result.levels}
    before, at = by_level["concurrency=4"].server, by_level["concurrency=8"].server
    assert before is not None
    assert at is not None
    assert at.waiting_mean >= before.waiting_mean + 1
    assert at.running_max == 4
    assert "the queue is on the server" in result.summary
    # A request at the knee waits about one whole service time (150 ms prefill + 8 x 15 ms) for a slot.
    low = by_level["concurrency=4"].buckets_p95["first_token"]
    assert by_level["concurrency=8"].buckets_p95["first_token"] >= low + 0.2
    assert "concurrency=8 *" in text
    assert "the queue is on the server" in " ".join(text.split())

    # Every call span carries its level and the run, and nothing else was made but call spans.
    calls = [span for span in ran.spans if (span.attributes or {}).get(names.STAGE) == names.STAGE_LLM]
    assert len(calls) == 36
    assert {span.attributes[names.LOAD_RUN_ID] for span in calls} == {result.run_id}  # type: ignore[index]
    levels = [span.attributes[names.LOAD_LEVEL] for span in calls]  # type: ignore[index]
    assert {level: levels.count(level) for level in set(levels)} == {
        "concurrency=2": 12, "concurrency=4": 12, "concurrency=8": 12,
    }  # fmt: skip

    # The HTML page: one self-contained document with the three charts and the knee marked.
    page = render_html(result)
    assert "<script" not in page
    assert "http://" not in page.replace(batch_slots.base_url, "")
    assert page.count('class="knee-line" data-knee="concurrency=8"') == 3
    assert 'data-finding="server_queue"' in page
    assert page.count('class="segment" data-level="concurrency=8"') == len(names.BUCKETS)


@retry_timing
async def test_kv_blocks_as_the_limit_are_named_kv_pressure_with_preemptions() -> None:
    """Ten KV blocks of 16 tokens: a request needs 3 when admitted (40 words) and 4 by its end (+24
    tokens), so two run side by side forever, while three get admitted and then preempt one another."""
    config = EngineConfig(
        max_num_seqs=16, prefill_per_token=0.001, decode_per_token=0.008, block_size=16, num_kv_blocks=10
    )
    with VLLMSimulator(config) as sim:
        ran = await run_load(sim, "1,2,4", requests=12, prompt_tokens=40, max_tokens=24)
        preempted = sum(request.preemptions for request in sim.requests)
    result = ran.result
    text = render_text(result)
    assert preempted > 0
    assert result.knee is not None, text
    assert (result.knee.before.label, result.knee.at.label) == ("concurrency=2", "concurrency=4"), text
    assert result.verdict is not None
    assert result.verdict.grew in ("first_token", "stream"), text
    assert result.verdict.finding == FINDING_MEMORY_BOUND, text
    assert "out of KV cache" in result.verdict.message
    at = {stats.level.label: stats for stats in result.levels}["concurrency=4"].server
    assert at is not None
    assert at.kv_cache_usage_max is not None
    assert at.kv_cache_usage_max >= 0.9
    assert at.preemption_rate_mean is not None
    assert at.preemption_rate_mean > 0


@retry_timing
async def test_a_client_limiter_puts_the_knee_at_its_cap_and_names_the_client_queue() -> None:
    """The server has room for 16; the app's own Limiter(cap=2) queues the calls past two."""
    config = EngineConfig(
        max_num_seqs=16, prefill_per_token=0.0015, decode_per_token=0.015, num_kv_blocks=4096
    )
    with VLLMSimulator(config) as sim:
        ran = await run_load(
            sim, "1,2,4", requests=12, prompt_tokens=100, max_tokens=8, limiter=llmspans.Limiter(2, name="app"),
            sample_server=False,
        )  # fmt: skip
    result = ran.result
    text = render_text(result)
    assert result.knee is not None, text
    assert (result.knee.before.label, result.knee.at.label) == ("concurrency=2", "concurrency=4"), text
    assert result.verdict is not None
    assert (result.verdict.grew, result.verdict.finding) == ("queue", FINDING_QUEUE), text
    assert "limiter 'app', cap 2" in result.verdict.message
    at = {stats.level.label: stats for stats in result.levels}["concurrency=4"]
    assert at.buckets_p95["queue"] >= 0.2  # about one service time (270 ms) waiting for a slot


@pytest.fixture
async def two_slots() -> AsyncIterator[VLLMSimulator]:
    """Two batch slots of 150 ms (50 ms prefill, 5 decode steps of 20 ms): about 13 requests/s at most."""
    config = EngineConfig(max_num_seqs=2, prefill_per_token=0.001, decode_per_token=0.02, num_kv_blocks=4096)
    with VLLMSimulator(config) as sim:
        yield sim


def _thirds(records: list[RequestRecord]) -> tuple[float, float]:
    """The mean e2e of the first and the last third of the requests, in the order they were issued."""
    ordered = sorted((record for record in records if record.ok), key=lambda record: record.issued_ns)
    third = len(ordered) // 3
    first = [record.e2e_ns or 0 for record in ordered[:third]]
    last = [record.e2e_ns or 0 for record in ordered[-third:]]
    return sum(first) / len(first) / 1e9, sum(last) / len(last) / 1e9


async def test_past_capacity_the_open_loop_latency_grows_with_time_and_the_closed_loop_does_not(
    two_slots: VLLMSimulator,
) -> None:
    """Coordinated omission: at 30 requests/s against ~13/s of capacity, each arrival finds a longer queue
    than the one before, and latency counted from the schedule shows it. Six closed-loop users saturate
    the same server, yet each waits behind the same few, so their latency stays flat."""
    opened = await run_load(two_slots, "30", shape=SHAPE_RATE, requests=36, prompt_tokens=50, max_tokens=5)
    closed = await run_load(two_slots, "6", requests=36, prompt_tokens=50, max_tokens=5, sample_server=False)
    open_first, open_last = _thirds(opened.outcome.records["rate=30"])
    closed_first, closed_last = _thirds(closed.outcome.records["concurrency=6"])
    assert open_last > 2 * open_first, (open_first, open_last)
    assert closed_last < 1.5 * closed_first, (closed_first, closed_last)
    # Every open-loop request's lag behind its schedule is measured, and counted in its latency.
    lag = opened.result.levels[0].lag
    assert lag is not None
    assert lag.count == 36
    for record in opened.outcome.records["rate=30"]:
        assert record.scheduled_ns is not None
        assert record.e2e_ns is not None
        assert record.e2e_ns >= record.start_offset_ns == max(0, record.issued_ns - record.scheduled_ns)


# --- the figures, by vLLM's definitions -------------------------------------------------------------


def _percentile_linear(values: list[float], q: float) -> float:
    """numpy's default `np.percentile` (linear interpolation), which `vllm bench serve` reports."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered) - 1e-9))) - 1]


def _vllm_metrics(records: list[RequestRecord], slo: dict[str, float]) -> dict[str, list[float] | int]:
    """`calculate_metrics` of vllm/benchmarks/serve.py, over the same per-request timestamps: the start
    (`st`: when the request was issued, or due in an open loop), the first and last content chunk, every
    chunk's arrival, and the output tokens the server reported."""
    ttfts, tpots, all_tpots, itls, e2els, good = [], [], [], [], [], 0
    for record in records:
        if not record.ok:
            continue
        start = -record.start_offset_ns  # on the call's clock: the call started at 0
        assert record.first_token_ns is not None
        assert record.last_token_ns is not None
        ttft = (record.first_token_ns - start) / 1e9
        latency = (record.last_token_ns - start) / 1e9
        output_len = record.output_tokens
        assert output_len is not None
        tpot = 0.0
        if output_len > 1:
            tpot = (latency - ttft) / (output_len - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += [
            (later - earlier) / 1e9
            for earlier, later in zip(record.chunk_ns, record.chunk_ns[1:], strict=False)
        ]
        ttfts.append(ttft)
        e2els.append(latency)
        limits = {"ttft": ttft, "tpot": tpot, "e2e": latency}
        good += all(slo[name] >= limits[name] for name in slo)
    return {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2e": e2els, "good": good}


@pytest.mark.parametrize(("shape", "levels"), [(SHAPE_CONCURRENCY, "3"), (SHAPE_RATE, "15")])
async def test_ttft_tpot_itl_e2e_and_goodput_agree_with_vllm_bench_serve_on_the_same_timestamps(
    two_slots: VLLMSimulator, shape: str, levels: str
) -> None:
    slo = {"ttft": 0.2, "tpot": 0.05, "e2e": 0.4}
    ran = await run_load(two_slots, levels, shape=shape, requests=24, prompt_tokens=50, max_tokens=5, slo=slo)
    (stats,) = ran.result.levels
    records = ran.outcome.records[stats.level.label]
    vllm = _vllm_metrics(records, slo)
    assert stats.good == vllm["good"]
    assert stats.goodput_per_s == pytest.approx(vllm["good"] / stats.duration_s)  # type: ignore[operator]
    for name in ("ttft", "tpot", "itl", "e2e"):
        values = vllm[name]
        assert isinstance(values, list)
        assert values
        figures = getattr(stats, name)
        assert figures is not None, name
        assert figures.count == len(values), name
        for q in (0.5, 0.9, 0.95, 0.99):
            # The same definitions give the same values: with the same (nearest-rank) percentile rule the
            # figures are equal; vLLM's interpolated percentile lies between the two values around it.
            assert figures.at(q) == pytest.approx(_nearest_rank(values, q), abs=1e-9), (name, q)
            ordered = sorted(values)
            position = (len(ordered) - 1) * q
            around = ordered[math.floor(position)], ordered[math.ceil(position)]
            assert around[0] - 1e-9 <= _percentile_linear(values, q) <= around[1] + 1e-9
            step = (
                ordered[min(len(ordered) - 1, math.ceil(position) + 1)]
                - ordered[max(0, math.floor(position) - 1)]
            )
            assert abs(figures.at(q) - _percentile_linear(values, q)) <= step + 1e-9, (name, q)
    # And the server's own view agrees on what it sent: the usage the spans carried.
    assert all(record.output_tokens == 5 for record in records)


# --- the report splits the same spans by level ------------------------------------------------------


async def test_the_report_splits_a_load_runs_spans_by_level_and_compares_two_runs(
    batch_slots: VLLMSimulator,
) -> None:
    first = await run_load(
        batch_slots, "1,4", requests=8, prompt_tokens=20, max_tokens=4, sample_server=False
    )
    second = await run_load(
        batch_slots, "1,4", requests=8, prompt_tokens=20, max_tokens=4, sample_server=False
    )
    report = analyse(spans_of_readable(first.spans), top=0)
    assert [(row.label, row.calls, row.failed) for row in report.levels] == [
        ("concurrency=1", 8, 0), ("concurrency=4", 8, 0),
    ]  # fmt: skip
    from llmspans.report._compare import compare
    from llmspans.report._text import render

    after = analyse(spans_of_readable(second.spans), top=0)
    comparison = compare(report, after, before_name="first", after_name="second")
    levels = {(change.name, change.quantile) for change in comparison.changes if change.kind == "level"}
    assert levels == {(level, q) for level in ("concurrency=1", "concurrency=4") for q in ("p50", "p95")}
    text = render(after, comparison)
    assert "Load levels" in text
    assert "concurrency=4 (level)" in text
    # Two runs in one file: each level is labelled with its run.
    both = analyse(spans_of_readable([*first.spans, *second.spans]), top=0)
    assert len(both.levels) == 4
    assert {row.run_id for row in both.levels} == {first.result.run_id, second.result.run_id}
    assert all("(run " in row.label for row in both.levels)


async def test_ctrl_c_stops_the_run_with_what_it_has(batch_slots: VLLMSimulator) -> None:
    workload = Workload(model=batch_slots.config.model, max_tokens=4, prompt_tokens=20)
    plan = Plan(
        shape=SHAPE_CONCURRENCY, levels=parse_levels("2,4", SHAPE_CONCURRENCY), requests_per_level=200
    )
    some_done = asyncio.Event()

    def progress(level: Level, records: Sequence[RequestRecord], planned: int, final: bool) -> None:
        if sum(1 for record in records if record.done_ns) >= 4:
            some_done.set()

    with providers() as (tracer_provider, exporter):
        runner = Runner(
            workload, plan, base_url=batch_slots.base_url, tracer_provider=tracer_provider, progress=progress
        )
        stop = asyncio.Event()
        running = asyncio.ensure_future(runner.run(stop))
        await asyncio.wait_for(some_done.wait(), 10)
        stop.set()
        outcome = await asyncio.wait_for(running, 10)
        spans = exporter.get_finished_spans()
    (stats,) = outcome.levels
    assert outcome.interrupted
    assert 0 < stats.completed < 200
    assert stats.cancelled <= 2  # what was in flight when it stopped
    # Every span that started ended, the cancelled ones as cancelled.
    calls = [span for span in spans if (span.attributes or {}).get(names.STAGE) == names.STAGE_LLM]
    assert len(calls) == stats.requests
    outcomes = [span.attributes[names.STREAM_OUTCOME] for span in calls]  # type: ignore[index]
    assert outcomes.count(names.OUTCOME_CANCELLED) == stats.cancelled


# --- a real server ------------------------------------------------------------------------------------


@retry_timing
async def test_a_sweep_against_transformers_serve_measures_each_requests_ttft_as_the_client_saw_it(
    transformers_serve: TransformersServer,
) -> None:
    """A small sweep end to end against a real CPU model. Each request's TTFT (from its call span: the
    network read that completed the first content chunk) agrees with the moment the first content chunk
    reached the code consuming the stream, the figure tests/test_realservers.py times, by the tolerance
    tests/timing.py allows a figure that holds the client's own work (CLIENT_SIDE)."""
    workload = Workload(model=transformers_serve.model, max_tokens=8, prompt_tokens=12)
    plan = Plan(
        shape=SHAPE_CONCURRENCY, levels=parse_levels("1", SHAPE_CONCURRENCY), sweep=True, requests_per_level=4,
        max_requests=16, max_seconds=30,
    )  # fmt: skip
    with providers() as (tracer_provider, _):
        runner = Runner(
            workload,
            plan,
            base_url=transformers_serve.base_url,
            tracer_provider=tracer_provider,
            max_retries=0,
        )
        outcome = await runner.run()
    assert len(outcome.levels) >= 2
    assert outcome.levels[0].level.label == "concurrency=1"
    checked = 0
    for records in outcome.records.values():
        for record in records:
            assert record.ok, record
            assert record.ttft_ns is not None
            assert record.output_tokens == 8  # read from the finish chunk's usage
            seen = (record.chunk_ns[0] - record.issued_ns) / 1e9
            assert record.ttft_ns / 1e9 - 0.001 <= seen <= record.ttft_ns / 1e9 + CLIENT_SIDE, (seen, record)
            checked += 1
    assert checked >= 8


# --- worker processes ---------------------------------------------------------------------------------


def test_dealing_gives_every_request_to_exactly_one_worker() -> None:
    schedule = [(index, 1000 * (index - 10)) for index in range(10, 17)]
    parts = deal_open(schedule, 3)
    assert parts == [
        ((10, 0), (13, 3000), (16, 6000)), ((11, 1000), (14, 4000)), ((12, 2000), (15, 5000)),
    ]  # fmt: skip
    assert sorted(pair for part in parts for pair in part) == schedule
    closed = deal_closed(5, range(100, 111), 2)
    assert [users for users, _ in closed] == [3, 2]
    assert [len(indices) for _, indices in closed] == [7, 4]
    assert [index for _, indices in closed for index in indices] == list(range(100, 111))
    assert deal_closed(3, range(3), 3) == [(1, (0,)), (1, (1,)), (1, (2,))]


def _call_spans_in(path: Path) -> list[dict[str, object]]:
    """Every call span in a traces file: its attributes, and the process that wrote it."""
    calls = []
    for line in path.read_text().splitlines():
        document = json.loads(line)
        for resource in document.get("resourceSpans", ()):
            process = {item["key"]: item["value"] for item in resource["resource"]["attributes"]}
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    attributes = {
                        item["key"]: next(iter(item["value"].values())) for item in span["attributes"]
                    }
                    if attributes.get(names.STAGE) == names.STAGE_LLM:
                        calls.append({**attributes, "process": process["service.instance.id"]["stringValue"]})
    return calls


async def _run_on(
    server: SimulatedServer, plan: Plan, workers: int, traces: Path
) -> tuple[Runner, RunOutcome]:
    workload = Workload(model="sim-model", max_tokens=4, prompt_tokens=16)
    with providers() as (tracer_provider, _):
        runner = Runner(
            workload, plan, base_url=server.base_url, tracer_provider=tracer_provider, max_retries=0,
            workers=workers, export=WorkerExport("llmspans-load-test", traces),
        )  # fmt: skip
        outcome = await runner.run()
    return runner, outcome


@pytest.mark.parametrize(
    ("shape", "levels", "requests"), [(SHAPE_CONCURRENCY, "2,3", 9), (SHAPE_RATE, "20,40", 16)]
)
async def test_worker_processes_give_the_figures_and_spans_one_process_gives(
    tmp_path: Path, shape: str, levels: str, requests: int
) -> None:
    """The same plan on this process and on two workers, against a server whose answers do not vary: the
    same levels, the same requests (each recorded once, the prompts dealt by index), the same counts and
    tokens, the same open-loop schedule to the nanosecond (one seeded draw, dealt), and every worker's
    call spans in the one traces file, with the level and the run."""
    plan = Plan(shape=shape, levels=parse_levels(levels, shape), requests_per_level=requests, max_seconds=60)
    with SimulatedServer(Behavior(chunks=4, chunk_gap=0.001, usage="auto"), record=False) as server:
        _, alone = await _run_on(server, plan, 1, tmp_path / "alone.jsonl")
        runner, split = await _run_on(server, plan, 2, tmp_path / "split.jsonl")
    assert not alone.workers
    assert len(split.workers) == 2
    assert [stats.level.label for stats in split.levels] == [stats.level.label for stats in alone.levels]
    for one, two in zip(alone.levels, split.levels, strict=True):
        assert (one.workers, two.workers) == (1, 2)
        for figure in ("requests", "completed", "cancelled", "errors", "retries", "unrecorded"):
            assert getattr(two, figure) == getattr(one, figure), figure
        assert two.completed == requests
        assert two.generator_cpu_s is not None
        assert two.generator_cpu_s > 0
        records = {label: split.records[label] for label in split.records}[two.level.label]
        mine = alone.records[one.level.label]
        assert [record.index for record in records] == [record.index for record in mine]
        assert len({record.index for record in records}) == requests
        assert [record.tokens for record in records] == [record.tokens for record in mine] == [4] * requests
        assert all(record.recorded and record.ok for record in records)
        if shape == SHAPE_RATE:
            due = [record.scheduled_ns or 0 for record in records]
            mine_due = [record.scheduled_ns or 0 for record in mine]
            assert [at - due[0] for at in due] == [at - mine_due[0] for at in mine_due]
        assert two.report is not None
        assert two.report.llm_calls == requests
    calls = _call_spans_in(tmp_path / "split.jsonl")
    assert len(calls) == len(split.levels) * requests
    assert {call[names.LOAD_RUN_ID] for call in calls} == {runner.run_id}
    levels_seen = [call[names.LOAD_LEVEL] for call in calls]
    assert {level: levels_seen.count(level) for level in set(levels_seen)} == {
        stats.level.label: requests for stats in split.levels
    }
    assert len({call["process"] for call in calls}) == 2  # written by the two workers, appended here
    assert sorted(os.listdir(tmp_path)) == ["split.jsonl"]  # no worker file left
    for pid in split.workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --- levels whose spans are a sample (issue 37) -----------------------------------------------------------


def _sampled_level_spans(values: Sequence[float]) -> list[Span]:
    """One call span per value, first_token and stream both drawn from `values` (equal distributions)."""
    spans = []
    for index, value in enumerate(values):
        attributes = {
            names.STAGE: names.STAGE_LLM, names.LOAD_LEVEL: "concurrency=4", names.LOAD_RUN_ID: "run",
            "llmspans.bucket.first_token": value, "llmspans.bucket.stream": values[-1 - index],
        }  # fmt: skip
        buckets = tuple(round(attributes.get(f"llmspans.bucket.{b}", 0.0) * 1e9) for b in names.BUCKETS)  # type: ignore[arg-type]
        trace_id = f"{index + 1:032x}"
        spans.append(Span(trace_id, f"{index + 1:016x}", None, "chat m", 3, 0, 10**8, attributes, (), False,
                          "s", "s", names.STAGE_LLM, 10**8, buckets))  # fmt: skip
    return spans


def test_a_level_whose_spans_are_a_sample_cannot_tell_two_equal_parts_apart() -> None:
    """Ten spans of forty calls (a head sampler's quarter): first_token and stream alike, so the level's
    report says it cannot tell them apart; the same ten as every call made name the larger, as before."""
    values = [0.004 + 0.0001 * ((7 * i) % 10) for i in range(10)]
    spans = _sampled_level_spans(values)
    sample = analyse(spans, top=0, population=40)
    (row,) = sample.levels
    assert row.dominant == "cannot tell (first_token or stream)"
    assert sample.triage is not None
    assert not sample.triage.told
    assert (
        sample.notes[0]
        == "sampled: 10 of 40 requests have spans; quantiles are estimates with 95 % intervals"
    )
    assert all(bucket.values.intervals for bucket in sample.buckets)
    whole = analyse(spans, top=0, population=10)
    assert whole.triage is not None
    assert whole.triage.told
    assert whole.levels[0].dominant in ("first_token", "stream")


async def test_a_head_sampled_load_run_gives_each_level_as_an_estimate(tmp_path: Path) -> None:
    """`llmspans load` under a head sampler (OTEL_TRACES_SAMPLER=traceidratio, here the provider's own): the
    level's calls are all counted, its spans are a sample of them, and the level's figures say so: a part
    is named only where it stands apart beyond the intervals."""
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=TraceIdRatioBased(0.25))
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider()
    plan = Plan(shape=SHAPE_CONCURRENCY, levels=parse_levels("1,2", SHAPE_CONCURRENCY), requests_per_level=40,
                max_seconds=60)  # fmt: skip
    workload = Workload(model="sim-model", max_tokens=4, prompt_tokens=16)
    try:
        with (
            _telemetry.use_providers(tracer_provider, meter_provider),
            SimulatedServer(Behavior(chunks=2, header_delay=0.004, chunk_gap=0.004, usage="auto"), record=False)
            as server,
        ):  # fmt: skip
            runner = Runner(
                workload, plan, base_url=server.base_url, tracer_provider=tracer_provider, max_retries=0
            )
            outcome = await runner.run()
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()
    for stats in outcome.levels:
        assert stats.completed == 40
        assert 0 < stats.unrecorded < 40
        report = stats.report
        assert report is not None
        assert report.notes[0].startswith(f"sampled: {40 - stats.unrecorded} of 40 requests have spans")
        assert all(row.values.intervals for row in report.buckets)
        triage = report.triage
        assert triage is not None
        leader, runner_up = triage.compared
        assert triage.told == (leader.low > runner_up.high)
        assert stats.dominant == (
            f"{leader.label}" if triage.told else f"cannot tell ({leader.label} or {runner_up.label})"
        )


def _level_of(value: int, first_tokens: Sequence[float], made: int) -> LevelStats:
    """A level's figures from one call per value (first_token as given, stream 1 ms), `made` calls made."""
    from llmspans.load._model import Level
    from llmspans.load._stats import level_stats

    level = Level(SHAPE_CONCURRENCY, value)
    spans, records = [], []
    for index, first_token in enumerate(first_tokens):
        attributes = {
            names.STAGE: names.STAGE_LLM, names.LOAD_LEVEL: level.label, names.LOAD_RUN_ID: "run",
            "llmspans.bucket.first_token": first_token, "llmspans.bucket.stream": 0.001,
        }  # fmt: skip
        buckets = tuple(
            round(float(attributes.get(f"llmspans.bucket.{b}", 0.0)) * 1e9) for b in names.BUCKETS
        )  # type: ignore[arg-type]
        trace_id = f"{value:08x}{index + 1:024x}"
        spans.append(Span(trace_id, f"{index + 1:016x}", None, "chat m", 3, 0, 10**8, attributes, (), False,
                          "s", "s", names.STAGE_LLM, 10**8, buckets))  # fmt: skip
        record = RequestRecord(index, level.label, issued_ns=1, done_ns=2)
        record.recorded, record.duration_ns = True, 10**8
        record.buckets_ns = dict(zip(names.BUCKETS, buckets, strict=True))
        records.append(record)
    report = analyse(spans, top=0, population=made)
    return level_stats(level, records, duration_s=1.0, slo={}, report=report)


def test_the_knees_verdict_cannot_tell_what_grew_when_the_levels_spans_are_samples() -> None:
    """first_token's p95 went from 4.3 to 4.6 ms between two levels because one call of ten spans was slower,
    each level known from ten spans of forty calls: within what ten spans can tell, so the verdict says so;
    from every call's spans it names first_token."""
    from llmspans.load._model import Knee
    from llmspans.load._verdict import verdict

    before = [0.0035, 0.0036, 0.0037, 0.0038, 0.0039, 0.0040, 0.0040, 0.0041, 0.0042, 0.0043]
    at = [*before[:-1], 0.0046]
    for made, told in ((40, False), (10, True)):
        levels = [_level_of(1, before, made), _level_of(2, at, made)]
        found = verdict(levels, Knee(levels[0].level, levels[1].level, ("ttft",)))
        assert found is not None
        assert found.grew == "first_token"
        assert (found.finding == "cannot_tell") == (not told), found.message
        if not told:
            assert "within what the spans of these levels can tell apart" in found.message
