"""The report's golden files: today's `llmspans report` text and JSON for fixed inputs.

    python -m tests.support.report_golden --check    # compare today's output with the golden files
    python -m tests.support.report_golden --update   # rewrite the golden files from today's report
    python -m tests.support.report_golden --inputs   # remake the demo-derived inputs, then --update

`tests/test_report_golden.py` runs the comparison. Rewrite the golden files only when the report is meant
to change, and say so in the commit (`git diff tests/golden/report/` is the review of that change).

The cases are those the frozen pre-issue-16 report was the oracle for (the report read in one pass and in
two, across formats and file orders): the recorded client and vLLM server files in both orders, a saved
Jaeger page, a `retries` demo run as a batch exporter writes it (spans in the order they ended, metric
lines between, a truncated last line), six shifted copies of it interleaved in a shuffled order (traces
split across lines, tied durations, late spans: the two-pass exact mode), and four files at once. The
demo run (`tests/golden/report/inputs/retries.jsonl`) is a file, not remade per run, so the outputs are
fixed; the shuffled copies are made from it the same way each time. `--inputs` remakes it (a new demo
run: every timing changes, so the golden outputs are rewritten too).

Each case is reported as the command line does it, from the repository root with the paths as written
here (they appear in the report's `from ...` line and `sources`): the text of `llmspans report FILE...`
and the JSON of `llmspans report FILE... --json`.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import json
import os
import random
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path("tests/golden/report")
INPUTS = GOLDEN / "inputs"
RECORDED = "tests/fixtures/embedded-default.jsonl"
VLLM = "tests/fixtures/vllm-server.jsonl"
JAEGER = "tests/fixtures/jaeger-find-traces.json"
RETRIES = f"{INPUTS}/retries.jsonl"
REPLICATED = f"{INPUTS}/replicated.jsonl"  # made from RETRIES when reported, never stored

# case name -> the files, in the order given on the command line
CASES: dict[str, tuple[str, ...]] = {
    "client-then-server": (RECORDED, VLLM),
    "server-then-client": (VLLM, RECORDED),
    "jaeger-document": (JAEGER,),
    "demo-retries": (RETRIES,),
    "replicated-shuffled": (REPLICATED,),
    "four-files": (RETRIES, REPLICATED, RECORDED, VLLM),
}
KINDS = ("txt", "json")


@contextmanager
def _at_root() -> Iterator[None]:
    """Paths relative to the repository root, as the golden files name them."""
    before = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(before)


def replicated(retries: str) -> str:
    """6 copies of the retries run's span lines with new trace ids, each shifted later in time (by 1 s,
    then 2 s more, ...: durations tie across copies), their lines shuffled with a fixed seed (late spans:
    some traces are read in the two-pass exact mode)."""
    copies = []
    shift = 0
    batches = [line for line in retries.splitlines() if line.startswith('{"resourceSpans"')]
    for copy in range(6):
        shift += 10**9 * (1 + copy)
        for line in batches:
            document = json.loads(line)
            for span in document["resourceSpans"][0]["scopeSpans"][0]["spans"]:
                span["traceId"] = f"{copy:02x}{span['traceId'][2:]}"
                for key in ("startTimeUnixNano", "endTimeUnixNano"):
                    span[key] = str(int(span[key]) + shift)
            copies.append(json.dumps(document))
    random.Random(16).shuffle(copies)
    return "\n".join(copies) + "\n"


def render(case: str) -> dict[str, str]:
    """Today's report of one case: {"txt": what `llmspans report` prints, "json": what `--json` prints}."""
    from llmspans.report._cli import _Options, _span_report
    from llmspans.report._sources.file import FileSource
    from llmspans.report._text import render as render_text

    with tempfile.TemporaryDirectory(prefix="llmspans-golden-") as folder, _at_root():
        # The replicated file is made from the retries one (1 MB it need not be in git); the report
        # names it by its place in CASES, as it names every other file.
        made = Path(folder) / "replicated.jsonl"
        made.write_text(replicated(Path(RETRIES).read_text()))
        paths = [made if path == REPLICATED else Path(path) for path in CASES[case]]
        source = FileSource(paths, progress=False)
        source.sources = list(CASES[case])
        report = _span_report(source, _Options(None, 5, None, None))
    return {"txt": render_text(report, None), "json": json.dumps(report.to_dict(), indent=2) + "\n"}


def golden_path(case: str, kind: str) -> Path:
    return ROOT / GOLDEN / f"{case}.{kind}"


def differences(case: str) -> list[str]:
    """A unified diff per output of `case` that differs from its golden file (empty: all equal)."""
    diffs = []
    for kind, today in render(case).items():
        path = golden_path(case, kind)
        golden = path.read_text(encoding="utf-8") if path.exists() else ""
        if golden != today:
            lines = difflib.unified_diff(
                golden.splitlines(keepends=True), today.splitlines(keepends=True),
                fromfile=str(GOLDEN / path.name), tofile="today", n=2,
            )  # fmt: skip
            diffs.append("".join(lines) or f"{path.name}: missing")
    return diffs


def update() -> list[Path]:
    """Write every case's golden files from today's report; the files written."""
    written = []
    for case in CASES:
        for kind, text in render(case).items():
            path = golden_path(case, kind)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            written.append(path)
    return written


def make_inputs() -> None:
    """A `retries` demo run (attempt spans, failures, retried calls), written the way a batch exporter
    does: spans in the order they ended, 23 to a line, a metric line after the first, a truncated last
    line."""
    from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans

    from llmspans.testing import capture
    from llmspans.tools.demo import SCENARIOS, run

    with capture() as captured:
        run(SCENARIOS["retries"], requests=16, concurrency=4, seed=5)
        ended = sorted(captured.spans, key=lambda span: span.end_time or 0)
    gc.collect()  # the run's limiter: until collected it reports gauges
    batches = [
        json.dumps(encode_spans(ended[start : start + 23]).to_dict()) for start in range(0, len(ended), 23)
    ]
    metric_line = json.dumps({"resourceMetrics": [{"scopeMetrics": []}]})
    (ROOT / INPUTS).mkdir(parents=True, exist_ok=True)
    (ROOT / RETRIES).write_text("\n".join([batches[0], metric_line, *batches[1:], "{truncated"]) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.report_golden", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true", help="compare today's report with the golden files")
    action.add_argument("--update", action="store_true", help="rewrite the golden files from today's report")
    action.add_argument("--inputs", action="store_true", help="remake the demo-derived inputs, then --update")
    args = parser.parse_args(argv)
    if args.inputs:
        make_inputs()
    if args.update or args.inputs:
        for path in update():
            print(path)
        return 0
    diffs = [diff for case in CASES for diff in differences(case)]
    sys.stdout.write("".join(diffs) or f"{len(CASES) * len(KINDS)} golden files equal today's report\n")
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
