"""The OpenTelemetry instruments llmspans records into (DESIGN §3)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation

from llmspans import _budget, _limiter
from llmspans import _names as names


def _observe_budgets(_options: CallbackOptions) -> Iterable[Observation]:
    return [
        Observation(seconds, {names.STAGE: stage}) for stage, seconds in _budget.registry.current().items()
    ]


def _limiter_gauge(field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """A gauge callback reading one field of every live limiter, labelled by its lane."""

    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(getattr(r, field), {names.LIMITER_NAME: r.name}) for r in _limiter.live_readings()
        ]

    return observe


def _vllm_gauge(field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """A gauge callback reading one field of every running vLLM sampler's latest good sample."""

    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        # The metric reader's thread runs this: look the module up, never import it (no sampler
        # can be running before something imported it).
        vllm = sys.modules.get("llmspans.vllm")
        if vllm is None:
            return []
        readings = vllm._fresh_readings()
        return [Observation(value, attributes) for sample, attributes in readings
                if (value := getattr(sample, field)) is not None]  # fmt: skip

    return observe


class Instruments:
    """Every instrument the package records into; one instance per process."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.operation_duration: Histogram = meter.create_histogram(
            names.METRIC_OPERATION_DURATION, unit="s", description="GenAI operation duration.",
            explicit_bucket_boundaries_advisory=names.DURATION_BOUNDARIES,
        )  # fmt: skip
        self.token_usage: Histogram = meter.create_histogram(
            names.METRIC_TOKEN_USAGE, unit="{token}", description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=names.TOKEN_BOUNDARIES,
        )  # fmt: skip
        self.time_to_first_chunk: Histogram = meter.create_histogram(
            names.METRIC_TIME_TO_FIRST_CHUNK, unit="s",
            description="Time from the call to the first content chunk of a streamed response.",
            explicit_bucket_boundaries_advisory=names.DURATION_BOUNDARIES,
        )  # fmt: skip
        self.time_per_output_chunk: Histogram = meter.create_histogram(
            names.METRIC_TIME_PER_OUTPUT_CHUNK, unit="s",
            description="Mean time between content chunks of one streamed response.",
            explicit_bucket_boundaries_advisory=names.CHUNK_BOUNDARIES,
        )  # fmt: skip
        self.bucket_duration: Histogram = meter.create_histogram(
            names.METRIC_BUCKET_DURATION, unit="s", description="Time an LLM call spent in each bucket.",
            explicit_bucket_boundaries_advisory=names.DURATION_BOUNDARIES,
        )  # fmt: skip
        self.stage_duration: Histogram = meter.create_histogram(
            names.METRIC_STAGE_DURATION, unit="s", description="Duration of each stage, LLM call and turn.",
            explicit_bucket_boundaries_advisory=names.DURATION_BOUNDARIES,
        )  # fmt: skip
        self.budget_exceeded: Counter = meter.create_counter(
            names.METRIC_BUDGET_EXCEEDED, unit="{span}", description="Spans that overran their budget."
        )
        self.retry_attempts: Counter = meter.create_counter(
            names.METRIC_RETRY_ATTEMPTS, unit="{attempt}", description="Failed attempts that were retried."
        )
        self.connect_new: Counter = meter.create_counter(
            names.METRIC_CONNECT_NEW, unit="{connection}", description="Connections opened by LLM calls."
        )
        meter.create_observable_gauge(
            names.METRIC_STAGE_BUDGET, callbacks=[_observe_budgets], unit="s",
            description="The configured budget per stage, so dashboards can draw the line.",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_LIMITER_IN_FLIGHT, callbacks=[_limiter_gauge("in_flight")], unit="{call}",
            description="Calls admitted and running per limiter (lane).",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_LIMITER_QUEUE_DEPTH, callbacks=[_limiter_gauge("queue_depth")], unit="{call}",
            description="Calls waiting for admission per limiter (lane).",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_LIMITER_CAP, callbacks=[_limiter_gauge("cap")], unit="{call}",
            description="The configured concurrency cap per limiter (lane).",
        )  # fmt: skip
        # vLLM server state, from every running llmspans.vllm.ServerMetrics sampler.
        meter.create_observable_gauge(
            names.METRIC_VLLM_NUM_REQUESTS_WAITING, callbacks=[_vllm_gauge("num_requests_waiting")], unit="{request}",
            description="Requests waiting in the vLLM server's queue, as last sampled from its /metrics.",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_VLLM_NUM_REQUESTS_RUNNING, callbacks=[_vllm_gauge("num_requests_running")], unit="{request}",
            description="Requests in the vLLM server's running batch, as last sampled from its /metrics.",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_VLLM_KV_CACHE_USAGE, callbacks=[_vllm_gauge("kv_cache_usage")], unit="1",
            description="The vLLM server's KV-cache usage (1 means full), as last sampled from its /metrics.",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_VLLM_PREEMPTION_RATE, callbacks=[_vllm_gauge("preemption_rate")], unit="{preemption}/s",
            description="Preemptions per second in the vLLM server between its last two samples.",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_VLLM_PREFIX_CACHE_HIT_RATIO, callbacks=[_vllm_gauge("prefix_cache_hit_ratio")], unit="1",
            description="The share of prompt tokens vLLM found in its prefix cache between its last two samples.",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_VLLM_NUM_REQUESTS_WAITING_FOR_CAPACITY, unit="{request}",
            callbacks=[_vllm_gauge("num_requests_waiting_for_capacity")],
            description="Requests waiting in the vLLM server's queue for room in its batch or KV cache.",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_VLLM_NUM_REQUESTS_WAITING_DEFERRED, unit="{request}",
            callbacks=[_vllm_gauge("num_requests_waiting_deferred")],
            description="Requests the vLLM server's scheduler deferred (a transient constraint, not capacity).",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_VLLM_ADMISSION_REJECTION_RATE, callbacks=[_vllm_gauge("admission_rejection_rate")],
            unit="{rejection}/s", description="Requests per second the vLLM server rejected at admission.",
        )  # fmt: skip
