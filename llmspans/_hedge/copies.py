"""One copy of a hedged call, as the transport sees it: the attempts it makes and the bytes it reads.

A copy costs nothing until it matters: no attempt span of its own before a backup is sent (the primary's is
made then, or at the call's end with its real start, as a retried call's first attempt is), no connection
looked up until it has to be stopped. How a loser is stopped: an asyncio copy is cancelled (the backup's
task, or the caller's own task while it runs the primary); a sync copy's HTTP/1.1 socket is shut down,
which wakes the read it is blocked in, and what fails after that is turned into `HedgeCancelled` so the SDK
does not retry it (`HedgeCopy.watch`).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from llmspans import _names as names
from llmspans import _openai_wire
from llmspans import _sites as sites
from llmspans._budget import seconds
from llmspans._call import Attempt, CallRecord
from llmspans._guard import report, swallow

PREFETCH = 256  # items read ahead of a stream's first content chunk, at most (role chunks, events)
_FRAMES = 40  # frames looked through, innermost first, for the HTTP/1.1 connection a sync copy is in


class HedgeCancelled(BaseException):
    """Stops a sync copy that lost (or was refused a retry): a BaseException, so neither the openai SDK's
    retry loop nor any handler of ordinary errors takes it for a failure to retry; it never reaches the app."""


class Contest(Protocol):
    """What a copy needs of its race (`race.Race`)."""

    call: CallRecord
    winner: HedgeCopy | None
    is_content: Callable[[Any], bool]

    def claim(self, copy: HedgeCopy, at_ns: int) -> bool: ...


class CopyAttempt(Attempt):
    """An attempt of a copy: its span says which copy it is, and whether it won, from the moment it has one.
    The transport makes a plain `Attempt`; `CopyAttempts.append` makes it this (the same layout, no slots)."""

    role = names.HEDGE_ROLE_PRIMARY
    _span: Any = None

    @property
    def span(self) -> Any:
        return self._span

    @span.setter
    def span(self, span: Any) -> None:
        self._span = span
        if span is not None:
            with swallow(sites.HEDGE_SPAN):
                span.set_attributes({names.HEDGE_ROLE: self.role, names.HEDGE_WON: False})


class CopyAttempts(list[Attempt]):
    """A copy's attempts. The transport appends each one as it starts, before its span is made: here it
    becomes the copy's, and a copy that lost sends nothing more (the SDK retrying it after its back-off).
    A hedge adds nothing to the transport's per-attempt path; a call without one never meets this list."""

    def __init__(self, owner: HedgeCopy) -> None:
        super().__init__()
        self.owner = weakref.ref(owner)  # weak: the copy holds this list (no cycle for the collector)

    def append(self, attempt: Attempt) -> None:
        copy = self.owner()
        if copy is None:  # pragma: no cover - a copy's request runs with the copy current
            raise HedgeCancelled(names.HEDGE_ROLE_PRIMARY)
        if copy.cancelled:
            raise HedgeCancelled(copy.role)
        if type(attempt) is Attempt:
            attempt.__class__ = CopyAttempt
            attempt.role = copy.role  # type: ignore[attr-defined]
        super().append(attempt)


class _CopyWatch:
    """The copy's response headers, as the transport sees them arrive: a call that does not stream is won
    by the first copy whose headers say 2xx (a stream is won at its first content chunk: no watch)."""

    complete = False
    muted = False

    def __init__(self, copy: HedgeCopy) -> None:
        self.copy = weakref.ref(copy)  # weak: the copy holds its watch (no cycle for the collector)

    def response_headers(self, headers: Any) -> None:
        copy = self.copy()
        if copy is not None:
            copy.responded()

    def feed(self, chunk: bytes, now_ns: int) -> None:
        pass

    def finish(self, now_ns: int, error: BaseException | None) -> None:
        pass


