"""The same triage from the metrics llmspans exports, asked of Prometheus' HTTP API.

Prometheus (or Mimir, Thanos, VictoriaMetrics behind the same API) aggregates where the data lives,
so the answer costs the same for a fleet as for one process. The metric names are those the shipped
Grafana dashboard queries: the OTLP names as Prometheus 3 translates them, which is also what
`opentelemetry-exporter-prometheus` serves for a scrape, except that a unit-`1` gauge gets no `_ratio`
suffix from the exporter (`vllm_kv_cache_usage` against `vllm_kv_cache_usage_ratio`): both are asked
for. How the answer differs from the span report (bucket-interpolated quantiles, per span and per call
instead of per trace, sampled gauges, no slowest list but exemplars): docs/report.md.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from llmspans import _names as names
from llmspans.report._model import (
    KIND_BUCKET,
    KIND_STAGE,
    Bound,
    BucketRow,
    CacheRow,
    Connections,
    Distribution,
    Exemplar,
    Interval,
    LimiterRow,
    Part,
    PromptCaps,
    Report,
    Retries,
    ServerGauges,
    ServerHistograms,
    StageRow,
)
from llmspans.report._spans import ReportInputError
from llmspans.report._triage import Figures, triage, variability_of


def _translated(name: str, suffix: str = "") -> str:
    """An OpenTelemetry metric or attribute name as Prometheus spells it (the rules for llmspans' names:
    dots become underscores, seconds add `_seconds`, counters `_total`; tests/test_integrations.py has all)."""
    return name.replace(".", "_") + suffix


STAGE_DURATION = _translated(names.METRIC_STAGE_DURATION, "_seconds")
BUCKET_DURATION = _translated(names.METRIC_BUCKET_DURATION, "_seconds")
STAGE_BUDGET = _translated(names.METRIC_STAGE_BUDGET, "_seconds")
BUDGET_EXCEEDED = _translated(names.METRIC_BUDGET_EXCEEDED, "_total")
RETRY_ATTEMPTS = _translated(names.METRIC_RETRY_ATTEMPTS, "_total")
CONNECT_NEW = _translated(names.METRIC_CONNECT_NEW, "_total")
OPERATION_DURATION = _translated(names.METRIC_OPERATION_DURATION, "_seconds")
LIMITER_IN_FLIGHT = _translated(names.METRIC_LIMITER_IN_FLIGHT)
LIMITER_QUEUE_DEPTH = _translated(names.METRIC_LIMITER_QUEUE_DEPTH)
LIMITER_CAP = _translated(names.METRIC_LIMITER_CAP)
VLLM_WAITING = _translated(names.METRIC_VLLM_NUM_REQUESTS_WAITING)
VLLM_RUNNING = _translated(names.METRIC_VLLM_NUM_REQUESTS_RUNNING)
# A unit-1 gauge: Prometheus 3's OTLP translation adds `_ratio`, opentelemetry-exporter-prometheus does not.
VLLM_KV_CACHE = _translated(names.METRIC_VLLM_KV_CACHE_USAGE) + "(_ratio)?"
PROMPT_ESTIMATE_RATIO = _translated(names.METRIC_PROMPT_ESTIMATE_RATIO)  # unit 1: no suffix on a histogram
CACHE_LOOKUPS = _translated(names.METRIC_CACHE_LOOKUPS, "_total")
CACHE_SAVED_ESTIMATE = _translated(names.METRIC_CACHE_SAVED_ESTIMATE, "_seconds")
LABEL_OVER_CAP = _translated(names.PROMPT_OVER_CAP)
LABEL_CACHE = _translated(names.CACHE_NAME)
LABEL_CACHE_HIT = _translated(names.CACHE_HIT)
LABEL_ESTIMATOR = _translated(names.PROMPT_ESTIMATOR)
LABEL_STAGE = _translated(names.STAGE)
LABEL_BUCKET = _translated(names.METRIC_ATTR_BUCKET)
LABEL_CAUSE = _translated(names.METRIC_ATTR_RETRY_CAUSE)
LABEL_LIMITER = _translated(names.LIMITER_NAME)
LABEL_ERROR = _translated(names.ERROR_TYPE)
LABEL_SERVER_ADDRESS = _translated(names.SERVER_ADDRESS)
LABEL_SERVER_PORT = _translated(names.SERVER_PORT)
QUANTILE_METHOD = (
    "histogram_quantile over Prometheus histograms: linear interpolation inside the bucket that holds the "
    "rank (llmspans' own a quarter of a doubling apart, vLLM's and the conventions' coarser), each quantile "
    "within its bucket; per span and per call rather than per trace"
)
_APP_EXCLUDED = (names.STAGE_LLM, names.STAGE_TURN)
_GAUGE_POINTS = 600  # samples of the limiter gauges over the window


@dataclass(frozen=True)
class _Window:
    end_s: float
    length_s: float

    @property
    def range(self) -> str:
        return f"{max(1, math.ceil(self.length_s * 1000))}ms"


class _Api:
    """The few calls of Prometheus' HTTP API the report makes; every failure a one-line ReportInputError."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.base = url.rstrip("/")
        if not self.base.startswith(("http://", "https://")):
            raise ReportInputError(f"--prometheus must be a URL like http://localhost:9090, got {url!r}")
        self.http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def _get(self, path: str, params: Mapping[str, str]) -> Any:
        try:
            response = self.http.get(self.base + path, params=params)
        except httpx.HTTPError as error:
            raise ReportInputError(
                f"cannot reach Prometheus at {self.base}: {error or type(error).__name__}"
            ) from None
        try:
            body = response.json()
        except ValueError:
            raise ReportInputError(
                f"Prometheus at {self.base} answered HTTP {response.status_code} to {path} with something that "
                "is not its JSON API"
            ) from None
        if not isinstance(body, dict) or body.get("status") != "success":
            problem = body.get("error") if isinstance(body, dict) else None
            raise ReportInputError(
                f"Prometheus at {self.base} answered HTTP {response.status_code} to {path}: {problem}"
            )
        return body.get("data")

    def vector(self, query: str, at_s: float) -> list[tuple[dict[str, str], float]]:
        data = self._get("/api/v1/query", {"query": query, "time": f"{at_s:.3f}"})
        if not isinstance(data, dict) or data.get("resultType") != "vector":
            return []
        out = []
        for item in data.get("result", []):
            value = float(item["value"][1])
            if not math.isnan(value):
                out.append((dict(item.get("metric", {})), value))
        return out

    def matrix(self, query: str, window: _Window) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        step = max(window.length_s / _GAUGE_POINTS, 0.1)
        data = self._get(
            "/api/v1/query_range",
            {"query": query, "start": f"{window.end_s - window.length_s:.3f}", "end": f"{window.end_s:.3f}",
             "step": f"{step:.3f}"},
        )  # fmt: skip
        if not isinstance(data, dict):
            return []
        return [
            (dict(item.get("metric", {})), [(float(t), float(v)) for t, v in item.get("values", [])])
            for item in data.get("result", [])
        ]

    def exemplars(self, query: str, window: _Window) -> list[tuple[dict[str, str], float, str]]:
        data = self._get(
            "/api/v1/query_exemplars",
            {"query": query, "start": f"{window.end_s - window.length_s:.3f}", "end": f"{window.end_s:.3f}"},
        )
        out = []
        for series in data or []:
            for exemplar in series.get("exemplars", []):
                labels = exemplar.get("labels", {})
                trace_id = labels.get("trace_id") or labels.get("traceID") or labels.get("traceId")
                if trace_id:
                    out.append(
                        (dict(series.get("seriesLabels", {})), float(exemplar["value"]), str(trace_id))
                    )
        return out


