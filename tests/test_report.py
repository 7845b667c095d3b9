"""The report: figures checked against hand-built timelines, the recorded file and Jaeger fixtures,
bad input, and the HTML page as headless Chromium renders it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from llmspans import _names as names
from llmspans.__main__ import main
from llmspans.report._analysis import analyse
from llmspans.report._html import render as render_html
from llmspans.report._model import FINDING_QUEUE, FINDING_STALLED, Distribution, Report, quantile
from llmspans.report._sources.jaeger import JAEGER_TRACES_PATH
from llmspans.report._spans import spans_of_document
from llmspans.report._text import render as render_text
from tests.support.local_http import QuietHandler, serving
from tests.support.report_files import read_spans

FIXTURES = Path(__file__).parent / "fixtures"
RECORDED = [FIXTURES / "embedded-default.jsonl", FIXTURES / "vllm-server.jsonl"]
JAEGER_RESPONSE = FIXTURES / "jaeger-find-traces.json"
SERVICE = "llmspans-demo-queue"
MS = 1_000_000  # nanoseconds


# --- building OTLP JSON by hand ------------------------------------------------------------------


def _value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list):
        return {"arrayValue": {"values": [_value(item) for item in value]}}
    return {"stringValue": str(value)}


class Trace:
    """Spans of one trace in OTLP JSON, times in milliseconds from an arbitrary epoch."""

    counter = 0

    def __init__(self) -> None:
        Trace.counter += 1
        self.trace_id = f"{Trace.counter:032x}"
        self.spans: list[dict[str, Any]] = []

    def span(
        self, name: str, start_ms: float, end_ms: float, parent: str | None = None, kind: int = 1,
        events: dict[str, float] | None = None, error: bool = False, **attributes: Any,
    ) -> str:  # fmt: skip
        span_id = f"{len(self.spans) + 1:04x}{Trace.counter:012x}"
        self.spans.append({
            "traceId": self.trace_id, "spanId": span_id, "parentSpanId": parent or "", "name": name, "kind": kind,
            "startTimeUnixNano": str(int(start_ms * MS)), "endTimeUnixNano": str(int(end_ms * MS)),
            "attributes": [{"key": k.replace("__", "."), "value": _value(v)} for k, v in attributes.items()],
            "events": [{"name": e, "timeUnixNano": str(int(t * MS))} for e, t in (events or {}).items()],
            "status": {"code": 2} if error else {},
        })  # fmt: skip
        return span_id

    def call(
        self, start_ms: float, parent: str | None = None, admitted_ms: float | None = None, **buckets: float
    ) -> str:
        """An LLM call span whose buckets (ms) sum to its duration."""
        values = {bucket: buckets.get(bucket, 0.0) for bucket in names.BUCKETS}
        end = start_ms + sum(values.values())
        attributes = {names.STAGE: names.STAGE_LLM}
        attributes.update({names.BUCKET_PREFIX + b: v / 1e3 for b, v in values.items()})
        events = {names.EVENT_ADMITTED: admitted_ms} if admitted_ms is not None else None
        return self.span("chat m", start_ms, end, parent, kind=3, events=events, **_keys(attributes))


def _keys(attributes: dict[str, Any]) -> dict[str, Any]:
    return {key.replace(".", "__"): value for key, value in attributes.items()}


def document(*traces: Trace, service: str = "app") -> dict[str, Any]:
    return {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
        "scopeSpans": [{"scope": {"name": "llmspans"}, "spans": [s for t in traces for s in t.spans]}],
    }]}  # fmt: skip


def report_of(*traces: Trace, **kwargs: Any) -> Report:
    return analyse(spans_of_document(document(*traces)) or [], **kwargs)


# --- the figures ------------------------------------------------------------------------------------


def test_quantiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert [quantile(values, q) for q in (0.5, 0.95, 0.99, 1.0)] == [50.0, 95.0, 99.0, 100.0]
    assert Distribution.of([3.0, 1.0, 2.0]) == Distribution(3, 2.0, 3.0, 3.0, 3.0)
    assert Distribution.of([]).count == 0
    assert quantile([1.0] * 19 + [9.0], 0.95) == 1.0  # rank ceil(19) = 19: not the max
    assert quantile([1.0] * 19 + [9.0], 0.99) == 9.0


def test_budgets_exceeded_are_counted_exactly_from_the_spans_and_from_overrides() -> None:
    traces = []
    for n in range(20):
        trace = Trace()
        duration = 10 + 10 * n  # 10..200 ms
        trace.span("retrieval search", 0, duration, **_keys({
            names.STAGE: "retrieval", names.BUDGET: 0.1, names.BUDGET_EXCEEDED: duration > 100,
        }))  # fmt: skip
        traces.append(trace)
    row = report_of(*traces).stages[0]
    assert (row.stage, row.budget, row.budgeted, row.exceeded) == ("retrieval", 0.1, 20, 10)
    row = report_of(*traces, budgets={"retrieval": 0.15}).stages[0]
    assert (row.budget, row.budgeted, row.exceeded) == (0.15, 20, 5)
    assert report_of(*traces, budgets={"rerank": 0.1}).notes == (
        "--budgets names stage 'rerank', which no span has",
    )


def test_gap_fraction_is_rebuilt_from_the_call_timelines() -> None:
    # cap 1: A runs 0-10; B queued 0-12 (2 ms with a backlog and nothing in flight), runs 12-20;
    # C queued 0-20, runs 20-30. Backlog 0-20, gap 10-12: gap_fraction 0.1.
    trace = Trace()
    limiter = {names.LIMITER_NAME: "lane", names.LIMITER_CAP: 1}
    for start, admitted, end in ((0, 0, 10), (0, 12, 20), (0, 20, 30)):
        call = trace.call(start, admitted_ms=admitted, queue=admitted - start, stream=end - admitted)
        trace.spans[-1]["attributes"] += document_attributes(limiter)
        del call
    (row,) = report_of(trace).limiters
    assert (row.name, row.cap, row.calls) == ("lane", 1, 3)
    assert row.backlog_s == pytest.approx(0.020)
    assert row.gap_s == pytest.approx(0.002)
    assert row.gap_fraction == pytest.approx(0.1)
    assert row.mean_queue_depth == pytest.approx((2 * 12 + 1 * 8) / 30)
    assert row.max_queue_depth == 2
    assert row.mean_in_flight == pytest.approx(28 / 30)


def test_a_call_the_limiter_admitted_at_once_was_never_queued() -> None:
    # The client's own set-up before acquiring (start -> admitted) is not a backlog when the limiter
    # says the wait was 0.
    trace = Trace()
    trace.call(0, admitted_ms=1, queue=1, stream=10)
    trace.spans[-1]["attributes"] += document_attributes(
        {names.LIMITER_NAME: "lane", names.LIMITER_CAP: 1, names.LIMITER_WAIT: 0.0}
    )
    (row,) = report_of(trace).limiters
    assert (row.backlog_s, row.gap_fraction) == (0.0, 0.0)


def document_attributes(attributes: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": key, "value": _value(value)} for key, value in attributes.items()]


@pytest.mark.parametrize(
    ("bucket", "finding", "words"),
    [
        ("queue", FINDING_QUEUE, "queue dominates: backlog or cap too low"),
        ("retry", "retry", "retry dominates: fix retry budgets and timeouts before concurrency"),
        ("connect", "connect", "connect dominates: connection churn"),
        ("first_token", "first_token", "first_token dominates: look at server queueing, connection reuse"),
        ("stream", "stream", "stream dominates: decode speed (quantisation, kernels, speculative decoding)"),
        ("post", "post", "post dominates: move work off the hot path"),
    ],
)
def test_the_dominant_bucket_at_p95_names_its_rule(bucket: str, finding: str, words: str) -> None:
    traces = []
    for n in range(20):
        trace = Trace()
        buckets = {"first_token": 50.0, "stream": 100.0}
        buckets[bucket] = 400.0 + n
        trace.call(0, **buckets)
        traces.append(trace)
    triage = report_of(*traces).triage
    assert triage is not None
    assert (triage.dominant_kind, triage.dominant, triage.finding) == ("bucket", bucket, finding)
    assert triage.message.startswith(words)
    assert triage.dominant_p95 == pytest.approx(0.418)  # nearest rank 19 of 400..419 ms: 418


def test_stalled_scheduler_when_calls_wait_while_slots_sit_idle() -> None:
    trace = Trace()
    # cap 4, never more than one call in flight, and always someone waiting.
    for n in range(6):
        trace.call(0, admitted_ms=100 * n, queue=100 * n, stream=100)
        trace.spans[-1]["attributes"] += document_attributes(
            {names.LIMITER_NAME: "chat", names.LIMITER_CAP: 4}
        )
    triage = report_of(trace).triage
    assert triage is not None
    assert (triage.dominant, triage.finding) == ("queue", FINDING_STALLED)
    assert "gap_fraction 1.00" in triage.message
    assert "a stalled scheduler" in triage.message


def test_an_app_stage_dominates_with_its_own_time_not_the_llm_call_nested_in_it() -> None:
    traces = []
    for _ in range(5):
        trace = Trace()
        turn = trace.span("turn chat", 0, 1000, **_keys({names.STAGE: names.STAGE_TURN}))
        tool = trace.span("execute_tool agent", 0, 900, turn, **_keys({names.STAGE: "tool"}))
        trace.call(100, parent=tool, first_token=50, stream=650)  # 700 ms inside the tool
        trace.span("retrieval search", 900, 1000, turn, **_keys({names.STAGE: "retrieval"}))
        traces.append(trace)
    report = report_of(*traces)
    parts = {part.label: part.per_trace.p95 for part in report.parts}
    assert parts["tool (stage)"] == pytest.approx(0.2)
    assert parts["stream (llm bucket)"] == pytest.approx(0.65)
    assert parts["unmarked time in turns"] == pytest.approx(0.0)
    assert report.triage is not None
    assert report.triage.dominant == "stream"
    assert report.slowest[0].rows[2].depth == 2  # turn > tool > call


def test_vllm_server_spans_split_first_token() -> None:
    traces = []
    for n in range(10):
        trace = Trace()
        call = trace.call(0, first_token=100.0 + n, stream=50)
        attempt = trace.spans[-1]
        attempt_id = trace.span("POST", 0, 150 + n, call, kind=3)
        trace.span(names.VLLM_SERVER_SPAN, 1, 149 + n, attempt_id, kind=2, **_keys({
            names.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.06, names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.03,
            names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.095,
        }))  # fmt: skip
        del attempt
        traces.append(trace)
    server = report_of(*traces).server
    assert server is not None
    assert server.calls == 10
    assert server.server_queue.p95 == pytest.approx(0.06)
    assert server.prefill.p95 == pytest.approx(0.03)
    assert server.network_other.p50 == pytest.approx(0.104 - 0.09)
    assert server.server_front_end is not None
    assert server.server_front_end.p50 == pytest.approx(0.095 - 0.09)
    assert server.network_and_client is not None
    assert server.network_and_client.p50 == pytest.approx(0.104 - 0.095)
    assert server.engines == ("newer",)
    assert server.first_token.p95 == pytest.approx(0.109)


def test_retry_amplification_and_connection_churn() -> None:
    traces = []
    for n in range(4):
        trace = Trace()
        trace.call(0, retry=300, first_token=10, stream=10)
        attributes = {
            names.RETRY_COUNT: n % 2, names.CONNECT_NEW: 1 + n % 2, names.RETRY_WASTED_OUTPUT_TOKENS: 3 * (n % 2),
        }  # fmt: skip
        if n % 2:
            attributes[names.RETRY_CAUSES] = ["http_429"]
        trace.spans[-1]["attributes"] += document_attributes(attributes)
        traces.append(trace)
    failed = Trace()
    failed.call(0, first_token=5)
    failed.spans[-1]["attributes"] += document_attributes({names.ERROR_TYPE: "RateLimitError", names.RETRY_COUNT: 2,
                                                          names.RETRY_CAUSES: ["http_429", "http_503"]})  # fmt: skip
    failed.spans[-1]["status"] = {"code": 2}
    report = report_of(*traces, failed)
    retries = report.retries
    assert (retries.calls, retries.successful, retries.failed, retries.attempts) == (5, 4, 1, 9)
    assert retries.attempts_per_success == pytest.approx(9 / 4)
    assert retries.causes == {"http_429": 3, "http_503": 1}
    assert retries.wasted_output_tokens == 6
    assert retries.error_types == {"RateLimitError": 1}
    assert report.connections.per_success == pytest.approx(6 / 4)
    assert report.triage is not None
    assert "2.25 attempts per success" in report.triage.message


def _calls_with_server_spans(streamed: int, whole: int) -> list[Trace]:
    """Calls of each kind with vLLM's span under them (newer engine): queue 20 ms, prefill 10 ms, decode
    60 ms; the front end hands the first token on at 35 ms (its e2e: 96 ms), the client's stream is 50 ms
    (the first token reached it 10 ms late and the rest caught up)."""
    server = {
        names.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.020, names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.010,
        names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.035, names.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: 0.060,
        names.GEN_AI_LATENCY_E2E: 0.096,
    }  # fmt: skip
    traces = []
    for n in range(streamed + whole):
        trace = Trace()
        if n < streamed:
            call = trace.call(0, first_token=40.0 + n, stream=50)
            trace.spans[-1]["attributes"] += document_attributes({names.GEN_AI_REQUEST_STREAM: True})
        else:
            call = trace.call(0, first_token=100.0 + n)
        trace.span(names.VLLM_SERVER_SPAN, 1, 97, call, kind=2, **_keys(server))
        traces.append(trace)
    return traces


def test_a_call_that_did_not_stream_shows_its_decode_as_a_row_and_every_part_is_labelled(
    tmp_path: Path,
) -> None:
    """A non-streamed call's first_token holds its whole answer: its decode is a row of its own (counted
    over those calls), not hidden in network and client, which for such a call is what followed the front
    end's e2e; every row is labelled in the text, the JSON and the HTML."""
    report = report_of(*_calls_with_server_spans(streamed=3, whole=2))
    server = report.server
    assert server is not None
    rows = {(row.bucket, row.part): row for row in server.rows}
    decode = rows[("first_token", "server_decode")]
    assert (decode.label, decode.calls, decode.values.count) == ("decode (not streamed)", "not_streamed", 2)
    assert decode.values.p50 == pytest.approx(0.060)
    network = rows[("first_token", "network_and_client")]
    assert network.values.count == 5
    # streamed: first_token - ttft (40..42 ms - 35); not streamed: first_token - e2e (103, 104 ms - 96)
    assert (network.values.p50, network.values.max) == (pytest.approx(0.007), pytest.approx(0.008))
    front_end = rows[("first_token", "server_front_end")]
    assert front_end.values.max == pytest.approx(0.096 - 0.020 - 0.010 - 0.060)  # not streamed: from e2e
    assert [row.label for row in server.rows if row.bucket == "stream"] == [
        "stream (client)", "server decode", "network and client",
    ]  # fmt: skip
    text = render_text(report)
    assert "first_token split by the server's llm_request spans (5 calls: 3 streamed, 2 not" in text
    (row,) = [line for line in text.splitlines() if line.startswith("  decode (not streamed)")]
    assert row.split() == ["decode", "(not", "streamed)", "2", "60", "ms", "60", "ms", "60", "ms", "60", "ms"]
    data = report.to_dict()["server"]
    assert all(row["label"] and row["calls"] for row in data["rows"])
    page = render_html(report)
    assert (
        'data-part="server_decode" data-calls="not_streamed"><td>decode (not streamed)</td><td>2</td>' in page
    )


