"""What a load run says, as plain frozen data: the levels' figures, the knee and the verdict.

Seconds everywhere; quantiles are nearest-rank, as in the report (docs/load.md says why, and how they
compare with `vllm bench serve`'s interpolated ones).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from llmspans.report._model import Report, quantile

if TYPE_CHECKING:
    from llmspans.load._replay_table import ReplayResult

SHAPE_CONCURRENCY = "concurrency"
SHAPE_RATE = "rate"
SHAPE_SPEED = "speed"  # `--replay`: the recorded traffic at this many times its recorded pace
LOAD_QUANTILES = (0.5, 0.9, 0.95, 0.99)


@dataclass(frozen=True, order=True)
class Level:
    """One load level: `concurrency` users each sending the next request when the last one is done
    (closed loop), `rate` requests per second arriving on a schedule (open loop), or a recorded run
    replayed at `speed` times its pace (`--replay`, an open loop on the recorded schedule)."""

    shape: str
    value: float

    @property
    def label(self) -> str:
        """The `llmspans.load.level` value: `concurrency=8`, `rate=4` (requests/s), `speed=2`."""
        return f"{self.shape}={_number(self.value)}"

    @property
    def words(self) -> str:
        if self.shape == SHAPE_CONCURRENCY:
            return f"{_number(self.value)} concurrent"
        if self.shape == SHAPE_SPEED:
            return f"{_number(self.value)}x speed"
        return f"{_number(self.value)} requests/s"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Percentiles:
    count: int
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Percentiles | None:
        ordered = sorted(values)
        if not ordered:
            return None
        return cls(
            len(ordered),
            quantile(ordered, 0.5),
            quantile(ordered, 0.9),
            quantile(ordered, 0.95),
            quantile(ordered, 0.99),
            ordered[-1],
        )

    def at(self, q: float) -> float:
        return {0.5: self.p50, 0.9: self.p90, 0.95: self.p95, 0.99: self.p99}[q]


@dataclass(frozen=True)
class ServerFigures:
    """vLLM's `/metrics` over one level (llmspans.vllm.ServerMetrics' samples taken during it)."""

    samples: int
    waiting_mean: float
    waiting_max: int
    running_mean: float
    running_max: int
    kv_cache_usage_mean: float | None
    kv_cache_usage_max: float | None
    preemption_rate_mean: float | None
    prefix_cache_hit_ratio_mean: float | None


@dataclass(frozen=True)
class LevelStats:
    level: Level
    requests: int  # issued
    completed: int  # succeeded
    cancelled: int  # cut by Ctrl-C (or the run's time cap)
    errors: dict[str, int]
    retried_calls: int
    retries: int
    unrecorded: int  # succeeded, but no call span reached the load tool (sampled out)
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    tokens_counted_as_chunks: bool  # the server reported no usage: output tokens are content chunks
    good: int | None  # requests meeting every --slo (None without one)
    goodput_per_s: float | None
    ttft: Percentiles | None  # None when the calls do not stream
    tpot: Percentiles | None
    itl: Percentiles | None
    e2e: Percentiles | None
    buckets_p50: dict[str, float]
    buckets_p95: dict[str, float]
    lag: Percentiles | None  # open loop: the client's lag behind its schedule
    behind_schedule: bool
    server: ServerFigures | None
    dominant: str | None  # the report's dominant part at p95 for this level
    triage: str | None  # and its message
    workers: int = 1  # processes that sent the level's requests (1: the runner's own)
    generator_cpu_s: float | None = None  # CPU the load tool's processes spent over the level
    loop_lag: Percentiles | None = None  # how late the generator's event loop woke (`_host.LoopLag`)
    generator_inflated: bool = False  # the loop's lateness is a real share of the TTFT (`_host.inflated`)
    shared_host: str | None = None  # the target on this machine, on the generator's CPUs: who shares what
    shared_cpu_share: float | None = None  # the share of a CPU the generator used there, when it mattered
    lost: int = 0  # `--ray`: requests in flight on a generator that was lost (not server errors)
    lost_generators: tuple[str, ...] = ()  # `--ray`: each generator lost during the level, in one line
    report: Report | None = field(default=None, compare=False, repr=False)

    @property
    def cpu_per_request_s(self) -> float | None:
        """The load generator's own CPU per request issued (the SDK, llmspans, the export, the load tool)."""
        if self.generator_cpu_s is None or not self.requests:
            return None
        return self.generator_cpu_s / self.requests

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("report")
        data["level"] = {"shape": self.level.shape, "value": self.level.value, "label": self.level.label}
        return data


@dataclass(frozen=True)
class GeneratorStats:
    """One generator of a `--ray` run (a Ray actor) over the whole run, for the table per generator."""

    name: str  # g1, g2, ... in the order they were started
    attribute: str  # its `llmspans.load.generator` on the call spans
    node: str  # the node's address and the node id's first 8 hex digits
    requests: int  # issued, whose records came back
    lost: int  # in flight when it was lost
    cpu_s: (
        float  # its process's CPU over the parts it finished (its exporter's thread and Ray's own included)
    )
    cpu_per_request_s: float | None  # over the parts it finished; None when it finished none
    lag: Percentiles | None  # open loop: its requests' lag behind the schedule, over the run
    lag_worst: tuple[str, float] | None  # open loop: the level where its lag p99 was highest, and that p99
    clock_offset_s: float  # its wall clock minus the driver's, as last measured
    clock_uncertainty_s: float  # half the round trip of the best measurement
    lost_during: str | None = None  # the level it was lost in, if it was

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Knee:
    """The first level where p95 TTFT or e2e left its low-load value by more than the factor, or where
    throughput stopped growing with the load; `before` is the level under it."""

    before: Level
    at: Level
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Verdict:
    """What grew at the knee, in the report's words (`llmspans.report._triage.cause_of`)."""

    grew: str  # a bucket name, or "schedule_lag"
    before_s: float
    after_s: float
    finding: str
    message: str
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Result:
    target: str
    model: str
    endpoint: str
    stream: bool
    shape: str
    run_id: str
    workload: str
    levels: tuple[LevelStats, ...]
    knee: Knee | None
    verdict: Verdict | None
    summary: str  # one line: the knee and what grew, or that there was none
    slo: dict[str, float]
    interrupted: bool
    notes: tuple[str, ...] = ()
    generators: tuple[GeneratorStats, ...] = ()  # `--ray`: one per generator, in their order
    replay: ReplayResult | None = (
        None  # `--replay`: the recorded calls, what was assumed, recorded vs replayed
    )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (the `--json` document)."""
        knee = None
        if self.knee is not None:
            knee = {
                "before": self.knee.before.label,
                "at": self.knee.at.label,
                "reasons": list(self.knee.reasons),
            }
        return {
            "target": self.target,
            "model": self.model,
            "endpoint": self.endpoint,
            "stream": self.stream,
            "shape": self.shape,
            "run_id": self.run_id,
            "workload": self.workload,
            "slo": self.slo,
            "interrupted": self.interrupted,
            "levels": [level.to_dict() for level in self.levels],
            "knee": knee,
            "verdict": asdict(self.verdict) if self.verdict is not None else None,
            "summary": self.summary,
            "notes": list(self.notes),
            **(
                {"generators": [generator.to_dict() for generator in self.generators]}
                if self.generators
                else {}
            ),
            **({"replay": self.replay.to_dict()} if self.replay is not None else {}),
        }
