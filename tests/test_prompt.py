"""Prompt caps (`instrument(client, max_prompt_tokens=N, on_exceed=..., prompt_tokenizer=...)`), over real HTTP.

Every estimate here is checked against a count made independently: characters/4 by hand, a Hugging Face
tokenizer and a tiktoken encoding by those libraries themselves. Both tokenizers are trained here
(tests/support/trained_tokenizers.py): OpenAI's tiktoken encodings need a download this machine cannot make, so
tiktoken is tested through an encoding registered as a plugin would register it, and its real
`o200k_base` only where it is missing (one warning, characters/4, no download tried).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import llmspans
from llmspans import _names as names
from llmspans import _prompt
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.trained_tokenizers import (
    as_tiktoken,
    registered_tiktoken,
    sample_text,
    save_bpe,
    tiktoken_constructor,
    train_bpe,
)

SERVER_BEHAVIOR = Behavior(chunks=3, usage="finish")
CLIENTS = ["openai.OpenAI", "openai.AsyncOpenAI", "httpx.Client", "httpx2.AsyncClient"]
STUB_ENCODING = "llmspans_test_bpe"
STUB_MODEL = "sim-bpe"  # a model name tiktoken maps to the stub encoding, inside `stub_tiktoken`
OPERATIONS = {"chat": "/chat/completions", "completion": "/completions", "embedding": "/embeddings",
              "response": "/responses"}  # fmt: skip


# --- calling the simulated server through each kind of client -------------------------------------------


def call(
    kind: str,
    server: SimulatedServer,
    body: dict[str, Any],
    path: str = "/chat/completions",
    **instrument: Any,
) -> Any:
    """One request of `body` to `path` through an instrumented client of `kind`; the parsed answer."""
    if kind.startswith("openai."):
        return _call_openai(kind, server, body, path, instrument)
    library = __import__(kind.split(".")[0])
    if kind.endswith("AsyncClient"):

        async def run() -> Any:
            async with llmspans.instrument(
                library.AsyncClient(base_url=server.base_url), **instrument
            ) as client:
                response = await client.post(path, json=body)
                return response.text if body.get("stream") else response.json()

        return asyncio.run(run())
    with llmspans.instrument(library.Client(base_url=server.base_url), **instrument) as client:
        response = client.post(path, json=body)
        return response.text if body.get("stream") else response.json()


def _call_openai(
    kind: str, server: SimulatedServer, body: dict[str, Any], path: str, instrument: dict[str, Any]
) -> Any:
    def resource(client: Any) -> Any:
        return {
            "/chat/completions": client.chat.completions, "/completions": client.completions,
            "/embeddings": client.embeddings, "/responses": client.responses,
        }[path]  # fmt: skip

    if kind == "openai.AsyncOpenAI":

        async def run() -> Any:
            client = llmspans.instrument(
                openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0), **instrument
            )
            async with client:
                result = await resource(client).create(**body)
                if body.get("stream"):
                    return [item async for item in result]
                return result

        return asyncio.run(run())
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), **instrument
    )
    with client:
        result = resource(client).create(**body)
        return list(result) if body.get("stream") else result


def chat(content: str, model: str = "sim-model", **more: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **more}


def call_spans(captured: Captured) -> list[Any]:
    return [span for span in captured.spans if (span.attributes or {}).get(names.STAGE) == names.STAGE_LLM]


# --- the tokenizers -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe() -> Any:
    return train_bpe()


@pytest.fixture(scope="module")
def bpe_dir(bpe: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_bpe(tmp_path_factory.mktemp("tokenizer"), bpe)


@pytest.fixture
def stub_tiktoken(bpe: Any) -> Iterator[Any]:
    """tiktoken with the trained merges registered as `llmspans_test_bpe`, `sim-bpe` mapped to it."""
    pytest.importorskip("tiktoken")
    with registered_tiktoken(tiktoken_constructor(bpe, STUB_ENCODING), STUB_ENCODING, STUB_MODEL):
        yield as_tiktoken(bpe, STUB_ENCODING)


def hand_count(content: str) -> int:
    """characters/4 of one user message: "user" and the content, rounded up, plus 3 for the message and 3
    for the reply (OpenAI's count for chat)."""
    return -(-(len("user") + len(content)) // 4) + 3 + 3


# --- three prompt sizes, with and without a tokenizer ------------------------------------------------------


@pytest.mark.parametrize("tokenizer", ["chars", "hf", "tiktoken"])
@pytest.mark.parametrize("kind", CLIENTS)
def test_three_prompt_sizes_are_estimated_and_marked_against_the_cap(
    kind: str, tokenizer: str, server: SimulatedServer, captured: Captured, bpe: Any, bpe_dir: Path,
    stub_tiktoken: Any,
) -> None:  # fmt: skip
    """A short prompt, one exactly at the cap (not over it) and one of 100 KB, each sent (on_exceed="record")
    with its estimate, the estimator and whether it was over on the span and on its metrics."""
    if tokenizer == "chars":
        count, spec, estimator = hand_count, "chars", names.ESTIMATOR_CHARS
    elif tokenizer == "hf":
        spec, estimator = f"hf:{bpe_dir}", f"hf:{bpe_dir}"

        def count(content: str) -> int:
            return sum(len(bpe.encode(text, add_special_tokens=False).ids) for text in ("user", content)) + 6
    else:
        spec, estimator = f"tiktoken:{STUB_ENCODING}", f"tiktoken:{STUB_ENCODING}"

        def count(content: str) -> int:
            return sum(len(stub_tiktoken.encode_ordinary(text)) for text in ("user", content)) + 6

    prompts = [sample_text(200, seed=1), sample_text(4000, seed=2), sample_text(100_000, seed=3)]
    cap = count(prompts[1])  # the middle one is exactly at the cap: not over it
    for prompt in prompts:
        call(kind, server, chat(prompt), max_prompt_tokens=cap, prompt_tokenizer=spec)

    spans = call_spans(captured)
    assert len(spans) == 3
    assert len(server.requests) == 3  # "record" sends every one
    expected = [count(prompt) for prompt in prompts]
    assert expected[0] < cap < expected[2]
    for span, estimate in zip(spans, expected, strict=True):
        attributes = span.attributes
        assert attributes[names.PROMPT_ESTIMATED_TOKENS] == estimate
        assert attributes[names.PROMPT_ESTIMATOR] == estimator
        assert attributes[names.PROMPT_CAP] == cap
        assert attributes[names.PROMPT_OVER_CAP] is (estimate > cap)
        assert names.ERROR_TYPE not in attributes
    over = {
        point.attributes[names.PROMPT_OVER_CAP]: point.count
        for point in captured.metric_points(names.METRIC_OPERATION_DURATION)
    }
    assert over == {False: 2, True: 1}


def test_a_call_of_a_client_without_a_cap_carries_no_prompt_attribute_or_label(
    server: SimulatedServer, captured: Captured
) -> None:
    call("openai.OpenAI", server, chat("short"))
    (span,) = call_spans(captured)
    assert not [key for key in span.attributes or {} if key.startswith("llmspans.prompt.")]
    for point in captured.metric_points(names.METRIC_BUCKET_DURATION):
        assert names.PROMPT_OVER_CAP not in point.attributes


# --- on_exceed="error": refused before a byte is sent ----------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", CLIENTS)
def test_error_refuses_a_prompt_over_the_cap_before_any_byte_reaches_the_server(
    kind: str, stream: bool, server: SimulatedServer, captured: Captured
) -> None:
    short, long = sample_text(100), sample_text(2000)
    cap = hand_count(short) + 10
    call(kind, server, chat(short, stream=stream), max_prompt_tokens=cap, on_exceed="error")
    sent, connections = len(server.requests), server.connections_opened

    with pytest.raises(llmspans.PromptTooLarge) as raised:
        call(kind, server, chat(long, stream=stream), max_prompt_tokens=cap, on_exceed="error")

    server.wait_idle()
    assert (len(server.requests), server.connections_opened) == (
        sent,
        connections,
    )  # nothing sent, no connection
    error = raised.value
    assert (error.estimated_tokens, error.max_prompt_tokens, error.estimator, error.model) == (
        hand_count(long), cap, names.ESTIMATOR_CHARS, "sim-model",
    )  # fmt: skip
    assert isinstance(error, ValueError)
    assert f"max_prompt_tokens={cap}" in str(error)
    assert "nothing was sent" in str(error)
    answered, refused = call_spans(captured)
    assert answered.attributes[names.PROMPT_OVER_CAP] is False
    assert refused.attributes[names.PROMPT_OVER_CAP] is True
    assert refused.attributes[names.ERROR_TYPE] == names.ERROR_PROMPT_TOO_LARGE
    assert refused.status.status_code.name == "ERROR"
    assert refused.attributes[names.PROMPT_ESTIMATED_TOKENS] == hand_count(long)
    assert names.HTTP_RESPONSE_STATUS_CODE not in refused.attributes  # no attempt was made
    assert refused.end_time >= refused.start_time


def test_a_refused_call_never_waits_for_a_limiter_slot(server: SimulatedServer, captured: Captured) -> None:
    limiter = llmspans.Limiter(1, name="capped")
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), limiter=limiter,
        max_prompt_tokens=20, on_exceed="error",
    )  # fmt: skip
    # The only slot is held: a call that waited for it would hang here.
    with limiter, pytest.raises(llmspans.PromptTooLarge):
        client.chat.completions.create(**chat(sample_text(400)))
    assert limiter.stats().admitted == 1  # the block's own admission only
    assert server.requests == []


