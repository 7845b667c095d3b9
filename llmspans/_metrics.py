"""The OpenTelemetry instruments llmspans records into (DESIGN §3)."""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation

from llmspans import _budget, _limiter
from llmspans import _names as names


def _observe_budgets(_options: CallbackOptions) -> Iterable[Observation]:
    return [
        Observation(seconds, {names.STAGE: stage}) for stage, seconds in _budget.registry.current().items()
    ]


def _observe_limiters_in_flight(_options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(r.in_flight, {names.LIMITER_NAME: r.name}) for r in _limiter.live_readings()]


def _observe_limiters_queue_depth(_options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(r.queue_depth, {names.LIMITER_NAME: r.name}) for r in _limiter.live_readings()]


def _observe_limiters_cap(_options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(r.cap, {names.LIMITER_NAME: r.name}) for r in _limiter.live_readings()]


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
            names.METRIC_LIMITER_IN_FLIGHT, callbacks=[_observe_limiters_in_flight], unit="{call}",
            description="Calls admitted and running per limiter (lane).",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_LIMITER_QUEUE_DEPTH, callbacks=[_observe_limiters_queue_depth], unit="{call}",
            description="Calls waiting for admission per limiter (lane).",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_LIMITER_CAP, callbacks=[_observe_limiters_cap], unit="{call}",
            description="The configured concurrency cap per limiter (lane).",
        )  # fmt: skip
        # vLLM server state, from every running llmspans.vllm.ServerMetrics sampler.
        meter.create_observable_gauge(
            names.METRIC_VLLM_NUM_REQUESTS_WAITING, callbacks=[_observe_vllm_waiting], unit="{request}",
            description="Requests waiting in the vLLM server's queue, as last sampled from its /metrics.",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_VLLM_NUM_REQUESTS_RUNNING, callbacks=[_observe_vllm_running], unit="{request}",
            description="Requests in the vLLM server's running batch, as last sampled from its /metrics.",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.METRIC_VLLM_KV_CACHE_USAGE, callbacks=[_observe_vllm_kv_cache], unit="1",
            description="The vLLM server's KV-cache usage (1 means full), as last sampled from its /metrics.",
        )  # fmt: skip


def _observe_vllm_waiting(_options: CallbackOptions) -> Iterable[Observation]:
    from llmspans import vllm

    return [Observation(s.num_requests_waiting, attributes) for s, attributes in vllm._fresh_readings()]


def _observe_vllm_running(_options: CallbackOptions) -> Iterable[Observation]:
    from llmspans import vllm

    return [Observation(s.num_requests_running, attributes) for s, attributes in vllm._fresh_readings()]


def _observe_vllm_kv_cache(_options: CallbackOptions) -> Iterable[Observation]:
    from llmspans import vllm

    return [
        Observation(s.kv_cache_usage, attributes)
        for s, attributes in vllm._fresh_readings()
        if s.kv_cache_usage is not None
    ]