def _selector(service: str | None, extra: str = "") -> str:
    matchers = [f'job="{_escape(service)}"'] if service else []
    if extra:
        matchers.append(extra)
    return "{" + ", ".join(matchers) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _histograms(api: _Api, metric: str, label: str, select: str, window: _Window) -> dict[str, Distribution]:
    """Per label value: the increase in count and the interpolated p50/p95/p99 over the window; a quantile
    that falls in a bucket wider than itself is only that bucket's bound (`_bounded`)."""
    counts = {
        labels.get(label, ""): value
        for labels, value in api.vector(
            f"sum by ({label}) (increase({metric}_count{select}[{window.range}]))", window.end_s
        )
    }
    buckets = f"sum by (le, {label}) (increase({metric}_bucket{select}[{window.range}]))"
    quantiles: dict[str, dict[float, float]] = {}
    for q in (0.5, 0.95, 0.99):
        for labels, value in api.vector(f"histogram_quantile({q}, {buckets})", window.end_s):
            quantiles.setdefault(labels.get(label, ""), {})[q] = value
    edges: dict[str, set[float]] = {}
    for labels, _count in api.vector(buckets, window.end_s):
        try:
            edge = float(labels.get("le", "nan"))
        except ValueError:
            continue
        if math.isfinite(edge):
            edges.setdefault(labels.get(label, ""), set()).add(edge)
    return {
        name: _bounded(round(count), values, sorted(edges.get(name, ())))
        for name, values in quantiles.items()
        if (count := counts.get(name, 0.0)) > 0
    }


