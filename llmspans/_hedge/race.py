"""One hedged call's decisions: its two copies, when the backup is due, which copy won, and what the caller gets.

No I/O here: `runs` drives a race in the app's thread (`run_sync`) or task (`run_async`), sending the copies,
waiting and stopping, and asks the race at each turn what comes next, as httpx's `Auth.auth_flow` is driven
by its sync and async flows and the limiter's decisions by its two entries. What the race says on the call
span and in the metrics is `telemetry`'s.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._call import CallRecord
from llmspans._guard import swallow
from llmspans._hedge import telemetry
from llmspans._hedge.alarms import Alarm
from llmspans._hedge.copies import Copy, HedgeCancelled, ReadAhead
from llmspans._hedge.policy import Hedge
from llmspans._hedge.replay import AsyncReplay, SyncReplay
from llmspans._limiter import Limiter, LimiterTimeout

# What the caller's thread or task does once its primary copy has run (`Race.after_primary`).
HAND_OVER: Final = "hand over the primary's answer"
RAISE: Final = "raise the primary's error: no backup was sent"
AWAIT_BACKUP: Final = "wait for the backup: it won and cut the primary, or the primary failed while it runs"
SETTLE: Final = "a tie: count the primary's whole answer as wasted, then wait for the backup, which won"
STOP: Final = "stop the backup and let the caller's own cancellation or exit through"


class Race:
    """One hedged call: its copies, which won, and what it cost. It is also one of the call's levers
    (`_call.Lever`): once the call is written, `finished` has `telemetry` write what the hedge did.

    `send` sends the primary (the client's own request); `backup_send()` says what sends the backup, asked
    only when it is sent. What most races keep as they start out are class defaults (a race per call).
    """

    winner: Copy | None = None
    closed = False  # no backup may be sent any more
    skipped: str | None = None
    fired_ns: int | None = None  # when the backup really left (its thread or task started)
    backup: Copy | None = None
    backup_done: threading.Event | None = None  # a sync backup's end (made with the backup)
    backup_outcome: tuple[Any, BaseException | None] = (None, None)
    context: contextvars.Context | None = None  # the app's, for the backup's thread or task
    alarm: Alarm | None = None
    loop: asyncio.AbstractEventLoop | None = None  # an async call's, where its backup's task runs

    def __init__(
        self, hedge: Hedge, call: CallRecord, send: Callable[..., Any], backup_send: Callable[[], Callable[..., Any]],
        limiter: Limiter | None, is_async: bool, args: tuple[Any, ...], kwargs: dict[str, Any],
        body: Mapping[str, Any], is_content: Callable[[Any], bool], started_ns: int,
    ) -> None:  # fmt: skip
        self.hedge, self.call, self.limiter, self.is_async, self.body = hedge, call, limiter, is_async, body
        self.send, self.backup_send, self.args, self.kwargs = send, backup_send, args, kwargs
        self.is_content = is_content
        model = body.get("model")
        self.model = model if isinstance(model, str) else None
        self.lock = threading.Lock()  # the race's and its copies'
        self.after_ns = after_ns = hedge.after_ns(self.model)
        self.due_ns = None if after_ns is None else started_ns + after_ns
        self.started_ns = started_ns
        self.primary = Copy(
            self, names.HEDGE_ROLE_PRIMARY, call.attempts
        )  # the call's own, until a backup wins
        call.levers += (self,)

    # --- the backup ---

    def fire(self) -> Copy | None:
        """The backup is due: the copy to send if the call still needs one (with a limiter slot of its own, only
        if one is free now: docs/hedging.md), else None. The caller sends it."""
        with self.lock:
            if self.closed or self.backup is not None or self.primary.reached_ns is not None:
                return None
            admission = self._free_slot()
            if admission is False:
                self.closed = True
                self.skipped = names.HEDGE_SKIPPED_LIMITER
                return None
            backup = self.backup = Copy(self, names.HEDGE_ROLE_BACKUP, [])
            if not self.is_async:
                self.backup_done = threading.Event()
            if admission is not None:
                backup.release = admission.release
        # From now on each attempt of the primary has its span as it runs (the one under way gets its own at
        # the call's end, with its real start: `telemetry`), and a sync one may be stopped.
        primary = self.primary
        primary.attempt_spans_always = True
        if not self.is_async:
            primary.watch_now()
        return backup

    def _free_slot(self) -> Any:
        limiter = self.limiter
        if limiter is None:
            return None
        try:
            return limiter.acquire(timeout=0)
        except LimiterTimeout:
            return False

    def launched(self, at_ns: int) -> None:
        """The backup really left (its thread or task started): the hedge fired."""
        self.fired_ns = at_ns
        telemetry.launched(self.call, at_ns)

    def not_launched(self, backup: Copy, error: BaseException) -> None:
        """No thread or task to be had: the backup never left, the primary goes on alone."""
        with self.lock:
            self.backup_outcome = (None, error)
        self.release(backup)
        if self.backup_done is not None:
            self.backup_done.set()  # a primary that fails must not wait for it

    def backup_ended(self, backup: Copy, outcome: tuple[Any, BaseException | None]) -> bool:
        """A sync backup's run is over: its outcome is kept if it won (a loser's is never read, and its
        exception's traceback would hold this race in a cycle). Whether it won."""
        with self.lock:
            won = self.winner is backup
            self.backup_outcome = outcome if won else (None, None)
        return won

    # --- deciding ---

    def claim(self, copy: Copy, at_ns: int) -> bool:
        """`copy` got there first, unless another did: it wins, and the other is stopped."""
        with self.lock:
            if self.winner is not None or copy.cancelled:
                return False
            self.winner = copy
            self.closed = True
            primary = self.primary
            loser = self.backup if copy is primary else primary
            if loser is not None:
                loser.wasted = (loser.content_seen, loser.reported_input)
        alarm = self.alarm
        if alarm is not None:  # decided: its alarm leaves the heap now, not when it would have rung
            alarm.cancel()
        attempts = copy.attempts
        span = attempts[-1].span if attempts else None
        if span is not None:
            with swallow(sites.HEDGE_SPAN):
                span.set_attribute(names.HEDGE_WON, True)
        if self.hedge.learns:
            self._observed(at_ns)
        if loser is None:  # unfired: nothing else to do (the usual case)
            return True
        call = self.call
        if copy is not primary:
            call.attempts = attempts  # the call's are the winner's
            if copy.release is not None:
                # The call keeps the winner's slot; the primary's goes back once it has stopped.
                primary.release, call.on_release, copy.release = call.on_release, copy.release, None
        loser.interrupt()
        return True

    def _observed(self, at_ns: int) -> None:
        with swallow(sites.HEDGE_SPAN):
            self.hedge.observed(self.model, at_ns - self.started_ns)

    def close(self) -> Copy | None:
        """No backup may be sent any more (the primary is over, or the caller left): the backup, if one was."""
        if not self.closed:
            with self.lock:
                self.closed = True
        return self.backup

    def disarm(self) -> None:
        """The primary's run is over: no backup may be sent any more, and the alarm lets go of the race."""
        self.close()
        alarm = self.alarm
        if alarm is not None and alarm.race is not None:
            alarm.cancel()

    def after_primary(self, error: BaseException | None) -> str:
        """What the caller's thread or task does once its primary has run: returned (`error` None) or raised."""
        winner = self.winner
        primary = self.primary
        if error is None:
            return HAND_OVER if winner is primary or winner is None else SETTLE
        if isinstance(error, (HedgeCancelled, asyncio.CancelledError)):
            # Cut: by the backup's win (whose answer is then the call's), else by the caller, who leaves.
            cut = primary.cancelled and winner is not None and winner is not primary
            return AWAIT_BACKUP if cut else STOP
        if isinstance(error, Exception):
            return AWAIT_BACKUP if self.close() is not None else RAISE
        return STOP

    def answer(self, primary_error: BaseException | None, outcome: tuple[Any, BaseException | None]) -> Any:
        """The call's answer once the backup is over (`outcome`: what it returned or raised): the backup's if it
        won; else the primary's error, when the primary failed; else the backup's own error."""
        result, error = outcome
        backup = self.backup
        if isinstance(primary_error, Exception) and (error is not None or self.winner is not backup):
            raise primary_error
        if error is not None:
            raise error
        return self.hand_over(backup, result)  # type: ignore[arg-type]

    def hand_over(self, copy: Copy, result: Any) -> Any:
        """What the caller gets of the copy that won: its answer, or its stream with what was read ahead."""
        # The race lives as long as the HTTP pool holds a copy's request (until its response is closed): it
        # must not hold the answer, or an answer the app drops unclosed is never collected, and its
        # connection never closed, as it is without a hedge.
        self.backup_outcome = (None, None)
        copy.task = None  # a finished task holds its result
        if isinstance(result, ReadAhead):
            replay = AsyncReplay if self.is_async else SyncReplay
            return replay(result.stream, copy.attempts[-1], collections.deque(result.buffered))
        return result

    @staticmethod
    def release(copy: Copy | None) -> None:
        """A copy that stopped gives back its limiter slot, if it holds one the call does not."""
        if copy is None:
            return
        release, copy.release = copy.release, None
        if release is not None:
            with swallow(sites.HEDGE_CLOSE):
                release()

    # --- the lever ---

    def finished(self, record: CallRecord, outcome: str, duration_ns: int) -> None:
        telemetry.write(self, record)
        # The call is written: what tied it and the copies' answers into cycles goes (see `Copy.race`).
        levers = record.levers
        record.levers = (
            levers[:-1] if levers[-1] is self else tuple(lever for lever in levers if lever is not self)
        )
        self.backup_outcome = (None, None)  # a stopped copy's exception: its traceback's frames hold the race
        for copy in (self.primary, self.backup):
            if copy is not None:
                copy.control = None
                for attempt in copy.attempts:
                    attempt.response = None
