"""Does the load generator keep its schedule? Its lag at 200 requests/s against a zero-delay server, on one
process and on the worker processes `llmspans load` chooses, side by side.

`llmspans load`'s open loop counts each request's latency from when it was due, so a generator that falls
behind inflates every figure; DESIGN §5 asks that its schedule lag p99 stay under 5 ms at 200 requests/s
against a server that answers at once. This runs the open loop as the command does (the instrumented
`openai.AsyncOpenAI`, the spans written by `configure()`'s embedded default to a traces file in a scratch
folder, the load tool's own span processor and figures), against llmspans' simulator (4 streamed chunks,
no delay) in a child process, once with `--workers 1` and once with the workers it would choose (or those
of `--workers`), the same seeded schedule each time. Per column: the rate it sent at, the lag's
percentiles, and the CPU the generator's processes spent per request (the SDK, llmspans, the export and
the load tool together); then whether 200 requests/s was kept with a p99 under 5 ms.

    python benchmarks/load.py               # 200 requests/s for 10 s (2,000 requests) per column
    python benchmarks/load.py --quick       # 1 s per column: checks that it runs (CI)
    python benchmarks/load.py --rate 400 --seconds 5 --workers 1,2,4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import llmspans  # noqa: E402
from llmspans.load._model import SHAPE_RATE, Level, LevelStats  # noqa: E402
from llmspans.load._requests import RequestRecord  # noqa: E402
from llmspans.load._runner import Runner, RunOutcome  # noqa: E402
from llmspans.load._stats import BEHIND_SCHEDULE_S  # noqa: E402
from llmspans.load._workers import WorkerExport, available_cpus, workers_for  # noqa: E402
from llmspans.load._workload import Plan, Workload  # noqa: E402

TARGET_P99_S = BEHIND_SCHEDULE_S
KEPT_RATE_SHARE = 0.95  # the rate sent must be at least this share of the rate asked


@dataclass
class Column:
    workers: int
    stats: LevelStats
    sent_per_s: float
    wall_s: float
    server_cpu_s: float | None

    def kept(self, rate: float) -> bool:
        lag = self.stats.lag
        return (
            lag is not None
            and lag.p99 < TARGET_P99_S
            and self.sent_per_s >= KEPT_RATE_SHARE * rate
            and self.stats.completed == self.stats.requests
        )


def start_simulator() -> tuple[subprocess.Popen[str], str]:
    """llmspans' simulator in a child process (4 streamed chunks, no delay), and its base URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "llmspans.tools.simulator", "--chunks", "4"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def _cpu_s(pid: int) -> float | None:
    """A process's CPU time so far (Linux's /proc), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _column(workers: int, rate: float, count: int, base_url: str, traces: Path, server_pid: int) -> Column:
    workload = Workload(model="sim-model", max_tokens=4, prompt_tokens=16)
    level = Level(SHAPE_RATE, rate)
    plan = Plan(
        shape=SHAPE_RATE, levels=(level,), requests_per_level=count, level_seconds=count / rate + 60,
        max_requests=count, max_seconds=count / rate + 120,
    )  # fmt: skip
    export = WorkerExport("llmspans-load-benchmark", traces)
    measured = measure("benchmarks/load.py", workload, plan, workers, base_url, export, server_pid)
    return Column(workers, measured.stats, measured.sent_per_s, measured.wall_s, measured.server_cpu_s)


@dataclass
class Measured:
    """One run of a one-level plan: the level's figures and records, the rate it was sent at (the first
    request issued to the last) and the CPU the server spent meanwhile (None off Linux)."""

    stats: LevelStats
    records: list[RequestRecord]
    sent_per_s: float
    wall_s: float
    server_cpu_s: float | None


def measure(
    script: str, workload: Workload, plan: Plan, workers: int, base_url: str, export: WorkerExport,
    server_pid: int,
) -> Measured:  # fmt: skip
    """Run `plan` (one level) as `llmspans load` runs it, on `workers` processes, its spans where
    `configure()` sends them; SystemExit naming the benchmark when a worker failed."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    runner = Runner(
        workload,
        plan,
        base_url=base_url,
        tracer_provider=provider,
        max_retries=0,
        workers=workers,
        export=export,
    )
    server_before = _cpu_s(server_pid)
    started = time.perf_counter()
    outcome: RunOutcome = asyncio.run(runner.run())
    wall = time.perf_counter() - started
    server_after = _cpu_s(server_pid)
    if outcome.failure is not None:
        raise SystemExit(f"{script}: {outcome.failure}")
    (stats,) = outcome.levels
    records = outcome.records[stats.level.label]
    issued = sorted(record.issued_ns for record in records if record.issued_ns)
    sent = (len(issued) - 1) / ((issued[-1] - issued[0]) / 1e9) if len(issued) > 1 else 0.0
    server = server_after - server_before if server_before is not None and server_after is not None else None
    return Measured(stats, records, sent, wall, server)


