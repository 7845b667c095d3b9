"""How fast and how flat `llmspans report FILE` is on a large file, against its decoder's floor, in one run.

The file is `llmspans demo`'s own output (the embedded default's OTLP-JSON lines of a `healthy` and a
`retries` run, spans and metric points alike), replicated with new trace ids and shifted in time until it
reaches the target size (150 MB: about 20,000 traces and 160,000 spans). Each path runs in a child process
of its own, so its peak RSS is its own (`wait4`'s `ru_maxrss`); MB/s is the file's size over the child's
wall time, imports included. The report is `llmspans report FILE --json`; the floor is its decoder
(msgspec) reading the same file into the per-span facts the analysis needs, alone (`report_engines.py
msgspec`): what is left is the report's own work. (The old whole-in-memory report that issue 16 replaced
is gone; its last figures are in docs/report.md.)

    python benchmarks/report.py                 # 150 MB, report and floor, one round each
    python benchmarks/report.py --mb 20 --rounds 3
    python benchmarks/report.py --quick         # 5 MB: checks that it runs
    python benchmarks/report.py --engines       # also the engine candidates' extraction alone (see README)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("healthy", "retries")
_TRACE_ID = re.compile(rb'"traceId":"([0-9a-f]{32})"')
_TIME = re.compile(rb'"(startTimeUnixNano|endTimeUnixNano|timeUnixNano)":"([0-9]+)"')


def demo_output(workdir: Path) -> list[bytes]:
    """The traces file lines of one demo run per scenario (the openai SDK drives the retries one)."""
    lines: list[bytes] = []
    for scenario in SCENARIOS:
        traces = workdir / f"demo-{scenario}.jsonl"
        env = {**os.environ, "LLMSPANS_TRACES_FILE": str(traces)}
        for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            env.pop(name, None)
        subprocess.run(
            [sys.executable, "-m", "llmspans", "demo", "--scenario", scenario, "--json"],
            cwd=workdir, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300,
        )  # fmt: skip
        lines += [line for line in traces.read_bytes().splitlines() if line.strip()]
    return lines


def replicate(lines: list[bytes], target_bytes: int, out: Path) -> tuple[int, int]:
    """Copies of `lines` with new trace ids, each copy later in time than the last, up to the target size.

    Returns (copies, bytes written)."""
    times = [int(match.group(2)) for line in lines for match in _TIME.finditer(line)]
    period = max(times) - min(times) + 1_000_000_000
    written = copies = 0
    with out.open("wb") as file:
        while written < target_bytes:
            shift = copies * period
            prefix = b"%08x" % copies

            def new_id(match: re.Match[bytes], prefix: bytes = prefix) -> bytes:
                return b'"traceId":"' + prefix + match.group(1)[8:] + b'"'

            def later(match: re.Match[bytes], shift: int = shift) -> bytes:
                return b'"%s":"%d"' % (match.group(1), int(match.group(2)) + shift)

            for line in lines:
                data = _TIME.sub(later, _TRACE_ID.sub(new_id, line)) + b"\n"
                file.write(data)
                written += len(data)
            copies += 1
    return copies, written


def measure(argv: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one child process."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.stderr is not None
    errors = process.stderr.read().decode()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} ... failed ({process.returncode}): {errors[-2000:]}")
    return elapsed, usage.ru_maxrss / 1024  # Linux: kilobytes


FLOOR = "floor (msgspec extraction)"
REPORT = "llmspans report --json"


def paths(file: Path) -> dict[str, list[str]]:
    script = str(Path(__file__).with_name("report_engines.py"))
    return {
        FLOOR: [sys.executable, script, "msgspec", str(file)],
        REPORT: [sys.executable, "-m", "llmspans", "report", str(file), "--json"],
    }


def engines(file: Path) -> dict[str, list[str]]:
    """The candidates' extraction of the per-span facts the analysis needs, alone (benchmarks/report_engines.py)."""
    script = str(Path(__file__).with_name("report_engines.py"))
    return {f"engine: {name}": [sys.executable, script, name, str(file)] for name in
            ("json", "orjson", "msgspec", "duckdb", "polars")}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=150.0, help="size of the replicated file (150)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each path, interleaved (1)")
    parser.add_argument("--quick", action="store_true", help="5 MB, one round: checks that it runs")
    parser.add_argument("--engines", action="store_true", help="also time each engine's extraction alone")
    parser.add_argument("--keep", metavar="FILE", help="also keep the replicated file here")
    args = parser.parse_args()
    mb = 5.0 if args.quick else args.mb
    with tempfile.TemporaryDirectory(prefix="llmspans-report-bench-") as tmp:
        workdir = Path(tmp)
        lines = demo_output(workdir)
        big = Path(args.keep) if args.keep else workdir / "replicated.jsonl"
        copies, size = replicate(lines, int(mb * 1e6), big)
        span_lines = [line for line in lines if line.startswith(b'{"resourceSpans"')]
        spans = sum(line.count(b'"spanId":"') for line in span_lines) * copies
        traces = len({match.group(1) for line in span_lines for match in _TRACE_ID.finditer(line)}) * copies
        print(f"file: {size / 1e6:.1f} MB, {copies} copies of {len(lines)} demo lines ({', '.join(SCENARIOS)}): "
              f"{traces:,} traces, {spans:,} spans")  # fmt: skip
        runs = paths(big)
        if args.engines:
            runs.update(engines(big))
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        for _ in range(max(1, args.rounds)):
            for name, argv in runs.items():
                figures[name].append(measure(argv))
        print(f"{'path':<28}{'seconds':>9}{'MB/s':>8}{'peak RSS MB':>13}")
        for name, results in figures.items():
            seconds = sorted(r[0] for r in results)[len(results) // 2]
            rss = max(r[1] for r in results)
            print(f"{name:<28}{seconds:>9.2f}{size / 1e6 / seconds:>8.1f}{rss:>13.0f}")
        floor, report = figures[FLOOR], figures[REPORT]
        floor_s = sorted(r[0] for r in floor)[len(floor) // 2]
        report_s = sorted(r[0] for r in report)[len(report) // 2]
        rss = max(r[1] for r in report) / max(r[1] for r in floor)
        print(f"report/floor: {report_s / floor_s:.2f}x the time, peak RSS {rss:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
