"""The server split of first_token and stream (llmspans/report/_vllm_split.py), by arithmetic and on every
vLLM family: real calls through the instrumented openai client against the simulator, whose server
spans come back over OTLP/HTTP; each part is compared with what the simulator was told to do."""

from __future__ import annotations

import threading
from typing import Any

import openai
import pytest

import llmspans
from llmspans import _names as names
from llmspans.report._vllm_split import (
    ENGINE_NEWER,
    ENGINE_OLDER,
    NETWORK_AND_CLIENT,
    NOTE_PREFILL_DERIVED,
    PREFILL,
    SERVER_DECODE,
    SERVER_FRONT_END,
    SERVER_QUEUE,
    ServerSplit,
    by_part,
    split,
)
from llmspans.testing import Captured
from tests.support.vllm_sim import FAMILIES, EngineConfig, OTLPReceiver, VLLMSimulator
from tests.test_vllm import MODEL, TOLERANCE, ask, call_spans, receiver, server_spans
from tests.timing import retry_timing

__all__ = ["receiver"]  # the fixture, imported for this module's tests

NEWER_SPAN = {
    names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.30,
    names.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.10,
    names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.15,
    names.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: 0.50,
    names.GEN_AI_LATENCY_E2E: 0.81,
}
OLDER_SPAN = {
    names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.30,
    names.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.12,  # from the arrival: the front end is inside
    names.GEN_AI_LATENCY_E2E: 0.80,
    names.GEN_AI_LATENCY_TIME_IN_SCHEDULER: 0.004,
}
BUCKETS = {"first_token": 0.32, "stream": 0.53}


def names_and_seconds(parts: Any) -> list[tuple[str, float]]:
    return [(part.name, pytest.approx(part.seconds)) for part in parts]


def split_streamed(span: Any, engine: str, prefill: float, front_end: float, queue: float) -> Any:
    """The streamed call's split of BUCKETS by `span`: made by `engine`, first token in queue, prefill,
    front end and the 0.02 s left to network and client, and the stream in 0.50 s decode and 0.03 s left."""
    result = split(span, BUCKETS, streamed=True)
    assert result is not None
    assert result.engine == engine
    assert names_and_seconds(result.first_token) == [
        (SERVER_QUEUE, queue), (PREFILL, prefill), (SERVER_FRONT_END, front_end), (NETWORK_AND_CLIENT, 0.02),
    ]  # fmt: skip
    assert names_and_seconds(result.stream) == [(SERVER_DECODE, 0.50), (NETWORK_AND_CLIENT, 0.03)]
    return result


def test_the_newer_engine_splits_with_its_own_prefill_and_decode() -> None:
    result = split_streamed(NEWER_SPAN, ENGINE_NEWER, prefill=0.15, front_end=0.05, queue=0.10)
    assert [part.derived for part in result.first_token] == [False, False, True, True]
    assert result.notes == ()
    assert sum(part.seconds for part in result.first_token) == BUCKETS["first_token"]
    assert sum(part.seconds for part in result.stream) == pytest.approx(BUCKETS["stream"], abs=1e-15)


def test_the_older_engine_derives_prefill_and_decode_and_says_so() -> None:
    result = split_streamed(OLDER_SPAN, ENGINE_OLDER, prefill=0.18, front_end=0.0, queue=0.12)
    assert [part.derived for part in result.first_token] == [False, True, True, True]
    assert result.stream[0].derived
    assert NOTE_PREFILL_DERIVED in result.notes
    assert len(result.notes) == 3
    assert result.time_in_scheduler == 0.004
    assert result.time_in_model_execute is None


def test_a_call_that_did_not_stream_has_the_decode_inside_first_token() -> None:
    """The body arrives after the front end handled the last token (e2e): network and client is what
    follows e2e, and the front end is the rest of e2e that the engine did not queue, prefill or decode."""
    result = split(NEWER_SPAN, {"first_token": 0.84, "stream": 0.0}, streamed=False)
    assert result is not None
    assert names_and_seconds(result.first_token) == [
        (SERVER_QUEUE, 0.10), (PREFILL, 0.15), (SERVER_FRONT_END, 0.81 - 0.10 - 0.15 - 0.50),
        (SERVER_DECODE, 0.50), (NETWORK_AND_CLIENT, 0.84 - 0.81),
    ]  # fmt: skip
    assert sum(part.seconds for part in result.first_token) == pytest.approx(0.84, abs=1e-15)
    assert result.stream == ()
    older = split(OLDER_SPAN, {"first_token": 0.84, "stream": 0.0}, streamed=False)
    assert older is not None
    assert names_and_seconds(older.first_token) == [
        (SERVER_QUEUE, 0.12), (PREFILL, 0.18), (SERVER_FRONT_END, 0.0), (SERVER_DECODE, 0.50),
        (NETWORK_AND_CLIENT, 0.84 - 0.80),
    ]  # fmt: skip


