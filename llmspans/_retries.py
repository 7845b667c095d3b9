"""The openai SDK's retries of one call, grouped into one call when only its `http_client` is instrumented.

A plain httpx/httpx2 client sees each of the SDK's attempts as a request of its own. The SDK marks its
retries (`x-stainless-retry-count: N`), so a plain call whose attempt failed in a way the SDK retries
(a timeout, a lost connection, 408, 409, 429, 5xx) is held open instead of ended: the request that comes
next in the same thread or task with the next retry count joins it as its next attempt, and the call
ends with its last attempt, retries and back-off in its `retry` bucket as for an SDK-instrumented client.

If no retry comes (the SDK's retries were used up, or `max_retries=0`), the call ends where its failed
attempt ended: when the next request in that thread or task is not the retry, else once the longest
back-off the SDK would wait has passed (the server's `retry-after`, at most 60 s, else 10 s), or at exit;
its span is then exported that much later, with its true times. A plain client with a limiter does not
hold calls (a held call would hold its slot through the back-off): there each attempt stays a call. Frameworks with retry loops of their own (LiteLLM with `max_retries=0` on the SDK)
send no retry count: each of their attempts stays a call of its own.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmspans import _sites as sites
from llmspans._guard import swallow

if TYPE_CHECKING:
    from llmspans._call import CallRecord

RETRY_COUNT_HEADER = "x-stainless-retry-count"
NO_RETRY_AFTER_WAIT_S = 10.0  # the SDK's longest back-off (8 s) and some slack
MAX_RETRY_AFTER_S = 60.0  # the SDK follows a server's retry-after up to this


def retried_status(status: int | None) -> bool:
    """The statuses the openai SDK retries."""
    return status is not None and (status in (408, 409, 429) or status >= 500)


class _Held:
    """A call whose failed attempt awaits the SDK's retry; `finish` ends it where that attempt ended."""

    def __init__(self, record: CallRecord, finish: Callable[[], None], wait_s: float) -> None:
        self.record = record
        self.finish = finish
        self.lock = threading.Lock()
        self.claimed = False
        self.timer = threading.Timer(wait_s, self._give_up)
        self.timer.daemon = True

    def _give_up(self) -> None:
        with self.lock:
            if self.claimed:
                return
            self.claimed = True
        with swallow(sites.TRANSPORT_CLOSE):  # the held call's end, from the timer's thread
            self.finish()


_held: contextvars.ContextVar[_Held | None] = contextvars.ContextVar("llmspans_held_retry", default=None)


def hold(record: CallRecord, finish: Callable[[], None], retry_after_s: float | None) -> None:
    """Keep `record` open for the SDK's next attempt in this thread or task (see the module's docstring)."""
    wait_s = NO_RETRY_AFTER_WAIT_S if retry_after_s is None else min(retry_after_s, MAX_RETRY_AFTER_S) + 2.0
    held = _Held(record, finish, wait_s)
    previous = _held.get()
    _held.set(held)
    if previous is not None:
        previous._give_up()  # a call of its own that was never retried
    held.timer.start()


def claim(retry_count: int | None) -> CallRecord | None:
    """The held call this request (the SDK's retry number `retry_count`) continues, or None. A request
    that is not that retry means the held call was not retried: it ends now, where it ended."""
    held = _held.get()
    if held is None:
        return None
    if retry_count is None or len(held.record.attempts) != retry_count:
        _held.set(None)
        held._give_up()
        return None
    with held.lock:
        if held.claimed:
            return None
        held.claimed = True
    held.timer.cancel()
    _held.set(None)
    return held.record


def retry_after_seconds(headers: object) -> float | None:
    """A response's `retry-after-ms` or numeric `retry-after`, in seconds (None when absent or a date)."""
    get = getattr(headers, "get", None)
    if get is None:
        return None
    for key, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        raw = get(key)
        if raw:
            try:
                return float(raw) * scale
            except ValueError:
                continue
    return None


def give_up() -> None:
    """The caller will not retry the call held in this thread or task (its last attempt failed, and it sends
    no more): the call ends now, where its failed attempt ended, not after the wait for a retry."""
    held = _held.get()
    if held is not None:
        _held.set(None)
        held._give_up()
