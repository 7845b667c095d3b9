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
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Union

from llmspans import _conversation, _internals
from llmspans import _names as names

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
    # Read at every call (a change to the environment counts from the next call), as cheaply as it is
    # stored: what a stored value says is worked out once.
    raw = _read_environment()
    found = _from_raw.get(raw)
    if found is None:
        found = _from_environment("" if raw is None else _decode_environment(raw))
        if len(_from_raw) < 64:
            _from_raw[raw] = found
    return found


_read_environment, _decode_environment = _internals.environment_reader(names.ENV_CAPTURE_CONTENT)
_from_raw: dict[Any, bool] = {}


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


def limit(record: CallRecord) -> int:
    """The most characters one content attribute may hold on this call's span: `MAX_CONTENT_CHARS`, or
    the tracer provider's attribute value length limit when that is lower (`SpanLimits`, or
    `OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT`), which would otherwise cut the JSON text mid-way."""
    configured = _internals.span_attribute_length_limit(record.span)
    if (
        isinstance(configured, int)
        and not isinstance(configured, bool)
        and 0 < configured < MAX_CONTENT_CHARS
    ):
        return configured
    return MAX_CONTENT_CHARS


def write(record: CallRecord, setting: CaptureSetting, attribute: str, messages: Any) -> None:
    """Serialise opted-in content through the user's redaction hook, within the length limit.

    JSON that would be too long keeps its structure: the longest texts are shortened first (each
    ends with a note of what was cut), inline bytes are dropped whole, and only if that is not
    enough the oldest messages go. A hook that returns a string has it recorded as it is, cut short.
    """
    if not setting or messages is None:
        return
    if callable(setting) and not isinstance(setting, bool):
        messages = setting(messages)
        if messages is None:
            return
    most = limit(record)
    text = messages[:most] if isinstance(messages, str) else fit(messages, most)
    if text is not None:
        record.set_attributes({attribute: text})


def keeps_bytes(setting: CaptureSetting) -> bool:
    """Inline media (images, audio, files sent as base64) keeps its bytes only for a redaction hook,
    which sees the whole conversation and decides what is recorded; `True` records the part without them."""
    return callable(setting) and not isinstance(setting, bool)


def write_input(record: CallRecord, setting: CaptureSetting, body: Any) -> None:
    """The request's messages, and the Responses API's `instructions` as the system instructions."""
    write(
        record, setting, names.GEN_AI_INPUT_MESSAGES, _conversation.input_messages(body, keeps_bytes(setting))
    )
    write(record, setting, names.GEN_AI_SYSTEM_INSTRUCTIONS, _conversation.system_instructions(body))


def write_output(record: CallRecord, setting: CaptureSetting, output: _conversation.OutputMessages) -> None:
    """The answer as the GenAI output messages; nothing when the model returned nothing."""
    write(record, setting, names.GEN_AI_OUTPUT_MESSAGES, output.messages())


# --- keeping content within the limit -------------------------------------------------------------

# Keys whose string values say what a part is, not what it holds: never shortened.
_STRUCTURAL = frozenset({"type", "role", "id", "name", "mime_type", "modality", "finish_reason", "file_id"})


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def fit(messages: Any, most: int) -> str | None:
    """`messages` as compact JSON of at most `most` characters, or None when not even its shape fits.

    Too long, its texts are shortened, the longest first, to one common length (each cut text ends
    with a note of how much was cut; inline bytes go whole); if even notes alone are too long, the
    oldest messages go first (the newest led to this answer), and the rest is shortened again.
    """
    text = _dumps(messages)
    if len(text) <= most:
        return text
    if isinstance(messages, list) and messages:
        # The shortest each message can be: every text cut to its note alone.
        least = [len(_dumps(_shortened(message, 0, None))) + 1 for message in messages]
        keep, room = 0, most - 1  # the list's brackets; each message's comma counted in `least`
        while keep < len(messages) and least[-1 - keep] <= room:
            room -= least[-1 - keep]
            keep += 1
        if keep == 0:
            return None
        messages = messages[-keep:]
        text = _dumps(messages)
        if len(text) <= most:
            return text
    texts: list[tuple[int, bool]] = []
    _texts(messages, texts, None, False)
    budget = sum(length for length, _ in texts) - (len(text) - most)
    for _ in range(4):  # escaping makes the estimate slightly short, rarely more than once
        cap = _cap(texts, budget)
        if cap is None:
            break
        text = _dumps(_shortened(messages, cap, None))
        if len(text) <= most:
            return text
        budget -= len(text) - most
    text = _dumps(_shortened(messages, 0, None))
    return text if len(text) <= most else None


def _texts(value: Any, texts: list[tuple[int, bool]], key: str | None, blob: bool) -> None:
    """The length of each text that may be shortened, and whether it goes whole (a blob's bytes), in
    the order `_shortened` meets them."""
    if isinstance(value, str):
        if key not in _STRUCTURAL:
            texts.append((len(value), blob and key == "content"))
    elif isinstance(value, Mapping):
        is_blob = value.get("type") == "blob"
        for item_key, item in value.items():
            _texts(item, texts, item_key, is_blob)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _texts(item, texts, key, False)


_EARLIER_NOTE = re.compile(r"…\[\+(\d+) chars\]\Z")


def _note(cut: int) -> int:
    """The length of the note a shortened text ends with: "…[+1234 chars]"."""
    return 10 + len(str(cut))


def _kept(length: int, cap: int, whole: bool) -> int:
    """What a text of `length` takes once shortened to `cap` (the same rule as `_shortened`)."""
    if length <= cap:
        return length
    if whole:
        return 0
    shortened = cap + _note(length - cap)
    return shortened if shortened < length else length


def _cap(texts: list[tuple[int, bool]], budget: int) -> int | None:
    """The longest a text may stay so that all of them, with their notes, take at most `budget` chars."""
    if sum(_kept(length, 0, whole) for length, whole in texts) > budget:
        return None
    low, high = 0, max((length for length, _ in texts), default=0)
    while low < high:
        middle = (low + high + 1) // 2
        if sum(_kept(length, middle, whole) for length, whole in texts) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def _shortened(value: Any, cap: int, key: str | None, blob: bool = False) -> Any:
    if isinstance(value, str):
        if key in _STRUCTURAL or len(value) <= cap:
            return value
        if blob and key == "content":
            return ""  # part of a base64 text is no use to anyone: the bytes go whole
        body, earlier = value, 0
        found = _EARLIER_NOTE.search(value)  # cut once already, as it arrived: one note says it all
        if found is not None:
            body, earlier = value[: found.start()], int(found.group(1))
        if cap >= len(body):
            return value
        shortened = _conversation.noted(body[:cap], earlier + len(body) - cap)
        return shortened if len(shortened) < len(value) else value
    if isinstance(value, Mapping):
        is_blob = value.get("type") == "blob"
        return {item_key: _shortened(item, cap, item_key, is_blob) for item_key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shortened(item, cap, key) for item in value]
    return value
