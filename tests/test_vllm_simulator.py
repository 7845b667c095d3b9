"""The simulated vLLM server, release by release: what each family serves and traces, and how its
scheduler behaves under pressure (preemption, the prefix cache, deferred requests, admission control).

The expectations are components.md's "vLLM release families" written out here, so the simulator's
own tables (tests/support/vllm_sim.py `Release`) are checked against them, not against themselves.
Timings are compared with what the scheduler was told to do, within TOLERANCE.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmspans import _names as names
from tests.support.vllm_sim import FAMILIES, EngineConfig, EngineRequest, OTLPReceiver, VLLMSimulator
from tests.test_vllm import MODEL, TOLERANCE, ask, raw_stream, receiver, server_spans, vllm
from tests.timing import retry_timing

__all__ = ["receiver"]  # the fixture, imported for this module's tests


def counter_totals(sim: VLLMSimulator) -> dict[str, float]:
    """The `/metrics` counters, summed over series (family name without `_total`)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(sim.url + "/metrics").text):
        for sample in family.samples:
            if family.type == "counter" and sample.name.endswith("_total"):
                totals[family.name] = totals.get(family.name, 0.0) + sample.value
    return totals


# --- each release family serves what that release serves ------------------------------------------

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
GPU_CACHE, KV_CACHE, BY_REASON = (
    "vllm:gpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_waiting_by_reason",
)
TOKENS = {"vllm:prompt_tokens", "vllm:generation_tokens"}
PREFIX = {"vllm:prefix_cache_queries", "vllm:prefix_cache_hits"}
GPU_PREFIX = {"vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits"}
PREEMPTIONS = {"vllm:num_preemptions"}
NEW_IN_0_32 = {"vllm:prompt_tokens_cached", "vllm:admission_rejections"}
PHASES = {
    "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
}  # fmt: skip
TPOT, ITL = "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"
KV_COMPUTED, REQUEST_PREEMPTIONS = "vllm:request_prefill_kv_computed_tokens", "vllm:request_num_preemptions"
OLDER = {"model_name"}
NEWER = {"model_name", "engine"}

# (family, tracing) -> gauges, counters, histograms, labels: components.md's "vLLM release families"
# written out, so the simulator's own tables are checked against them rather than against themselves.
PAGES: dict[tuple[str, bool], tuple[set[str], set[str], set[str], set[str]]] = {
    ("0.8/0.9", True): ({RUNNING, WAITING, GPU_CACHE}, TOKENS | PREEMPTIONS, PHASES | {TPOT}, OLDER),
    ("0.8/0.9", False): ({RUNNING, WAITING, GPU_CACHE}, TOKENS | GPU_PREFIX, PHASES | {TPOT}, NEWER),
    ("0.10", True): ({RUNNING, WAITING, GPU_CACHE}, TOKENS | PREEMPTIONS, PHASES | {TPOT}, OLDER),
    ("0.10", False): (
        {RUNNING, WAITING, GPU_CACHE, KV_CACHE},
        TOKENS | PREEMPTIONS | PREFIX | GPU_PREFIX,
        PHASES | {TPOT},
        NEWER,
    ),
    ("0.11", True): (
        {RUNNING, WAITING, KV_CACHE},
        TOKENS | PREEMPTIONS | PREFIX,
        PHASES | {TPOT, ITL},
        NEWER,
    ),
    ("0.12/0.13", False): (
        {RUNNING, WAITING, KV_CACHE},
        TOKENS | PREEMPTIONS | PREFIX,
        PHASES | {ITL, KV_COMPUTED},
        NEWER,
    ),
    ("0.32/0.33", False): (
        {RUNNING, WAITING, KV_CACHE, BY_REASON},
        TOKENS | PREEMPTIONS | PREFIX | NEW_IN_0_32,
        PHASES | {ITL, KV_COMPUTED, REQUEST_PREEMPTIONS},
        NEWER,
    ),
}