def _bounded(count: int, values: Mapping[float, float], edges: list[float]) -> Distribution:
    """The quantiles as a Distribution. `histogram_quantile` interpolates linearly inside the bucket that
    holds the rank, as if the values were spread evenly across it: where the bucket is wider than the
    figure itself (always so for the first, from 0 to its upper edge), that is a figure of the buckets,
    not of the data, so the quantile is reported as the bucket's upper edge and named a bound."""
    figures: dict[str, float] = {}
    bounds: list[Bound] = []
    intervals: list[Interval] = []
    for q, name in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
        value = figures[name] = values.get(q, 0.0)
        upper_index = bisect.bisect_left(edges, value)
        if not math.isfinite(value) or upper_index >= len(edges):
            continue  # above the highest finite edge: Prometheus gives that edge; nothing better is known
        upper = edges[upper_index]
        lower = edges[upper_index - 1] if upper_index > 0 else 0.0
        intervals.append(Interval(name, lower, upper, upper_index > 0))  # the bucket that holds the rank
        if upper > 0 and upper - lower > value:
            bounds.append(Bound(name, lower, upper))
            figures[name] = upper
    return Distribution(
        count, figures["p50"], figures["p95"], figures["p99"], None, tuple(bounds), tuple(intervals)
    )


def _by_label(api: _Api, query: str, label: str, at_s: float) -> dict[str, float]:
    return {labels.get(label, ""): value for labels, value in api.vector(query, at_s)}


def _total(api: _Api, query: str, at_s: float) -> float:
    return sum(value for _, value in api.vector(query, at_s))


def _limiters(api: _Api, select: str, window: _Window, service: str | None) -> tuple[LimiterRow, ...]:
    """In-flight against cap while calls queued, from the sampled gauges (not from each call, as spans can)."""
    series: dict[str, dict[str, dict[float, float]]] = {}
    for metric in (LIMITER_IN_FLIGHT, LIMITER_QUEUE_DEPTH, LIMITER_CAP):
        for labels, values in api.matrix(f"max by ({LABEL_LIMITER}) ({metric}{select})", window):
            series.setdefault(labels.get(LABEL_LIMITER, ""), {})[metric] = dict(values)
    rows = []
    for name, gauges in series.items():
        in_flight, queued, caps = (
            gauges.get(metric, {}) for metric in (LIMITER_IN_FLIGHT, LIMITER_QUEUE_DEPTH, LIMITER_CAP)
        )
        times = sorted(set(in_flight) & set(queued))
        if not times:
            continue
        step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        cap = max(caps.values(), default=0.0)
        backlog = [t for t in times if queued[t] > 0]
        gap = [t for t in backlog if in_flight[t] < caps.get(t, cap)]
        rows.append(
            LimiterRow(
                name=name,
                process=f"job {service}" if service else "all jobs",
                cap=round(cap),
                calls=None,
                window_s=step * len(times),
                backlog_s=step * len(backlog),
                gap_s=step * len(gap),
                gap_fraction=len(gap) / len(backlog) if backlog else 0.0,
                mean_queue_depth=sum(queued[t] for t in times) / len(times),
                max_queue_depth=round(max(queued[t] for t in times)),
                mean_in_flight=sum(in_flight[t] for t in times) / len(times),
                queue_depth_on_entry=None,
            )
        )
    rows.sort(key=lambda row: -row.backlog_s)
    return tuple(rows)


