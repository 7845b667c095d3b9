"""`llmspans load --replay`: a recorded run sent again, call by call, against the shipped simulator with capacity.

A real `llmspans demo` run is recorded once (a subprocess writing the embedded default's traces file), and
an agent app's turns of three chained calls once (in this process, through the same file exporter); both
are replayed over real HTTP against `SimulatedServer(capacity=...)`, whose engine has a prefix cache.
Nothing here is timed against the clock: the schedule is checked as computed (offsets, order, counts), the
lag as measured, and the server's own counters say what reached its prefix cache.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import llmspans
from llmspans import _exporters, _telemetry
from llmspans import _names as names
from llmspans.__main__ import main
from llmspans.load._cli import build_result
from llmspans.load._html import render as render_html
from llmspans.load._model import SHAPE_SPEED, Result
from llmspans.load._replay import Recording, read_recording, recording_lines
from llmspans.load._replay_probe import probe
from llmspans.load._replay_table import compare
from llmspans.load._replay_workload import (
    RULE_CACHED,
    RULE_CONVERSATION,
    RULE_TURN,
    Assumptions,
    Built,
    ServerFacts,
    build_workload,
    deal_replay,
    prefix_partners,
)
from llmspans.load._requests import RequestRecord
from llmspans.load._runner import Runner, RunOutcome
from llmspans.load._text import render as render_text
from llmspans.load._workers import WorkerExport
from llmspans.load._workload import Plan, captured_prompts, parse_levels
from llmspans.report._sources import MemorySource
from llmspans.report._sources.file import FileSource
from llmspans.report._sources.jaeger import fetch_jaeger
from llmspans.report._sources.tempo import fetch_tempo
from llmspans.report._spans import spans_of_document
from llmspans.tools.capacity import Capacity
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.local_http import serving
from tests.support.tempo import tempo_server
from tests.support.vllm_sim import EngineConfig, VLLMSimulator
from tests.test_load import providers
from tests.test_report import JAEGER_RESPONSE, _Jaeger
from tests.test_report import RECORDED as JAEGER_RECORDED
from tests.test_report import SERVICE as JAEGER_SERVICE

DEMO_TURNS = 12
DEMO_SERVICE = "llmspans-demo-healthy"
AGENT_SERVICE = "agent-app"
SYSTEM_WORDS = 40  # the agent's system prompt: shared by every call of a turn
CAPACITY = Capacity(slots=4, prefill_per_token=0.0005, decode_per_token=0.004, model="sim-model")


@dataclass
class Replayed:
    recording: Recording
    built: Built
    outcome: RunOutcome
    result: Result
    spans: list[ReadableSpan]

    def records(self, speed: float) -> list[RequestRecord]:
        return self.outcome.records[f"speed={speed:g}"]


# --- recordings -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `llmspans demo` run (12 chat turns, 4 users), as the embedded default wrote it."""
    path = tmp_path_factory.mktemp("demo") / "traces.jsonl"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "LLMSPANS_"))}
    env[names.ENV_TRACES_FILE] = str(path)
    done = subprocess.run(
        [sys.executable, "-m", "llmspans", "demo", "--requests", str(DEMO_TURNS), "--json"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return path


@pytest.fixture(scope="module")
def agent_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An agent app's turns: each calls the model three times, every call re-sending the conversation so far
    (the system prompt, the question, each answer and tool result): recorded on a server without a cache,
    with content capture on."""
    path = tmp_path_factory.mktemp("agent") / "traces.jsonl"
    span_exporter, _ = _exporters.file_exporters(path)
    tracer_provider = TracerProvider(resource=_telemetry_resource(AGENT_SERVICE))
    tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    system = " ".join(f"rule{n}" for n in range(SYSTEM_WORDS))
    with (
        SimulatedServer(Behavior(chunks=6, chunk_gap=0.002), record=False) as server,
        _telemetry.use_providers(tracer_provider, _meter_provider()),
        httpx.Client(base_url=server.base_url, timeout=10) as plain,
    ):
        client = llmspans.instrument(
            plain, capture_content=True
        )  # for --prompts-from; a replay reads none else
        for turn in range(4):
            with llmspans.turn("agent"):
                messages = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"question {turn} about the order status please"},
                ]
                for step in range(3):
                    answer = _chat(client, messages)
                    messages += [
                        {"role": "assistant", "content": answer},
                        {"role": "tool", "content": f"tool result {turn} {step} shipped yesterday"},
                    ]
    tracer_provider.shutdown()
    return path


def _telemetry_resource(service: str) -> Any:
    from opentelemetry.sdk.resources import Resource

    return Resource.create({"service.name": service})


def _meter_provider() -> Any:
    from opentelemetry.sdk.metrics import MeterProvider

    return MeterProvider()


def _chat(client: httpx.Client, messages: list[dict[str, str]]) -> str:
    body = {
        "model": "sim-model",
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts = []
    with client.stream("POST", "/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                parts.append((choices[0].get("delta") or {}).get("content") or "")
    return "".join(parts)


# --- replays ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def capacity_server() -> Iterator[SimulatedServer]:
    with SimulatedServer(record=False, capacity=CAPACITY) as server:
        yield server


async def replay(
    recording: Recording, server: SimulatedServer, speeds: str, *, seed: int = 7, shared_prefixes: bool = True,
    facts: ServerFacts | None = None, captured: dict[tuple[str, str], Any] | None = None,
) -> Replayed:  # fmt: skip
    facts = facts or probe(server.base_url, "sim-model", ["chat"])
    built = build_workload(
        recording, model="sim-model", facts=facts, seed=seed, prompt_tokens=32, max_tokens=16,
        shared_prefixes=shared_prefixes, captured=captured, captured_source="the recording",
    )  # fmt: skip
    plan = Plan(
        shape=SHAPE_SPEED, levels=parse_levels(speeds, SHAPE_SPEED), requests_per_level=len(recording.calls),
        level_seconds=60, max_seconds=60,
    )  # fmt: skip
    with providers() as (tracer_provider, exporter):
        runner = Runner(
            built.workload, plan, base_url=server.base_url, tracer_provider=tracer_provider, max_retries=0
        )
        outcome = await runner.run()
        spans = list(exporter.get_finished_spans())
    result = build_result(
        outcome.levels, workload=built.workload, plan=plan, target=server.base_url, run_id=runner.run_id,
        interrupted=False, notes=outcome.notes,
        replay=compare(recording, outcome.records, [*recording_lines(recording), *built.assumptions]),
    )  # fmt: skip
    assert all(stats.completed == stats.requests for stats in outcome.levels), render_text(result)
    return Replayed(recording, built, outcome, result, spans)


@pytest.fixture(scope="module")
def demo_recording(demo_file: Path) -> Recording:
    return read_recording(
        FileSource([demo_file], progress=False), label=str(demo_file), service=None, window_s=None
    )


@pytest.fixture(scope="module")
def demo_replayed(demo_recording: Recording, capacity_server: SimulatedServer) -> Replayed:
    return asyncio.run(replay(demo_recording, capacity_server, "1,2"))


# --- the demo replayed ----------------------------------------------------------------------------------


def test_a_demo_replayed_at_1x_sends_each_recorded_call_once_at_its_offset_with_its_token_counts(
    demo_replayed: Replayed,
) -> None:
    recording, records = demo_replayed.recording, demo_replayed.records(1)
    calls = recording.calls
    assert len(calls) == DEMO_TURNS  # one LLM call a turn
    assert len(records) == len(calls)
    count = len(calls)
    sent = sorted(records, key=lambda record: record.issued_ns)
    # each call once, in the recorded order (the demo's turns are one call each: every call starts a turn)
    assert [record.index % count for record in sent] == list(range(count))
    assert all(call.after is None for call in calls)
    # at the recorded offsets: the schedule is the recording's, to the nanosecond (what was sent when is
    # the lag, measured, not assumed)
    start = sent[0].scheduled_ns
    assert start is not None
    for record in sent:
        call = calls[record.index % count]
        assert record.scheduled_ns == start + call.offset_ns
        assert record.issued_ns >= record.scheduled_ns
    # the same token counts, request by request: the server's usage of the replay against the recording's
    for record in records:
        call = calls[record.index % count]
        assert (record.input_tokens, record.output_tokens) == (call.input_tokens, call.output_tokens)
    tokens = demo_replayed.result.replay.tokens  # type: ignore[union-attr]
    assert tokens is not None
    assert (tokens.compared_input, tokens.input_exact, tokens.output_exact) == (count, count, count)


def test_each_replayed_span_names_its_source_and_the_recorded_call_beside_which_it_goes(
    demo_replayed: Replayed, demo_file: Path
) -> None:
    recorded = {(call.trace_id, call.span_id) for call in demo_replayed.recording.calls}
    calls = [
        span for span in demo_replayed.spans if (span.attributes or {}).get(names.STAGE) == names.STAGE_LLM
    ]
    assert len(calls) == 2 * DEMO_TURNS
    for span in calls:
        attributes = span.attributes or {}
        assert attributes[names.LOAD_REPLAY_SOURCE] == str(demo_file)
        assert (attributes[names.LOAD_REPLAY_TRACE_ID], attributes[names.LOAD_REPLAY_SPAN_ID]) in recorded
        assert attributes[names.LOAD_LEVEL] in ("speed=1", "speed=2")


def test_at_2x_speed_the_schedule_sends_the_same_calls_at_twice_the_rate(demo_replayed: Replayed) -> None:
    one, two = demo_replayed.records(1), demo_replayed.records(2)
    assert len(one) == len(two) == DEMO_TURNS

    def due_span(records: list[RequestRecord]) -> int:
        due = [record.scheduled_ns for record in records if record.scheduled_ns is not None]
        return max(due) - min(due)

    recorded_span = demo_replayed.recording.span_ns
    assert due_span(one) == recorded_span
    assert abs(due_span(two) - recorded_span / 2) <= DEMO_TURNS  # a nanosecond of rounding per call
    # The rate the requests went out at: the schedule's, moved by at most the lag each level measured.
    rates = []
    for records in (one, two):
        issued = sorted(record.issued_ns for record in records)
        lags = [
            record.issued_ns - record.scheduled_ns for record in records if record.scheduled_ns is not None
        ]
        span = due_span(records)
        low, high = span - max(lags), span + max(lags)
        assert low <= issued[-1] - issued[0] <= high
        rates.append(((len(records) - 1) / high, (len(records) - 1) / max(low, 1)))
    (one_low, one_high), (two_low, two_high) = rates
    assert two_low / one_high <= 2 <= two_high / one_low
    # and the levels' own throughput, per second of their wall time, grew with it (the server kept up)
    levels = {stats.level.label: stats for stats in demo_replayed.outcome.levels}
    assert levels["speed=2"].requests_per_s > levels["speed=1"].requests_per_s


def test_the_recorded_against_replayed_table_is_first_in_text_json_and_html(demo_replayed: Replayed) -> None:
    result = demo_replayed.result
    replay = result.replay
    assert replay is not None
    assert replay.speed == 1
    assert [row.part for row in replay.rows] == [*names.BUCKETS, names.STAGE_LLM]
    call = replay.rows[-1]
    assert call.recorded_count == call.replayed_count == DEMO_TURNS
    assert call.recorded_p50 > 0
    assert call.replayed_p50 > 0
    assert replay.largest is not None
    assert replay.largest.startswith("largest difference: ")
    # what the replay assumed, one line per cause: the demo's calls say nothing of a shared prefix, and
    # they waited for the app's limiter
    assert any(
        "nothing in the trace shows their prompts sharing a prefix" in line for line in replay.assumptions
    )
    assert any("the app's limiter 'chat'" in line for line in replay.assumptions)

    text = render_text(result)
    table = text.index("Recorded against replayed at 1x speed")
    assert table < text.index("Throughput and errors per level")
    assert "llm (the call)" in text
    assert "largest difference: " in text
    document = json.loads(json.dumps(result.to_dict()))
    rows = document["replay"]["rows"]
    assert [row["part"] for row in rows] == [*names.BUCKETS, names.STAGE_LLM]
    assert rows[-1]["recorded_p95"] == pytest.approx(call.recorded_p95)
    assert document["replay"]["largest"] == replay.largest
    html = render_html(result)
    assert html.index('id="replay"') < html.index('id="latency"')
    assert html.count('class="compared"') == len(names.BUCKETS) + 1
    assert f'data-part="{names.STAGE_LLM}"' in html


# --- structure: turns and shared prefixes ---------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_recording(agent_file: Path) -> Recording:
    return read_recording(
        FileSource([agent_file], progress=False), label=str(agent_file), service=None, window_s=None
    )


def test_a_turns_calls_wait_for_one_another_and_go_in_their_recorded_order(
    agent_recording: Recording,
) -> None:
    calls = agent_recording.calls
    assert len(calls) == 12
    turns: dict[str, list[int]] = {}
    for call in calls:
        turns.setdefault(call.turn, []).append(call.number)
    assert sorted(len(numbers) for numbers in turns.values()) == [3, 3, 3, 3]
    for numbers in turns.values():
        first, second, third = (calls[number] for number in numbers)
        assert first.after is None
        assert (second.after, third.after) == (first.number, second.number)
        assert second.gap_ns == second.start_ns - first.end_ns >= 0


async def test_shared_prefixes_reach_the_simulators_prefix_cache_and_none_without_them(
    agent_recording: Recording,
) -> None:
    hits, expected = {}, {}
    for shared in (True, False):
        with SimulatedServer(record=False, capacity=CAPACITY) as server:
            facts = probe(server.base_url, "sim-model", ["chat"])  # its own requests, before the count
            assert facts.measured
            assert facts.tokens_per_word == 1
            assert facts.ignore_eos  # its /models names the llmspans simulator
            engine = server.engine
            assert engine is not None
            before = engine.counters.values["prefix_hits"]
            replayed = await replay(agent_recording, server, "2", shared_prefixes=shared, facts=facts)
            hits[shared] = engine.counters.values["prefix_hits"] - before
        # What the engine's cache must find: each shared prompt's full blocks of its partner's words (at
        # least one token of a prompt is always computed, as in vLLM).
        block = CAPACITY.block_size
        expected[shared] = sum(
            min(request.prefix_words // block, (request.words - 1) // block) * block
            for request in replayed.built.workload.requests
            if request.prefix_from >= 0
        )
        _sent_in_order_after_their_gaps(agent_recording, replayed.records(2))
    # the second and third call of each turn re-sent the conversation: each shares its predecessor's prompt
    assert hits[True] == expected[True] > 0
    assert hits[False] == expected[False] == 0


def _sent_in_order_after_their_gaps(
    recording: Recording, records: list[RequestRecord], speed: float = 2
) -> None:
    """Each later call of a turn went after the call it waits for was done, plus the recorded gap at `speed`."""
    count = len(recording.calls)
    by_call = {record.index % count: record for record in records}
    assert sorted(by_call) == list(range(count))
    for call in recording.calls:
        if call.after is None:
            continue
        record, before = by_call[call.number], by_call[call.after]
        assert record.scheduled_ns == before.done_ns + round(call.gap_ns / speed)
        assert record.issued_ns >= record.scheduled_ns


async def test_no_content_is_read_unless_prompts_from_asks_and_then_each_call_sends_its_own(
    agent_file: Path, agent_recording: Recording, capacity_server: SimulatedServer
) -> None:
    synthetic = build_workload(
        agent_recording, model="m", facts=ServerFacts(), seed=5, prompt_tokens=8, max_tokens=8
    )
    sent = json.dumps([synthetic.workload.request(index) for index in range(len(agent_recording.calls))])
    assert "rule0" not in sent  # the recorded system prompt: captured in the file, never read without asking
    captured = captured_prompts(str(agent_file))
    assert len(captured) == len(agent_recording.calls)
    replayed = await replay(agent_recording, capacity_server, "4", seed=43, captured=captured)
    count = len(agent_recording.calls)
    for number, call in enumerate(agent_recording.calls):
        assert replayed.built.workload.messages(number) == captured[(call.trace_id, call.span_id)]
    for record in replayed.records(4):  # the recorded words, so the simulator counts the recorded tokens
        assert record.input_tokens == agent_recording.calls[record.index % count].input_tokens


async def test_on_two_worker_processes_each_turn_is_sent_whole_by_one_of_them(
    agent_recording: Recording, capacity_server: SimulatedServer, tmp_path: Path
) -> None:
    built = build_workload(
        agent_recording, model="sim-model", facts=ServerFacts(), seed=44, prompt_tokens=8, max_tokens=8
    )  # fmt: skip
    plan = Plan(
        shape=SHAPE_SPEED, levels=parse_levels("4", SHAPE_SPEED), requests_per_level=len(agent_recording.calls),
        max_seconds=60,
    )  # fmt: skip
    traces = tmp_path / "traces.jsonl"
    with providers() as (tracer_provider, _):
        runner = Runner(
            built.workload, plan, base_url=capacity_server.base_url, tracer_provider=tracer_provider,
            max_retries=0, workers=2, export=WorkerExport("llmspans-load-test", traces),
        )  # fmt: skip
        outcome = await runner.run()
    assert outcome.failure is None
    assert len(outcome.workers) == 2
    (stats,) = outcome.levels
    assert stats.workers == 2
    _sent_in_order_after_their_gaps(agent_recording, outcome.records["speed=4"], speed=4)
    writers: dict[str, set[str]] = {}
    for line in traces.read_text().splitlines():
        for resource in json.loads(line).get("resourceSpans", ()):
            process = {item["key"]: item["value"] for item in resource["resource"]["attributes"]}
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    attributes = {item["key"]: item["value"] for item in span["attributes"]}
                    if names.LOAD_REPLAY_TRACE_ID in attributes:
                        recorded = attributes[names.LOAD_REPLAY_TRACE_ID]["stringValue"]
                        writers.setdefault(recorded, set()).add(process["service.instance.id"]["stringValue"])
    assert len(writers) == 4  # the four turns (one trace each), every one written by a single worker
    assert all(len(processes) == 1 for processes in writers.values())
    assert len(set.union(*writers.values())) == 2


async def test_a_system_prompt_the_recorded_server_found_in_its_cache_is_found_there_again(
    tmp_path: Path,
) -> None:
    """One-call turns sharing a system prompt, recorded against a vLLM-like server that reports the prompt
    tokens its prefix cache held (`--enable-prompt-tokens-details`): the replay's shared prefixes make the
    simulator's cache find exactly as many tokens as the recorded server said it found."""
    path = tmp_path / "recorded.jsonl"
    span_exporter, _ = _exporters.file_exporters(path)
    tracer_provider = TracerProvider(resource=_telemetry_resource("support-bot"))
    tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    config = EngineConfig(
        model="sim-model", enable_prefix_caching=True, enable_prompt_tokens_details=True, prefill_per_token=0.0002,
        decode_per_token=0.001,
    )  # fmt: skip
    system = " ".join(f"policy{n}" for n in range(SYSTEM_WORDS))
    with (
        VLLMSimulator(config) as recorded_server,
        _telemetry.use_providers(tracer_provider, _meter_provider()),
        httpx.Client(base_url=recorded_server.base_url, timeout=10) as plain,
    ):
        client = llmspans.instrument(plain)
        for turn in range(6):
            with llmspans.turn("support"):
                _chat(client, [{"role": "system", "content": system},
                               {"role": "user", "content": f"question {turn} " + "please " * 9}])  # fmt: skip
    tracer_provider.shutdown()
    recording = read_recording(
        FileSource([path], progress=False), label=str(path), service=None, window_s=None
    )
    cached = [call.cached_tokens for call in recording.calls]
    assert cached == [0] + [SYSTEM_WORDS // 16 * 16] * 5  # the recorded server's own words
    with SimulatedServer(record=False, capacity=CAPACITY) as server:
        facts = probe(server.base_url, "sim-model", ["chat"])
        engine = server.engine
        assert engine is not None
        before = engine.counters.values["prefix_hits"]
        replayed = await replay(recording, server, "4", facts=facts)
        hits = engine.counters.values["prefix_hits"] - before
    assert {partner[2] for partner in replayed.built.partners.values()} == {RULE_CACHED}
    assert hits == sum(cached)


def test_each_level_and_each_run_draws_its_own_words_so_no_cache_carries_over(
    agent_recording: Recording,
) -> None:
    """A level's prompts share what the recording shared, and nothing with another level, another run or the
    warm-up request (index 0), which a server's prefix cache would otherwise find again."""

    def prompts(salt: int, first: int) -> list[str]:
        built = build_workload(agent_recording, model="m", facts=ServerFacts(), seed=7, prompt_tokens=8, max_tokens=8,
                               salt=salt)  # fmt: skip
        count = len(agent_recording.calls)
        return [built.workload.messages(first + number)[0]["content"] for number in range(count)]

    count = len(agent_recording.calls)
    level, again, next_level, other_run = (
        prompts(1, count),
        prompts(1, count),
        prompts(1, 2 * count),
        prompts(2, count),
    )
    assert level == again  # the same run: the same requests
    warm_up = prompts(1, 0)[0]

    def heads(texts: list[str]) -> set[tuple[str, ...]]:
        return {tuple(text.split()[:8]) for text in texts}  # 32**8 ways: no two runs' words meet by chance

    for other in (next_level, other_run):
        assert not heads(level) & heads(other)
    assert warm_up not in level
    assert level[1].startswith(
        " ".join(level[0].split()[:20])
    )  # the turn's second call holds the first's prompt


def test_the_prefix_rules_say_who_shared_with_whom() -> None:
    """Rule by rule, on calls as the report's decoder reads them (no server needed)."""
    calls = _recording([
        _call("t1", "a1", 0, 100, input_tokens=50, output_tokens=10, parent="turn1"),
        _call("t1", "a2", 110, 200, input_tokens=70, output_tokens=10, parent="turn1"),  # holds a1 + its answer
        _call("t2", "b1", 120, 150, input_tokens=30, output_tokens=5, conversation="c"),
        _call("t3", "b2", 300, 350, input_tokens=40, output_tokens=5, conversation="c"),  # the next turn of c
        _call("t4", "d1", 400, 450, input_tokens=20, output_tokens=5),
    ]).calls  # fmt: skip
    assumed = Assumptions()
    partners = prefix_partners(calls, assumed)
    by_span = {
        name: call.number
        for call in calls
        for name in ("a1", "a2", "b1", "b2", "d1")
        if call.span_id == _hex(name, 16)
    }
    assert partners[by_span["a2"]] == (by_span["a1"], 50, RULE_TURN)
    assert partners[by_span["b2"]] == (by_span["b1"], 30, RULE_CONVERSATION)
    assert by_span["d1"] not in partners
    lines = assumed.lines()
    assert any("assumed to re-send that conversation" in line for line in lines)
    # where the recorded server reported cached tokens, they decide: of the turn first, else the latest long enough
    cached = _recording([
        _call("t1", "a1", 0, 100, input_tokens=64, output_tokens=10, cached=0),
        _call("t2", "b1", 50, 150, input_tokens=80, output_tokens=10, cached=48),
        _call("t3", "c1", 60, 160, input_tokens=20, output_tokens=10, cached=0),
    ]).calls  # fmt: skip
    partners = prefix_partners(cached, Assumptions())
    assert partners == {1: (0, 48, RULE_CACHED)}


def test_missing_facts_are_assumed_and_said_one_line_per_cause() -> None:
    recording = _recording([
        _call("t1", "a1", 0, 100, input_tokens=None, output_tokens=None, chunks=9),
        _call("t2", "b1", 10, 100, input_tokens=12, output_tokens=None, chunks=None),
        _call("t3", "c1", 20, 100, input_tokens=12, output_tokens=None, chunks=None, operation=None),
    ])  # fmt: skip
    built = build_workload(recording, model="m", facts=ServerFacts(), seed=1, prompt_tokens=33, max_tokens=44)
    requests = built.workload.requests
    assert [request.words for request in requests] == [33, 12, 12]
    assert [request.max_tokens for request in requests] == [9, 44, 44]
    lines = built.assumptions
    first, second = (f"(traces {_hex(trace, 32)[:8]}…" for trace in ("t1", "t2"))
    assert any(line.startswith(f"1 call {first})") and "sent prompts of 33 words" in line for line in lines)
    assert any(line.startswith(f"1 call {first})") and "content chunks" in line for line in lines)
    assert any(
        line.startswith(f"2 calls {second}") and "asked for 44 (--max-tokens)" in line for line in lines
    )
    assert any("sent as chat completions" in line for line in lines)


def test_window_and_limit_bound_the_calls_and_say_so() -> None:
    spans = [_call(f"t{n}", f"s{n}", n * 1_000_000_000, n * 1_000_000_000 + 10, input_tokens=5, output_tokens=5)
             for n in range(10)]  # fmt: skip
    limited = _recording(spans, limit=4)
    assert [call.span_id for call in limited.calls] == [_hex(f"s{n}", 16) for n in range(4)]
    assert limited.cut_by_limit == 6
    windowed = _recording(spans, window_s=2.5)
    assert len(windowed.calls) == 3
    assert windowed.cut_by_window == 7
    assert any("--limit" in line for line in recording_lines(limited))
    mixed = [*spans[:2], {**spans[2], "traceId": _hex("other", 32)}]
    document = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": name}}]},
                                   "scopeSpans": [{"spans": group}]} for name, group in (("a", mixed[:2]), ("b", mixed[2:]))]}  # fmt: skip
    with pytest.raises(
        ValueError, match=r"several services, a \(2 calls\), b \(1 call\): pass --service NAME"
    ):
        read_recording(
            MemorySource(spans_of_document(document) or [], "x"), label="x", service=None, window_s=None
        )
    assert any("--window" in line for line in recording_lines(windowed))


