"""The limiter: client-side admission control that also tells whether its scheduler stalls.

`Limiter(cap, name=...)` lets at most `cap` callers run at once and queues the rest in one
strict FIFO, whether they wait in threads or in asyncio tasks, on any number of event loops.
Waiting never polls, a waiter that gives up never keeps a slot, and a slot is *granted* at a
release but counts as *in flight* only when its waiter resumes: the gap between the two is
what `gap_fraction` measures. docs/limiter.md explains the states, the figures and what they
do not measure.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import math
import operator
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, TypeVar

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from llmspans import _deferred, _suppress
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._gaps import GapSketch
from llmspans._guard import guarded

__all__ = ["Admission", "Limiter", "LimiterReading", "LimiterStats", "LimiterTimeout", "live_readings"]

T = TypeVar("T")
_NS = 1e-9

# A waiter's life: queued, then granted a slot, then admitted (resumed); or gone (gave up).
_QUEUED = 0
_GRANTED = 1
_ADMITTED = 2
_GONE = 3


class LimiterTimeout(TimeoutError):
    """No slot was admitted within the acquisition timeout; the waiter left the queue."""

    def __init__(self, name: str, cap: int, timeout: float, waited: float) -> None:
        super().__init__(
            f"limiter {name!r} (cap {cap}) admitted no slot within the {timeout:g}s timeout "
            f"(waited {waited:.3f}s); raise its cap, give this work its own lane, or pass a longer timeout="
        )
        self.name = name
        self.cap = cap
        self.timeout = timeout
        self.waited = waited


@dataclass(frozen=True)
class LimiterStats:
    """A limiter's figures over one window (see `Limiter.stats`)."""

    window_s: float
    """How long the window was, in seconds."""
    mean_in_flight: float
    """Callers running, averaged over the window's time (not over events)."""
    mean_queue_depth: float
    """Callers waiting (granted-but-not-resumed included), averaged over the window's time."""
    admitted: int
    """Callers admitted in the window, including those admitted at once."""
    wait_p50_s: float
    """Median arrival-to-admission wait of the callers admitted in the window; 0 for an
    immediate admission. From a log-linear sketch: within about 6 % of the exact quantile."""
    wait_p95_s: float
    """The 95th percentile of the same waits."""
    gap_fraction: float
    """Share of the window with someone waiting while in-flight was below the cap (module docs)."""
    cap: int
    """The cap at the end of the window."""
    name: str
    """The limiter's name (its lane)."""


class LimiterReading(NamedTuple):
    """The gauges' view of one limiter name at collection time."""

    name: str
    in_flight: int
    queue_depth: int
    cap: int


