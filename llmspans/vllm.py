"""vLLM: the server's queue, KV-cache and pressure signals, sampled in the background for the call spans.

    from llmspans.vllm import ServerMetrics

    with ServerMetrics("http://127.0.0.1:8000/v1", interval=1.0) as server:
        server.span_attributes()
        # {"vllm.num_requests_waiting": 3, "vllm.num_requests_running": 8,
        #  "vllm.kv_cache_usage": 0.93, "vllm.preemption_rate": 0.5, "vllm.metrics.age": 0.41}

Exports `ServerMetrics`, `ServerSnapshot` and `looks_like_vllm`.

**What is read.** vLLM's Prometheus `/metrics` (the server root's, whether `base_url` names the
root or the OpenAI `/v1` URL), each signal only when the server exposes its source (docs/telemetry.md
lists the releases):

- `vllm:num_requests_waiting` and `vllm:num_requests_running` (every release; a page without them
  is not vLLM's);
- the KV-cache usage: `vllm:kv_cache_usage_perc` (0.9.2 and later), else `vllm:gpu_cache_usage_perc`
  (up to 0.10.x, and the only one on the older engine that `--otlp-traces-endpoint` forces before 0.11);
- the preemption rate: the counter `vllm:num_preemptions` (0.9.2 and later, and the older engine),
  else the preemptions that 0.32's `vllm:request_num_preemptions` counted for finished requests;
- the prefix-cache hit ratio: `vllm:prefix_cache_hits` over `vllm:prefix_cache_queries` (0.9.2 and
  later; `vllm:gpu_prefix_cache_*` before), else 0.32's `vllm:prompt_tokens_cached` over
  `vllm:prompt_tokens`;
- `vllm:num_requests_waiting_by_reason{reason=capacity|deferred}` and the admission-rejection rate
  from `vllm:admission_rejections` (0.32).

Rates and the ratio are over the time between the last two successful reads. The text is parsed
with `prometheus_client`'s parser (the `vllm` extra: `pip install 'llmspans[vllm]'`), after the
lines of every other family are dropped (a 0.32 page is 50 KB; what is read is about 50 lines).

**On the call spans.** A call is stamped when it ends, with the freshest sample and the most
requests the server had waiting in any read taken between the moment the call was sent and its
first token (`vllm.num_requests_waiting_max`; for a call that did not stream, its whole answer).
A sample read once a second would miss a burst that queues for half a second, so a call still
waiting for its first token `late_after` seconds after it was sent makes the thread read at once
(at most one such read every `late_after`, however many calls wait): every call that waits
longer than that has a read taken while it waited. docs/telemetry.md says why this choice.

**Several series.** The series carry a `model_name` label (and `engine` on the newer engine). The
request counts and counters are **summed** over every series, so they are the whole server's backlog,
batch and events, whatever model alias or data-parallel engine holds them. The KV-cache usage is the **maximum**
over the series: each engine has its own cache, and the fullest one is the one that stalls
admission (summing fractions would be meaningless).

**How it behaves.** One daemon thread issues one GET per `interval`, with `timeout` on each
phase of the request and a cap on the body size, so its work is bounded; nothing runs on the
application's request path; it connects directly (no proxy from the environment), and its
requests are neither traced by OpenTelemetry's HTTP instrumentations nor logged by httpx at
INFO. `span_attributes()` only reads the latest sample: no I/O, no lock,
a handful of dictionary operations, safe from any thread (`watch()` appends to a deque,
`attributes_during()` also looks over the last reads' times). When the endpoint is down or serves
something else, the sampler logs one warning per outage on the `llmspans.vllm` logger and keeps
trying; `span_attributes()` then returns the last good sample with its growing age (or `{}` if
there never was one), while the gauges stop reporting until a sample succeeds again. The
thread stops on `close()`, at the end of a `with` block, within a quarter of a second of the
object being garbage collected, and at interpreter exit. At exit its last sample stays for the
gauges: the metric exporters' final export, which may run after the thread stopped, still
reports it. The thread imports nothing and the finalizer takes no lock (see `_Sampler` for why).

**Gauges.** While sampling, the values are also exported as OpenTelemetry gauges of the same
names as the span attributes (`vllm.num_requests_waiting`, `vllm.kv_cache_usage`,
`vllm.preemption_rate`, ...) with the server's `server.address` and `server.port`, through the
same meter provider as llmspans' other instruments.

**Recognising vLLM.** vLLM's `/v1/models` lists its models with `owned_by: "vllm"`
(`looks_like_vllm()` checks a decoded payload), but finding out takes a request to the server
before the first call, which `instrument()` will not make on its own: pass
`provider="vllm"` to `llmspans.instrument()` for a client pointed at vLLM.
"""

