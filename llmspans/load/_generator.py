"""One event loop sending a level's requests through one instrumented client.

The client is a plain `httpx2.AsyncClient` on the load tool's lean transport (`_plain.py`, `_http.py`) by
default, or the openai SDK's `openai.AsyncOpenAI` (`client="openai"`, about 7x the CPU per streamed
request: docs/load.md, "What the generator costs"); either way llmspans instruments it as an app's, and
each request records its call span (buckets, attempts, `llmspans.load.level`).

The runner drives a generator in its own process (one worker), and each worker process drives its own
(`_worker.py`); either way the same code sends the requests, so a request records the same call span
wherever it ran. Closed loop: `users` coroutines, each taking the next request when its last one is done.
Open loop: one dispatcher sleeps until each request is due and starts it as its own task, whatever is
still in flight; the record keeps when it was due and when `create()` was called, so the lag is measured,
never hidden. Each request consumes its stream as an app would and stamps each content chunk.

What keeps the schedule (docs/load.md, "What the generator costs"): a request's arguments are built
before it is due; while a level issues no full garbage collection runs (the spans and records a level
keeps would make each one a pause of tens of milliseconds) and the exporter's thread hands the GIL back
within half a millisecond (`on_schedule`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

import llmspans
from llmspans import _deferred, _retries, _suppress
from llmspans._adapters.body_readers import chunk_listener
from llmspans._openai_wire import carries_tokens
from llmspans.load._model import Level
from llmspans.load._requests import CURRENT, LevelStamper, RequestRecord
from llmspans.load._workload import Workload
from llmspans.report._spans import Span, spans_of_readable
from llmspans.vllm import ServerMetrics

# A span ended from a finalizer is ended on llmspans' worker thread: wait this long for it at a level's end.
SETTLE_S = 2.0
# While a level issues, the oldest generation is collected only past this many younger collections: never.
NO_FULL_COLLECTION = 2**31 - 1
# While a level issues, another thread of the process (the exporter's) hands the GIL back after this long.
SWITCH_INTERVAL_S = 0.0005
CLIENTS = ("httpx", "openai")
# The plain client retries as the openai SDK does: these back-offs (doubling, with jitter), or retry-after.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 8.0
_RETRY_HEADER = _retries.RETRY_COUNT_HEADER.encode()
_PATHS = {"chat": "chat/completions", "completions": "completions", "responses": "responses"}


class LoadError(Exception):
    """The run cannot go on (the target does not answer, a worker died); one line saying why."""


class Generator:
    """The instrumented client, the span processor that reads each call span back, and the two loops."""

    def __init__(
        self, workload: Workload, *, base_url: str, tracer_provider: TracerProvider, run_id: str,
        api_key: str = "none", provider: str | None = None, limiter: llmspans.Limiter | None = None,
        server_metrics: ServerMetrics | None = None, max_retries: int = 2, timeout: float = 60.0,
        client: str = "httpx",
    ) -> None:  # fmt: skip
        if client not in CLIENTS:
            raise ValueError(f"client must be one of {', '.join(CLIENTS)}, got {client!r}")
        self.client, self.workload, self.base_url, self.api_key = client, workload, base_url, api_key
        self.provider, self.limiter, self.server_metrics = provider, limiter, server_metrics
        self.max_retries, self.timeout = max_retries, timeout
        self.stamper = LevelStamper(run_id, stamps=workload.span_attributes)
        tracer_provider.add_span_processor(self.stamper)
        self._client: Any = None
        self._creators: dict[str, Callable[..., Any]] = {}  # the openai SDK's create(), by endpoint

    async def start(self) -> None:
        """The client, and one warm-up request no span records: the SDK's one-off set-up is not in the
        first level, and a target that does not answer is said (LoadError) before any level starts."""
        if self.client == "httpx":
            self._start_plain()
        else:
            self._start_openai()
        with _suppress.suppressing():
            try:
                if self.client == "httpx":
                    await self._send(RequestRecord(index=0, level=""), self.body(0))
                else:
                    response = await self._creators[self.workload.shape(0).endpoint](
                        **self.workload.request(0)
                    )
                    if self.workload.shape(0).stream:
                        async for _ in response:
                            pass
            except Exception as error:
                raise LoadError(
                    f"the warm-up request to {self.base_url} failed: {error_name(error)}: {error}"
                ) from None

    def _start_openai(self) -> None:
        try:
            import openai
        except ImportError as error:
            raise LoadError("--client openai needs the openai SDK: pip install 'llmspans[openai]'") from error
        self._client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=self.max_retries, timeout=self.timeout
        )
        llmspans.instrument(
            self._client, provider=self.provider, limiter=self.limiter, request_usage=self.workload.stream,
            server_metrics=self.server_metrics or False,
        )  # fmt: skip
        self._creators = {endpoint: _creator(self._client, endpoint) for endpoint in _PATHS}

    def _start_plain(self) -> None:
        import httpx2

        from llmspans.load._http import LeanTransport

        self._client = httpx2.AsyncClient(
            base_url=self.base_url.rstrip("/") + "/", transport=LeanTransport(self.timeout),
            headers={"authorization": f"Bearer {self.api_key}", "content-type": "application/json"},
            timeout=self.timeout,
        )  # fmt: skip
        llmspans.instrument(
            self._client,
            provider=self.provider,
            limiter=self.limiter,
            server_metrics=self.server_metrics or False,
        )
        self._urls = {
            endpoint: httpx2.URL(self.base_url.rstrip("/") + "/" + path) for endpoint, path in _PATHS.items()
        }
        self._headers = [(name.encode(), value.encode()) for name, value in self._client.headers.items()]

    def body(self, index: int) -> bytes:
        """Request `index`'s JSON body for the plain client (usage asked for when streamed, as the SDK
        path asks), encoded once before it is due."""
        arguments = self.workload.request(index)
        arguments.update(arguments.pop("extra_body", None) or {})  # the SDK's extra_body goes in the JSON
        shape = self.workload.shape(index)
        if shape.stream and shape.endpoint != "responses":
            arguments["stream_options"] = {"include_usage": True}
        return json.dumps(arguments, separators=(",", ":")).encode()

    def arguments(self, index: int) -> Any:
        """What `_one` sends for request `index`: the plain client's body, or the SDK's keyword arguments."""
        return self.body(index) if self.client == "httpx" else self.workload.request(index)

    async def _send(self, record: RequestRecord, body: bytes) -> None:
        """One request on the plain client, retried as the openai SDK retries (the same header, so llmspans
        groups the attempts into one call); the body is read to its end, its observer stamping chunks."""
        import httpx2

        shape = self.workload.shape(record.index)
        client, url = self._client, self._urls[shape.endpoint]
        attempt = 0
        while True:
            # The request built whole here: the client's own build_request merges and parses its URL again.
            headers = [*self._headers, (_RETRY_HEADER, str(attempt).encode())]
            last = attempt >= self.max_retries
            try:
                response = await client.send(
                    httpx2.Request("POST", url, headers=headers, content=body), stream=True
                )
            except Exception as error:
                if last or not _transport_retried(error):
                    _give_up_held()
                    raise
                await asyncio.sleep(_backoff(attempt, None))
                attempt += 1
                continue
            try:
                status = response.status_code
                if status >= 400:
                    await response.aread()
                    if last or not _retries.retried_status(status):
                        record.error = f"HTTP {status}"
                        return
                    wait = _backoff(attempt, _retries.retry_after_seconds(response.headers))
                elif record.observed or not shape.stream:
                    async for _ in response.aiter_raw():
                        pass
                    return
                else:  # nothing observed the stream (llmspans records nothing): stamp it here
                    await _stamp_chunks(response, record)
                    return
            finally:
                await response.aclose()
                if record.error is not None:
                    _give_up_held()
            await asyncio.sleep(wait)
            attempt += 1

    async def close(self) -> None:
        self.stamper.shutdown()
        if self._client is not None:
            if self.client == "httpx":
                await self._client.aclose()
            else:
                await self._client.close()

    async def closed(
        self,
        level: Level,
        users: int,
        indices: Sequence[int],
        records: list[RequestRecord],
        stop: asyncio.Event,
        until: float,
    ) -> None:
        """`users` users share `indices` (the requests to send, in order) until done, `until`
        (`time.monotonic()`) or `stop`."""
        pending = iter(indices)

        async def user() -> None:
            while not stop.is_set() and time.monotonic() < until:
                index = next(pending, None)
                if index is None:
                    return
                record = RequestRecord(index=index, level=level.label)
                records.append(record)
                await self._one(record, self.arguments(index))

        await asyncio.gather(*(user() for _ in range(users)))

    async def open(
        self,
        level: Level,
        schedule: Sequence[tuple[int, int]],
        records: list[RequestRecord],
        stop: asyncio.Event,
        until: float,
    ) -> None:
        """Each `(index, due)` of `schedule` (`time.perf_counter_ns()`, in order) started when due."""
        in_flight = InFlight()
        try:
            for index, due in schedule:
                request = await self.when_due(level, index, due, records, stop, until)
                if request is None:
                    break
                in_flight.start(self.send(*request))
            await in_flight.wait()
        finally:
            await in_flight.cancel()

    async def when_due(
        self, level: Level, index: int, due: int, records: list[RequestRecord], stop: asyncio.Event,
        until: float,
    ) -> tuple[RequestRecord, Any] | None:  # fmt: skip
        """Request `index` of a schedule, at `due` (`time.perf_counter_ns()`): its record (added to `records`,
        keeping when it was due) and its arguments, built before it is due, so they are not its lag. None
        when `stop` was set or `until` (`time.monotonic()`) passed meanwhile: it is not sent."""
        arguments = self.arguments(index)
        wait = (due - time.perf_counter_ns()) / 1e9
        if wait > 0:
            await asyncio.sleep(wait)
        if stop.is_set() or time.monotonic() >= until:
            return None
        record = RequestRecord(index=index, level=level.label, scheduled_ns=due)
        records.append(record)
        return record, arguments

    async def send(self, record: RequestRecord, arguments: Any) -> None:
        """One request of a schedule (`open`'s, or a replay's turns: `_replay_send.py`), once due."""
        await self._one(record, arguments)

    async def _one(self, record: RequestRecord, arguments: Any) -> None:
        """One request, consumed as an app would; what it measured lands on `record`."""
        token = CURRENT.set(record)
        try:
            record.issued_ns = time.perf_counter_ns()
            if self.client == "httpx":
                listening = chunk_listener.set(record)  # the adapter's reader stamps its chunks
                try:
                    await self._send(record, arguments)
                finally:
                    chunk_listener.reset(listening)
                return
            shape = self.workload.shape(record.index)
            response = await self._creators[shape.endpoint](**arguments)
            if shape.stream:
                async for item in response:
                    if carries_tokens(item):
                        record.chunk_ns.append(time.perf_counter_ns())
        except asyncio.CancelledError:
            record.cancelled = True
            raise
        except Exception as error:
            record.error = error_name(error)
        finally:
            record.done_ns = time.perf_counter_ns()
            CURRENT.reset(token)

    def level_spans(self, level: Level, records: Sequence[RequestRecord]) -> list[Span]:
        """Every ended span of the level's requests' traces, as the report reads them, once the spans
        ended from a finalizer have ended too; the generator forgets them."""
        if any(record.ok and not record.recorded for record in records):
            _deferred.settle(SETTLE_S)
        return spans_of_readable(self.stamper.take(level.label))


class InFlight:
    """The requests an open loop started and that have not ended: each its own task, whatever else is in
    flight. `wait` returns when all have ended, those started meanwhile too (a replay's later calls);
    `cancel` cancels what is left (the level was stopped) and waits until it has ended."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, request: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(request)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks))

    async def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


@contextlib.contextmanager
def on_schedule() -> Iterator[None]:
    """While a level issues: no full garbage collection (one at its end, outside every request's time), and
    the loop's thread waits at most `SWITCH_INTERVAL_S` for the GIL.

    A full collection walks every object the process holds, the level's spans and records included: tens
    of milliseconds here, which every request due meanwhile would count as lag. The young generations are
    still collected as usual (about a millisecond each); what reaches the oldest one during a level is
    about one object per request, freed at the level's end. The exporter's thread encodes spans in batches
    in the same process: by Python's default it keeps the GIL for up to 5 ms before the loop gets it back,
    the whole of the lag allowed.
    """
    threshold, interval = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(threshold[0], threshold[1], NO_FULL_COLLECTION)
    sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*threshold)
        gc.collect()