class _Waiter:
    """One caller that found no free slot; woken through its own lock (thread) or future (task)."""

    __slots__ = (
        "cap",
        "future",
        "granted_ns",
        "in_flight",
        "loop",
        "queue_depth",
        "queued_ns",
        "state",
        "wake",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.future: asyncio.Future[bool] | None = None
        self.wake: threading.Lock | None = None
        self.state = _QUEUED
        self.queued_ns = 0
        self.granted_ns = 0
        self.cap = 0
        self.in_flight = 0
        self.queue_depth = 0


class Admission:
    """One admitted slot, from arrival to `release()`.

    Instants are `time.perf_counter_ns()` stamps: `queued_ns` when the caller arrived,
    `granted_ns` when a slot was handed to it, `admitted_ns` when it resumed and started
    to count as in flight (all three equal when a slot was free on arrival). `cap`,
    `in_flight` and `queue_depth` are the limiter's state on arrival, before this caller
    joined: the cap then, the callers running then, and the callers already waiting then
    (not counting this one).

    `release()` gives the slot back: idempotent, thread-safe, callable from any thread, task
    or garbage-collection finaliser. An admission dropped without `release()` gives its slot
    back when it is collected, so a forgotten release cannot shrink the limiter for good.
    """

    __slots__ = (
        "_limiter", "_released", "admitted_ns", "cap", "granted_ns", "in_flight", "name", "queue_depth",
        "queued_ns",
    )  # fmt: skip

    def __init__(self, limiter: Limiter, waiter: _Waiter, admitted_ns: int) -> None:
        self._limiter = limiter
        self._released = False
        self.name = limiter.name
        self.queued_ns = waiter.queued_ns
        self.granted_ns = waiter.granted_ns
        self.admitted_ns = admitted_ns
        self.cap = waiter.cap
        self.in_flight = waiter.in_flight
        self.queue_depth = waiter.queue_depth

    @property
    def wait_s(self) -> float:
        """Seconds from arrival to admission: the call's `queue` bucket."""
        return (self.admitted_ns - self.queued_ns) * _NS

    @property
    def released(self) -> bool:
        return self._released

    def attributes(self) -> dict[str, AttributeValue]:
        """The `llmspans.limiter.*` span attributes of this admission."""
        return {
            names.LIMITER_NAME: self.name,
            names.LIMITER_CAP: self.cap,
            names.LIMITER_IN_FLIGHT: self.in_flight,
            names.LIMITER_QUEUE_DEPTH: self.queue_depth,
            names.LIMITER_WAIT: self.wait_s,
        }

    def release(self) -> None:
        if not self._released:
            self._limiter._release(self)

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            # A finalizer takes no lock (see `_deferred`): the worker gives the slot back. At
            # interpreter shutdown there may be nothing left to give the slot to.
            with contextlib.suppress(Exception):
                _deferred.defer(self._limiter._release, self)

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<Admission {self.name!r} {state}, waited {self.wait_s:.6f}s>"


# The `with limiter:` blocks the current context is inside, innermost last. One module-level
# variable (not one per limiter) so contexts never pin a collected limiter's variable.
_held: contextvars.ContextVar[tuple[tuple[Limiter, Admission], ...]] = contextvars.ContextVar(
    "llmspans_limiter_held", default=()
)

# Every live limiter, weakly: the gauges read them at collection time. Plain references
# without callbacks, pruned on use, so a collection never runs our code inside a lock.
_live: list[weakref.ref[Limiter]] = []
_live_lock = threading.Lock()


def live_readings() -> list[LimiterReading]:
    """In-flight, queue depth and cap per limiter name, summed over live limiters sharing a name."""
    with _live_lock:
        limiters = [limiter for ref in _live if (limiter := ref()) is not None]
        _live[:] = [ref for ref in _live if ref() is not None]
    totals: dict[str, list[int]] = {}
    for limiter in limiters:
        total = totals.setdefault(limiter.name, [0, 0, 0])
        total[0] += limiter.in_flight
        total[1] += limiter.queue_depth
        total[2] += limiter.cap
    return [LimiterReading(name, *total) for name, total in totals.items()]


def _check_cap(cap: object) -> int:
    if isinstance(cap, bool) or not hasattr(cap, "__index__"):
        raise TypeError(
            f"limiter cap must be a positive integer (the most calls in flight at once), "
            f"got {cap!r} ({type(cap).__name__})"
        )
    value = operator.index(cap)
    if value < 1:
        raise ValueError(
            f"limiter cap must be a positive integer (the most calls in flight at once), got {value}"
        )
    return value


def _check_timeout(timeout: object, what: str) -> float | None:
    """Seconds as a float, `None` for no limit (`math.inf` too); 0 means "only if free at once"."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"{what} must be a number of seconds (or None to wait as long as it takes), got {timeout!r}"
        )
    seconds = float(timeout)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(
            f"{what} must be zero or a positive number of seconds (or None to wait as long as it takes), "
            f"got {timeout!r}"
        )
    return None if math.isinf(seconds) else seconds


def _resolve(future: asyncio.Future[bool], granted: bool) -> None:
    if not future.done():
        future.set_result(granted)


def _no_op(_now: int) -> None:
    return None


class Limiter:
    """At most `cap` callers at once, FIFO across threads and asyncio tasks; see the module docs.

    `name` is the lane: it labels every span attribute and gauge this limiter produces.
    `timeout` is the default acquisition timeout in seconds (None: wait as long as it
    takes; 0: admit only if a slot is free at once); `acquire(timeout=...)` overrides it.
    `cap` may be changed at run time from any thread: raising it admits waiters at once,
    lowering it lets the work in flight finish and admits nobody until in-flight drops
    below the new cap.
    """

    __slots__ = (
        "__weakref__", "_admitted", "_cap", "_changed_ns", "_deferred", "_gap_ns", "_holding", "_in_flight_area",
        "_lock", "_name", "_owner", "_queue", "_queue_area", "_running", "_timeout", "_to_wake", "_waiting",
        "_waits", "_window_start_ns",
    )  # fmt: skip

    def __init__(self, cap: int, *, name: str = "default", timeout: float | None = None) -> None:
        if not isinstance(name, str):
            raise TypeError(f"limiter name must be a string such as 'interactive' or 'batch', got {name!r}")
        if not name.strip():
            raise ValueError(f"limiter name must be a non-empty string such as 'interactive', got {name!r}")
        self._name = name
        self._cap = _check_cap(cap)
        self._timeout = _check_timeout(timeout, f"timeout of limiter {name!r}")
        _deferred.start_worker()  # an Admission's `__del__` hands its release to it
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread inside `_locked`, to defer re-entrant releases
        self._deferred: collections.deque[Admission] = collections.deque()
        self._to_wake: list[_Waiter] = []
        self._queue: collections.deque[_Waiter] = collections.deque()  # waiters not granted yet
        self._holding = 0  # slots taken: in flight, plus granted to waiters that have not resumed
        self._running = 0  # in flight
        self._waiting = 0  # queue depth: arrived and not resumed, granted or not
        now = time.perf_counter_ns()
        self._window_start_ns = now
        self._changed_ns = now
        self._in_flight_area = 0  # integrals over the window, in caller-nanoseconds
        self._queue_area = 0
        self._gap_ns = 0
        self._admitted = 0
        self._waits = GapSketch()
        with _live_lock:
            _live[:] = [ref for ref in _live if ref() is not None]
            _live.append(weakref.ref(self))

    # --- the public surface -----------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def cap(self) -> int:
        return self._cap

    @cap.setter
    def cap(self, cap: int) -> None:
        value = _check_cap(cap)
        self._locked(lambda now: self._set_cap_locked(value, now))

    @property
    def in_flight(self) -> int:
        """Callers admitted and running inside the limiter now."""
        return self._running

    @property
    def queue_depth(self) -> int:
        """Callers waiting now, including any that were handed a slot and have not resumed yet."""
        return self._waiting

    def acquire(self, *, timeout: float | None = None) -> Admission:
        """Block this thread until admitted; `LimiterTimeout` after `timeout` seconds."""
        limit = self._limit(timeout)
        waiter = _Waiter(None)
        admission = self._locked(lambda now: self._arrive_locked(waiter, now, limit != 0))
        if admission is not None:
            return admission
        wake = waiter.wake
        if wake is None:  # timeout 0 and no free slot: never queued
            raise self._timeout_error(waiter, 0.0)
        try:
            if limit is None:
                woke = wake.acquire()
            else:
                remaining = limit - (time.perf_counter_ns() - waiter.queued_ns) * _NS
                woke = wake.acquire(timeout=min(max(remaining, 0.0), threading.TIMEOUT_MAX))
        except BaseException:
            self._locked(lambda now: self._abandon_locked(waiter, now))
            raise
        if not woke:
            # A slot granted at the same moment as the deadline passes on to the next waiter.
            self._locked(lambda now: self._abandon_locked(waiter, now))
            raise self._timeout_error(waiter, limit or 0.0)
        return self._resume(waiter)

    async def acquire_async(self, *, timeout: float | None = None) -> Admission:
        """Wait in this task until admitted; `LimiterTimeout` after `timeout` seconds.

        Cancellation while queued leaves the queue; if the slot had just been granted, it
        passes to the next waiter.
        """
        limit = self._limit(timeout)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop)
        admission = self._locked(lambda now: self._arrive_locked(waiter, now, limit != 0))
        if admission is not None:
            return admission
        future = waiter.future
        if future is None:
            raise self._timeout_error(waiter, 0.0)
        timer = None if limit is None else loop.call_later(limit, _resolve, future, False)
        try:
            granted = await future
        except BaseException:
            self._locked(lambda now: self._abandon_locked(waiter, now))
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if not granted:
            self._locked(lambda now: self._abandon_locked(waiter, now))
            raise self._timeout_error(waiter, limit or 0.0)
        return self._resume(waiter)

    def stats(self, *, reset: bool = False) -> LimiterStats:
        """The figures since this limiter was created or since the last `stats(reset=True)`.

        A window is tumbling, not sliding: exact sliding windows would need memory that grows
        with traffic. A collector that wants periodic figures calls `stats(reset=True)` on its
        own period; each call's `window_s` says how long the window was.
        """
        return self._locked(lambda now: self._stats_locked(now, reset))

    def __enter__(self) -> Admission:
        admission = self.acquire()
        self._enter(admission)
        return admission

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._exit()

    async def __aenter__(self) -> Admission:
        admission = await self.acquire_async()
        self._enter(admission)
        return admission

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._exit()

    def __repr__(self) -> str:
        return (
            f"<Limiter {self._name!r} cap={self._cap} in_flight={self._running} queue_depth={self._waiting}>"
        )

    # --- the lock, and the transitions made under it --------------------------------------------

    def _locked(self, action: Callable[[int], T]) -> T:
        """Run `action(now)` under the lock, then wake the waiters it granted slots to.

        A release from a finaliser that the garbage collector runs on this very thread while
        it holds the lock cannot take the lock again: it is queued in `_deferred` and applied
        here before the lock is let go.
        """
        me = threading.get_ident()
        lock = self._lock
        lock.acquire()
        self._owner = me
        try:
            now = time.perf_counter_ns()
            result = action(now)
            while self._deferred:
                self._release_locked(self._deferred.popleft(), now)
        finally:
            to_wake = self._to_wake
            if to_wake:
                self._to_wake = []
            self._owner = None
            lock.release()
        for waiter in to_wake:
            if not self._wake(waiter):
                self._locked(functools.partial(self._abandon_locked, waiter))
        if self._deferred:  # a finaliser slipped in between the drain and the unlock
            self._locked(_no_op)
        return result

    def _advance_locked(self, now: int) -> None:
        """Add the time since the last change to the integrals; call before changing state."""
        elapsed = now - self._changed_ns
        if elapsed > 0:
            running = self._running
            waiting = self._waiting
            self._in_flight_area += running * elapsed
            self._queue_area += waiting * elapsed
            if waiting and running < self._cap:
                self._gap_ns += elapsed
            self._changed_ns = now

    def _dispatch_locked(self, now: int) -> None:
        """Hand free slots to the head of the queue; they are woken once the lock is let go."""
        queue = self._queue
        while queue and self._holding < self._cap:
            waiter = queue.popleft()
            waiter.state = _GRANTED
            waiter.granted_ns = now
            self._holding += 1
            self._to_wake.append(waiter)

    def _arrive_locked(self, waiter: _Waiter, now: int, may_queue: bool) -> Admission | None:
        waiter.queued_ns = now
        waiter.cap = self._cap
        waiter.in_flight = self._running
        waiter.queue_depth = self._waiting
        self._advance_locked(now)
        if self._holding < self._cap:  # the queue is empty whenever a slot is free
            waiter.granted_ns = now
            waiter.state = _ADMITTED
            self._holding += 1
            self._running += 1
            self._admitted += 1
            self._waits.add(0)
            return Admission(self, waiter, now)
        if not may_queue:
            waiter.state = _GONE
            return None
        if waiter.loop is None:
            waiter.wake = threading.Lock()
            waiter.wake.acquire()
        else:
            waiter.future = waiter.loop.create_future()
        self._waiting += 1
        self._queue.append(waiter)
        return None

    def _resume(self, waiter: _Waiter) -> Admission:
        admission = self._locked(lambda now: self._resume_locked(waiter, now))
        if admission is None:  # pragma: no cover - only a waiter whose loop closed loses its grant
            raise RuntimeError(f"limiter {self._name!r}: a waiter resumed without the slot it was granted")
        return admission

    def _resume_locked(self, waiter: _Waiter, now: int) -> Admission | None:
        if waiter.state != _GRANTED:
            return None
        self._advance_locked(now)
        waiter.state = _ADMITTED
        self._waiting -= 1
        self._running += 1
        self._admitted += 1
        self._waits.add(now - waiter.queued_ns)
        return Admission(self, waiter, now)

    def _abandon_locked(self, waiter: _Waiter, now: int) -> None:
        """The waiter gives up (cancelled, timed out, its loop closed): it keeps no slot."""
        if waiter.state == _QUEUED:
            self._advance_locked(now)
            self._queue.remove(waiter)
            self._waiting -= 1
        elif waiter.state == _GRANTED:
            self._advance_locked(now)
            self._holding -= 1
            self._waiting -= 1
            self._dispatch_locked(now)
        else:
            return
        waiter.state = _GONE

    def _release(self, admission: Admission) -> None:
        if _deferred.collecting():  # a finalizer takes no lock of ours (see `_deferred`)
            _deferred.defer(self._release, admission)
            return
        if self._owner == threading.get_ident():  # re-entered from a finaliser inside `_locked`
            self._deferred.append(admission)
            return
        self._locked(lambda now: self._release_locked(admission, now))

    def _release_locked(self, admission: Admission, now: int) -> None:
        if admission._released:
            return
        admission._released = True
        self._advance_locked(now)
        self._running -= 1
        self._holding -= 1
        self._dispatch_locked(now)

    def _set_cap_locked(self, cap: int, now: int) -> None:
        self._advance_locked(now)
        self._cap = cap
        self._dispatch_locked(now)

    def _stats_locked(self, now: int, reset: bool) -> LimiterStats:
        self._advance_locked(now)
        window_ns = now - self._window_start_ns
        per_ns = 1 / window_ns if window_ns > 0 else 0.0
        stats = LimiterStats(
            window_s=window_ns * _NS,
            mean_in_flight=self._in_flight_area * per_ns,
            mean_queue_depth=self._queue_area * per_ns,
            admitted=self._admitted,
            wait_p50_s=self._waits.quantile_ns(0.5) * _NS,
            wait_p95_s=self._waits.quantile_ns(0.95) * _NS,
            gap_fraction=self._gap_ns * per_ns,
            cap=self._cap,
            name=self._name,
        )
        if reset:
            self._window_start_ns = now
            self._in_flight_area = self._queue_area = self._gap_ns = self._admitted = 0
            self._waits = GapSketch()
        return stats

    # --- waking, timeouts, `with` blocks --------------------------------------------------------

    def _wake(self, waiter: _Waiter) -> bool:
        """Wake a granted waiter; False when it can never resume (its event loop is closed)."""
        if waiter.wake is not None:
            waiter.wake.release()
            return True
        loop, future = waiter.loop, waiter.future
        if loop is None or future is None:  # pragma: no cover - every queued waiter has one or the other
            return False
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            _resolve(future, True)
            return True
        try:
            loop.call_soon_threadsafe(_resolve, future, True)
        except RuntimeError:
            return False
        return True

    def _limit(self, timeout: float | None) -> float | None:
        if timeout is None:
            return self._timeout
        return _check_timeout(timeout, f"acquisition timeout for limiter {self._name!r}")

    def _timeout_error(self, waiter: _Waiter, limit: float) -> LimiterTimeout:
        waited = (time.perf_counter_ns() - waiter.queued_ns) * _NS
        return LimiterTimeout(self._name, self._cap, limit, waited)

    def _enter(self, admission: Admission) -> None:
        _record_on_current_span(admission)
        _held.set((*_held.get(), (self, admission)))

    def _exit(self) -> None:
        held = _held.get()
        for index in range(len(held) - 1, -1, -1):
            limiter, admission = held[index]
            if limiter is self:
                _held.set(held[:index] + held[index + 1 :])
                admission.release()
                return


@guarded(sites.LIMITER_RECORD, None)
def _record_on_current_span(admission: Admission) -> None:
    """Stamp the wait on whatever span is current: the `with limiter:` form around user code."""
    span = trace.get_current_span()
    if not span.is_recording() or _suppress.suppressed():
        return
    attributes = admission.attributes()
    span.set_attributes(attributes)
    # The event sits at the admission instant on the span's wall-clock time line.
    at_ns = time.time_ns() - (time.perf_counter_ns() - admission.admitted_ns)
    span.add_event(names.EVENT_ADMITTED, attributes, timestamp=at_ns)
