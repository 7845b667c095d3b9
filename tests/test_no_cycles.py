"""An instrumented call leaves no garbage in reference cycles: what it allocates is freed by reference
counting when the call ends, as the plain client's is, so llmspans never drives the collector.

The count: after a warm-up, `gc.DEBUG_SAVEALL` keeps whatever the collector would have freed, over
`CALLS` calls (or fewer for the slow cases), then `gc.collect()`; objects per call must be 0, against the
plain client's 0 over the same server in the same test (if the plain client's count is not 0, something
other than llmspans is making garbage and the test says so rather than blame llmspans). Every openai-SDK
case talks over real HTTP to the simulated server on 127.0.0.1, as do the plain httpx/httpx2 clients.

How many calls: a cycle made on every call shows after one; `CALLS` (40) is for a cycle made on only some
paths (a retry inside the SDK, a race lost): one made by 1 call in 10 still shows with probability
1 - 0.9**40 = 98.5 % (1 in 5: 99.99 %). The slow cases count fewer calls with the same reasoning.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import httpx2
import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

import llmspans
from llmspans import _telemetry
from llmspans.testing import settle
from llmspans.tools.simulator import Behavior, SimulatedServer

SERVER_BEHAVIOR = Behavior(chunks=4, usage="finish")
MESSAGES = [{"role": "user", "content": "hi"}]
CALLS = 40
WARM_UP = 10


class _Drop(SpanExporter):
    """Ends spans as a real pipeline does, keeping none (kept spans would only add live objects)."""

    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


@pytest.fixture(params=["sampled", "unsampled", "no provider"])
def telemetry(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Record into a sampled or an unsampled pipeline, or nowhere (no provider installed at all)."""
    if request.param == "no provider":
        monkeypatch.setattr(_telemetry, "_override", None)
        monkeypatch.setattr(_telemetry, "_global", None)
        monkeypatch.setattr(_telemetry, "_resolve", lambda: None)
        yield request.param
        return
    tracer_provider = TracerProvider(sampler=ALWAYS_OFF) if request.param == "unsampled" else TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(_Drop()))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    with _telemetry.use_providers(tracer_provider, meter_provider):
        yield request.param
    tracer_provider.shutdown()
    meter_provider.shutdown()


class Garbage:
    """What the collector found after some calls: every object it would have freed (`total`, as
    `DEBUG_SAVEALL` keeps them), and by type those in a reference cycle themselves (`in_cycles`), not
    merely referred to from one."""

    def __init__(self, found: list[Any], calls: int) -> None:
        cyclic, asyncio_own = _in_cycles(found)
        found = [item for item in found if id(item) not in asyncio_own]
        self.total = len(found) / calls
        self.kinds = collections.Counter(type(item).__qualname__ for item in found)
        self.in_cycles = collections.Counter(type(item).__qualname__ for item in cyclic)

    def __repr__(self) -> str:
        return f"{self.total:.2f}/call, in cycles {self.in_cycles.most_common(12)}"