def test_the_stream_residual_below_zero_is_explained() -> None:
    """The client's stream (first content chunk to last) was 10 ms shorter than the engine's decode: the
    first token reached the client late and the rest caught up; the report says what the residual means."""
    server = report_of(*_calls_with_server_spans(streamed=3, whole=0)).server
    assert server is not None
    assert server.stream_network_and_client is not None
    assert server.stream_network_and_client.p50 == pytest.approx(-0.010)
    (note,) = server.notes
    assert note.startswith("the stream's network and client is below zero at p50 (-10.0 ms)")
    assert "the first token came late" in note


def test_variability_is_compared_over_streamed_calls_only() -> None:
    """Streamed calls whose first_token and stream both vary little, and calls that did not stream, whose
    first_token is their whole answer (0.5 to 0.9 s): over all calls first_token would look 6x as variable
    as stream and send the reader to server queueing; over the streamed calls it is not, and the report
    says which calls it compared."""
    traces = []
    for n in range(10):
        streamed = Trace()
        streamed.call(0, first_token=100.0 + n, stream=50.0 + n)
        streamed.spans[-1]["attributes"] += document_attributes({names.GEN_AI_REQUEST_STREAM: True})
        whole = Trace()
        whole.call(0, first_token=500.0 + 40 * n)
        traces += [streamed, whole]
    report = report_of(*traces)
    variability = report.variability
    assert (variability.calls, variability.over) == (10, "streamed calls")
    assert variability.first_token_spread == pytest.approx(0.109 / 0.104)
    assert variability.stream_spread == pytest.approx(0.059 / 0.054)
    assert report.triage is not None
    assert report.triage.dominant == "first_token"
    assert "varies" not in report.triage.message
    assert not any("varies" in note for note in report.triage.notes)
    assert "TTFT vs stream variability over the 10 streamed calls (p95/p50)" in render_text(report)
    only_whole = report_of(*traces[1::2])
    assert only_whole.variability.calls == 0
    assert only_whole.variability.ratio is None
    assert "TTFT vs stream variability: no streamed calls to compare" in render_text(only_whole)


