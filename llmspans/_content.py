"""Whether prompt and completion text may be recorded, and the hook that redacts it.

Content is off unless the user opts in: `capture_content=True` (or a redaction callable)
on `instrument()`/`configure()`, or the standard `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`
with `true` or the reference values `SPAN_ONLY` / `SPAN_AND_EVENT` (any case). llmspans records
content on the call span only: `EVENT_ONLY` asks for none on spans, so it records none, and says once
that it emits no content events (nor does `SPAN_AND_EVENT` add any). Anything else is off.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union

from llmspans import _names as names
from llmspans import _openai_wire

if TYPE_CHECKING:
    from llmspans._call import CallRecord

Redactor = Callable[[Any], Any]
CaptureSetting = Union[bool, Redactor, None]  # noqa: UP007 - a runtime alias must work on 3.10

logger = logging.getLogger("llmspans")
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
    return _from_environment(os.environ.get(names.ENV_CAPTURE_CONTENT, ""))


_ON = frozenset({"1", "true", "yes", "on", "span_only", "span_and_event"})
_NO_EVENTS = frozenset({"event_only", "span_and_event"})
_said: set[str] = set()


def _from_environment(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _NO_EVENTS and value not in _said:
        _said.add(value)
        logger.warning(
            "llmspans: %s=%s: llmspans records message content on the call span only and emits no content "
            "events%s", names.ENV_CAPTURE_CONTENT, raw.strip(),
            "; nothing is recorded" if value == "event_only" else "",
        )  # fmt: skip
    return value in _ON


def write(record: CallRecord, setting: CaptureSetting, attribute: str, messages: Any) -> None:
    """Serialise opted-in content through the user's redaction hook, capped in length."""
    if not setting or messages is None:
        return
    if callable(setting) and not isinstance(setting, bool):
        messages = setting(messages)
        if messages is None:
            return
    text = messages if isinstance(messages, str) else json.dumps(messages, ensure_ascii=False, default=str)
    record.set_attributes({attribute: text[:MAX_CONTENT_CHARS]})


def write_input(record: CallRecord, setting: CaptureSetting, body: Any) -> None:
    """The request's messages, and the Responses API's `instructions` as the system instructions."""
    write(record, setting, names.GEN_AI_INPUT_MESSAGES, _openai_wire.input_messages(body))
    write(record, setting, names.GEN_AI_SYSTEM_INSTRUCTIONS, _openai_wire.system_instructions(body))


# The GenAI message schema's finish reasons, from the OpenAI names where they differ.
_FINISH_REASONS = {"tool_calls": "tool_call", "function_call": "tool_call"}


def write_output(record: CallRecord, setting: CaptureSetting, text: str) -> None:
    """The answer as the GenAI output messages: one assistant message with one text part and the
    `finish_reason` the schema requires (the first choice's; `error` when the answer never said it
    was over, as a stream cut short)."""
    reasons = record.finish_reasons
    reason = _FINISH_REASONS.get(reasons[0], reasons[0]) if reasons else "error"
    write(
        record, setting, names.GEN_AI_OUTPUT_MESSAGES,
        [{"role": "assistant", "parts": [{"type": "text", "content": text}], "finish_reason": reason}],
    )  # fmt: skip
