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
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.realservers import (
    _http,
    _http_ok,
    _run_server,
    _ServerProcess,
    free_ports,
    real_servers_required,
)

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
        try:
            process.wait_ready(_http_ok(f"{server.url}/-/ready"), 30.0)
        except Exception:
            process.stop()
            raise
        return process, server

    with _run_server("prometheus", start) as server:
        yield server
