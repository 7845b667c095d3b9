"""A real Prometheus (Debian's `prometheus` package, 2.42) scraping apps on 127.0.0.1, for the report's tests.

`.ci/run` installs it with apt; without it the tests that need it are skipped locally and fail in CI
(`CI` set) or with `LLMSPANS_REQUIRE_REAL_SERVERS=1`, like the other real servers. Each job of the
scrape configuration is one app's `/metrics`; the scrape interval is short (`SCRAPE_INTERVAL_S`) so a
test of a few seconds has enough samples, and a scrape may take all of it: llmspans' own histograms have 77
boundaries (issue 37), and on a busy 2-core machine an app's `/metrics` then took 0.23 s on average and up to
0.41 s to serve (0.10 s with the conventions' 14), past the 0.4 s allowed before.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple, TextIO

import pytest

from tests.support.realservers import (
    _http,
    _http_ok,
    _run_server,
    _ServerProcess,
    free_ports,
    real_servers_required,
)

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SCRAPE_INTERVAL_S = 0.5


def require_prometheus() -> str:
    if Path(PROMETHEUS).exists():
        return PROMETHEUS
    message = "Prometheus is not installed (apt-get install -y prometheus)"
    if real_servers_required():
        pytest.fail(f"{message}; required in CI", pytrace=False)
    pytest.skip(message)


@dataclass(frozen=True)
class PrometheusServer:
    url: str
    log_path: Path

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        status, body = _http("GET", f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
        assert status == 200, body[:500]
        return [(item["metric"], float(item["value"][1])) for item in json.loads(body)["data"]["result"]]

    def wait_for(self, promql: str, value: float, timeout_s: float = 30.0) -> None:
        """Until the query's single value equals `value`: a scrape holding it is then stored."""
        deadline = time.monotonic() + timeout_s
        seen: list[tuple[dict[str, str], float]] = []
        while time.monotonic() < deadline:
            seen = self.query(promql)
            if seen and abs(seen[0][1] - value) < 1e-9:
                return
            time.sleep(0.1)
        raise AssertionError(f"{promql} never reached {value} within {timeout_s} s; last {seen}")

    def scrapes(self, selector: str, after: float, until: float | None = None) -> list[float]:
        """When Prometheus stored a sample of the series `selector` (a plain series selector, e.g. one
        counter of one job), wall-clock seconds, after `after` and up to `until` (default: now). A scrape
        that failed (a busy app too slow for the scrape timeout) stored none: it is not among them."""
        until = time.time() if until is None else until
        span_ms = max(1, round((time.time() - after) * 1000) + 1000)
        query = urllib.parse.urlencode({"query": f"{selector}[{span_ms}ms]"})
        status, body = _http("GET", f"{self.url}/api/v1/query?{query}")
        assert status == 200, body[:500]
        stamps = {float(at) for series in json.loads(body)["data"]["result"] for at, _ in series["values"]}
        return sorted(at for at in stamps if after < at <= until)

    def window(self, selector: str, settled_at: float, timeout_s: float = 60.0) -> RunWindow:
        """A report window over a run about to start, when the app's counters (`selector`: one of them)
        have not moved since `settled_at` (wall clock). Once Prometheus has stored a scrape `DRIFT` seconds
        after `settled_at` (and half a second), the window begins `DRIFT` seconds before the latest
        scrape: every sample in it before the run holds the settled values, and one of them is still in
        it when the report reads its own clock up to `DRIFT` seconds after the caller asked (`since`) and
        the window slides that much later. increase() then counts the run's whole rise, never less; the
        window holds little idle time before the run (gauges are averaged over it)."""
        drift = RunWindow.DRIFT
        deadline = time.monotonic() + timeout_s
        while not (stored := self.scrapes(selector, settled_at + 0.5 + drift)):
            if time.monotonic() > deadline:
                raise AssertionError(f"no scrape of {selector} stored within {timeout_s} s")
            time.sleep(0.1)
        return RunWindow(self, selector, max(settled_at + 0.5, stored[-1] - drift - 0.05))


@dataclass
class RunWindow:
    """The window from `start` (wall clock) to a report's own `now`; `since()` is its `--since`, taken just
    before the report runs, and `stretch()` just after says how far increase() may have stretched a rise
    counted over it."""

    DRIFT: ClassVar[float] = 1.0
    """Seconds the report may read its clock after `since()` (a thread kept off a busy CPU) and count all."""

    server: PrometheusServer
    selector: str
    start: float
    asked: float = 0.0

    def since(self) -> str:
        self.asked = time.time()
        return f"{self.asked - self.start:.3f}s"

    def stretch(self) -> float:
        """increase() extrapolates the rise between the first and the last sample in the window to its
        edges (it never shrinks it): at most by the window's length over the time between those samples.
        The report read its clock between `since()` and now, so its window slid up to that much later
        than asked (at most `DRIFT` seconds for it to hold the run's whole rise): its first sample is at
        worst the first after `start` plus that slide, and every sample up to `since()` was in it."""
        slide = min(time.time() - self.asked, self.DRIFT)
        stored = self.server.scrapes(self.selector, self.start + slide, self.asked)
        assert len(stored) >= 2, f"{len(stored)} scrapes of {self.selector} in the window"
        return (self.asked - self.start) / (stored[-1] - stored[0])


@contextlib.contextmanager
def prometheus_server(jobs: Mapping[str, int]) -> Iterator[PrometheusServer]:
    """Prometheus scraping `127.0.0.1:<port>/metrics` for each job name -> port."""
    binary = require_prometheus()

    def start(workdir: Path) -> tuple[_ServerProcess, PrometheusServer]:
        (port,) = free_ports(1)
        scrape = "\n".join(
            f'  - job_name: {json.dumps(job)}\n    static_configs:\n      - targets: ["127.0.0.1:{target}"]'
            for job, target in jobs.items()
        )
        config = workdir / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {round(SCRAPE_INTERVAL_S * 1000)}ms\n"
            f"  scrape_timeout: {round(SCRAPE_INTERVAL_S * 1000)}ms\nscrape_configs:\n{scrape}\n"
        )
        log = workdir / "prometheus.log"
        process = _ServerProcess(
            "prometheus",
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            {"PATH": "/usr/bin:/bin"}, workdir, log,
        )  # fmt: skip
        server = PrometheusServer(f"http://127.0.0.1:{port}", log)
        process.ready_or_stopped(_http_ok(f"{server.url}/-/ready"), 30.0)
        return process, server

    with _run_server("prometheus", start) as server:
        yield server


class CuedApp(NamedTuple):
    """An app process that printed `ready` and waits for `go` on its stdin."""

    stdin: TextIO
    stdout: TextIO


@contextlib.contextmanager
def cued_app(*module_and_args: str) -> Iterator[CuedApp]:
    """Run `python -m module args...` at the repository root until it says `ready`; on the way out close its
    stdin (its cue to end) and wait for it, so its last metrics and spans are written before the test reads
    them."""
    app = subprocess.Popen(
        [sys.executable, "-m", *module_and_args],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert app.stdin is not None
    assert app.stdout is not None
    try:
        assert app.stdout.readline().strip() == "ready"
        yield CuedApp(app.stdin, app.stdout)
    finally:
        app.stdin.close()
        app.wait(timeout=30)