def _in_cycles(found: list[Any]) -> tuple[list[Any], set[int]]:
    """The objects of `found` on a reference cycle (Tarjan's strongly connected components, iteratively),
    less asyncio's own cycle of a closed connection's transport (one per connection the pool dropped:
    the plain client leaves it too, and a hedge that fires closes its loser's connection); and the ids
    of what that cycle holds."""
    index_of = {id(item): i for i, item in enumerate(found)}
    edges = [[index_of[id(r)] for r in gc.get_referents(item) if id(r) in index_of] for item in found]
    order, low, on_stack, stack, cyclic = [-1] * len(found), [0] * len(found), [False] * len(found), [], []
    asyncio_own: list[int] = []
    counter = 0
    for root in range(len(found)):
        if order[root] != -1:
            continue
        work = [(root, 0)]
        while work:
            node, next_edge = work.pop()
            if next_edge == 0:
                order[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack[node] = True
            recurse = False
            for position in range(next_edge, len(edges[node])):
                target = edges[node][position]
                if order[target] == -1:
                    work.append((node, position + 1))
                    work.append((target, 0))
                    recurse = True
                    break
                if on_stack[target]:
                    low[node] = min(low[node], order[target])
            if recurse:
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == order[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack[member] = False
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    members = [found[member] for member in component]
                    if any(type(member).__name__ == "_SelectorSocketTransport" for member in members):
                        asyncio_own.extend(component)
                    else:
                        cyclic.extend(members)
    held, reached = set(asyncio_own), list(asyncio_own)
    while reached:
        for target in edges[reached.pop()]:
            if target not in held:
                held.add(target)
                reached.append(target)
    return cyclic, {id(found[member]) for member in held}


def cyclic_garbage(call: Callable[[], None], calls: int = CALLS) -> Garbage:
    """What `calls` calls left for the collector, after a warm-up."""
    for _ in range(WARM_UP):
        call()
    settle()
    gc.collect()
    gc.garbage.clear()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(calls):
            call()
        settle()
        gc.collect()
        found = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return Garbage(found, calls)


def assert_no_cycles(plain: Callable[[], None], instrumented: Callable[[], None], calls: int = CALLS) -> None:
    """Nothing for the collector where the plain client leaves nothing. Where it leaves garbage itself
    (httpx 0.28's response and its bound stream refer to each other), no cycle of another type, and of
    its types no more than the plain client's, give or take a connection or two dropped at another
    moment; a cycle of llmspans' own would add one per call (`calls` of each of its types at least)."""
    baseline = cyclic_garbage(plain, calls)
    garbage = cyclic_garbage(instrumented, calls)
    if baseline.total == 0:
        assert garbage.total == 0, f"left for the collector: {garbage!r}; {garbage.kinds.most_common(12)}"
        return
    added = garbage.in_cycles - baseline.in_cycles
    beyond = {kind: more for kind, more in added.items() if kind not in baseline.in_cycles or more > _SLACK}
    assert not beyond, f"more in cycles than the plain client ({baseline!r}): {added.most_common(12)}"


_SLACK = 2  # connections the instrumented run may drop beyond the plain run's (when they close varies)


def sync_pair(server: SimulatedServer, **instrument: Any) -> tuple[openai.OpenAI, openai.OpenAI]:
    plain = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=2)
    client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=2)
    return plain, llmspans.instrument(client, **instrument)


def async_pair(server: SimulatedServer, **instrument: Any) -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]:
    plain = openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=2)
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=2)
    return plain, llmspans.instrument(client, **instrument)


def sync_call(client: Any, stream: bool) -> Callable[[], None]:
    def call() -> None:
        if stream:
            for _chunk in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
                pass
        else:
            client.chat.completions.create(model="m", messages=MESSAGES)

    return call


def async_call(loop: asyncio.AbstractEventLoop, client: Any, stream: bool) -> Callable[[], None]:
    async def run() -> None:
        if stream:
            async for _chunk in await client.chat.completions.create(
                model="m", messages=MESSAGES, stream=True
            ):
                pass
        else:
            await client.chat.completions.create(model="m", messages=MESSAGES)

    return lambda: loop.run_until_complete(run())


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    running = asyncio.new_event_loop()
    yield running
    running.run_until_complete(running.shutdown_asyncgens())
    running.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_sync_openai_call(server: SimulatedServer, telemetry: str, stream: bool) -> None:
    plain, instrumented = sync_pair(server)
    assert_no_cycles(sync_call(plain, stream), sync_call(instrumented, stream))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_async_openai_call(
    server: SimulatedServer, telemetry: str, stream: bool, loop: asyncio.AbstractEventLoop
) -> None:
    plain, instrumented = async_pair(server)
    assert_no_cycles(async_call(loop, plain, stream), async_call(loop, instrumented, stream))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_limited_call(
    server: SimulatedServer, telemetry: str, stream: bool, loop: asyncio.AbstractEventLoop
) -> None:
    plain, instrumented = sync_pair(server, limiter=llmspans.Limiter(2, name="cycles"))
    assert_no_cycles(sync_call(plain, stream), sync_call(instrumented, stream))
    aplain, ainstrumented = async_pair(server, limiter=llmspans.Limiter(2, name="acycles"))
    assert_no_cycles(async_call(loop, aplain, stream), async_call(loop, ainstrumented, stream))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_retried_call(server: SimulatedServer, stream: bool, loop: asyncio.AbstractEventLoop) -> None:
    """A first attempt answered 503, the second 200: the retried call's attempt spans and events too."""

    def retried(call: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            server.enqueue(Behavior(status=503, retry_after_ms=1))
            call()

        return run

    with _sampled():
        plain, instrumented = sync_pair(server)
        assert_no_cycles(retried(sync_call(plain, stream)), retried(sync_call(instrumented, stream)), 30)
        aplain, ainstrumented = async_pair(server)
        assert_no_cycles(
            retried(async_call(loop, aplain, stream)), retried(async_call(loop, ainstrumented, stream)), 30
        )


def test_with_raw_response(server: SimulatedServer, telemetry: str) -> None:
    plain, instrumented = sync_pair(server)

    def raw(client: Any) -> Callable[[], None]:
        def call() -> None:
            client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES).parse()
            with client.chat.completions.with_streaming_response.create(
                model="m", messages=MESSAGES, stream=True
            ) as response:
                for _line in response.iter_lines():
                    pass

        return call

    assert_no_cycles(raw(plain), raw(instrumented))


