"""One hedged call: its two copies, which won, and what it cost; run in the app's thread (sync) or task (async).

An unfired hedge costs an armed timer and nothing else: the primary copy is sent at once, in the caller's own
thread or task, while an alarm (`alarms`, sync) or a loop timer (async) waits for `after`. Only when it rings
is the backup made and sent (in a `llmspans-hedge-backup` thread, or a task), and the primary's attempt span
made with its real start. A race that is decided lets go of its alarm at once. The first copy to get there
wins, `claim` interrupts the other, and the call span stays one logical call timed on the winner's timeline.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.util.types import AttributeValue

from llmspans import _metrics as metric
from llmspans import _names as names
from llmspans import _prompt, _telemetry, _transport
from llmspans import _sites as sites
from llmspans._budget import seconds
from llmspans._call import CallRecord
from llmspans._guard import guarded, report, swallow
from llmspans._hedge.alarms import Alarm, alarms
from llmspans._hedge.copies import Copy, HedgeCancelled, ReadAhead
from llmspans._hedge.policy import Hedge
from llmspans._hedge.replay import AsyncReplay, SyncReplay
from llmspans._limiter import Limiter, LimiterTimeout

_KEPT = 256


class Race:
    """One hedged call: its copies, which won, and what it cost. It is also one of the call's levers
    (`_call.Lever`): once the call is written, `finished` adds the hedge's attributes and metrics.

    `send` sends the primary (the client's own request); `backup_send()` says what sends the backup, asked
    only when it is sent."""

    def __init__(
        self, hedge: Hedge, call: CallRecord, send: Callable[..., Any], backup_send: Callable[[], Callable[..., Any]],
        limiter: Limiter | None, is_async: bool, args: tuple[Any, ...], kwargs: dict[str, Any],
        body: Mapping[str, Any], is_content: Callable[[Any], bool],
    ) -> None:  # fmt: skip
        self.hedge = hedge
        self.call = call
        self.send = send
        self.backup_send = backup_send
        self.limiter = limiter
        self.is_async = is_async
        self.args = args
        self.kwargs = kwargs
        self.body = body
        self.is_content = is_content
        model = body.get("model")
        self.model = model if isinstance(model, str) else None
        self.lock = threading.Lock()
        self.winner: Copy | None = None
        self.closed = False  # no backup may be sent any more
        self.skipped: str | None = None
        self.fired_ns: int | None = None  # when the backup really left (its thread or task started)
        self.backup: Copy | None = None
        self.backup_done: threading.Event | None = None  # a sync backup's end (made with the backup)
        self.backup_outcome: tuple[Any, BaseException | None] = (None, None)
        self.context: contextvars.Context | None = None  # the app's, for a sync backup's thread
        self.alarm: Alarm | None = None
        self.after_ns = hedge.after_ns(self.model)
        self.primary = Copy(
            self, names.HEDGE_ROLE_PRIMARY, call.attempts
        )  # the call's own, until a backup wins
        call.levers += (self,)
        self.started_ns = time.perf_counter_ns()

    # --- deciding ---

    def claim(self, copy: Copy, at_ns: int) -> bool:
        """`copy` got there first, unless another did: it wins, and the other is stopped."""
        with self.lock:
            if self.winner is not None or copy.cancelled:
                return False
            self.winner = copy
            self.closed = True
            loser = self.backup if copy is self.primary else self.primary
            if loser is not None and loser is not copy:
                loser.wasted = (loser.content_seen, loser.reported_input)
        alarm = self.alarm
        if alarm is not None:  # decided: its alarm leaves the heap now, not when it would have rung
            alarm.cancel()
        span = copy.attempts[-1].span if copy.attempts else None
        if span is not None:
            with swallow(sites.HEDGE_SPAN):
                span.set_attribute(names.HEDGE_WON, True)
        call = self.call
        call.attempts = copy.attempts
        if copy is self.backup and copy.release is not None:
            # The call keeps the winner's slot; the primary's goes back once it has stopped.
            self.primary.release, call.on_release, copy.release = call.on_release, copy.release, None
        if self.hedge.learns:
            with swallow(sites.HEDGE_SPAN):
                self.hedge.observed(self.model, at_ns - self.started_ns)
        if loser is not None and loser is not copy:
            loser.interrupt()
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

    def _fire(self) -> Copy | None:
        """Make the backup copy if the call still needs one (the caller sends it); None otherwise."""
        with self.lock:
            if self.closed or self.backup is not None:
                return None
            admission = self._take_slot()
            if admission is False:
                self.closed = True
                self.skipped = names.HEDGE_SKIPPED_LIMITER
                return None
            backup = self.backup = Copy(self, names.HEDGE_ROLE_BACKUP, [])
            self.backup_done = threading.Event()
            if admission is not None:
                backup.release = admission.release
        # From now on each attempt of the primary has its span as it runs (the one under way gets its
        # own at the call's end, with its real start: `_span_primary`), and a sync one may be stopped.
        primary = self.primary
        primary.attempt_spans_always = True
        if not self.is_async:
            primary.watch_now()
        return backup

    def _launched(self, at_ns: int) -> None:
        """The backup really left (its thread or task started): the hedge fired."""
        self.fired_ns = at_ns
        call = self.call
        if call.recording and not call.finished:
            with swallow(sites.HEDGE_SPAN):
                call.span.add_event(
                    names.EVENT_HEDGE, {names.ELAPSED: seconds(at_ns - call.queued_ns)}, call.wall_ns(at_ns)
                )

    def _not_launched(self, backup: Copy, error: BaseException) -> None:
        """No thread or task to be had: the backup never left, the primary goes on alone."""
        with self.lock:
            self.backup_outcome = (None, error)
        self._release(backup)
        if self.backup_done is not None:
            self.backup_done.set()  # a primary that fails must not wait for it

    @staticmethod
    def _release(copy: Copy) -> None:
        """A copy that stopped gives back its limiter slot, if it holds one the call does not."""
        release, copy.release = copy.release, None
        if release is not None:
            with swallow(sites.HEDGE_CLOSE):
                release()

    def _disarm(self) -> None:
        if not self.closed:  # else decided, and its alarm let go of already
            with self.lock:
                self.closed = True
        alarm = self.alarm
        if alarm is not None and alarm.race is not None:
            alarm.cancel()

    # --- sync: the primary in the app's thread, the backup in a thread of its own ---

    def run_sync(self) -> Any:
        if self.after_ns is not None:
            try:
                self.context = contextvars.copy_context()
                self.alarm = alarms.schedule(self.started_ns + self.after_ns, self)
            except Exception as failure:  # no alarm: the call goes unhedged
                report(sites.HEDGE_FIRE, failure)
        primary = self.primary
        try:
            result = self._run_copy_sync(primary, self.send)
        except HedgeCancelled:
            return self._backup_result()  # the backup won and stopped us
        except Exception as error:
            return self._primary_failed(error)
        except BaseException:
            self._stop_backup()
            raise
        finally:
            self._disarm()
        if self.winner is primary:
            return self._hand_over(primary, result)
        primary.settle(result)  # a tie: its whole answer came, but the backup got there first
        _discard(result)
        return self._backup_result()

    def _run_copy_sync(self, copy: Copy, send: Callable[..., Any]) -> Any:
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
        context = self.context if self.context is not None else contextvars.copy_context()
        thread = threading.Thread(
            target=context.run,
            args=(self._run_backup_sync, backup),
            name="llmspans-hedge-backup",
            daemon=True,
        )
        now = time.perf_counter_ns()
        try:
            thread.start()
        except BaseException as error:
            self._not_launched(backup, error)
            raise
        self._launched(now)

    def _run_backup_sync(self, backup: Copy) -> None:
        outcome: tuple[Any, BaseException | None]
        try:
            outcome = (self._run_copy_sync(backup, self.backup_send()), None)
        except BaseException as error:  # HedgeCancelled too: this thread's end
            outcome = (None, error)
        with self.lock:
            won = self.winner is backup
            # A loser's outcome is never read (the primary's own answer or error is the call's); its
            # exception's traceback would hold this race in a cycle.
            self.backup_outcome = outcome if won else (None, None)
        if not won:
            backup.settle(outcome[0])
            _discard(outcome[0])
            self._release(backup)
        # The exception's traceback holds this frame: without this its locals would hold the exception.
        del outcome
        self.backup_done.set()  # type: ignore[union-attr]

    def _backup_result(self) -> Any:
        """The primary stopped (it lost, or failed while the backup runs): the backup's answer, once it has one."""
        primary = self.primary
        self._release(primary)
        backup = self.backup
        if (
            backup is None or self.backup_done is None
        ):  # pragma: no cover - only a backup's claim stops the primary
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
        if backup is None or self.backup_done is None:
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

    # --- asyncio: the primary in the caller's task, the backup in a task of its own ---

    async def run_async(self) -> Any:
        loop = asyncio.get_running_loop()
        caller = asyncio.current_task()
        timer = None
        if self.after_ns is not None:
            delay = (self.started_ns + self.after_ns - time.perf_counter_ns()) / 1e9
            timer = loop.call_later(max(0.0, delay), self._fire_async, loop)
        primary = self.primary
        primary.task = caller
        uncancel = getattr(caller, "uncancel", None)
        cancelling = caller.cancelling() if uncancel is not None else 0  # type: ignore[union-attr]
        try:
            result = await self._run_primary_async(primary)
        except (asyncio.CancelledError, HedgeCancelled) as error:
            cut = primary.cancelled and self.winner is not None and self.winner is not primary
            if cut and isinstance(error, asyncio.CancelledError) and uncancel is not None:
                cut = uncancel() <= cancelling  # not also cancelled by someone else
            if not cut:
                await self._stop_backup_async()
                raise
            return await self._backup_result_async()
        except Exception as error:
            return await self._primary_failed_async(error)
        except BaseException:
            await self._stop_backup_async()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if self.winner is primary or self.winner is None:
            backup = self.backup
            if backup is not None:
                await self._stop_async(backup)
            return self._hand_over(primary, result)
        primary.settle(result)  # a tie: its whole answer came, but the backup got there first
        _discard(result)
        return await self._backup_result_async()

    async def _run_primary_async(self, primary: Copy) -> Any:
        token = _transport.active_call.set(primary)
        primary.launched_ns = time.perf_counter_ns()
        primary.running = True  # `interrupt` cancels the caller's task only while it runs the primary
        try:
            result = await self.send(*self.args, **self.kwargs)
            if self.call.stream:
                return await primary.read_ahead_async(result)
            if primary.reached_ns is None:
                primary.reach(time.perf_counter_ns())
            return result
        finally:
            primary.running = False
            primary.task = None
            with self.lock:
                self.closed = True
            _transport.active_call.reset(token)

    def _fire_async(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer rang: the primary has not got there in time; send the backup in a task of its own."""
        backup = None
        with swallow(sites.HEDGE_FIRE):  # a backup that cannot be made: the call goes on unhedged
            backup = self._fire()
        if backup is None:
            return
        now = time.perf_counter_ns()
        try:
            task = backup.task = loop.create_task(
                self._run_copy_async(backup, self.backup_send()), name="llmspans-hedge-backup"
            )
            task.add_done_callback(_retrieve)
        except Exception as error:
            self._not_launched(backup, error)
            report(sites.HEDGE_FIRE, error)
            return
        self._launched(now)

    async def _run_copy_async(self, copy: Copy, send: Callable[..., Any]) -> Any:
        _transport.active_call.set(copy)  # this task's own context
        copy.launched_ns = time.perf_counter_ns()
        result = await send(*self.args, **self.kwargs)
        if self.call.stream:
            return await copy.read_ahead_async(result)
        if copy.reached_ns is None:
            copy.reach(time.perf_counter_ns())
        return result

    async def _stop_async(self, loser: Copy) -> None:
        """Stop a losing backup and wait until it is closed (before the caller goes on); a whole answer it
        got in a tie says what it cost."""
        loser.interrupt()
        task = loser.task
        if task is not None:
            if not task.done():
                await asyncio.wait((task,))
            if not task.cancelled() and task.exception() is None:
                loser.settle(task.result())
                _discard(task.result())
            loser.task = None  # a finished task holds its exception, whose frames hold the copy
        self._release(loser)

    async def _stop_backup_async(self) -> None:
        """The caller is cancelled or failed: the backup (if any) is stopped and closed first."""
        with self.lock:
            self.closed = True
            backup = self.backup
        if backup is None:
            return
        backup.interrupt()
        task = backup.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait((task,))
        self._release(backup)

    async def _backup_result_async(self) -> Any:
        """The backup won and cut the primary: its answer, once it has one."""
        self._release(self.primary)
        backup = self.backup
        task = None if backup is None else backup.task
        if task is None:  # pragma: no cover - only a backup's claim cuts the primary
            raise RuntimeError("llmspans: a hedged call lost its primary without a backup")
        try:
            result = await task
        except BaseException:
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
            self._release(backup)  # type: ignore[arg-type]
            raise
        return self._hand_over(backup, result)  # type: ignore[arg-type]

    async def _primary_failed_async(self, error: Exception) -> Any:
        """The primary failed: the call is the backup's if one was sent and it answers, else this error's."""
        with self.lock:
            self.closed = True
            backup = self.backup
        task = None if backup is None else backup.task
        if task is None:
            raise error
        try:
            await asyncio.wait((task,))
        except BaseException:
            task.cancel()
            await asyncio.wait((task,))
            self._release(backup)  # type: ignore[arg-type]
            raise
        self._release(self.primary)
        if task.cancelled() or task.exception() is not None or self.winner is not backup:
            self._release(backup)  # type: ignore[arg-type]
            raise error
        return self._hand_over(backup, task.result())  # type: ignore[arg-type]

    # --- the answer ---

    def _hand_over(self, copy: Copy, result: Any) -> Any:
        # The race lives as long as the HTTP pool holds a copy's request (until its response is closed): it
        # must not hold the answer, or an answer the app drops unclosed is never collected, and its
        # connection never closed, as it is without a hedge.
        self.backup_outcome = (None, None)
        copy.task = None  # a finished task holds its result
        if isinstance(result, ReadAhead):
            replay = AsyncReplay if self.is_async else SyncReplay
            return replay(result.stream, copy.attempts[-1], collections.deque(result.buffered))
        return result

    # --- the lever: what the call span and the metrics say ---

    def finished(self, record: CallRecord, outcome: str, duration_ns: int) -> None:
        self._write(record)
        # The call is written: what tied it and the copies' answers into cycles goes (see `Copy.race`).
        record.levers = tuple(lever for lever in record.levers if lever is not self)
        self.backup_outcome = (None, None)  # a stopped copy's exception: its traceback's frames hold the race
        for copy in (self.primary, self.backup):
            if copy is not None:
                copy.control = None
                for attempt in copy.attempts:
                    attempt.response = None

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
            if record.recording:
                self._span_primary(record)
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

    def _span_primary(self, record: CallRecord) -> None:
        """The primary's attempts that ran without a span (the one under way when the backup left): their
        spans now, with their real start (and end, when over), as a retried call's first attempt gets."""
        primary = self.primary
        attempts = primary.attempts
        for attempt in attempts:
            if attempt.span is not None:
                continue
            with swallow(sites.HEDGE_SPAN):
                last = attempt is attempts[-1]
                if last:  # what it did, before its span may end (its role, and won=False, it says already)
                    extra: dict[str, AttributeValue] = dict(attempt.span_attributes or {})
                    if self.winner is primary:
                        extra[names.HEDGE_WON] = True
                    if primary.first_token_s is not None:
                        extra[names.HEDGE_FIRST_TOKEN] = primary.first_token_s
                    attempt.span_attributes = extra
                _transport.span_attempt_after(record, attempt)  # ended now if over, else by the transport

    def _input_tokens(self, record: CallRecord, reported_by_loser: int | None) -> int:
        """The loser's prompt: the winner's count, else the loser's own, else an estimate (the prompt cap's,
        or characters/4)."""
        if record.input_tokens is not None:
            return record.input_tokens
        if reported_by_loser is not None:
            return reported_by_loser
        if record.estimated_input_tokens is not None:  # a prompt cap's
            return record.estimated_input_tokens
        texts, tokens = _prompt.prompt_pieces(self.body)
        return _prompt.CHARACTERS.count(texts) + tokens


def _discard(result: Any) -> None:
    """Close what a copy that lost got back (a stream it read ahead in is closed already)."""
    if isinstance(result, ReadAhead):
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
