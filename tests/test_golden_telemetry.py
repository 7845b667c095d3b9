"""What a call exports is what it exported before issue 22's performance work.

`tests/fixtures/golden_telemetry.json` was made on main (054b5e4) before any of that work, by
`tests/fixtures/make_golden_telemetry.py` running the workload of `tests/support/golden.py`: the same
span names, kinds, parents, statuses, attributes and events, metric points (names, units, attributes,
counts, token sums and buckets, exemplars), and `traceparent` headers, through the application's
MeterProvider and through llmspans' own aggregation, sampled, unsampled and without a provider.
Since issue 37 llmspans' own histograms in seconds have finer boundaries (`_metrics.LATENCY_BOUNDARIES`):
the fixture's `bounds` of those three were rewritten to them, nothing else.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures"


def _differences(expected: Any, got: Any, where: str = "") -> list[str]:
    """Where two JSON values differ, as paths, so a failure says what changed rather than dumping both."""
    if isinstance(expected, dict) and isinstance(got, dict):
        found = []
        for key in sorted(set(expected) | set(got)):
            if key not in got:
                found.append(f"{where}/{key}: missing now")
            elif key not in expected:
                found.append(f"{where}/{key}: new ({got[key]!r:.200})")
            else:
                found += _differences(expected[key], got[key], f"{where}/{key}")
        return found
    if isinstance(expected, list) and isinstance(got, list) and len(expected) != len(got):
        shown = {repr(item) for item in got}
        missing = [item for item in expected if repr(item) not in shown]
        known = {repr(item) for item in expected}
        new = [item for item in got if repr(item) not in known]
        return [f"{where}: {len(expected)} items, now {len(got)}; missing {missing!r:.600}; new {new!r:.600}"]
    if isinstance(expected, list) and isinstance(got, list):
        return [line for index, (one, other) in enumerate(zip(expected, got, strict=True))
                for line in _differences(one, other, f"{where}[{index}]")]  # fmt: skip
    if expected != got:
        return [f"{where}: was {expected!r:.300}, now {got!r:.300}"]
    return []


def test_a_calls_spans_metric_points_and_traceparents_are_what_they_were() -> None:
    made = subprocess.run(
        [sys.executable, str(FIXTURES / "make_golden_telemetry.py"), "--print"],
        capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    expected = json.loads((FIXTURES / "golden_telemetry.json").read_text())
    got = json.loads(made.stdout)
    differences = _differences(expected, got)
    assert not differences, "\n".join(differences[:40])