def column_options(parser: argparse.ArgumentParser, *, calls: str, seconds_of: str, columns: str) -> None:
    """The options of a benchmark of the schedule: `--rate` (of `calls`), `--seconds` (of `seconds_of`) per
    column, `--quick`, and `--workers`, the worker counts of its `columns` (read by `worker_columns`)."""
    parser.add_argument("--rate", type=float, default=200.0, help=f"{calls} per second (200)")
    parser.add_argument(
        "--seconds", type=float, default=10.0, help=f"seconds of {seconds_of} per column (10)"
    )
    parser.add_argument("--quick", action="store_true", help="1 s per column: checks that it runs")
    parser.add_argument(
        "--workers", default=None, metavar="N,N,...",
        help=f"the {columns} worker counts (default: 1 and the ones llmspans load chooses)",
    )  # fmt: skip


def worker_columns(workers: str | None, chosen: int) -> list[int]:
    """The columns' worker counts: those of `--workers`, else one process and the `chosen` count."""
    return [int(part) for part in workers.split(",")] if workers else sorted({1, chosen})


def print_rows(rows: Sequence[tuple[str, list[str]]], name_width: int, width: int) -> None:
    for name, cells in rows:
        print(f"  {name:<{name_width}}" + "".join(cell.rjust(width) for cell in cells))


def figure_of_record(script: str, argv: Sequence[str] | None) -> None:
    command = shlex.join([Path(sys.executable).name, script, *(argv or sys.argv[1:])])
    print(f"the figure of record: {command} on a machine with nothing else running")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _print(columns: Sequence[Column], rate: float) -> None:
    width = 16
    rows: list[tuple[str, list[str]]] = [
        ("workers", [str(column.workers) for column in columns]),
        ("requests issued", [str(column.stats.requests) for column in columns]),
        ("completed", [str(column.stats.completed) for column in columns]),
        ("sent (requests/s)", [f"{column.sent_per_s:.1f}" for column in columns]),
        ("lag p50", [_ms(column.stats.lag.p50 if column.stats.lag else None) for column in columns]),
        ("lag p95", [_ms(column.stats.lag.p95 if column.stats.lag else None) for column in columns]),
        ("lag p99", [_ms(column.stats.lag.p99 if column.stats.lag else None) for column in columns]),
        ("lag max", [_ms(column.stats.lag.max if column.stats.lag else None) for column in columns]),
        ("CPU per request", [_ms(column.stats.cpu_per_request_s) for column in columns]),
        (
            "server CPU/request",
            [
                _ms(column.server_cpu_s / column.stats.requests if column.server_cpu_s is not None else None)
                for column in columns
            ],
        ),
        ("level wall time", [f"{column.stats.duration_s:.1f} s" for column in columns]),
        ("kept the schedule", ["yes" if column.kept(rate) else "NO" for column in columns]),
    ]
    print_rows(rows, 20, width)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    column_options(parser, calls="requests", seconds_of="arrivals", columns="columns'")
    args = parser.parse_args(argv)
    seconds = 1.0 if args.quick else args.seconds
    count = int(args.rate * seconds)
    level = Level(SHAPE_RATE, args.rate)
    chosen = workers_for(level, count, None)
    columns_asked = worker_columns(args.workers, chosen)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"llmspans load's open loop at {args.rate:g} requests/s for {seconds:g} s against a zero-delay server "
        f"(4 streamed chunks); {available_cpus()} CPUs here, load average {load_before:.1f} before the run; "
        f"llmspans load would choose {chosen} worker{'s' if chosen > 1 else ''}"
    )
    process, base_url = start_simulator()
    columns = []
    with tempfile.TemporaryDirectory(prefix="llmspans-load-benchmark-") as scratch:
        traces = Path(scratch) / "traces.jsonl"
        llmspans.configure(service_name="llmspans-load-benchmark", traces_file=traces)
        try:
            for workers in columns_asked:
                columns.append(_column(workers, args.rate, count, base_url, traces, process.pid))
        finally:
            process.terminate()
            process.wait(10)
            from opentelemetry import trace

            trace.get_tracer_provider().shutdown()  # type: ignore[attr-defined]
    _print(columns, args.rate)
    kept = [column for column in columns if column.kept(args.rate)]
    target = f"{args.rate:g} requests/s with the schedule lag p99 under {TARGET_P99_S * 1e3:.0f} ms"
    if kept:
        best = min(kept, key=lambda column: column.workers)
        assert best.stats.lag is not None
        print(f"{target}: KEPT with {best.workers} worker(s) (p99 {_ms(best.stats.lag.p99)})")
    else:
        print(
            f"{target}: NOT kept on this machine now (load average {os.getloadavg()[0]:.1f}); the run marks such a "
            "level BEHIND and counts the lag in every latency"
        )
    figure_of_record("benchmarks/load.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
