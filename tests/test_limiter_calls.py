"""A limiter admitting LLM calls: the queue bucket, the admitted event and the limiter attributes."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any

import httpx2
import openai
import pytest

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.timing import retry_timing

HOLD = 0.1
MESSAGES = [{"role": "user", "content": "hi"}]


SERVER_BEHAVIOR = Behavior(header_delay=HOLD, chunks=2)


def calls(captured: Captured) -> list[Any]:
    return sorted(
        (s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == "llm"),
        key=lambda s: s.start_time,
    )


class HeldTransport(httpx2.AsyncHTTPTransport):
    """While `held`, a request waits here, past the limiter, until `opened` is set: the calls admitted
    first stay in their slots until the test has queued the others behind them."""

    def __init__(self) -> None:
        super().__init__()
        self.held = False
        self.holding = 0
        self.opened = asyncio.Event()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if self.held:
            self.holding += 1
            await self.opened.wait()
        return await super().handle_async_request(request)


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll a condition the test set up (the limiter itself never polls)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.0005)


@retry_timing
async def test_cap_two_six_calls_wait_in_fifo_order(server: SimulatedServer, captured: Captured) -> None:
    """Six calls on a cap of two. Each is started once the one before it is admitted or queued, and the
    first two are held after the limiter until all six are in: the order and the queue depths are the
    test's, whatever the load. A waiting call's queue bucket runs from its arrival to the release that
    freed its slot (never before it: the server held each call ahead for HOLD after the gate opened) plus
    the hand-over, which this loop's own lateness bounds on a loaded machine."""
    limiter = llmspans.Limiter(2, name="interactive")
    transport = HeldTransport()
    http = httpx2.AsyncClient(transport=transport)
    client = llmspans.instrument(
        openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0, http_client=http),
        limiter=limiter,
    )
    await client.chat.completions.create(model="warm", messages=MESSAGES)
    captured.clear()
    server.clear()
    peak, late = 0, 0.0

    async def watch() -> None:  # the cap, and how late this event loop ran a 2 ms timer
        nonlocal peak, late
        while True:
            peak = max(peak, limiter.in_flight)
            before = time.perf_counter()
            await asyncio.sleep(0.002)
            late = max(late, time.perf_counter() - before - 0.002)

    watcher = asyncio.create_task(watch())
    transport.held = True
    tasks: list[asyncio.Task[Any]] = []
    try:
        for i in range(6):
            tasks.append(
                asyncio.create_task(client.chat.completions.create(model=f"m{i}", messages=MESSAGES))
            )
            await wait_until(lambda: limiter.in_flight + limiter.queue_depth == len(tasks))
        await wait_until(lambda: transport.holding == 2)
        assert (limiter.in_flight, limiter.queue_depth) == (2, 4)
        transport.held = False
        opened_ns = time.time_ns()
        transport.opened.set()
        await asyncio.gather(*tasks)
    finally:
        transport.opened.set()
        watcher.cancel()
    assert peak <= 2
    spans = calls(captured)
    assert [s.attributes[names.GEN_AI_REQUEST_MODEL] for s in spans] == [f"m{i}" for i in range(6)]
    admitted_at = [next(e.timestamp for e in s.events if e.name == names.EVENT_ADMITTED) for s in spans]
    assert admitted_at == sorted(admitted_at)  # FIFO
    assert [s.attributes[names.LIMITER_QUEUE_DEPTH] for s in spans] == [0, 0, 0, 1, 2, 3]
    releases = sorted(s.end_time for s in spans)  # each slot is given back just after its call's end
    handover_bound = 0.015 + late
    for index, span in enumerate(spans):
        queue = span.attributes[names.BUCKET_PREFIX + "queue"]
        arrived = admitted_at[index] - queue * 1e9  # on the span's own time line
        assert span.start_time - 1_000 <= arrived <= opened_ns, index  # every call was in before the gate
        if index < 2:
            assert queue <= handover_bound, (index, queue, late)
        else:
            # Not before the calls ahead were answered, HOLD each from the gate on, and freed by the
            # (index - 1)th release; then at once, give or take this loop's own lateness.
            floor = opened_ns + (index // 2) * HOLD * 1e9 - 1e6
            assert admitted_at[index] >= max(floor, releases[index - 2]), (index, queue)
            assert (admitted_at[index] - releases[index - 2]) * 1e-9 <= handover_bound, (index, queue, late)
        assert span.attributes[names.LIMITER_NAME] == "interactive"
        assert span.attributes[names.LIMITER_CAP] == 2
        total = sum(span.attributes[a] for a in names.BUCKET_ATTRIBUTES)
        assert total == pytest.approx((span.end_time - span.start_time) * 1e-9, abs=2e-6)
    server_hold = [(r.finished_ns - r.arrived_ns) * 1e-9 for r in server.requests]
    assert len(server_hold) == 6
    assert min(server_hold) >= HOLD - 0.001
    assert limiter.in_flight == 0
    handovers = [(admitted_at[k] - releases[k - 2]) * 1e-6 for k in range(2, 6)]
    print(
        f"\n[limiter calls] hand-overs {max(handovers):.1f} ms at most; this loop ran up to {late * 1e3:.1f} ms late"
    )


def test_sync_client_admits_through_the_limiter(server: SimulatedServer, captured: Captured) -> None:
    limiter = llmspans.Limiter(1, name="batch")
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k"), limiter=limiter)
    client.chat.completions.create(model="m", messages=MESSAGES)
    (span,) = calls(captured)
    assert span.attributes[names.LIMITER_NAME] == "batch"
    assert any(e.name == names.EVENT_ADMITTED for e in span.events)
    assert limiter.in_flight == 0


def test_a_stream_holds_its_slot_until_it_ends(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(chunks=3)
    limiter = llmspans.Limiter(1)
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k"), limiter=limiter)
    stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    next(stream)
    assert limiter.in_flight == 1
    list(stream)
    assert limiter.in_flight == 0
    abandoned = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    next(abandoned)
    del abandoned
    gc.collect()
    assert limiter.in_flight == 0  # garbage collection hands the slot back too


async def test_cancelled_and_timed_out_waiters_leak_no_slot(
    server: SimulatedServer, captured: Captured
) -> None:
    limiter = llmspans.Limiter(1, name="lane")
    client = llmspans.instrument(
        openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0), limiter=limiter
    )
    holder = asyncio.create_task(client.chat.completions.create(model="holder", messages=MESSAGES))
    await asyncio.sleep(0.02)
    waiter = asyncio.create_task(client.chat.completions.create(model="cancelled", messages=MESSAGES))
    await asyncio.sleep(0.02)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    timed = llmspans.instrument(
        openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0),
        limiter=llmspans.Limiter(1, name="strict", timeout=0.01),
    )
    await holder
    assert limiter.in_flight == 0
    assert limiter.queue_depth == 0
    started = asyncio.get_running_loop().time()
    await client.chat.completions.create(model="next", messages=MESSAGES)  # admitted at once
    assert asyncio.get_running_loop().time() - started < HOLD + 0.05
    by_model = {s.attributes[names.GEN_AI_REQUEST_MODEL]: s for s in calls(captured)}
    cancelled = by_model["cancelled"]
    assert cancelled.attributes[names.ERROR_TYPE] == "CancelledError"
    assert names.LIMITER_NAME not in cancelled.attributes  # never admitted
    assert by_model["next"].attributes[names.BUCKET_PREFIX + "queue"] < 0.01
    strict = timed._llmspans_instrumentation.settings.limiter  # type: ignore[attr-defined]
    slot = strict.acquire()
    with pytest.raises(llmspans.LimiterTimeout, match="strict"):
        await timed.chat.completions.create(model="timeout", messages=MESSAGES)
    slot.release()
    timeout_span = next(s for s in calls(captured) if s.attributes[names.GEN_AI_REQUEST_MODEL] == "timeout")
    assert timeout_span.attributes[names.ERROR_TYPE] == "LimiterTimeout"


