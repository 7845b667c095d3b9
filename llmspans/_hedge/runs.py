"""The two drivers of a race (`race.Race`, which decides): its I/O in the app's thread, or in its task.

An unfired hedge costs an armed alarm and nothing else: the primary copy is sent at once, in the caller's own
thread or task, while an alarm (`alarms`: one heap entry, sync or async alike) waits for `after`. Only when it
rings is the backup made and sent (in a `llmspans-hedge-backup` thread, or a task on the call's loop). The first copy to get there
wins, its claim interrupts the other, and the caller's thread or task then does what the race says.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any

from llmspans import _sites as sites
from llmspans import _transport
from llmspans._guard import report, swallow
from llmspans._hedge.alarms import alarms
from llmspans._hedge.copies import Copy, ReadAhead
from llmspans._hedge.race import AWAIT_BACKUP, HAND_OVER, STOP, Race

# --- sync: the primary in the app's thread, the backup in a thread of its own -------------------------------


def _arm(race: Race, ring: Callable[[Race], None]) -> None:
    """The backup's alarm (sync and async alike: arming it is a heap entry, an unfired hedge's whole cost), with
    the app's context for the backup to run in."""
    due = race.due_ns
    if due is not None:
        try:
            race.context = contextvars.copy_context()
            race.alarm = alarms.schedule(due, race, ring)
        except Exception as failure:  # no alarm: the call goes unhedged
            report(sites.HEDGE_FIRE, failure)


def run_sync(race: Race) -> Any:
    _arm(race, _fire_sync)
    primary = race.primary
    try:
        result = _run_copy_sync(race, primary, race.send)
    except BaseException as error:
        race.disarm()
        step = race.after_primary(error)
        if step is AWAIT_BACKUP:
            return _backup_answer_sync(race, error)
        if step is STOP and (backup := race.close()) is not None:
            backup.interrupt()
        raise
    race.disarm()
    if race.after_primary(None) is HAND_OVER:
        return race.hand_over(primary, result)
    primary.settle(result)  # a tie: its whole answer came, but the backup got there first
    return _backup_answer_sync(race, None)


def _backup_answer_sync(race: Race, failure: BaseException | None) -> Any:
    """Wait for the backup (it won and cut the primary, or the primary failed or tied while it ran): the call's
    answer is then the race's to say."""
    backup, done, primary = race.backup, race.backup_done, race.primary
    if backup is None or done is None:  # pragma: no cover - only a sent backup is waited for
        raise failure or RuntimeError("llmspans: a hedged call lost its primary without a backup")
    race.release(primary)  # a primary cut by the backup's claim gives back the slot the claim gave it
    try:
        done.wait()
    except BaseException:
        backup.interrupt()
        raise
    race.release(primary)  # a primary that failed while the backup ran: likewise, once the backup is over
    return race.answer(failure, race.backup_outcome)


def _run_copy_sync(race: Race, copy: Copy, send: Callable[..., Any]) -> Any:
    token = _transport.active_call.set(copy)
    copy.launched_ns = time.perf_counter_ns()
    try:
        result = send(*race.args, **race.kwargs)
        if copy.stream:
            return copy.read_ahead(result)
        if copy.reached_ns is None:  # its headers went unseen: the body is its answer
            copy.reach(time.perf_counter_ns())
        return result
    finally:
        _transport.active_call.reset(token)


def _fire_sync(race: Race) -> None:
    """The alarm rang (in the alarm's thread, which must not block): send the backup from a thread of its own."""
    backup = race.fire()
    if backup is None:
        return
    context = race.context if race.context is not None else contextvars.copy_context()
    thread = threading.Thread(
        target=context.run, args=(_run_backup_sync, race, backup), name="llmspans-hedge-backup", daemon=True
    )
    now = time.perf_counter_ns()
    try:
        thread.start()
    except BaseException as error:
        race.not_launched(backup, error)
        raise
    race.launched(now)


def _run_backup_sync(race: Race, backup: Copy) -> None:
    outcome: tuple[Any, BaseException | None]
    try:
        outcome = (_run_copy_sync(race, backup, race.backup_send()), None)
    except BaseException as error:  # HedgeCancelled too: this thread's end
        outcome = (None, error)
    if not race.backup_ended(backup, outcome):
        backup.settle(outcome[0])
        _discard(outcome[0])
        race.release(backup)
    # The exception's traceback holds this frame: without this its locals would hold the exception.
    del outcome
    race.backup_done.set()  # type: ignore[union-attr]


# --- asyncio: the primary in the caller's task, the backup in a task of its own ------------------------------


