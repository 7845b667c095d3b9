"""Load and soak, bounded: benchmarks/soak.py at its full width (2,000 concurrent async streams and 64
threads of sync calls against the simulator in a process of its own), for three rounds.

It runs as a process of its own too, so what it measures (threads, file descriptors, RSS) is the
client's alone. Every span ends exactly once with the outcome its call must give, nothing is left
over (tasks, threads, file descriptors), nothing warns that does not warn without llmspans, and
memory is flat: the Python heap (allocated blocks) does not grow from round to round, and RSS does
not grow faster than the allocator's own drift, which the same workload shows without llmspans
(about 4 MB a round; `python benchmarks/soak.py --uninstrumented`). The longer run is by hand:
`python benchmarks/soak.py` (eight rounds of 3,280 calls).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"
ROUNDS, STREAMS, THREADS, CALLS = 3, 2000, 64, 6


# Bounded by its work, not by the clock: about 40 s on a quiet 2-core machine, three times that with both
# cores busy elsewhere (stress-ng); the timeouts only stop a run that hangs.
@pytest.mark.timeout(480)
def test_soak_every_span_once_nothing_left_over_memory_flat() -> None:
    command = [
        sys.executable, str(SOAK), "--json", "--rounds", str(ROUNDS), "--streams", str(STREAMS),
        "--threads", str(THREADS), "--calls", str(CALLS), "--baseline-streams", "300",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=450)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    rounds = report["rounds"]
    figures = [
        {
            key: done[key]
            for key in ("seconds", "calls", "peak_open_streams", "spans_ended", "rss_after", "blocks_after")
        }
        for done in rounds
    ]
    print(
        json.dumps(
            {
                "threads_before": report["threads_before"],
                "fds_before": report["fds_before"],
                "rounds": figures,
            }
        )
    )
    assert report["problems"] == [], report["problems"]  # spans, outcomes, tasks, threads, fds, warnings
    assert len(rounds) == ROUNDS
    for done in rounds:
        assert done["calls"] == STREAMS + THREADS * CALLS
        assert (
            done["spans_started"] == done["spans_ended"] == done["calls"]
        )  # one attempt each: no attempt span
        assert done["peak_open_streams"] >= STREAMS * 0.98  # all at once, bar those cancelled before headers
        assert done["outcomes"]["cancelled"] > 0
        assert done["outcomes"]["abandoned"] > done["calls"] // 4
    # Memory: no objects left behind by a round (a leak of one object per call would add thousands
    # of blocks a round), and RSS within the allocator's drift.
    assert rounds[-1]["blocks_after"] - rounds[1]["blocks_after"] < 1_000, figures
    assert rounds[-1]["rss_after"] - rounds[0]["rss_after"] < 12_000_000 * (ROUNDS - 1), figures