def page_id(key: tuple[str, bool]) -> str:
    return f"{key[0]}-{'tracing' if key[1] else 'no-tracing'}"


@pytest.mark.parametrize("page", list(PAGES), ids=page_id)
def test_metrics_page_serves_what_the_release_serves(page: tuple[str, bool], receiver: OTLPReceiver) -> None:
    family, tracing = page
    gauges, counters, histograms, labels = PAGES[page]
    with vllm(receiver if tracing else None, version=FAMILIES[family]) as sim:
        raw_stream(sim, {"model": MODEL, "messages": ask(), "stream": True, "max_tokens": 2})
        assert sim.wait_idle()
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(sim.url + "/metrics").text)}
    served = {kind: {n for n, f in families.items() if f.type == kind and not n.endswith("_created")}
              for kind in ("gauge", "counter", "histogram")}  # fmt: skip
    assert served == {"gauge": gauges, "counter": counters, "histogram": histograms}
    for name, metric in families.items():
        for sample in metric.samples:
            # 0.32's admission rejections are counted by the front end: no `engine` label
            expected = labels - {"engine"} if name.startswith("vllm:admission_rejections") else labels
            assert set(sample.labels) - {"le", "reason"} == expected, (name, sample.labels)
    ttft_count = next(
        s for s in families["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")
    )
    assert ttft_count.value == 1


def test_every_family_is_checked() -> None:
    assert {family for family, _ in PAGES} == set(FAMILIES)
    with pytest.raises(ValueError, match="admission control"):
        EngineConfig(version="0.13.0", max_waiting=1)
    with pytest.raises(ValueError, match="a vLLM release"):
        EngineConfig(version="latest")


# --- the server span of each engine --------------------------------------------------------------

COMMON_SPAN = {
    names.GEN_AI_REQUEST_ID, names.GEN_AI_REQUEST_N, names.GEN_AI_REQUEST_TOP_P, names.GEN_AI_REQUEST_MAX_TOKENS,
    names.GEN_AI_USAGE_PROMPT_TOKENS, names.GEN_AI_USAGE_COMPLETION_TOKENS, names.GEN_AI_LATENCY_TIME_IN_QUEUE,
    names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, names.GEN_AI_LATENCY_E2E,
}  # fmt: skip
OLDER_SPAN = COMMON_SPAN | {
    names.GEN_AI_RESPONSE_MODEL, names.GEN_AI_REQUEST_TEMPERATURE, "gen_ai.usage.num_sequences",
    names.GEN_AI_LATENCY_TIME_IN_SCHEDULER, names.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD,
    names.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE,
}  # fmt: skip
NEWER_SPAN = COMMON_SPAN | {
    names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL, names.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE,
    names.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE, names.GEN_AI_RESPONSE_FINISH_REASONS,
}  # fmt: skip
OLDER_ENGINE = {"0.8/0.9", "0.10"}  # with tracing
WITHOUT_FINISH_REASONS = {"0.32/0.33"}  # as a real 0.32's span (tests/test_vllm_real.py)


