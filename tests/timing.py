"""Shared help for tests that compare client timings with a server's known delays."""

from __future__ import annotations

import functools
import inspect
from typing import Any


def retry_timing(test: Any) -> Any:
    """Run a timing test up to three times: a scheduler hiccup on a loaded 2-core machine can
    delay one stamp by several ms, but a systematic error (a stamp taken at the wrong point)
    fails every run. Fixtures are reused; the records are cleared between runs."""

    def reset(kwargs: dict[str, Any]) -> None:
        for fixture in ("captured", "server", "receiver"):
            if fixture in kwargs:
                kwargs[fixture].clear()

    if inspect.iscoroutinefunction(test):

        @functools.wraps(test)
        async def async_wrapper(*args: Any, **kwargs: Any) -> None:
            for attempt in range(3):
                try:
                    return await test(*args, **kwargs)
                except AssertionError:
                    if attempt == 2:
                        raise
                    reset(kwargs)

        return async_wrapper

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        for attempt in range(3):
            try:
                return test(*args, **kwargs)
            except AssertionError:
                if attempt == 2:
                    raise
                reset(kwargs)

    return wrapper
