"""vLLM: one trace from client to server, vLLM's usage chunks, and the server-state sampler.

Everything runs over real HTTP on 127.0.0.1 against the simulated vLLM server
(tests/support/vllm_sim.py), whose `llm_request` spans go over OTLP/HTTP to a receiver the
test runs. Server-span figures are compared with the simulator's own records (the same
numbers, so exactly) and with what its scheduler was told to do (within TOLERANCE: a loaded
2-core machine oversleeps, and the records show by how much).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import SimulatedServer
from llmspans.vllm import ServerMetrics, ServerSnapshot, looks_like_vllm
from tests.support.vllm_sim import FAMILIES, EngineConfig, OTLPReceiver, ReceivedSpan, VLLMSimulator
from tests.timing import retry_timing

MODEL = EngineConfig().model
TOLERANCE = 0.030
SAMPLER_THREAD = "llmspans-vllm-metrics"
OTLP_SERVER = 2  # SpanKind in the OTLP protobuf enum


def eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll until `predicate()` holds; what a sleep would assume, checked instead."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def sampler_log(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "llmspans.vllm" and r.levelno >= level]


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as running:
        yield running


@contextmanager
def vllm(receiver: OTLPReceiver | None = None, **config: Any) -> Iterator[VLLMSimulator]:
    endpoint = receiver.traces_url if receiver is not None else None
    with VLLMSimulator(EngineConfig(**config), otlp_traces_endpoint=endpoint) as sim:
        yield sim


def client_for(sim: VLLMSimulator, **kwargs: Any) -> openai.OpenAI:
    return llmspans.instrument(
        openai.OpenAI(base_url=sim.base_url, api_key="sk-test", max_retries=0), provider="vllm", **kwargs
    )


def ask(content: str = "count to five please") -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def call_spans(captured: Captured) -> list[Any]:
    return [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]


def only_call_span(captured: Captured) -> Any:
    spans = call_spans(captured)
    assert len(spans) == 1, [s.name for s in captured.spans]
    return spans[0]


def no_attempt_span_under(captured: Captured, call: Any) -> None:
    """A call answered by its first attempt has no attempt span: the server's span is the call's child."""
    children = [
        s for s in captured.spans if s.parent is not None and s.parent.span_id == call.context.span_id
    ]
    assert children == [], [s.name for s in children]


def server_spans(sim: VLLMSimulator, receiver: OTLPReceiver, count: int) -> list[ReceivedSpan]:
    assert sim.wait_idle()
    assert sim.flush_traces()
    return receiver.wait_for_spans(names.VLLM_SERVER_SPAN, count)


def streamed_calls_at_once(client: openai.OpenAI, count: int, max_tokens: int, timeout: float) -> None:
    """`count` streamed calls sent together, one a thread, each read to its end (its span ends there)."""

    def call() -> None:
        for _ in client.chat.completions.create(
            model=MODEL, messages=ask(), stream=True, max_tokens=max_tokens
        ):
            pass

    threads = [threading.Thread(target=call) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)


def hex_id(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def raw_stream(sim: VLLMSimulator, body: dict[str, Any], path: str = "/chat/completions") -> list[Any]:
    """The decoded `data:` payloads of one streamed answer, `[DONE]` included as a string."""
    events: list[Any] = []
    with httpx.stream("POST", sim.base_url + path, json=body, timeout=10) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def sampler_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == SAMPLER_THREAD}


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def load(sim: VLLMSimulator, requests: int, max_tokens: int) -> Iterator[list[threading.Thread]]:
    """`requests` concurrent streamed requests from uninstrumented threads; joined on exit."""
    body = {"model": MODEL, "messages": ask("one two three"), "stream": True, "max_tokens": max_tokens}
    threads = [threading.Thread(target=raw_stream, args=(sim, body), daemon=True) for _ in range(requests)]
    for thread in threads:
        thread.start()
    try:
        yield threads
    finally:
        for thread in threads:
            thread.join(10)


# --- the simulator is faithful to vLLM's wire format ------------------------------------------


def test_stream_carries_no_usage_unless_asked() -> None:
    with vllm() as sim:
        events = raw_stream(sim, {"model": MODEL, "messages": ask(), "stream": True, "max_tokens": 3})
    chunks = events[:-1]
    assert events[-1] == "[DONE]"
    assert all("usage" not in chunk for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:]] == ["Hello", ",", " this"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:]] == [None, None, "length"]


def test_include_usage_adds_one_final_chunk_with_no_choices() -> None:
    with vllm() as sim:
        body = {"model": MODEL, "messages": ask("a b c"), "stream": True, "max_tokens": 3}
        events = raw_stream(sim, body | {"stream_options": {"include_usage": True}})
    *chunks, final, done = events
    assert done == "[DONE]"
    assert all("usage" not in chunk for chunk in chunks)
    assert final["choices"] == []
    assert final["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_continuous_usage_stats_put_cumulative_usage_on_every_chunk() -> None:
    with vllm() as sim:
        options = {"include_usage": True, "continuous_usage_stats": True}
        body = {"model": MODEL, "prompt": "a b c", "stream": True, "max_tokens": 3, "stream_options": options}
        events = raw_stream(sim, body, "/completions")
        ignored = raw_stream(sim, body | {"stream_options": {"continuous_usage_stats": True}}, "/completions")
    *chunks, final, _done = events
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hello", ",", " this"]
    assert final["choices"] == []
    assert final["usage"]["completion_tokens"] == 3
    assert all("usage" not in c for c in ignored[:-1])  # without include_usage, vLLM ignores it


def test_stream_options_without_stream_is_rejected_as_vllm_does() -> None:
    with vllm() as sim:
        body = {"model": MODEL, "messages": ask(), "stream_options": {"include_usage": True}}
        response = httpx.post(sim.base_url + "/chat/completions", json=body)
    assert response.status_code == 400
    assert "stream=True" in response.json()["error"]["message"]


def test_models_are_owned_by_vllm_and_recognised() -> None:
    with vllm() as sim, SimulatedServer() as plain:
        assert looks_like_vllm(httpx.get(sim.base_url + "/models").json())
        assert not looks_like_vllm(httpx.get(plain.base_url + "/models").json())
    for payload in ({}, {"data": None}, {"data": ["vllm"]}, {"data": [{"owned_by": "openai"}]}, None, []):
        assert not looks_like_vllm(payload)  # type: ignore[arg-type]


# --- one trace: the server's span under the call span -----------------------------------------


def check_server_span(server: ReceivedSpan, record: Any, config: EngineConfig) -> None:
    """The span's figures are vLLM's formulas over the simulator's own stamps."""
    attrs = server.attributes
    assert server.kind == OTLP_SERVER
    assert attrs[names.GEN_AI_REQUEST_ID] == record.request_id
    assert attrs[names.GEN_AI_LATENCY_TIME_IN_QUEUE] == pytest.approx(
        record.scheduled_ts - record.queued_ts, abs=1e-9
    )
    assert attrs[names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] == pytest.approx(
        record.first_token_ts - record.arrival, abs=1e-9
    )
    prefill = attrs[names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL]
    decode = attrs[names.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE]
    assert prefill == pytest.approx(record.first_token_ts - record.scheduled_ts, abs=1e-9)
    assert decode == pytest.approx(record.last_token_ts - record.first_token_ts, abs=1e-9)
    assert attrs[names.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] == pytest.approx(prefill + decode, abs=1e-9)
    assert attrs[names.GEN_AI_LATENCY_E2E] == pytest.approx(record.finished_ts - record.arrival, abs=1e-9)
    assert attrs[names.GEN_AI_USAGE_PROMPT_TOKENS] == record.prompt_tokens
    assert attrs[names.GEN_AI_USAGE_COMPLETION_TOKENS] == record.target_tokens
    # ... and those stamps follow what the scheduler was told.
    expected_prefill = (record.prompt_tokens - record.cached_tokens) * config.prefill_per_token
    expected_decode = (record.target_tokens - 1) * config.decode_per_token
    assert expected_prefill - 0.001 <= prefill <= expected_prefill + TOLERANCE
    assert expected_decode - 0.001 <= decode <= expected_decode + TOLERANCE
    # Backdated to the arrival: the span covers the whole request, queue included.
    assert (server.end_ns - server.start_ns) * 1e-9 == pytest.approx(
        attrs[names.GEN_AI_LATENCY_E2E], abs=0.002
    )


