"""The simulator must look like the real API to the official clients, and keep its timing promises."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmspans.tools.simulator import Behavior, SimulatedServer

MESSAGES: Any = [{"role": "user", "content": "say hello to the simulator"}]  # 5 words
FULL_TEXT = "Hello, this is a simulated reply."  # the default 8 chunks
MS = 1_000_000
TOLERANCE = 4 * MS


@pytest.fixture
def client(server: SimulatedServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0) as c:
        yield c


@pytest.fixture
def raw(server: SimulatedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=10) as c:
        yield c


def sse_lines(raw: httpx.Client, path: str, body: dict[str, Any]) -> list[str]:
    with raw.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/event-stream"
        assert resp.headers["transfer-encoding"] == "chunked"
        return [line for line in resp.iter_lines() if line]


def sim_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("llmspans-sim-")}


# -- chat completions -------------------------------------------------------------------


def test_chat_non_streamed(server: SimulatedServer, client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="my-model", messages=MESSAGES)
    assert resp.object == "chat.completion"
    assert resp.model == "my-model"
    assert resp.choices[0].message.content == FULL_TEXT
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (5, 8, 13)
    assert resp._request_id is not None
    assert resp._request_id.startswith("req_sim")

    server.wait_idle()
    (rec,) = server.requests
    assert (rec.method, rec.path, rec.body["model"]) == ("POST", "/v1/chat/completions", "my-model")
    assert rec.headers["authorization"] == "Bearer test"
    assert rec.headers_sent_ns is not None
    assert rec.finished_ns is not None
    assert rec.arrived_ns <= rec.headers_sent_ns <= rec.finished_ns
    assert rec.behavior == Behavior()
    assert rec.status == 200


def test_chat_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content is None
    content = [c.choices[0].delta.content for c in chunks[1:-1]]
    assert "".join(c or "" for c in content) == FULL_TEXT
    assert len(content) == 8
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.object == "chat.completion.chunk" and c.model == "m" and c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_wire_format(server: SimulatedServer, raw: httpx.Client) -> None:
    server.default = Behavior(chunks=2)
    lines = sse_lines(raw, "/chat/completions", {"model": "m", "messages": MESSAGES, "stream": True})
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    first = json.loads(lines[1].removeprefix("data: "))
    assert first["choices"] == [
        {"index": 0, "delta": {"content": "Hello"}, "logprobs": None, "finish_reason": None}
    ]
    assert isinstance(first["created"], int)


@pytest.mark.parametrize(
    ("usage", "include_usage", "where"),
    [
        ("auto", False, None),
        ("auto", True, "chunk"),
        ("chunk", False, "chunk"),
        ("finish", False, "finish"),
        ("finish", True, "finish"),
        ("none", True, None),
    ],
)
def test_chat_stream_usage_placement(
    server: SimulatedServer, client: openai.OpenAI, usage: Any, include_usage: bool, where: str | None
) -> None:
    server.default = Behavior(chunks=3, usage=usage)
    extra: Any = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True, **extra))
    with_usage = [c for c in chunks if c.usage is not None]
    if where is None:
        assert with_usage == []
        return
    (carrier,) = with_usage
    assert carrier.usage is not None
    assert (carrier.usage.prompt_tokens, carrier.usage.completion_tokens, carrier.usage.total_tokens) == (
        5,
        3,
        8,
    )
    if where == "chunk":
        assert carrier is chunks[-1]
        assert carrier.choices == []
    else:
        assert carrier.choices[0].finish_reason == "stop"


def test_chat_stream_without_done_or_role_chunk(
    server: SimulatedServer, client: openai.OpenAI, raw: httpx.Client
) -> None:
    server.default = Behavior(chunks=2, done=False, role_chunk=False, finish_reason="length")
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert [c.choices[0].delta.content for c in chunks] == ["Hello", ",", None]
    assert chunks[-1].choices[0].finish_reason == "length"
    lines = sse_lines(raw, "/chat/completions", {"model": "m", "messages": MESSAGES, "stream": True})
    assert len(lines) == 3
    assert "data: [DONE]" not in lines


def test_chat_tool_calls(server: SimulatedServer, client: openai.OpenAI) -> None:
    server.default = Behavior(chunks=4, tool_calls=True, finish_reason="tool_calls")
    arguments = ""
    names = []
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
        for call in chunk.choices[0].delta.tool_calls or []:
            assert call.index == 0
            assert call.function is not None
            names.append(call.function.name)
            arguments += call.function.arguments or ""
    assert names[0] == "simulated_tool"
    assert json.loads(arguments) == {"text": "Hello, this is"}

    resp = client.chat.completions.create(model="m", messages=MESSAGES)
    message = resp.choices[0].message
    assert message.content is None
    assert message.tool_calls is not None
    tool_call = message.tool_calls[0]
    assert tool_call.type == "function"
    assert json.loads(tool_call.function.arguments) == {"text": "Hello, this is"}
    assert resp.choices[0].finish_reason == "tool_calls"


# -- other endpoints --------------------------------------------------------------------


def test_legacy_completions(server: SimulatedServer, client: openai.OpenAI) -> None:
    resp = client.completions.create(model="m", prompt="one two three")
    assert resp.object == "text_completion"
    assert resp.choices[0].text == FULL_TEXT
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == 3

    server.default = Behavior(chunks=3)
    stream = client.completions.create(
        model="m", prompt="one two", stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello, this"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3


def test_embeddings(client: openai.OpenAI) -> None:
    # The SDK asks for base64 by default and decodes it; an explicit "float" gets a plain list.
    default = client.embeddings.create(model="e", input=["alpha beta", "gamma"])
    floats = client.embeddings.create(model="e", input=["alpha beta", "gamma"], encoding_format="float")
    assert [d.index for d in default.data] == [0, 1]
    assert len(default.data[0].embedding) == 8
    for a, b in zip(default.data, floats.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
    assert default.data[0].embedding != default.data[1].embedding
    assert (default.usage.prompt_tokens, default.usage.total_tokens) == (3, 3)
    single = client.embeddings.create(model="e", input="alpha beta", dimensions=4)
    assert len(single.data) == 1
    assert single.data[0].embedding == pytest.approx(default.data[0].embedding[:4], abs=1e-6)


def test_responses_non_streamed(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="m", input="three little words", instructions="be brief")
    assert resp.output_text == FULL_TEXT
    assert resp.status == "completed"
    assert resp.model == "m"
    assert resp.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (5, 8, 13)


def test_responses_streamed(server: SimulatedServer, client: openai.OpenAI, raw: httpx.Client) -> None:
    server.default = Behavior(chunks=3)
    events = list(client.responses.create(model="m", input="hi", stream=True))
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas == ["Hello", ",", " this"]
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.output_text == "Hello, this"
    assert completed.response.usage is not None
    assert completed.response.usage.output_tokens == 3

    # The high-level helper checks identities across events; it must accept ours too.
    with client.responses.stream(model="m", input="hi") as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == "Hello, this"

    # Like the real API: an `event:` line per event, matching the data's type, and no [DONE].
    lines = sse_lines(raw, "/responses", {"model": "m", "input": "hi", "stream": True})
    names = [line.removeprefix("event: ") for line in lines[::2]]
    datas = [json.loads(line.removeprefix("data: "))["type"] for line in lines[1::2]]
    assert names == datas == types


def test_responses_tool_call_and_incomplete(server: SimulatedServer, client: openai.OpenAI) -> None:
    server.default = Behavior(chunks=2, tool_calls=True, finish_reason="length")
    with client.responses.stream(model="m", input="hi") as stream:
        events = list(stream)
        # Like the real API, an incomplete answer ends with `response.incomplete`, which
        # the SDK's get_final_response() refuses ("Didn't receive a `response.completed` event").
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            stream.get_final_response()
    assert "response.function_call_arguments.delta" in [e.type for e in events]
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    (item,) = last.response.output
    assert item.type == "function_call"
    assert json.loads(item.arguments) == {"text": "Hello,"}


def test_models_health_and_unknown_paths(client: openai.OpenAI, raw: httpx.Client) -> None:
    assert [m.id for m in client.models.list()] == ["sim-model"]
    assert raw.get("/health").status_code == 200
    assert raw.get(str(raw.base_url).removesuffix("/v1/") + "/health").json() == {"status": "ok"}
    missing = raw.post("/nope", json={})
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "invalid_request_error"
    assert raw.get("/chat/completions").status_code == 405
    with pytest.raises(openai.NotFoundError):
        client.post("/nope", cast_to=object, body={})


def test_chunked_request_body(raw: httpx.Client) -> None:
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    resp = raw.post("/chat/completions", content=iter([body[:10], body[10:]]))
    assert resp.request.headers["transfer-encoding"] == "chunked"
    assert resp.json()["usage"]["prompt_tokens"] == 5


# -- errors and failures ----------------------------------------------------------------


def test_rate_limit_with_retry_after(server: SimulatedServer, client: openai.OpenAI) -> None:
    server.enqueue(
        Behavior(status=429, retry_after_ms=250, headers={"x-extra": "yes"}),
        Behavior(status=503, retry_after=1),
    )
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert caught.value.response.headers["retry-after-ms"] == "250"
    assert caught.value.response.headers["x-extra"] == "yes"
    assert caught.value.code == "rate_limit_exceeded"
    assert caught.value.body == {
        "message": "Simulated error 429",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    with pytest.raises(openai.InternalServerError) as caught_503:
        client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    assert caught_503.value.response.headers["retry-after"] == "1"


def test_drop_after_breaks_the_stream(
    server: SimulatedServer, client: openai.OpenAI, raw: httpx.Client
) -> None:
    server.default = Behavior(drop_after=2)
    received = []
    # The SDK wraps the transport's RemoteProtocolError (httpx2's, not httpx's) in APIConnectionError.
    with pytest.raises(openai.APIConnectionError) as caught:  # noqa: PT012
        for chunk in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
            received.append(chunk.choices[0].delta.content)
    assert received == [None, "Hello", ","]
    assert "incomplete chunked read" in str(caught.value.__cause__)
    server.wait_idle()
    rec = server.requests[-1]
    assert len(rec.chunk_sent_ns) == 2
    assert rec.finished_ns is not None

    body = {"model": "m", "messages": [], "stream": True}
    with (
        pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"),
        raw.stream("POST", "/chat/completions", json=body) as r,
    ):
        for _ in r.iter_lines():
            pass
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="m", messages=MESSAGES)  # non-streamed: body cut in half


def test_reset_before_headers(server: SimulatedServer, client: openai.OpenAI, raw: httpx.Client) -> None:
    server.default = Behavior(reset_before_headers=True)
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
        raw.post("/chat/completions", json={"model": "m", "messages": MESSAGES})
    server.wait_idle()
    assert all(r.headers_sent_ns is None for r in server.requests)


# -- timing -----------------------------------------------------------------------------


class Deviations:
    """Collects timing misses instead of failing at the first, so a noisy attempt can be retried.

    `late_ns`: how late the server's own timed writes woke in this attempt (`RecordedRequest.late_ns`),
    which a busy machine adds to every figure here, the client's threads sharing the same cores; on a
    quiet machine it is a fraction of a millisecond and the tolerances are the idle ones."""

    def __init__(self) -> None:
        self.misses: list[str] = []
        self.late_ns = 0

    def near(self, label: str, actual_ns: int, expected_ns: int, tolerance_ns: int = TOLERANCE) -> None:
        if abs(actual_ns - expected_ns) >= tolerance_ns + self.late_ns:
            self.misses.append(
                f"{label}: {actual_ns / MS:.2f} ms, want {expected_ns / MS:.0f} ± {tolerance_ns / MS:.0f}"
            )


def best_of(attempts: int, measure: Callable[[Deviations], None]) -> None:
    """Timing on a shared machine suffers from preemption; one clean attempt shows the server is exact."""
    misses: list[str] = []
    for _ in range(attempts):
        deviations = Deviations()
        measure(deviations)
        if not deviations.misses:
            return
        misses.extend(deviations.misses)
    pytest.fail("no attempt met the timing tolerances: " + "; ".join(misses))


def test_stream_timing_matches_behavior(server: SimulatedServer, client: openai.OpenAI) -> None:
    server.default = Behavior(first_chunk_delay=0.05, chunk_gap=0.01, chunks=5)

    def measure(dev: Deviations) -> None:
        start = time.perf_counter_ns()
        arrivals = []
        for chunk in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter_ns())
        server.wait_idle()
        rec = server.requests[-1]
        sent = rec.chunk_sent_ns
        assert rec.headers_sent_ns is not None
        assert len(sent) == len(arrivals) == 5
        assert all(put >= due for put, due in zip(sent, rec.chunk_due_ns, strict=True))  # never early
        dev.late_ns = rec.late_ns
        # The server keeps its promises (idle, to ~0.3 ms)...
        dev.near("first chunk after headers (server)", sent[0] - rec.headers_sent_ns, 50 * MS)
        for a, b in itertools.pairwise(sent):
            dev.near("gap (server)", b - a, 10 * MS)
        # ...and each chunk reaches the client at once (flushed per event, no Nagle delay). The
        # server stamps after its write returns, so the client may even see a chunk first.
        for got, put in zip(arrivals, sent, strict=True):
            dev.near("client arrival vs server write", got - put, 0)
        # From the request: the server's 50 ms after it had the request; what the client took to send it
        # (the SDK building it: a few ms, tens on a loaded machine) is before that, and the server saw it.
        before_server = rec.arrived_ns - start
        dev.near(
            "first chunk after request (client)", arrivals[0] - start, before_server + 50 * MS, 2 * TOLERANCE
        )
        for a, b in itertools.pairwise(arrivals):
            dev.near("gap (client)", b - a, 10 * MS)

    best_of(3, measure)


def test_header_delay_non_streamed(server: SimulatedServer, client: openai.OpenAI) -> None:
    server.default = Behavior(header_delay=0.05)

    def measure(dev: Deviations) -> None:
        start = time.perf_counter_ns()
        client.chat.completions.create(model="m", messages=MESSAGES)
        elapsed = time.perf_counter_ns() - start
        server.wait_idle()
        rec = server.requests[-1]
        assert rec.headers_sent_ns is not None
        assert elapsed >= 50 * MS
        dev.late_ns = rec.late_ns
        dev.near("headers after arrival (server)", rec.headers_sent_ns - rec.arrived_ns, 50 * MS)
        dev.near("response time (client)", elapsed, 50 * MS, 2 * TOLERANCE)

    best_of(3, measure)


def test_zero_delay_stream_is_fast(server: SimulatedServer, raw: httpx.Client) -> None:
    server.default = Behavior(chunks=2000)
    start = time.perf_counter()
    lines = sse_lines(raw, "/chat/completions", {"model": "m", "messages": [], "stream": True})
    assert time.perf_counter() - start < 0.5
    assert len(lines) == 2000 + 3


# -- scripting --------------------------------------------------------------------------


def test_enqueue_is_fifo_then_default(server: SimulatedServer, client: openai.OpenAI) -> None:
    server.enqueue(Behavior(chunks=1), Behavior(chunks=2))
    server.enqueue(Behavior(chunks=3))
    got = []
    for _ in range(4):
        usage = client.chat.completions.create(model="m", messages=MESSAGES).usage
        assert usage is not None
        got.append(usage.completion_tokens)
    assert got == [1, 2, 3, 8]


def test_x_sim_overrides_without_consuming_the_queue(server: SimulatedServer, client: openai.OpenAI) -> None:
    server.enqueue(Behavior(status=500))
    resp = client.chat.completions.create(model="m", messages=MESSAGES, extra_body={"x_sim": {"chunks": 2}})
    assert resp.choices[0].message.content == "Hello,"
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="m", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="unknown Behavior field"):
        client.chat.completions.create(model="m", messages=MESSAGES, extra_body={"x_sim": {"chunkz": 2}})
    with pytest.raises(openai.BadRequestError, match="chunks must be"):
        client.chat.completions.create(model="m", messages=MESSAGES, extra_body={"x_sim": {"chunks": -1}})


def test_x_sim_concurrent_requests(server: SimulatedServer, client: openai.OpenAI) -> None:
    results: dict[int, str] = {}

    def run(n: int) -> None:
        stream = client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            stream=True,
            extra_body={"x_sim": {"chunks": n, "first_chunk_delay": 0.05}},
        )
        results[n] = "".join(c.choices[0].delta.content or "" for c in stream)

    threads = [threading.Thread(target=run, args=(n,)) for n in (1, 2, 3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert results == {1: "Hello", 2: "Hello,", 3: "Hello, this", 4: "Hello, this is"}
    server.wait_idle()
    records = server.requests
    assert len({r.connection_id for r in records}) == 4
    assert max(r.arrived_ns for r in records) < min(r.finished_ns or 0 for r in records)  # they overlapped


def test_behavior_validation() -> None:
    with pytest.raises(ValueError, match="chunks"):
        Behavior(chunks=-1)
    with pytest.raises(ValueError, match="usage"):
        Behavior(usage="sometimes")  # type: ignore[arg-type]
    assert Behavior().with_overrides({"chunks": 3}) == Behavior(chunks=3)


# -- connections and lifecycle ----------------------------------------------------------


def test_keep_alive_reuses_the_connection(server: SimulatedServer, raw: httpx.Client) -> None:
    raw.post("/chat/completions", json={"model": "m", "messages": MESSAGES}).raise_for_status()
    sse_lines(raw, "/chat/completions", {"model": "m", "messages": MESSAGES, "stream": True})
    raw.post("/chat/completions", json={"model": "m", "messages": MESSAGES}).raise_for_status()
    server.wait_idle()
    assert len({r.connection_id for r in server.requests}) == 1
    assert server.connections_opened == 1

    with httpx.Client(base_url=server.base_url) as other:
        other.get("/models")
    server.wait_idle()
    assert server.connections_opened == 2
    assert server.requests[-1].connection_id != server.requests[0].connection_id

    server.clear()
    assert server.requests == []
    assert server.connections_opened == 0


async def test_async_client_streams_reuse_the_connection(server: SimulatedServer) -> None:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0) as client:
        for _ in range(2):
            stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            assert [c.choices[0].delta.content async for c in stream][1] == "Hello"
    assert server.wait_idle()
    assert [r.connection_id for r in server.requests] == [1, 1]


def test_stop_is_prompt_with_open_streams_and_idle_connections() -> None:
    fds_before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    others = sim_threads()  # another test's module-wide simulator may be running (any test order)
    server = SimulatedServer(Behavior(chunk_gap=10)).start()
    errors: list[BaseException] = []

    def stream_forever() -> None:
        with openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0) as client:
            try:
                for _ in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
                    pass
            except openai.APIConnectionError as err:
                errors.append(err)

    reader = threading.Thread(target=stream_forever)
    reader.start()
    with httpx.Client(base_url=server.base_url) as idle:
        idle.get("/health")  # leaves an idle keep-alive connection open
        deadline = time.monotonic() + 2
        while not any(r.chunk_sent_ns for r in server.requests):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert sim_threads() - others
        start = time.perf_counter()
        server.stop()
        assert time.perf_counter() - start < 0.5
        reader.join(2)
        assert not reader.is_alive()
        assert len(errors) == 1
        assert not sim_threads() - others
        with pytest.raises(httpx.TransportError):
            idle.get("/health", timeout=1)
    server.stop()  # idempotent
    with pytest.raises(RuntimeError):
        server.start()
    if fds_before is not None:
        assert len(os.listdir("/proc/self/fd")) <= fds_before


def test_command_line_entry_point() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmspans.tools.simulator", "--port", "0", "--chunks", "3"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        base_url = proc.stdout.readline().strip()
        assert base_url.startswith("http://127.0.0.1:")
        assert base_url.endswith("/v1")
        with openai.OpenAI(base_url=base_url, api_key="test", max_retries=0) as client:
            resp = client.chat.completions.create(model="m", messages=MESSAGES)
        assert resp.choices[0].message.content == "Hello, this"
    finally:
        proc.terminate()
        assert proc.wait(5) == 0
        if proc.stdout is not None:
            proc.stdout.close()


def test_n_answers_round_robin_and_a_bad_n_is_a_400() -> None:
    with SimulatedServer(Behavior(chunks=5)) as server:
        url = f"{server.base_url}/chat/completions"
        whole = httpx.post(url, json={"model": "m", "messages": [], "n": 2}).json()
        assert [(c["index"], c["finish_reason"]) for c in whole["choices"]] == [(0, "stop"), (1, "stop")]
        assert all(c["message"]["content"] for c in whole["choices"])
        body = httpx.post(url, json={"model": "m", "messages": [], "n": 2, "stream": True}).text
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        finishes = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert finishes == [0, 1]
        assert httpx.post(url, json={"model": "m", "messages": [], "n": 0}).status_code == 400