from __future__ import annotations

import atexit
import collections
import encodings.idna  # noqa: F401  (the socket module encodes host names with it; see _Sampler)
import logging
import math
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NamedTuple, Protocol

import httpx
from opentelemetry import context
from opentelemetry.util.types import AttributeValue

from llmspans import _internals, _metrics
from llmspans import _names as names
from llmspans._redact import url_for_log

__all__ = ["ServerMetrics", "ServerSnapshot", "looks_like_vllm"]

logger = logging.getLogger("llmspans.vllm")

_MAX_BODY_BYTES = 8 * 1024 * 1024  # a vLLM /metrics page is tens of KB; anything this big is not one
_ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"  # the classic text format, never OpenMetrics
_INSTALL_HINT = "llmspans.vllm.ServerMetrics needs prometheus-client: pip install 'llmspans[vllm]'"


def looks_like_vllm(models_payload: Mapping[str, Any]) -> bool:
    """Whether a decoded `GET /v1/models` answer comes from vLLM (a model `owned_by` "vllm").

    Anything that is not a model list gives False, never an exception.
    """
    if not isinstance(models_payload, Mapping):
        return False
    data = models_payload.get("data")
    if not isinstance(data, list):
        return False
    return any(isinstance(model, Mapping) and model.get("owned_by") == "vllm" for model in data)


class _Call(Protocol):
    """What the thread looks at on a call it watches (`llmspans._call.CallRecord`): whether it is over,
    and whether its first token came."""

    finished: bool
    first_chunk_ns: int


class _Read(NamedTuple):
    """When one successful read was sent and answered (`perf_counter_ns`, the call records' clock), and
    how many requests were waiting then."""

    sent_ns: int
    answered_ns: int
    waiting: int


_KEPT_READS = 256  # the reads a call ending now can look back on (four minutes at the default interval)
_WATCHED_MAX = 4096  # calls watched at once; past this the oldest are forgotten (they get no extra read)


@dataclass(frozen=True)
class ServerSnapshot:
    """One successful read of the server's `/metrics`.

    `kv_cache_usage` is a fraction (1.0 means the cache is full), None when the server exposes
    neither KV-cache gauge. `sampled_at` is the wall-clock time of the read (`time.time()`);
    the age is measured on the monotonic clock, so a wall-clock step does not distort it.

    The rest is None when the server does not expose its source (see the module docstring):
    `preemption_rate` and `admission_rejection_rate` are per second and `prefix_cache_hit_ratio`
    a fraction of the prompt tokens looked up, all three over the time since the previous
    successful read (None on the first read, after a counter went backwards, and for the ratio
    when nothing was looked up); the two waiting counts split `num_requests_waiting` by reason.
    """

    num_requests_waiting: int
    num_requests_running: int
    kv_cache_usage: float | None
    sampled_at: float
    monotonic: float = field(repr=False, compare=False)
    preemption_rate: float | None = None
    prefix_cache_hit_ratio: float | None = None
    num_requests_waiting_for_capacity: int | None = None
    num_requests_waiting_deferred: int | None = None
    admission_rejection_rate: float | None = None
    attributes: Mapping[str, AttributeValue] = field(repr=False, compare=False, default_factory=dict)

    @property
    def age(self) -> float:
        """Seconds since the read."""
        return max(0.0, time.monotonic() - self.monotonic)