def test_churn_from_streams_closed_before_their_end_is_put_on_the_sdk() -> None:
    """Streamed and non-streamed calls taking turns: each stream was closed before its body's end (the
    openai SDK at [DONE]), so the non-streamed call after it opened the connection. Counted by the calls
    that opened them the churn would sit on the non-streamed calls; the streams closed early say where it
    comes from, and that reusing the client does not change it. Without such streams: reuse connections."""
    traces = []
    for n in range(6):
        streamed = Trace()
        streamed.call(0, first_token=10, stream=10)
        streamed.spans[-1]["attributes"] += document_attributes(
            {names.GEN_AI_REQUEST_STREAM: True, names.STREAM_CLOSED_BEFORE_END: True}
            | ({names.CONNECT_NEW: 1} if n == 0 else {})  # the first call of all opened the first connection
        )
        whole = Trace()
        whole.call(0, first_token=20)
        whole.spans[-1]["attributes"] += document_attributes({names.CONNECT_NEW: 1})
        traces += [streamed, whole]
    report = report_of(*traces)
    connections = report.connections
    assert connections.closed_before_end == 6
    assert connections.streamed is not None
    assert connections.not_streamed is not None
    assert (connections.streamed.new_connections, connections.not_streamed.new_connections) == (1, 6)
    assert report.triage is not None
    (note,) = [note for note in report.triage.notes if note.startswith("connection churn")]
    assert "6 of 6 streamed calls closed their response before the body's end" in note
    assert note.endswith("reusing the client does not change that")
    assert (
        "by the calls that opened them: streamed 0.17 (1 new, 6 successful), non-streamed 1.00"
        in " ".join(render_text(report).split())
    )
    for trace in traces[::2]:
        trace.spans[-1]["attributes"] = [
            a for a in trace.spans[-1]["attributes"] if a["key"] != names.STREAM_CLOSED_BEFORE_END
        ]
    plain = report_of(*traces).triage
    assert plain is not None
    assert "connection churn: 0.58 new connections per successful call; reuse connections" in plain.notes