@retry_timing
def test_server_span_is_a_child_of_the_call_span(receiver: OTLPReceiver, captured: Captured) -> None:
    config = {"prefill_per_token": 0.002, "decode_per_token": 0.01}
    with vllm(receiver, **config) as sim:
        stream = client_for(sim).chat.completions.create(
            model=MODEL, messages=ask(), stream=True, max_tokens=4, temperature=0.5, top_p=0.9
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Hello, this is"
        (server,) = server_spans(sim, receiver, 1)
        (record,) = sim.requests
    call = only_call_span(captured)
    no_attempt_span_under(captured, call)
    assert server.trace_id == hex_id(call.context.trace_id, 32)
    assert server.parent_span_id == hex_id(call.context.span_id, 16)
    assert server.service_name == "vllm"
    assert call.attributes[names.GEN_AI_PROVIDER_NAME] == names.PROVIDER_VLLM
    assert call.attributes[names.GEN_AI_RESPONSE_ID] == server.attributes[names.GEN_AI_REQUEST_ID]
    check_server_span(server, record, EngineConfig(**config))
    attrs = server.attributes
    assert json.loads(attrs[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["length"]
    assert attrs[names.GEN_AI_REQUEST_MAX_TOKENS] == 4
    assert attrs[names.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert attrs[names.GEN_AI_REQUEST_TOP_P] == 0.9
    assert attrs[names.GEN_AI_REQUEST_N] == 1
    # The server's time sits inside the call's (same machine, same wall clock).
    assert call.start_time <= server.start_ns
    assert server.end_ns <= call.end_time


async def test_async_client_and_non_streamed_completion_are_linked_too(
    receiver: OTLPReceiver, captured: Captured
) -> None:
    with vllm(receiver) as sim:
        client = llmspans.instrument(
            openai.AsyncOpenAI(base_url=sim.base_url, api_key="sk-test", max_retries=0), provider="vllm"
        )
        completion = await client.completions.create(model=MODEL, prompt="say hi", temperature=0)
        await client.close()
        (server,) = server_spans(sim, receiver, 1)
    call = only_call_span(captured)
    assert completion.usage is not None
    no_attempt_span_under(captured, call)
    assert server.parent_span_id == hex_id(call.context.span_id, 16)
    assert json.loads(server.attributes[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop"]
    # vLLM writes a sampling parameter only when it is truthy after its defaults.
    assert names.GEN_AI_REQUEST_TEMPERATURE not in server.attributes
    assert names.GEN_AI_REQUEST_MAX_TOKENS not in server.attributes
    assert (
        call.attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS]
        == server.attributes[names.GEN_AI_USAGE_COMPLETION_TOKENS]
    )


def test_plain_httpx_client_is_linked_too(receiver: OTLPReceiver, captured: Captured) -> None:
    with vllm(receiver) as sim:
        client = llmspans.instrument(httpx.Client(base_url=sim.base_url), provider="vllm")
        options = {"include_usage": True, "continuous_usage_stats": True}
        body = {"model": MODEL, "messages": ask(), "stream": True, "max_tokens": 5, "stream_options": options}
        with client.stream("POST", "/chat/completions", json=body) as response:
            for _ in response.iter_lines():
                pass
        client.close()
        (server,) = server_spans(sim, receiver, 1)
    call = only_call_span(captured)
    assert call.attributes[names.GEN_AI_PROVIDER_NAME] == names.PROVIDER_VLLM
    assert call.attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    assert server.parent_span_id == hex_id(call.context.span_id, 16)


@retry_timing
def test_queue_time_when_more_requests_than_max_num_seqs(receiver: OTLPReceiver, captured: Captured) -> None:
    config = EngineConfig(max_num_seqs=1, prefill_per_token=0.005, decode_per_token=0.02)
    calls = 3
    with VLLMSimulator(config, otlp_traces_endpoint=receiver.traces_url) as sim:
        client = client_for(sim)
        client.models.list()  # not an LLM call: warms the connection pool's code paths
        streamed_calls_at_once(client, calls, max_tokens=4, timeout=10)
        spans = server_spans(sim, receiver, calls)
        records = sorted(sim.requests, key=lambda r: r.scheduled_ts)
    by_id = {span.attributes[names.GEN_AI_REQUEST_ID]: span for span in spans}
    service = 4 * config.prefill_per_token + 3 * config.decode_per_token  # 4 prompt words, 4 tokens
    for position, record in enumerate(records):
        server = by_id[record.request_id]
        check_server_span(server, record, config)
        if position:
            # Granted the slot the moment the previous request finished.
            assert record.scheduled_ts - records[position - 1].finished_ts < 0.002
        spread = record.queued_ts - records[0].queued_ts  # the threads did not arrive at one instant
        queue = server.attributes[names.GEN_AI_LATENCY_TIME_IN_QUEUE]
        assert position * service - spread - 0.002 <= queue <= position * (service + TOLERANCE) + 0.002
    # Each call's wait for its first token holds the server's queue and prefill.
    call_by_id = {c.attributes[names.GEN_AI_RESPONSE_ID]: c for c in call_spans(captured)}
    assert set(call_by_id) == set(by_id)
    for request_id, server in by_id.items():
        first_token = call_by_id[request_id].attributes[names.BUCKET_PREFIX + "first_token"]
        assert first_token >= server.attributes[names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] - 0.002
        assert server.parent_span_id == hex_id(call_by_id[request_id].context.span_id, 16)


# --- usage chunks into the call span ------------------------------------------------------------


def test_include_usage_reaches_the_call_span(captured: Captured) -> None:
    with vllm() as sim:
        stream = client_for(sim).chat.completions.create(
            model=MODEL, messages=ask("a b c d e"), stream=True, max_tokens=6,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
    assert chunks[-1].choices == []
    attrs = only_call_span(captured).attributes
    assert attrs[names.GEN_AI_USAGE_INPUT_TOKENS] == 5
    assert attrs[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 6
    assert attrs[names.STREAM_CHUNKS] == 6


def test_request_usage_asks_vllm_for_usage(captured: Captured) -> None:
    with vllm() as sim:
        stream = client_for(sim, request_usage=True).chat.completions.create(
            model=MODEL, messages=ask(), stream=True, max_tokens=3
        )
        chunks = list(stream)
    assert all(chunk.choices for chunk in chunks)  # the usage chunk we asked for is not shown to the app
    assert only_call_span(captured).attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 3


@pytest.mark.parametrize("operation", ["chat", "completions"])
def test_continuous_usage_stats_reach_the_call_span(captured: Captured, operation: str) -> None:
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    with vllm(decode_per_token=0.005) as sim:
        client = client_for(sim)
        if operation == "chat":
            stream: Any = client.chat.completions.create(
                model=MODEL, messages=ask(), stream=True, max_tokens=7, stream_options=options
            )
        else:
            stream = client.completions.create(
                model=MODEL, prompt="count to five please", stream=True, max_tokens=7, stream_options=options
            )
        usages = [chunk.usage.completion_tokens for chunk in stream]
    assert usages[-2:] == [7, 7]  # the last content chunk, then the usage chunk
    attrs = only_call_span(captured).attributes
    assert attrs[names.GEN_AI_USAGE_INPUT_TOKENS] == 4
    assert attrs[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 7
    assert attrs[names.STREAM_OUTCOME] == names.OUTCOME_COMPLETED


def test_continuous_usage_counts_the_tokens_of_an_abandoned_stream(captured: Captured) -> None:
    with vllm(decode_per_token=0.005) as sim:
        stream = client_for(sim).chat.completions.create(
            model=MODEL, messages=ask(), stream=True, max_tokens=12,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )  # fmt: skip
        content = 0
        for chunk in stream:
            content += bool(chunk.choices and chunk.choices[0].delta.content)
            if content == 3:
                break
        stream.close()
    attrs = only_call_span(captured).attributes
    assert attrs[names.STREAM_OUTCOME] == names.OUTCOME_ABANDONED
    assert attrs[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 3  # exact, though the final usage never came


# --- ServerMetrics --------------------------------------------------------------------------------


def test_the_module_exports_exactly_its_public_names() -> None:
    import llmspans.vllm as module

    defined_here = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    }
    assert module.__all__ == sorted(defined_here) == ["ServerMetrics", "ServerSnapshot", "looks_like_vllm"]


def test_without_prometheus_client_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client.parser", None)
    with pytest.raises(ImportError, match=r"pip install 'llmspans\[vllm\]'"):
        ServerMetrics("http://127.0.0.1:1/v1")


def test_metrics_url_is_derived_from_the_server_root() -> None:
    for base_url, expected in [
        ("http://127.0.0.1:{p}", "http://127.0.0.1:{p}/metrics"),
        ("http://127.0.0.1:{p}/", "http://127.0.0.1:{p}/metrics"),
        ("http://127.0.0.1:{p}/v1", "http://127.0.0.1:{p}/metrics"),
        ("http://127.0.0.1:{p}/v1/", "http://127.0.0.1:{p}/metrics"),
        ("http://127.0.0.1:{p}/proxy/vllm/v1?x=1", "http://127.0.0.1:{p}/proxy/vllm/metrics"),
    ]:
        port = closed_port()
        with ServerMetrics(base_url.format(p=port), interval=60, timeout=0.05) as sampler:
            assert sampler.metrics_url == expected.format(p=port)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"base_url": 8000}, TypeError, "base_url must be a str"),
        ({"base_url": "127.0.0.1:8000"}, ValueError, "base_url must be an http(s) URL"),
        ({"base_url": "ftp://host/v1"}, ValueError, "base_url must be an http(s) URL"),
        ({"base_url": "http://h:99999/v1"}, ValueError, "invalid port"),
        ({"interval": "1"}, TypeError, "interval must be a number of seconds"),
        ({"interval": True}, TypeError, "interval must be a number of seconds"),
        ({"interval": 0}, ValueError, "interval must be a positive, finite number"),
        ({"interval": math.inf}, ValueError, "interval must be a positive, finite number"),
        ({"timeout": -1}, ValueError, "timeout must be a positive, finite number"),
    ],
)
def test_arguments_are_validated(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    before = sampler_threads()
    arguments: dict[str, Any] = {"base_url": "http://127.0.0.1:1/v1"} | kwargs
    base_url = arguments.pop("base_url")
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        ServerMetrics(base_url, **arguments)
    assert sampler_threads() == before  # nothing started


@retry_timing
def test_samples_the_scheduler_state() -> None:
    """Two running, two waiting: the sample says so, and says what the server's page said."""
    with vllm(max_num_seqs=2, decode_per_token=0.15, num_kv_blocks=64) as sim, load(sim, 4, max_tokens=6):
        assert sim.wait_for_state(lambda waiting, running: (waiting, running) == (2, 2))
        with ServerMetrics(sim.base_url, interval=0.05, timeout=0.5) as sampler:
            assert sampler.wait_for_sample(1.0)
            snapshot, attributes = sampler.snapshot, sampler.span_attributes()
            waiting, running, kv_cache_usage = sim.state()
            scrapes = sim.scrapes
    assert (waiting, running) == (2, 2)  # the window held while we looked
    assert isinstance(snapshot, ServerSnapshot)
    assert (snapshot.num_requests_waiting, snapshot.num_requests_running) == (2, 2)
    assert snapshot.kv_cache_usage == kv_cache_usage == 2 / 64  # one 16-token block per running request
    assert (scrapes[-1].num_requests_waiting, scrapes[-1].num_requests_running) == (2, 2)
    assert abs(snapshot.sampled_at - time.time()) < 2
    assert set(attributes) == {
        names.VLLM_NUM_REQUESTS_WAITING, names.VLLM_NUM_REQUESTS_RUNNING, names.VLLM_KV_CACHE_USAGE,
        names.VLLM_METRICS_AGE,
    }  # fmt: skip
    assert attributes[names.VLLM_NUM_REQUESTS_WAITING] == 2
    assert attributes[names.VLLM_NUM_REQUESTS_RUNNING] == 2
    assert type(attributes[names.VLLM_NUM_REQUESTS_RUNNING]) is int
    assert attributes[names.VLLM_KV_CACHE_USAGE] == 2 / 64
    assert 0 <= attributes[names.VLLM_METRICS_AGE] < 0.5


def test_falls_back_to_the_older_gpu_cache_gauge() -> None:
    config = {"version": FAMILIES["0.8/0.9"], "max_num_seqs": 1, "decode_per_token": 0.1, "num_kv_blocks": 4}
    with vllm(**config) as sim, load(sim, 1, max_tokens=5):
        assert sim.wait_for_state(lambda waiting, running: running == 1)
        with ServerMetrics(sim.url, interval=0.05) as sampler:
            assert sampler.wait_for_sample(1.0)
            assert sampler.span_attributes()[names.VLLM_KV_CACHE_USAGE] == 0.25


class _Static(BaseHTTPRequestHandler):
    """Serves `server.page` at /metrics with `server.status`."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        server: Any = self.server
        body = server.page.encode()
        self.send_response(server.status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def static_metrics() -> Iterator[Any]:
    server: Any = ThreadingHTTPServer(("127.0.0.1", 0), _Static)
    server.daemon_threads = True
    server.status, server.page = 200, ""
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


MULTI_SERIES = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 3.0
vllm:num_requests_running{engine="1",model_name="a"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a"} 1.0
vllm:num_requests_waiting{engine="1",model_name="a"} 5.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="a"} 0.99
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.75
"""


def test_counts_are_summed_over_series_and_kv_cache_is_the_fullest_engine(static_metrics: Any) -> None:
    static_metrics.page = MULTI_SERIES
    with ServerMetrics(static_metrics.url + "/v1", interval=0.05) as sampler:
        assert sampler.wait_for_sample(1.0)
        attributes = sampler.span_attributes()
    assert attributes[names.VLLM_NUM_REQUESTS_RUNNING] == 7
    assert attributes[names.VLLM_NUM_REQUESTS_WAITING] == 6
    assert attributes[names.VLLM_KV_CACHE_USAGE] == 0.75  # the current gauge wins over the older one


@contextmanager
def traffic(sim: VLLMSimulator, prompt: str = "one two three") -> Iterator[None]:
    """Short requests one after another from an uninstrumented thread, until the block ends, so
    every sampling interval sees prompts looked up in the prefix cache."""
    done = threading.Event()
    body = {"model": MODEL, "messages": ask(prompt), "max_tokens": 1}

    def loop() -> None:
        with httpx.Client(base_url=sim.base_url, timeout=10) as plain:
            while not done.is_set():
                plain.post("/chat/completions", json=body)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(10)


BASE_SAMPLE = {
    names.VLLM_NUM_REQUESTS_WAITING, names.VLLM_NUM_REQUESTS_RUNNING, names.VLLM_KV_CACHE_USAGE,
    names.VLLM_METRICS_AGE,
}  # fmt: skip
PREEMPTION, PREFIX_RATIO = {names.VLLM_PREEMPTION_RATE}, {names.VLLM_PREFIX_CACHE_HIT_RATIO}
ONLY_0_32 = {
    names.VLLM_NUM_REQUESTS_WAITING_FOR_CAPACITY, names.VLLM_NUM_REQUESTS_WAITING_DEFERRED,
    names.VLLM_ADMISSION_REJECTION_RATE,
}  # fmt: skip
# (family, tracing) -> the span attributes a sampler of that server gives, under steady traffic
SAMPLED: dict[tuple[str, bool], set[str]] = {
    ("0.8/0.9", True): BASE_SAMPLE | PREEMPTION,  # the older engine: no prefix-cache counters
    ("0.8/0.9", False): BASE_SAMPLE | PREFIX_RATIO,  # gpu_prefix_cache_*, no preemption counter yet
    ("0.10", True): BASE_SAMPLE | PREEMPTION,
    ("0.10", False): BASE_SAMPLE | PREEMPTION | PREFIX_RATIO,
    ("0.11", True): BASE_SAMPLE | PREEMPTION | PREFIX_RATIO,
    ("0.12/0.13", False): BASE_SAMPLE | PREEMPTION | PREFIX_RATIO,
    ("0.32/0.33", False): BASE_SAMPLE | PREEMPTION | PREFIX_RATIO | ONLY_0_32,
}


@pytest.mark.parametrize(
    "page", list(SAMPLED), ids=lambda key: f"{key[0]}-{'tracing' if key[1] else 'no-tracing'}"
)
def test_the_sampler_reads_what_each_release_exposes(
    page: tuple[str, bool], receiver: OTLPReceiver, captured: Captured
) -> None:
    family, tracing = page
    expected = SAMPLED[page]
    seen: set[str] = set()
    with (
        vllm(receiver if tracing else None, version=FAMILIES[family]) as sim,
        traffic(sim),
        ServerMetrics(sim.base_url, interval=0.05) as sampler,
    ):

        def complete() -> bool:
            seen.update(sampler.span_attributes())
            return expected <= seen

        eventually(complete)
        for _ in range(5):
            assert sampler.wait_for_sample(1.0)
            seen.update(sampler.span_attributes())
        gauges = {p.name for p in captured.metric_points() if p.name.startswith("vllm.")}
    assert seen == expected
    assert gauges <= expected - {names.VLLM_METRICS_AGE}


def test_gauges_are_exported_with_the_server_address(captured: Captured) -> None:
    every_gauge = {
        names.METRIC_VLLM_NUM_REQUESTS_WAITING, names.METRIC_VLLM_NUM_REQUESTS_RUNNING,
        names.METRIC_VLLM_KV_CACHE_USAGE, names.METRIC_VLLM_PREEMPTION_RATE, names.METRIC_VLLM_PREFIX_CACHE_HIT_RATIO,
        names.METRIC_VLLM_NUM_REQUESTS_WAITING_FOR_CAPACITY, names.METRIC_VLLM_NUM_REQUESTS_WAITING_DEFERRED,
        names.METRIC_VLLM_ADMISSION_REJECTION_RATE,
    }  # fmt: skip
    points: dict[str, Any] = {}
    with vllm(version=FAMILIES["0.32/0.33"]) as sim, traffic(sim), ServerMetrics(sim.base_url, interval=0.05):

        def all_exported() -> bool:
            points.update({p.name: p for p in captured.metric_points() if p.name.startswith("vllm.")})
            return set(points) == every_gauge

        eventually(all_exported)
    for point in points.values():
        assert dict(point.attributes) == {names.SERVER_ADDRESS: "127.0.0.1", names.SERVER_PORT: sim.port}
    assert points[names.METRIC_VLLM_PREFIX_CACHE_HIT_RATIO].unit == "1"
    assert points[names.METRIC_VLLM_PREEMPTION_RATE].unit == "{preemption}/s"


def reading(page: str, at: float) -> Any:
    from llmspans.vllm import _Reading

    return _Reading.parse(text_string_to_metric_families(page), at)


COUNTERS_AT = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="a"}} 1.0
vllm:num_requests_running{{engine="1",model_name="a"}} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="a"}} 3.0
vllm:num_requests_waiting{{engine="1",model_name="a"}} 1.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{{engine="0",model_name="a",reason="capacity"}} 2.0
vllm:num_requests_waiting_by_reason{{engine="0",model_name="a",reason="deferred"}} 1.0
vllm:num_requests_waiting_by_reason{{engine="1",model_name="a",reason="capacity"}} 1.0
vllm:num_requests_waiting_by_reason{{engine="1",model_name="a",reason="deferred"}} 0.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="a"}} {preemptions}
vllm:num_preemptions_total{{engine="1",model_name="a"}} 1.0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="a"}} {queries}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="a"}} {hits}
# TYPE vllm:admission_rejections_total counter
vllm:admission_rejections_total{{engine="0",model_name="a"}} {rejections}
"""


def test_rates_and_the_ratio_are_over_the_time_between_two_reads() -> None:
    first = reading(COUNTERS_AT.format(preemptions=2, queries=100, hits=40, rejections=0), 10.0)
    second = reading(COUNTERS_AT.format(preemptions=6, queries=300, hits=90, rejections=4), 12.0)
    alone = first.snapshot(None)
    assert (alone.preemption_rate, alone.prefix_cache_hit_ratio, alone.admission_rejection_rate) == (
        None,
        None,
        None,
    )
    snapshot = second.snapshot(first)
    assert snapshot.preemption_rate == 2.0  # (6 + 1 - 2 - 1) / 2 s, summed over the engines
    assert snapshot.prefix_cache_hit_ratio == 0.25  # 50 of 200 tokens
    assert snapshot.admission_rejection_rate == 2.0
    assert (snapshot.num_requests_waiting_for_capacity, snapshot.num_requests_waiting_deferred) == (3, 1)
    assert snapshot.num_requests_waiting == 4
    assert snapshot.attributes[names.VLLM_PREEMPTION_RATE] == 2.0
    assert snapshot.attributes[names.VLLM_NUM_REQUESTS_WAITING_FOR_CAPACITY] == 3
    # Nothing looked up: no ratio (rather than a stale one); a counter that went back (a restart): no rate.
    quiet = reading(COUNTERS_AT.format(preemptions=6, queries=300, hits=90, rejections=4), 13.0).snapshot(
        second
    )
    assert quiet.prefix_cache_hit_ratio is None
    assert quiet.preemption_rate == 0.0
    assert names.VLLM_PREFIX_CACHE_HIT_RATIO not in quiet.attributes
    restarted = reading(COUNTERS_AT.format(preemptions=0, queries=10, hits=5, rejections=0), 14.0)
    after_restart = restarted.snapshot(second)
    assert (after_restart.preemption_rate, after_restart.prefix_cache_hit_ratio) == (None, None)
    assert after_restart.admission_rejection_rate is None


OLDER_AND_0_32_SOURCES = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="a"}} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="a"}} 0.0
# TYPE vllm:{prefix}prefix_cache_queries_total counter
vllm:{prefix}prefix_cache_queries_total{{model_name="a"}} {queries}
# TYPE vllm:{prefix}prefix_cache_hits_total counter
vllm:{prefix}prefix_cache_hits_total{{model_name="a"}} {hits}
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{model_name="a"}} {queries}
# TYPE vllm:prompt_tokens_cached_total counter
vllm:prompt_tokens_cached_total{{model_name="a"}} {cached}
# HELP vllm:request_num_preemptions Number of preemptions per finished request.
# TYPE vllm:request_num_preemptions histogram
vllm:request_num_preemptions_bucket{{le="1.0",model_name="a"}} 0.0
vllm:request_num_preemptions_bucket{{le="+Inf",model_name="a"}} {finished}
vllm:request_num_preemptions_count{{model_name="a"}} {finished}
vllm:request_num_preemptions_sum{{model_name="a"}} {preempted}
"""


