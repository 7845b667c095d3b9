"""The report's triage reads vLLM's pressure signals stamped on the call spans (llmspans/report/_pressure.py):
a memory-bound server, a queue that is on the server, prompts that stopped sharing a prefix. Each verdict
with spans that trigger it and spans that do not."""

from __future__ import annotations

from typing import Any

import pytest

from llmspans import _names as names
from tests.test_report import Trace, document_attributes, report_of


def calls(signals: list[dict[str, Any]], **buckets: float) -> list[Trace]:
    """One trace per call, in start order, each stamped with its share of the signals."""
    traces = []
    for n, stamped in enumerate(signals):
        trace = Trace()
        trace.call(10 * n, **buckets)
        trace.spans[-1]["attributes"] += document_attributes(stamped)
        traces.append(trace)
    return traces


def stamp(kv: float, preemptions: float, waiting: int = 0, hits: float = 0.5) -> dict[str, Any]:
    return {
        names.VLLM_KV_CACHE_USAGE: kv, names.VLLM_PREEMPTION_RATE: preemptions,
        names.VLLM_NUM_REQUESTS_WAITING: waiting, names.VLLM_PREFIX_CACHE_HIT_RATIO: hits,
    }  # fmt: skip


def test_first_token_with_a_full_kv_cache_and_rising_preemptions_is_a_memory_bound_server() -> None:
    signals = [stamp(0.6 + 0.04 * n, 0.0 if n < 5 else 2.0 + n) for n in range(10)]
    triage = report_of(*calls(signals, first_token=400, stream=100)).triage
    assert triage is not None
    assert triage.dominant == "first_token"
    assert "memory-bound" in triage.message
    assert "more replicas, shorter contexts or a larger KV cache" in triage.message
    assert "not slow at prefill" in triage.message


@pytest.mark.parametrize(
    "signals",
    [
        [stamp(0.5, 3.0) for _ in range(10)],  # preemptions, but the KV cache is far from full
        [stamp(0.97, 0.0) for _ in range(10)],  # full, but nothing preempted
        [stamp(0.97, 5.0 if n < 5 else 1.0) for n in range(10)],  # full, preemptions falling
    ],
)
def test_without_both_signals_first_token_keeps_its_usual_advice(signals: list[dict[str, Any]]) -> None:
    triage = report_of(*calls(signals, first_token=400, stream=100)).triage
    assert triage is not None
    assert "memory-bound" not in triage.message
    assert "look at server queueing" in triage.message


def test_waiting_requests_rising_with_a_small_client_queue_put_the_queue_on_the_server() -> None:
    signals = [stamp(0.5, 0.0, waiting=0 if n < 5 else 6) for n in range(10)]
    report = report_of(*calls(signals, queue=2, first_token=400, stream=100))
    assert report.triage is not None
    assert any("the queue is on the server" in note for note in report.triage.notes)
    assert report.server_pressure is not None
    assert (report.server_pressure.waiting_before, report.server_pressure.waiting_after) == (0, 6)
    # The same rise while the client's own queue is as long as first_token: the queue is not (only) there.
    long_queue = report_of(*calls(signals, queue=400, first_token=400, stream=100))
    assert long_queue.triage is not None
    assert not any("the queue is on the server" in note for note in long_queue.triage.notes)


def test_prefix_cache_hits_falling_means_prompts_stopped_sharing_a_prefix() -> None:
    falling = [stamp(0.5, 0.0, hits=0.8 if n < 5 else 0.1) for n in range(10)]
    report = report_of(*calls(falling, first_token=400, stream=100))
    assert report.triage is not None
    assert any("prefix-cache hits fell from 80% to 10%" in note for note in report.triage.notes)
    steady = [stamp(0.5, 0.0, hits=0.8) for _ in range(10)]
    steady_report = report_of(*calls(steady, first_token=400, stream=100))
    assert steady_report.triage is not None
    assert not any("prefix-cache" in note for note in steady_report.triage.notes)


def test_calls_without_a_sampler_have_no_pressure_figures() -> None:
    trace = Trace()
    trace.call(0, first_token=400, stream=100)
    assert report_of(trace).server_pressure is None
