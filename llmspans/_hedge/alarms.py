"""The alarm clock of sync hedges: one daemon thread (`llmspans-hedge`) that sends each sync call's backup when
it comes due. Arming an alarm is what an unfired sync hedge costs: an entry in a heap, under one lock."""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from llmspans import _sites as sites
from llmspans._guard import report

_SLACK = 64  # dead entries kept in the heap beyond the live ones before it is rebuilt without them


class Alarm:
    """One armed alarm: `cancel()` lets go of its race at once (the heap keeps a dead entry of two ints). When it
    rings, `ring(race)` runs in the alarm thread, which it must not block."""

    __slots__ = ("race", "ring")

    def __init__(self, race: Any, ring: Callable[[Any], None]) -> None:
        self.race: Any = race
        self.ring = ring

    def cancel(self) -> None:
        alarms.cancelled(self)


class Alarms:
    """The due alarms in a heap; a decided race's alarm leaves the heap at once in what matters: it drops its
    race (a call the app dropped unclosed must be collectable, so that its connection is closed as without a
    hedge), and dead entries are swept out once they outnumber the live ones, so the heap holds what is
    armed now, not `rate x after` of decided calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._due: list[tuple[int, int, Alarm]] = []  # (due, order, alarm): compared in C
        self._live = 0
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._waking_at: int | None = None  # when the thread wakes by itself (None: only when told)

    def __len__(self) -> int:
        """Entries in the heap, dead or alive (what a test of its memory reads)."""
        return len(self._due)

    def schedule(self, at_ns: int, race: Any, ring: Callable[[Any], None]) -> Alarm:
        alarm = Alarm(race, ring)
        with self._lock:
            due = self._due
            heapq.heappush(due, (at_ns, next(self._order), alarm))
            self._live += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llmspans-hedge", daemon=True)
                self._thread.start()
            waking_at = self._waking_at
            if waking_at is None or at_ns < waking_at:  # else it wakes in time by itself: no switch per call
                self._wake.notify()
        return alarm

    def cancelled(self, alarm: Alarm) -> None:
        with self._lock:
            if alarm.race is None:
                return
            alarm.race = None
            self._live -= 1
            due = self._due
            if len(due) > 2 * self._live + _SLACK:
                due[:] = [entry for entry in due if entry[2].race is not None]
                heapq.heapify(due)

    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    due = self._due
                    if not due:
                        self._waking_at = None
                        self._wake.wait()
                        continue
                    at_ns, _, head = due[0]
                    if head.race is None:
                        heapq.heappop(due)
                        continue
                    wait_ns = at_ns - time.perf_counter_ns()
                    if wait_ns <= 0:
                        heapq.heappop(due)
                        race, ring, head.race = head.race, head.ring, None
                        self._live -= 1
                        break
                    self._waking_at = at_ns
                    self._wake.wait(wait_ns / 1e9)
            try:
                ring(race)
            except Exception as failure:
                report(sites.HEDGE_FIRE, failure)
            # Not kept until the next alarm: a call the app dropped unclosed must be collectable.
            del race, ring, head

    def forget(self) -> None:
        """At fork: the child has no alarm thread; its next sync hedged call starts one."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._due = []
        self._live = 0
        self._thread = None
        self._waking_at = None


alarms = Alarms()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=alarms.forget)
