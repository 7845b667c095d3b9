"""A load run as plain text for a terminal: tables in 100 columns, one row per level, then the verdict."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from llmspans import _names as names
from llmspans.load._model import LevelStats, Percentiles, Result
from llmspans.load._replay_table import ComparedRow, ReplayResult, token_words
from llmspans.report._model import format_seconds as seconds
from llmspans.report._text import WIDTH

# A closed loop whose generator was on the CPU this share of the time may have timed its own work.
BUSY_SHARE = 0.8


def _wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(
        text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False
    )


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], first: int = 16, width: int = 9
) -> list[str]:
    lines = []
    for cells in [headers, *rows]:
        line = "  " + cells[0][:first].ljust(first) + "".join(cell.rjust(width) for cell in cells[1:])
        lines.append(line.rstrip())
    return lines


def _q(figures: Percentiles | None, q: float) -> str:
    return "-" if figures is None else seconds(figures.at(q))


def render(result: Result) -> str:
    out = [f"llmspans load: {result.target}, model {result.model}, run {result.run_id}"]
    out += _wrap(result.workload)
    for note in result.notes:
        out += _wrap(f"note: {note}")
    if result.replay is not None:
        out += _replay(result.replay)
    levels = sorted(result.levels, key=lambda stats: stats.level.value)
    if not levels:
        out.append("")
        out.append("No level ran.")
        return "\n".join(out) + "\n"
    knee = result.knee.at if result.knee is not None else None

    def label(stats: LevelStats) -> str:
        return stats.level.label + (" *" if stats.level == knee else "")

    out.append("")
    slo = f", goodput under {_slo(result.slo)}" if result.slo else ""
    out.append(f"Throughput and errors per level (* the knee){slo}")
    lost = any(stats.lost for stats in levels)  # `--ray`: requests on a generator that was lost
    headers = [
        "level",
        "requests",
        "ok",
        "errors",
        *(["lost"] if lost else []),
        "retries",
        "req/s",
        "tok/s",
    ] + (["goodput"] if result.slo else [])
    rows = []
    for stats in levels:
        row = [
            label(stats), str(stats.requests + stats.lost), str(stats.completed), str(stats.failed),
            *([str(stats.lost)] if lost else []), str(stats.retries), f"{stats.requests_per_s:.1f}",
            f"{stats.output_tokens_per_s:.0f}",
        ]  # fmt: skip
        if result.slo:
            row.append("-" if stats.goodput_per_s is None else f"{stats.goodput_per_s:.1f}")
        rows.append(row)
    out += _table(headers, rows)

    out.append("")
    out.append("Latency per level (nearest-rank percentiles; TTFT and e2e from the request's start)")
    headers = ["level", "TTFT p50", "p95", "p99", "TPOT p95", "ITL p95", "e2e p50", "p95", "p99"]
    rows = [
        [
            label(stats),
            _q(stats.ttft, 0.5),
            _q(stats.ttft, 0.95),
            _q(stats.ttft, 0.99),
            _q(stats.tpot, 0.95),
            _q(stats.itl, 0.95),
            _q(stats.e2e, 0.5),
            _q(stats.e2e, 0.95),
            _q(stats.e2e, 0.99),
        ]
        for stats in levels
    ]
    out += _table(headers, rows)

    out.append("")
    out.append("Each bucket's p95 per level (per call), and the report's dominant part at p95")
    headers = ["level", *names.BUCKETS, "dominant"]
    rows = [
        [
            label(stats),
            *(seconds(stats.buckets_p95[bucket]) for bucket in names.BUCKETS),
            _short(stats.dominant),
        ]
        for stats in levels
    ]
    out += _table(headers, rows, width=12)

    out.append("")
    out.append(
        "The load generator per level: its processes, its CPU per request, and its lag behind the schedule"
    )
    out.append("(open loop; the lag is counted in every latency above)")
    rows = [
        [label(stats), str(stats.workers), _cpu(stats), _q(stats.lag, 0.5), _q(stats.lag, 0.95), _q(stats.lag, 0.99),
         "-" if stats.lag is None else seconds(stats.lag.max),
         "-" if stats.lag is None else "BEHIND" if stats.behind_schedule else "kept up"]
        for stats in levels
    ]  # fmt: skip
    out += _table(["level", "workers", "CPU/req", "lag p50", "p95", "p99", "max", "schedule"], rows)
    out += _generators(result)

    if any(stats.server is not None for stats in levels):
        out.append("")
        out.append("vLLM's /metrics over each level (mean / max)")
        rows = []
        for stats in levels:
            server = stats.server
            if server is None:
                rows.append([label(stats), "-", "-", "-", "-", "-"])
                continue
            rows.append([
                label(stats),
                f"{server.waiting_mean:.1f}/{server.waiting_max}",
                f"{server.running_mean:.1f}/{server.running_max}",
                "-" if server.kv_cache_usage_max is None else f"{server.kv_cache_usage_mean or 0:.0%}/{server.kv_cache_usage_max:.0%}",
                "-" if server.preemption_rate_mean is None else f"{server.preemption_rate_mean:.2f}",
                "-" if server.prefix_cache_hit_ratio_mean is None else f"{server.prefix_cache_hit_ratio_mean:.0%}",
            ])  # fmt: skip
        out += _table(["level", "waiting", "running", "KV cache", "preempt/s", "prefix hits"], rows, width=12)

    warnings = []
    ray = bool(result.generators)  # the level's processes are Ray generators, spread by --generators
    spread = "--generators" if ray else "--workers"
    for stats in levels:
        if stats.behind_schedule and stats.lag is not None:
            warnings.append(
                f"{stats.level.words}: the client could not keep the schedule (lag p99 {seconds(stats.lag.p99)} on "
                f"{_processes(stats.workers, ray)}); its latencies include that lag: more {spread}, if "
                f"{'the cluster' if ray else 'this machine'} has idle CPUs, or fewer requests/s"
            )
        busy = _busy(stats)
        if stats.lag is None and busy is not None and busy >= BUSY_SHARE:
            warnings.append(
                f"{stats.level.words}: the load generator was busy {busy:.0%} of the level on "
                f"{_processes(stats.workers, ray)}: its own time may be in the latencies ({spread} N spreads it)"
            )
        if stats.shared_host is not None and stats.shared_cpu_share is not None:
            warnings.append(
                f"{stats.level.words}: the target is on this machine and {stats.shared_host}; the generator "
                f"used {stats.shared_cpu_share:.0%} of a CPU over the level, CPU the server may not have had: "
                "its figures may be slower than the server is. Pin them apart (taskset -c) or run the "
                "generator on another machine"
            )
        if stats.generator_inflated and stats.loop_lag is not None and stats.ttft is not None:
            warnings.append(
                f"{stats.level.words}: the generator's own work is in these latencies: its event loop woke "
                f"{seconds(stats.loop_lag.p50)} late at the median ({seconds(stats.loop_lag.p95)} p95) against a "
                f"TTFT p50 of {seconds(stats.ttft.p50)}: more {spread}, a less busy machine, or fewer requests "
                "per process"
            )
        for line in stats.lost_generators:
            warnings.append(f"{stats.level.words}: {line}")
        if stats.unrecorded:
            warnings.append(
                f"{stats.level.words}: {stats.unrecorded} successful calls had no span (sampled out?)"
            )
        if stats.tokens_counted_as_chunks:
            warnings.append(
                f"{stats.level.words}: the server reported no usage: tokens are counted as content chunks"
            )
        if stats.errors:
            kinds = ", ".join(f"{kind} ×{count}" for kind, count in stats.errors.items())
            warnings.append(f"{stats.level.words}: {stats.failed} failed ({kinds})")
    if warnings:
        out.append("")
        for warning in warnings:
            out += _wrap(f"note: {warning}")
    out.append("")
    out += _wrap(("Interrupted: " if result.interrupted else "") + result.summary)
    if result.verdict is not None:
        for note in result.verdict.notes:
            out += _wrap(f"also: {note}", "  ")
    return "\n".join(out) + "\n"


def _generators(result: Result) -> list[str]:
    """`--ray`: one row per generator over the run."""
    if not result.generators:
        return []
    width = max(len("node"), *(len(generator.node) for generator in result.generators)) + 2

    def line(first: str, node: str, cells: Sequence[str]) -> str:
        return (
            "  " + first.ljust(11) + node.ljust(width) + "".join(cell.rjust(10) for cell in cells)
        ).rstrip()

    out = [
        "",
        "The generators on Ray over the run (workers above: how many sent each level; a --limiter-cap applies",
        "per generator; lag p99: at its worst level; clock: its wall clock minus the driver's)",
        line("generator", "node", ["requests", "lost", "CPU/req", "lag p99", "at", "clock ms"]),
    ]
    for generator in result.generators:
        cpu = generator.cpu_per_request_s
        worst = generator.lag_worst
        out.append(
            line(
                generator.name + (" (lost)" if generator.lost_during else ""),
                generator.node,
                [
                    str(generator.requests),
                    str(generator.lost),
                    "-" if cpu is None else seconds(cpu),
                    "-" if worst is None else seconds(worst[1]),
                    "-" if worst is None else worst[0],
                    f"{generator.clock_offset_s * 1e3:+.1f}±{generator.clock_uncertainty_s * 1e3:.1f}",
                ],
            )
        )
    return out


def _replay(replay: ReplayResult) -> list[str]:
    """The first table of a replay: the recorded calls against the replay at 1x speed; what was assumed."""
    out = [""]
    if replay.speed is None or not replay.rows:
        out.append("Recorded against replayed: no 1x speed level ran (--speed 1 gives the comparison)")
    else:
        out += _wrap(
            f"Recorded against replayed at {replay.speed:g}x speed ({replay.calls} calls; nearest-rank p50 and p95 "
            "of the calls that succeeded, per call)"
        )
        rows = [
            [
                _row_name(row), seconds(row.recorded_p50), seconds(row.recorded_p95), seconds(row.replayed_p50),
                seconds(row.replayed_p95), f"{row.recorded_count}/{row.replayed_count}",
            ]
            for row in replay.rows
        ]  # fmt: skip
        out += _table(
            ["part", "recorded p50", "p95", "replayed p50", "p95", "calls"], rows, first=20, width=13
        )
        if replay.largest is not None:
            out += _wrap(replay.largest)
        if replay.tokens is not None:
            out += _wrap(token_words(replay.tokens))
        if replay.order is not None and replay.order.turns:
            out += _wrap(
                f"turns of several calls sent in their recorded order: {replay.order.in_order} of {replay.order.turns}"
            )
    for line in replay.assumptions:
        out += _wrap(f"assumed: {line}")
    return out


def _row_name(row: ComparedRow) -> str:
    return "llm (the call)" if row.kind == "stage" else row.part


def _cpu(stats: LevelStats) -> str:
    cpu = stats.cpu_per_request_s
    return "-" if cpu is None else seconds(cpu)


def _busy(stats: LevelStats) -> float | None:
    """The share of the level's wall time the generator's processes spent on the CPU, per process."""
    if stats.generator_cpu_s is None or stats.duration_s <= 0:
        return None
    return stats.generator_cpu_s / (stats.duration_s * stats.workers)


def _processes(workers: int, ray: bool = False) -> str:
    if ray:
        return "one Ray generator" if workers == 1 else f"{workers} Ray generators"
    return "one process" if workers == 1 else f"{workers} worker processes"


def _short(label: str | None) -> str:
    if label is None:
        return "-"
    return label.replace(" (llm bucket)", "")


def _slo(slo: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds(limit)}" for name, limit in slo.items())