@retry_timing
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_traces_with_its_engine(family: str, receiver: OTLPReceiver) -> None:
    """0.8 to 0.10 with tracing run the older engine: no prefill, decode, inference or finish
    reasons, the queue time counted from the arrival (the front end included), the scheduler time,
    and (with detailed traces) forward and execute; temperature=0 written as 0. From 0.11 the newer
    engine: prefill and decode, the queue time from when the engine queued the request."""
    config = EngineConfig(
        version=FAMILIES[family], frontend_delay=0.02, prefill_per_token=0.002, decode_per_token=0.01,
        collect_detailed_traces=True,
    )  # fmt: skip
    with VLLMSimulator(config, otlp_traces_endpoint=receiver.traces_url) as sim:
        body = {"model": MODEL, "messages": ask(), "stream": True, "max_tokens": 4, "temperature": 0}
        raw_stream(sim, body)
        (span,) = server_spans(sim, receiver, 1)
        (r,) = sim.requests
    attrs = span.attributes
    assert r.first_token_ts is not None
    assert r.scheduled_ts is not None
    assert r.queued_ts is not None
    assert attrs[names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] == pytest.approx(
        r.first_token_ts - r.arrival, abs=1e-9
    )
    front_end = r.queued_ts - r.arrival
    assert config.frontend_delay - 0.001 <= front_end <= config.frontend_delay + TOLERANCE
    if family in OLDER_ENGINE:
        assert set(attrs) == OLDER_SPAN
        assert attrs[names.GEN_AI_LATENCY_TIME_IN_QUEUE] == pytest.approx(
            r.scheduled_ts - r.arrival, abs=1e-9
        )
        assert attrs[names.GEN_AI_LATENCY_TIME_IN_QUEUE] >= front_end
        assert attrs[names.GEN_AI_REQUEST_TEMPERATURE] == 0.0
        assert attrs[names.GEN_AI_LATENCY_TIME_IN_SCHEDULER] == pytest.approx(4 * config.scheduler_step)
        modelled = 4 * config.prefill_per_token + 3 * config.decode_per_token  # 4 prompt words, 4 tokens
        assert attrs[names.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD] == pytest.approx(modelled)
    else:
        if family in WITHOUT_FINISH_REASONS:
            assert set(attrs) == NEWER_SPAN - {names.GEN_AI_RESPONSE_FINISH_REASONS}
        else:
            assert set(attrs) == NEWER_SPAN
            assert json.loads(attrs[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["length"]
        queue = attrs[names.GEN_AI_LATENCY_TIME_IN_QUEUE]
        assert queue == pytest.approx(r.scheduled_ts - r.queued_ts, abs=1e-9)
        assert queue < 0.002  # the engine was idle: no queue, the front end is not in it
        prefill = attrs[names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL]
        # ttft - queue - prefill is the front end: what the server did before its engine queued the request
        assert attrs[names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] - queue - prefill == pytest.approx(
            front_end, abs=1e-9
        )


@pytest.mark.parametrize("family", ["0.10", "0.12/0.13"], ids=["older-engine", "newer-engine"])
def test_an_aborted_request_makes_no_server_span(family: str, receiver: OTLPReceiver) -> None:
    with vllm(receiver, version=FAMILIES[family], decode_per_token=0.01) as sim:
        body = {"model": MODEL, "messages": ask(), "stream": True, "max_tokens": 30}
        with httpx.stream("POST", sim.base_url + "/chat/completions", json=body, timeout=10) as response:
            for line in response.iter_lines():
                if '"content":"Hello"' in line:
                    break  # the client goes away after the first token
        raw_stream(sim, body | {"max_tokens": 2})
        spans = server_spans(sim, receiver, 1)
        aborted, finished = sim.requests
    assert aborted.finish_reason is None
    assert aborted.generated < 30
    assert [span.attributes[names.GEN_AI_REQUEST_ID] for span in spans] == [finished.request_id]


# --- the scheduler under pressure ----------------------------------------------------------------


def stream_in_threads(sim: VLLMSimulator, bodies: list[dict[str, Any]]) -> list[list[Any]]:
    """Each body streamed from its own (uninstrumented) thread; the events of each. All are queued,
    in order, before the engine admits any: what follows depends on the config, not on how fast a
    busy machine ran the threads."""
    results: list[list[Any]] = [[] for _ in bodies]

    def one(index: int) -> None:
        results[index] = raw_stream(sim, bodies[index])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    with sim.held():
        for queued, thread in enumerate(threads, 1):
            thread.start()  # in order: each reaches the engine's queue before the next is sent
            assert sim.wait_for_state(lambda waiting, running, n=queued: waiting == n, 30.0)
    for thread in threads:
        thread.join(20)
    return results


def content(events: list[Any]) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])