def test_a_span_without_the_figures_every_release_has_gives_no_split() -> None:
    assert split({names.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.1}, BUCKETS, streamed=True) is None
    assert split({names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: "0.3", names.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.1}, BUCKETS, streamed=True) is None  # fmt: skip
    no_e2e = {k: v for k, v in OLDER_SPAN.items() if k != names.GEN_AI_LATENCY_E2E}
    result = split(no_e2e, BUCKETS, streamed=True)
    assert result is not None
    assert result.stream == ()  # nothing to split the stream with


def test_by_part_gathers_each_part_across_calls() -> None:
    splits = [
        s for s in (split(NEWER_SPAN, BUCKETS, streamed=True), split(OLDER_SPAN, BUCKETS, streamed=True)) if s
    ]
    gathered = by_part(splits, "first_token")
    assert list(gathered) == [SERVER_QUEUE, PREFILL, SERVER_FRONT_END, NETWORK_AND_CLIENT]
    assert gathered[SERVER_QUEUE] == [0.10, 0.12]
    assert by_part(splits, "stream")[SERVER_DECODE] == pytest.approx([0.50, 0.50])


# --- on every family, against the simulator ---------------------------------------------------------


def one_split(captured: Captured, server_attributes: dict[str, Any], request_id: str) -> ServerSplit:
    (call,) = [s for s in call_spans(captured) if s.attributes[names.GEN_AI_RESPONSE_ID] == request_id]
    attributes = call.attributes
    buckets = {bucket: attributes[names.BUCKET_PREFIX + bucket] for bucket in ("first_token", "stream")}
    result = split(server_attributes, buckets, streamed=True)
    assert result is not None
    assert sum(p.seconds for p in result.first_token) == pytest.approx(buckets["first_token"], abs=1e-12)
    assert sum(p.seconds for p in result.stream) == pytest.approx(buckets["stream"], abs=1e-12)
    return result


@retry_timing
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_split_is_right_on_every_family(family: str, receiver: OTLPReceiver, captured: Captured) -> None:
    """Two streamed calls on a one-slot server: the second queues behind the first. Each part matches
    what the simulator did: its queue, prefill (4 prompt words), front end and decode; what is left
    for the network and the client on 127.0.0.1 is small."""
    config = EngineConfig(
        version=FAMILIES[family], max_num_seqs=1, frontend_delay=0.015, prefill_per_token=0.005,
        decode_per_token=0.01, enable_prefix_caching=False,
    )  # fmt: skip
    with VLLMSimulator(config, otlp_traces_endpoint=receiver.traces_url) as sim:
        client = llmspans.instrument(
            openai.OpenAI(base_url=sim.base_url, api_key="sk-test", max_retries=0), provider="vllm"
        )
        client.models.list()  # not an LLM call: warms the client's code paths

        def call() -> None:
            for _ in client.chat.completions.create(model=MODEL, messages=ask(), stream=True, max_tokens=5):
                pass

        threads = [threading.Thread(target=call) for _ in range(2)]
        for sent, thread in enumerate(threads, 1):
            thread.start()
            assert sim.wait_for_state(lambda waiting, running, n=sent: waiting + running >= n)
        for thread in threads:
            thread.join(10)
        spans = server_spans(sim, receiver, 2)
        records = {r.request_id: r for r in sim.requests}
    older = family in ("0.8/0.9", "0.10")
    for span in spans:
        r = records[span.attributes[names.GEN_AI_REQUEST_ID]]
        result = one_split(captured, span.attributes, r.request_id)
        assert result.engine == (ENGINE_OLDER if older else ENGINE_NEWER)
        assert r.scheduled_ts is not None
        assert r.queued_ts is not None
        front_end = r.queued_ts - r.arrival
        queue = result.seconds("first_token", SERVER_QUEUE)
        assert queue == pytest.approx(r.scheduled_ts - (r.arrival if older else r.queued_ts), abs=1e-9)
        prefill = result.seconds("first_token", PREFILL)
        assert prefill is not None
        assert 4 * 0.005 - 0.001 <= prefill <= 4 * 0.005 + TOLERANCE
        expected_front_end = 0.0 if older else front_end
        assert result.seconds("first_token", SERVER_FRONT_END) == pytest.approx(expected_front_end, abs=1e-9)
        decode = result.seconds("stream", SERVER_DECODE)
        assert decode is not None
        assert 4 * 0.01 - 0.001 <= decode <= 4 * 0.01 + TOLERANCE
        before_first = result.seconds("first_token", NETWORK_AND_CLIENT)
        after_first = result.seconds("stream", NETWORK_AND_CLIENT)
        assert before_first is not None
        assert after_first is not None
        assert -0.001 <= before_first <= TOLERANCE
        # A first chunk read late (a busy machine) moves that time from stream into first_token: the
        # stream's residual can go below zero by as much as first_token's holds, never more.
        assert -before_first - 0.001 <= after_first <= TOLERANCE, (before_first, after_first)
    queues = sorted(s.attributes[names.GEN_AI_LATENCY_TIME_IN_QUEUE] for s in spans)
    assert queues[1] > 0.01  # the second call waited while the first was served


