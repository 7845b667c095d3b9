"""The simulator's capacity model: a vLLM-like engine with batch slots, a queue and a KV cache.

Without it the simulated server answers every request at once, however many arrive, so a load test
never finds a knee. With it (`SimulatedServer(capacity=Capacity(...))`, or `python -m
llmspans.tools.simulator --slots 4`), an API request is timed the way vLLM's scheduler times it:

- it spends `frontend_delay` in the front end, then waits in one FIFO queue;
- it is admitted while fewer than `slots` run (vLLM's `--max-num-seqs`) and its KV-cache blocks fit in
  `kv_blocks` (`block_size` tokens each; full prompt blocks are shared between requests with the same
  prefix); nothing overtakes a request that does not fit;
- it prefills its uncached prompt tokens at `prefill_per_token`, then decodes one token every
  `decode_per_token`; a running request that needs a block when none is free preempts the latest
  admitted one, which goes back to the head of the queue and recomputes its prompt and output;
- with `prefix_caching`, an admitted request's leading full blocks already seen are not prefilled again
  (at least one prompt token always is, as in vLLM);
- with `max_waiting`, a request arriving at a full queue is rejected (the server answers 503).

A prompt's tokens are its whitespace-separated words. `Engine.metrics_text()` is the server's
`/metrics`: Prometheus text with vLLM's own names (`vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, the preemption, prefix-cache and token
counters), labelled `model_name` and `engine` as vLLM's newer engine labels them, so `llmspans load
--provider vllm` and `llmspans.vllm.ServerMetrics` read it as they read vLLM's.

All monotonic stamps on `EngineRequest` are `time.perf_counter()` seconds in the server's process.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Capacity", "Engine", "EngineEvents", "EngineRequest", "Stopped", "words"]


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """How much the simulated server can do at once, and how fast; every field has a working default."""

    slots: int = 4
    prefill_per_token: float = 0.001
    decode_per_token: float = 0.01
    frontend_delay: float = 0.0
    block_size: int = 16
    kv_blocks: int = 1024
    prefix_caching: bool = True
    max_waiting: int | None = None
    stream_interval: int = 1  # tokens per streamed chunk (vLLM's --stream-interval)
    model: str = "sim-model"  # the `model_name` label of /metrics

    def __post_init__(self) -> None:
        """Reject nonsense early, so a typo fails loudly instead of hanging a load test."""
        for name in ("slots", "block_size", "kv_blocks", "stream_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("prefill_per_token", "decode_per_token", "frontend_delay"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if self.max_waiting is not None and (not isinstance(self.max_waiting, int) or self.max_waiting < 0):
            raise ValueError(f"max_waiting must be None or a non-negative int, got {self.max_waiting!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")


def words(obj: Any) -> list[str]:
    """A prompt's tokens, one per whitespace-separated word (token-id arrays: one per id)."""
    if isinstance(obj, str):
        return obj.split()
    if isinstance(obj, bool):
        return []
    if isinstance(obj, int):
        return [str(obj)]
    if isinstance(obj, list):
        return [word for item in obj for word in words(item)]
    if isinstance(obj, dict):
        return [
            word for key in ("content", "text", "input", "output") if key in obj for word in words(obj[key])
        ]
    return []


@dataclass(kw_only=True)
class EngineRequest:
    """One request's life in the engine; monotonic stamps are `time.perf_counter()` seconds."""

    request_id: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    stream: bool
    words: list[str] = field(repr=False)  # the prompt's tokens, one per word
    max_tokens: int | None
    target_tokens: int
    arrival_time: float  # wall clock, as vLLM's `arrival_time`
    arrival: float  # the same instant on the monotonic clock
    deferred_until: float | None = None  # not admitted before this (vLLM: while its grammar compiles)
    queued_ts: float | None = None
    scheduled_ts: float | None = None  # first admission
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    finished_ts: float | None = None
    token_ts: list[float] = field(default_factory=list)
    chunk_sent: list[float] = field(default_factory=list)  # after each content chunk's write
    chunk_tokens: list[int] = field(default_factory=list)  # tokens carried by each content chunk
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at the first admission
    preemptions: int = 0
    recomputes: list[tuple[float, int]] = field(default_factory=list)  # (readmitted at, tokens to compute)
    steps: int = 0  # engine steps that computed something for this request
    compute_time: float = 0.0  # seconds of those steps (prefills and decodes)
    # The engine's view while it runs: when it was last admitted, how many tokens that admission
    # computes before the next token, and its full prompt blocks (shared by content).
    admissions: int = field(default=0, repr=False)
    admitted_ts: float | None = field(default=None, repr=False)
    to_compute: int = field(default=0, repr=False)
    prompt_blocks: tuple[int, ...] = field(default=(), repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.words)

    @property
    def generated(self) -> int:
        return len(self.token_ts)

    @property
    def time_in_queue(self) -> float:
        """From when the engine queued the request to its first admission."""
        assert self.scheduled_ts is not None
        assert self.queued_ts is not None
        return self.scheduled_ts - self.queued_ts