@pytest.mark.parametrize(
    ("prefix", "expected_ratio"),
    [("gpu_", 0.5), ("", 0.5), ("none", 0.25)],
    ids=["gpu_-prefixed counters before 0.9.2", "prefix_cache counters", "prompt_tokens_cached of 0.32"],
)
def test_each_source_of_the_ratio_and_of_preemptions(prefix: str, expected_ratio: float) -> None:
    def page(queries: int, hits: int, cached: int, finished: int, preempted: int) -> str:
        text = OLDER_AND_0_32_SOURCES.format(
            prefix="" if prefix == "none" else prefix, queries=queries, hits=hits, cached=cached,
            finished=finished, preempted=preempted,
        )  # fmt: skip
        if prefix == "none":  # a page without the prefix-cache counters
            text = "\n".join(line for line in text.splitlines() if "prefix_cache" not in line) + "\n"
        return text

    before = reading(page(100, 10, 10, 1, 0), 1.0)
    after = reading(page(200, 60, 35, 3, 4), 3.0).snapshot(before)
    assert after.prefix_cache_hit_ratio == expected_ratio
    assert after.preemption_rate == 2.0  # the histogram's sum: 4 preemptions of finished requests in 2 s
    assert after.kv_cache_usage is None
    assert after.num_requests_waiting_for_capacity is None