def test_kv_pressure_preempts_the_latest_request_which_recomputes() -> None:
    """Four requests whose caches outgrow the blocks: the latest admitted is preempted, waits at the
    head of the queue, and recomputes its prompt and output before its next token; every answer
    is still whole."""
    config = EngineConfig(
        version=FAMILIES["0.32/0.33"], max_num_seqs=4, block_size=4, num_kv_blocks=8,
        prefill_per_token=0.002, decode_per_token=0.01, enable_prefix_caching=False,
    )  # fmt: skip
    with VLLMSimulator(config) as sim:
        bodies = [
            {"model": MODEL, "messages": ask(f"w{i} x y z"), "stream": True, "max_tokens": 10}
            for i in range(4)
        ]
        results = stream_in_threads(sim, bodies)
        assert sim.wait_idle()
        totals = counter_totals(sim)
        records = sorted(sim.requests, key=lambda r: r.scheduled_ts or 0)
    assert all(content(events) == "Hello, this is a simulated reply.Hello," for events in results)
    preempted = [r for r in records if r.preemptions]
    assert preempted, [r.preemptions for r in records]
    assert records[0].preemptions == 0  # the first admitted is never the one pushed out
    assert totals["vllm:num_preemptions"] == sum(r.preemptions for r in records)
    for r in preempted:
        assert len(r.recomputes) == r.preemptions
        for readmitted, tokens in r.recomputes:
            before = [t for t in r.token_ts if t < readmitted]
            assert tokens == r.prompt_tokens + len(before)  # its prompt and its output so far, again
            after = min(t for t in r.token_ts if t > readmitted)
            assert after >= readmitted + tokens * config.prefill_per_token - 0.001


def test_kv_blocks_gate_admission_first_come_first_served() -> None:
    config = EngineConfig(max_num_seqs=4, block_size=4, num_kv_blocks=4, decode_per_token=0.01)
    with VLLMSimulator(config) as sim:
        long_prompts = [  # different words: no prompt block is shared between them
            {"model": MODEL, "messages": ask(words), "stream": True, "max_tokens": 4}
            for words in ("a b c d e f g h i j k", "l m n o p q r s t u v")
        ]
        short = {"model": MODEL, "messages": ask("a"), "stream": True, "max_tokens": 4}
        stream_in_threads(sim, [*long_prompts, short])
        assert sim.wait_idle()
        first, second, third = sim.requests
    assert first.scheduled_ts is not None
    assert second.scheduled_ts is not None
    assert third.scheduled_ts is not None
    assert first.finished_ts is not None
    # Three blocks each: the second waits for the first to finish, and the short one waits behind it.
    assert second.scheduled_ts >= first.finished_ts - 0.001
    assert third.scheduled_ts >= second.scheduled_ts


@retry_timing
def test_a_shared_prefix_is_not_prefilled_again(receiver: OTLPReceiver) -> None:
    shared = "one two three four five six seven eight"
    config = {"block_size": 4, "prefill_per_token": 0.004, "decode_per_token": 0.005}
    with vllm(receiver, **config) as sim:
        for tail in ("alpha beta gamma delta", "epsilon zeta eta theta"):
            raw_stream(
                sim, {"model": MODEL, "messages": ask(f"{shared} {tail}"), "stream": True, "max_tokens": 2}
            )
        spans = server_spans(sim, receiver, 2)
        totals = counter_totals(sim)
        first, second = sim.requests
    assert (first.cached_tokens, second.cached_tokens) == (0, 8)
    assert totals["vllm:prefix_cache_queries"] == 24
    assert totals["vllm:prefix_cache_hits"] == 8
    by_id = {span.attributes[names.GEN_AI_REQUEST_ID]: span.attributes for span in spans}
    prefill = by_id[second.request_id][names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL]
    assert 4 * 0.004 - 0.001 <= prefill <= 4 * 0.004 + TOLERANCE  # only the 4 words after the shared 8


def test_the_older_engine_has_no_prefix_cache(receiver: OTLPReceiver) -> None:
    prompt = ask("one two three four five six seven eight nine")
    with vllm(receiver, version=FAMILIES["0.10"], block_size=4) as sim:
        for _ in range(2):
            raw_stream(sim, {"model": MODEL, "messages": prompt, "stream": True, "max_tokens": 1})
        assert sim.wait_idle()
    assert [r.cached_tokens for r in sim.requests] == [0, 0]