class _Sampler:
    """The state the sampling thread shares with its `ServerMetrics`; it never refers back to it,
    so a `ServerMetrics` nobody holds any more can be collected (which stops the thread).

    Two rules keep the thread from ever disturbing the application:

    - **The thread imports nothing.** Everything it runs is imported at the top of this module or
      by `ServerMetrics.__init__`, and its HTTP transport is built by `start()`, all in the
      caller's thread before the thread starts. A module being imported sits half-initialised
      in `sys.modules` until its import ends, and the app's threads can find it there: the openai
      3.x SDK looks `httpx` up on every request, and the first call after
      `instrument(..., server_metrics=True)` failed with "partially initialized module 'httpx'"
      while this thread imported it. (`encodings.idna` is imported above because the socket
      module imports it on the first connection to a host name.)
    - **The finalizer only sets a flag.** Garbage collection can run a finalizer in any thread at
      any allocation, including while that thread holds `_live_lock` or an OpenTelemetry SDK
      lock. So `abandon()` (the `ServerMetrics` finalizer) only stores True in `abandoned`: no
      lock, no OpenTelemetry call, no join. The thread looks at the flag at least every
      `_ABANDON_POLL` seconds, then leaves `_live` and ends on its own.
    """

    def __init__(
        self,
        metrics_url: str,
        address: str,
        port: int,
        interval: float,
        timeout: float,
        families: Callable[[str], Iterable[Any]],
        late_after: float | None = None,
    ) -> None:
        self.metrics_url = metrics_url
        self.interval = interval
        self.timeout = timeout
        self.late_after_ns = None if late_after is None else round(late_after * 1e9)
        self.families = families  # prometheus_client's parser, imported by the caller
        self.gauge_attributes: dict[str, AttributeValue] = {
            names.SERVER_ADDRESS: address,
            names.SERVER_PORT: port,
        }
        self.snapshot: ServerSnapshot | None = None  # replaced whole, so readers need no lock
        self.reads: tuple[_Read, ...] = ()  # the last reads, oldest first; replaced whole likewise
        self.healthy = False  # whether the latest attempt succeeded
        self.abandoned = False  # set by the finalizer, and by nothing else
        self.exported = True  # whether the gauges report this sampler's samples
        self.sampled = threading.Condition()
        self.stopping = threading.Event()
        self.wake = threading.Event()  # a call to watch, or the end: look again before the pause is over
        # (when the call's read is due, when it was sent, the call), in the order they were sent;
        # appended by the app's threads, looked at and taken from the left by the thread only.
        self.watched: collections.deque[tuple[int, int, _Call]] = collections.deque(maxlen=_WATCHED_MAX)
        self.last_sent_ns = 0  # when the latest read was sent (thread only)
        self.last_read_sent_ns = 0  # ... and the latest that succeeded
        self.thread: threading.Thread | None = None
        self._in_outage = False
        self._timeouts = httpx.Timeout(timeout).as_dict()
        self._previous: _Reading | None = None  # the last good read, for the rates (thread only)

    # --- the thread (imports nothing: see the class docstring) -------------------------------

    def run(self, transport: httpx.HTTPTransport) -> None:
        # The sampler's own GETs are not the application's traffic: keep OpenTelemetry's HTTP
        # instrumentations (if the app installed any) from tracing them.
        suppressed = context.get_current()
        for key in (_internals.SUPPRESS_INSTRUMENTATION_KEY, _internals.SUPPRESS_HTTP_INSTRUMENTATION_KEY):
            if key is not None:
                suppressed = context.set_value(key, True, suppressed)
        context.attach(suppressed)
        try:
            with transport:
                regular = time.monotonic()
                while self.running:
                    started = time.monotonic()
                    if started >= regular or self._late_call_due() == 0:
                        if started >= regular:
                            regular = started + self.interval
                        self.sample_once(transport)
                    self._pause_until(regular)
        finally:
            self.watched.clear()
            if self.abandoned or not self.exported:  # at exit the last sample stays for the final export
                with _live_lock:
                    _live.discard(self)
            with self.sampled:
                self.sampled.notify_all()

    @property
    def running(self) -> bool:
        return not (self.stopping.is_set() or self.abandoned)

    def _pause_until(self, until: float) -> None:
        """Wait until `until` (monotonic) or until a watched call's read is due, waking at least every
        `_ABANDON_POLL` s to look at the flag, and at once when a call is watched or the sampler stops."""
        while self.running:
            remaining = until - time.monotonic()
            late = self._late_call_due()
            if late is not None:
                remaining = min(remaining, late / 1e9)
            if remaining <= 0:
                return
            if self.wake.wait(min(remaining, _ABANDON_POLL)):
                self.wake.clear()

    def _late_call_due(self) -> int | None:
        """Nanoseconds until a read is due for a watched call still waiting for its first token (0: now),
        None when no call needs one. A call needs one successful read sent at least `late_after` after
        it was sent; one read serves every call waiting then, reads are at least `late_after` apart, and
        none is made while the latest read failed (the regular reads go on)."""
        watched, late_after = self.watched, self.late_after_ns
        if late_after is None or not self.healthy:  # no extra reads of an endpoint that is failing
            return None
        last_sent = self.last_sent_ns
        while watched:
            due, _sent, call = watched[0]
            if call.finished or call.first_chunk_ns or self.last_read_sent_ns >= due:
                watched.popleft()  # answered, or a read was taken while it waited
                continue
            return max(0, max(due, last_sent + late_after) - time.perf_counter_ns())
        return None

    def sample_once(self, transport: httpx.HTTPTransport) -> None:
        self.last_sent_ns = sent = time.perf_counter_ns()
        try:
            text = self._fetch(transport)
            answered = time.perf_counter_ns()
            reading = _Reading.parse(self.families(_wanted_lines(text)), time.monotonic())
            snapshot = reading.snapshot(self._previous)
        except Exception as error:  # whatever went wrong, the thread carries on
            self._failed(error)
            return
        self._previous = reading
        self.snapshot = snapshot
        self.reads = (*self.reads[1 - _KEPT_READS :], _Read(sent, answered, reading.waiting))
        self.last_read_sent_ns = sent
        self.healthy = True
        if self._in_outage:
            self._in_outage = False
            logger.info("llmspans: vLLM metrics at %s are readable again", url_for_log(self.metrics_url))
        with self.sampled:
            self.sampled.notify_all()

    def _fetch(self, transport: httpx.HTTPTransport) -> str:
        request = httpx.Request(
            "GET", self.metrics_url, headers={"accept": _ACCEPT}, extensions={"timeout": self._timeouts}
        )
        response = transport.handle_request(request)
        try:
            if response.status_code != 200:
                raise _NotMetrics(f"HTTP {response.status_code}")
            stream = response.stream
            assert isinstance(stream, httpx.SyncByteStream)  # what a sync transport returns
            body = bytearray()
            for piece in stream:
                body += piece
                if len(body) > _MAX_BODY_BYTES:
                    raise _NotMetrics(f"body larger than {_MAX_BODY_BYTES} bytes")
        finally:
            response.close()
        return body.decode("utf-8", errors="replace")

    def _failed(self, error: BaseException) -> None:
        self.healthy = False
        reason = str(error) or type(error).__name__
        if not self._in_outage:
            self._in_outage = True
            logger.warning(
                "llmspans: cannot read vLLM metrics from %s (%s); span attributes keep the last sample, "
                "retrying every %gs",
                url_for_log(self.metrics_url), reason, self.interval,
            )  # fmt: skip
        else:
            logger.debug(
                "llmspans: vLLM metrics still unreadable at %s (%s)", url_for_log(self.metrics_url), reason
            )

    # --- control (the caller's thread) ------------------------------------------------------

    def start(self) -> None:
        # A bare transport rather than an httpx.Client: a client logs every request at INFO,
        # which would put a line in the app's logs every interval. Built here, not in the thread,
        # because building it imports httpcore and loads the certificates. A plain-HTTP URL never
        # uses TLS, so it skips loading the certificate bundle.
        transport = httpx.HTTPTransport(retries=0, verify=self.metrics_url.startswith("https:"))
        thread = threading.Thread(
            target=self.run, args=(transport,), name="llmspans-vllm-metrics", daemon=True
        )
        self.thread = thread
        with _live_lock:
            _live.add(self)
        thread.start()

    def stop(self, keep_exporting: bool = False) -> None:
        """Stop the thread and wait for it: at most one request's timeouts plus a little. With
        `keep_exporting` (at interpreter exit) the gauges keep reporting the last sample, for the
        final export that may come after.

        Never from a finalizer (it takes `_live_lock` and joins): that is `abandon()`.
        """
        self.exported = keep_exporting
        self.stopping.set()
        self.wake.set()
        if not keep_exporting:
            with _live_lock:
                _live.discard(self)
        with self.sampled:
            self.sampled.notify_all()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=4 * self.timeout + 1.0)

    def abandon(self) -> None:
        """The `ServerMetrics` finalizer: a plain attribute store, the only thing safe in one."""
        self.abandoned = True