def test_the_thread_computes_rates_between_its_own_reads(static_metrics: Any) -> None:
    static_metrics.page = COUNTERS_AT.format(preemptions=2, queries=100, hits=40, rejections=0)
    with ServerMetrics(static_metrics.url, interval=0.05) as sampler:
        assert sampler.wait_for_sample(1.0)
        first = sampler.snapshot
        static_metrics.page = COUNTERS_AT.format(preemptions=12, queries=100, hits=40, rejections=0)
        eventually(lambda: sampler.snapshot is not None and (sampler.snapshot.preemption_rate or 0) > 0)
        second = sampler.snapshot
    assert first is not None
    assert second is not None
    assert second.preemption_rate == pytest.approx(10 / (second.monotonic - first.monotonic))
    assert second.prefix_cache_hit_ratio is None  # no lookups in that interval


def test_kv_pressure_shows_as_preemptions_on_the_call_span(captured: Captured) -> None:
    """Requests whose caches outgrow the server's blocks: calls admitted meanwhile carry a KV-cache
    usage near full and a rising preemption rate."""
    config = {
        "version": FAMILIES["0.32/0.33"], "max_num_seqs": 4, "block_size": 4, "num_kv_blocks": 16,
        "decode_per_token": 0.005, "enable_prefix_caching": False,
    }  # fmt: skip
    with vllm(**config) as sim, ServerMetrics(sim.base_url, interval=0.02) as sampler:
        client = client_for(sim, server_metrics=sampler)

        def call() -> None:
            client.chat.completions.create(model=MODEL, messages=ask("a"), max_tokens=1)

        with load(sim, 16, max_tokens=40):  # about a second of pressure
            calls = [threading.Thread(target=call) for _ in range(40)]
            for thread in calls:  # the app keeps calling while the server is under pressure
                thread.start()
                time.sleep(0.015)
            for thread in calls:
                thread.join(20)
        preemptions = sum(r.preemptions for r in sim.requests)
    stamped = [dict(span.attributes) for span in call_spans(captured)]
    assert len(stamped) == 40
    assert preemptions > 0
    assert any(s.get(names.VLLM_PREEMPTION_RATE, 0) > 0 for s in stamped)
    assert any(s[names.VLLM_KV_CACHE_USAGE] >= 0.875 for s in stamped)


