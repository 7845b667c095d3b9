"""One copy of a hedged call, as the transport sees it: the attempts it makes and the stream it reads ahead in.

A copy is a `_transport.AttemptWatcher` that composes the call: its attempts are children of the call span,
on the call's clock; the primary's are the call's own list (an unfired hedge adds no record of its own),
the backup's a list of its own until it wins. A copy costs nothing until it matters: no attempt span of its
own before a backup is sent (the primary's is made then, or at the call's end with its real start, as a
retried call's first attempt is), no request followed until it may have to be stopped. How a loser is
stopped: an asyncio copy is cancelled (the backup's task, or the caller's own task while it runs the
primary); a sync copy's HTTP/1.1 connection is shut down by the transport (`AttemptControl.interrupt`),
which wakes the read it is blocked in, and what fails after that is turned into `HedgeCancelled`, so the
SDK does not retry it (`Copy.follow`).
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, Protocol

from llmspans import _names as names
from llmspans import _openai_wire
from llmspans import _sites as sites
from llmspans._budget import seconds
from llmspans._call import Attempt, CallRecord
from llmspans._guard import report, swallow
from llmspans._transport import AttemptControl, AttemptRefused

PREFETCH = 256  # items read ahead of a stream's first content chunk, at most (role chunks, events)


class HedgeCancelled(AttemptRefused):
    """Stops a copy that lost (or was refused a retry): a BaseException, so neither the openai SDK's retry loop
    nor any handler of ordinary errors takes it for a failure to retry; it never reaches the app."""


class Contest(Protocol):
    """What a copy needs of its race (`race.Race`)."""

    call: CallRecord
    winner: Copy | None
    is_async: bool
    lock: threading.Lock
    is_content: Callable[[Any], bool]

    def claim(self, copy: Copy, at_ns: int) -> bool: ...


# What a copy's attempt spans say from the start: which copy it is, and that it has not won (yet).
_ROLE_ATTRIBUTES = {
    role: MappingProxyType({names.HEDGE_ROLE: role, names.HEDGE_WON: False})
    for role in (names.HEDGE_ROLE_PRIMARY, names.HEDGE_ROLE_BACKUP)
}


class Copy:
    """One copy of a hedged call: the watcher of the attempts it makes, and what its race needs to know of it.

    It is never finished, only won, lost or failed; `interrupt()` stops it from another thread or task, once,
    and never after it won.
    """

    # What a copy starts with (class defaults: a primary is made on every hedged call).
    cancelled = False
    launched_ns = 0
    reached_ns: int | None = None  # its first content chunk (a stream) or 2xx headers
    first_token_s: float | None = None
    content_seen = 0  # content chunks read before it was stopped
    reported_input: int | None = None
    reported_output: int | None = None
    release: Callable[[], None] | None = None  # gives back the limiter slot it holds, if any
    wasted: tuple[int, int | None] | None = None  # (output, input) it had when it lost
    # The attempt under way (or the last one) and what the transport lets us do with it. A sync copy's requests
    # are followed once it may have to be stopped (`watching`: a backup, or a primary whose backup was sent),
    # and `sending` says whether its request holds its connection (from its headers' sending to its
    # response's close), so that `interrupt` never shuts down a connection another request has since taken.
    attempt: Attempt | None = None
    control: AttemptControl | None = None
    watching = False
    sending = False
    # An async copy: the backup's task, or the caller's while it runs the primary (`running`).
    task: asyncio.Task[Any] | None = None
    running = False

    def __init__(self, race: Contest, role: str, attempts: list[Attempt]) -> None:
        call = self.call = race.call
        # Weak: the race holds its copies. Whatever runs a copy (the caller's frame, a backup's thread or
        # task, the alarm) holds the race, so it is there whenever the copy is at work; the race and its
        # copies are then freed by reference counting when the call is over, not left for the collector.
        self._race = weakref.ref(race)
        self.role = role
        self.attempts = attempts
        self.stream = call.stream
        self.is_async = race.is_async
        # The backup's attempts have their spans as they run (its `traceparent` names them); the primary's
        # only once a backup is sent, or as the call asked (`attempt_spans="always"`).
        self.attempt_spans_always = call.attempt_spans_always or role != names.HEDGE_ROLE_PRIMARY
        self.lock = race.lock  # the race's: one lock for a race and its copies (never held while waiting)
        if role != names.HEDGE_ROLE_PRIMARY:
            self.watching = True

    @property
    def race(self) -> Contest:
        race = self._race()
        if race is None:  # pragma: no cover - see `__init__`
            raise HedgeCancelled(self.role)
        return race

    # --- what the transport tells (`_transport.AttemptWatcher`) ---

    def attempt_started(self, attempt: Attempt, control: AttemptControl) -> None:
        """An attempt of this copy is about to be sent: kept, or refused when the copy lost (the SDK retrying
        it after its back-off), so that a copy that lost sends nothing more."""
        with self.lock:
            if self.cancelled:
                raise HedgeCancelled(self.role)
            self.attempt, self.control = attempt, control
            watching = self.watching and not self.is_async
        attempt.span_attributes = _ROLE_ATTRIBUTES[self.role]
        self.attempts.append(attempt)
        if watching:
            self.follow(control.request)

    def attempt_answered(self, attempt: Attempt) -> None:
        """A call that does not stream is won by the first copy whose headers say 2xx (a stream is won at its
        first content chunk)."""
        status = attempt.status
        if not self.stream and status is not None and 200 <= status < 300:
            self.reach(time.perf_counter_ns())

    def attempt_body_done(self, attempt: Attempt) -> None:
        pass

    def attempt_failed(self, attempt: Attempt, error: BaseException) -> None:
        pass

    # --- the race ---

    def reach(self, at_ns: int) -> bool:
        """The copy got its first content chunk (or 2xx headers) at `at_ns`: record it, and claim the call."""
        if self.reached_ns is not None:
            return self.race.winner is self
        self.reached_ns = at_ns
        self.first_token_s = seconds(at_ns - self.launched_ns)
        attempts = self.attempts
        span = attempts[-1].span if attempts else None
        if span is not None:
            with swallow(sites.HEDGE_SPAN):
                span.set_attribute(names.HEDGE_FIRST_TOKEN, self.first_token_s)
        return self.race.claim(self, at_ns)

    def interrupt(self) -> None:
        """Stop this copy where it is (it lost, or its call is over): once, and never the winner."""
        with self.lock:
            if self.cancelled or self.race.winner is self:
                return
            self.cancelled = True
            control = self.control if self.sending else None
            if control is not None:
                with swallow(sites.HEDGE_CONNECTION):
                    control.interrupt()
        task = self.task
        if task is not None and (self.running or self.role != names.HEDGE_ROLE_PRIMARY) and not task.done():
            task.cancel()

    # --- a sync copy's requests ---

    def watch_now(self) -> None:
        """This copy may have to be stopped from now on (its backup was sent): its requests are followed, the
        one under way too, taken as holding its connection until its response is closed."""
        with self.lock:
            self.watching = True
            attempt, control = self.attempt, self.control
            under_way = attempt is not None and control is not None and attempt.ended_ns is None
            if under_way:
                self.sending = True
        if under_way:
            self.follow(control.request)  # type: ignore[union-attr]

    def follow(self, request: Any) -> None:
        """Follow one request of this copy through httpcore's trace events: while it holds its HTTP/1.1
        connection (from its headers' sending to its response's close) `interrupt` may shut that connection
        down; and what fails after an interrupt becomes `HedgeCancelled`."""
        previous = request.extensions.get("trace")
        copy = self

        def trace(event: str, info: dict[str, Any]) -> None:
            if event == _SENDING:
                with copy.lock:
                    copy.sending = True
            elif event == _RELEASING:
                with copy.lock:
                    copy.sending = False
            if previous is not None:
                previous(event, info)
            if copy.cancelled and event.endswith((".failed", ".started")) and "response_closed" not in event:
                raise HedgeCancelled(copy.role)

        request.extensions["trace"] = trace

    # --- a stream's first content chunk ---

    def read_ahead(self, stream: Any) -> ReadAhead:
        """Read a sync stream up to its first content chunk (or its end) and claim the call there."""
        ahead = _Ahead(self)
        try:
            while not ahead.done:
                try:
                    ahead.take(stream.__next__())
                except StopIteration:
                    ahead.end()
            return ahead.result(stream)
        except BaseException:
            with swallow(sites.HEDGE_CLOSE):
                stream.close()
            raise

    async def read_ahead_async(self, stream: Any) -> ReadAhead:
        """`read_ahead` for an async stream: only its I/O differs."""
        ahead = _Ahead(self)
        try:
            while not ahead.done:
                try:
                    ahead.take(await stream.__anext__())
                except StopAsyncIteration:
                    ahead.end()
            return ahead.result(stream)
        except BaseException:
            with swallow(sites.HEDGE_CLOSE):
                await stream.close()
            raise

    def stamp(self) -> int:
        """When the read that completed the item just read arrived (the transport stamps its attempt)."""
        attempts = self.attempts
        return (attempts[-1].bytes_at_ns if attempts else 0) or time.perf_counter_ns()

    def _content(self, is_content: Callable[[Any], bool], item: Any) -> bool:
        usage = getattr(item, "usage", None)
        if usage is not None:
            with swallow(sites.HEDGE_READ):
                self.reported_input, self.reported_output, _ = _openai_wire.read_usage(usage)
        try:
            content = is_content(item)
        except Exception as failure:  # an item we cannot read: take it as the answer starting
            report(sites.HEDGE_READ, failure)
            content = True
        if content:
            self.content_seen += 1
        return content

    def settle(self, result: Any) -> None:
        """This copy lost but its whole answer came (a tie): what it reported is what it cost."""
        if isinstance(result, ReadAhead) or result is None:
            return
        with swallow(sites.HEDGE_READ):
            usage = _openai_wire.fields(result).get("usage")
            if usage is not None:
                self.reported_input, self.reported_output, _ = _openai_wire.read_usage(usage)
                self.wasted = (self.reported_output or 0, self.reported_input)


_SENDING = "http11.send_request_headers.started"
_RELEASING = "http11.response_closed.started"


class _Ahead:
    """What a copy reads ahead of its first content chunk, decided item by item without I/O: each item is kept
    with when its bytes came, until one carries tokens (or `PREFETCH` were read, or the stream ended); the copy
    then claims the call at that instant, and a copy that did not win is stopped."""

    __slots__ = ("buffered", "copy", "done", "is_content", "won")

    def __init__(self, copy: Copy) -> None:
        self.copy = copy
        self.is_content = copy.race.is_content
        self.buffered: list[tuple[Any, int]] = []
        self.done = False
        self.won = False

    def take(self, item: Any) -> None:
        copy = self.copy
        stamp = copy.stamp()
        buffered = self.buffered
        buffered.append((item, stamp))
        if copy._content(self.is_content, item) or len(buffered) >= PREFETCH:
            self.won = copy.reach(stamp)
            self.done = True

    def end(self) -> None:
        """The stream ended before any content chunk: it is the copy's whole answer."""
        self.won = self.copy.reach(time.perf_counter_ns())
        self.done = True

    def result(self, stream: Any) -> ReadAhead:
        if not self.won:
            raise HedgeCancelled(self.copy.role)
        return ReadAhead(stream, self.buffered)


class ReadAhead:
    """A stream and the items read from it before its first content chunk, each with when its bytes came."""

    __slots__ = ("buffered", "stream")

    def __init__(self, stream: Any, buffered: list[tuple[Any, int]]) -> None:
        self.stream = stream
        self.buffered = buffered
