"""The SSE observer (WHATWG parsing over arbitrary chunk splits) and the OpenAI-compatible classifier."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmspans._sse import ChunkInfo, SSEObserver, classify, classify_json_body

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


# --- classify: chat completions ---------------------------------------------------------------


def chat_chunk(delta: Any, finish: str | None = None, **extra: Any) -> str:
    return json.dumps(
        {
            "id": "chatcmpl-abc",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": "gpt-4o-mini-2024-07-18",
            "system_fingerprint": "fp_0ba0d124f1",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            **extra,
        }
    )


def test_role_only_first_chunk_is_not_content() -> None:
    info = classify(None, chat_chunk({"role": "assistant", "content": "", "refusal": None}))
    assert info == ChunkInfo(response_id="chatcmpl-abc", model="gpt-4o-mini-2024-07-18")


def test_content_chunk() -> None:
    info = classify(None, chat_chunk({"content": "Hello"}))
    assert info is not None
    assert (info.content, info.content_text, info.finish_reasons) == (True, "Hello", [])


def test_refusal_delta_is_content() -> None:
    info = classify(None, chat_chunk({"refusal": "I can't"}))
    assert info is not None
    assert (info.content, info.content_text) == (True, "I can't")


@pytest.mark.parametrize(
    "delta",
    [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ],
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]},
        {"reasoning_content": "Let me think"},
        {"reasoning": "Let me think", "content": None},
    ],
    ids=["tool_call_start", "tool_call_arguments", "reasoning_content", "reasoning"],
)
def test_tool_call_and_reasoning_deltas_are_content_without_answer_text(delta: dict[str, Any]) -> None:
    info = classify(None, chat_chunk(delta))
    assert info is not None
    assert (info.content, info.content_text) == (True, None)


def test_finish_chunk_with_usage_transformers_serve_style() -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46}
    info = classify(None, chat_chunk({}, "stop", usage=usage))
    assert info == ChunkInfo(
        response_id="chatcmpl-abc",
        model="gpt-4o-mini-2024-07-18",
        finish_reasons=["stop"],
        finish_indexes=[0],
        input_tokens=12,
        output_tokens=34,
    )


def test_usage_only_chunk() -> None:
    usage = {
        "prompt_tokens": 1200,
        "completion_tokens": 80,
        "total_tokens": 1280,
        "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    payload = {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [],
        "usage": usage,
    }
    info = classify(None, json.dumps(payload))
    assert info == ChunkInfo(
        response_id="chatcmpl-abc", model="m", input_tokens=1200, output_tokens=80, cached_tokens=1024
    )


def test_done_sentinel() -> None:
    assert classify(None, "[DONE]") == ChunkInfo(done=True)
    assert classify(None, " [DONE] ") == ChunkInfo(done=True)


@pytest.mark.parametrize("data", ["", "not json", "{bad", "[1, 2]", "null", '"text"', "42", "[" * 100_000])
def test_data_that_is_not_a_json_object_gives_none(data: str) -> None:
    assert classify(None, data) is None


@pytest.mark.parametrize(
    "payload",
    [
        {"choices": [{"index": 0, "delta": None, "finish_reason": None}], "usage": None},
        {"choices": None, "usage": None},
        {"choices": [None, 3, "x", {"delta": {"content": 5, "tool_calls": {}, "reasoning": []}}]},
        {"choices": {"0": {}}, "usage": [], "id": 7, "model": None},
        {"choices": [{"delta": "text", "finish_reason": 1, "text": None}]},
    ],
)
def test_null_and_mistyped_fields_are_tolerated(payload: dict[str, Any]) -> None:
    assert classify(None, json.dumps(payload)) == ChunkInfo()


def test_only_real_non_negative_ints_count_as_tokens() -> None:
    usage = {
        "prompt_tokens": True,
        "completion_tokens": -1,
        "prompt_tokens_details": {"cached_tokens": 3.0},
        "input_tokens": "5",
    }
    info = classify(None, json.dumps({"choices": [], "usage": usage}))
    assert info is not None
    assert (info.input_tokens, info.output_tokens, info.cached_tokens) == (None, None, None)


@pytest.mark.parametrize(
    "payload",
    [
        {
            "error": {
                "message": "Rate limit reached",
                "type": "requests",
                "param": None,
                "code": "rate_limit_exceeded",
            }
        },
        {"object": "error", "message": "The model does not exist.", "type": "NotFoundError", "code": 404},
        {"error": "Input validation error", "error_type": "validation"},
    ],
    ids=["openai", "vllm", "tgi"],
)
def test_error_payloads(payload: dict[str, Any]) -> None:
    info = classify(None, json.dumps(payload))
    assert info is not None
    assert info.error
    assert not info.content


def test_error_null_is_not_an_error() -> None:
    info = classify(None, chat_chunk({"content": "x"}, error=None))
    assert info is not None
    assert not info.error


# --- classify: legacy completions -------------------------------------------------------------


def completion_chunk(text: Any, finish: str | None = None, **extra: Any) -> str:
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    return json.dumps(
        {"id": "cmpl-xyz", "object": "text_completion", "created": 1, "model": "gpt-3.5-turbo-instruct"}
        | {"choices": [choice], **extra}
    )


def test_legacy_completion_chunks() -> None:
    info = classify(None, completion_chunk(" world"))
    assert info == ChunkInfo(
        content=True, response_id="cmpl-xyz", model="gpt-3.5-turbo-instruct", content_text=" world"
    )
    usage = {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
    info = classify(None, completion_chunk("", "length", usage=usage))
    assert info is not None
    assert (info.content, info.finish_reasons, info.input_tokens, info.output_tokens) == (
        False,
        ["length"],
        5,
        16,
    )


# --- classify: Responses API ------------------------------------------------------------------


def response_object(status: str, usage: Any = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "resp_123",
        "object": "response",
        "created_at": 1_741_290_958,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "model": "gpt-4.1-2025-04-14",
        "output": [],
        "usage": usage,
        **extra,
    }


def responses_event(kind: str, **fields: Any) -> tuple[str, str]:
    return kind, json.dumps({"type": kind, "sequence_number": 1, **fields})


_RESPONSES_USAGE = {
    "input_tokens": 37,
    "input_tokens_details": {"cached_tokens": 16},
    "output_tokens": 11,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 48,
}


def test_responses_created_gives_id_and_model() -> None:
    info = classify(*responses_event("response.created", response=response_object("in_progress")))
    assert info == ChunkInfo(response_id="resp_123", model="gpt-4.1-2025-04-14")


def test_responses_output_text_delta() -> None:
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    info = classify(*responses_event("response.output_text.delta", **where, delta="Hi", logprobs=[]))
    assert info == ChunkInfo(content=True, content_text="Hi")
    info = classify(*responses_event("response.output_text.delta", **where, delta=""))
    assert info == ChunkInfo()


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        ("response.function_call_arguments.delta", None),
        ("response.reasoning_text.delta", None),
        ("response.refusal.delta", "piece"),
    ],
)
def test_other_responses_deltas_are_content(kind: str, text: str | None) -> None:
    info = classify(*responses_event(kind, item_id="x", output_index=0, delta="piece"))
    assert info == ChunkInfo(content=True, content_text=text)


def test_responses_structural_events_are_not_content() -> None:
    item = {"id": "msg_1", "type": "message", "status": "in_progress", "content": [], "role": "assistant"}
    assert classify(*responses_event("response.output_item.added", output_index=0, item=item)) == ChunkInfo()
    info = classify(*responses_event("response.output_text.done", text="Hi there"))
    assert info == ChunkInfo()


def test_responses_completed_with_usage() -> None:
    response = response_object("completed", _RESPONSES_USAGE)
    info = classify(*responses_event("response.completed", response=response))
    assert info == ChunkInfo(
        response_id="resp_123",
        model="gpt-4.1-2025-04-14",
        finish_reasons=["stop"],
        finish_indexes=[0],
        input_tokens=37,
        output_tokens=11,
        cached_tokens=16,
    )


def test_responses_incomplete_and_failed() -> None:
    details = {"reason": "max_output_tokens"}
    response = response_object("incomplete", _RESPONSES_USAGE, incomplete_details=details)
    info = classify(*responses_event("response.incomplete", response=response))
    assert info is not None
    assert (info.finish_reasons, info.error) == (["max_output_tokens"], False)
    info = classify(*responses_event("response.incomplete", response=response_object("incomplete")))
    assert info is not None
    assert info.finish_reasons == ["length"]
    error = {"code": "server_error", "message": "The model failed"}
    info = classify(*responses_event("response.failed", response=response_object("failed", error=error)))
    assert info is not None
    assert (info.finish_reasons, info.error) == (["error"], True)


def test_responses_error_event() -> None:
    info = classify(
        *responses_event("error", code="ERR_SOMETHING", message="Something went wrong", param=None)
    )
    assert info == ChunkInfo(error=True)


def test_event_name_is_used_when_the_payload_has_no_type() -> None:
    info = classify("response.output_text.delta", json.dumps({"delta": "Hi"}))
    assert info == ChunkInfo(content=True, content_text="Hi")
    info = classify("response.completed", json.dumps({"response": None}))
    assert info == ChunkInfo(finish_reasons=["stop"], finish_indexes=[0])


# --- classify_json_body -----------------------------------------------------------------------


def test_json_body_chat_completion() -> None:
    body = {
        "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
        "object": "chat.completion",
        "created": 1_741_570_283,
        "model": "gpt-4o-2024-08-06",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The image shows", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 1117,
            "completion_tokens": 46,
            "total_tokens": 1163,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        },
    }
    assert classify_json_body(json.dumps(body).encode()) == ChunkInfo(
        content=True,
        response_id="chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
        model="gpt-4o-2024-08-06",
        finish_reasons=["stop"],
        finish_indexes=[0],
        input_tokens=1117,
        output_tokens=46,
        cached_tokens=0,
        content_text="The image shows",
    )


def test_json_body_chat_completion_with_tool_calls() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    body = {"id": "c", "object": "chat.completion", "model": "m"} | {
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]
    }
    info = classify_json_body(json.dumps(body).encode())
    assert info is not None
    assert (info.content, info.content_text, info.finish_reasons) == (True, None, ["tool_calls"])


def test_json_body_text_completion() -> None:
    body = json.loads(completion_chunk("\n\nThis is a test", "length"))
    body["usage"] = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert classify_json_body(json.dumps(body).encode()) == ChunkInfo(
        content=True,
        response_id="cmpl-xyz",
        model="gpt-3.5-turbo-instruct",
        finish_reasons=["length"],
        finish_indexes=[0],
        input_tokens=5,
        output_tokens=7,
        content_text="\n\nThis is a test",
    )


def test_json_body_embeddings() -> None:
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.0023, -0.0093]}],
        "model": "text-embedding-3-small",
        "usage": {"prompt_tokens": 8, "total_tokens": 8},
    }
    assert classify_json_body(json.dumps(body).encode()) == ChunkInfo(
        model="text-embedding-3-small", input_tokens=8
    )


def test_json_body_responses_object() -> None:
    message = {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Under the moon", "annotations": []}],
    }
    body = response_object("completed", _RESPONSES_USAGE, output=[message])
    assert classify_json_body(json.dumps(body).encode()) == ChunkInfo(
        content=True,
        response_id="resp_123",
        model="gpt-4.1-2025-04-14",
        finish_reasons=["stop"],
        finish_indexes=[0],
        input_tokens=37,
        output_tokens=11,
        cached_tokens=16,
        content_text="Under the moon",
    )
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}"}
    info = classify_json_body(json.dumps(response_object("completed", output=[call])).encode())
    assert info is not None
    assert (info.content, info.content_text) == (True, None)


def test_json_body_error() -> None:
    body = {
        "error": {"message": "Invalid API key", "type": "invalid_request_error", "code": "invalid_api_key"}
    }
    info = classify_json_body(json.dumps(body).encode())
    assert info is not None
    assert info.error


@pytest.mark.parametrize(
    "body", [b"", b"not json", b"\xff\xfe\xfa", b"[]", b"<html>502</html>", b"{" * 100_000]
)
def test_json_body_that_is_not_an_object_gives_none(body: bytes) -> None:
    assert classify_json_body(body) is None