def test_dead_metrics_endpoint_changes_nothing_for_the_app(
    captured: Captured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="llmspans.vllm")
    before = sampler_threads()
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    with vllm() as sim:
        client = client_for(sim)
        sampler = ServerMetrics(dead, interval=0.05, timeout=0.1)
        (thread,) = sampler_threads() - before
        for _ in range(3):
            stream = client.chat.completions.create(model=MODEL, messages=ask(), stream=True, max_tokens=3)
            assert len([c for c in stream if c.choices and c.choices[0].delta.content]) == 3
        eventually(lambda: len(sampler_log(caplog)) >= 4)  # several failed samples meanwhile
        assert sampler.span_attributes() == {}
        assert sampler.snapshot is None
        assert not [p for p in captured.metric_points() if p.name.startswith("vllm.")]
        sampler.close()
    assert not thread.is_alive()
    assert len(call_spans(captured)) == 3
    assert all(s.status.is_ok for s in call_spans(captured))
    warnings = sampler_log(caplog, logging.WARNING)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert dead.removesuffix("/v1") + "/metrics" in warnings[0].getMessage()


def test_a_sample_goes_stale_with_its_age_when_the_server_goes_away(
    captured: Captured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="llmspans.vllm")
    with vllm() as sim, ServerMetrics(sim.base_url, interval=0.05, timeout=0.1) as sampler:
        assert sampler.wait_for_sample(1.0)
        sim.stop()
        eventually(lambda: len(sampler_log(caplog)) >= 3)
        time.sleep(0.3 - min(0.3, sampler.span_attributes()[names.VLLM_METRICS_AGE]))
        first = sampler.span_attributes()
        time.sleep(0.05)
        second = sampler.span_attributes()
        gauges = [p for p in captured.metric_points() if p.name.startswith("vllm.")]
    assert first[names.VLLM_NUM_REQUESTS_RUNNING] == 0
    assert 0.3 <= first[names.VLLM_METRICS_AGE] < second[names.VLLM_METRICS_AGE]
    assert gauges == []  # a gauge reports the current state or nothing
    assert len(sampler_log(caplog, logging.WARNING)) == 1