# --- reading: the recorded file and the recorded Jaeger answer ------------------------------------


class _Jaeger(QuietHandler):
    """Answers `GET /api/v3/traces` like Jaeger v2: the recorded response for the recorded service, 404 else."""

    queries: list[dict[str, list[str]]]

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        self.server.queries.append(query)  # type: ignore[attr-defined]
        body = self.server.body  # type: ignore[attr-defined]
        if url.path == JAEGER_TRACES_PATH and query.get("query.serviceName") == [SERVICE]:
            self.reply(200, body)
        else:
            self.reply(404, b'{"error":{"httpCode":404,"message":"No traces found"}}')


@pytest.fixture
def jaeger() -> Iterator[ThreadingHTTPServer]:
    with serving(_Jaeger, queries=[], body=JAEGER_RESPONSE.read_bytes()) as server:
        yield server


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_recorded_file_and_the_recorded_jaeger_answer_give_identical_reports(
    jaeger: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, from_file, _ = run_cli(capsys, "report", *map(str, RECORDED), "--service", SERVICE, "--json")
    assert code == 0
    url = f"http://127.0.0.1:{jaeger.server_address[1]}"
    code, from_jaeger, err = run_cli(
        capsys, "report", "--jaeger", url, "--service", SERVICE, "--since", "2h", "--json"
    )
    assert code == 0, err
    file_report, jaeger_report = json.loads(from_file), json.loads(from_jaeger)
    assert file_report.pop("sources") != jaeger_report.pop("sources")
    assert file_report == jaeger_report
    assert file_report["traces"] == 10
    assert file_report["triage"]["dominant"] == "queue"
    assert file_report["server"]["calls"] == 10
    (query,) = jaeger.queries  # type: ignore[attr-defined]
    for canonical, deprecated in (("query.serviceName", "query.service_name"),
                                  ("query.startTimeMin", "query.start_time_min"),
                                  ("query.startTimeMax", "query.start_time_max")):  # fmt: skip
        assert query[canonical] == query[deprecated]
    assert query["query.startTimeMin"][0].endswith("Z")


def test_the_recorded_figures(capsys: pytest.CaptureFixture[str]) -> None:
    loaded = read_spans(RECORDED)
    assert loaded.skipped == []  # the metric lines are OTLP JSON too, just not spans
    report = analyse(loaded.spans)
    llm = next(row for row in report.stages if row.stage == names.STAGE_LLM)
    calls = [span for span in loaded.spans if span.stage == names.STAGE_LLM]
    assert llm.exceeded == sum(1 for call in calls if call.attributes[names.BUDGET_EXCEEDED])
    assert report.server is not None
    assert report.server.server_queue.p95 == pytest.approx(0.3 * report.server.first_token.p95)
    assert report.server.prefill.p95 == pytest.approx(0.6 * report.server.first_token.p95)
    (limiter,) = report.limiters
    assert (limiter.cap, limiter.calls) == (1, 10)
    assert limiter.gap_fraction < 0.05
    code, out, _ = run_cli(capsys, "report", *map(str, RECORDED))
    assert code == 0
    assert "Dominant at p95: queue (llm bucket)" in out
    assert "queue dominates: backlog or cap too low" in out
    assert "first_token split by the server's llm_request spans (10 calls; vLLM's newer engine)" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_jaeger_404_means_no_traces_not_an_error(
    jaeger: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{jaeger.server_address[1]}"
    code, out, err = run_cli(capsys, "report", "--jaeger", url, "--service", "nobody")
    assert (code, err) == (0, "")
    assert "No llmspans traces found" in out


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_unreachable_jaeger_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    code, out, err = run_cli(capsys, "report", "--jaeger", url, "--service", "chat")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert err.startswith(f"llmspans report: cannot reach Jaeger at {url}")


def test_jaeger_answering_something_else_is_a_one_line_error(
    jaeger: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str]
) -> None:
    jaeger.body = b"<html>not jaeger</html>"  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{jaeger.server_address[1]}"
    code, _, err = run_cli(capsys, "report", "--jaeger", url, "--service", SERVICE)
    assert code == 2
    assert err.count("\n") == 1
    assert "not JSON" in err
    jaeger.body = b'{"result": {"spans": []}}'  # type: ignore[attr-defined]
    code, _, err = run_cli(capsys, "report", "--jaeger", url, "--service", SERVICE)
    assert code == 2
    assert err.count("\n") == 1
    assert "not OTLP JSON" in err


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "empty file, no OTLP-JSON lines in it"),
        ("\n  \n", "empty file, no OTLP-JSON lines in it"),
        ("this is not json\n", "not OTLP JSON: line 1 is not JSON"),
        ('{"foo": 1}\n', "not OTLP JSON: line 1 is not OTLP JSON (an object without resourceSpans"),
        ("[1, 2]\n[3]\n", "not OTLP JSON: line 1 is not OTLP JSON (a JSON list, not an object"),
        ('{"resourceSpans": 3}\n', "resourceSpans is not a list"),
    ],
)
def test_bad_files_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, problem: str
) -> None:
    path = tmp_path / "traces.jsonl"
    path.write_text(content)
    code, out, err = run_cli(capsys, "report", str(path))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert err.startswith(f"llmspans report: {path}: ")
    assert problem in err


