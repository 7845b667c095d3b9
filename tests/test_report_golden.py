"""Today's `llmspans report` equals its golden files: text and JSON for six fixed inputs.

The golden files (`tests/golden/report/`) replaced the frozen pre-issue-16 report that was the oracle
here: on these inputs they were checked equal to that oracle's JSON (on the keys both had) before it was
deleted. A change to the report that is meant shows up as a diff of the golden files:
`python -m tests.support.report_golden --update` rewrites them (see its docstring).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from llmspans.report._sources.file import FileSource
from llmspans.report._traces import LateSpan, optimistic_traces
from tests.support import report_golden
from tests.support.report_golden import CASES, REPLICATED, RETRIES, differences, golden_path

UPDATE = "python -m tests.support.report_golden --update"


@pytest.mark.parametrize("case", list(CASES))
def test_the_report_equals_its_golden_text_and_json(case: str) -> None:
    diffs = differences(case)
    assert diffs == [], f"the report changed; if that was meant, run `{UPDATE}`:\n" + "\n".join(diffs)


def _read_in_one_pass(case: str) -> bool:
    with tempfile.TemporaryDirectory() as folder:
        made = Path(folder) / "replicated.jsonl"
        made.write_text(report_golden.replicated((report_golden.ROOT / RETRIES).read_text()))
        paths = [made if path == REPLICATED else report_golden.ROOT / path for path in CASES[case]]
        try:
            for _ in optimistic_traces(FileSource(paths, progress=False).batches()):
                pass
        except LateSpan:
            return False
    return True


def test_the_cases_read_the_input_both_ways() -> None:
    """What the cases are for: the one-pass read and the two-pass (exact) read each give their golden
    answer; a server file after the client's, and shuffled copies, make spans arrive late."""
    one_pass = {case: _read_in_one_pass(case) for case in CASES}
    assert one_pass == {
        "client-then-server": False,
        "server-then-client": True,
        "jaeger-document": True,
        "demo-retries": True,
        "replicated-shuffled": False,
        "four-files": False,
    }


def test_the_inputs_hold_what_the_cases_are_about() -> None:
    """The demo run has retries, a failed call, a skipped line and a metric line; the copies tie
    durations; the vLLM file splits first_token; the Jaeger page is one whole document."""
    reports = {case: json.loads(golden_path(case, "json").read_text()) for case in CASES}
    retries = reports["demo-retries"]
    assert [skip["line"] for skip in retries["skipped"]] == [10]
    text = (report_golden.ROOT / RETRIES).read_text().splitlines()
    assert text[1].startswith('{"resourceMetrics"')
    assert text[-1] == "{truncated"
    assert retries["retries"]["retried_calls"] > 0
    assert retries["retries"]["failed"] > 0
    assert reports["replicated-shuffled"]["traces"] == 6 * retries["traces"]
    assert reports["four-files"]["traces"] == 7 * retries["traces"] + reports["client-then-server"]["traces"]
    assert reports["client-then-server"]["server"]["calls"] > 0
    assert reports["client-then-server"] == {
        **reports["server-then-client"],
        "sources": list(CASES["client-then-server"]),
    }
    assert reports["jaeger-document"]["traces"] == reports["client-then-server"]["traces"]


def test_the_update_command_writes_what_the_test_compares(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--update` and `--check` are the test's own comparison: after an update into a copy of the
    golden folder, the check passes; a changed golden file fails it with a diff."""
    monkeypatch.setattr(report_golden, "golden_path", lambda case, kind: tmp_path / f"{case}.{kind}")
    assert report_golden.main(["--update"]) == 0
    assert report_golden.main(["--check"]) == 0
    target = tmp_path / "jaeger-document.txt"
    target.write_text(target.read_text().replace("10 traces", "11 traces"))
    assert report_golden.main(["--check"]) == 1