_ABANDON_POLL = 0.25  # how soon the thread of a collected ServerMetrics notices and ends


class _NotMetrics(Exception):
    """The endpoint answered, but not with vLLM's metrics."""


def _add(a: float, b: float) -> float:
    return a + b


# vLLM family -> (the sample read: its name's suffix, how the series combine). Counts are summed over
# every series (model aliases, data-parallel engines); the KV-cache usage is the fullest engine's.
_WANTED: dict[str, tuple[str, Callable[[float, float], float]]] = {
    names.PROMETHEUS_VLLM_NUM_REQUESTS_WAITING: ("", _add),
    names.PROMETHEUS_VLLM_NUM_REQUESTS_RUNNING: ("", _add),
    names.PROMETHEUS_VLLM_KV_CACHE_USAGE: ("", max),
    names.PROMETHEUS_VLLM_GPU_CACHE_USAGE: ("", max),
    names.PROMETHEUS_VLLM_NUM_PREEMPTIONS: ("_total", _add),
    names.PROMETHEUS_VLLM_REQUEST_NUM_PREEMPTIONS: ("_sum", _add),  # a histogram: preemptions it counted
    names.PROMETHEUS_VLLM_PREFIX_CACHE_QUERIES: ("_total", _add),
    names.PROMETHEUS_VLLM_PREFIX_CACHE_HITS: ("_total", _add),
    names.PROMETHEUS_VLLM_GPU_PREFIX_CACHE_QUERIES: ("_total", _add),
    names.PROMETHEUS_VLLM_GPU_PREFIX_CACHE_HITS: ("_total", _add),
    names.PROMETHEUS_VLLM_PROMPT_TOKENS: ("_total", _add),
    names.PROMETHEUS_VLLM_PROMPT_TOKENS_CACHED: ("_total", _add),
    names.PROMETHEUS_VLLM_ADMISSION_REJECTIONS: ("_total", _add),
}
_REASONS = (names.PROMETHEUS_VLLM_REASON_CAPACITY, names.PROMETHEUS_VLLM_REASON_DEFERRED)