def busy(sim: VLLMSimulator, max_tokens: int = 20) -> threading.Thread:
    """A request holding the only slot for `max_tokens` decode steps."""
    body = {"model": MODEL, "messages": ask("hold"), "stream": True, "max_tokens": max_tokens}
    thread = threading.Thread(target=raw_stream, args=(sim, body))
    thread.start()
    assert sim.wait_for_state(lambda waiting, running: running == 1)
    return thread


def by_reason(sim: VLLMSimulator) -> dict[str, float]:
    page = text_string_to_metric_families(httpx.get(sim.url + "/metrics").text)
    family = next(f for f in page if f.name == "vllm:num_requests_waiting_by_reason")
    return {s.labels["reason"]: s.value for s in family.samples}


def test_structured_output_waits_deferred_and_lets_others_pass() -> None:
    """A request whose grammar is compiling is skipped by the scheduler (0.32 shows it as
    `deferred`); the plain request behind it is admitted first."""
    config = EngineConfig(
        version=FAMILIES["0.32/0.33"], max_num_seqs=1, decode_per_token=0.01, grammar_compile_time=1.5
    )
    with VLLMSimulator(config) as sim:
        structured = {
            "model": MODEL,
            "messages": ask(),
            "max_tokens": 2,
            "response_format": {"type": "json_object"},
        }
        plain = {"model": MODEL, "messages": ask(), "max_tokens": 2}
        threads = [
            threading.Thread(
                target=httpx.post,
                args=(sim.base_url + "/chat/completions",),
                kwargs={"json": body, "timeout": 10},
            )
            for body in (structured, plain)
        ]
        with sim.held():  # both queue, in order, before the scheduler looks at them
            for queued, thread in enumerate(threads, 1):
                thread.start()
                assert sim.wait_for_state(lambda waiting, running, n=queued: waiting == n, 30.0)
            reasons = by_reason(sim)
        released = time.perf_counter()
        for thread in threads:
            thread.join(10)
        assert sim.wait_idle()
        deferred, passed = sim.requests
    # The scheduler looked while the grammar still compiled (else this run shows nothing: say so).
    assert released < deferred.arrival + config.grammar_compile_time, "the machine stalled for 1.5 s"
    assert reasons == {"capacity": 1.0, "deferred": 1.0}
    assert deferred.scheduled_ts is not None
    assert passed.scheduled_ts is not None
    assert passed.scheduled_ts < deferred.scheduled_ts


def test_admission_control_rejects_past_max_waiting() -> None:
    config = EngineConfig(version=FAMILIES["0.32/0.33"], max_num_seqs=1, max_waiting=1, decode_per_token=0.01)
    with VLLMSimulator(config) as sim:
        waiting = threading.Thread(
            target=raw_stream,
            args=(sim, {"model": MODEL, "messages": ask(), "stream": True, "max_tokens": 1}),
        )
        with sim.held():  # the queue stays full, however slowly a busy machine runs this test
            waiting.start()
            assert sim.wait_for_state(lambda w, running: w == 1, 30.0)
            rejected = httpx.post(
                sim.base_url + "/chat/completions", json={"model": MODEL, "messages": ask()}, timeout=10
            )
            totals = counter_totals(sim)
        waiting.join(10)
    assert rejected.status_code == 503
    assert totals["vllm:admission_rejections"] == 1
    assert len(sim.requests) == 1  # the rejected one never reached the engine


def test_engine_request_prompt_tokens_count_words() -> None:
    r = EngineRequest(
        request_id="x", path="/v1/completions", headers={}, body={}, stream=False, words=["a", "b"],
        max_tokens=None, target_tokens=1, arrival_time=0.0, arrival=0.0,
    )  # fmt: skip
    assert r.prompt_tokens == 2