def test_a_stream_left_early(
    server: SimulatedServer, telemetry: str, loop: asyncio.AbstractEventLoop
) -> None:
    plain, instrumented = sync_pair(server)
    aplain, ainstrumented = async_pair(server)

    def left(client: Any) -> Callable[[], None]:
        def call() -> None:
            stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            for _chunk in stream:
                break
            stream.close()

        return call

    def aleft(client: Any) -> Callable[[], None]:
        async def run() -> None:
            stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            async for _chunk in stream:
                break
            await stream.close()

        return lambda: loop.run_until_complete(run())

    assert_no_cycles(left(plain), left(instrumented))
    assert_no_cycles(aleft(aplain), aleft(ainstrumented))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("fired", [False, True], ids=["unfired", "fired"])
def test_a_hedged_call(
    server: SimulatedServer, fired: bool, stream: bool, loop: asyncio.AbstractEventLoop
) -> None:
    """A hedge that never fires (every answer fast), and one that does (the primary slow to its first
    token, its backup fast): the loser is closed, both copies' spans end."""
    slow = Behavior(chunks=4, usage="finish", **{"first_chunk_delay" if stream else "header_delay": 0.3})
    calls = 8 if fired else 30

    def hedged(call: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            if fired:
                server.enqueue(slow)
            call()

        return run

    # Unfired: not within a call however slow a busy machine makes it. A sync hedge's alarm holds its race
    # (and so the client) until due: waited for below, so no client is left for a later test's count.
    after = 0.05 if fired else 1.5
    with _sampled():
        plain, instrumented = sync_pair(server, hedge=llmspans.Hedge(after=after))
        assert_no_cycles(hedged(sync_call(plain, stream)), hedged(sync_call(instrumented, stream)), calls)
        aplain, ainstrumented = async_pair(server, hedge=llmspans.Hedge(after=after))
        assert_no_cycles(
            hedged(async_call(loop, aplain, stream)), hedged(async_call(loop, ainstrumented, stream)), calls
        )
        server.wait_idle()
    time.sleep(after + 0.5)  # every alarm rang


@pytest.mark.parametrize("library", [httpx, httpx2], ids=["httpx", "httpx2"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_plain_http_client(
    server: SimulatedServer, telemetry: str, library: Any, stream: bool, loop: asyncio.AbstractEventLoop
) -> None:
    url = f"{server.base_url}/chat/completions"
    body = {"model": "m", "messages": MESSAGES, "stream": stream}

    def sync_post(client: Any) -> Callable[[], None]:
        def call() -> None:
            with client.stream("POST", url, json=body) as response:
                for _line in response.iter_lines():
                    pass

        return call

    def async_post(client: Any) -> Callable[[], None]:
        async def run() -> None:
            async with client.stream("POST", url, json=body) as response:
                async for _line in response.aiter_lines():
                    pass

        return lambda: loop.run_until_complete(run())

    assert_no_cycles(sync_post(library.Client()), sync_post(llmspans.instrument(library.Client())))
    assert_no_cycles(
        async_post(library.AsyncClient()), async_post(llmspans.instrument(library.AsyncClient()))
    )


class _sampled:
    """A sampled pipeline, for the cases that only make sense with one (retries, hedges)."""

    def __enter__(self) -> None:
        self._tracer_provider = TracerProvider()
        self._tracer_provider.add_span_processor(SimpleSpanProcessor(_Drop()))
        self._meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
        self._block = _telemetry.use_providers(self._tracer_provider, self._meter_provider)
        self._block.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        self._block.__exit__(*exc_info)
        self._tracer_provider.shutdown()
        self._meter_provider.shutdown()