def test_a_turns_calls_stay_on_one_worker_when_a_level_is_dealt() -> None:
    heads = [(10, 100), (11, 200), (13, 300)]
    follows = {12: (11, 5), 14: (12, 7), 15: (13, 1)}
    parts = deal_replay(heads, follows, 2)
    assert parts[0] == (((10, 100), (13, 300)), ((15, 13, 1),))
    assert parts[1] == (((11, 200),), ((12, 11, 5), (14, 12, 7)))


# --- sources ---------------------------------------------------------------------------------------------


async def test_a_replay_from_tempo_reads_the_same_calls_as_the_file_and_sends_them(
    demo_file: Path, demo_recording: Recording, capacity_server: SimulatedServer
) -> None:
    with tempo_server([demo_file]) as tempo:
        url = str(tempo.url)  # type: ignore[attr-defined]
        traces = fetch_tempo(url, DEMO_SERVICE, 3600.0)
        recording = read_recording(traces, label=f"tempo {url}", service=DEMO_SERVICE, window_s=None)
    assert [_essentials(call) for call in recording.calls] == [
        _essentials(call) for call in demo_recording.calls
    ]
    replayed = await replay(recording, capacity_server, "4", seed=41)
    assert len(replayed.records(4)) == DEMO_TURNS
    sources = {(span.attributes or {}).get(names.LOAD_REPLAY_SOURCE) for span in replayed.spans}
    assert f"tempo {url}" in sources


