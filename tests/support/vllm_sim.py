"""A simulated vLLM OpenAI-compatible server, and an OTLP/HTTP receiver for its traces.

vLLM needs CUDA, so tests talk to this instead. What it reproduces, from vLLM's own sources
(V1 engine, 0.10-0.11 era; see ../shared/components.md):

- **A scheduler**: at most `max_num_seqs` requests run at once; the rest wait in one FIFO queue,
  so queue time is real. A request is granted a slot the moment one frees (that is its
  `scheduled_ts`), prefills for `prompt_tokens * prefill_per_token` seconds (its first token is
  due then), then decodes one token every `decode_per_token` seconds. Running requests do not
  slow each other down (a real batch does, a little). KV-cache blocks are held per running
  request, `ceil((prompt + generated) / block_size)` of `num_kv_blocks`.
- **Streaming as vLLM does it**: response headers at once; at the first token a role chunk
  (`{"role": "assistant", "content": ""}`) then the first token's chunk; then a chunk every
  `stream_interval` tokens (vLLM's `--stream-interval`), the last one carrying `finish_reason`
  and `stop_reason`. Usage only with `stream_options.include_usage`: a final chunk with
  `choices: []`; with `continuous_usage_stats` too, cumulative usage on every chunk (the role
  chunk reports 0 completion tokens). Then `data: [DONE]`. `stream_options` without `stream`
  is a 400, as in vLLM. Legacy `/v1/completions` streams the same way without the role chunk.
- **`/v1/models`** lists the served model `owned_by: "vllm"`.
- **`/metrics`**: Prometheus text written by `prometheus_client` (as vLLM's is) with vLLM's
  names and buckets, labels `model_name` and `engine`. `metric_names="legacy"` serves the names
  of vLLM before 0.9 (`vllm:gpu_cache_usage_perc`, `vllm:time_per_output_token_seconds`, no
  `engine` label), `"both"` the transition releases that served old and new side by side.
- **Tracing** (`otlp_traces_endpoint`, a full OTLP/HTTP traces URL): the incoming W3C
  `traceparent`/`tracestate` is extracted and, when the request finishes (before its last
  chunk is written), one `llm_request` SERVER span is exported, start time backdated to the
  arrival, with vLLM's `gen_ai.latency.*` attributes computed the way vLLM computes them.
  `gen_ai.request.top_p`/`temperature`/`n`/`max_tokens` follow vLLM's "when set": after
  vLLM's defaults (top_p 1.0, temperature 1.0, n 1) are applied, a value is written when it
  is truthy, so `temperature=0` is absent and `max_tokens` appears only when the request had it.
  The span has its own TracerProvider (never the global one) and a BatchSpanProcessor with
  the OTLP/HTTP protobuf exporter; `flush_traces()` pushes what is pending.

All monotonic stamps on `EngineRequest` are `time.perf_counter()` seconds in this process, so
in-process tests compare them with their own clock. Bound to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import math
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmspans._simulator import _DONE_FRAME, _TERMINATOR, _count_words, _dumps, _sse, _token

__all__ = ["EngineConfig", "EngineRequest", "OTLPReceiver", "ReceivedSpan", "Scrape", "VLLMSimulator"]

_HOST = "127.0.0.1"
MetricNames = Literal["current", "legacy", "both"]

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What `vllm serve` would have been started with, plus the simulated speeds."""

    model: str = "sim-vllm-model"
    max_num_seqs: int = 4
    prefill_per_token: float = 0.001
    decode_per_token: float = 0.01
    default_output_tokens: int = 8  # generated (finish "stop") when the request sets no max_tokens
    max_model_len: int = 4096
    block_size: int = 16
    num_kv_blocks: int = 64
    stream_interval: int = 1
    metric_names: MetricNames = "current"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "default_output_tokens", "max_model_len", "block_size", "num_kv_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be a positive int, got {self.stream_interval!r}")
        for name in ("prefill_per_token", "decode_per_token"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if self.metric_names not in ("current", "legacy", "both"):
            raise ValueError(f"metric_names must be 'current', 'legacy' or 'both', got {self.metric_names!r}")


@dataclass(kw_only=True)
class EngineRequest:
    """One request's life in the engine; monotonic stamps are `time.perf_counter()` seconds."""

    request_id: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    stream: bool
    prompt_tokens: int
    max_tokens: int | None
    target_tokens: int
    arrival_time: float  # wall clock, as vLLM's `arrival_time`
    arrival: float  # the same instant on the monotonic clock
    queued_ts: float | None = None
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    finished_ts: float | None = None
    token_ts: list[float] = field(default_factory=list)
    chunk_sent: list[float] = field(default_factory=list)  # after each content chunk's write
    chunk_tokens: list[int] = field(default_factory=list)  # tokens carried by each content chunk
    finish_reason: str | None = None

    @property
    def generated(self) -> int:
        return len(self.token_ts)

    @property
    def time_in_queue(self) -> float:
        assert self.scheduled_ts is not None
        assert self.queued_ts is not None
        return self.scheduled_ts - self.queued_ts


@dataclass(frozen=True)
class Scrape:
    """What one `GET /metrics` reported, and when (monotonic)."""

    at: float
    num_requests_waiting: int
    num_requests_running: int
    kv_cache_usage: float


class _Stopped(Exception):
    """The server is stopping: abandon the request."""


class _Engine:
    """The scheduler: a FIFO waiting queue and at most `max_num_seqs` running requests."""

    def __init__(self, config: EngineConfig, stopping: threading.Event) -> None:
        self.config = config
        self.stopping = stopping
        self.cond = threading.Condition()
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []

    def add(self, request: EngineRequest) -> None:
        """Queue the request and block until the scheduler grants it a slot."""
        with self.cond:
            request.queued_ts = time.perf_counter()
            self.waiting.append(request)
            self._schedule()
            self.cond.wait_for(lambda: request.scheduled_ts is not None or self.stopping.is_set())
            if request.scheduled_ts is None:
                self.waiting.remove(request)
                raise _Stopped

    def release(self, request: EngineRequest) -> None:
        with self.cond:
            if request in self.running:
                self.running.remove(request)
            self._schedule()

    def _schedule(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            granted = self.waiting.popleft()
            granted.scheduled_ts = time.perf_counter()
            self.running.append(granted)
        self.cond.notify_all()

    def state(self) -> tuple[int, int, float]:
        """(waiting, running, KV-cache usage) now."""
        size = self.config.block_size
        with self.cond:
            blocks = sum(math.ceil((r.prompt_tokens + r.generated) / size) for r in self.running)
            return len(self.waiting), len(self.running), min(1.0, blocks / self.config.num_kv_blocks)


class _PrometheusMetrics:
    """vLLM's Prometheus metrics in a private registry."""

    def __init__(self, config: EngineConfig) -> None:
        self.registry = CollectorRegistry()
        legacy = config.metric_names == "legacy"
        current = config.metric_names != "legacy"
        labelnames = ["model_name"] if legacy else ["model_name", "engine"]
        self.labels: dict[str, str] = {"model_name": config.model}
        if not legacy:
            self.labels["engine"] = "0"
        registry = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labelnames, buckets=buckets, registry=registry)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.cache_gauges: list[Gauge] = []
        if config.metric_names != "current":
            self.cache_gauges.append(
                gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.")
            )
        if current:
            self.cache_gauges.append(
                gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
            )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labelnames, registry=registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labelnames, registry=registry
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.itl: list[Histogram] = []
        if config.metric_names != "current":
            self.itl.append(
                histogram(
                    "vllm:time_per_output_token_seconds",
                    "Histogram of time per output token in seconds.",
                    _ITL_BUCKETS,
                )
            )
        if current:
            self.itl.append(
                histogram(
                    "vllm:inter_token_latency_seconds",
                    "Histogram of inter-token latency in seconds.",
                    _ITL_BUCKETS,
                )
            )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )

    def finished(self, r: EngineRequest) -> None:
        assert r.first_token_ts is not None
        assert r.last_token_ts is not None
        assert r.scheduled_ts is not None
        assert r.finished_ts is not None
        labels = self.labels
        self.prompt_tokens.labels(**labels).inc(r.prompt_tokens)
        self.generation_tokens.labels(**labels).inc(r.generated)
        self.ttft.labels(**labels).observe(r.first_token_ts - r.arrival)
        for histogram in self.itl:
            for earlier, later in itertools.pairwise(r.token_ts):
                histogram.labels(**labels).observe(later - earlier)
        self.e2e.labels(**labels).observe(r.finished_ts - r.arrival)
        self.queue.labels(**labels).observe(r.time_in_queue)
        self.inference.labels(**labels).observe(r.last_token_ts - r.scheduled_ts)
        self.prefill.labels(**labels).observe(r.first_token_ts - r.scheduled_ts)
        self.decode.labels(**labels).observe(r.last_token_ts - r.first_token_ts)

    def render(self, waiting: int, running: int, kv_cache_usage: float) -> bytes:
        self.waiting.labels(**self.labels).set(waiting)
        self.running.labels(**self.labels).set(running)
        for gauge in self.cache_gauges:
            gauge.labels(**self.labels).set(kv_cache_usage)
        return generate_latest(self.registry)