def test_logs_once_per_outage_and_notes_the_recovery(
    static_metrics: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="llmspans.vllm")
    static_metrics.page = MULTI_SERIES
    static_metrics.status = 503
    with ServerMetrics(static_metrics.url, interval=0.02) as sampler:
        eventually(lambda: len(sampler_log(caplog)) >= 3)  # one warning, then quieter failures
        assert sampler.span_attributes() == {}
        static_metrics.status = 200
        assert sampler.wait_for_sample(1.0)
        assert sampler.span_attributes()[names.VLLM_NUM_REQUESTS_RUNNING] == 7
        static_metrics.page = "# not vLLM's metrics\nup 1\n"
        failures = len(sampler_log(caplog))
        eventually(lambda: len(sampler_log(caplog)) >= failures + 3)
        assert sampler.span_attributes()[names.VLLM_NUM_REQUESTS_RUNNING] == 7  # stale, with its age
    messages = [(r.levelname, r.getMessage()) for r in sampler_log(caplog, logging.INFO)]
    assert [level for level, _ in messages] == ["WARNING", "INFO", "WARNING"]
    assert "HTTP 503" in messages[0][1]
    assert "is this a vLLM server?" in messages[2][1]


def test_a_server_that_is_not_vllm_gives_no_attributes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="llmspans.vllm")
    with SimulatedServer() as plain, ServerMetrics(plain.base_url, interval=0.02) as sampler:
        eventually(lambda: len(sampler_log(caplog)) >= 3)
        assert sampler.span_attributes() == {}
    warnings = sampler_log(caplog, logging.WARNING)
    assert len(warnings) == 1
    assert "HTTP 404" in warnings[0].getMessage()


def test_one_request_per_interval() -> None:
    with vllm() as sim:
        with ServerMetrics(sim.base_url, interval=0.1) as sampler:
            time.sleep(0.55)
        scrapes = len(sim.scrapes)
        assert sampler.closed
        time.sleep(0.15)
        assert len(sim.scrapes) == scrapes  # nothing after close()
    assert 2 <= scrapes <= 7  # at most one per interval (a late-starting thread makes fewer)


def test_sampler_stops_on_close_on_collection_and_is_harmless_to_close_twice() -> None:
    with vllm() as sim:
        before = sampler_threads()
        sampler = ServerMetrics(sim.base_url, interval=0.05)
        (thread,) = sampler_threads() - before
        sampler.close()
        sampler.close()
        assert not thread.is_alive()
        assert sampler.span_attributes() == {}
        assert "closed" in repr(sampler)

        forgotten = ServerMetrics(sim.base_url, interval=0.05)
        (thread,) = sampler_threads() - before
        assert forgotten.wait_for_sample(1.0)
        del forgotten
        gc.collect()
        thread.join(2)
        assert not thread.is_alive()


def test_interpreter_exit_is_prompt_and_quiet_with_a_sampler_left_open() -> None:
    with vllm() as sim:
        code = (
            "import time\n"
            "from llmspans.vllm import ServerMetrics\n"
            f"live = ServerMetrics({sim.base_url!r}, interval=0.05)\n"
            f"dead = ServerMetrics('http://127.0.0.1:{closed_port()}/v1', interval=0.05, timeout=0.2)\n"
            "assert live.wait_for_sample(5.0)\n"
            "print(live.span_attributes()['vllm.num_requests_running'])\n"
        )
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
        elapsed = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0"]
    assert "Traceback" not in out.stderr
    assert elapsed < 10  # the interpreter's start-up dominates; the samplers add at most one timeout


# --- the sampling thread never disturbs the app ----------------------------------------------------

FIRST_CALL = """
import sys
import openai
import llmspans

client = llmspans.instrument(
    openai.OpenAI(base_url=sys.argv[1], api_key="sk-test", max_retries=0), provider="vllm", server_metrics=True
)
client.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": "hi"}], max_tokens=2)
"""