class EngineEvents(Protocol):
    """What the engine tells its metrics as it happens."""

    def preempted(self) -> None: ...
    def rejected(self) -> None: ...
    def prefix_lookup(self, queried: int, hit: int) -> None: ...
    def finished(self, r: EngineRequest) -> None: ...


class Stopped(Exception):
    """The server is stopping: the request is abandoned."""


class _Counters:
    """The engine's own counters, for `/metrics` (thread-safe: one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values = dict.fromkeys(
            (
                "preemptions",
                "prefix_queries",
                "prefix_hits",
                "prompt_tokens",
                "generation_tokens",
                "rejections",
            ),
            0,
        )

    def add(self, **amounts: int) -> None:
        with self.lock:
            for name, amount in amounts.items():
                self.values[name] += amount

    def preempted(self) -> None:
        self.add(preemptions=1)

    def rejected(self) -> None:
        self.add(rejections=1)

    def prefix_lookup(self, queried: int, hit: int) -> None:
        self.add(prefix_queries=queried, prefix_hits=hit)

    def finished(self, r: EngineRequest) -> None:
        self.add(prompt_tokens=r.prompt_tokens, generation_tokens=r.generated)


_GAUGES = (
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("vllm:num_requests_running", "Number of requests in model execution batches."),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
)
_COUNTERS = (
    ("vllm:num_preemptions", "preemptions", "Cumulative number of preemption from the engine."),
    (
        "vllm:prefix_cache_queries",
        "prefix_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    ("vllm:prefix_cache_hits", "prefix_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens", "Number of generation tokens processed."),
)


class Engine:
    """The scheduler, the KV-cache blocks and the prefix cache (see the module docstring).

    `run(request, emit)` takes one request through the front end, the queue, prefill and decode in the
    calling thread (the server's thread for that connection); `emit(tokens, last)` writes its chunks.
    `events` hears of preemptions, rejections, prefix lookups and finished requests; the engine always
    keeps its own counters for `metrics_text()` as well.
    """

    def __init__(self, capacity: Capacity, events: EngineEvents | None = None) -> None:
        self.capacity = capacity
        self.counters = _Counters()
        self.events: EngineEvents = self.counters if events is None else _Both(self.counters, events)
        self.stopping = threading.Event()
        self.cond = threading.Condition()
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self.running: list[EngineRequest] = []
        self.cached_blocks: collections.OrderedDict[int, None] = collections.OrderedDict()

    def stop(self) -> None:
        """Abandon every waiting and running request (their `run` raises `Stopped`)."""
        self.stopping.set()
        with self.cond:
            self.cond.notify_all()

    def admitting(self) -> bool:
        """Whether the scheduler admits now (called under `cond`); a subclass may hold admissions."""
        return True

    # --- blocks ---------------------------------------------------------------------------------

    def _blocks(self, requests: list[EngineRequest], grow: EngineRequest | None = None) -> int:
        """KV blocks the requests hold (shared prompt blocks once), `grow` holding one token more."""
        size = self.capacity.block_size
        shared: set[int] = set()
        private = 0
        for r in requests:
            tokens = r.prompt_tokens + r.generated + (1 if r is grow else 0)
            shared.update(r.prompt_blocks)
            private += math.ceil(tokens / size) - len(r.prompt_blocks)
        return len(shared) + private

    def kv_cache_usage(self) -> float:
        return min(1.0, self._blocks(self.running) / self.capacity.kv_blocks)

    def fits_alone(self, prompt_tokens: int, output_tokens: int) -> bool:
        """Whether a request could ever run: its prompt and output in the whole KV cache."""
        return (
            math.ceil((prompt_tokens + output_tokens) / self.capacity.block_size) <= self.capacity.kv_blocks
        )

    def _block_hashes(self, tokens: list[str]) -> tuple[int, ...]:
        size = self.capacity.block_size
        hashes, previous = [], 0
        for start in range(0, len(tokens) - size + 1, size):
            previous = hash((previous, tuple(tokens[start : start + size])))
            hashes.append(previous)
        return tuple(hashes)

    # --- scheduling (under self.cond) -------------------------------------------------------------

    def rejects(self) -> bool:
        """Admission control: whether the queue is full now (`max_waiting`); counted when it is."""
        limit = self.capacity.max_waiting
        if limit is None:
            return False
        with self.cond:
            if len(self.waiting) < limit:
                return False
        self.events.rejected()
        return True

    def add(self, r: EngineRequest) -> None:
        """Queue the request and block until the scheduler admits it."""
        with self.cond:
            r.queued_ts = time.perf_counter()
            self.waiting.append(r)
            self._wait_admitted(r)

    def _wait_admitted(self, r: EngineRequest) -> None:
        while True:
            self.schedule()
            if r in self.running:
                return
            if self.stopping.is_set():
                if r in self.waiting:
                    self.waiting.remove(r)
                raise Stopped
            deferred = r.deferred_until
            timeout = None if deferred is None else max(0.0, deferred - time.perf_counter()) + 0.0005
            self.cond.wait(timeout)

    def schedule(self) -> None:
        """Admit from the head of the queue while a slot is free and the request's blocks fit."""
        now = time.perf_counter()
        index = 0
        while self.admitting() and index < len(self.waiting) and len(self.running) < self.capacity.slots:
            candidate = self.waiting[index]
            if candidate.deferred_until is not None and candidate.deferred_until > now:
                index += 1  # skipped while deferred
                continue
            blocks = self._block_hashes(candidate.words)
            candidate.prompt_blocks = blocks
            if self._blocks([*self.running, candidate], grow=candidate) > self.capacity.kv_blocks:
                candidate.prompt_blocks = ()
                break  # first come, first served: nothing overtakes a request that does not fit
            del self.waiting[index]
            self._admit(candidate, now)
        self.cond.notify_all()

    def _admit(self, r: EngineRequest, now: float) -> None:
        tokens = r.prompt_tokens + r.generated
        cached = 0
        if self.capacity.prefix_caching:
            usable = (tokens - 1) // self.capacity.block_size  # at least one token is always computed
            for block in r.prompt_blocks[:usable]:
                if block not in self.cached_blocks:
                    break
                cached += self.capacity.block_size
            self.events.prefix_lookup(queried=tokens, hit=cached)
            for block in r.prompt_blocks:
                self.cached_blocks[block] = None
                self.cached_blocks.move_to_end(block)
            while len(self.cached_blocks) > self.capacity.kv_blocks:
                self.cached_blocks.popitem(last=False)
        if r.scheduled_ts is None:
            r.scheduled_ts = now
            r.cached_tokens = cached
        else:
            r.recomputes.append((now, tokens - cached))
        r.admissions += 1
        r.admitted_ts = now
        r.to_compute = tokens - cached
        self.running.append(r)

    def _step(self, r: EngineRequest, admission: int) -> bool:
        """Room for `r`'s next token, preempting the latest admitted requests if need be; False
        when the computation since `admission` was lost (`r` was preempted meanwhile, or now)."""
        with self.cond:
            while r in self.running and self._blocks(self.running, grow=r) > self.capacity.kv_blocks:
                self._preempt(self.running[-1])
            return r in self.running and r.admissions == admission

    def _preempt(self, victim: EngineRequest) -> None:
        self.running.remove(victim)
        victim.prompt_blocks = ()
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        self.events.preempted()
        self.cond.notify_all()

    def _readmit(self, r: EngineRequest) -> None:
        """After a preemption: wait at the head of the queue until admitted again."""
        with self.cond:
            self._wait_admitted(r)

    def _release(self, r: EngineRequest) -> None:
        with self.cond:
            if r in self.running:
                self.running.remove(r)
            elif r in self.waiting:
                self.waiting.remove(r)
            self.schedule()

    def state(self) -> tuple[int, int, float, int]:
        """(waiting, running, KV-cache usage, of the waiting: deferred) now."""
        now = time.perf_counter()
        with self.cond:
            deferred = sum(1 for r in self.waiting if r.deferred_until is not None and r.deferred_until > now)
            return len(self.waiting), len(self.running), self.kv_cache_usage(), deferred

    # --- one request, in its connection's thread --------------------------------------------------

    def _wait_until(self, deadline: float) -> None:
        remaining = deadline - time.perf_counter()
        if (remaining > 0 and self.stopping.wait(remaining)) or self.stopping.is_set():
            raise Stopped

    def run(self, r: EngineRequest, emit: Callable[[int, bool], None]) -> None:
        """Front end, queue, prefill and decode one request; `emit(tokens, last)` writes a content chunk.

        The request finishes in the engine (slot released, `events.finished`) before its last chunk is
        written, as in vLLM, where the output processor handles the finished request before the API
        server streams its final delta. A request that does not finish (the client went away, the
        server stops) is aborted: its slot is freed, no `finished` event. `Stopped` when the server stops.
        """
        capacity = self.capacity
        self._wait_until(r.arrival + capacity.frontend_delay)
        self.add(r)
        finished = False
        try:
            pending = 0
            admission, prefill, due = self._admitted(r)
            while True:
                self._wait_until(due)
                if not self._step(r, admission):  # preempted: back to the queue, then recompute
                    self._readmit(r)
                    admission, prefill, due = self._admitted(r)
                    continue
                now = time.perf_counter()
                r.steps += 1
                r.compute_time += prefill if prefill else capacity.decode_per_token
                prefill = 0.0
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
                if last or r.generated == 1 or pending >= capacity.stream_interval:
                    emit(pending, last)
                    pending = 0
                if last:
                    return
                due = now + capacity.decode_per_token
        finally:
            if not finished:
                self._finish(r)  # aborted: the client went away or the server is stopping

    def _admitted(self, r: EngineRequest) -> tuple[int, float, float]:
        """The latest admission, its prefill (or recompute) time, and when its next token is due."""
        assert r.admitted_ts is not None
        prefill = r.to_compute * self.capacity.prefill_per_token
        return r.admissions, prefill, r.admitted_ts + prefill

    def _finish(self, r: EngineRequest) -> None:
        r.finished_ts = time.perf_counter()
        self._release(r)
        if r.finish_reason is not None:
            self.events.finished(r)

    # --- /metrics -------------------------------------------------------------------------------

    def metrics_text(self) -> bytes:
        """The Prometheus text exposition of the engine's state and counters, with vLLM's names."""
        waiting, running, usage, _ = self.state()
        labels = f'{{engine="0",model_name="{_label(self.capacity.model)}"}}'
        lines = []
        for (name, doc), value in zip(_GAUGES, (waiting, running, usage), strict=True):
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name}{labels} {float(value)!r}"]
        with self.counters.lock:
            counts = dict(self.counters.values)
        for name, key, doc in _COUNTERS:
            lines += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter"]
            lines.append(f"{name}_total{labels} {float(counts[key])!r}")
        return ("\n".join(lines) + "\n").encode()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Both:
    """The engine's own counters and the caller's events, each told of every event."""

    def __init__(self, first: EngineEvents, second: EngineEvents) -> None:
        self.first, self.second = first, second

    def preempted(self) -> None:
        self.first.preempted()
        self.second.preempted()

    def rejected(self) -> None:
        self.first.rejected()
        self.second.rejected()

    def prefix_lookup(self, queried: int, hit: int) -> None:
        self.first.prefix_lookup(queried, hit)
        self.second.prefix_lookup(queried, hit)

    def finished(self, r: EngineRequest) -> None:
        self.first.finished(r)
        self.second.finished(r)