def _server_gauges(api: _Api, select: str, window: _Window) -> tuple[ServerGauges, ...]:
    labels = f"{LABEL_SERVER_ADDRESS}, {LABEL_SERVER_PORT}"
    figures: dict[str, dict[str, float]] = {}

    def collect(key: str, query: str) -> None:
        for found, value in api.vector(query, window.end_s):
            server = f"{found.get(LABEL_SERVER_ADDRESS, '?')}:{found.get(LABEL_SERVER_PORT, '?')}"
            figures.setdefault(server, {})[key] = value

    collect("waiting_max", f"max by ({labels}) (max_over_time({VLLM_WAITING}{select}[{window.range}]))")
    collect("waiting_mean", f"max by ({labels}) (avg_over_time({VLLM_WAITING}{select}[{window.range}]))")
    collect("running_max", f"max by ({labels}) (max_over_time({VLLM_RUNNING}{select}[{window.range}]))")
    collect("running_mean", f"max by ({labels}) (avg_over_time({VLLM_RUNNING}{select}[{window.range}]))")
    kv_select = select[:-1] + (", " if select != "{}" else "") + f'__name__=~"{VLLM_KV_CACHE}"' + "}"
    collect("kv_cache_usage_max", f"max by ({labels}) (max_over_time({kv_select}[{window.range}]))")
    return tuple(
        ServerGauges(
            server,
            found.get("waiting_max"),
            found.get("waiting_mean"),
            found.get("running_max"),
            found.get("running_mean"),
            found.get("kv_cache_usage_max"),
        )
        for server, found in sorted(figures.items())
    )


# vLLM's own histograms, as its /metrics names them (Prometheus scrapes vLLM directly: no translation).
VLLM_QUEUE_TIME = "vllm:request_queue_time_seconds"
VLLM_PREFILL_TIME = "vllm:request_prefill_time_seconds"
VLLM_TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
VLLM_INTER_TOKEN = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")  # 0.11+, before
LABEL_VLLM_MODEL = "model_name"


def _server_histograms(api: _Api, window: _Window) -> tuple[ServerHistograms, ...]:
    """vLLM's histograms per model over the window; empty when Prometheus scrapes no vLLM server."""
    found: dict[str, dict[str, Distribution]] = {}
    for key, metric in (
        ("queue", VLLM_QUEUE_TIME), ("prefill", VLLM_PREFILL_TIME), ("ttft", VLLM_TIME_TO_FIRST_TOKEN),
    ):  # fmt: skip
        for model, distribution in _histograms(api, metric, LABEL_VLLM_MODEL, "", window).items():
            found.setdefault(model, {})[key] = distribution
    inter_token_metric: dict[str, str] = {}
    for metric in VLLM_INTER_TOKEN:
        for model, distribution in _histograms(api, metric, LABEL_VLLM_MODEL, "", window).items():
            if "inter_token" not in found.setdefault(model, {}):
                found[model]["inter_token"] = distribution
                inter_token_metric[model] = metric
    return tuple(
        ServerHistograms(
            model, figures.get("queue"), figures.get("prefill"), figures.get("ttft"), figures.get("inter_token"),
            inter_token_metric.get(model),
        )
        for model, figures in sorted(found.items())
    )  # fmt: skip


