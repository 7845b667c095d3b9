"""Tail sampling (`llmspans.TailSampling`, `llmspans.TailSamplingProcessor`), over real HTTP on 127.0.0.1.

Each test records the same spans twice on one TracerProvider: through the tail-sampling processor, and
whole through a plain processor beside it. The whole recording is the truth the kept traces are held to.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import textwrap
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanContext, TraceFlags, TraceState

import llmspans
from llmspans import _guard, _tail_sampling, _telemetry
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans.testing import settle
from llmspans.tools.simulator import Behavior, SimulatedServer

MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass
class Recording:
    kept: InMemorySpanExporter
    whole: InMemorySpanExporter
    processor: llmspans.TailSamplingProcessor
    reader: InMemoryMetricReader
    provider: TracerProvider

    def kept_spans(self) -> list[ReadableSpan]:
        settle()
        return list(self.kept.get_finished_spans())

    def whole_spans(self) -> list[ReadableSpan]:
        settle()
        return list(self.whole.get_finished_spans())

    def kept_traces(self) -> dict[int, list[ReadableSpan]]:
        return _by_trace(self.kept_spans())

    def whole_traces(self) -> dict[int, list[ReadableSpan]]:
        return _by_trace(self.whole_spans())

    def metric_value(self, name: str, **attributes: Any) -> float:
        data = self.reader.get_metrics_data()
        total = 0.0
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != name:
                        continue
                    for point in metric.data.data_points:
                        if all((point.attributes or {}).get(k) == v for k, v in attributes.items()):
                            total += point.value  # type: ignore[union-attr]
        return total


def _by_trace(spans: list[ReadableSpan]) -> dict[int, list[ReadableSpan]]:
    traces: dict[int, list[ReadableSpan]] = defaultdict(list)
    for span in spans:
        assert span.context is not None
        traces[span.context.trace_id].append(span)
    return dict(traces)


@contextmanager
def recording(*extra: SpanProcessor, **sampling: Any) -> Iterator[Recording]:
    """Record into a provider that has the tail-sampling processor and, beside it, the whole truth."""
    kept, whole = InMemorySpanExporter(), InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)
    processor = llmspans.TailSamplingProcessor(SimpleSpanProcessor(kept), *extra, **sampling)
    provider.add_span_processor(processor)
    provider.add_span_processor(SimpleSpanProcessor(whole))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    try:
        with _telemetry.use_providers(provider, meter_provider):
            yield Recording(kept, whole, processor, reader, provider)
    finally:
        provider.shutdown()
        meter_provider.shutdown()


def _weight(span: ReadableSpan) -> Any:
    return (span.attributes or {}).get(names.SAMPLE_WEIGHT)


def _client(server: SimulatedServer, **instrument: Any) -> openai.OpenAI:
    max_retries = instrument.pop("max_retries", 0)
    client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=max_retries)
    return llmspans.instrument(client, **instrument)


def _ask(client: openai.OpenAI, **x_sim: Any) -> None:
    client.chat.completions.create(
        model="sim-model", messages=MESSAGES, extra_body={"x_sim": x_sim} if x_sim else None
    )


# --- what is always kept -------------------------------------------------------------------------------


def test_slow_failed_over_budget_retried_and_hedged_traces_are_all_kept_whole(
    server: SimulatedServer,
) -> None:
    """ratio=0: only the rules keep a trace; every trace of each kind must be there with all its spans."""
    server.default = Behavior(chunks=2)
    plain = _client(server)
    retrying = _client(server, max_retries=2)
    hedged = _client(server, hedge=llmspans.Hedge(after=0.05))
    kinds: dict[int, str] = {}

    @llmspans.retrieval
    def search() -> str:
        return "doc"

    def turn(kind: str, budget: float | None = None) -> None:
        with llmspans.turn(kind, budget=budget) as span:
            search()
            try:
                if kind == "failed":
                    _ask(plain, status=500)
                elif kind == "retried":
                    server.enqueue(Behavior(status=503, retry_after_ms=1), Behavior(chunks=2))
                    _ask(retrying)
                elif kind == "hedged":
                    server.enqueue(Behavior(header_delay=0.5), Behavior(chunks=2))
                    _ask(hedged)
                elif kind == "slow":
                    _ask(plain, header_delay=0.25)
                else:
                    _ask(plain)
            except openai.APIStatusError:
                pass
        kinds[span.get_span_context().trace_id] = kind

    with recording(ratio=0.0, slower_than="200ms") as run:
        for _ in range(3):
            for kind in ("ordinary", "failed", "retried", "hedged", "slow", "ordinary"):
                turn(kind)
            turn("over_budget", budget=0.000001)
        assert server.wait_idle(10)
        whole, kept = run.whole_traces(), run.kept_traces()

    assert len(whole) == len(kinds) == 21
    for trace_id, kind in kinds.items():
        if kind == "ordinary":
            (root,) = [s for s in whole[trace_id] if s.parent is None]
            slow = (root.end_time or 0) - (root.start_time or 0) > 200_000_000  # a busy machine's doing
            assert (trace_id in kept) == slow, "ratio 0 keeps no ordinary trace"
            continue
        assert trace_id in kept, kind
        assert sorted(s.context.span_id for s in kept[trace_id]) == sorted(  # type: ignore[union-attr]
            s.context.span_id  # type: ignore[union-attr]
            for s in whole[trace_id]
        ), kind
        assert {_weight(s) for s in kept[trace_id]} == {1.0}
        assert {s.context.trace_state.get("ot") for s in kept[trace_id]} == {"th:0"}  # type: ignore[union-attr]
    hedged_calls = [
        s
        for t, k in kinds.items()
        if k == "hedged"
        for s in whole[t]
        if (s.attributes or {}).get(names.HEDGE_FIRED)
    ]
    assert len(hedged_calls) == 3  # the hedges really fired
    assert run.processor.held_spans == 0


def test_the_ordinary_traces_are_kept_within_binomial_bounds_of_the_ratio_whole_and_weighted() -> None:
    ratio, turns = 0.2, 600
    with recording(ratio=ratio, slower_than=None) as run:

        @llmspans.stage("prompt")
        def build() -> str:
            return "p"

        for _ in range(turns):
            with llmspans.turn("chat"):
                build()
                build()
        whole, kept = run.whole_traces(), run.kept_traces()
    mean, sd = turns * ratio, math.sqrt(turns * ratio * (1 - ratio))
    assert mean - 5 * sd <= len(kept) <= mean + 5 * sd, len(kept)  # 5 sd: 1 run in 1.7 million fails
    threshold = _tail_sampling.TailSampling(ratio=ratio).threshold
    for trace_id in whole:
        assert (trace_id in kept) == ((trace_id & (2**56 - 1)) >= threshold)
    for trace_id, spans in kept.items():
        assert len(spans) == len(whole[trace_id]) == 3
        assert {_weight(s) for s in spans} == {1 / ratio}
        assert {s.context.trace_state.get("ot") for s in spans} == {"th:cccccccccccccc"}  # type: ignore[union-attr]


def test_the_same_trace_id_gets_the_same_decision_everywhere() -> None:
    """The decision reads only the trace id (or its `rv`): two processors, and a pinned id, agree."""
    sampling = _tail_sampling.TailSampling(ratio=0.01)
    threshold = sampling.threshold
    assert threshold == 2**56 - round(0.01 * 2**56)
    assert _tail_sampling.threshold_hex(threshold) == "fd70a3d70a3d71"
    at = SpanContext(0xABCDEF << 64 | threshold, 1, False, TraceFlags(1))
    below = SpanContext(0xABCDEF << 64 | (threshold - 1), 1, False, TraceFlags(1))
    assert _tail_sampling.randomness(at) == threshold
    assert _tail_sampling.randomness(below) == threshold - 1
    explicit = SpanContext(1, 1, False, TraceFlags(1), TraceState([("ot", "rv:ffffffffffffff")]))
    assert _tail_sampling.randomness(explicit) == 2**56 - 1

    second = InMemorySpanExporter()
    twin = llmspans.TailSamplingProcessor(SimpleSpanProcessor(second), ratio=0.3, slower_than=None)
    with recording(ratio=0.3, slower_than=None) as run:
        run.provider.add_span_processor(twin)
        for _ in range(200):
            with llmspans.turn("chat"):
                pass
        first_ids = set(run.kept_traces())
    assert first_ids == set(_by_trace(list(second.get_finished_spans())))
    assert 0 < len(first_ids) < 200


def test_a_percentile_keeps_the_roots_slower_than_their_recent_peers() -> None:
    """p90 over the last 1,000 roots of the same name, after a warm-up of 100 in which all are kept."""
    with recording(ratio=0.0, slower_than="p90") as run:
        tracer = run.provider.get_tracer("test")
        durations = [(i * 7919) % 1000 for i in range(_tail_sampling.WARM_UP + 400)]  # a shuffled 0..999 ms
        ids = []
        start = 1_000_000_000
        for duration in durations:
            span = tracer.start_span("turn chat", start_time=start)
            span.end(end_time=start + duration * 1_000_000)
            ids.append(span.get_span_context().trace_id)
        kept = run.kept_traces()
    window: list[int] = []
    for index, (duration, trace_id) in enumerate(zip(durations, ids, strict=True)):
        if index < _tail_sampling.WARM_UP:
            expected = True
        else:
            ordered = sorted(window[-_tail_sampling.WINDOW :])
            expected = duration > ordered[math.ceil(0.9 * len(ordered)) - 1]
        window.append(duration)
        assert (trace_id in kept) == expected, index
    assert 30 <= len(kept) - _tail_sampling.WARM_UP <= 50  # about a tenth of the 400 after the warm-up


# --- across processes ------------------------------------------------------------------------------------


def test_the_traceparent_says_sampled_while_the_decision_is_pending(server: SimulatedServer) -> None:
    client = _client(server, provider="vllm")
    with recording(ratio=0.0, slower_than=None) as run:
        with llmspans.turn("chat"):
            _ask(client)
        assert server.wait_idle(10)
        assert run.kept_spans() == []  # dropped in this process...
    traceparent = server.requests[-1].headers["traceparent"]
    assert int(traceparent.rsplit("-", 1)[1], 16) & 0x01  # ...but the server was told to record it


# --- metrics -----------------------------------------------------------------------------------------------


def _metric_counts(reader: InMemoryMetricReader) -> dict[tuple[str, str], float]:
    """Every series' count (histograms) or value (counters): what dashboards count, timings aside."""
    counts: dict[tuple[str, str], float] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if "limiter" in metric.name or metric.name.startswith("vllm."):
                    continue
                for point in metric.data.data_points:
                    key = (metric.name, json.dumps(sorted((point.attributes or {}).items())))
                    counts[key] = getattr(point, "count", None) or getattr(point, "value", 0)
    return counts