async def run_async(race: Race) -> Any:
    caller = asyncio.current_task()
    race.loop = asyncio.get_running_loop()
    _arm(race, _ring_async)
    primary = race.primary
    primary.task = caller
    uncancel = getattr(caller, "uncancel", None)
    cancelling = caller.cancelling() if uncancel is not None else 0  # type: ignore[union-attr]
    try:
        result = await _run_primary_async(race, primary)
    except BaseException as error:
        race.disarm()
        step = race.after_primary(error)
        if step is AWAIT_BACKUP and isinstance(error, asyncio.CancelledError) and uncancel is not None:
            step = AWAIT_BACKUP if uncancel() <= cancelling else STOP  # else cancelled by someone else too
        if step is AWAIT_BACKUP:
            return await _backup_answer_async(race, error)
        if step is STOP:
            await _stop_backup_async(race)
        raise
    race.disarm()
    if race.after_primary(None) is HAND_OVER:
        backup = race.close()
        if backup is not None:
            await _stop_async(race, backup)
        return race.hand_over(primary, result)
    primary.settle(result)  # a tie: its whole answer came, but the backup got there first
    return await _backup_answer_async(race, None)


async def _backup_answer_async(race: Race, failure: BaseException | None) -> Any:
    """`_backup_answer_sync` for the backup's task."""
    backup = race.backup
    task = None if backup is None else backup.task
    if task is None:  # pragma: no cover - only a sent backup is waited for
        raise failure or RuntimeError("llmspans: a hedged call lost its primary without a backup")
    race.release(race.primary)
    try:
        await asyncio.wait((task,))
    except BaseException:
        task.cancel()
        await asyncio.wait((task,))
        race.release(backup)
        raise
    race.release(race.primary)
    if task.cancelled():
        outcome: tuple[Any, BaseException | None] = (None, asyncio.CancelledError())
    else:
        error = task.exception()
        outcome = (None, error) if error is not None else (task.result(), None)
    try:
        return race.answer(failure, outcome)
    except BaseException:
        race.release(backup)
        raise


async def _run_primary_async(race: Race, primary: Copy) -> Any:
    token = _transport.active_call.set(primary)
    primary.launched_ns = time.perf_counter_ns()
    primary.running = True  # `interrupt` cancels the caller's task only while it runs the primary
    try:
        result = await race.send(*race.args, **race.kwargs)
        if primary.stream:
            return await primary.read_ahead_async(result)
        if primary.reached_ns is None:
            primary.reach(time.perf_counter_ns())
        return result
    finally:
        primary.running = False
        primary.task = None
        race.close()
        _transport.active_call.reset(token)


def _ring_async(race: Race) -> None:
    """The alarm rang (in the alarm's thread): the backup is made and sent on the call's own loop."""
    loop = race.loop
    if loop is not None:
        with contextlib.suppress(RuntimeError):  # its loop was closed meanwhile: the call is over
            loop.call_soon_threadsafe(_fire_async, race, loop, context=race.context)


def _fire_async(race: Race, loop: asyncio.AbstractEventLoop) -> None:
    """The alarm rang: the primary has not got there in time; send the backup in a task of its own."""
    backup = None
    with swallow(sites.HEDGE_FIRE):  # a backup that cannot be made: the call goes on unhedged
        backup = race.fire()
    if backup is None:
        return
    now = time.perf_counter_ns()
    try:
        task = backup.task = loop.create_task(
            _run_copy_async(race, backup, race.backup_send()), name="llmspans-hedge-backup"
        )
        task.add_done_callback(_retrieve)
    except Exception as error:
        race.not_launched(backup, error)
        report(sites.HEDGE_FIRE, error)
        return
    race.launched(now)


async def _run_copy_async(race: Race, copy: Copy, send: Callable[..., Any]) -> Any:
    _transport.active_call.set(copy)  # this task's own context
    copy.launched_ns = time.perf_counter_ns()
    result = await send(*race.args, **race.kwargs)
    if copy.stream:
        return await copy.read_ahead_async(result)
    if copy.reached_ns is None:
        copy.reach(time.perf_counter_ns())
    return result


async def _stop_async(race: Race, loser: Copy) -> None:
    """Stop a losing backup and wait until it is closed (before the caller goes on); a whole answer it got in
    a tie says what it cost."""
    loser.interrupt()
    task = loser.task
    if task is not None:
        if not task.done():
            await asyncio.wait((task,))
        if not task.cancelled() and task.exception() is None:
            loser.settle(task.result())
            _discard(task.result())
        loser.task = None  # a finished task holds its exception, whose frames hold the copy
    race.release(loser)


async def _stop_backup_async(race: Race) -> None:
    """The caller is cancelled or failed: the backup (if any) is stopped and closed first."""
    backup = race.close()
    if backup is None:
        return
    backup.interrupt()
    task = backup.task
    if task is not None and not task.done():
        task.cancel()
        await asyncio.wait((task,))
    race.release(backup)


def _discard(result: Any) -> None:
    """Close what a copy that lost got back (a stream it read ahead in is closed already)."""
    if isinstance(result, ReadAhead):
        with swallow(sites.HEDGE_CLOSE):
            result.stream.close()


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A copy's task is never left with an exception nobody asked for (asyncio would log it)."""
    if not task.cancelled():
        task.exception()