class HedgeCopy(CallRecord):
    """One copy of a hedged call, as the transport sees it: the attempts it makes and the bytes it reads.

    Its span, clock and shape are the logical call's (`race.call`): its attempt spans are children of the
    call span. It is never finished, only won, lost or failed; `interrupt()` stops it from another thread
    or task, once, and never after it won.
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
    # A sync copy: the thread it runs in; its latest request, followed through httpcore's trace events once
    # it may have to be stopped (`watching`: a backup, or a primary whose backup was sent); whether that
    # request holds its connection (from its headers' sending to its response's close), and the
    # connection's stream once its response came.
    thread = 0
    request: Any = None
    watching = False
    sending = False
    network_stream: Any = None
    # An async copy: the backup's task, or the caller's while it runs the primary (`running`).
    task: asyncio.Task[Any] | None = None
    running = False

    def __init__(self, race: Contest, role: str) -> None:  # CallRecord's own set-up is the call's, not ours
        call = race.call
        # Weak: the race holds its copies. Whatever runs a copy (the caller's frame, a backup's thread or
        # task, the alarm) holds the race, so it is there whenever the copy is at work; the race and its
        # copies are then freed by reference counting when the call is over, not left for the collector.
        self._race = weakref.ref(race)
        self.role = role
        self.attempts = CopyAttempts(self)
        self.span = call.span
        self.recording = call.recording
        self.suppressed = call.suppressed
        self.shape = call.shape
        self.queued_ns = call.queued_ns
        self.wall_anchor_ns = call.wall_anchor_ns
        self.stream = call.stream
        # The backup's attempts have their spans as they run (its `traceparent` names them); the primary's
        # only once a backup is sent, or as the call asked (`attempt_spans="always"`).
        self.attempt_spans_always = call.attempt_spans_always or role != names.HEDGE_ROLE_PRIMARY
        if not self.stream:
            self.body_observer = _CopyWatch(self)
        self.lock = threading.Lock()
        if role != names.HEDGE_ROLE_PRIMARY:
            self.watching = True

    @property
    def race(self) -> Contest:
        race = self._race()
        if race is None:  # pragma: no cover - see `__init__`
            raise HedgeCancelled(self.role)
        return race

    # --- what the transport calls ---

    def attempt(self, started_ns: int, method: str = "POST", url: Any = None) -> Attempt:
        attempt = Attempt(started_ns, method, url)
        self.attempts.append(attempt)  # raises HedgeCancelled for a copy that lost
        return attempt

    def finish(self, outcome: str, error: BaseException | None = None, now_ns: int | None = None) -> None:
        """A copy is never finished: its call is."""

    def responded(self) -> None:
        now = time.perf_counter_ns()
        attempts = self.attempts
        status = attempts[-1].status if attempts else None
        if status is not None and 200 <= status < 300:
            self.reach(now)

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
            if self.sending:
                with swallow(sites.HEDGE_CONNECTION):
                    stream = self.network_stream or _http11_stream(self.thread)
                    if stream is not None:
                        _shut_down(stream)
        task = self.task
        if task is not None and (self.running or self.role != names.HEDGE_ROLE_PRIMARY) and not task.done():
            task.cancel()

    # --- a sync copy's requests (see `openai_glue.watch_requests`) ---

    def prepared(self, request: Any) -> None:
        """A request of this sync copy was built (`openai_glue.watch_requests`): followed if it may have to
        be stopped, else only kept, to be followed from when it may (`watch_now`)."""
        with self.lock:
            watching = self.watching
            if not watching:
                self.request = request
        if watching:
            self.watch(request)

    def watch_now(self) -> None:
        """This copy may have to be stopped from now on (its backup was sent): its requests are followed,
        the one under way too, taken as holding its connection (`interrupt` looks for it only in the
        frames of a thread inside an HTTP/1.1 connection)."""
        with self.lock:
            self.watching = True
            request, self.request = self.request, None
            if request is not None:
                self.sending = True
        if request is not None:
            self.watch(request)

    def watch(self, request: Any) -> None:
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
                    copy.network_stream = None
            if previous is not None:
                previous(event, info)
            if copy.cancelled and event.endswith((".failed", ".started")) and "response_closed" not in event:
                raise HedgeCancelled(copy.role)

        request.extensions["trace"] = trace

    # --- a stream's first content chunk ---

    def read_ahead(self, stream: Any) -> ReadAhead:
        """Read a sync stream up to its first content chunk (or its end) and claim the call there."""
        self._note_stream(stream)
        buffered: list[tuple[Any, int]] = []
        is_content = self.race.is_content
        try:
            while True:
                try:
                    item = stream.__next__()
                except StopIteration:
                    won = self.reach(time.perf_counter_ns())
                    break
                stamp = self.bytes_at_ns or time.perf_counter_ns()
                buffered.append((item, stamp))
                if self._content(is_content, item) or len(buffered) >= PREFETCH:
                    won = self.reach(stamp)
                    break
            if not won:
                raise HedgeCancelled(self.role)
        except BaseException:
            with swallow(sites.HEDGE_CLOSE):
                stream.close()
            raise
        return ReadAhead(stream, buffered)

    def _note_stream(self, stream: Any) -> None:
        """The HTTP/1.1 connection a sync stream is read from, for `interrupt` (HTTP/2 shares one: not it)."""
        with swallow(sites.HEDGE_CONNECTION):
            extensions = stream.response.extensions
            if extensions.get("http_version", b"HTTP/1.1") in (b"HTTP/1.1", b"HTTP/1.0"):
                with self.lock:
                    if self.sending or not self.watching:  # unwatched: what it is, should it need stopping
                        self.network_stream = extensions.get("network_stream")

    async def read_ahead_async(self, stream: Any) -> ReadAhead:
        buffered: list[tuple[Any, int]] = []
        is_content = self.race.is_content
        try:
            while True:
                try:
                    item = await stream.__anext__()
                except StopAsyncIteration:
                    won = self.reach(time.perf_counter_ns())
                    break
                stamp = self.bytes_at_ns or time.perf_counter_ns()
                buffered.append((item, stamp))
                if self._content(is_content, item) or len(buffered) >= PREFETCH:
                    won = self.reach(stamp)
                    break
            if not won:
                raise HedgeCancelled(self.role)
        except BaseException:
            with swallow(sites.HEDGE_CLOSE):
                await stream.close()
            raise
        return ReadAhead(stream, buffered)

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


def _http11_stream(thread: int) -> Any:
    """The network stream of the HTTP/1.1 connection `thread` is sending or reading on now: httpcore passes
    its trace callbacks no connection, so it is found in that thread's frames (`HTTP11Connection`, in
    httpcore and httpcore2 alike), only when a copy must be stopped. HTTP/2 multiplexes requests on one
    connection, which must not be shut down for one of them: None there, and the copy stops at its next
    trace event instead."""
    frame = sys._current_frames().get(thread)
    for _ in range(_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if type(owner).__name__ == "HTTP11Connection":
            return getattr(owner, "_network_stream", None)
        frame = frame.f_back
    return None


def _shut_down(network_stream: Any) -> None:
    """Wake whatever is blocked reading this connection: the read ends, the server sees the client leave."""
    with swallow(sites.HEDGE_CLOSE):
        sock = network_stream.get_extra_info("socket")
        if sock is not None:
            import socket

            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's: an SSL one keeps its state


class ReadAhead:
    """A stream and the items read from it before its first content chunk, each with when its bytes came."""

    __slots__ = ("buffered", "stream")

    def __init__(self, stream: Any, buffered: list[tuple[Any, int]]) -> None:
        self.stream = stream
        self.buffered = buffered