def _workload(server: SimulatedServer) -> None:
    client = _client(server, max_retries=2)

    @llmspans.retrieval(budget=0.000001)
    def search() -> str:
        return "doc"

    for index in range(12):
        with llmspans.turn("chat"):
            search()
            if index % 4 == 1:
                server.enqueue(Behavior(status=503, retry_after_ms=1), Behavior(chunks=3))
            _ask(client)
            stream = client.chat.completions.create(model="sim-model", messages=MESSAGES, stream=True)
            for _ in stream:
                pass
    assert server.wait_idle(10)


def test_metrics_count_every_call_and_stage_with_and_without_tail_sampling(server: SimulatedServer) -> None:
    server.default = Behavior(chunks=3)
    with recording(ratio=0.0, slower_than=None) as sampled:
        _workload(server)
        settle()
        with_tail = _metric_counts(sampled.reader)
        assert sampled.kept_spans() == [s for s in sampled.kept_spans() if _weight(s) == 1.0]
    plain_exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(plain_exporter))
    meter_provider = MeterProvider(metric_readers=[reader])
    with _telemetry.use_providers(provider, meter_provider):
        _workload(server)
        settle()
        without = _metric_counts(reader)
    provider.shutdown()
    meter_provider.shutdown()
    assert with_tail == without
    assert with_tail[(names.METRIC_STAGE_DURATION, json.dumps([(names.STAGE, "retrieval")]))] == 12


