"""The load generator's default client (a plain httpx2 client on `LeanTransport`, `LoadStreamObserver`)
records what the openai SDK path records: the same call spans, buckets, attempts, chunks and level, over
real HTTP on 127.0.0.1. And the transport's own parts: a chunked body split anywhere, keep-alive, retries.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx2
import pytest
from opentelemetry.sdk.trace import ReadableSpan

from llmspans import _names as names
from llmspans.load import _host
from llmspans.load._host import LoopLag, inflated, shared_host, sharing
from llmspans.load._http import LeanTransport
from llmspans.load._model import SHAPE_CONCURRENCY
from llmspans.load._plain import content_of, content_of_bytes
from llmspans.load._runner import Runner, RunOutcome
from llmspans.load._workload import Plan, Workload, parse_levels
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.test_load import providers  # the load tests' own providers, one place


async def _run(
    base_url: str, client: str, *, requests: int = 12, users: int = 3, max_retries: int = 0
) -> tuple[RunOutcome, list[ReadableSpan]]:
    workload = Workload(model="sim", max_tokens=8, prompt_tokens=20)
    plan = Plan(shape=SHAPE_CONCURRENCY, levels=parse_levels(str(users), SHAPE_CONCURRENCY),
                requests_per_level=requests, max_seconds=60)  # fmt: skip
    with providers() as (tracer_provider, exporter):
        runner = Runner(
            workload, plan, base_url=base_url, tracer_provider=tracer_provider, max_retries=max_retries,
            client=client,
        )  # fmt: skip
        outcome = await runner.run()
        return outcome, list(exporter.get_finished_spans())


def _call_spans(spans: list[ReadableSpan]) -> list[ReadableSpan]:
    return [s for s in spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]


@pytest.mark.parametrize("client", ["httpx", "openai"])
async def test_each_client_records_one_call_span_per_request_with_its_level_buckets_and_chunks(
    client: str,
) -> None:
    with SimulatedServer(Behavior(chunks=6, first_chunk_delay=0.02, chunk_gap=0.005)) as server:
        outcome, spans = await _run(server.base_url, client)
    records = next(iter(outcome.records.values()))
    assert len(records) == 12
    assert all(r.ok and r.recorded for r in records)
    calls = _call_spans(spans)
    assert len(calls) == 12
    for span in calls:
        attributes = span.attributes or {}
        assert attributes[names.LOAD_LEVEL] == records[0].level
        assert attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 6
        assert {event.name for event in span.events} >= {names.EVENT_FIRST_TOKEN, names.EVENT_LAST_TOKEN}
        assert attributes[names.STREAM_CHUNKS] == 6
    for record in records:
        assert len(record.chunk_ns) == 6  # each content chunk stamped where it reached the generator
        assert record.first_token_ns is not None
        assert record.first_token_ns >= 20_000_000
        assert record.chunk_ns == sorted(record.chunk_ns)
        assert len(set(record.chunk_ns)) > 1
        assert record.buckets_ns["first_token"] > 0
        if client == "httpx":  # stamped at the read that brought them, as the call span's events are
            assert record.last_token_ns is not None
            spread = record.chunk_ns[-1] - record.chunk_ns[0]
            assert abs(spread - (record.last_token_ns - record.first_token_ns)) < 100_000


async def test_the_plain_client_retries_as_the_sdk_does_and_its_attempts_stay_one_call() -> None:
    with SimulatedServer(Behavior(chunks=4)) as server:
        server.enqueue(Behavior(chunks=4), Behavior(status=503, retry_after_ms=10))  # the warm-up, then a 503
        outcome, spans = await _run(server.base_url, "httpx", requests=3, users=1, max_retries=2)
    records = next(iter(outcome.records.values()))
    assert all(r.ok for r in records), [r.error for r in records]
    calls = _call_spans(spans)
    assert len(calls) == 3
    retried = [s for s in calls if (s.attributes or {}).get(names.RETRY_COUNT) == 1]
    assert len(retried) == 1
    assert sum(r.retries for r in records) == 1


async def test_a_failed_request_without_retries_is_named_by_its_status() -> None:
    with SimulatedServer(Behavior(chunks=4)) as server:
        server.enqueue(Behavior(chunks=4), Behavior(status=500))  # the warm-up, then a 500
        outcome, _ = await _run(server.base_url, "httpx", requests=2, users=1, max_retries=0)
    records = next(iter(outcome.records.values()))
    assert [r.error for r in records] == ["HTTP 500", None]


async def _serve_chunked(pieces: list[bytes], connections: list[int]) -> asyncio.AbstractServer:
    """A server that answers each request with a chunked body written in `pieces` (split anywhere)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        while True:
            head = b""
            while b"\r\n\r\n" not in head:
                piece = await reader.read(65536)
                if not piece:
                    writer.close()
                    return
                head += piece
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = head.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                body += await reader.read(65536)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.001)

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
async def test_a_chunked_body_split_anywhere_comes_out_whole_and_the_connection_is_reused(cut: int) -> None:
    events = [f'data: {{"n": {i}, "text": "{"x" * i}"}}\n\n'.encode() for i in range(12)] + [
        b"data: [DONE]\n\n"
    ]
    wire = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    pieces = [wire[i : i + cut] for i in range(0, len(wire), cut)]
    connections: list[int] = []
    server = await _serve_chunked(pieces, connections)
    port = server.sockets[0].getsockname()[1]
    traced: list[str] = []

    async def trace(event: str, info: dict[str, object]) -> None:
        traced.append(event)

    try:
        async with httpx2.AsyncClient(transport=LeanTransport(timeout=10)) as client:
            for _ in range(2):
                request = client.build_request(
                    "POST", f"http://127.0.0.1:{port}/v1/x", content=b"{}", extensions={"trace": trace}
                )
                response = await client.send(request, stream=True)
                body = b"".join([piece async for piece in response.aiter_raw()])
                await response.aclose()
                assert response.status_code == 200
                assert body == b"".join(events)
    finally:
        server.close()
        await server.wait_closed()
    assert len(connections) == 1  # the second request reused the first's connection
    assert traced.count("connection.connect_tcp.started") == 1
    assert traced.count("connection.connect_tcp.complete") == 1