@pytest.mark.timeout(
    600
)  # 25 fresh interpreters, three at a time: under 40 s on a quiet machine, several times that when busy
def test_the_first_call_right_after_instrument_succeeds_in_every_fresh_process() -> None:
    """The sampler thread used to `import httpx` while the app's first request ran; the openai 3.x
    SDK looks `httpx` up in `sys.modules` and failed on the half-imported module in about one
    fresh process in five. Only a fresh process has never imported it, hence one per try. The race is
    between two threads of one process: three processes at a time (one importing while another waits
    on the server) leave it as it was, in less time than one after another."""
    tries, at_once = 25, 3
    failures: list[str] = []
    with vllm() as sim:
        for first in range(0, tries, at_once):
            running = [
                subprocess.Popen(
                    [sys.executable, "-c", FIRST_CALL, sim.base_url, MODEL],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for _ in range(min(at_once, tries - first))
            ]
            for process in running:
                _, err = process.communicate(timeout=60)
                if process.returncode != 0:
                    failures.append(err.strip().splitlines()[-1] if err.strip() else str(process.returncode))
        assert sim.wait_idle()
        calls = [r for r in sim.requests if r.path == "/v1/chat/completions"]
    assert failures == [], f"{len(failures)} of {tries} fresh processes failed their first call"
    assert len(calls) == tries


THREAD_IMPORTS = """
import json, socket, sys, threading

imports = {}


def audit(event, args):
    if event == "import":
        imports.setdefault(threading.current_thread().name, []).append(args[0])


sys.addaudithook(audit)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from llmspans import _metrics

# The vLLM gauges' callback, collected from a thread of its own as a periodic reader does.
reader = InMemoryMetricReader()
_metrics.SdkRecorder(MeterProvider(metric_readers=[reader]).get_meter("t"))
collector = threading.Thread(target=reader.get_metrics_data, name="collector")
collector.start()
collector.join()

from llmspans.vllm import ServerMetrics

silent = socket.socket()  # accepts connections, never answers: every read times out
silent.bind(("127.0.0.1", 0))
silent.listen()
closed = socket.socket()
closed.bind(("127.0.0.1", 0))
targets = [sys.argv[1], sys.argv[2], sys.argv[3]]
targets += ["http://127.0.0.1:%d" % s.getsockname()[1] for s in (silent, closed)]
closed.close()
for url in targets:
    with ServerMetrics(url, interval=0.02, timeout=0.1) as sampler:
        sampler.wait_for_sample(0.3)
        sampler.wait_for_sample(0.3)
print(json.dumps(imports))
"""


def test_the_sampling_thread_and_the_gauge_callback_import_nothing(static_metrics: Any) -> None:
    """Whatever the sampler thread needs is imported before it starts, on every path it takes
    (a good page, HTTP 404, a page that is not vLLM's, a read timeout, a refused connection),
    and the gauges' callback, which runs in the metric reader's thread, imports nothing either."""
    static_metrics.page = "# not vLLM's metrics\nup 1\n"
    with vllm() as sim, SimulatedServer() as plain:
        out = subprocess.run(
            [sys.executable, "-c", THREAD_IMPORTS, sim.url, plain.url, static_metrics.url],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        scrapes = len(sim.scrapes)
    assert out.returncode == 0, out.stderr
    imports = json.loads(out.stdout)
    assert imports.get(SAMPLER_THREAD, []) == []
    assert [name for name in imports.get("collector", []) if name.startswith("llmspans")] == []
    assert "llmspans.vllm" in imports["MainThread"]  # the audit hook saw the imports there
    assert scrapes >= 2


COLLECTED_UNDER_LOCK = """
import sys, threading
from llmspans import vllm

sampler = vllm.ServerMetrics(sys.argv[1], interval=0.05)
assert sampler.wait_for_sample(5.0)
(thread,) = [t for t in threading.enumerate() if t.name == "llmspans-vllm-metrics"]
with vllm._live_lock:  # garbage collection may run a finalizer while this thread holds the lock
    del sampler
thread.join(2)
print("ended" if not thread.is_alive() else "running")
"""


def test_a_collected_sampler_is_ended_without_a_lock_in_its_finalizer() -> None:
    """The finalizer only flags the thread: collecting a ServerMetrics while the same thread
    holds the sampler registry's lock neither deadlocks nor leaves the thread running."""
    with vllm() as sim:
        out = subprocess.run(
            [sys.executable, "-c", COLLECTED_UNDER_LOCK, sim.base_url],
            capture_output=True,
            text=True,
            timeout=20,
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ended"]


def test_span_attributes_is_safe_from_many_threads_while_sampling(static_metrics: Any) -> None:
    static_metrics.page = MULTI_SERIES
    seen: list[dict[str, Any]] = []
    with ServerMetrics(static_metrics.url, interval=0.005) as sampler:
        assert sampler.wait_for_sample(1.0)

        def read() -> None:
            for _ in range(5000):
                seen.append(sampler.span_attributes())

        threads = [threading.Thread(target=read) for _ in range(4)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
    assert len(seen) == 20000
    assert all(
        len(attributes) == 4 and attributes[names.VLLM_NUM_REQUESTS_RUNNING] == 7 for attributes in seen
    )
    assert elapsed < 2.0  # about a microsecond each; generous for a loaded 2-core machine


# --- wiring into instrument() (pending) ----------------------------------------------------------


def test_instrument_with_server_metrics_stamps_the_server_state_as_the_call_ends(captured: Captured) -> None:
    """`instrument(client, provider="vllm", server_metrics=True)` starts a ServerMetrics for the
    client's base_url, stamps its freshest sample on each call span as the call ends, and
    `uninstrument()` closes it."""
    before = sampler_threads()
    with vllm() as sim:
        client = client_for(sim, server_metrics=True)
        (thread,) = sampler_threads() - before
        sampler = client._llmspans_instrumentation.settings.server_metrics  # type: ignore[attr-defined]
        assert sampler.late_after == 0.1
        assert sampler.wait_for_sample(3.0)
        keys = (names.VLLM_NUM_REQUESTS_RUNNING, names.VLLM_NUM_REQUESTS_WAITING, names.VLLM_KV_CACHE_USAGE)
        for _ in range(3):  # a sample landing between the call's end and the read below is possible, if rare
            captured.clear()
            client.chat.completions.create(model=MODEL, messages=ask(), max_tokens=2)
            expected = sampler.span_attributes()
            attrs = only_call_span(captured).attributes
            if all(attrs[key] == expected[key] for key in keys):
                break
        assert {key: attrs[key] for key in keys} == {key: expected[key] for key in keys}
        assert 0 <= attrs[names.VLLM_METRICS_AGE] <= expected[names.VLLM_METRICS_AGE]
        llmspans.uninstrument(client)
        thread.join(2)
        assert not thread.is_alive()


def test_instrument_accepts_a_shared_server_metrics(receiver: OTLPReceiver, captured: Captured) -> None:
    """`server_metrics=` also takes a ServerMetrics the app owns (several clients, one sampler). A call
    sent while the server had two running and two waiting joins the queue as the third: the reads
    taken while it waited (every 20 ms; the pair ahead of it runs for a second) saw three waiting, and
    its own server span shows the queue it joined."""
    with vllm(receiver, max_num_seqs=2, decode_per_token=0.05) as sim, load(sim, 4, max_tokens=20):
        assert sim.wait_for_state(lambda waiting, running: (waiting, running) == (2, 2))
        with ServerMetrics(sim.base_url, interval=0.02) as sampler:
            assert sampler.wait_for_sample(1.0)
            client = client_for(sim, server_metrics=sampler)
            client.chat.completions.create(model=MODEL, messages=ask(), max_tokens=2)
        spans = server_spans(sim, receiver, 5)
    attrs = only_call_span(captured).attributes
    assert attrs[names.VLLM_NUM_REQUESTS_WAITING_MAX] == 3
    assert names.VLLM_NUM_REQUESTS_RUNNING in attrs  # the freshest sample, as the call ended
    (own,) = [s for s in spans if s.attributes[names.GEN_AI_REQUEST_ID] == attrs[names.GEN_AI_RESPONSE_ID]]
    assert own.attributes[names.GEN_AI_LATENCY_TIME_IN_QUEUE] > 0.5


def test_a_burst_is_seen_by_every_call_that_queued_in_it(receiver: OTLPReceiver, captured: Captured) -> None:
    """16 streams started together on a server that runs two at a time. The last read before the burst
    saw an idle server, and the next regular one is a second away: the calls that queued are each read
    for while they wait (`late_after`, 0.1 s), so each one that queued on the server for half a second
    or more (time enough for that read on a busy machine) carries the queue it was in; no call carries
    more waiting than the burst had (15)."""
    calls = 16
    with vllm(receiver, max_num_seqs=2, decode_per_token=0.01) as sim:
        with ServerMetrics(sim.base_url) as sampler:  # one read a second, late_after 0.1
            assert sampler.wait_for_sample(2.0)
            client = client_for(sim, server_metrics=sampler)
            assert sampler.span_attributes()[names.VLLM_NUM_REQUESTS_WAITING] == 0
            streamed_calls_at_once(client, calls, max_tokens=20, timeout=30)
            reads = len(sampler._sampler.reads)
        spans = server_spans(sim, receiver, calls)
    queued = {
        s.attributes[names.GEN_AI_REQUEST_ID]: s.attributes[names.GEN_AI_LATENCY_TIME_IN_QUEUE] for s in spans
    }
    long_waits = 0
    for span in call_spans(captured):
        attrs = span.attributes
        waited = queued[attrs[names.GEN_AI_RESPONSE_ID]]
        seen = attrs.get(names.VLLM_NUM_REQUESTS_WAITING_MAX)
        assert seen is None or 0 <= seen <= calls - 1
        if waited >= 0.5:
            long_waits += 1
            assert seen is not None, (waited, attrs)
            assert seen >= 1, (waited, attrs)
    assert long_waits >= 6  # 16 calls two at a time, 0.2 s each: the last eight queue at least 0.8 s
    duration = max(queued.values()) + 1.0
    assert reads <= 2 + duration / 0.1 + duration / 1.0  # at most one extra read per late_after


def test_the_sampler_reads_only_every_interval_without_late_after(captured: Captured) -> None:
    """`late_after=None`: calls are stamped with the regular reads only, and none is made for them."""
    with (
        vllm(max_num_seqs=1, decode_per_token=0.02) as sim,
        ServerMetrics(sim.base_url, interval=5.0, late_after=None) as sampler,
    ):
        assert sampler.wait_for_sample(2.0)
        client = client_for(sim, server_metrics=sampler)
        scrapes = len(sim.scrapes)
        threads = [
            threading.Thread(
                target=lambda: client.chat.completions.create(model=MODEL, messages=ask(), max_tokens=10)
            )
            for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert len(sim.scrapes) == scrapes
    assert all(names.VLLM_NUM_REQUESTS_WAITING_MAX not in s.attributes for s in call_spans(captured))


EXIT_EXPORT = """
import sys
import openai
import llmspans

llmspans.configure(traces_file=sys.argv[3], metric_interval=60)
client = llmspans.instrument(
    openai.OpenAI(base_url=sys.argv[1], api_key="sk-test", max_retries=0), provider="vllm", server_metrics=True
)
client._llmspans_instrumentation.settings.server_metrics.wait_for_sample(5.0)
client.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": "hi"}], max_tokens=2)
"""


def test_the_server_gauges_reach_the_final_export_of_a_short_app(tmp_path: Path) -> None:
    """An app shorter than the metric export interval: its only export is the one at exit, after the
    sampler's own exit hook stopped the thread (`llmspans.vllm` is imported after `configure()`, so its
    hook runs first); that export still carries the server's gauges."""
    traces = tmp_path / "traces.jsonl"
    with vllm() as sim:
        out = subprocess.run(
            [sys.executable, "-c", EXIT_EXPORT, sim.base_url, MODEL, str(traces)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    metric_names = set()
    for line in traces.read_text().splitlines():
        for resource in json.loads(line).get("resourceMetrics", []):
            for scope in resource["scopeMetrics"]:
                metric_names.update(metric["name"] for metric in scope["metrics"])
    assert names.METRIC_OPERATION_DURATION in metric_names
    assert {names.METRIC_VLLM_NUM_REQUESTS_WAITING, names.METRIC_VLLM_NUM_REQUESTS_RUNNING} <= metric_names


def test_only_the_families_read_are_parsed_and_they_read_the_same() -> None:
    """The lines of every other family are dropped before parsing; what is read is what the whole page says."""
    from llmspans.vllm import _Reading, _wanted_lines

    for family in FAMILIES.values():
        for tracing in (False, True):
            with contextlib.ExitStack() as stack:
                otlp = stack.enter_context(OTLPReceiver()) if tracing else None
                sim = stack.enter_context(vllm(otlp, version=family))
                stack.enter_context(traffic(sim))
                page = httpx.get(sim.base_url.removesuffix("/v1") + "/metrics").text
            kept = _wanted_lines(page)
            assert len(kept) < len(page) / 2
            whole = _Reading.parse(text_string_to_metric_families(page), 1.0)
            assert _Reading.parse(text_string_to_metric_families(kept), 1.0) == whole, (family, tracing)


@retry_timing
def test_continuous_usage_makes_inter_token_figures_per_token(captured: Captured) -> None:
    """With `continuous_usage_stats`, each chunk says how many tokens it carries (vLLM sends
    several per chunk with `--stream-interval`, speculative decoding or a slow reader), so the
    inter-token figures are per token: a gap spread over the tokens that arrived with it."""
    decode = 0.02
    with vllm(decode_per_token=decode, stream_interval=2) as sim:
        stream = client_for(sim).chat.completions.create(
            model=MODEL, messages=ask(), stream=True, max_tokens=9,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )  # fmt: skip
        list(stream)
        assert sim.wait_idle()
        (record,) = sim.requests
    assert record.chunk_tokens == [1, 2, 2, 2, 2]
    attrs = only_call_span(captured).attributes
    assert attrs[names.STREAM_CHUNKS] == 5
    assert attrs[names.ITL_P50] == pytest.approx(decode, abs=0.008)
    assert attrs[names.ITL_MAX] < 2 * decode
    assert attrs[names.OUTPUT_TOKENS_PER_SECOND] == pytest.approx(1 / decode, rel=0.25)


def test_vllm_sampling_extensions_are_recorded(captured: Captured) -> None:
    """vLLM's `extra_body` sampling parameters land on the call span (`gen_ai.request.top_k`)."""
    with vllm() as sim:
        client_for(sim).chat.completions.create(
            model=MODEL, messages=ask(), max_tokens=2, extra_body={"top_k": 20}
        )
    assert only_call_span(captured).attributes[names.GEN_AI_REQUEST_TOP_K] == 20
