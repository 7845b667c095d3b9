"""Hedged requests: a second copy of a call that is slow to start, the first to answer wins, the other is closed.

`instrument(client, hedge=Hedge(after=..., backup=...))` gives an openai client a `Hedging`; its sender takes
the place of the SDK's own request for the calls that may be sent twice (`eligible`), and every call it
takes is a `Race`. The primary copy is sent at once; when it has no first content chunk (a stream) or no
response headers (otherwise) after `after`, the backup copy is sent. The first copy to get there wins,
`claim` interrupts the other, and the call span stays one logical call timed on the winner's timeline.
Each copy is a `HedgeCopy`: what the transport records its attempts and reads on, in place of the call.

How a loser is stopped: an asyncio copy runs in a task of its own and is cancelled. A sync copy runs in a
thread (the primary in the app's, the backup in a `llmspans-hedge-backup` thread that ends with its copy),
and a thread cannot be cancelled: its socket is shut down, which wakes the read it is blocked in, and the
failure that follows is turned into `HedgeCancelled` so the SDK does not retry it (`HedgeCopy.watch`). One
daemon thread, `llmspans-hedge`, sends the sync backups when they come due (`_Alarms`); at fork the child
forgets it and starts its own. What each figure means: docs/telemetry.md; the choices: README "Levers".
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextvars
import functools
import heapq
import itertools
import math
import os
import re
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import wrapt
from opentelemetry.util.types import AttributeValue

from llmspans import _metrics as metric
from llmspans import _names as names
from llmspans import _openai_wire, _prompt, _telemetry, _transport
from llmspans import _sites as sites
from llmspans._adapters import openai_sdk
from llmspans._budget import parse_seconds, seconds
from llmspans._call import Attempt, CallRecord
from llmspans._guard import guarded, report, swallow
from llmspans._limiter import Limiter, LimiterTimeout

WINDOW = 200  # first-token times per model a percentile `after` is taken over
MIN_SAMPLES = 20  # fewer than this, and a percentile `after` sends no backup: p95 of 19 is their maximum
_MODELS = 64  # models with a window of their own, per Hedge
_PREFETCH = 256  # items read ahead of a stream's first content chunk, at most (role chunks, events)
_PERCENTILE = re.compile(r"^\s*p(\d+(?:\.\d+)?)\s*$")
_KEPT = 256


class HedgeCancelled(BaseException):
    """Stops a sync copy that lost (or was refused a retry): a BaseException, so neither the openai SDK's
    retry loop nor any handler of ordinary errors takes it for a failure to retry; it never reaches the app."""


class Hedge:
    """Send a second copy of an LLM call that is slow to start, and keep whichever answers first.

    `after`: how long the first copy may go without its first content chunk (a stream) or its response
    headers (otherwise) before the second is sent: seconds (`0.15`), a duration (`"150ms"`), or a percentile
    of the model's own recent times (`"p95"`, over the last 200 calls of that model through this Hedge; no
    second copy is sent until 20 were seen). `backup`: the client that sends the second copy, another openai
    client of the same kind (sync or async; instrumented or not), or None for the same client.
    """

    __slots__ = ("_after_s", "_lock", "_quantile", "_windows", "after", "backup")

    def __init__(self, after: float | str = "p95", backup: Any = None) -> None:
        self._after_s, self._quantile = _parse_after(after)
        _check_backup(backup)
        self.after = after
        self.backup = backup
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        backup = "the same client" if self.backup is None else type(self.backup).__qualname__
        return f"Hedge(after={self.after!r}, backup={backup})"

    def after_ns(self, model: str | None) -> int | None:
        """When to send the backup of a call of `model`, in ns after the primary left; None: not yet known."""
        if self._quantile is None:
            return round(self._after_s * 1e9)  # type: ignore[operator]
        with self._lock:
            window = self._windows.get(model or "")
            return None if window is None else window.quantile(self._quantile)

    def observed(self, model: str | None, elapsed_ns: int) -> None:
        """A call of `model` got its first token (or headers) `elapsed_ns` after its primary left."""
        if self._quantile is None:
            return
        key = model or ""
        with self._lock:
            window = self._windows.get(key)
            if window is None:
                if len(self._windows) >= _MODELS:
                    return
                window = self._windows[key] = _Window()
            window.add(elapsed_ns)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()


def _parse_after(after: object) -> tuple[float | None, float | None]:
    """(seconds, None) or (None, quantile), or an error that says what to pass."""
    what = (
        "Hedge(after=...) must be seconds (0.15), a duration such as '150ms', or a percentile of the "
        "model's recent first tokens such as 'p95'"
    )
    if isinstance(after, bool) or not isinstance(after, (int, float, str)):
        raise TypeError(f"{what}; got {after!r}")
    if isinstance(after, str):
        match = _PERCENTILE.match(after)
        if match:
            percentile = float(match.group(1))
            if not 50 <= percentile < 100:
                raise ValueError(f"{what}; a percentile from p50 to p99.9, got {after!r}")
            return None, percentile / 100
    try:
        return parse_seconds(after, what="Hedge(after=...)"), None
    except ValueError:
        raise ValueError(f"{what}; got {after!r}") from None


def _check_backup(backup: object) -> None:
    if backup is None or openai_sdk.ADAPTER.matches(backup):
        return
    kind = f"{type(backup).__module__}.{type(backup).__qualname__}"
    if isinstance(backup, type):
        raise TypeError(
            f"Hedge(backup=...) takes a client, not a class: pass an instance, e.g. openai.OpenAI(...); got {kind}"
        )
    if any(base.__module__.split(".")[0] in ("httpx", "httpx2") for base in type(backup).__mro__):
        raise TypeError(
            "Hedge(backup=...) must be an openai client (openai.OpenAI or AsyncOpenAI), not a plain HTTP client: "
            f"wrap it, openai.OpenAI(base_url=..., http_client=...); got {kind}"
        )
    raise TypeError(f"Hedge(backup=...) must be an openai client or None (the same client); got {kind}")


def check(hedge: object) -> None:
    """`instrument()`'s `hedge` argument, or an error that says what to pass."""
    if hedge is not None and not isinstance(hedge, Hedge):
        raise TypeError(
            f"hedge must be an llmspans.Hedge, e.g. hedge=llmspans.Hedge(after='150ms'); got {hedge!r}"
        )