async def test_a_server_that_never_answers_is_a_read_timeout_within_the_requests_timeout() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx2.AsyncClient(transport=LeanTransport(timeout=0.3)) as client:
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(httpx2.ReadTimeout):
                await client.post(f"http://127.0.0.1:{port}/v1/x", content=b"{}")
            assert loop.time() - started < 3.0
    finally:
        server.close()


def _chunk(delta: dict[str, object], finish: str | None = None, usage: object = None) -> str:
    body: dict[str, object] = {
        "id": "c1", "object": "chat.completion.chunk", "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }  # fmt: skip
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body, separators=(",", ":"))


def test_content_of_bytes_says_what_content_of_says() -> None:
    samples = [
        _chunk({"content": "hi"}), _chunk({"content": ""}), _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "x"}, finish="stop"), _chunk({"content": "x"}, usage={"completion_tokens": 1}),
        _chunk({"reasoning_content": "r"}), _chunk({"content": 'q \\"content\\":\\"'}), "[DONE]", '{"content":"',
    ]  # fmt: skip
    for sample in samples:
        assert content_of_bytes(sample.encode()) == content_of(sample), sample


def test_content_of_reads_compact_mid_stream_chunks_and_leaves_the_rest_to_the_adapter() -> None:
    assert content_of(_chunk({"content": "hi"})) is True
    assert content_of(_chunk({"content": 'a "quoted" \\"content\\":\\"x'})) is True
    assert content_of(_chunk({"role": "assistant", "content": ""})) is False
    assert content_of(_chunk({"content": ""})) is False
    assert content_of(_chunk({"reasoning_content": "think"})) is True
    assert content_of(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]})) is None
    assert content_of(_chunk({"content": "x"}, finish="stop")) is None  # the finish: read whole
    assert content_of(_chunk({"content": "x"}, usage={"completion_tokens": 1})) is None
    assert (
        content_of(json.dumps({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}))
        is None
    )
    assert content_of("[DONE]") is None
    legacy = json.dumps(
        {"id": "c", "choices": [{"index": 0, "text": "t", "finish_reason": None}]}, separators=(",", ":")
    )
    assert content_of(legacy) is True


async def test_the_loop_lag_monitor_sees_a_blocked_loop_and_inflated_weighs_it_against_the_ttft() -> None:
    lag = LoopLag()
    lag.start()
    await asyncio.sleep(0.03)
    time.sleep(0.2)  # noqa: ASYNC251  (the generator's own work, holding the loop)
    await asyncio.sleep(0.02)
    samples = await lag.stop()
    assert max(samples) >= 0.2e9 - 2 * _host.LAG_EVERY_S * 1e9  # woke at most one period before it
    assert inflated(0.002, 0.015)  # 2 ms late against a 15 ms TTFT: the zero-delay simulator's case
    assert not inflated(0.0004, 0.150)  # under 0.5 ms against 150 ms: the real vLLM's
    assert not inflated(0.003, 0.150)  # 2% of the TTFT
    assert not inflated(None, 0.1)


def test_a_target_on_this_machine_is_named_with_the_cpus_it_shares_and_a_remote_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with SimulatedServer() as server:
        host = shared_host(server.base_url)
        assert host is not None
        assert host.pid == os.getpid()  # the process listening on the port
        assert host.shared_cpus == frozenset(os.sched_getaffinity(0))
        assert sharing(host, cpu_s=0.5, duration_s=2.0) == 0.25
        assert sharing(host, cpu_s=0.1, duration_s=2.0) is None  # 5% of a CPU: under the threshold
        # Pinned apart: the server's CPUs and the generator's do not meet.
        monkeypatch.setattr(_host, "_affinity", lambda pid: frozenset({0}) if pid == 0 else frozenset({1}))
        assert shared_host(server.base_url) is None
    assert shared_host("http://192.0.2.1:8000/v1") is None  # TEST-NET: not this machine
    assert sharing(None, cpu_s=1.0, duration_s=1.0) is None


def test_a_level_carries_the_shared_host_and_the_inflated_latencies_in_its_figures() -> None:
    from llmspans.load._model import Level
    from llmspans.load._requests import RequestRecord
    from llmspans.load._stats import level_stats

    record = RequestRecord(
        index=0, level="c=1", issued_ns=1, done_ns=2, recorded=True, first_token_ns=10_000_000
    )
    host = _host.SharedHost(pid=123, shared_cpus=frozenset({0}), generator_cpus=frozenset({0, 1}))
    level = Level(SHAPE_CONCURRENCY, 1)
    stats = level_stats(level, [record], duration_s=1.0, slo={}, generator_cpu_s=0.3, host=host,
                        loop_lag_ns=[2_000_000] * 9)  # fmt: skip
    assert stats.shared_host == "the server (pid 123) and the generator share CPU 0"
    assert stats.shared_cpu_share == 0.3
    assert stats.generator_inflated  # 2 ms late against a 10 ms TTFT
    quiet = level_stats(level, [record], duration_s=1.0, slo={}, generator_cpu_s=0.05, host=host,
                        loop_lag_ns=[100_000] * 9)  # fmt: skip
    assert quiet.shared_host is None
    assert not quiet.generator_inflated