def _first(totals: Mapping[str, float], *candidates: str) -> float | None:
    """The first of `candidates` the page had (a current name before the older one)."""
    for name in candidates:
        if name in totals:
            return totals[name]
    return None


@dataclass(frozen=True)
class _Reading:
    """One `/metrics` page reduced to what llmspans uses: the gauges, and the counters' totals at
    `monotonic`, from which two consecutive reads make rates."""

    waiting: int
    running: int
    kv_cache_usage: float | None
    waiting_by_reason: Mapping[str, int]
    preemptions: float | None
    prefix_lookups: tuple[float, float] | None  # (tokens queried, tokens found)
    admission_rejections: float | None
    monotonic: float

    @classmethod
    def parse(cls, families: Iterable[Any], monotonic: float) -> _Reading:
        totals: dict[str, float] = {}
        by_reason: dict[str, float] = {}
        for family in families:
            if family.name == names.PROMETHEUS_VLLM_NUM_REQUESTS_WAITING_BY_REASON:
                for sample in family.samples:
                    reason = sample.labels.get("reason")
                    if sample.name == family.name and reason in _REASONS and not math.isnan(sample.value):
                        by_reason[reason] = by_reason.get(reason, 0.0) + sample.value
                continue
            wanted = _WANTED.get(family.name)
            if wanted is None:
                continue
            suffix, combine = wanted
            for sample in family.samples:
                if sample.name != family.name + suffix or math.isnan(sample.value):
                    continue
                previous = totals.get(family.name)
                totals[family.name] = sample.value if previous is None else combine(previous, sample.value)
        waiting = totals.get(names.PROMETHEUS_VLLM_NUM_REQUESTS_WAITING)
        running = totals.get(names.PROMETHEUS_VLLM_NUM_REQUESTS_RUNNING)
        if waiting is None or running is None:
            raise _NotMetrics(
                f"no {names.PROMETHEUS_VLLM_NUM_REQUESTS_WAITING} / {names.PROMETHEUS_VLLM_NUM_REQUESTS_RUNNING} "
                "gauges: is this a vLLM server?"
            )
        queries = _first(
            totals, names.PROMETHEUS_VLLM_PREFIX_CACHE_QUERIES, names.PROMETHEUS_VLLM_GPU_PREFIX_CACHE_QUERIES
        )
        hits = _first(
            totals, names.PROMETHEUS_VLLM_PREFIX_CACHE_HITS, names.PROMETHEUS_VLLM_GPU_PREFIX_CACHE_HITS
        )
        lookups = None if queries is None or hits is None else (queries, hits)
        if lookups is None:  # 0.32 also counts the prompt tokens served from the cache
            prompt = totals.get(names.PROMETHEUS_VLLM_PROMPT_TOKENS)
            cached = totals.get(names.PROMETHEUS_VLLM_PROMPT_TOKENS_CACHED)
            lookups = None if prompt is None or cached is None else (prompt, cached)
        return cls(
            waiting=round(waiting),
            running=round(running),
            kv_cache_usage=_first(
                totals, names.PROMETHEUS_VLLM_KV_CACHE_USAGE, names.PROMETHEUS_VLLM_GPU_CACHE_USAGE
            ),
            waiting_by_reason={reason: round(count) for reason, count in by_reason.items()},
            preemptions=_first(
                totals, names.PROMETHEUS_VLLM_NUM_PREEMPTIONS, names.PROMETHEUS_VLLM_REQUEST_NUM_PREEMPTIONS
            ),
            prefix_lookups=lookups,
            admission_rejections=totals.get(names.PROMETHEUS_VLLM_ADMISSION_REJECTIONS),
            monotonic=monotonic,
        )

    def snapshot(self, previous: _Reading | None) -> ServerSnapshot:
        """This read as a snapshot; the rates are over the time since `previous` (None: no rates)."""
        elapsed = None if previous is None else self.monotonic - previous.monotonic
        preemption_rate = rejection_rate = hit_ratio = None
        if previous is not None and elapsed is not None and elapsed > 0:
            preemption_rate = _rate(self.preemptions, previous.preemptions, elapsed)
            rejection_rate = _rate(self.admission_rejections, previous.admission_rejections, elapsed)
            if self.prefix_lookups is not None and previous.prefix_lookups is not None:
                queried = self.prefix_lookups[0] - previous.prefix_lookups[0]
                found = self.prefix_lookups[1] - previous.prefix_lookups[1]
                if queried > 0 and 0 <= found <= queried:
                    hit_ratio = found / queried
        for_capacity = self.waiting_by_reason.get(names.PROMETHEUS_VLLM_REASON_CAPACITY)
        deferred = self.waiting_by_reason.get(names.PROMETHEUS_VLLM_REASON_DEFERRED)
        attributes: dict[str, AttributeValue] = {}
        for attribute, value in (
            (names.VLLM_NUM_REQUESTS_WAITING, self.waiting),
            (names.VLLM_NUM_REQUESTS_RUNNING, self.running),
            (names.VLLM_KV_CACHE_USAGE, self.kv_cache_usage),
            (names.VLLM_PREEMPTION_RATE, preemption_rate),
            (names.VLLM_PREFIX_CACHE_HIT_RATIO, hit_ratio),
            (names.VLLM_NUM_REQUESTS_WAITING_FOR_CAPACITY, for_capacity),
            (names.VLLM_NUM_REQUESTS_WAITING_DEFERRED, deferred),
            (names.VLLM_ADMISSION_REJECTION_RATE, rejection_rate),
        ):
            if value is not None:
                attributes[attribute] = value
        return ServerSnapshot(
            num_requests_waiting=self.waiting,
            num_requests_running=self.running,
            kv_cache_usage=self.kv_cache_usage,
            sampled_at=time.time(),
            monotonic=self.monotonic,
            preemption_rate=preemption_rate,
            prefix_cache_hit_ratio=hit_ratio,
            num_requests_waiting_for_capacity=for_capacity,
            num_requests_waiting_deferred=deferred,
            admission_rejection_rate=rejection_rate,
            attributes=attributes,
        )