def test_missing_file_and_bad_arguments_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(names.ENV_TRACES_FILE, raising=False)
    for argv, problem in (
        (["report"], "no traces file at llmspans-traces.jsonl"),
        (["report", "nope.jsonl"], "nope.jsonl: no such file"),
        (["report", "--jaeger", "http://x"], "--jaeger needs --service NAME"),
        (["report", "--since", "soon", str(RECORDED[0])], "--since must be a positive duration"),
        (["report", "--budgets", "llm=fast", str(RECORDED[0])], "--budgets: budget for 'llm'"),
    ):
        code, out, err = run_cli(capsys, *argv)
        assert (code, out, err.count("\n")) == (2, "", 1), argv
        assert problem in err, (argv, err)


def test_a_partly_bad_file_reports_the_skipped_lines_and_continues(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = RECORDED[0].read_text().splitlines()
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([good[0], "{truncated", *good[1:], '{"unrelated": true}']) + "\n")
    code, out, err = run_cli(capsys, "report", str(path), "--json")
    assert code == 0
    bad_lines = [2, len(good) + 2]
    assert err == (
        f"llmspans report: skipped 2 line(s) of {path} ({bad_lines[0]}, {bad_lines[1]}); line 2 is not JSON "
        "(JSON is malformed: object keys must be strings (byte 1))\n"
    )
    report = json.loads(out)
    assert [skip["line"] for skip in report["skipped"]] == bad_lines
    assert report["traces"] == 10


