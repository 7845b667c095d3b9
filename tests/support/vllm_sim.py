"""A simulated vLLM OpenAI-compatible server, release by release, and an OTLP/HTTP trace receiver.

vLLM needs CUDA, so tests talk to this instead. It stands on the simulator's HTTP core
(`llmspans.tools.simulator.HTTPCore`) and adds what a vLLM server does, from vLLM's own sources
(../shared/components.md, "vLLM release families"):

- **A release knob.** `EngineConfig(version="0.11.0")` serves what that release serves; `FAMILIES`
  names one release per family the tests run across. With tracing on (`otlp_traces_endpoint`),
  0.8.5 to 0.10.x run the **older engine** (`--otlp-traces-endpoint` forces it): its metrics carry
  only the `model_name` label, its `llm_request` span has no prefill/decode/inference attributes
  and no finish reasons, and its `time_in_queue` counts from the arrival. Otherwise, and from 0.11
  with tracing, the **newer engine** runs: labels `model_name` and `engine`, and its span has
  prefill, decode and inference, with the queue time counted from when the engine queued the
  request. See `Release` for each metric's releases.
- **A scheduler**, the shipped simulator's capacity model (`llmspans.tools.capacity.Engine`, which
  `EngineConfig.capacity()` configures, plus `held()` for tests about order): a request first spends `frontend_delay` in the front end (tokenising, chat
  template), then waits in one FIFO queue; it is admitted while fewer than `max_num_seqs` run and
  its KV-cache blocks fit in `num_kv_blocks` (`block_size` tokens each; full prompt blocks are
  shared between requests with the same prefix). It prefills its uncached prompt tokens at
  `prefill_per_token`, then decodes one token every `decode_per_token`. When a running request
  needs a block and none is free, the latest admitted request is **preempted**: its blocks are
  freed, it goes back to the head of the queue and recomputes its prompt and output when
  admitted again. A request asking for structured output (`response_format` of type
  `json_schema`/`json_object`, or `guided_json`) is **deferred** for `grammar_compile_time`
  while its grammar compiles; the scheduler skips it meanwhile. From 0.32, `max_waiting` caps the
  queue: a request arriving at a full queue is rejected (HTTP 503) and counted.
- **The prefix cache** (the newer engine's default; `enable_prefix_caching` overrides): the
  prompt's full blocks are remembered by content (least recently used out first, at most
  `num_kv_blocks`); an admitted request's leading blocks found there are not prefilled again
  (at least one prompt token always is, as in vLLM).
- **Streaming as vLLM does it**: response headers at once; at the first token a role chunk
  (`{"role": "assistant", "content": ""}`) then the first token's chunk; then a chunk every
  `stream_interval` tokens (vLLM's `--stream-interval`), the last one carrying `finish_reason`
  and `stop_reason`. Usage only with `stream_options.include_usage`: a final chunk with
  `choices: []`; with `continuous_usage_stats` too, cumulative usage on every chunk (the role
  chunk reports 0 completion tokens). Then `data: [DONE]`. `stream_options` without `stream`
  is a 400, as in vLLM. Legacy `/v1/completions` streams the same way without the role chunk.
- **`/v1/models`** lists the served model `owned_by: "vllm"`.
- **`/metrics`**: Prometheus text written by `prometheus_client` (as vLLM's is) with the
  release's names, labels and buckets.
- **Tracing** (`otlp_traces_endpoint`, a full OTLP/HTTP traces URL): the incoming W3C
  `traceparent`/`tracestate` is extracted and, when a request **finishes** (before its last chunk
  is written), one `llm_request` SERVER span is exported, start time backdated to the arrival,
  with the engine's `gen_ai.latency.*` attributes computed as that engine computes them. An
  aborted request makes no span. The span has its own TracerProvider (never the global one) and
  a BatchSpanProcessor with the OTLP/HTTP protobuf exporter; `flush_traces()` pushes what is
  pending.

All monotonic stamps on `EngineRequest` are `time.perf_counter()` seconds in this process, so
in-process tests compare them with their own clock. Bound to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmspans.tools.capacity import Capacity, Engine, EngineEvents, EngineRequest, Stopped
from llmspans.tools.capacity import words as prompt_words
from llmspans.tools.simulator import _DONE_FRAME, Exchange, HTTPCore, LocalServer, _dumps, _sse, _token

__all__ = [
    "FAMILIES",
    "EngineConfig",
    "EngineRequest",
    "OTLPReceiver",
    "ReceivedSpan",
    "Release",
    "Scrape",
    "VLLMSimulator",
]

_HOST = "127.0.0.1"

# One release per family the tests run across (components.md, "vLLM release families").
FAMILIES: dict[str, str] = {
    "0.8/0.9": "0.9.1",
    "0.10": "0.10.1",
    "0.11": "0.11.0",
    "0.12/0.13": "0.13.0",
    "0.32/0.33": "0.32.0",  # the release the suite also runs for real (tests/test_vllm_real.py)
}

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def _version(text: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(part) for part in text.split("."))
    except ValueError:
        parts = ()
    if len(parts) < 2:
        raise ValueError(f"version must be a vLLM release such as '0.11.0', got {text!r}")
    return parts


@dataclass(frozen=True)
class Release:
    """What one vLLM release serves, with tracing on or off; every boundary is components.md's, except
    where a real 0.32 (tests/test_vllm_real.py) shows otherwise."""

    version: tuple[int, ...]
    tracing: bool

    @property
    def older_engine(self) -> bool:
        """0.8.5 to 0.10.x with `--otlp-traces-endpoint`: the engine before V1."""
        return self.tracing and self.version < (0, 11)

    @property
    def labelnames(self) -> tuple[str, ...]:
        return ("model_name",) if self.older_engine else ("model_name", "engine")

    @property
    def prefix_caching_by_default(self) -> bool:
        return not self.older_engine

    def serves(self, name: str) -> bool:
        """Whether `/metrics` has this family (by its vLLM name, `vllm:` prefix included)."""
        v, older = self.version, self.older_engine
        if name in _ALWAYS:
            return True
        if name == "vllm:gpu_cache_usage_perc":  # 0.11 hides it behind --show-hidden-metrics-for-version
            return older or v < (0, 11)
        if name == "vllm:kv_cache_usage_perc":
            return not older and v >= (0, 9, 2)
        if name == "vllm:num_preemptions":  # the older engine always had it
            return older or v >= (0, 9, 2)
        if name in ("vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits"):  # renamed in 0.9.2
            return not older and v < (0, 11)
        if name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
            return not older and v >= (0, 9, 2)
        if name == "vllm:time_per_output_token_seconds":  # deprecated in 0.11, hidden from 0.12
            return older or v < (0, 12)
        if name == "vllm:inter_token_latency_seconds":
            return not older and v >= (0, 11)
        if name == "vllm:request_prefill_kv_computed_tokens":
            return not older and v >= (0, 13)
        if name in _FROM_0_32:
            return not older and v >= (0, 32)
        raise ValueError(f"unknown vLLM metric {name!r}")

    @property
    def admission_control(self) -> bool:
        return self.serves("vllm:admission_rejections")


_REJECTION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")  # `max_waiting` is the first
_ALWAYS = frozenset(
    {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens",
        "vllm:generation_tokens", "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    }
)  # fmt: skip
# Seen on a real 0.32 server; components.md read 0.33's wheel, and the releases between 0.13 and 0.32
# were not checked: 0.32 is where they are known to be.
_FROM_0_32 = frozenset(
    {
        "vllm:request_num_preemptions", "vllm:prompt_tokens_cached", "vllm:num_requests_waiting_by_reason",
        "vllm:admission_rejections",
    }
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What `vllm serve` would have been started with, plus the simulated speeds."""

    model: str = "sim-vllm-model"
    version: str = FAMILIES["0.12/0.13"]
    max_num_seqs: int = 4
    frontend_delay: float = 0.0
    prefill_per_token: float = 0.001
    decode_per_token: float = 0.01
    default_output_tokens: int = 8  # generated (finish "stop") when the request sets no max_tokens
    max_model_len: int = 4096
    block_size: int = 16
    num_kv_blocks: int = 64
    stream_interval: int = 1
    enable_prefix_caching: bool | None = None  # None: the engine's default
    # --enable-prompt-tokens-details: usage says `prompt_tokens_details.cached_tokens`, the prefix cache's hit
    enable_prompt_tokens_details: bool = False
    grammar_compile_time: float = 0.05
    max_waiting: int | None = (
        None  # from 0.32 (`--max-num-queued-reqs`): requests past this many waiting are rejected
    )
    scheduler_step: float = 0.0002  # the older engine's scheduler time per step of a request
    collect_detailed_traces: bool = False  # --collect-detailed-traces model,worker (older engine)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "default_output_tokens", "max_model_len", "block_size", "num_kv_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be a positive int, got {self.stream_interval!r}")
        for name in (
            "frontend_delay", "prefill_per_token", "decode_per_token", "grammar_compile_time", "scheduler_step",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        _version(self.version)
        if self.max_waiting is not None:
            if not isinstance(self.max_waiting, int) or self.max_waiting < 0:
                raise ValueError(f"max_waiting must be None or a non-negative int, got {self.max_waiting!r}")
            if _version(self.version) < (0, 32):
                raise ValueError(
                    f"max_waiting needs admission control, which vLLM has from 0.32, not {self.version}"
                )

    def release(self, tracing: bool) -> Release:
        return Release(_version(self.version), tracing)

    def capacity(self, release: Release) -> Capacity:
        """The shipped simulator's capacity model for this server and release."""
        caching = self.enable_prefix_caching
        return Capacity(
            slots=self.max_num_seqs, prefill_per_token=self.prefill_per_token,
            decode_per_token=self.decode_per_token, frontend_delay=self.frontend_delay,
            block_size=self.block_size, kv_blocks=self.num_kv_blocks,
            prefix_caching=release.prefix_caching_by_default if caching is None else caching,
            max_waiting=self.max_waiting if release.admission_control else None,
            stream_interval=self.stream_interval, model=self.model,
        )  # fmt: skip


@dataclass(frozen=True)
class Scrape:
    """What one `GET /metrics` reported, and when (monotonic)."""

    at: float
    num_requests_waiting: int
    num_requests_running: int
    kv_cache_usage: float


class _Engine(Engine):
    """The shipped engine, with admissions that a test can hold (see `VLLMSimulator.held`)."""

    def __init__(self, capacity: Capacity, events: EngineEvents) -> None:
        super().__init__(capacity, events)
        self.held = False  # admit nothing: requests queue in the order they came

    def admitting(self) -> bool:
        return not self.held

    def hold(self, held: bool) -> None:
        with self.cond:
            self.held = held
            self.schedule()


class _Events:
    """What the engine reports, to the release's Prometheus metrics and (finished requests) to tracing."""

    def __init__(self, metrics: _PrometheusMetrics, tracing: _Tracing | None) -> None:
        self.metrics, self.tracing = metrics, tracing
        self.preempted, self.rejected, self.prefix_lookup = (
            metrics.preempted,
            metrics.rejected,
            metrics.prefix_lookup,
        )

    def finished(self, r: EngineRequest) -> None:
        self.metrics.finished(r)
        if self.tracing is not None:
            self.tracing.export(r)


class _PrometheusMetrics:
    """The release's Prometheus metrics in a private registry."""

    def __init__(self, config: EngineConfig, release: Release) -> None:
        self.release = release
        self.registry = CollectorRegistry()
        self.labelnames = list(release.labelnames)
        self.labels: dict[str, str] = {"model_name": config.model}
        if "engine" in self.labelnames:
            self.labels["engine"] = "0"
        self.metrics: dict[str, Any] = {}
        self._lock = threading.Lock()
        g, c, h = self._gauge, self._counter, self._histogram
        g("vllm:num_requests_running", "Number of requests in model execution batches.")
        g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        g("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.")
        g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        g("vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason.", ["reason"])
        c("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        c("vllm:gpu_prefix_cache_queries", "GPU prefix cache queries, in terms of number of queried tokens.")
        c("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of number of cached tokens.")
        c("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        c("vllm:prompt_tokens_cached", "Number of cached prompt tokens.")
        c("vllm:generation_tokens", "Number of generation tokens processed.")
        # As 0.32 serves it: no `engine` label, one series per queue limit that can reject.
        c("vllm:admission_rejections", "Requests rejected at admission.", ["model_name", "reason"],
          [{"model_name": config.model, "reason": reason} for reason in _REJECTION_REASONS])  # fmt: skip
        h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        h(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            _ITL_BUCKETS,
        )
        h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        for name, phase in [
            ("vllm:e2e_request_latency_seconds", "e2e request latency"),
            ("vllm:request_queue_time_seconds", "time spent in WAITING phase for request"),
            ("vllm:request_inference_time_seconds", "time spent in RUNNING phase for request"),
            ("vllm:request_prefill_time_seconds", "time spent in PREFILL phase for request"),
            ("vllm:request_decode_time_seconds", "time spent in DECODE phase for request"),
        ]:
            h(name, f"Histogram of {phase} in seconds.", _REQUEST_LATENCY_BUCKETS)
        h(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            _TOKEN_COUNT_BUCKETS,
        )
        h("vllm:request_num_preemptions", "Number of preemptions per finished request.", _PREEMPTION_BUCKETS)

    def _gauge(self, name: str, doc: str, extra: list[str] | None = None) -> None:
        if self.release.serves(name):
            self.metrics[name] = Gauge(name, doc, self.labelnames + (extra or []), registry=self.registry)

    def _counter(
        self,
        name: str,
        doc: str,
        labelnames: list[str] | None = None,
        series: list[dict[str, str]] | None = None,
    ) -> None:
        if self.release.serves(name):
            counter = self.metrics[name] = Counter(
                name, doc, labelnames or self.labelnames, registry=self.registry
            )
            for labels in series or [self.labels]:
                counter.labels(**labels)  # served at 0 from the start, as vLLM's per-engine series are

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        if self.release.serves(name):
            histogram = Histogram(name, doc, self.labelnames, buckets=buckets, registry=self.registry)
            self.metrics[name] = histogram
            histogram.labels(**self.labels)

    def _inc(self, name: str, amount: float = 1.0) -> None:
        metric = self.metrics.get(name)
        if metric is not None and amount:
            metric.labels(**self.labels).inc(amount)

    def _observe(self, name: str, value: float) -> None:
        metric = self.metrics.get(name)
        if metric is not None:
            metric.labels(**self.labels).observe(value)

    # --- engine events ----------------------------------------------------------------------------

    def preempted(self) -> None:
        self._inc("vllm:num_preemptions")

    def rejected(self) -> None:
        metric = self.metrics.get("vllm:admission_rejections")
        if metric is not None:
            metric.labels(model_name=self.labels["model_name"], reason=_REJECTION_REASONS[0]).inc()

    def prefix_lookup(self, queried: int, hit: int) -> None:
        for prefix in ("vllm:gpu_prefix_cache_", "vllm:prefix_cache_"):
            self._inc(prefix + "queries", queried)
            self._inc(prefix + "hits", hit)
        self._inc("vllm:prompt_tokens_cached", hit)

    def finished(self, r: EngineRequest) -> None:
        assert r.first_token_ts is not None
        assert r.last_token_ts is not None
        assert r.scheduled_ts is not None
        assert r.finished_ts is not None
        self._inc("vllm:prompt_tokens", r.prompt_tokens)
        self._inc("vllm:generation_tokens", r.generated)
        self._observe("vllm:time_to_first_token_seconds", r.first_token_ts - r.arrival)
        for earlier, later in itertools.pairwise(r.token_ts):
            self._observe("vllm:time_per_output_token_seconds", later - earlier)
            self._observe("vllm:inter_token_latency_seconds", later - earlier)
        self._observe("vllm:e2e_request_latency_seconds", r.finished_ts - r.arrival)
        self._observe("vllm:request_queue_time_seconds", r.time_in_queue)
        self._observe("vllm:request_inference_time_seconds", r.last_token_ts - r.scheduled_ts)
        self._observe("vllm:request_prefill_time_seconds", r.first_token_ts - r.scheduled_ts)
        self._observe("vllm:request_decode_time_seconds", r.last_token_ts - r.first_token_ts)
        self._observe("vllm:request_prefill_kv_computed_tokens", r.prompt_tokens - r.cached_tokens)
        self._observe("vllm:request_num_preemptions", r.preemptions)

    def render(self, waiting: int, running: int, kv_cache_usage: float, deferred: int) -> bytes:
        with self._lock:
            values = {
                "vllm:num_requests_waiting": waiting,
                "vllm:num_requests_running": running,
                "vllm:gpu_cache_usage_perc": kv_cache_usage,
                "vllm:kv_cache_usage_perc": kv_cache_usage,
            }
            for name, value in values.items():
                if name in self.metrics:
                    self.metrics[name].labels(**self.labels).set(value)
            by_reason = self.metrics.get("vllm:num_requests_waiting_by_reason")
            if by_reason is not None:
                by_reason.labels(**self.labels, reason="capacity").set(waiting - deferred)
                by_reason.labels(**self.labels, reason="deferred").set(deferred)
            return generate_latest(self.registry)


class _Tracing:
    """vLLM's `llm_request` span: its own provider, OTLP/HTTP protobuf, batched."""

    def __init__(self, endpoint: str, config: EngineConfig, release: Release) -> None:
        self.config = config
        self.release = release
        self.provider = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=5), schedule_delay_millis=100)
        )
        self.tracer = self.provider.get_tracer("vllm.llm_engine")
        self.propagator = TraceContextTextMapPropagator()

    def export(self, r: EngineRequest) -> None:
        """A finished request's span; never called for an aborted one."""
        attributes = self._older(r) if self.release.older_engine else self._newer(r)
        context = self.propagator.extract(carrier=r.headers)
        span = self.tracer.start_span(
            "llm_request", context=context, kind=SpanKind.SERVER, attributes=attributes,
            start_time=int(r.arrival_time * 1e9),
        )  # fmt: skip
        span.end()

    def _sampling(self, r: EngineRequest) -> dict[str, float]:
        """The request's sampling parameters after vLLM's defaults (top_p 1, temperature 1, n 1)."""
        return {"top_p": 1.0, "temperature": 1.0, "n": 1} | {
            key: r.body[key]
            for key in ("top_p", "temperature", "n")
            if isinstance(r.body.get(key), (int, float))
        }

    def _newer(self, r: EngineRequest) -> dict[str, Any]:
        """`do_tracing` of the newer engine's output processor (0.11 and later)."""
        assert r.queued_ts is not None
        assert r.scheduled_ts is not None
        assert r.finished_ts is not None
        assert r.first_token_ts is not None
        assert r.last_token_ts is not None
        first, last = r.first_token_ts, r.last_token_ts
        attributes: dict[str, Any] = {
            "gen_ai.latency.time_to_first_token": first - r.arrival,
            "gen_ai.latency.e2e": r.finished_ts - r.arrival,
            "gen_ai.latency.time_in_queue": r.scheduled_ts - r.queued_ts,
            "gen_ai.usage.prompt_tokens": r.prompt_tokens,
            "gen_ai.usage.completion_tokens": r.generated,
            "gen_ai.latency.time_in_model_prefill": first - r.scheduled_ts,
            "gen_ai.latency.time_in_model_decode": last - first,
            "gen_ai.latency.time_in_model_inference": last - r.scheduled_ts,
            "gen_ai.request.id": r.request_id,
        }
        if self.release.version < (0, 32):  # a real 0.32 sends none (tests/test_vllm_real.py)
            attributes["gen_ai.response.finish_reasons"] = json.dumps([r.finish_reason])
        # "When set": a value is written when it is truthy after the defaults, so temperature=0 is
        # absent and max_tokens appears only when the request had it.
        sampling = self._sampling(r)
        if sampling["top_p"]:
            attributes["gen_ai.request.top_p"] = float(sampling["top_p"])
        if r.max_tokens:
            attributes["gen_ai.request.max_tokens"] = r.max_tokens
        if sampling["temperature"]:
            attributes["gen_ai.request.temperature"] = float(sampling["temperature"])
        if sampling["n"]:
            attributes["gen_ai.request.n"] = int(sampling["n"])
        return attributes

    def _older(self, r: EngineRequest) -> dict[str, Any]:
        """`create_trace_span` of the older engine (0.8.5 to 0.10.x with tracing): the queue time
        runs from the arrival, no prefill/decode/inference, no finish reasons; the sampling
        parameters are written whatever their value (a None is dropped by OpenTelemetry)."""
        assert r.scheduled_ts is not None
        assert r.finished_ts is not None
        assert r.first_token_ts is not None
        sampling = self._sampling(r)
        attributes: dict[str, Any] = {
            "gen_ai.response.model": self.config.model,
            "gen_ai.request.id": r.request_id,
            "gen_ai.request.temperature": float(sampling["temperature"]),
            "gen_ai.request.top_p": float(sampling["top_p"]),
            "gen_ai.request.n": int(sampling["n"]),
            "gen_ai.usage.num_sequences": int(sampling["n"]),
            "gen_ai.usage.prompt_tokens": r.prompt_tokens,
            "gen_ai.usage.completion_tokens": r.generated,
            "gen_ai.latency.time_in_queue": r.scheduled_ts - r.arrival,
            "gen_ai.latency.time_to_first_token": r.first_token_ts - r.arrival,
            "gen_ai.latency.e2e": r.finished_ts - r.arrival,
            "gen_ai.latency.time_in_scheduler": r.steps * self.config.scheduler_step,
        }
        if r.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = r.max_tokens
        if self.config.collect_detailed_traces:
            # The simulator spends nothing outside the forward pass, so the two are equal.
            attributes["gen_ai.latency.time_in_model_forward"] = r.compute_time
            attributes["gen_ai.latency.time_in_model_execute"] = r.compute_time
        return attributes