class _Tracing:
    """vLLM's `llm_request` span: its own provider, OTLP/HTTP protobuf, batched."""

    def __init__(self, endpoint: str) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=5), schedule_delay_millis=100)
        )
        self.tracer = self.provider.get_tracer("vllm.llm_engine")
        self.propagator = TraceContextTextMapPropagator()

    def export(self, r: EngineRequest) -> None:
        assert r.queued_ts is not None
        assert r.scheduled_ts is not None
        assert r.finished_ts is not None
        first = r.first_token_ts if r.first_token_ts is not None else r.finished_ts
        last = r.last_token_ts if r.last_token_ts is not None else first
        body = r.body
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
            "gen_ai.response.finish_reasons": json.dumps([r.finish_reason or "abort"]),
        }
        sampling = {"top_p": 1.0, "temperature": 1.0, "n": 1} | {
            key: body[key] for key in ("top_p", "temperature", "n") if isinstance(body.get(key), (int, float))
        }
        if sampling["top_p"]:
            attributes["gen_ai.request.top_p"] = float(sampling["top_p"])
        if r.max_tokens:
            attributes["gen_ai.request.max_tokens"] = r.max_tokens
        if sampling["temperature"]:
            attributes["gen_ai.request.temperature"] = float(sampling["temperature"])
        if sampling["n"]:
            attributes["gen_ai.request.n"] = int(sampling["n"])
        context = self.propagator.extract(carrier=r.headers)
        span = self.tracer.start_span(
            "llm_request", context=context, kind=SpanKind.SERVER, attributes=attributes,
            start_time=int(r.arrival_time * 1e9),
        )  # fmt: skip
        if r.finish_reason is None:
            span.set_status(Status(StatusCode.ERROR, "aborted"))
        span.end()