@pytest.mark.parametrize("kind", ["openai.OpenAI", "openai.AsyncOpenAI", "httpx.Client", "httpx.AsyncClient"])
def test_the_cap_still_refuses_inside_the_suppress_switch_and_records_nothing(
    kind: str, server: SimulatedServer, captured: Captured
) -> None:
    """Nothing records here, as with no provider at all: the cap acts all the same."""
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    with suppress_instrumentation(), pytest.raises(llmspans.PromptTooLarge):
        call(kind, server, chat(sample_text(400)), max_prompt_tokens=20, on_exceed="error")
    assert server.requests == []
    assert captured.spans == []


# --- the estimate against the server's own count -----------------------------------------------------------


@pytest.mark.parametrize("kind", CLIENTS)
def test_the_estimate_is_compared_with_the_input_tokens_the_server_reported(
    kind: str, server: SimulatedServer, captured: Captured
) -> None:
    """The simulator counts a prompt's words: 300 words of four letters are 300 tokens to it, and
    (4 + 1499) / 4 rounded up, plus 6, to characters/4."""
    content = " ".join(["abcd"] * 300)
    call(kind, server, chat(content), max_prompt_tokens=10_000)
    (span,) = call_spans(captured)
    attributes = span.attributes
    assert attributes[names.GEN_AI_USAGE_INPUT_TOKENS] == 300
    assert attributes[names.PROMPT_ESTIMATED_TOKENS] == 376 + 6
    assert attributes[names.PROMPT_ESTIMATE_RATIO] == pytest.approx(382 / 300, abs=1e-12)
    (point,) = captured.metric_points(names.METRIC_PROMPT_ESTIMATE_RATIO)
    assert (point.count, point.sum) == (1, pytest.approx(382 / 300, abs=1e-12))
    assert point.attributes[names.PROMPT_ESTIMATOR] == names.ESTIMATOR_CHARS
    assert point.attributes[names.GEN_AI_REQUEST_MODEL] == "sim-model"