def _prompt_caps(api: _Api, service: str | None, window: _Window) -> tuple[PromptCaps | None, list[str]]:
    """Capped calls over and under the cap, those refused, each side's first_token and the estimate over the
    server's count; the notes say what the metrics cannot tell apart."""
    at, span = window.end_s, window.range
    capped = _selector(service, f'{LABEL_OVER_CAP}!=""')
    calls = _by_label(
        api,
        f"sum by ({LABEL_OVER_CAP}) (increase({OPERATION_DURATION}_count{capped}[{span}]))",
        LABEL_OVER_CAP,
        at,
    )
    total = round(sum(calls.values()))
    if not total:
        return None, []
    over = round(calls.get("true", 0.0))
    refused_select = _selector(
        service, f'{LABEL_OVER_CAP}="true", {LABEL_ERROR}="{names.ERROR_PROMPT_TOO_LARGE}"'
    )
    refused = min(
        over, round(_total(api, f"sum(increase({OPERATION_DURATION}_count{refused_select}[{span}]))", at))
    )
    first_token_select = _selector(service, f'{LABEL_BUCKET}="first_token", {LABEL_OVER_CAP}!=""')
    first_token = _histograms(api, BUCKET_DURATION, LABEL_OVER_CAP, first_token_select, window)
    notes = []
    first_token_over = first_token.get("true")
    if refused and refused >= over:
        first_token_over = None  # every call over the cap was refused: none was answered
    elif refused:
        notes.append(
            "from Prometheus: the first_token of calls over the prompt cap includes the calls it refused "
            "(llmspans.bucket.duration carries no error type)"
        )
    ratios = _histograms(api, PROMPT_ESTIMATE_RATIO, LABEL_ESTIMATOR, _selector(service), window)
    ratio = None
    if ratios:
        ratio = next(iter(ratios.values())) if len(ratios) == 1 else _overall(api, service, window)
    caps = PromptCaps(
        calls=total, over=over, refused=refused, first_token_over=first_token_over,
        first_token_under=first_token.get("false"), estimate_ratio=ratio, estimators=tuple(sorted(ratios)),
    )  # fmt: skip
    return caps, notes


def _overall(api: _Api, service: str | None, window: _Window) -> Distribution | None:
    """The estimate ratio over every estimator at once."""
    select = _selector(service)
    count = _total(api, f"sum(increase({PROMPT_ESTIMATE_RATIO}_count{select}[{window.range}]))", window.end_s)
    quantiles = [
        _total(
            api, f"histogram_quantile({q}, sum by (le) (increase({PROMPT_ESTIMATE_RATIO}_bucket{select}[{window.range}])))",
            window.end_s,
        )
        for q in (0.5, 0.95, 0.99)
    ]  # fmt: skip
    if count <= 0:
        return None
    return Distribution(round(count), quantiles[0], quantiles[1], quantiles[2], None)


def _caches(api: _Api, service: str | None, window: _Window) -> tuple[CacheRow, ...]:
    """Lookups, hits, failures and the estimated time saved per cache; the lookups' own time and the requests
    that held them are in the spans only."""
    at, span = window.end_s, window.range
    select = _selector(service)
    counts: dict[str, dict[str, float]] = {}
    query = f"sum by ({LABEL_CACHE}, {LABEL_CACHE_HIT}) (increase({CACHE_LOOKUPS}{select}[{span}]))"
    for labels, value in api.vector(query, at):
        counts.setdefault(labels.get(LABEL_CACHE, ""), {})[labels.get(LABEL_CACHE_HIT, "")] = value
    if not counts:
        return ()
    failed_select = _selector(service, f'{LABEL_ERROR}!=""')
    failed = _by_label(
        api, f"sum by ({LABEL_CACHE}) (increase({CACHE_LOOKUPS}{failed_select}[{span}]))", LABEL_CACHE, at
    )
    saved = _by_label(
        api, f"sum by ({LABEL_CACHE}) (increase({CACHE_SAVED_ESTIMATE}_sum{select}[{span}]))", LABEL_CACHE, at
    )
    estimated = _by_label(
        api,
        f"sum by ({LABEL_CACHE}) (increase({CACHE_SAVED_ESTIMATE}_count{select}[{span}]))",
        LABEL_CACHE,
        at,
    )
    rows = []
    for name, by_hit in counts.items():
        lookups = round(sum(by_hit.values()))
        if not lookups:
            continue
        rows.append(
            CacheRow(
                name=name, lookups=lookups, hits=round(by_hit.get("true", 0.0)), errors=round(failed.get(name, 0.0)),
                saved_s=saved.get(name, 0.0), hits_estimated=round(estimated.get(name, 0.0)), lookup=None,
                with_hit=None, with_miss=None,
            )
        )  # fmt: skip
    rows.sort(key=lambda row: (-row.lookups, row.name))
    return tuple(rows)