# --- bounded memory -------------------------------------------------------------------------------------


def test_a_trace_at_its_span_cap_is_decided_at_once_and_counted() -> None:
    with recording(ratio=0.0, slower_than=None, max_spans_per_trace=5) as run:

        @llmspans.stage("tool")
        def step(fail: bool) -> None:
            if fail:
                raise ValueError("boom")

        with llmspans.turn("long"):
            for _ in range(12):
                step(False)
                assert run.processor.held_spans <= 5
        with contextlib.suppress(ValueError), llmspans.turn("failing"):
            for _ in range(3):
                step(False)
            step(True)
        assert (
            run.metric_value(names.METRIC_SAMPLE_OVERFLOW, **{names.SAMPLE_OVERFLOW_CAP: "trace_spans"}) == 1
        )
        kept = run.kept_traces()
        assert run.processor.held_spans == 0
    # The long ordinary trace was dropped at its cap, its later spans with it; the failing one kept whole.
    assert [sorted(s.name.split(".")[0] for s in spans) for spans in kept.values()] == [
        ["tool test_a_trace_at_its_span_cap_is_decided_at_once_and_counted"] * 4 + ["turn failing"]
    ]


def test_held_spans_are_capped_in_total_and_by_age() -> None:
    with recording(ratio=0.0, slower_than=None, max_held_spans=50, max_age=2.0) as run:
        tracer = run.provider.get_tracer("test")
        roots = [tracer.start_span("turn open") for _ in range(40)]  # never ended while we look
        for root in roots:
            for _ in range(3):
                tracer.start_span("step", context=_in(root)).end()
            assert run.processor.held_spans <= 50
        held = run.metric_value(names.METRIC_SAMPLE_OVERFLOW, **{names.SAMPLE_OVERFLOW_CAP: "held_spans"})
        assert held >= 24  # 40 traces of 3 spans each, at most 50 spans held: 24 or more decided early
        threading.Event().wait(2.2)  # (2 s: the loop above finishes well within it, even when busy)
        tracer.start_span("turn new").end()  # a span ending is when ages are looked at
        assert run.processor.held_traces == 0
        aged = run.metric_value(names.METRIC_SAMPLE_OVERFLOW, **{names.SAMPLE_OVERFLOW_CAP: "max_age"})
        assert held + aged == 40
        for root in roots:
            root.end()  # decided already: dropped with their trace
        assert run.kept_spans() == []