def test_no_ratio_where_the_server_reported_no_usage(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(chunks=3, usage="none")
    call("openai.OpenAI", server, chat("no usage here", stream=True), max_prompt_tokens=100)
    (span,) = call_spans(captured)
    assert names.PROMPT_ESTIMATED_TOKENS in span.attributes
    assert names.PROMPT_ESTIMATE_RATIO not in span.attributes
    assert captured.metric_points(names.METRIC_PROMPT_ESTIMATE_RATIO) == []


@pytest.mark.parametrize("kind", ["openai.OpenAI", "httpx.Client"])
def test_every_operation_is_estimated_from_what_its_prompt_carries(
    kind: str, server: SimulatedServer, captured: Captured
) -> None:
    bodies = [
        ("/completions", {"model": "sim-model", "prompt": "abcd" * 25}, 25),  # no message overhead
        ("/completions", {"model": "sim-model", "prompt": [1, 2, 3, 4, 5, 6, 7]}, 7),  # token ids: exact
        ("/embeddings", {"model": "sim-embed", "input": ["abcd" * 10, "abcd" * 5]}, 15),
        ("/responses", {"model": "sim-model", "input": "abcd" * 8, "instructions": "abcd" * 4}, 12),
        ("/responses", {"model": "sim-model", "input": [{"role": "user", "content": "abcd" * 9}]},
         -(-(4 + 36) // 4) + 3 + 3),
    ]  # fmt: skip
    for path, body, _ in bodies:
        call(kind, server, body, path, max_prompt_tokens=1000)
    estimates = [span.attributes[names.PROMPT_ESTIMATED_TOKENS] for span in call_spans(captured)]
    assert estimates == [expected for _, _, expected in bodies]
    ratios = [span.attributes.get(names.PROMPT_ESTIMATE_RATIO) for span in call_spans(captured)]
    assert all(ratio is not None for ratio in ratios)  # every operation's usage is compared


def test_what_a_prompt_carries_and_what_it_does_not() -> None:
    """Tool calls, tool results and tool definitions are prompt text; an image (a data URL of megabytes) is
    not."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100_000}}
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is here?"}, image]},
            {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                  "function": {"name": "look", "arguments": "{\"x\":1}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
        ],
        "tools": [{"type": "function", "function": {"name": "look"}}],
    }  # fmt: skip
    texts, tokens = _prompt.prompt_pieces(body)
    assert texts == [
        "system", "be brief", "user", "what is here?", "assistant", "look", '{"x":1}', "tool", "a cat",
        '[{"type":"function","function":{"name":"look"}}]',
    ]  # fmt: skip
    assert tokens == 4 * 3 + 3
    assert max(map(len, texts)) < 100


# --- tokenizers: never a download, one warning where one is missing --------------------------------------


@contextlib.contextmanager
def no_download(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """tiktoken's fetch, made to fail loudly and to say it was tried."""
    import tiktoken.load

    tried: list[str] = []

    def refuse(blobpath: str) -> bytes:
        tried.append(blobpath)
        raise AssertionError(f"tiktoken was asked to download {blobpath}")

    monkeypatch.setattr(tiktoken.load, "read_file", refuse)
    yield tried


def test_a_tiktoken_encoding_not_on_this_machine_falls_back_with_one_warning_and_no_download(
    server: SimulatedServer, captured: Captured, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:  # fmt: skip
    pytest.importorskip("tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # an empty cache, whatever this machine holds
    with no_download(monkeypatch) as tried, caplog.at_level(logging.WARNING, logger="llmspans"):
        for _ in range(2):  # two clients naming it: one warning
            call(
                "openai.OpenAI",
                server,
                chat("hello"),
                max_prompt_tokens=100,
                prompt_tokenizer="tiktoken:o200k_base",
            )
    assert tried == []
    warnings = [
        record.getMessage() for record in caplog.records if "tiktoken:o200k_base" in record.getMessage()
    ]
    assert len(warnings) == 1
    assert "never downloads" in warnings[0]
    assert "characters/4" in warnings[0]
    assert {span.attributes[names.PROMPT_ESTIMATOR] for span in call_spans(captured)} == {
        names.ESTIMATOR_CHARS
    }


def test_by_default_an_openai_model_tiktoken_cannot_load_here_is_estimated_as_characters(
    server: SimulatedServer, captured: Captured, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:  # fmt: skip
    pytest.importorskip("tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with no_download(monkeypatch) as tried, caplog.at_level(logging.WARNING, logger="llmspans"):
        call("openai.OpenAI", server, chat("hello", model="gpt-4o-mini"), max_prompt_tokens=100)
        assert _prompt.loaded("gpt-4o-mini", timeout=30)
        call("openai.OpenAI", server, chat("hello", model="gpt-4o-mini"), max_prompt_tokens=100)
    assert tried == []
    assert [span.attributes[names.PROMPT_ESTIMATOR] for span in call_spans(captured)] == [
        names.ESTIMATOR_CHARS
    ] * 2
    assert len([r for r in caplog.records if "tiktoken:o200k_base" in r.getMessage()]) == 1


def test_by_default_tiktoken_counts_the_models_it_knows_once_loaded_off_the_request_path(
    server: SimulatedServer, captured: Captured, bpe: Any
) -> None:
    """The first capped call naming a model starts loading its encoding in the background and goes on with
    characters/4 (held here until that call is over, so the order is certain); later calls use it."""
    pytest.importorskip("tiktoken")
    release = threading.Event()
    build = tiktoken_constructor(bpe, STUB_ENCODING)

    def slow_constructor() -> dict[str, Any]:
        assert release.wait(30)
        return build()

    content = sample_text(3000)
    with registered_tiktoken(slow_constructor, STUB_ENCODING, STUB_MODEL):
        call("httpx.Client", server, chat(content, model=STUB_MODEL), max_prompt_tokens=10_000)
        release.set()
        assert _prompt.loaded(STUB_MODEL, timeout=30)
        call("httpx.Client", server, chat(content, model=STUB_MODEL), max_prompt_tokens=10_000)
        call("httpx.Client", server, chat(content, model="sim-model"), max_prompt_tokens=10_000)
        assert _prompt.loaded("sim-model", timeout=30)  # a model tiktoken does not know: characters/4
        call("httpx.Client", server, chat(content, model="sim-model"), max_prompt_tokens=10_000)
        encoding = as_tiktoken(bpe, STUB_ENCODING)
    first, second, unknown, unknown_again = call_spans(captured)
    assert first.attributes[names.PROMPT_ESTIMATOR] == names.ESTIMATOR_CHARS
    assert first.attributes[names.PROMPT_ESTIMATED_TOKENS] == hand_count(content)
    assert second.attributes[names.PROMPT_ESTIMATOR] == f"tiktoken:{STUB_ENCODING}"
    assert second.attributes[names.PROMPT_ESTIMATED_TOKENS] == (
        len(encoding.encode_ordinary("user")) + len(encoding.encode_ordinary(content)) + 6
    )
    assert unknown.attributes[names.PROMPT_ESTIMATOR] == names.ESTIMATOR_CHARS
    assert unknown_again.attributes[names.PROMPT_ESTIMATOR] == names.ESTIMATOR_CHARS


def test_a_hugging_face_tokenizer_by_a_name_not_in_the_cache_falls_back_with_one_warning(
    server: SimulatedServer, captured: Captured, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="llmspans"):
        for kind in ("openai.OpenAI", "httpx.Client"):
            call(
                kind,
                server,
                chat("hello"),
                max_prompt_tokens=100,
                prompt_tokenizer="hf:llmspans-test/not-here",
            )
    warnings = [r.getMessage() for r in caplog.records if "hf:llmspans-test/not-here" in r.getMessage()]
    assert len(warnings) == 1
    assert "Hugging Face cache" in warnings[0]
    assert {span.attributes[names.PROMPT_ESTIMATOR] for span in call_spans(captured)} == {
        names.ESTIMATOR_CHARS
    }


def test_a_hugging_face_tokenizer_is_found_by_its_file_or_its_directory(
    server: SimulatedServer, captured: Captured, bpe: Any, bpe_dir: Path
) -> None:
    for spec in (f"hf:{bpe_dir}", f"hf:{bpe_dir / 'tokenizer.json'}"):
        call(
            "httpx.Client", server, chat("the quick brown fox"), max_prompt_tokens=100, prompt_tokenizer=spec
        )
    expected = (
        sum(len(bpe.encode(text, add_special_tokens=False).ids) for text in ("user", "the quick brown fox"))
        + 6
    )
    assert [span.attributes[names.PROMPT_ESTIMATED_TOKENS] for span in call_spans(captured)] == [expected] * 2


# --- arguments --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "error", "says"),
    [
        ({"max_prompt_tokens": 0}, ValueError, "max_prompt_tokens=8000"),
        ({"max_prompt_tokens": -5}, ValueError, "positive"),
        ({"max_prompt_tokens": "8000"}, TypeError, "whole number"),
        ({"max_prompt_tokens": 8000.0}, TypeError, "whole number"),
        ({"max_prompt_tokens": True}, TypeError, "whole number"),
        ({"max_prompt_tokens": 100, "on_exceed": "drop"}, ValueError, "'record'"),
        ({"max_prompt_tokens": 100, "on_exceed": "cancel"}, ValueError, "'error'"),
        ({"on_exceed": "error"}, ValueError, "pass max_prompt_tokens=N"),
        ({"prompt_tokenizer": "chars"}, ValueError, "pass max_prompt_tokens=N"),
        ({"max_prompt_tokens": 100, "prompt_tokenizer": "spacy"}, ValueError, "'hf:<name or local path>'"),
        ({"max_prompt_tokens": 100, "prompt_tokenizer": "hf:"}, ValueError, "'tiktoken:<encoding>'"),
        ({"max_prompt_tokens": 100, "prompt_tokenizer": 3}, ValueError, "prompt_tokenizer must be"),
    ],
)
def test_bad_prompt_cap_arguments_say_what_to_pass(arguments: dict[str, Any], error: type, says: str) -> None:
    for target in (openai.OpenAI(api_key="k"), httpx.Client(), openai.OpenAI):
        with pytest.raises(error, match=says.replace("(", r"\(").replace("*", r"\*")):
            llmspans.instrument(target, **arguments)
    with pytest.raises(error):
        llmspans.instrument_all(**arguments)
    assert not llmspans.uninstrument_all()  # nothing was left half-done


def test_class_level_and_instrument_all_pass_the_cap_through(
    server: SimulatedServer, captured: Captured
) -> None:
    llmspans.instrument_all(max_prompt_tokens=20, on_exceed="error")
    client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
    with pytest.raises(llmspans.PromptTooLarge):
        client.chat.completions.create(**chat(sample_text(400)))
    client.chat.completions.create(**chat("short"))
    refused, answered = call_spans(captured)
    assert refused.attributes[names.ERROR_TYPE] == names.ERROR_PROMPT_TOO_LARGE
    assert answered.attributes[names.PROMPT_OVER_CAP] is False
    assert len(server.requests) == 1


# --- a real server's own tokenizer ---------------------------------------------------------------------


def test_a_real_servers_own_tokenizer_estimates_its_prompt_to_within_the_chat_template(
    transformers_serve: Any, captured: Captured
) -> None:
    """`transformers serve` counts the prompt after its chat template; the estimate, with the model's own
    tokenizer.json, counts the message and OpenAI's 3 + 3 in its place: a few tokens apart at most."""
    client = llmspans.instrument(
        openai.OpenAI(base_url=transformers_serve.base_url, api_key="x", max_retries=0),
        max_prompt_tokens=100_000, prompt_tokenizer=f"hf:{transformers_serve.model}",
    )  # fmt: skip
    content = sample_text(2000, seed=11)
    result = client.chat.completions.create(
        model=transformers_serve.model,
        messages=[{"role": "user", "content": content}],
        max_tokens=2,
        temperature=0,
    )
    (span,) = call_spans(captured)
    estimated = span.attributes[names.PROMPT_ESTIMATED_TOKENS]
    reported = result.usage.prompt_tokens
    assert span.attributes[names.GEN_AI_USAGE_INPUT_TOKENS] == reported
    assert reported > 300  # a prompt long enough for the template's few tokens to be a small share
    assert abs(estimated - reported) <= 8, (estimated, reported)
    assert span.attributes[names.PROMPT_ESTIMATE_RATIO] == pytest.approx(estimated / reported, abs=1e-12)