def test_ids_in_base64_and_enum_names_are_read_too() -> None:
    trace = Trace()
    trace.call(0, stream=10)
    span = trace.spans[0]
    span["traceId"] = "AAAAAAAAAAEAAAAAAAAAAg=="
    span["spanId"] = "AAAAAAAAAAM="
    span["kind"] = "SPAN_KIND_CLIENT"
    (read,) = spans_of_document({"result": document(trace)}) or []
    assert (read.trace_id, read.span_id, read.kind) == (
        "00000000000000010000000000000002",
        "0000000000000003",
        3,
    )


def test_python_dash_m_llmspans_runs_the_report() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "llmspans", "report", *map(str, RECORDED), "--top", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("  turn chat\n") == 2


# --- the HTML page in headless Chromium -------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


@pytest.fixture
def chromium() -> str:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is required in CI (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return CHROMIUM


def _chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip


class _Elements(HTMLParser):
    """Every element of the rendered DOM with its attributes, and which <g class=bar> it sits in."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str], str | None]] = []
        self._bar: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {key: value or "" for key, value in attrs}
        bar = self._bar[-1] if self._bar else None
        if tag == "g":
            self._bar.append(attributes.get("data-quantile", bar))
        self.elements.append((tag, attributes, bar))

    def handle_endtag(self, tag: str) -> None:
        if tag == "g" and self._bar:
            self._bar.pop()

    def having(self, tag: str, css_class: str) -> list[tuple[dict[str, str], str | None]]:
        return [
            (a, bar) for t, a, bar in self.elements if t == tag and css_class in a.get("class", "").split()
        ]


def test_the_html_page_renders_its_charts_in_headless_chromium(chromium: str, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    report = analyse(read_spans(RECORDED).spans, top=3)
    html = render_html(report)
    for reference in ("<script", "src=", "href=", "url(", "@import"):
        assert reference not in html  # self-contained: nothing to fetch
    page.write_text(html)
    dumped = _chromium(chromium, tmp_path / "profile", "--dump-dom", page.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = _Elements()
    dom.feed(dumped.stdout)

    segments = dom.having("rect", "segment")
    bars = sorted({bar for _, bar in segments if bar})
    assert bars == ["p50", "p95", "p99"]
    for bar in bars:
        in_bar = [attributes["data-part"] for attributes, where in segments if where == bar]
        assert in_bar == [f"{part.kind}:{part.name}" for part in report.parts]  # one segment per part
        assert [p.split(":")[1] for p in in_bar if p.startswith("bucket:")] == list(names.BUCKETS)
    widths = {a["data-part"]: float(a["width"]) for a, bar in segments if bar == "p95"}
    assert max(widths, key=widths.__getitem__) == "bucket:queue"

    budget_lines = {a["data-stage"]: float(a["data-budget"]) for a, _ in dom.having("line", "budget-line")}
    assert budget_lines == {row.stage: row.budget for row in report.stages if row.budget is not None}
    assert {a["data-stage"] for a, _ in dom.having("svg", "stage-dist")} == {
        row.stage for row in report.stages
    }
    waterfalls = [a["data-trace-id"] for a, _ in dom.having("svg", "waterfall")]
    assert waterfalls == [slow.trace_id for slow in report.slowest]
    assert len(dom.having("rect", "wf-segment")) == 3 * len(names.BUCKETS)
    (dominant,) = dom.having("span", "dominant")
    assert dominant[0]["data-part"] == "bucket:queue"

    shot = tmp_path / "report.png"
    taken = _chromium(
        chromium, tmp_path / "profile", "--window-size=1000,1600", f"--screenshot={shot}", page.as_uri()
    )
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 20_000  # charts, not a blank page
    if os.environ.get("LLMSPANS_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["LLMSPANS_KEEP_SCREENSHOT"])


# --- the shapes other changes give the spans ---------------------------------------------------------


def test_calls_without_attempt_spans_and_with_phase_spans_are_read_like_any_other() -> None:
    # A first attempt that succeeded has no attempt span, so vLLM's span is the call's own child; a slow
    # call has phase spans (llmspans.phase, no stage) under it. Neither is a stage; both are walked through.
    traces = []
    for n in range(10):
        trace = Trace()
        turn = trace.span("turn chat", 0, 400, **_keys({names.STAGE: names.STAGE_TURN}))
        call = trace.call(10, parent=turn, first_token=300.0 + n, stream=50)
        trace.span("waiting for the first token", 10, 310 + n, call, **{"llmspans__phase": "first_token"})
        phase = trace.span("streaming", 310 + n, 360 + n, call, **{"llmspans__phase": "stream"})
        trace.span(names.VLLM_SERVER_SPAN, 12, 350 + n, call if n % 2 else phase, kind=2, **_keys({
            names.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.1, names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.15,
            names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.26,
        }))  # fmt: skip
        traces.append(trace)
    report = report_of(*traces)
    assert [row.stage for row in report.stages] == [names.STAGE_LLM, names.STAGE_TURN]
    assert report.spans == 50
    assert report.server is not None
    assert report.server.calls == 10
    assert report.server.prefill.p95 == pytest.approx(0.15)
    assert report.triage is not None
    assert report.triage.dominant == "first_token"


def test_seconds_carry_no_float_noise() -> None:
    trace = Trace()
    call = trace.call(0, first_token=100, stream=50)
    trace.spans[-1]["attributes"] = [
        attribute
        for attribute in trace.spans[-1]["attributes"]
        if attribute["key"] not in (names.BUCKET_PREFIX + "queue", names.BUCKET_PREFIX + "retry")
    ] + document_attributes(
        {
            names.BUCKET_PREFIX + "queue": 0.00009831400000000001,
            names.BUCKET_PREFIX + "retry": 1.0594113550000002,
        }
    )
    del call
    data = report_of(trace).to_dict()
    buckets = {row["bucket"]: row["values"]["p50"] for row in data["buckets"]}
    assert (buckets["queue"], buckets["retry"]) == (0.000098314, 1.059411355)
    assert repr(buckets["queue"]) == "9.8314e-05"


def test_the_slowest_traces_never_lose_a_figure_or_its_unit() -> None:
    traces = []
    for n in range(3):
        trace = Trace()
        root = trace.span("turn a-very-long-name-for-a-turn-that-goes-on-and-on", 0, 2970 + n,
                          **_keys({names.STAGE: names.STAGE_TURN}))  # fmt: skip
        trace.span("tool", 0, 866, root, **_keys({names.STAGE: "an_extremely_long_custom_stage_name"}))
        trace.call(866, parent=root, first_token=2000 + n, stream=100)
        traces.append(trace)
    from llmspans.report._text import render as render_text

    text = render_text(report_of(*traces))
    lines = text.split("Slowest traces\n", 1)[1].splitlines()[1:]
    assert len(lines) == 3
    for line in lines:
        assert len(line) <= 100
        figures = line.split()[:4]
        assert figures[1] in ("s", "ms"), line  # "2.97 s": the duration whole, with its unit
        assert figures[3] in ("s", "ms"), line  # and the dominant part's figure too
        assert "…" in line  # the long root name is what gave way


# --- the progress bar -----------------------------------------------------------------------------------


class _Terminal:
    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.written: list[str] = []

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        self.written.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_the_progress_bar_shows_only_on_a_terminal_after_a_second() -> None:
    from llmspans.report._progress import Progress

    now = [0.0]
    terminal = _Terminal(tty=True)
    bar = Progress(100_000_000, "reading", stream=terminal, clock=lambda: now[0])  # type: ignore[arg-type]
    for step in range(1, 10):  # 0.9 s: a short read draws nothing
        now[0] = step / 10
        bar.update(step * 1_000_000)
    assert terminal.written == []
    now[0] = 1.5
    bar.update(50_000_000)
    assert terminal.written[-1].startswith("\rreading [")
    assert " 50% " in terminal.written[-1]
    bar.finish()
    assert terminal.written[-1] == "\r\033[K"  # erased: stdout's report follows on a clean line

    piped = _Terminal(tty=False)
    bar = Progress(100_000_000, "reading", stream=piped, clock=lambda: now[0])  # type: ignore[arg-type]
    now[0] = 10.0
    bar.update(90_000_000)
    bar.finish()
    assert piped.written == []


def test_the_file_reader_feeds_the_progress_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmspans.report import _progress
    from llmspans.report._sources.file import FileSource

    seen: list[int] = []
    monkeypatch.setattr(_progress.Progress, "update", lambda self, done: seen.append(done))
    source = FileSource(RECORDED)
    assert sum(len(batch) for batch in source.batches()) == 90
    assert len(seen) >= 2
    assert seen == sorted(seen)  # bytes read so far, across both files
    assert RECORDED[0].stat().st_size < seen[-1] <= sum(path.stat().st_size for path in RECORDED)