def trace_link_prefix(jaeger: str | None, tempo: str | None) -> str | None:
    """Where an exemplar's trace id links to: Jaeger's trace page, or Tempo's trace-by-id API (Tempo has
    no UI of its own; Grafana's Explore reads the same id)."""
    if jaeger:
        return f"{jaeger.rstrip('/')}/trace/"
    if tempo:
        from llmspans.report._sources.tempo import TRACE_V2_PATH, shown_url

        return shown_url(tempo) + TRACE_V2_PATH
    return None


def _exemplars(api: _Api, select: str, window: _Window, links: str | None, top: int) -> tuple[Exemplar, ...]:
    found = []
    for metric, label in ((STAGE_DURATION, LABEL_STAGE), (BUCKET_DURATION, LABEL_BUCKET)):
        for labels, value, trace_id in api.exemplars(f"{metric}_bucket{select}", window):
            series = f"{labels.get(label, '?')} ({'stage' if label == LABEL_STAGE else 'llm bucket'})"
            link = f"{links}{trace_id}" if links else None
            found.append(Exemplar(series, value, trace_id, link))
    found.sort(key=lambda exemplar: -exemplar.value_s)
    unique: dict[str, Exemplar] = {}
    for exemplar in found:
        unique.setdefault(exemplar.trace_id, exemplar)
    return tuple(list(unique.values())[: max(0, top)])


def query_report(
    url: str,
    *,
    service: str | None,
    window_s: float,
    ago_s: float = 0.0,
    budgets: Mapping[str, float] | None = None,
    top: int = 5,
    jaeger: str | None = None,
    tempo: str | None = None,
    timeout_s: float = 10.0,
) -> Report:
    """The report of the `window_s` seconds ending `ago_s` seconds ago, for one job (`service`) or all."""
    window = _Window(time.time() - ago_s, window_s)
    api = _Api(url, timeout_s)
    try:
        return _report(api, service, window, dict(budgets or {}), top, trace_link_prefix(jaeger, tempo))
    finally:
        api.close()