def check_client(hedge: Hedge | None, target: Any) -> None:
    """A hedge fits `target` (a client or a client class): an openai one, of its backup's kind."""
    if hedge is None:
        return
    cls = target if isinstance(target, type) else type(target)
    if not openai_sdk.ADAPTER.matches_class(cls):
        raise TypeError(
            "hedge= needs an openai client: a plain httpx/httpx2 client hands the app the raw response bytes, "
            "which llmspans cannot take back once a copy has lost. Instrument the openai client instead: "
            "llmspans.instrument(openai.OpenAI(http_client=...), hedge=...)"
        )
    if hedge.backup is not None and _is_async(cls) != _is_async(type(hedge.backup)):
        kinds = ("an async", "a sync")
        raise TypeError(
            f"the hedge's backup is {kinds[not _is_async(type(hedge.backup))]} client and "
            f"{cls.__qualname__} is {kinds[not _is_async(cls)]} one: a backup must be of the client's kind "
            "(openai.OpenAI with openai.OpenAI, AsyncOpenAI with AsyncOpenAI)"
        )


def _is_async(cls: type) -> bool:
    return any(base.__name__ == "AsyncOpenAI" for base in cls.__mro__)


class _Window:
    """The last `WINDOW` times of one model, in arrival order and sorted, for a quantile in O(1)."""

    __slots__ = ("arrived", "ordered")

    def __init__(self) -> None:
        self.arrived: collections.deque[int] = collections.deque()
        self.ordered: list[int] = []

    def add(self, value: int) -> None:
        if len(self.arrived) >= WINDOW:
            oldest = self.arrived.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, oldest)]
        self.arrived.append(value)
        bisect.insort(self.ordered, value)

    def quantile(self, q: float) -> int | None:
        """Nearest rank, as the report computes percentiles; None below `MIN_SAMPLES`."""
        ordered = self.ordered
        n = len(ordered)
        if n < MIN_SAMPLES:
            return None
        return ordered[max(1, math.ceil(q * n)) - 1]


# --- binding a hedge to a client ------------------------------------------------------------------------