def _rate(now: float | None, before: float | None, elapsed: float) -> float | None:
    """Per second between two counter totals; None when either is missing or the counter went back
    (the server restarted)."""
    if now is None or before is None or now < before:
        return None
    return (now - before) / elapsed


_live: set[_Sampler] = set()
_live_lock = threading.Lock()


@atexit.register
def _stop_all() -> None:
    """At interpreter exit, end every sampling thread before the interpreter tears down; the last
    samples stay readable for the gauges. The meter provider's own exit hook makes the final export,
    and whichever of the two runs first (atexit runs the last registered first, and this module is
    often imported after `configure()`), that export still reports the server's gauges."""
    with _live_lock:
        samplers = list(_live)
    for sampler in samplers:
        sampler.stopping.set()
        sampler.wake.set()
    for sampler in samplers:
        sampler.stop(keep_exporting=True)


def _fresh_readings() -> list[tuple[ServerSnapshot, Mapping[str, AttributeValue]]]:
    """The latest sample of every running sampler whose latest attempt succeeded, with its gauge
    attributes; what llmspans' observable gauges report (see `llmspans._metrics`)."""
    with _live_lock:
        samplers: Iterable[_Sampler] = list(_live)
    readings: list[tuple[ServerSnapshot, Mapping[str, AttributeValue]]] = []
    for sampler in samplers:
        snapshot = sampler.snapshot
        if snapshot is not None and sampler.healthy and not sampler.abandoned and sampler.exported:
            readings.append((snapshot, sampler.gauge_attributes))
    return readings


