"""The stream interceptor: proxies that stamp chunks and end the call exactly once.

The proxy is the object the caller gets back, so it must behave exactly like the SDK's
stream: iteration, `async for`, context managers, `close()`, `.response`, `isinstance`
and the SDK's helpers (wrapt's ObjectProxy passes everything else through). Each path
that ends a stream ends the call: exhaustion (`completed`), an exception (`error`), task
cancellation (`cancelled`), and `close()`, context exit or garbage collection before the
end (`abandoned`). No OpenTelemetry context stays attached while the caller holds the
stream, so a stream finished in another task or thread cannot trip "Failed to detach
context".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import wrapt

from llmspans import _deferred
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._call import Attempt, CallRecord
from llmspans._guard import report

# Inspects one item, given the instant it arrived; True hides it from the caller (the usage
# chunk llmspans asked for on the caller's behalf).
OnItem = Callable[[Any, int], bool]
# Ends the call with an outcome, at an instant (None: now); runs once whichever path gets there first.
OnEnd = Callable[[str, "BaseException | None", "int | None"], None]


def _abandoned(on_end: OnEnd, at_ns: int) -> None:
    on_end(names.OUTCOME_ABANDONED, None, at_ns)


_UNREAD = Attempt(0)  # where no transport saw the body: no stamp (0), the clock is read instead


def _reads(record: CallRecord) -> Attempt:
    """The attempt whose body the stream is read from: the call's final one (a stream is never retried once
    the caller has it)."""
    attempts = record.attempts
    return attempts[-1] if attempts else _UNREAD


class _StreamProxy(wrapt.ObjectProxy[Any]):
    """What both proxies share: the call, the item reader, and ending exactly once.

    An item's arrival is the read that completed it, as the transport stamped it on the call's final
    attempt (`Attempt.bytes_at_ns`); the clock is read here only when no transport saw the body.
    """

    def __init__(self, wrapped: Any, record: CallRecord, on_item: OnItem, on_end: OnEnd) -> None:
        super().__init__(wrapped)
        self._self_record = record
        self._self_on_item = on_item
        self._self_on_end = on_end
        self._self_ended = False
        _deferred.start_worker()  # before `__del__` can need it

    def __del__(self) -> None:
        """Collected before it ended: abandoned. A finalizer, so it only stamps the time and hands the
        end to the worker (no OpenTelemetry call and no llmspans lock in a finalizer: see `_deferred`)."""
        try:
            if not self._self_ended:
                _deferred.defer(_abandoned, self._self_on_end, time.perf_counter_ns())
        except Exception:  # at interpreter shutdown the modules may be gone; the exit hook ended the call
            pass

    @property
    def response(self) -> Any:
        """The SDK stream's HTTP response, whose close ends the call: the SDK's `.stream()` helpers
        close the response itself, not the stream, when their `with` block is left."""
        return _ResponseProxy(self.__wrapped__.response, self)

    def _self_hidden(self, item: Any) -> bool:
        """Read one item as it reaches the caller (never raising); True hides it from the caller."""
        try:
            return self._self_on_item(item, _reads(self._self_record).bytes_at_ns or time.perf_counter_ns())
        except Exception as error:
            report(sites.STREAM_CHUNK, error)
            return False

    def _self_failed(self, error: BaseException) -> None:
        """The SDK's iteration raised while the caller waited for an item: cancelled, or failed."""
        cancelled = isinstance(error, asyncio.CancelledError)
        self._self_end(names.OUTCOME_CANCELLED if cancelled else names.OUTCOME_ERROR, error)

    def _self_end(self, outcome: str, error: BaseException | None) -> None:
        self._self_ended = True
        try:
            self._self_on_end(outcome, error, None)
        except Exception as failure:
            report(sites.STREAM_END, failure)
            self._self_record.finish(outcome, error=error)  # the adapter's hook failed: the call still ends