def test_bad_limiter_argument() -> None:
    with pytest.raises(TypeError, match=r"llmspans\.Limiter"):
        llmspans.instrument(openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k"), limiter=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("library", ["httpx", "httpx2"])
async def test_plain_async_client_admits_through_the_limiter(
    server: SimulatedServer, captured: Captured, library: str
) -> None:
    import importlib

    module = importlib.import_module(library)
    limiter = llmspans.Limiter(1, name="plain")
    late = 0.0

    async def watch() -> None:  # how late this event loop ran a 2 ms timer
        nonlocal late
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.002)
            late = max(late, time.perf_counter() - before - 0.002)

    watcher = asyncio.create_task(watch())
    async with module.AsyncClient(base_url=server.base_url) as client:
        llmspans.instrument(client, limiter=limiter)
        body = {"model": "m", "messages": MESSAGES}
        first, second = await asyncio.gather(
            client.post("/chat/completions", json=body), client.post("/chat/completions", json=body)
        )
        assert first.status_code == second.status_code == 200
    watcher.cancel()
    # The second waits from its arrival, while the first holds the slot (HOLD at the server), to the
    # first's end, then at once, give or take this loop's own lateness on a loaded machine.
    ahead, behind = sorted(calls(captured), key=lambda s: s.attributes[names.BUCKET_PREFIX + "queue"])
    admitted = next(e.timestamp for e in behind.events if e.name == names.EVENT_ADMITTED)
    arrived = admitted - behind.attributes[names.BUCKET_PREFIX + "queue"] * 1e9
    assert ahead.attributes[names.BUCKET_PREFIX + "queue"] < 0.005 + late
    assert arrived < ahead.end_time - HOLD * 1e9 + 1e6  # it queued: it came before the first's answer
    assert ahead.end_time <= admitted <= ahead.end_time + (0.03 + late) * 1e9, (
        admitted - ahead.end_time,
        late,
    )
    assert min((r.finished_ns - r.arrived_ns) * 1e-9 for r in server.requests) >= HOLD - 0.001
    assert all(s.attributes[names.LIMITER_NAME] == "plain" for s in calls(captured))
    assert limiter.in_flight == 0


def test_plain_sync_client_limiter_timeout_raises_and_ends_the_span(
    server: SimulatedServer, captured: Captured
) -> None:
    import httpx

    limiter = llmspans.Limiter(1, name="sync-plain", timeout=0.01)
    held = limiter.acquire()
    with httpx.Client(base_url=server.base_url) as client:
        llmspans.instrument(client, limiter=limiter)
        with pytest.raises(llmspans.LimiterTimeout):
            client.post("/chat/completions", json={"model": "m", "messages": MESSAGES})
    held.release()
    (span,) = calls(captured)
    assert span.attributes[names.ERROR_TYPE] == "LimiterTimeout"
    assert server.requests == []


def test_the_lane_labels_the_call_metrics(server: SimulatedServer, captured: Captured) -> None:
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k"), limiter=llmspans.Limiter(4, name="batch")
    )
    client.chat.completions.create(model="m", messages=MESSAGES)
    for metric in (names.METRIC_OPERATION_DURATION, names.METRIC_BUCKET_DURATION, names.METRIC_TOKEN_USAGE):
        points = captured.metric_points(metric)
        assert points
        assert {p.attributes[names.LIMITER_NAME] for p in points} == {"batch"}