_metrics.read_vllm_samplers_with(_fresh_readings)


_FAMILY_SUFFIXES = ("_total", "_created", "_sum", "_count", "_bucket")
_READ_FAMILIES = frozenset((*_WANTED, names.PROMETHEUS_VLLM_NUM_REQUESTS_WAITING_BY_REASON))


def _wanted_lines(text: str) -> str:
    """The page without the lines of families the sampler does not read (histograms, per-source counters,
    the process' own metrics): parsing what is left costs a tenth of parsing the whole page."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            words = line.split(" ", 3)  # "# TYPE name type", "# HELP name text"
            name = words[2] if len(words) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _READ_FAMILIES or any(
            name.endswith(suffix) and name[: -len(suffix)] in _READ_FAMILIES for suffix in _FAMILY_SUFFIXES
        ):  # a sample, or a comment that names the family with its sample's suffix (older clients)
            kept.append(line)
    return "\n".join(kept) + "\n"


def _metrics_url(base_url: str) -> tuple[str, str, int]:
    """`/metrics` at the server root (a trailing `/v1` is the OpenAI API's, not the server's)."""
    parts = urllib.parse.urlsplit(base_url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"base_url must be an http(s) URL such as 'http://127.0.0.1:8000/v1', got {base_url!r}"
        )
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"base_url has an invalid port: {base_url!r}") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path + "/metrics", "", ""))
    return url, parts.hostname, port


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


class ServerMetrics:
    """Samples a vLLM server's `/metrics` in one background thread; see the module docstring.

    `base_url` is the server root or its OpenAI `/v1` URL (`http://host:8000/v1`). Sampling
    starts at once; the first sample arrives within `timeout` of construction when the server
    is up. `interval` is the time between the starts of two reads, `timeout` bounds each phase
    of one read (connect, send, receive). A call it watches (see `watch`) that still waits for
    its first token `late_after` seconds after it was sent makes it read at once, at most one such
    read every `late_after`; None reads only every `interval`.
    """

    def __init__(
        self, base_url: str, *, interval: float = 1.0, timeout: float = 0.5, late_after: float | None = 0.1
    ) -> None:
        if not isinstance(base_url, str):
            raise TypeError(f"base_url must be a str such as 'http://127.0.0.1:8000/v1', got {base_url!r}")
        metrics_url, address, port = _metrics_url(base_url)
        interval = _seconds(interval, "interval")
        timeout = _seconds(timeout, "timeout")
        if late_after is not None:
            late_after = _seconds(late_after, "late_after")
        try:
            from prometheus_client.parser import text_string_to_metric_families
        except ImportError as error:
            raise ImportError(_INSTALL_HINT) from error
        self._sampler = _Sampler(
            metrics_url, address, port, interval, timeout, text_string_to_metric_families, late_after
        )
        self._closed = False
        self._sampler.start()
        # Collection only flags the thread to end (see _Sampler); interpreter exit stops every
        # sampler through _stop_all instead.
        self._finalizer = weakref.finalize(self, _Sampler.abandon, self._sampler)
        self._finalizer.atexit = False

    @property
    def metrics_url(self) -> str:
        """The URL read: `/metrics` at the server root."""
        return self._sampler.metrics_url

    @property
    def interval(self) -> float:
        return self._sampler.interval

    @property
    def timeout(self) -> float:
        return self._sampler.timeout

    @property
    def late_after(self) -> float | None:
        late_after = self._sampler.late_after_ns
        return None if late_after is None else late_after / 1e9

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def snapshot(self) -> ServerSnapshot | None:
        """The latest successful sample, however old; None before the first one or after `close()`."""
        return None if self._closed else self._sampler.snapshot

    def span_attributes(self) -> dict[str, AttributeValue]:
        """The latest sample as call-span attributes, with `vllm.metrics.age` in seconds.

        `{}` before the first sample and after `close()`. No I/O and no lock: cheap enough
        to call as each call is admitted.
        """
        snapshot = self.snapshot
        if snapshot is None:
            return {}
        attributes = dict(snapshot.attributes)
        attributes[names.VLLM_METRICS_AGE] = max(0.0, time.monotonic() - snapshot.monotonic)
        return attributes

    def watch(self, call: _Call) -> None:
        """A call was just sent to the server: read the server while it waits if its first token is
        late (see the class). For llmspans' call records; an append, and a wake-up when no other call
        was waiting."""
        sampler = self._sampler
        late_after = sampler.late_after_ns
        if late_after is None or self._closed:
            return
        sent = time.perf_counter_ns()
        watched = sampler.watched
        watched.append((sent + late_after, sent, call))
        if len(watched) == 1:
            sampler.wake.set()

    def attributes_during(self, sent_ns: int, answered_ns: int) -> dict[str, AttributeValue]:
        """A call's attributes once it is over: `span_attributes()` (the freshest sample) and, when a
        read was sent and answered between `sent_ns` and `answered_ns` (`perf_counter_ns`: the call
        was sent, its first token or whole answer came), the most requests waiting in those reads as
        `vllm.num_requests_waiting_max`."""
        attributes = self.span_attributes()
        if attributes:
            most = -1
            for read in reversed(self._sampler.reads):  # newest first: the call's reads are the last few
                if read.sent_ns < sent_ns:
                    break
                if read.answered_ns <= answered_ns and read.waiting > most:
                    most = read.waiting
            if most >= 0:
                attributes[names.VLLM_NUM_REQUESTS_WAITING_MAX] = most
        return attributes

    def wait_for_sample(self, timeout: float) -> bool:
        """Block until a sample newer than this call exists (True) or `timeout` seconds pass (False).

        For start-up and tests; the instrumentation itself never waits.
        """
        timeout = _seconds(timeout, "timeout")
        sampler = self._sampler
        since = time.monotonic()

        def fresh() -> bool:
            snapshot = sampler.snapshot
            return self._closed or (snapshot is not None and snapshot.monotonic >= since)

        with sampler.sampled:
            sampler.sampled.wait_for(fresh, timeout)
        return not self._closed and fresh()

    def close(self) -> None:
        """Stop sampling and wait for the thread to end; harmless to call again."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self._sampler.stop()

    def __enter__(self) -> ServerMetrics:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"every {self.interval:g}s"
        return f"<ServerMetrics {self.metrics_url} {state}>"
