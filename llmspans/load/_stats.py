"""One level's figures from its requests' records (docs/load.md defines each, with vLLM's source).

TTFT, TPOT, ITL and e2e follow `vllm bench serve`'s definitions over the successful requests: TTFT from
the request's start to its first content chunk, e2e to its last, TPOT `(e2e - TTFT) / (tokens - 1)` for
requests of more than one token, ITL every gap between consecutive content chunks of every request.
A request starts when the runner calls the client, or in an open loop when it was due (so the client's
lag behind its schedule is in every figure, and also shown on its own). Throughput and goodput are per
second of the level's wall time (first request issued to last one done). The level's buckets and its
dominant part come from the report's analysis of the level's own spans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmspans import _names as names
from llmspans.load._host import SharedHost, inflated, sharing
from llmspans.load._model import Level, LevelStats, Percentiles, ServerFigures
from llmspans.load._requests import RequestRecord
from llmspans.report._model import Report, part_label

NS = 1e9
# An open loop whose lag p99 is over this is behind its schedule: the run says so (DESIGN §5's 5 ms).
BEHIND_SCHEDULE_S = 0.005


def level_stats(
    level: Level,
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    slo: Mapping[str, float],
    server: ServerFigures | None = None,
    report: Report | None = None,
    workers: int = 1,
    generator_cpu_s: float | None = None,
    loop_lag_ns: Sequence[int] = (),
    host: SharedHost | None = None,
    lost: int = 0,
    lost_generators: Sequence[str] = (),
) -> LevelStats:
    ok = [record for record in records if record.ok and record.recorded]
    errors: dict[str, int] = {}
    for record in records:
        if record.cancelled:
            continue
        kind = record.error or record.error_type
        if kind is not None:
            errors[kind] = errors.get(kind, 0) + 1
    ttft = [record.ttft_ns / NS for record in ok if record.ttft_ns is not None]
    e2e = [record.e2e_ns / NS for record in ok if record.e2e_ns is not None]
    tpot = [record.tpot_ns / NS for record in ok if record.tpot_ns is not None]
    itl = [gap / NS for record in ok for gap in record.itl_ns]
    tokens = sum(record.tokens for record in ok)
    lags = [
        record.start_offset_ns / NS
        for record in records
        if record.scheduled_ns is not None and record.issued_ns
    ]
    lag = Percentiles.of(lags)
    good = sum(1 for record in ok if meets(record, slo)) if slo else None
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    buckets = {bucket: [record.buckets_ns.get(bucket, 0) / NS for record in ok] for bucket in names.BUCKETS}
    bucket_figures = {bucket: Percentiles.of(values) for bucket, values in buckets.items()}
    triage = report.triage if report is not None else None
    loop_lag = Percentiles.of([sample / NS for sample in loop_lag_ns])
    ttft_figures = Percentiles.of(ttft)
    share = sharing(host, generator_cpu_s, duration_s)
    return LevelStats(
        level=level,
        requests=sum(1 for record in records if record.issued_ns),
        completed=sum(1 for record in records if record.ok),
        cancelled=sum(1 for record in records if record.cancelled),
        errors=dict(sorted(errors.items(), key=lambda item: -item[1])),
        retried_calls=sum(1 for record in records if record.retries),
        retries=sum(record.retries for record in records),
        unrecorded=sum(1 for record in records if record.ok and not record.recorded),
        duration_s=duration_s,
        requests_per_s=len(ok) * per_s,
        output_tokens_per_s=tokens * per_s,
        tokens_counted_as_chunks=any(record.output_tokens is None for record in ok),
        good=good,
        goodput_per_s=good * per_s if good is not None else None,
        ttft=ttft_figures,
        tpot=Percentiles.of(tpot),
        itl=Percentiles.of(itl),
        e2e=Percentiles.of(e2e),
        buckets_p50={bucket: figures.p50 if figures else 0.0 for bucket, figures in bucket_figures.items()},
        buckets_p95={bucket: figures.p95 if figures else 0.0 for bucket, figures in bucket_figures.items()},
        lag=lag,
        behind_schedule=lag is not None and lag.p99 > BEHIND_SCHEDULE_S,
        server=server,
        dominant=_dominant(report),
        triage=triage.message if triage is not None else None,
        workers=workers,
        generator_cpu_s=generator_cpu_s,
        loop_lag=loop_lag,
        generator_inflated=inflated(
            loop_lag.p50 if loop_lag else None, ttft_figures.p50 if ttft_figures else None
        ),
        shared_host=host.words() if host is not None and share is not None else None,
        shared_cpu_share=share,
        lost=lost,
        lost_generators=tuple(lost_generators),
        report=report,
    )


def _dominant(report: Report | None) -> str | None:
    """The level's dominant part, or `cannot tell (a or b)` when its spans were a sample too small to
    tell the two largest apart."""
    triage = report.triage if report is not None else None
    if triage is None:
        return None
    if not triage.told:
        first, second = triage.compared
        return f"cannot tell ({first.label} or {second.label})"
    return part_label(triage.dominant_kind, triage.dominant)


def meets(record: RequestRecord, slo: Mapping[str, float]) -> bool:
    """Whether a successful request met every SLO (vLLM's goodput: a request of one token has TPOT 0)."""
    values = {
        "ttft": record.ttft_ns,
        "tpot": record.tpot_ns if record.tpot_ns is not None else 0.0,
        "e2e": record.e2e_ns,
    }
    for name, limit in slo.items():
        value = values[name]
        if value is None or value / NS > limit:
            return False
    return True