async def until_done(work: Any, stop: asyncio.Event, deadline: float) -> None:
    """Run `work` to its end, or cancel it when `stop` is set or `deadline` (`time.monotonic()`) passes."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait(
            {task, stopped},
            timeout=max(0.0, deadline - time.monotonic()),
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)


def error_name(error: BaseException) -> str:
    status = getattr(error, "status_code", None)
    if isinstance(status, int):
        return f"HTTP {status}"
    return type(error).__name__


def _transport_retried(error: BaseException) -> bool:
    """The failures the openai SDK retries: a connection lost or refused, a timeout."""
    import httpx2

    return isinstance(error, httpx2.TransportError)


def _backoff(attempt: int, retry_after_s: float | None) -> float:
    if retry_after_s is not None and 0 <= retry_after_s <= _retries.MAX_RETRY_AFTER_S:
        return retry_after_s
    return float(min(RETRY_MAX_S, RETRY_FIRST_S * 2**attempt) * (1 - 0.25 * random.random()))


def _give_up_held() -> None:
    """The last attempt failed: its call ends now, not after the wait for a retry that will not come."""
    _retries.give_up()


async def _stamp_chunks(response: Any, record: RequestRecord) -> None:
    """Each content event of a stream stamped at the read it came in (`_openai_wire`'s rule)."""
    from llmspans.load._plain import carries_tokens_in

    chunk_ns = record.chunk_ns
    pending = b""
    async for piece in response.aiter_raw():
        now = time.perf_counter_ns()
        buffer = pending + piece if pending else piece
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        *events, pending = buffer.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:  # one data line, the usual event
                if carries_tokens_in(event[6:]):
                    chunk_ns.append(now)
                continue
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and carries_tokens_in(line[5:].strip()):
                    chunk_ns.append(now)


def _creator(client: Any, endpoint: str) -> Callable[..., Any]:
    if endpoint == "chat":
        return client.chat.completions.create  # type: ignore[no-any-return]
    if endpoint == "completions":
        return client.completions.create  # type: ignore[no-any-return]
    return client.responses.create  # type: ignore[no-any-return]
