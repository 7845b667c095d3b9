"""The firewall between llmspans' own failures and the user's code.

Every hook llmspans runs inside a user's call goes through `guarded` or `swallow`, so an
internal error is logged once per site and never reaches the application. A test switch
(`faults`) makes a named site raise, to prove the firewall holds.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

logger = logging.getLogger("llmspans")

P = ParamSpec("P")
R = TypeVar("R")
D = TypeVar("D")

_reported: set[str] = set()
_reported_lock = threading.Lock()
faults: set[str] = set()
"""The sites a test made fail; empty otherwise, so `if _guard.faults: check_fault(site)` costs the request
path one lookup (read through the module: a test may swap the set for one that counts)."""


class InjectedFault(RuntimeError):
    """Raised by a site the fault-injection switch names; only ever seen in tests."""


class Deliberate(Exception):
    """An exception llmspans raises into the app on purpose, because the app asked for it (a prompt cap
    with `on_exceed="error"`): the guards let it through, where they swallow any failure of our own."""


def report(site: str, error: BaseException) -> None:
    """Log an internal error once per site: a broken hook must not flood the app's logs."""
    with _reported_lock:
        if site in _reported:
            return
        _reported.add(site)
    with contextlib.suppress(Exception):  # logging itself may be broken; we still must not raise
        logger.warning(
            "llmspans: internal error in %s, telemetry for this call may be incomplete", site, exc_info=error
        )


def forget_reported() -> None:
    """Let every site log its next failure again (`llmspans.testing.reset`)."""
    with _reported_lock:
        _reported.clear()


def check_fault(site: str) -> None:
    """Raise at `site` when a test asked for it; a set lookup otherwise."""
    if faults and site in faults:
        raise InjectedFault(site)


def guarded(site: str, default: D) -> Callable[[Callable[P, R]], Callable[P, R | D]]:
    """Decorate an internal hook so that any exception is reported and `default` returned."""

    def decorate(func: Callable[P, R]) -> Callable[P, R | D]:
        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | D:
            try:
                if faults and site in faults:  # `check_fault`, inlined: this runs on every call
                    raise InjectedFault(site)
                return func(*args, **kwargs)
            except Deliberate:
                raise
            except Exception as error:
                report(site, error)
                return default

        return wrapper

    return decorate


class swallow:
    """Run a block of instrumentation code whose failure must not reach the caller.

    A class rather than a generator context manager: it runs several times per call.
    """

    __slots__ = ("site",)

    def __init__(self, site: str) -> None:
        self.site = site

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, error: BaseException | None, _tb: object
    ) -> bool:
        if error is None:
            if not (faults and self.site in faults):
                return False
            error = InjectedFault(self.site)  # after the block, as a failure of the block would be
        elif not isinstance(error, Exception):
            return False  # KeyboardInterrupt, SystemExit, cancellation: not ours to swallow
        report(self.site, error)
        return True


@contextmanager
def inject_faults(*sites: str) -> Iterator[None]:
    """Make the named internal sites raise inside the block (for fault-injection tests)."""
    faults.update(sites)
    forget_reported()
    try:
        yield
    finally:
        faults.difference_update(sites)