def test_a_replay_from_jaeger_reads_the_same_calls_as_the_file() -> None:
    """The report's Jaeger stand-in answers its recorded page: the same calls as the files it was made of."""
    with serving(_Jaeger, queries=[], body=JAEGER_RESPONSE.read_bytes()) as jaeger:
        url = f"http://127.0.0.1:{jaeger.server_address[1]}"
        source = fetch_jaeger(url, JAEGER_SERVICE, 7200.0)
    from_jaeger = read_recording(source, label=f"jaeger {url}", service=JAEGER_SERVICE, window_s=None)
    from_file = read_recording(
        FileSource(JAEGER_RECORDED, progress=False), label="file", service=JAEGER_SERVICE, window_s=None
    )
    assert len(from_file.calls) == 10
    assert [_essentials(call) for call in from_jaeger.calls] == [
        _essentials(call) for call in from_file.calls
    ]


def _essentials(call: Any) -> tuple[Any, ...]:
    return (
        call.trace_id,
        call.span_id,
        call.offset_ns,
        call.input_tokens,
        call.output_tokens,
        call.after,
        call.stream,
    )


def test_a_file_without_llm_calls_is_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "no-calls.jsonl"
    turn = {"traceId": "1" * 32, "spanId": "2" * 16, "name": "turn chat", "kind": 1, "startTimeUnixNano": "1",
            "endTimeUnixNano": "2", "attributes": [{"key": names.STAGE, "value": {"stringValue": "turn"}}]}  # fmt: skip
    path.write_text(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [turn]}]}]}) + "\n")
    code = main(["load", "http://127.0.0.1:9/v1", "--model", "m", "--replay", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [
        f"llmspans load: {path} holds no LLM call span (llmspans.stage=llm) to replay"
    ]


def test_the_command_replays_a_file_and_prints_the_table_in_json_and_html(
    demo_file: Path, capacity_server: SimulatedServer, tmp_path: Path
) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "LLMSPANS_"))}
    env[names.ENV_TRACES_FILE] = str(tmp_path / "replayed.jsonl")
    page = tmp_path / "replay.html"
    done = subprocess.run(
        [sys.executable, "-m", "llmspans", "load", capacity_server.base_url, "--model", "sim-model", "--replay",
         str(demo_file), "--speed", "1,4", "--limit", "6", "--seed", "99", "--json", "--html", str(page)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert [level["level"]["label"] for level in document["levels"]] == ["speed=1", "speed=4"]
    assert document["replay"]["calls"] == 6  # --limit: the 6 earliest calls
    assert document["replay"]["tokens"]["input_exact"] == 6
    assert 'class="compared"' in page.read_text()
    replayed = [
        span for line in (tmp_path / "replayed.jsonl").read_text().splitlines() if line.strip()
        for resource in json.loads(line).get("resourceSpans", []) for scope in resource["scopeSpans"]
        for span in scope["spans"] if any(item["key"] == names.LOAD_REPLAY_TRACE_ID for item in span["attributes"])
    ]  # fmt: skip
    assert len(replayed) == 2 * 6


# --- helpers ---------------------------------------------------------------------------------------------


def _call(
    trace: str, span: str, start: int, end: int, *, input_tokens: int | None, output_tokens: int | None,
    chunks: int | None = None, cached: int | None = None, conversation: str | None = None,
    parent: str | None = None, operation: str | None = names.OPERATION_CHAT,
) -> dict[str, Any]:  # fmt: skip
    attributes: list[dict[str, Any]] = [{"key": names.STAGE, "value": {"stringValue": names.STAGE_LLM}},
                                        {"key": names.GEN_AI_REQUEST_STREAM, "value": {"boolValue": True}}]  # fmt: skip
    for key, value in (
        (names.GEN_AI_USAGE_INPUT_TOKENS, input_tokens), (names.GEN_AI_USAGE_OUTPUT_TOKENS, output_tokens),
        (names.STREAM_CHUNKS, chunks), (names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, cached),
    ):  # fmt: skip
        if value is not None:
            attributes.append({"key": key, "value": {"intValue": str(value)}})
    if conversation is not None:
        attributes.append({"key": names.GEN_AI_CONVERSATION_ID, "value": {"stringValue": conversation}})
    if operation is not None:
        attributes.append({"key": names.GEN_AI_OPERATION_NAME, "value": {"stringValue": operation}})
    return {
        "traceId": _hex(trace, 32), "spanId": _hex(span, 16), "parentSpanId": _hex(parent, 16) if parent else "",
        "name": "chat m", "kind": 3, "startTimeUnixNano": str(start), "endTimeUnixNano": str(end),
        "attributes": attributes,
    }  # fmt: skip


def _hex(name: str, size: int) -> str:
    return name.encode().hex().ljust(size, "0")[:size]


def _recording(
    spans: Sequence[dict[str, Any]], *, limit: int = 10_000, window_s: float | None = None
) -> Recording:
    parents = {span["parentSpanId"] for span in spans if span["parentSpanId"]}
    turns = [
        {"traceId": next(s["traceId"] for s in spans if s["parentSpanId"] == parent), "spanId": parent,
         "name": "turn", "kind": 1, "startTimeUnixNano": "0", "endTimeUnixNano": "1000",
         "attributes": [{"key": names.STAGE, "value": {"stringValue": names.STAGE_TURN}}]}
        for parent in parents
    ]  # fmt: skip
    document = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "app"}}]},
                                   "scopeSpans": [{"spans": [*spans, *turns]}]}]}  # fmt: skip
    source = MemorySource(spans_of_document(document) or [], "test")
    return read_recording(source, label="test", service=None, window_s=window_s, limit=limit)