# --- the report uses the split, on every family -----------------------------------------------------


def _otlp_server_span(span: Any) -> dict[str, Any]:
    """A received `llm_request` span back in the OTLP JSON encoding the report reads."""
    from tests.test_report import _value as value

    return {
        "traceId": span.trace_id, "spanId": span.span_id, "parentSpanId": span.parent_span_id or "",
        "name": span.name, "kind": span.kind, "startTimeUnixNano": str(span.start_ns),
        "endTimeUnixNano": str(span.end_ns),
        "attributes": [{"key": key, "value": value(raw)} for key, raw in span.attributes.items()],
    }  # fmt: skip


@retry_timing
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_report_splits_first_token_and_stream_on_every_family(
    family: str, receiver: OTLPReceiver, captured: Captured, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The client's spans and vLLM's in one file, as a collector would write them: `llmspans report` splits
    first_token into server queue, prefill, front end and network, and stream into decode and network, on
    every release; where the older engine lacks prefill and decode it derives them and says so."""
    import json

    from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans

    from llmspans.__main__ import main

    config = EngineConfig(
        version=FAMILIES[family], frontend_delay=0.015, prefill_per_token=0.005, decode_per_token=0.01,
        enable_prefix_caching=False,
    )  # fmt: skip
    with VLLMSimulator(config, otlp_traces_endpoint=receiver.traces_url) as sim:
        client = llmspans.instrument(
            openai.OpenAI(base_url=sim.base_url, api_key="x", max_retries=0), provider="vllm"
        )
        for _ in range(3):
            for _ in client.chat.completions.create(model=MODEL, messages=ask(), stream=True, max_tokens=5):
                pass
        server = server_spans(sim, receiver, 3)
    document = encode_spans(captured.spans).to_dict()
    document["resourceSpans"].append(
        {"scopeSpans": [{"spans": [_otlp_server_span(span) for span in server]}]}
    )
    spans_file = tmp_path / "spans.jsonl"
    spans_file.write_text(json.dumps(document) + "\n")
    assert main(["report", str(spans_file), "--json"]) == 0
    split_report = json.loads(capsys.readouterr().out)["server"]
    older = family in ("0.8/0.9", "0.10")
    assert split_report["calls"] == split_report["streamed_calls"] == 3
    assert split_report["engines"] == ["older" if older else "newer"]
    assert 4 * 0.005 - 0.001 <= split_report["prefill"]["p50"] <= 4 * 0.005 + TOLERANCE
    assert 4 * 0.01 - 0.001 <= split_report["server_decode"]["p50"] <= 4 * 0.01 + TOLERANCE
    assert -0.001 <= split_report["network_and_client"]["p50"] <= TOLERANCE
    if older:  # the front end is inside the older engine's queue time, and prefill and decode are derived
        assert split_report["server_front_end"]["p50"] == 0
        assert any("prefill derived" in note for note in split_report["notes"])
        assert any("decode derived" in note for note in split_report["notes"])
    else:
        assert 0.015 - 0.001 <= split_report["server_front_end"]["p50"] <= 0.015 + TOLERANCE
        assert split_report["notes"] == []
    page = tmp_path / "report.html"
    assert main(["report", str(spans_file), "--html", str(page)]) == 0
    text = capsys.readouterr().out
    assert "stream split by the same spans (3 streamed calls)" in text
    assert ("note: prefill derived" in text) is older
    html = page.read_text()
    assert '<section id="server">' in html
    assert "server decode" in html
    assert ("prefill derived" in html) is older
