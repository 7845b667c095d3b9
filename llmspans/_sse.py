"""Watching a Server-Sent-Events body as it is read, one event at a time.

The transport hands `SSEObserver.feed` every piece of the body the application reads, in
whatever pieces the network delivered. The observer never changes or holds back those bytes:
it decodes them, keeps only the unterminated last line and the event being assembled, and
calls back once per complete event. Parsing follows the WHATWG rules
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation).

What an event says about an LLM call is the wire format's business (`_openai_wire.classify`).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

__all__ = ["SSEObserver"]

DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024


def _utf8_len(text: str) -> int:
    # isascii() is O(1) in CPython, so the common (ASCII JSON) case costs nothing extra.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class SSEObserver:
    """Feed raw body bytes; `on_event(event_name, data)` is called for each complete event.

    What the caller can rely on:

    - Chunks may be split anywhere: mid-line, mid-UTF-8 character, between the CR and LF of
      one line ending. The events are the same as if the body had been fed in one piece.
    - Lines end with CRLF, LF or CR; a blank line dispatches the event; `data:` lines are
      joined with "\\n"; one space after the colon is dropped; `:` lines are comments;
      `event:` names the event (`event_name` is None when there was no name, which SSE
      calls "message"); `id`, `retry` and unknown fields are ignored; an event without
      `data` lines is not dispatched. A leading byte-order mark is skipped.
    - Bytes that are not valid UTF-8 become U+FFFD; `feed` never raises for malformed input.
    - Memory is bounded: an event whose data and event name exceed `max_event_bytes` (UTF-8
      bytes, counting one newline per data line) is dropped as soon as it does, counted in
      `dropped_events`, and the rest of it is skipped up to its blank line. A comment line
      longer than the limit is skipped without affecting the event around it.
    - `close()` ends the body: an event not yet followed by a blank line is discarded, as the
      SSE specification requires for a stream that ends mid-event. Later `feed` calls are
      ignored.
    - If `on_event` raises, the exception propagates out of `feed` and the remaining events of
      that chunk are not delivered; the parser's own state stays consistent for later chunks.
    """

    __slots__ = (
        "_closed",
        "_data",
        "_decode",
        "_dropping",
        "_event_name",
        "_event_size",
        "_max_event_bytes",
        "_on_event",
        "_skip_lf",
        "_skip_line",
        "_started",
        "_tail",
        "_tail_size",
        "dropped_events",
    )

    def __init__(
        self,
        on_event: Callable[[str | None, str], None],
        *,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        if isinstance(max_event_bytes, bool) or not isinstance(max_event_bytes, int) or max_event_bytes <= 0:
            raise ValueError(f"max_event_bytes must be a positive number of bytes, got {max_event_bytes!r}")
        self._on_event = on_event
        self._max_event_bytes = max_event_bytes
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        self._started = False
        self._closed = False
        self._skip_lf = False  # the last chunk ended with CR: a leading LF is part of that line ending
        self._tail: list[str] = []  # pieces of the unterminated last line
        self._tail_size = 0
        self._skip_line = False  # the unterminated line outgrew the limit and is being skipped
        self._data: list[str] = []
        self._event_name: str | None = None
        self._event_size = 0
        self._dropping = False  # the current event outgrew the limit; skip to its blank line
        self.dropped_events = 0

    def feed(self, chunk: bytes) -> None:
        """Observe the next piece of the body, calling back for every event it completes."""
        if self._closed or not chunk:
            return
        text = self._decode(chunk)
        if not text:
            return
        if not self._started:
            self._started = True
            if text[0] == "\ufeff":
                text = text[1:]
                if not text:
                    return
        if self._skip_lf:
            self._skip_lf = False
            if text[0] == "\n":
                text = text[1:]
                if not text:
                    return
        if "\r" in text:
            self._skip_lf = text[-1] == "\r"
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if "\n" not in text:
            self._grow_tail(text)
            return
        lines = text.split("\n")
        rest = lines.pop()
        first = 0
        if self._skip_line:
            self._skip_line = False
            first = 1  # the end of a line already given up on, even if it looks blank
        elif self._tail:
            self._tail.append(lines[0])
            lines[0] = "".join(self._tail)
            self._tail.clear()
            self._tail_size = 0
        events = self._parse(lines, first)
        if rest:
            self._grow_tail(rest)
        for name, data in events:
            self._on_event(name, data)

    def close(self) -> None:
        """End of body: drop any unfinished event (SSE never dispatches one) and ignore later feeds."""
        if self._closed:
            return
        self._closed = True
        self._decode(b"", True)
        self._tail.clear()
        self._data.clear()
        self._event_name = None
        self._tail_size = self._event_size = 0

    def _parse(self, lines: list[str], first: int) -> list[tuple[str | None, str]]:
        """Apply complete lines to the event being assembled; return the events they finished."""
        events: list[tuple[str | None, str]] = []
        data = self._data
        for index in range(first, len(lines)):
            line = lines[index]
            if not line:
                if data and not self._dropping:
                    events.append((self._event_name or None, "\n".join(data)))
                data.clear()
                self._event_name = None
                self._event_size = 0
                self._dropping = False
                continue
            if self._dropping or line[0] == ":":
                continue
            if line.startswith("data: "):
                value = line[6:]
            else:
                name, colon, value = line.partition(":")
                if colon and value[:1] == " ":
                    value = value[1:]
                if name == "event":
                    self._event_size += _utf8_len(value) - _utf8_len(self._event_name or "")
                    self._event_name = value
                    if self._event_size > self._max_event_bytes:
                        self._drop()
                    continue
                if name != "data":
                    continue
            self._event_size += _utf8_len(value) + 1
            if self._event_size > self._max_event_bytes:
                self._drop()
            else:
                data.append(value)
        return events

    def _drop(self) -> None:
        """Give up on the current event: count it, release what it holds, skip to its blank line."""
        self.dropped_events += 1
        self._dropping = True
        self._data.clear()
        self._event_name = None
        self._event_size = 0

    def _grow_tail(self, text: str) -> None:
        """Keep an unterminated line for the next chunk, within the event's memory limit."""
        if self._skip_line:
            return
        self._tail.append(text)
        self._tail_size += _utf8_len(text)
        if self._tail_size + self._event_size > self._max_event_bytes:
            if self._tail[0][0] != ":" and not self._dropping:
                self._drop()
            self._tail.clear()
            self._tail_size = 0
            self._skip_line = True
