"""Issue 37's five-seed table: what the report says of a tail-sampled run, against the whole run, per seed.

Each seed records the issue's scenario once (tests/support/sampled_scenario.py: 2,000 turns of a retrieval
stage, 7 % at 30 ms else 1 ms, and one non-streamed LLM call, 2 % at 250 ms else 4 ms, against the
simulator over real HTTP, `configure(traces_file=..., tail_sampling=TailSampling(ratio, slower_than))`, every
span also written whole by a plain processor). The seed decides which turns are slow and every trace id, so
a seed keeps the same traces each time; the timings are the machine's. Then, on the same files:

- whole: `llmspans report WHOLE` (every span: the truth);
- sampled: `llmspans report SAMPLED` (the kept spans and the metric points beside them);
- traces only: the same file without its metric lines (an app that exports no metrics);
- before (with `--before REV`): the report of that git revision (e.g. 4012c95, main before issue 37) on the
  sampled file, run from `git archive REV` in a temporary folder.

    python benchmarks/sampled_report.py                       # seeds 1-5 at 1 %, slower_than 200ms
    python benchmarks/sampled_report.py --slower-than p95     # the docs' production setting
    python benchmarks/sampled_report.py --before 4012c95      # and main's report beside it
    python benchmarks/sampled_report.py --seeds 1 2 --ratio 0.05 --slower-than p95 --json out.json
    python benchmarks/sampled_report.py --scale 5 --concurrency 16 --slower-than 1s   # a busy machine

Each report is `llmspans report FILE --json` in a child process. The verdict is the triage's dominant part,
or `cannot tell`; turns are the report's traces (each trace here is one turn); retrieval's p95 is its stage
row's, with the interval the report gives (`-` where it gives none).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _report(path: Path, python_path: Path = ROOT) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "llmspans", "report", str(path), "--json"],
        cwd=python_path, capture_output=True, text=True, timeout=600, check=True,
        env={**os.environ, "PYTHONPATH": str(python_path)},
    )  # fmt: skip
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _verdict(report: dict[str, Any]) -> str:
    triage = report.get("triage")
    if triage is None:
        return "-"
    if not triage.get("told", True):
        return "cannot tell"
    return str(triage["dominant"])


def _p95(report: dict[str, Any], stage: str) -> tuple[float | None, tuple[float, float] | None]:
    for row in report.get("stages", []):
        if row["stage"] == stage:
            durations = row["durations"]
            interval = next((i for i in durations.get("intervals", ()) if i["quantile"] == "p95"), None)
            return durations["p95"], (interval["low"], interval["high"]) if interval else None
    return None, None


def _bucket_p95(report: dict[str, Any], bucket: str) -> float | None:
    return next((row["values"]["p95"] for row in report.get("buckets", []) if row["bucket"] == bucket), None)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def _within(interval: tuple[float, float] | None) -> str:
    return "" if interval is None else f" ({interval[0] * 1e3:.1f}–{interval[1] * 1e3:.1f})"


def _checkout(revision: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--slower-than", default="200ms")
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every delay of the scenario (on a busy machine, 5 keeps its stalls small)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=2,
        help="turns at once (2: at 8 the app's one process is busy on the CPU and its own waits reach "
        "first_token's p95)",
    )  # fmt: skip
    parser.add_argument("--before", metavar="REV", help="also report with this git revision's llmspans")
    parser.add_argument("--json", metavar="OUT", help="also write every figure to this file")
    parser.add_argument("--keep", metavar="DIR", help="keep the recordings in this folder")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="llmspans-sampled-") as temporary:
        work = Path(args.keep or temporary)
        before = _checkout(args.before, work / "before") if args.before else None
        for seed in args.seeds:
            folder = work / f"seed-{seed}"
            started = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "tests.support.sampled_scenario", str(folder), "--seed", str(seed),
                 "--turns", str(args.turns), "--ratio", str(args.ratio), "--slower-than", args.slower_than,
                 "--scale", str(args.scale), "--concurrency", str(args.concurrency)],
                cwd=ROOT, check=True, capture_output=True, timeout=900,
            )  # fmt: skip
            recorded_s = time.perf_counter() - started
            sampled = folder / "sampled.jsonl"
            traces_only = folder / "traces-only.jsonl"
            traces_only.write_text(
                "".join(
                    line + "\n"
                    for line in sampled.read_text().splitlines()
                    if '"resourceMetrics"' not in line
                )
            )
            reports = {"whole": _report(folder / "whole.jsonl"), "sampled": _report(sampled),
                       "traces only": _report(traces_only)}  # fmt: skip
            if before is not None:
                reports["before"] = _report(sampled, before)
            row: dict[str, Any] = {"seed": seed, "recorded_s": round(recorded_s, 1)}
            for name, report in reports.items():
                p95, interval = _p95(report, "retrieval")
                row[name] = {
                    "verdict": _verdict(report), "turns": report.get("traces"), "traces_read": report.get("traces_read"),
                    "retrieval_p95_s": p95, "retrieval_p95_within_s": interval,
                    "first_token_p95_s": _bucket_p95(report, "first_token"),
                    "message": (report.get("triage") or {}).get("message"),
                }  # fmt: skip
            rows.append(row)
            print(f"seed {seed} recorded in {recorded_s:.0f} s", file=sys.stderr)
    names = ["whole", "sampled", "traces only"] + (["before"] if args.before else [])
    scaled = f", every delay x{args.scale:g}" if args.scale != 1 else ""
    print(f"{args.turns} turns{scaled}, tail sampling ratio {args.ratio:g}, slower_than {args.slower_than}; retrieval p95 "
          "(its 95 % interval or histogram bucket, ms); first_token p95 of the whole run for reference\n")  # fmt: skip
    header = "| seed | " + " | ".join(f"{name}: verdict | turns | retrieval p95" for name in names)
    print(header + " | whole first_token p95 |")
    print("|---" * (1 + 3 * len(names) + 1) + "|")
    for row in rows:
        cells = [str(row["seed"])]
        for name in names:
            found = row[name]
            read = f" (of {found['traces_read']} read)" if found["traces_read"] else ""
            cells += [found["verdict"], f"{found['turns']:,}{read}",
                      _ms(found["retrieval_p95_s"]) + _within(found["retrieval_p95_within_s"])]  # fmt: skip
        cells.append(_ms(row["whole"]["first_token_p95_s"]))
        print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"arguments": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
