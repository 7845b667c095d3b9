"""What `llmspans report --tempo URL` costs: 500 traces of 10 spans read from a local Tempo stand-in.

The traces are written once to an OTLP-JSON file; the stand-in (`tests/support/tempo.py`, in a child process
of its own) serves that file through Tempo's API: the search, then `/api/v2/traces/<id>` per trace in
Tempo's JSON mapping. Each round runs, as child processes with their imports, the report of the file itself
(the baseline) and the report from the stand-in, and checks that the two are equal. Printed: wall seconds
and CPU seconds of each report process (`wait4`), the medians over the rounds, and the server's CPU.

    python benchmarks/report_tempo.py               # 500 traces of 10 spans, 5 rounds
    python benchmarks/report_tempo.py --traces 2000 --rounds 3
    python benchmarks/report_tempo.py --quick       # 50 traces, 1 round: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "bench-app"
MS = 1_000_000
_SERVE = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.support.tempo import tempo_server
with tempo_server([Path({path!r})]) as server:
    print(server.url, flush=True)
    sys.stdin.read()  # until the parent closes it
"""


def _attributes(**values: Any) -> list[dict[str, Any]]:
    out = []
    for key, value in values.items():
        key = key.replace("__", ".")
        if isinstance(value, str):
            out.append({"key": key, "value": {"stringValue": value}})
        elif isinstance(value, bool):
            out.append({"key": key, "value": {"boolValue": value}})
        elif isinstance(value, int):
            out.append({"key": key, "value": {"intValue": str(value)}})
        else:
            out.append({"key": key, "value": {"doubleValue": value}})
    return out


def trace_spans(index: int, start_ns: int) -> list[dict[str, Any]]:
    """One chat turn of 10 spans: the turn, 5 app stages, 2 LLM calls with their buckets, 2 attempt spans."""
    trace_id = f"{index + 1:032x}"
    spans: list[dict[str, Any]] = []

    def span(
        name: str, start_ms: float, end_ms: float, parent: str | None, kind: int = 1, **attrs: Any
    ) -> str:
        span_id = f"{len(spans) + 1:04x}{index + 1:012x}"
        spans.append({
            "traceId": trace_id, "spanId": span_id, "parentSpanId": parent or "", "name": name, "kind": kind,
            "startTimeUnixNano": str(start_ns + int(start_ms * MS)), "endTimeUnixNano": str(start_ns + int(end_ms * MS)),
            "attributes": _attributes(**attrs), "status": {},
        })  # fmt: skip
        return span_id

    slow = 1 + (index % 7) / 3  # some spread, so the quantiles differ
    turn = span("turn chat", 0, 900 * slow, None, llmspans__stage="turn")
    span("retrieval retrieve", 1, 60, turn, llmspans__stage="retrieval")
    span("prompt build_prompt", 61, 70, turn, llmspans__stage="prompt")
    span("guardrail guardrail", 71, 80, turn, llmspans__stage="guardrail")
    for number, (begin, length) in enumerate(((81, 400 * slow), (490 * slow, 380 * slow))):
        buckets = {"queue": 0.0, "retry": 0.0, "connect": 0.002, "first_token": 0.3 * length / 1000,
                   "stream": 0.7 * length / 1000 - 0.002, "post": 0.0}  # fmt: skip
        call = span("chat bench-model", begin, begin + length, turn, kind=3, llmspans__stage="llm",
                    gen_ai__request__model="bench-model", gen_ai__request__stream=True,
                    **{f"llmspans__bucket__{b}": v for b, v in buckets.items()})  # fmt: skip
        span(
            "POST",
            begin,
            begin + length,
            call,
            kind=3,
            http__request__method="POST",
            http__request__resend_count=number,
        )
    span("execute_tool order_status", 480 * slow, 489 * slow, turn, llmspans__stage="tool")
    span("post postprocess", 880 * slow, 899 * slow, turn, llmspans__stage="post")
    return spans


def write_traces(path: Path, traces: int) -> None:
    """`traces` turns of the last half hour, 50 to an export line, as the embedded default writes them."""
    now_ns = time.time_ns()
    resource = {"attributes": _attributes(service__name=SERVICE)}
    with path.open("w") as file:
        for first in range(0, traces, 50):
            spans = [s for i in range(first, min(traces, first + 50))
                     for s in trace_spans(i, now_ns - 1800 * 10**9 + i * 3 * 10**9 // 2)]  # fmt: skip
            line = {
                "resourceSpans": [
                    {"resource": resource, "scopeSpans": [{"scope": {"name": "llmspans"}, "spans": spans}]}
                ]
            }
            file.write(json.dumps(line) + "\n")


def timed(argv: list[str]) -> tuple[float, float, bytes]:
    """(wall seconds, CPU seconds, stdout) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)  # reaped children only: the server is not yet
    started = time.perf_counter()
    child = subprocess.run(argv, capture_output=True, cwd=ROOT, timeout=300, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if child.returncode:
        raise SystemExit(f"{' '.join(argv)} failed: {child.stderr.decode()}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, child.stdout


def _cpu_of(pid: int) -> float:
    """CPU seconds a running process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="50 traces, 1 round")
    args = parser.parse_args()
    traces, rounds = (50, 1) if args.quick else (args.traces, args.rounds)
    with tempfile.TemporaryDirectory() as workdir:
        path = Path(workdir) / "traces.jsonl"
        write_traces(path, traces)
        size = path.stat().st_size
        server = subprocess.Popen(
            [sys.executable, "-c", _SERVE.format(root=str(ROOT), path=str(path))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, text=True,
        )  # fmt: skip
        try:
            assert server.stdout is not None
            url = server.stdout.readline().strip()
            report = [sys.executable, "-m", "llmspans", "report", "--service", SERVICE, "--json"]
            rows: dict[str, list[tuple[float, float]]] = {"file": [], "tempo": []}
            server_cpu = 0.0
            for _ in range(rounds):
                wall, cpu, from_file = timed([*report, str(path)])
                rows["file"].append((wall, cpu))
                before = _cpu_of(server.pid)
                wall, cpu, from_tempo = timed([*report, "--tempo", url, "--limit", str(traces)])
                server_cpu += _cpu_of(server.pid) - before
                rows["tempo"].append((wall, cpu))
                a, b = json.loads(from_file), json.loads(from_tempo)
                a.pop("sources"), b.pop("sources")
                if a != b or a["traces"] != traces:
                    raise SystemExit(f"the reports differ (file {a['traces']} traces, tempo {b['traces']})")
        finally:
            if server.stdin is not None:
                server.stdin.close()
            server.wait(10)
    print(f"{traces} traces of 10 spans ({size / 1e6:.1f} MB of OTLP JSON), {rounds} round(s), {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'report':<36} {'wall s (median)':>16} {'CPU s (median)':>15} {'wall s (all)':>30}")
    for name, label in (("file", "llmspans report FILE"), ("tempo", "llmspans report --tempo (stand-in)")):
        walls = [w for w, _ in rows[name]]
        cpus = [c for _, c in rows[name]]
        print(f"{label:<36} {statistics.median(walls):>16.2f} {statistics.median(cpus):>15.2f} "
              f"{' '.join(f'{w:.2f}' for w in walls):>30}")  # fmt: skip
    tempo_wall = statistics.median(w for w, _ in rows["tempo"])
    print(f"the stand-in's own CPU per report: {server_cpu / rounds:.2f} s; reports equal in every round")
    print(
        f"--tempo: {tempo_wall:.2f} s for {traces} traces: {'under' if tempo_wall < 5 else 'NOT under'} 5 s"
    )


if __name__ == "__main__":
    main()