def _prompt_tokens(path: str, body: dict[str, Any]) -> int:
    source = body.get("messages") if path.endswith("/chat/completions") else body.get("prompt")
    return max(1, _count_words(source))


def _error(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    return _dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    timeout = 30
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        self.server.sim._connections.add(self.connection)

    def finish(self) -> None:
        self.server.sim._connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        sim = self.server.sim
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send(200, b"")
        elif path == "/metrics":
            self._send(200, sim._render_metrics(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            model = sim.config.model
            card = {
                "id": model,
                "object": "model",
                "created": int(sim._started_at),
                "owned_by": "vllm",
                "root": model,
            }
            card |= {"parent": None, "max_model_len": sim.config.max_model_len}
            self._send(200, _dumps({"object": "list", "data": [card]}))
        else:
            self._send(404, _error(404, "Not Found", "NotFoundError"))

    def do_POST(self) -> None:
        sim = self.server.sim
        path = self.path.split("?", 1)[0]
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._send(404, _error(404, "Not Found", "NotFoundError"))
            return
        arrival_time, arrival = time.time(), time.perf_counter()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._send(400, _error(400, "request body must be a JSON object", "BadRequestError"))
            return
        model = body.get("model")
        if model != sim.config.model:
            message = f"The model `{model}` does not exist."
            self._send(404, _error(404, message, "NotFoundError", "model"))
            return
        stream = body.get("stream") is True
        options = body.get("stream_options")
        if options is not None and not stream:
            message = "Stream options can only be defined when `stream=True`."
            self._send(400, _error(400, message, "BadRequestError"))
            return
        prompt_tokens = _prompt_tokens(path, body)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            self._send(
                400, _error(400, f"max_tokens must be at least 1, got {max_tokens}.", "BadRequestError")
            )
            return
        if prompt_tokens + (max_tokens or 0) > sim.config.max_model_len:
            self._send(
                400, _error(400, "This model's maximum context length was exceeded.", "BadRequestError")
            )
            return
        chat = path.endswith("/chat/completions")
        request = EngineRequest(
            request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            path=path,
            headers={key.lower(): value for key, value in self.headers.items()},
            body=body,
            stream=stream,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            target_tokens=max_tokens if max_tokens is not None else sim.config.default_output_tokens,
            arrival_time=arrival_time,
            arrival=arrival,
        )
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        continuous = (
            include_usage and isinstance(options, dict) and options.get("continuous_usage_stats") is True
        )
        try:
            with sim._track(request):
                if stream:
                    self._stream(sim, request, chat, include_usage, continuous)
                else:
                    self._complete(sim, request, chat)
        except (OSError, _Stopped):
            self.close_connection = True  # the client went away or the server is stopping: aborted

    def _complete(self, sim: VLLMSimulator, r: EngineRequest, chat: bool) -> None:
        sim._run(r, lambda tokens, last: None)
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
            "created": int(r.arrival_time), "model": sim.config.model, "choices": [choice], "usage": _usage(r),
        }  # fmt: skip
        self._send(200, _dumps(answer))

    def _stream(
        self, sim: VLLMSimulator, r: EngineRequest, chat: bool, include_usage: bool, continuous: bool
    ) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        base: dict[str, Any] = {
            "id": r.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(r.arrival_time), "model": sim.config.model,
        }  # fmt: skip
        sent = 0

        def chunk(choice: dict[str, Any], completion_tokens: int) -> bytes:
            obj = {**base, "choices": [choice]}
            if continuous:
                obj["usage"] = _usage(r, completion_tokens)
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
                self.wfile.write(frame)
            r.chunk_sent.append(time.perf_counter())
            r.chunk_tokens.append(tokens)

        sim._run(r, emit)
        tail = []
        if include_usage:
            tail.append(_sse(_dumps({**base, "choices": [], "usage": _usage(r)})))
        tail.append(_DONE_FRAME + _TERMINATOR)
        for frame in tail:
            self.wfile.write(frame)


def _usage(r: EngineRequest, completion_tokens: int | None = None) -> dict[str, Any]:
    completion = r.generated if completion_tokens is None else completion_tokens
    return {
        "prompt_tokens": r.prompt_tokens,
        "total_tokens": r.prompt_tokens + completion,
        "completion_tokens": completion,
    }


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins the handler threads
    block_on_close = True
    sim: VLLMSimulator


class VLLMSimulator:
    """A vLLM-like server on 127.0.0.1 in background threads; a context manager.

    `otlp_traces_endpoint` is where `llm_request` spans go (a full OTLP/HTTP URL ending in
    `/v1/traces`), as `vllm serve --otlp-traces-endpoint` with
    `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`; None disables tracing.
    """

    def __init__(
        self, config: EngineConfig | None = None, *, otlp_traces_endpoint: str | None = None
    ) -> None:
        self.config = config if config is not None else EngineConfig()
        self._stopping = threading.Event()
        self._engine = _Engine(self.config, self._stopping)
        self._prometheus = _PrometheusMetrics(self.config)
        self._tracing = _Tracing(otlp_traces_endpoint) if otlp_traces_endpoint else None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._requests: list[EngineRequest] = []
        self._scrapes: list[Scrape] = []
        self._connections: set[socket.socket] = set()
        self._server: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._started_at = time.time()

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> VLLMSimulator:
        if self._server is not None:
            raise RuntimeError("a VLLMSimulator can be started only once")
        server = _HTTPServer((_HOST, 0), _Handler)
        server.sim = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="vllm-sim", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: waiting and running requests are abandoned, connections closed, threads joined."""
        server = self._server
        if server is None or self._stopping.is_set():
            return
        self._stopping.set()
        with self._engine.cond:
            self._engine.cond.notify_all()
        server.shutdown()
        for connection in list(self._connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        server.server_close()
        if self._thread is not None:
            self._thread.join(5)
        if self._tracing is not None:
            self._tracing.provider.shutdown()

    def __enter__(self) -> VLLMSimulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- what tests read ------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("server not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The server root (where `/metrics` is)."""
        return f"http://{_HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        """What to pass as an OpenAI client's `base_url`."""
        return f"{self.url}/v1"

    @property
    def requests(self) -> list[EngineRequest]:
        """Every API request, in arrival order."""
        with self._lock:
            return list(self._requests)

    @property
    def scrapes(self) -> list[Scrape]:
        with self._lock:
            return list(self._scrapes)

    def state(self) -> tuple[int, int, float]:
        """The scheduler now: (waiting, running, KV-cache usage)."""
        return self._engine.state()

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until no API request is being handled (records and spans are final)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    def wait_for_state(self, predicate: Callable[[int, int], bool], timeout: float = 5.0) -> bool:
        """Poll the scheduler until `predicate(waiting, running)` holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            waiting, running, _ = self.state()
            if predicate(waiting, running):
                return True
            time.sleep(0.002)
        return False

    def flush_traces(self, timeout: float = 5.0) -> bool:
        """Export the finished spans still waiting in the batch processor."""
        if self._tracing is None:
            return True
        return self._tracing.provider.force_flush(int(timeout * 1000))

    # --- serving --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _track(self, request: EngineRequest) -> Iterator[None]:
        with self._lock:
            self._requests.append(request)
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def _wait_until(self, deadline: float) -> None:
        remaining = deadline - time.perf_counter()
        if (remaining > 0 and self._stopping.wait(remaining)) or self._stopping.is_set():
            raise _Stopped

    def _run(self, r: EngineRequest, emit: Callable[[int, bool], None]) -> None:
        """Queue, prefill and decode one request; `emit(tokens, last)` writes a content chunk.

        The request finishes in the engine (slot released, metrics observed, span exported)
        before its last chunk is written, as in vLLM, where the output processor handles the
        finished request before the API server streams its final delta.
        """
        config = self.config
        self._engine.add(r)
        assert r.scheduled_ts is not None
        finished = False
        try:
            self._wait_until(r.scheduled_ts + r.prompt_tokens * config.prefill_per_token)
            pending = 0
            while r.generated < r.target_tokens:
                if r.token_ts:
                    self._wait_until(r.token_ts[-1] + config.decode_per_token)
                now = time.perf_counter()
                r.token_ts.append(now)
                if r.generated == 1:
                    r.first_token_ts = now
                pending += 1
                last = r.generated == r.target_tokens
                if last:
                    r.last_token_ts = now
                    r.finish_reason = "length" if r.max_tokens is not None else "stop"
                    self._finish(r)
                    finished = True
                if last or r.generated == 1 or pending >= config.stream_interval:
                    emit(pending, last)
                    pending = 0
        finally:
            if not finished:
                self._finish(r)  # aborted: the client went away or the server is stopping

    def _finish(self, r: EngineRequest) -> None:
        r.finished_ts = time.perf_counter()
        self._engine.release(r)
        if r.finish_reason is not None:
            self._prometheus.finished(r)
        if self._tracing is not None:
            self._tracing.export(r)

    def _render_metrics(self) -> bytes:
        waiting, running, kv_cache_usage = self._engine.state()
        with self._lock:
            self._scrapes.append(Scrape(time.perf_counter(), waiting, running, kv_cache_usage))
            return self._prometheus.render(waiting, running, kv_cache_usage)


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


class _ReceiverHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ReceiverServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.headers.get("content-encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces":
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        self.server.receiver._add(ExportTraceServiceRequest.FromString(body))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()


class _ReceiverServer(ThreadingHTTPServer):
    daemon_threads = True
    receiver: OTLPReceiver


class OTLPReceiver:
    """A tiny OTLP/HTTP (protobuf) trace receiver on 127.0.0.1; a context manager."""

    def __init__(self) -> None:
        self._server = _ReceiverServer((_HOST, 0), _ReceiverHandler)
        self._server.receiver = self
        self._cond = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="otlp-receiver",
            daemon=True,
        )

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    @property
    def traces_url(self) -> str:
        return f"http://{_HOST}:{self._server.server_address[1]}/v1/traces"

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
