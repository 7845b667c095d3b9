"""The one safe place for work a finalizer wants done.

The garbage collector runs finalizers (`weakref.finalize` callbacks, `__del__`, a collected
generator's `finally`) at any allocation, also while the same thread holds a non-reentrant lock
inside the OpenTelemetry SDK (a metric aggregation being created, a span processor, an exporter).
A finalizer that ended a span or recorded a metric there would wait on that lock forever.

**The rule for every finalizer in llmspans: no OpenTelemetry call and no llmspans lock inside it.**
A finalizer stamps the time (a clock read takes no lock) and calls `defer(work, *args)`, which
puts the work on a `queue.SimpleQueue` (its `put` is reentrant, made for destructors and weakref
callbacks) and returns. One daemon thread runs the work in order. It is started from the caller's
own thread by `start_worker()` (cheap once it runs) wherever an object that has a finalizer is
made, never from a finalizer, and it imports nothing.

Code a finalizer may reach without knowing it (a library's finalizer closing a response we wrap,
a collected generator's `finally`, which cannot tell `close()` from collection) asks `collecting()`,
whether the collector is running in this thread (a `gc.callbacks` flag), and hands its work over
when it is: ending a call, an attempt or a stage, and giving a limiter slot back all do.

At fork the child starts with an empty queue and no worker (the parent's worker finishes the
parent's work); the next `start_worker()` in the child starts its own.
"""

from __future__ import annotations

import gc
import os
import queue
import threading
from collections.abc import Callable
from threading import get_ident
from typing import Any

from llmspans import _sites as sites
from llmspans._guard import report

_work: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]]] = queue.SimpleQueue()
_worker: threading.Thread | None = None
_start_lock = threading.Lock()
collecting_thread = 0
"""The thread the collector runs in, while it runs; 0 otherwise (so `collecting_thread and collecting()`
costs one lookup on the request path)."""


def defer(work: Callable[..., Any], *args: Any) -> None:
    """Have `work(*args)` run on the worker thread; safe inside any finalizer."""
    _work.put((work, args))


def collecting() -> bool:
    """Whether the collector is running in this thread (so whatever runs now may be a finalizer)."""
    return collecting_thread == get_ident()


def start_worker() -> None:
    """Make sure the worker runs; called from ordinary code, never from a finalizer."""
    if _worker is None:
        _start()


def _start() -> None:
    global _worker
    with _start_lock:
        if _worker is not None:
            return
        thread = threading.Thread(target=_run, args=(_work,), name="llmspans-deferred", daemon=True)
        thread.start()
        _worker = thread


def _run(work: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
    get = work.get
    while True:
        job, args = get()
        try:
            job(*args)
        except Exception as error:  # the worker must outlive any one job
            report(sites.DEFERRED_WORK, error)
        del job, args  # hold nothing between jobs


def settle(timeout: float = 10.0) -> bool:
    """Wait until the work deferred so far has run (tests, and `llmspans.testing`); True when it has."""
    if _worker is None:
        _start()
    done = threading.Event()
    defer(done.set)
    return done.wait(timeout)


def _on_collection(phase: str, _info: dict[str, Any]) -> None:
    global collecting_thread
    collecting_thread = get_ident() if phase == "start" else 0


def _after_fork_in_child() -> None:
    global _work, _worker, _start_lock
    _work = queue.SimpleQueue()
    _worker = None
    _start_lock = threading.Lock()


gc.callbacks.append(_on_collection)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