def _in(span: Any) -> Any:
    from opentelemetry import trace

    return trace.set_span_in_context(span)


# --- arguments ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "error", "says"),
    [
        ({"ratio": 1.5}, ValueError, "ratio must be from 0 to 1"),
        ({"ratio": -0.1}, ValueError, "ratio must be from 0 to 1"),
        ({"ratio": "1%"}, TypeError, "ratio must be a number"),
        ({"slower_than": "p40"}, ValueError, "from p50 to p99.9"),
        ({"slower_than": -2}, ValueError, "positive number of seconds"),
        ({"slower_than": "-5ms"}, ValueError, "2500ms"),
        ({"slower_than": [1]}, TypeError, "number of seconds"),
        ({"max_spans_per_trace": 0}, ValueError, "at least 1"),
        ({"max_age": 0}, ValueError, "positive number of seconds"),
    ],
)
def test_wrong_arguments_say_what_to_pass(
    arguments: dict[str, Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        llmspans.TailSampling(**arguments)
    with pytest.raises(error, match=says):
        llmspans.TailSamplingProcessor(SimpleSpanProcessor(InMemorySpanExporter()), **arguments)


def test_what_slower_than_accepts() -> None:
    assert llmspans.TailSampling(slower_than="2500ms").slower_than == 2.5
    assert llmspans.TailSampling(slower_than="2.5s").slower_than == 2.5
    assert llmspans.TailSampling(slower_than=2).slower_than == 2.0
    assert llmspans.TailSampling(slower_than="P99").slower_than == "p99"
    assert llmspans.TailSampling(slower_than=None).slower_than is None
    # The same spellings as `Hedge(after=...)` and the budgets (one parser, `_budget.parse_duration`).
    assert llmspans.TailSampling(slower_than="p97").slower_than == "p97"
    assert llmspans.TailSampling(slower_than="p99.9").slower_than == "p99.9"
    assert llmspans.TailSampling(slower_than="250us").slower_than == pytest.approx(250e-6)
    assert llmspans.TailSampling(slower_than="1m").slower_than == 60.0


@pytest.mark.parametrize("value", ["p97", "150ms", 0.15, "p40", "soon", -1, None, True])
def test_a_hedge_and_tail_sampling_take_the_same_spellings_with_the_same_message(value: Any) -> None:
    outcomes = []
    for make in (lambda: llmspans.Hedge(after=value), lambda: llmspans.TailSampling(slower_than=value)):
        try:
            make()
            outcomes.append("accepted")
        except (TypeError, ValueError) as error:
            outcomes.append(str(error).split(" must ", 1)[1])
    if value is None:  # None turns tail sampling's rule off; a hedge needs a time
        assert outcomes[1] == "accepted"
        assert "seconds or a percentile" in outcomes[0]
    else:
        assert outcomes[0] == outcomes[1]


def test_the_processor_and_configure_reject_what_they_cannot_use() -> None:
    with pytest.raises(TypeError, match="BatchSpanProcessor"):
        llmspans.TailSamplingProcessor()
    with pytest.raises(TypeError, match="span processors"):
        llmspans.TailSamplingProcessor("exporter")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not both"):
        llmspans.TailSamplingProcessor(
            SimpleSpanProcessor(InMemorySpanExporter()), sampling=llmspans.TailSampling(), ratio=0.5
        )
    with pytest.raises(TypeError, match=r"TailSampling\(ratio="):
        llmspans.configure(tail_sampling=0.01)  # type: ignore[arg-type]


# --- never breaks the app -------------------------------------------------------------------------------


class _Broken(SpanProcessor):
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        raise RuntimeError("broken on_start")

    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("broken exporter")

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        raise RuntimeError("broken flush")

    def shutdown(self) -> None:
        raise RuntimeError("broken shutdown")


def test_a_broken_exporter_or_a_fault_never_reaches_the_app(server: SimulatedServer) -> None:
    client = _client(server)
    with recording(_Broken(), ratio=1.0) as run:
        with llmspans.turn("chat"):
            _ask(client)
        assert len(run.kept_traces()) == 1  # the healthy processor beside the broken one got the trace
        with _guard.inject_faults(sites.TAIL_SAMPLING_DECIDE, sites.TAIL_SAMPLING_EXPORT):
            with llmspans.turn("chat"):
                _ask(client)
            tracer = run.provider.get_tracer("app")
            with tracer.start_as_current_span("the app's own span"):
                pass
        assert run.provider.force_flush() is False  # said, not raised


# --- configure() and the environment ----------------------------------------------------------------------


_CONFIGURED_RUN = textwrap.dedent(
    """
    import json, sys
    import llmspans
    conf = llmspans.configure(
        service_name="tail", traces_file=sys.argv[1], metrics=False,
        tail_sampling=llmspans.TailSampling(ratio=1.0, slower_than=None),
    )
    for _ in range(3):
        with llmspans.turn("chat"):
            pass
    print(json.dumps(conf.notes))
    """
)


def test_tail_sampling_wins_over_otel_traces_sampler(tmp_path: Path) -> None:
    """OTEL_TRACES_SAMPLER=always_off alongside tail sampling: every trace is still recorded and decided
    at its end, and configure() says so in its notes."""
    path = tmp_path / "traces.jsonl"
    environment = {**os.environ, "OTEL_TRACES_SAMPLER": "always_off"}
    environment.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    done = subprocess.run(
        [sys.executable, "-c", _CONFIGURED_RUN, str(path)],
        env=environment, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    notes = json.loads(done.stdout.strip().splitlines()[-1])
    assert any("tail sampling wins over OTEL_TRACES_SAMPLER=always_off" in note for note in notes)
    spans = [
        span
        for line in path.read_text().splitlines()
        for resource in json.loads(line).get("resourceSpans", [])
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    ]
    assert [span["name"] for span in spans] == ["turn chat"] * 3
    for span in spans:
        weight = {a["key"]: a["value"] for a in span["attributes"]}[names.SAMPLE_WEIGHT]
        assert weight == {"doubleValue": 1.0}
        assert span["traceState"] == "ot=th:0"


def test_kept_traces_reach_a_real_otlp_receiver(otlp_http_receiver: Any) -> None:
    """configure()'s batch processor behind tail sampling, to an OTLP/HTTP receiver on 127.0.0.1."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    port = otlp_http_receiver.server_address[1]
    script = textwrap.dedent(
        f"""
        import llmspans
        llmspans.configure(
            endpoint="http://127.0.0.1:{port}", metrics=False,
            tail_sampling=llmspans.TailSampling(ratio=0.0, slower_than=None),
        )
        @llmspans.stage("tool")
        def fails():
            raise ValueError("x")
        for index in range(6):
            try:
                with llmspans.turn("chat"):
                    if index % 2:
                        fails()
            except ValueError:
                pass
        """
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    subprocess.run([sys.executable, "-c", script], env=environment, timeout=120, check=True)
    spans = []
    for received in otlp_http_receiver.received:
        if received.path == "/v1/traces":
            request = ExportTraceServiceRequest.FromString(received.body)
            spans += [s for r in request.resource_spans for sc in r.scope_spans for s in sc.spans]
    assert sorted(span.name for span in spans) == ["tool fails"] * 3 + ["turn chat"] * 3
    for span in spans:
        weights = [a.value.double_value for a in span.attributes if a.key == names.SAMPLE_WEIGHT]
        assert weights == [1.0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_holds_none_of_its_parents_spans() -> None:
    with recording(ratio=0.0, slower_than=None) as run:
        tracer = run.provider.get_tracer("test")
        root = tracer.start_span("turn open")
        tracer.start_span("step", context=_in(root)).end()
        assert run.processor.held_spans == 1
        pid = os.fork()
        if pid == 0:  # the child: the parent's held spans are the parent's to export
            os._exit(0 if (run.processor.held_spans, run.processor.held_traces) == (0, 0) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert run.processor.held_spans == 1
        root.end()
        assert run.processor.held_spans == 0


def test_configure_says_when_an_app_provider_it_leaves_alone_gets_no_tail_sampling() -> None:
    script = textwrap.dedent(
        """
        import json
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        import llmspans
        trace.set_tracer_provider(TracerProvider())
        conf = llmspans.configure(metrics=False, tail_sampling=llmspans.TailSampling())
        print(json.dumps([conf.mode, conf.notes]))
        """
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120, check=True
    )  # fmt: skip
    mode, notes = json.loads(done.stdout.strip().splitlines()[-1])
    assert mode == "existing"
    assert any("llmspans.TailSamplingProcessor" in note for note in notes), notes


_KEPT_IDS = textwrap.dedent(
    """
    import json, random
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    import llmspans

    class Fixed(IdGenerator):
        def __init__(self):
            self.rng = random.Random(31)
        def generate_trace_id(self):
            return self.rng.getrandbits(128)
        def generate_span_id(self):
            return self.rng.getrandbits(64) or 1

    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=Fixed())
    provider.add_span_processor(
        llmspans.TailSamplingProcessor(SimpleSpanProcessor(exporter), ratio=0.1, slower_than=None)
    )
    tracer = provider.get_tracer("t")
    for _ in range(500):
        tracer.start_span("turn chat").end()
    print(json.dumps(sorted(span.context.trace_id for span in exporter.get_finished_spans())))
    """
)


def test_two_processes_with_the_same_ratio_keep_the_same_trace_ids() -> None:
    kept = []
    for hash_seed in ("1", "2"):  # two interpreters, hashed differently
        environment = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", _KEPT_IDS], env=environment, capture_output=True, text=True, timeout=120,
            check=True,
        )  # fmt: skip
        kept.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert kept[0] == kept[1]
    assert 20 <= len(kept[0]) <= 85  # 500 x 0.1, within 5 standard deviations
