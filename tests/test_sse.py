"""The SSE observer (`llmspans/_sse.py`): WHATWG parsing over arbitrary chunk splits, in bounded memory."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmspans._sse import SSEObserver

Event = tuple[str | None, str]


def observe(chunks: Iterable[bytes], **options: Any) -> tuple[list[Event], SSEObserver]:
    events: list[Event] = []
    observer = SSEObserver(lambda name, data: events.append((name, data)), **options)
    for chunk in chunks:
        observer.feed(chunk)
    observer.close()
    return events, observer


def parse(*chunks: bytes) -> list[Event]:
    return observe(chunks)[0]


def byte_by_byte(body: bytes) -> list[Event]:
    return parse(*(body[i : i + 1] for i in range(len(body))))


# --- line endings -----------------------------------------------------------------------------


@pytest.mark.parametrize("ending", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
def test_each_line_ending_style(ending: str) -> None:
    body = ending.join(["data: one", "", "data: two", "data: three", "", ""]).encode()
    expected = [(None, "one"), (None, "two\nthree")]
    assert parse(body) == expected
    assert byte_by_byte(body) == expected


def test_mixed_line_endings_in_one_body() -> None:
    body = b"data: a\r\ndata: b\rdata: c\n\r\ndata: d\r\rdata: e\n\n"
    expected = [(None, "a\nb\nc"), (None, "d"), (None, "e")]
    assert parse(body) == expected
    assert byte_by_byte(body) == expected


def test_crlf_split_across_feeds_is_one_line_ending() -> None:
    # Were the LF counted as a second ending, the blank line would dispatch "a" alone.
    assert parse(b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n") == [(None, "a\nb")]


def test_cr_at_chunk_end_followed_by_another_line() -> None:
    assert parse(b"data: a\r", b"\r", b"data: b\r", b"\r") == [(None, "a"), (None, "b")]


def test_pending_cr_survives_chunks_that_decode_to_nothing() -> None:
    # An empty chunk and the first byte of a 2-byte character both decode to "".
    assert parse(b"data: a\r", b"", b"\xc3", b"\xa9\r\n") == []
    assert parse(b"data: a\r", b"", b"\n", b"\r\n") == [(None, "a")]


def test_only_cr_and_lf_break_lines() -> None:
    # str.splitlines would also break on these; SSE does not.
    value = "a\x0bb\x0cc\x1cd\x85e\u2028f\u2029g"
    assert parse(f"data: {value}\n\n".encode()) == [(None, value)]


# --- fields, comments, events -----------------------------------------------------------------


def test_comments_and_keep_alives_are_ignored() -> None:
    body = b": keep-alive\n\n:\n: ping\ndata: a\n: between lines\ndata: b\n\n:\n\n"
    assert parse(body) == [(None, "a\nb")]


def test_responses_api_event_names() -> None:
    body = (
        b'event: response.created\ndata: {"type":"response.created"}\n\n'
        b'event: response.output_text.delta\ndata: {"delta":"Hi"}\n\n'
        b"data: unnamed\n\n"
        b"event:\ndata: empty name\n\n"
        b"event: first\nevent: last\ndata: x\n\n"
    )
    assert parse(body) == [
        ("response.created", '{"type":"response.created"}'),
        ("response.output_text.delta", '{"delta":"Hi"}'),
        (None, "unnamed"),
        (None, "empty name"),
        ("last", "x"),
    ]


def test_multi_line_data_and_empty_data_lines() -> None:
    body = b"data: a\ndata\ndata:\ndata: b\n\ndata\n\ndata:\ndata:\n\n"
    assert parse(body) == [(None, "a\n\n\nb"), (None, ""), (None, "\n")]


def test_only_one_leading_space_is_stripped() -> None:
    body = b"data:x\ndata: y\ndata:  z\ndata:\tw\ndata: a: b\n\nevent:  spaced\ndata: v\n\n"
    assert parse(body) == [(None, "x\ny\n z\n\tw\na: b"), (" spaced", "v")]


def test_unknown_fields_and_fields_without_colon_are_ignored() -> None:
    body = b"id: 7\nretry: 1000\nfoo: bar\nfoo\nData: wrong case\ndatax: no\nevent\ndata: kept\n\n"
    assert parse(body) == [(None, "kept")]


def test_event_without_data_lines_is_not_dispatched_and_its_name_does_not_leak() -> None:
    assert parse(b"event: lonely\n\nid: 3\n\n\n\ndata: next\n\n") == [(None, "next")]


def test_unfinished_event_at_close_is_discarded() -> None:
    assert parse(b"data: a\n\ndata: b\n") == [(None, "a")]
    assert parse(b"data: a\n\ndata: b") == [(None, "a")]
    assert parse(b"data: a\n\ndata: b\r") == [(None, "a")]


def test_feed_after_close_is_ignored() -> None:
    events, observer = observe([b"data: a\n"])
    observer.feed(b"\ndata: b\n\n")
    observer.close()
    assert events == []


def test_leading_byte_order_mark_is_skipped_once() -> None:
    assert parse(b"\xef\xbb\xbfdata: a\n\n") == [(None, "a")]
    assert parse(b"\xef", b"\xbb", b"\xbf", b"data: a\n\n") == [(None, "a")]
    assert parse(b"data: \xef\xbb\xbfa\n\n") == [(None, "\ufeffa")]


def test_utf8_character_split_across_feeds() -> None:
    text = "héllo € 𝄞 日本"
    body = f"data: {text}\n\n".encode()
    assert byte_by_byte(body) == [(None, text)]
    cut = body.index("𝄞".encode()) + 2
    assert parse(body[:cut], body[cut:]) == [(None, text)]


def test_invalid_utf8_becomes_replacement_characters() -> None:
    assert parse(b"data: a\xffb\xc3\n\n", b"data: \xe2\x82\n\n") == [
        (None, "a\ufffdb\ufffd"),
        (None, "\ufffd"),
    ]


def test_callback_error_propagates_and_the_parser_stays_consistent() -> None:
    events: list[Event] = []

    def on_event(name: str | None, data: str) -> None:
        if data == "boom":
            raise RuntimeError(data)
        events.append((name, data))

    observer = SSEObserver(on_event)
    with pytest.raises(RuntimeError):
        observer.feed(b"data: boom\n\ndata: par")
    observer.feed(b"tial\n\n")
    assert events == [(None, "partial")]


def test_max_event_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_event_bytes must be a positive number of bytes, got 0"):
        SSEObserver(lambda name, data: None, max_event_bytes=0)


# --- size limit -------------------------------------------------------------------------------

_TEN_MB = 10 * 1024 * 1024
_PIECE = 64 * 1024


def _big_line_chunks(size: int) -> Iterable[bytes]:
    piece = b"x" * _PIECE
    yield b"data: "
    for _ in range(size // _PIECE):
        yield piece
    yield b"\n\n"


def test_ten_megabyte_event_under_the_limit_is_dispatched_once() -> None:
    events, observer = observe([*_big_line_chunks(_TEN_MB), b"data: after\n\n"])
    assert [(name, len(data)) for name, data in events] == [(None, _TEN_MB), (None, 5)]
    assert events[0][1] == "x" * _TEN_MB
    assert observer.dropped_events == 0
    events, _ = observe([b"data: " + b"y" * _TEN_MB + b"\n\n"])
    assert len(events) == 1
    assert len(events[0][1]) == _TEN_MB


def test_ten_megabyte_event_over_the_limit_is_dropped_without_holding_it() -> None:
    limit = 1024 * 1024
    events: list[Event] = []
    observer = SSEObserver(lambda name, data: events.append((name, data)), max_event_bytes=limit)
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for chunk in _big_line_chunks(_TEN_MB):
            observer.feed(chunk)
        retained = tracemalloc.get_traced_memory()[0] - baseline
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    assert observer.dropped_events == 1
    assert peak < 3 * limit
    assert retained < 64 * 1024
    observer.feed(b"event: next\ndata: small\n\n")
    assert events == [("next", "small")]


def test_oversized_event_in_a_single_chunk_is_dropped() -> None:
    events, observer = observe([b"data: " + b"x" * 2000 + b"\n\ndata: ok\n\n"], max_event_bytes=1000)
    assert events == [(None, "ok")]
    assert observer.dropped_events == 1


def test_many_small_data_lines_over_the_limit_drop_the_event_once() -> None:
    body = b"data: 0123456789\n" * 100 + b"\n" + b"data: ok\n\n"
    events, observer = observe([body[i : i + 7] for i in range(0, len(body), 7)], max_event_bytes=500)
    assert events == [(None, "ok")]
    assert observer.dropped_events == 1


def test_event_exactly_at_the_limit_is_kept() -> None:
    # Size counts the data plus one newline per data line: "abc" + "\n" + "de" + "\n" = 7.
    assert observe([b"data: abc\ndata: de\n\n"], max_event_bytes=7)[0] == [(None, "abc\nde")]
    assert observe([b"data: abc\ndata: de\n\n"], max_event_bytes=6)[0] == []


def test_oversized_comment_is_skipped_without_dropping_the_event() -> None:
    body = [b"data: a\n:", b"c" * 3000, b"c" * 3000, b"\ndata: b\n\n"]
    events, observer = observe(body, max_event_bytes=1000)
    assert events == [(None, "a\nb")]
    assert observer.dropped_events == 0


def test_limit_counts_utf8_bytes_not_characters() -> None:
    value = "€" * 100  # 300 bytes
    assert observe([f"data: {value}\n\n".encode()], max_event_bytes=200)[0] == []
    assert observe([f"data: {value}\n\n".encode()], max_event_bytes=301)[0] == [(None, value)]


# --- any split gives the same events ----------------------------------------------------------

_field_text = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=12)


def _value_after_colon(raw: str) -> str:
    return raw[1:] if raw.startswith(" ") else raw


@st.composite
def sse_bodies(draw: st.DrawFn) -> tuple[bytes, list[Event]]:
    """A body of random events, comments and ignored fields, with random line endings, and its events."""
    lines: list[str] = []
    expected: list[Event] = []
    for _ in range(draw(st.integers(0, 6))):
        name = ""
        data: list[str] = []
        kinds = st.sampled_from(["data", "data", "event", "comment", "ignored"])
        for kind in draw(st.lists(kinds, max_size=6)):
            raw = draw(_field_text)
            if kind == "data":
                if not raw and draw(st.booleans()):
                    lines.append("data")
                    data.append("")
                else:
                    lines.append("data:" + raw)
                    data.append(_value_after_colon(raw))
            elif kind == "event":
                lines.append("event:" + raw)
                name = _value_after_colon(raw)
            elif kind == "comment":
                lines.append(":" + raw)
            else:
                lines.append(draw(st.sampled_from(["id:", "retry:", "x-field:", "id", "x"])) + raw)
        lines.append("")
        if data:
            expected.append((name or None, "\n".join(data)))
    if draw(st.booleans()):
        lines.append("data: never dispatched")  # the body ends mid-event
    text = []
    previous = ""
    for line in lines:
        ending = draw(st.sampled_from(["\n", "\r\n", "\r"]))
        if previous == "\r" and not line and ending == "\n":
            ending = "\r\n"  # "\r" + "\n" would merge two line endings into one
        text.append(line + ending)
        previous = ending
    if lines and lines[-1] and draw(st.booleans()):
        text[-1] = lines[-1]  # the last line unterminated as well
    return "".join(text).encode(), expected


@settings(max_examples=200, deadline=None)
@given(sse_bodies(), st.data())
def test_any_chunking_gives_the_events_of_the_whole_body(
    body_and_events: tuple[bytes, list[Event]], data: st.DataObject
) -> None:
    body, expected = body_and_events
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=12), label="cuts"))
    chunks = [body[start:end] for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    assert parse(body) == expected
    assert parse(*chunks) == expected