def _structured(body: dict[str, Any]) -> bool:
    response_format = body.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    return kind in ("json_schema", "json_object") or "guided_json" in body


def _error(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    return _dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


def _usage(
    r: EngineRequest, completion_tokens: int | None = None, *, details: bool = False
) -> dict[str, Any]:
    completion = r.generated if completion_tokens is None else completion_tokens
    usage: dict[str, Any] = {
        "prompt_tokens": r.prompt_tokens,
        "total_tokens": r.prompt_tokens + completion,
        "completion_tokens": completion,
    }
    if details:  # vLLM with --enable-prompt-tokens-details: the prompt tokens its prefix cache held
        usage["prompt_tokens_details"] = {"cached_tokens": r.cached_tokens}
    return usage


class VLLMSimulator(LocalServer):
    """A vLLM-like server on 127.0.0.1 in background threads; a context manager.

    `otlp_traces_endpoint` is where `llm_request` spans go (a full OTLP/HTTP URL ending in
    `/v1/traces`), as `vllm serve --otlp-traces-endpoint` with
    `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`; None disables tracing.
    """

    def __init__(
        self, config: EngineConfig | None = None, *, otlp_traces_endpoint: str | None = None
    ) -> None:
        self.config = config if config is not None else EngineConfig()
        self.release = self.config.release(tracing=otlp_traces_endpoint is not None)
        self._prometheus = _PrometheusMetrics(self.config, self.release)
        self._tracing = (
            _Tracing(otlp_traces_endpoint, self.config, self.release) if otlp_traces_endpoint else None
        )
        self._engine = _Engine(self.config.capacity(self.release), _Events(self._prometheus, self._tracing))
        self._core = HTTPCore(self._respond, record=False)
        self._lock = threading.Lock()
        self._requests: list[EngineRequest] = []
        self._scrapes: list[Scrape] = []
        self._started_at = time.time()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving: waiting and running requests are abandoned, connections closed, threads joined."""
        if self._engine.stopping.is_set():
            return
        self._engine.stop()
        self._core.stop(timeout)
        if self._tracing is not None:
            self._tracing.provider.shutdown()

    # --- what tests read ------------------------------------------------------------------------

    @property
    def requests(self) -> list[EngineRequest]:
        """Every API request the engine took, in arrival order."""
        with self._lock:
            return list(self._requests)

    @property
    def scrapes(self) -> list[Scrape]:
        with self._lock:
            return list(self._scrapes)

    def state(self) -> tuple[int, int, float]:
        """The scheduler now: (waiting, running, KV-cache usage)."""
        return self._engine.state()[:3]

    def wait_for_state(self, predicate: Callable[[int, int], bool], timeout: float = 5.0) -> bool:
        """Poll the scheduler until `predicate(waiting, running)` holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            waiting, running, _ = self.state()
            if predicate(waiting, running):
                return True
            time.sleep(0.002)
        return False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Admit nothing inside the block, then schedule what queued, in its order.

        For tests about order, not time: requests sent one by one (each waited for with
        `wait_for_state`) are all queued before the first is admitted, however slowly a busy
        machine ran their threads, so what the scheduler does next follows from the config alone.
        """
        self._engine.hold(True)
        try:
            yield
        finally:
            self._engine.hold(False)

    def flush_traces(self, timeout: float = 5.0) -> bool:
        """Export the finished spans still waiting in the batch processor."""
        if self._tracing is None:
            return True
        return self._tracing.provider.force_flush(int(timeout * 1000))

    # --- answering ------------------------------------------------------------------------------

    def _respond(self, ex: Exchange, seq: int, keep_alive: bool) -> None:
        rec = ex.rec
        common = [] if keep_alive else [("connection", "close")]
        if rec.method == "GET" and rec.path == "/health":
            ex.send_full(200, b"", common)
        elif rec.method == "GET" and rec.path == "/metrics":
            ex.send_full(
                200, self._render_metrics(), common, content_type="text/plain; version=0.0.4; charset=utf-8"
            )
        elif rec.method == "GET" and rec.path == "/v1/models":
            model = self.config.model
            card = {"id": model, "object": "model", "created": int(self._started_at), "owned_by": "vllm"}
            card |= {"root": model, "parent": None, "max_model_len": self.config.max_model_len}
            ex.send_full(200, _dumps({"object": "list", "data": [card]}), common)
        elif rec.method == "POST" and rec.path in ("/v1/chat/completions", "/v1/completions"):
            self._complete(ex, common)
        else:
            ex.send_full(404, _error(404, "Not Found", "NotFoundError"), common)

    def _complete(self, ex: Exchange, common: list[tuple[str, str]]) -> None:
        rec = ex.rec
        arrival = rec.arrived_ns / 1e9
        arrival_time = time.time() - (time.perf_counter() - arrival)
        body = rec.body
        if not isinstance(body, dict):
            ex.send_full(400, _error(400, "request body must be a JSON object", "BadRequestError"), common)
            return
        model = body.get("model")
        if model != self.config.model:
            message = f"The model `{model}` does not exist."
            ex.send_full(404, _error(404, message, "NotFoundError", "model"), common)
            return
        stream = body.get("stream") is True
        options = body.get("stream_options")
        if options is not None and not stream:
            message = "Stream options can only be defined when `stream=True`."
            ex.send_full(400, _error(400, message, "BadRequestError"), common)
            return
        chat = rec.path.endswith("/chat/completions")
        words = prompt_words(body.get("messages") if chat else body.get("prompt")) or ["."]
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            message = f"max_tokens must be at least 1, got {max_tokens}."
            ex.send_full(400, _error(400, message, "BadRequestError"), common)
            return
        target = max_tokens if max_tokens is not None else self.config.default_output_tokens
        if len(words) + (max_tokens or 0) > self.config.max_model_len:
            message = "This model's maximum context length was exceeded."
            ex.send_full(400, _error(400, message, "BadRequestError"), common)
            return
        if not self._engine.fits_alone(len(words), target):
            message = "The request needs more KV-cache blocks than the server has."
            ex.send_full(400, _error(400, message, "BadRequestError"), common)
            return
        request = EngineRequest(
            request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            path=rec.path,
            headers=dict(rec.headers),
            body=body,
            stream=stream,
            words=words,
            max_tokens=max_tokens,
            target_tokens=target,
            arrival_time=arrival_time,
            arrival=arrival,
        )
        if _structured(body):
            request.deferred_until = arrival + self.config.frontend_delay + self.config.grammar_compile_time
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        continuous = (
            include_usage and isinstance(options, dict) and options.get("continuous_usage_stats") is True
        )
        if self._engine.rejects():
            message = "The server is at capacity: its waiting queue is full."
            ex.send_full(503, _error(503, message, "ServiceUnavailableError"), common)
            return
        with self._lock:
            self._requests.append(request)
        try:
            if stream:
                self._stream(ex, request, chat, include_usage, continuous, common)
            else:
                self._whole(ex, request, chat, common)
        except Stopped:
            pass  # the server is stopping; HTTPCore closes the connection

    def _whole(self, ex: Exchange, r: EngineRequest, chat: bool, common: list[tuple[str, str]]) -> None:
        self._engine.run(r, lambda tokens, last: None)
        text = "".join(_token(i) for i in range(r.generated))
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": r.finish_reason,
            "stop_reason": None,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        answer = {
            "id": r.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(r.arrival_time), "model": self.config.model, "choices": [choice],
            "usage": _usage(r, details=self.config.enable_prompt_tokens_details),
        }  # fmt: skip
        ex.send_full(200, _dumps(answer), common)

    def _stream(
        self,
        ex: Exchange,
        r: EngineRequest,
        chat: bool,
        include_usage: bool,
        continuous: bool,
        common: list[tuple[str, str]],
    ) -> None:
        ex.start_stream(200, [("content-type", "text/event-stream; charset=utf-8"), *common])
        base: dict[str, Any] = {
            "id": r.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(r.arrival_time), "model": self.config.model,
        }  # fmt: skip
        sent = 0

        def chunk(choice: dict[str, Any], completion_tokens: int) -> bytes:
            obj = {**base, "choices": [choice]}
            if continuous:
                obj["usage"] = _usage(r, completion_tokens, details=self.config.enable_prompt_tokens_details)
            return _sse(_dumps(obj))

        def emit(tokens: int, last: bool) -> None:
            nonlocal sent
            frames = []
            if chat and sent == 0:
                delta = {"role": "assistant", "content": ""}
                frames.append(chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}, 0))
            text = "".join(_token(i) for i in range(sent, sent + tokens))
            sent += tokens
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
            if chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
                choice["stop_reason"] = None
            if last:
                choice["finish_reason"] = r.finish_reason
                choice["stop_reason"] = None
            frames.append(chunk(choice, sent))
            for frame in frames:
                ex.send(frame)
            r.chunk_sent.append(time.perf_counter())
            r.chunk_tokens.append(tokens)

        self._engine.run(r, emit)
        if include_usage:
            usage = _usage(r, details=self.config.enable_prompt_tokens_details)
            ex.send(_sse(_dumps({**base, "choices": [], "usage": usage})))
        ex.end_stream(_DONE_FRAME)

    def _render_metrics(self) -> bytes:
        waiting, running, kv_cache_usage, deferred = self._engine.state()
        with self._lock:
            self._scrapes.append(Scrape(time.perf_counter(), waiting, running, kv_cache_usage))
        return self._prometheus.render(waiting, running, kv_cache_usage, deferred)


# --- an OTLP/HTTP trace receiver --------------------------------------------------------------


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as an OTLP/HTTP exporter sent it (ids in lowercase hex)."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    kind: int  # the OTLP enum: 2 is SERVER, 3 is CLIENT
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int
    service_name: str | None


def _any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


class OTLPReceiver(LocalServer):
    """A tiny OTLP/HTTP (protobuf) trace receiver on 127.0.0.1, on the same HTTP core; a context manager."""

    def __init__(self) -> None:
        self._core = HTTPCore(self._respond, record=False)
        self._cond = threading.Condition()
        self._spans: list[ReceivedSpan] = []

    @property
    def traces_url(self) -> str:
        return f"{self._core.url}/v1/traces"

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def clear(self) -> None:
        """Forget the spans received so far."""
        with self._cond:
            self._spans.clear()

    def wait_for_spans(self, name: str, count: int, timeout: float = 5.0) -> list[ReceivedSpan]:
        """The spans called `name` once there are at least `count` of them; AssertionError on timeout."""
        with self._cond:
            found = self._cond.wait_for(lambda: len(self._named(name)) >= count, timeout)
            spans = self._named(name)
        if not found:
            raise AssertionError(
                f"expected {count} span(s) named {name!r} within {timeout}s, got {len(spans)}"
            )
        return spans

    def _named(self, name: str) -> list[ReceivedSpan]:
        return [span for span in self._spans if span.name == name]

    def _respond(self, ex: Exchange, seq: int, keep_alive: bool) -> None:
        rec = ex.rec
        common = [] if keep_alive else [("connection", "close")]
        if rec.method != "POST" or rec.path != "/v1/traces":
            ex.send_full(404, b"", common)
            return
        body = rec.raw_body
        if rec.headers.get("content-encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        self._add(ExportTraceServiceRequest.FromString(body))
        ex.send_full(200, b"", common, content_type="application/x-protobuf")

    def _add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _any_value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex() or None,
                            kind=span.kind,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={kv.key: _any_value(kv.value) for kv in span.attributes},
                            status_code=span.status.code,
                            service_name=resource.get("service.name"),
                        )
                    )
        with self._cond:
            self._spans.extend(received)
            self._cond.notify_all()