class SyncStreamProxy(_StreamProxy):
    """Wraps an SDK stream (openai `Stream`) for a synchronous caller.

    `for chunk in stream` runs one generator over the SDK's own iteration (no proxy attribute
    lookup per item); `next(stream)` works too, and both read the same underlying stream.
    """

    def __iter__(self) -> Iterator[Any]:
        return self._self_items()

    def _self_items(self) -> Iterator[Any]:
        reads = _reads(self._self_record)
        on_item = self._self_on_item
        clock = time.perf_counter_ns
        try:
            for item in self.__wrapped__:
                try:  # `_self_hidden`, inlined: this is the per-chunk path (a call would cost 10 %)
                    if on_item(item, reads.bytes_at_ns or clock()):
                        continue
                except Exception as error:
                    report(sites.STREAM_CHUNK, error)
                yield item
        except GeneratorExit:  # the caller let go of this loop (break): the stream itself lives on
            raise
        except BaseException as error:
            self._self_failed(error)
            raise
        self._self_end(names.OUTCOME_COMPLETED, None)

    def __next__(self) -> Any:
        while True:
            try:
                item = self.__wrapped__.__next__()
            except StopIteration:
                self._self_end(names.OUTCOME_COMPLETED, None)
                raise
            except BaseException as error:
                self._self_failed(error)
                raise
            if not self._self_hidden(item):
                return item

    def close(self) -> None:
        try:
            self.__wrapped__.close()
        finally:
            self._self_end(names.OUTCOME_ABANDONED, None)

    def __enter__(self) -> SyncStreamProxy:
        self.__wrapped__.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> Any:
        try:
            return self.__wrapped__.__exit__(*exc_info)
        finally:
            self._self_end(names.OUTCOME_ABANDONED, None)

    def __reduce_ex__(self, protocol: Any) -> Any:  # pragma: no cover - streams are not picklable anyway
        return self.__wrapped__.__reduce_ex__(protocol)


class AsyncStreamProxy(_StreamProxy):
    """Wraps an SDK stream (openai `AsyncStream`) for an asyncio caller.

    `async for` runs one async generator over the SDK's own iteration; `__anext__` works too.
    """

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._self_items()

    async def _self_items(self) -> AsyncIterator[Any]:
        reads = _reads(self._self_record)
        on_item = self._self_on_item
        clock = time.perf_counter_ns
        try:
            async for item in self.__wrapped__:
                try:  # `_self_hidden`, inlined: this is the per-chunk path (a call would cost 10 %)
                    if on_item(item, reads.bytes_at_ns or clock()):
                        continue
                except Exception as error:
                    report(sites.STREAM_CHUNK, error)
                yield item
        except GeneratorExit:  # the caller let go of this loop (break): the stream itself lives on
            raise
        except BaseException as error:
            self._self_failed(error)
            raise
        self._self_end(names.OUTCOME_COMPLETED, None)

    async def __anext__(self) -> Any:
        while True:
            try:
                item = await self.__wrapped__.__anext__()
            except StopAsyncIteration:
                self._self_end(names.OUTCOME_COMPLETED, None)
                raise
            except BaseException as error:
                self._self_failed(error)
                raise
            if not self._self_hidden(item):
                return item

    async def close(self) -> None:
        try:
            await self.__wrapped__.close()
        finally:
            self._self_end(names.OUTCOME_ABANDONED, None)

    async def __aenter__(self) -> AsyncStreamProxy:
        await self.__wrapped__.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> Any:
        try:
            return await self.__wrapped__.__aexit__(*exc_info)
        finally:
            self._self_end(names.OUTCOME_ABANDONED, None)


class _ResponseProxy(wrapt.ObjectProxy[Any]):
    """A streamed call's HTTP response as the caller reaches it through the stream: closing it ends the
    call (abandoned, unless the stream already ended), and gives back a limiter slot, at once."""

    def __init__(self, wrapped: Any, stream: _StreamProxy) -> None:
        super().__init__(wrapped)
        self._self_stream = stream

    def close(self) -> None:
        try:
            self.__wrapped__.close()
        finally:
            self._self_stream._self_end(names.OUTCOME_ABANDONED, None)

    async def aclose(self) -> None:
        try:
            await self.__wrapped__.aclose()
        finally:
            self._self_stream._self_end(names.OUTCOME_ABANDONED, None)