class Hedging:
    """A `Hedge` bound to one instrumented openai client (`Settings.hedge`)."""

    def __init__(self, hedge: Hedge, client: Any) -> None:
        check_client(hedge, client)
        self.hedge = hedge
        self.is_async = _is_async(type(client))
        backup = hedge.backup
        if backup is not None and backup is not client:
            # The backup's copies are observed by its transport as the primary's are (it records nothing of
            # the backup's own calls, which have no call of ours around them), and a sync one can be stopped.
            _transport.install(backup._client)
            if not self.is_async:
                _watch_requests(backup)

    def sender(self, adapter: openai_sdk.OpenAIInstrumentation) -> Callable[..., Any]:
        """What the adapter sends a call with, in place of the SDK's own request."""
        if self.is_async:
            return functools.partial(_send_async, self, adapter)
        _watch_requests(adapter.client)
        return functools.partial(_send_sync, self, adapter)

    @guarded(sites.HEDGE_BEGIN, None)
    def start(self, adapter: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Race | None:
        """The race of one call, or None: a call that must not be sent twice (`eligible`)."""
        call = _transport.active_call.get()
        options = args[1] if len(args) > 1 else kwargs.get("options")
        if call is None or type(call) is not CallRecord or options is None:
            return None
        url = getattr(options, "url", None)
        if not isinstance(url, str) or openai_sdk._raw_mode(options) is not None:
            return None  # a raw response the app reads itself
        body: Mapping[str, Any] = options.json_data if isinstance(options.json_data, Mapping) else {}
        extra = getattr(options, "extra_json", None)
        if isinstance(extra, Mapping) and extra:
            body = {**body, **extra}
        if not eligible(str(getattr(options, "method", "post")), url, body):
            return None
        return Race(self, call, adapter, args, kwargs, url, body)

    def backup_request(self, adapter: Any) -> Callable[..., Any]:
        backup = self.hedge.backup
        if backup is None or backup is adapter.client:
            return adapter._original_request  # type: ignore[no-any-return]
        installed = getattr(backup, openai_sdk._MARK, None)  # an instrumented backup: around its own calls
        return installed._original_request if installed is not None else backup.request  # type: ignore[no-any-return]


def eligible(method: str, url: str, body: Mapping[str, Any]) -> bool:
    """Whether a call may be sent twice: it must change nothing on the server. Chat completions, completions
    and embeddings may, unless chat asks the server to store the completion (`store=True`); a Responses call
    only with `store=False` (the API stores responses unless told not to), without `background` and
    without a `conversation` (which the response is added to)."""
    if method.lower() != "post" or _openai_wire.operation_for(url) is None:
        return False
    if _openai_wire.is_responses_path(url):
        return body.get("store") is False and not body.get("background") and not body.get("conversation")
    return body.get("store") is not True


def _watch_requests(client: Any) -> None:
    """Let a sync client's copies be stopped: each request a copy sends gets its trace hook (`watch`),
    through the SDK's own hook for amending a request once built."""
    if client.__dict__.get("_prepare_request") is not None:
        return
    original = client._prepare_request

    def prepare(request: Any) -> None:
        original(request)
        copy = _transport.active_call.get()
        if type(copy) is HedgeCopy:
            copy.watch(request)

    client._prepare_request = prepare


def unwatch(client: Any) -> None:
    client.__dict__.pop("_prepare_request", None)


# --- one copy ---------------------------------------------------------------------------------------------


class _CopyAttempt(Attempt):
    """An attempt of a copy: its span says which copy it is, and whether it won, from its start. The
    transport makes a plain `Attempt`; `_CopyAttempts.append` makes it this (the same layout, no slots)."""

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


class _CopyAttempts(list[Attempt]):
    """A copy's attempts. The transport appends each one as it starts, before its span is made: here it
    becomes the copy's, and a copy that lost sends nothing more (the SDK retrying it after its back-off).
    A hedge adds nothing to the transport's per-attempt path; a call without one never meets this list."""

    __slots__ = ("owner",)

    def __init__(self, copy: HedgeCopy) -> None:
        super().__init__()
        self.owner = weakref.ref(copy)  # weak: the copy holds this list (no cycle for the collector)

    def append(self, attempt: Attempt) -> None:
        copy = self.owner()
        if copy is None:  # pragma: no cover - a copy's request runs with the copy current
            raise HedgeCancelled(names.HEDGE_ROLE_PRIMARY)
        if copy.cancelled:
            raise HedgeCancelled(copy.role)
        if type(attempt) is Attempt:
            attempt.__class__ = _CopyAttempt
            attempt.role = copy.role  # type: ignore[attr-defined]
        super().append(attempt)


class _CopyWatch:
    """The copy's response headers, as the transport sees them arrive: a call that does not stream is won
    by the first copy whose headers say 2xx."""

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

    def __init__(self, race: Race, role: str) -> None:  # CallRecord's own set-up is the call's, not ours
        call = race.call
        # Weak: the race holds its copies. Whatever runs a copy (the caller's frame, a backup's thread or
        # task, the alarm) holds the race, so it is there whenever the copy is at work; the race and its
        # copies are then freed by reference counting when the call is over, not left for the collector.
        self._race = weakref.ref(race)
        self.role = role
        self.attempts = _CopyAttempts(self)
        self.span = call.span
        self.recording = call.recording
        self.suppressed = call.suppressed
        self.shape = call.shape
        self.queued_ns = call.queued_ns
        self.wall_anchor_ns = call.wall_anchor_ns
        self.stream = call.stream
        self.attempt_spans_always = True  # each copy is an attempt span: the report reads the primaries'
        self.body_observer = _CopyWatch(self)
        self.lock = threading.Lock()
        self.cancelled = False
        self.connection: Any = None  # a sync copy's HTTP/1.1 connection while it is in use
        self.task: asyncio.Task[Any] | None = None
        self.launched_ns = 0
        self.reached_ns: int | None = None  # its first content chunk (a stream) or 2xx headers
        self.content_seen = 0  # content chunks read before it was stopped
        self.reported_input: int | None = None
        self.reported_output: int | None = None
        self.release: Callable[[], None] | None = None  # gives back the limiter slot it holds, if any
        self.wasted: tuple[int, int | None] | None = None  # (output, input) it had when it lost

    @property
    def race(self) -> Race:
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
        if not self.stream and status is not None and 200 <= status < 300:
            self.reach(now)

    # --- the race ---

    def reach(self, at_ns: int) -> bool:
        """The copy got its first content chunk (or 2xx headers) at `at_ns`: record it, and claim the call."""
        if self.reached_ns is not None:
            return self.race.winner is self
        self.reached_ns = at_ns
        attempts = self.attempts
        span = attempts[-1].span if attempts else None
        if span is not None:
            with swallow(sites.HEDGE_SPAN):
                span.set_attribute(names.HEDGE_FIRST_TOKEN, seconds(at_ns - self.launched_ns))
        return self.race.claim(self, at_ns)

    def interrupt(self) -> None:
        """Stop this copy where it is (it lost, or its call is over): once, and never the winner."""
        with self.lock:
            if self.cancelled or self.race.winner is self:
                return
            self.cancelled = True
            connection = self.connection
            if connection is not None:
                _shut_down(connection)
        task = self.task
        if task is not None and not task.done():
            task.cancel()

    # --- a sync copy's requests (see `_watch_requests`) ---

    def watch(self, request: Any) -> None:
        """Follow one request of this copy through httpcore's trace events: note the HTTP/1.1 connection it
        is sent on (so `interrupt` can shut it down), forget it once the response is closed (the connection
        may serve another request then), and turn what fails after an interrupt into `HedgeCancelled`."""
        previous = request.extensions.get("trace")
        copy = self

        def trace(event: str, info: dict[str, Any]) -> None:
            if event == _SENDING:
                copy._sending(sys._getframe(1))
            elif event == _RELEASING:
                with copy.lock:
                    copy.connection = None
            if previous is not None:
                previous(event, info)
            if copy.cancelled and event.endswith((".failed", ".started")) and "response_closed" not in event:
                raise HedgeCancelled(copy.role)

        request.extensions["trace"] = trace

    def _sending(self, frame: Any) -> None:
        with self.lock:
            if self.cancelled:
                raise HedgeCancelled(self.role)
            with swallow(sites.HEDGE_CONNECTION):
                self.connection = _http11_connection(frame)

    # --- a stream's first content chunk ---

    def read_ahead(self, stream: Any) -> _ReadAhead:
        """Read a sync stream up to its first content chunk (or its end) and claim the call there."""
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
                if self._content(is_content, item) or len(buffered) >= _PREFETCH:
                    won = self.reach(stamp)
                    break
            if not won:
                raise HedgeCancelled(self.role)
        except BaseException:
            with swallow(sites.HEDGE_CLOSE):
                stream.close()
            raise
        return _ReadAhead(stream, buffered)

    async def read_ahead_async(self, stream: Any) -> _ReadAhead:
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
                if self._content(is_content, item) or len(buffered) >= _PREFETCH:
                    won = self.reach(stamp)
                    break
            if not won:
                raise HedgeCancelled(self.role)
        except BaseException:
            with swallow(sites.HEDGE_CLOSE):
                await stream.close()
            raise
        return _ReadAhead(stream, buffered)

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


_SENDING = "http11.send_request_headers.started"
_RELEASING = "http11.response_closed.started"


def _http11_connection(frame: Any) -> Any:
    """The network stream of the HTTP/1.1 connection whose trace event is being reported: httpcore passes
    its trace callbacks no connection, so it is found in the caller's frames (`HTTP11Connection`, in httpcore
    and httpcore2 alike). HTTP/2 multiplexes requests on one connection, which must not be shut down for
    one of them: None there, and the copy stops at its next trace event instead."""
    for _ in range(8):
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
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's: an SSL one keeps its state


class _ReadAhead:
    """A stream and the items read from it before its first content chunk, each with when its bytes came."""

    __slots__ = ("buffered", "stream")

    def __init__(self, stream: Any, buffered: list[tuple[Any, int]]) -> None:
        self.stream = stream
        self.buffered = buffered


# --- the race of one call ---------------------------------------------------------------------------------


def _content_check(url: str) -> Callable[[Any], bool]:
    """Whether an SDK item of this operation's stream carries tokens (the adapter's per-chunk readers' rule)."""
    if _openai_wire.is_responses_path(url):
        return _responses_content
    if url.rstrip("/").endswith("/chat/completions"):
        return _chat_content
    return _completion_content


def _chat_content(item: Any) -> bool:
    for choice in item.choices or ():
        delta = choice.delta
        if delta is not None and (
            delta.content or delta.tool_calls or delta.refusal or openai_sdk._reasoning_in(delta)
        ):
            return True
    return False


def _completion_content(item: Any) -> bool:
    choices = item.choices
    return bool(choices and choices[0].text)


def _responses_content(item: Any) -> bool:
    return getattr(item, "type", None) in _openai_wire.RESPONSES_DELTAS and bool(getattr(item, "delta", None))


class Race:
    """One hedged call: its copies, which won, and what it cost. It is also the call's lever
    (`CallRecord.lever`): once the call is written, `finished` adds the hedge's attributes and metrics."""

    def __init__(
        self, hedging: Hedging, call: CallRecord, adapter: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        url: str, body: Mapping[str, Any],
    ) -> None:  # fmt: skip
        self.hedging = hedging
        self.call = call
        self.adapter = adapter
        self.args = args
        self.kwargs = kwargs
        self.body = body
        self.is_content = _content_check(url)
        model = body.get("model")
        self.model = model if isinstance(model, str) else None
        self.limiter: Limiter | None = adapter.settings.limiter
        self.lock = threading.Lock()
        self.winner: HedgeCopy | None = None
        self.closed = False  # no backup may be sent any more
        self.skipped: str | None = None
        self.fired_ns: int | None = None
        self.backup: HedgeCopy | None = None
        self.backup_done = threading.Event()
        self.backup_outcome: tuple[Any, BaseException | None] = (None, None)
        self.decided: asyncio.Future[None] | None = None
        self.context = contextvars.Context()  # the app's, for a sync backup's thread
        self.after_ns = hedging.hedge.after_ns(self.model)
        self.primary = HedgeCopy(self, names.HEDGE_ROLE_PRIMARY)
        call.attempts = self.primary.attempts  # the call's until a backup wins
        self.previous = call.lever
        call.lever = self
        self.started_ns = time.perf_counter_ns()

    # --- deciding ---

    def claim(self, copy: HedgeCopy, at_ns: int) -> bool:
        """`copy` got there first, unless another did: it wins, and the other is stopped."""
        with self.lock:
            if self.winner is not None or copy.cancelled:
                return False
            self.winner = copy
            self.closed = True
            loser = self.backup if copy is self.primary else self.primary
            if loser is not None and loser is not copy:
                loser.wasted = (loser.content_seen, loser.reported_input)
        with swallow(sites.HEDGE_SPAN):
            span = copy.attempts[-1].span if copy.attempts else None
            if span is not None:
                span.set_attribute(names.HEDGE_WON, True)
        call = self.call
        call.attempts = copy.attempts
        if copy is self.backup and copy.release is not None:
            # The call keeps the winner's slot; the primary's goes back once it has stopped.
            self.primary.release, call.on_release, copy.release = call.on_release, copy.release, None
        with swallow(sites.HEDGE_SPAN):
            self.hedging.hedge.observed(self.model, at_ns - self.started_ns)
        if loser is not None and loser is not copy:
            loser.interrupt()
        decided = self.decided
        if decided is not None and not decided.done():
            decided.set_result(None)
        return True

    def _take_slot(self) -> Any:
        """A backup's own limiter slot, only if one is free now (see README "Levers"); False: none."""
        limiter = self.limiter
        if limiter is None:
            return None
        try:
            return limiter.acquire(timeout=0)
        except LimiterTimeout:
            return False

    def _fire(self) -> HedgeCopy | None:
        """Make the backup copy if the call still needs one (the caller sends it); None otherwise."""
        with self.lock:
            if self.closed or self.backup is not None:
                return None
            admission = self._take_slot()
            if admission is False:
                self.closed = True
                self.skipped = names.HEDGE_SKIPPED_LIMITER
                return None
            backup = self.backup = HedgeCopy(self, names.HEDGE_ROLE_BACKUP)
            if admission is not None:
                backup.release = admission.release
            self.fired_ns = now = time.perf_counter_ns()
        call = self.call
        if call.recording:
            with swallow(sites.HEDGE_SPAN):
                call.span.add_event(
                    names.EVENT_HEDGE, {names.ELAPSED: seconds(now - call.queued_ns)}, call.wall_ns(now)
                )
        return backup

    @staticmethod
    def _release(copy: HedgeCopy) -> None:
        """A copy that stopped gives back its limiter slot, if it holds one the call does not."""
        release, copy.release = copy.release, None
        if release is not None:
            with swallow(sites.HEDGE_CLOSE):
                release()

    # --- sync: the primary in the app's thread, the backup in a thread of its own ---

    def run_sync(self) -> Any:
        if self.after_ns is not None:
            with swallow(sites.HEDGE_FIRE):  # no alarm: the call goes unhedged
                self.context = contextvars.copy_context()
                _alarms.schedule(self.started_ns + self.after_ns, self)
        primary = self.primary
        try:
            result = self._run_copy_sync(primary, self.adapter._original_request)
        except HedgeCancelled:
            return self._backup_result()  # the backup won and stopped us
        except Exception as error:
            return self._primary_failed(error)
        except BaseException:
            self._stop_backup()
            raise
        if self.winner is primary:
            return self._hand_over(primary, result)
        _discard(result)
        return self._backup_result()

    def _run_copy_sync(self, copy: HedgeCopy, send: Callable[..., Any]) -> Any:
        token = _transport.active_call.set(copy)
        copy.launched_ns = time.perf_counter_ns()
        try:
            result = send(*self.args, **self.kwargs)
            if self.call.stream:
                return copy.read_ahead(result)
            if copy.reached_ns is None:  # its headers went unseen: the body is its answer
                copy.reach(time.perf_counter_ns())
            return result
        finally:
            _transport.active_call.reset(token)

    def fire_sync(self) -> None:
        """The alarm: the primary has not got there in time; send the backup from its own thread."""
        backup = self._fire()
        if backup is None:
            return
        thread = threading.Thread(
            target=self.context.run,
            args=(self._run_backup_sync, backup),
            name="llmspans-hedge-backup",
            daemon=True,
        )
        try:
            thread.start()
        except BaseException as error:  # no thread to be had: the backup never left, the primary goes on
            with self.lock:
                self.backup_outcome = (None, error)
            self._release(backup)
            self.backup_done.set()  # a primary that fails must not wait for it
            raise

    def _run_backup_sync(self, backup: HedgeCopy) -> None:
        outcome: tuple[Any, BaseException | None]
        try:
            outcome = (self._run_copy_sync(backup, self.hedging.backup_request(self.adapter)), None)
        except BaseException as error:  # HedgeCancelled too: this thread's end
            outcome = (None, error)
        with self.lock:
            won = self.winner is backup
            # A loser's outcome is never read (the primary's own answer or error is the call's); its
            # exception's traceback would hold this race in a cycle.
            self.backup_outcome = outcome if won else (None, None)
        if not won:
            _discard(outcome[0])
            self._release(backup)
        # The exception's traceback holds this frame: without this its locals would hold the exception.
        del outcome
        self.backup_done.set()

    def _backup_result(self) -> Any:
        """The primary stopped (it lost, or failed while the backup runs): the backup's answer, once it has one."""
        primary = self.primary
        self._release(primary)
        backup = self.backup
        if backup is None:  # pragma: no cover - only a backup's claim stops the primary
            raise RuntimeError("llmspans: a hedged call lost its primary without a backup")
        try:
            self.backup_done.wait()
        except BaseException:
            backup.interrupt()
            raise
        result, error = self.backup_outcome
        if error is not None:
            raise error
        return self._hand_over(backup, result)

    def _primary_failed(self, error: Exception) -> Any:
        """The primary failed: the call is the backup's if one was sent and it answers, else this error's."""
        with self.lock:
            self.closed = True
            backup = self.backup
        if backup is None:
            raise error
        self.backup_done.wait()
        self._release(self.primary)  # the backup's claim gave it the call's slot, if it won
        result, backup_error = self.backup_outcome
        if backup_error is not None or self.winner is not backup:
            raise error
        return self._hand_over(backup, result)

    def _stop_backup(self) -> None:
        with self.lock:
            self.closed = True
            backup = self.backup
        if backup is not None:
            backup.interrupt()

    # --- asyncio: each copy in a task of its own ---

    async def run_async(self) -> Any:
        loop = asyncio.get_running_loop()
        self.decided = loop.create_future()
        primary = self.primary
        tasks = [self._start_task(loop, primary, self.adapter._original_request)]
        try:
            if self.after_ns is not None:
                delay = (self.started_ns + self.after_ns - time.perf_counter_ns()) / 1e9
                await asyncio.wait(
                    {tasks[0], self.decided}, timeout=max(0.0, delay), return_when=asyncio.FIRST_COMPLETED
                )
                if not self.decided.done() and not tasks[0].done():
                    backup = None
                    with swallow(sites.HEDGE_FIRE):  # a backup that cannot be made: the call goes on unhedged
                        backup = self._fire()
                    if backup is not None:
                        tasks.append(
                            self._start_task(loop, backup, self.hedging.backup_request(self.adapter))
                        )
            with self.lock:
                self.closed = True
            while not self.decided.done():
                running = [task for task in tasks if not task.done()]
                if not running:
                    break
                await asyncio.wait({*running, self.decided}, return_when=asyncio.FIRST_COMPLETED)
            winner = self.winner
            losers = [copy for copy in (primary, self.backup) if copy is not None and copy is not winner]
            for loser in losers:
                loser.interrupt()
            stopping = [loser.task for loser in losers if loser.task is not None and not loser.task.done()]
            if stopping:
                await asyncio.wait(stopping)  # closed before the caller goes on
            for loser in losers:
                self._release(loser)
                loser.task = None  # a finished task holds its exception, whose frames hold the copy
            if winner is None:
                return tasks[0].result()  # the primary's own failure (a backup that failed too says less)
            result = await winner.task  # type: ignore[misc]
            return self._hand_over(winner, result)
        except BaseException:  # cancelled, or the winner failed after winning
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            for copy in (primary, self.backup):
                if copy is not None and copy is not self.winner:
                    self._release(copy)
            raise

    def _start_task(
        self, loop: asyncio.AbstractEventLoop, copy: HedgeCopy, send: Callable[..., Any]
    ) -> asyncio.Task[Any]:
        task = copy.task = loop.create_task(
            self._run_copy_async(copy, send), name=f"llmspans-hedge-{copy.role}"
        )
        task.add_done_callback(_retrieve)
        return task

    async def _run_copy_async(self, copy: HedgeCopy, send: Callable[..., Any]) -> Any:
        _transport.active_call.set(copy)  # this task's own context
        copy.launched_ns = time.perf_counter_ns()
        result = await send(*self.args, **self.kwargs)
        if self.call.stream:
            return await copy.read_ahead_async(result)
        if copy.reached_ns is None:
            copy.reach(time.perf_counter_ns())
        return result

    # --- the answer ---

    def _hand_over(self, copy: HedgeCopy, result: Any) -> Any:
        # The race lives as long as the HTTP pool holds a copy's request (until its response is closed): it
        # must not hold the answer, or an answer the app drops unclosed is never collected, and its
        # connection never closed, as it is without a hedge.
        self.backup_outcome = (None, None)
        copy.task = None  # a finished task holds its result
        if isinstance(result, _ReadAhead):
            replay = _AsyncReplay if self.hedging.is_async else _SyncReplay
            return replay(result.stream, self.call, copy, collections.deque(result.buffered))
        return result

    # --- the lever: what the call span and the metrics say ---

    def finished(self, record: CallRecord, outcome: str, duration_ns: int) -> None:
        self._write(record)
        previous = self.previous
        # The call is written: what tied it and the copies' answers into cycles goes (see `HedgeCopy.race`).
        record.lever = previous
        self.backup_outcome = (None, None)  # a stopped copy's exception: its traceback's frames hold the race
        for copy in (self.primary, self.backup):
            if copy is not None:
                for attempt in copy.attempts:
                    attempt.response = None
        if previous is not None:
            previous.finished(record, outcome, duration_ns)

    @guarded(sites.HEDGE_FINISH, None)
    def _write(self, record: CallRecord) -> None:
        fired = self.fired_ns is not None
        attributes: dict[str, AttributeValue] = {names.HEDGE_FIRED: fired}
        if self.after_ns is not None:
            attributes[names.HEDGE_AFTER] = seconds(self.after_ns)
        if self.skipped is not None:
            attributes[names.HEDGE_SKIPPED] = self.skipped
        labels = _labels_of(record.shape)
        records: list[metric.Record] = []
        if fired:
            winner = self.winner
            records.append((metric.HEDGE_FIRED, 1, labels[0]))
            if winner is not None:
                attributes[names.HEDGE_WON_BY] = winner.role
                if winner is self.backup:
                    records.append((metric.HEDGE_BACKUP_WON, 1, labels[0]))
            loser = self.backup if winner is not self.backup else self.primary
            if loser is not None and loser.attempts:  # it was sent: its prompt was read, at least
                output, reported = loser.wasted or (loser.content_seen, loser.reported_input)
                wasted_input = self._input_tokens(record, reported)
                attributes[names.HEDGE_WASTED_INPUT_TOKENS] = wasted_input
                attributes[names.HEDGE_WASTED_OUTPUT_TOKENS] = output
                records.append((metric.HEDGE_WASTED_TOKENS, wasted_input, labels[1]))
                if output:
                    records.append((metric.HEDGE_WASTED_TOKENS, output, labels[2]))
                opened = sum(1 for attempt in loser.attempts if attempt.new_connection)
                if opened:  # the loser's connections are the call's churn too
                    total = opened + sum(1 for attempt in record.attempts if attempt.new_connection)
                    attributes[names.CONNECT_NEW] = total
                    records.append((metric.CONNECT_NEW, opened, record.shape.metric_labels))
        if record.recording:
            record.span.set_attributes(attributes)
        if records:
            recorder = _telemetry.recorder()
            recorder.add(
                records, recorder.sample(record.span, record.wall_ns(record.released_ns or record.queued_ns))
            )

    def _input_tokens(self, record: CallRecord, reported_by_loser: int | None) -> int:
        """The loser's prompt: the winner's count, else the loser's own, else an estimate (the prompt cap's,
        or characters/4)."""
        if record.input_tokens is not None:
            return record.input_tokens
        if reported_by_loser is not None:
            return reported_by_loser
        estimated = getattr(self.previous, "estimated", None)
        if isinstance(estimated, int):
            return estimated
        texts, tokens = _prompt.prompt_pieces(self.body)
        return _prompt.CHARACTERS.count(texts) + tokens


def _discard(result: Any) -> None:
    """Close what a copy that lost got back (a stream it read ahead in is closed already)."""
    if isinstance(result, _ReadAhead):
        with swallow(sites.HEDGE_CLOSE):
            result.stream.close()


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A copy's task is never left with an exception nobody asked for (asyncio would log it)."""
    if not task.cancelled():
        task.exception()


_label_sets: dict[str, tuple[metric.Labels, metric.Labels, metric.Labels]] = {}
_LABEL_KEYS = (names.GEN_AI_OPERATION_NAME, names.GEN_AI_PROVIDER_NAME, names.GEN_AI_REQUEST_MODEL)


def _labels_of(shape: Any) -> tuple[metric.Labels, metric.Labels, metric.Labels]:
    """By model: the counters' attributes, and the wasted tokens' for input and for output."""
    key = shape.metric_labels.key
    found = _label_sets.get(key)
    if found is None:
        attributes = shape.metric_labels.attributes
        common = {k: attributes[k] for k in _LABEL_KEYS if k in attributes}
        found = (
            metric.Labels(common),
            metric.Labels({**common, names.GEN_AI_TOKEN_TYPE: names.TOKEN_TYPE_INPUT}),
            metric.Labels({**common, names.GEN_AI_TOKEN_TYPE: names.TOKEN_TYPE_OUTPUT}),
        )
        if len(_label_sets) >= _KEPT:
            _label_sets.clear()
        _label_sets[key] = found
    return found


# --- the senders the adapter calls ------------------------------------------------------------------------


def _send_sync(hedging: Hedging, adapter: Any, *args: Any, **kwargs: Any) -> Any:
    race = hedging.start(adapter, args, kwargs)
    if race is None:
        return adapter._original_request(*args, **kwargs)
    return race.run_sync()


async def _send_async(hedging: Hedging, adapter: Any, *args: Any, **kwargs: Any) -> Any:
    race = hedging.start(adapter, args, kwargs)
    if race is None:
        return await adapter._original_request(*args, **kwargs)
    return await race.run_async()


# --- the winner's stream, as the app reads it ---------------------------------------------------------------


class _SyncReplay(wrapt.ObjectProxy[Any]):
    """The winning copy's SDK stream: first the items read ahead of its first content chunk, each at the
    instant its bytes came, then the rest as they come. The call's stamps are taken from the copy's reads."""

    def __init__(
        self, stream: Any, call: CallRecord, copy: HedgeCopy, buffered: collections.deque[tuple[Any, int]]
    ) -> None:
        super().__init__(stream)
        self._self_call = call
        self._self_copy = copy
        self._self_buffered = buffered

    def __iter__(self) -> Any:
        return self._self_items()

    def _self_items(self) -> Any:
        call, copy, buffered = self._self_call, self._self_copy, self._self_buffered
        while buffered:
            item, call.bytes_at_ns = buffered.popleft()
            yield item
        for item in self.__wrapped__:
            call.bytes_at_ns = copy.bytes_at_ns
            call.last_bytes = copy.last_bytes
            yield item
        call.last_bytes = copy.last_bytes

    def __next__(self) -> Any:
        buffered = self._self_buffered
        if buffered:
            item, self._self_call.bytes_at_ns = buffered.popleft()
            return item
        try:
            item = self.__wrapped__.__next__()
        finally:
            self._self_call.bytes_at_ns = self._self_copy.bytes_at_ns
            self._self_call.last_bytes = self._self_copy.last_bytes
        return item


class _AsyncReplay(wrapt.ObjectProxy[Any]):
    """`_SyncReplay` for an `AsyncStream`."""

    def __init__(
        self, stream: Any, call: CallRecord, copy: HedgeCopy, buffered: collections.deque[tuple[Any, int]]
    ) -> None:
        super().__init__(stream)
        self._self_call = call
        self._self_copy = copy
        self._self_buffered = buffered

    def __aiter__(self) -> Any:
        return self._self_items()

    async def _self_items(self) -> Any:
        call, copy, buffered = self._self_call, self._self_copy, self._self_buffered
        while buffered:
            item, call.bytes_at_ns = buffered.popleft()
            yield item
        async for item in self.__wrapped__:
            call.bytes_at_ns = copy.bytes_at_ns
            call.last_bytes = copy.last_bytes
            yield item
        call.last_bytes = copy.last_bytes

    async def __anext__(self) -> Any:
        buffered = self._self_buffered
        if buffered:
            item, self._self_call.bytes_at_ns = buffered.popleft()
            return item
        try:
            item = await self.__wrapped__.__anext__()
        finally:
            self._self_call.bytes_at_ns = self._self_copy.bytes_at_ns
            self._self_call.last_bytes = self._self_copy.last_bytes
        return item


# --- the alarm clock of sync hedges -----------------------------------------------------------------------


class _Alarms:
    """One daemon thread (`llmspans-hedge`) that sends each sync call's backup when it comes due; started by
    the first sync hedged call. A call decided before its alarm leaves it to ring for nothing."""

    def __init__(self) -> None:
        self._wake = threading.Condition(threading.Lock())
        self._due: list[tuple[int, int, Race]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, at_ns: int, race: Race) -> None:
        with self._wake:
            heapq.heappush(self._due, (at_ns, next(self._order), race))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llmspans-hedge", daemon=True)
                self._thread.start()
            if self._due[0][2] is race:
                self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while True:
                    if not self._due:
                        self._wake.wait()
                        continue
                    wait_ns = self._due[0][0] - time.perf_counter_ns()
                    if wait_ns <= 0:
                        race = heapq.heappop(self._due)[2]
                        break
                    self._wake.wait(wait_ns / 1e9)
            try:
                race.fire_sync()
            except Exception as failure:
                report(sites.HEDGE_FIRE, failure)
            # Not kept until the next alarm: a call the app dropped unclosed must be collectable, so that
            # its connection is closed as without a hedge.
            del race

    def forget(self) -> None:
        """At fork: the child has no alarm thread; its next sync hedged call starts one."""
        self._wake = threading.Condition(threading.Lock())
        self._due = []
        self._thread = None


_alarms = _Alarms()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_alarms.forget)