def _report(
    api: _Api, service: str | None, window: _Window, overrides: dict[str, float], top: int, links: str | None
) -> Report:
    select = _selector(service)
    at, span = window.end_s, window.range
    stage_rows = _histograms(api, STAGE_DURATION, LABEL_STAGE, select, window)
    bucket_rows = _histograms(api, BUCKET_DURATION, LABEL_BUCKET, select, window)
    budgets = _by_label(
        api, f"max by ({LABEL_STAGE}) (last_over_time({STAGE_BUDGET}{select}[{span}]))", LABEL_STAGE, at
    )
    exceeded = _by_label(
        api, f"sum by ({LABEL_STAGE}) (increase({BUDGET_EXCEEDED}{select}[{span}]))", LABEL_STAGE, at
    )
    ordered = [stage for stage in stage_rows if stage not in _APP_EXCLUDED]
    ordered += [stage for stage in _APP_EXCLUDED if stage in stage_rows]
    stages = []
    for stage in ordered:
        distribution = stage_rows[stage]
        budget = overrides.get(stage, budgets.get(stage))
        over = round(exceeded.get(stage, 0.0)) if stage not in overrides else 0
        stages.append(StageRow(stage, distribution, budget, False, distribution.count if budget is not None else 0,
                               over, 0))  # fmt: skip
    buckets: tuple[BucketRow, ...] = ()
    if bucket_rows:
        values = {
            bucket: bucket_rows.get(bucket, Distribution(0, 0.0, 0.0, 0.0, None)) for bucket in names.BUCKETS
        }
        total = sum(row.p95 for row in values.values())
        buckets = tuple(
            BucketRow(bucket, values[bucket], values[bucket].p95 / total if total > 0 else 0.0)
            for bucket in names.BUCKETS
        )
    parts = tuple(
        [Part(KIND_STAGE, row.stage, row.durations) for row in stages if row.stage not in _APP_EXCLUDED]
        + [Part(KIND_BUCKET, row.bucket, row.values) for row in buckets]
    )
    calls = _total(api, f"sum(increase({OPERATION_DURATION}_count{select}[{span}]))", at)
    failed_select = _selector(service, f'{LABEL_ERROR}!=""')
    errors = _by_label(
        api,
        f"sum by ({LABEL_ERROR}) (increase({OPERATION_DURATION}_count{failed_select}[{span}]))",
        LABEL_ERROR,
        at,
    )
    failed = round(sum(errors.values()))
    successful = round(calls) - failed
    causes = _by_label(
        api, f"sum by ({LABEL_CAUSE}) (increase({RETRY_ATTEMPTS}{select}[{span}]))", LABEL_CAUSE, at
    )
    retried_attempts = round(sum(causes.values()))
    new_connections = round(_total(api, f"sum(increase({CONNECT_NEW}{select}[{span}]))", at))
    variability = variability_of(buckets)
    retries = Retries(
        calls=round(calls),
        successful=successful,
        failed=failed,
        attempts=round(calls) + retried_attempts,
        attempts_per_success=(round(calls) + retried_attempts) / successful if successful > 0 else None,
        retried_calls=None,
        causes={
            cause: round(count)
            for cause, count in sorted(causes.items(), key=lambda item: -item[1])
            if round(count)
        },
        wasted_output_tokens=None,
        error_types={
            error: round(count) for error, count in sorted(errors.items(), key=lambda item: -item[1])
        },
    )
    connections = Connections(
        round(calls),
        successful,
        new_connections,
        new_connections / successful if successful > 0 else None,
        None,
    )
    server_histograms = _server_histograms(api, window)
    prompt_caps, cap_notes = _prompt_caps(api, service, window)
    figures = Figures(
        variability=variability,
        retries=retries,
        connections=connections,
        limiters=_limiters(api, select, window, service),
        server=None,
        histograms=server_histograms,
        prompt_caps=prompt_caps,
    )
    notes = [
        "from Prometheus: quantiles are interpolated inside histogram buckets, per span and per call (not per "
        "trace); no max; limiter gauges are sampled at each scrape, and their in-flight counts every holder "
        "of a slot, not only LLM calls"
    ]
    notes += [
        f"--budgets names stage '{stage}', which no metric has"
        for stage in overrides
        if stage not in stage_rows
    ]
    notes += cap_notes
    caches = _caches(api, service, window)
    if caches:
        notes.append(
            "from Prometheus: a cache's lookup time and the latency of requests with a hit against those "
            "without need the spans (llmspans report FILE)"
        )
    served = f"job {service!r}" if service else "all jobs"
    return Report(
        sources=(
            f"Prometheus {api.base} ({served}, {_duration(window.length_s)} ending {_ago(time.time() - window.end_s)})",
        ),
        skipped=(),
        spans=sum(row.durations.count for row in stages),
        traces=stage_rows[names.STAGE_TURN].count if names.STAGE_TURN in stage_rows else 0,
        llm_calls=round(calls),
        quantile_method=QUANTILE_METHOD,
        stages=tuple(stages),
        buckets=buckets,
        parts=parts,
        triage=triage(parts, stages, figures),
        variability=variability,
        connections=connections,
        retries=retries,
        limiters=figures.limiters,
        server=None,
        slowest=(),
        notes=tuple(notes),
        server_gauges=_server_gauges(api, select, window),
        exemplars=_exemplars(api, select, window, links, top),
        server_histograms=server_histograms,
        prompt_caps=prompt_caps,
        caches=caches,
    )


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _ago(seconds: float) -> str:
    return "now" if seconds < 1 else f"{_duration(round(seconds))} ago"
