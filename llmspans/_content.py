"""Whether prompt and completion text may be recorded, and the hook that redacts it.

Content is off unless the user opts in: `capture_content=True` (or a redaction callable)
on `instrument()`/`configure()`, or the standard
`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Union

from llmspans import _names as names

Redactor = Callable[[Any], Any]
CaptureSetting = Union[bool, Redactor, None]  # noqa: UP007 - a runtime alias must work on 3.10

_configured: CaptureSetting = None
MAX_CONTENT_CHARS = 16_384


def check(value: object, *, what: str = "capture_content") -> CaptureSetting:
    if value is None or isinstance(value, bool) or callable(value):
        return value
    raise TypeError(f"{what} must be True, False, None or a callable that redacts messages, got {value!r}")


def set_configured(value: CaptureSetting) -> None:
    global _configured
    _configured = value


def resolve(explicit: CaptureSetting) -> CaptureSetting:
    """The setting in force for one client: its own, else configure()'s, else the environment."""
    if explicit is not None:
        return explicit
    if _configured is not None:
        return _configured
    return os.environ.get(names.ENV_CAPTURE_CONTENT, "").strip().lower() in ("1", "true", "yes", "on")
