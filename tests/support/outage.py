"""An app whose collector is down or failing, run in a process of its own: what it cost, what it said.

The app makes 3,000 stage spans (more than the export queue holds), times `CALLS` streamed calls
through a plain and an instrumented openai client alternately, then makes 5,000 more spans and
measures its RSS around them. It prints its figures when its work is done and the export health
at exit, after the providers' final flush.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Any

OUTAGE_APP = """
import atexit, json, logging, os, statistics, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s|%(levelname)s|%(message)s")
import llmspans, openai
from llmspans import _setup
from llmspans.tools.simulator import Behavior, SimulatedServer

def at_exit():  # registered before configure(): runs after the providers' final flush
    print(json.dumps({"dropped": _setup._export_health[0].dropped, "failures": _setup._export_health[0].failures}), flush=True)

atexit.register(at_exit)

def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

llmspans.configure(service_name=SERVICE, endpoint=ENDPOINT, protocol=PROTOCOL)
created = 0

@llmspans.stage("work")
def work():
    pass

def spans(n):
    global created
    for _ in range(n):
        work()
    created += n

spans(3000)  # more than the queue holds, while the first export is still being retried
with SimulatedServer(Behavior(chunks=8, chunk_gap=0.002, usage="finish")) as server:
    plain = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    instrumented = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0))

    def call(client):
        started = time.perf_counter()
        for _ in client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], stream=True):
            pass
        return time.perf_counter() - started

    for client in (plain, instrumented):
        call(client)
    timings = {"plain": [], "instrumented": []}
    for _ in range(CALLS):
        timings["plain"].append(call(plain))
        timings["instrumented"].append(call(instrumented))
    created += CALLS + 1  # a call span per instrumented call (one attempt each: no attempt span)
before = rss()
spans(5000)
after = rss()
print(json.dumps({
    "plain": statistics.median(timings["plain"]),
    "instrumented": statistics.median(timings["instrumented"]),
    "paired": [b - a for a, b in zip(timings["plain"], timings["instrumented"])],
    "rss_growth": after - before,
    "created": created,
}), flush=True)
"""


def assert_no_slower(result: dict[str, Any]) -> None:
    """The instrumented calls were no slower than the plain ones beside them, beyond a quarter of a call
    and 2 ms for the instrumentation itself, with 95 % confidence.

    Plain and instrumented calls alternate in one process, so a busy machine slows both; what differs
    between a pair is the instrumentation, and the noise. The median paired difference has a
    distribution-free confidence interval from its order statistics (the sign test's); the lower end of
    it must lie within the allowance: a systematic slowdown, as a request path blocked by the failing
    exporter would be, moves the whole interval up and fails, while a noisy run widens it and does not.
    On a quiet machine the interval is a fraction of a millisecond wide.
    """
    paired = sorted(result["paired"])
    n = len(paired)
    lower_rank = max(0, math.floor((n - 1.96 * math.sqrt(n)) / 2))  # 0-based: the 7th of 25
    allowance = result["plain"] * 0.25 + 0.002
    assert paired[lower_rank] <= allowance, (paired[lower_rank], allowance, result)


@dataclass
class OutageRun:
    result: dict[str, Any]
    """plain / instrumented (median seconds per call), rss_growth, created, and dropped / failures at exit."""
    exit_took: float
    """Seconds from the app's last print to its exit (the final flush against the outage)."""
    stderr: str

    def records(self) -> list[list[str]]:
        """[logger name, level, message] of every log record the app wrote."""
        return [line.split("|", 2) for line in self.stderr.splitlines() if line.count("|") >= 2]

    def warnings(self) -> list[str]:
        """The messages of llmspans' own WARNING records."""
        return [
            message for name, level, message in self.records() if name == "llmspans" and level == "WARNING"
        ]


def run_outage_app(endpoint: str, protocol: str, service: str, calls: int) -> OutageRun:
    code = (
        f"ENDPOINT = {endpoint!r}\nPROTOCOL = {protocol!r}\nSERVICE = {service!r}\nCALLS = {calls}\n"
        + textwrap.dedent(OUTAGE_APP)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    process = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    line = process.stdout.readline()  # the app's work is done when it prints
    done = time.monotonic()
    at_exit, stderr = process.communicate(timeout=60)
    exit_took = time.monotonic() - done
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    return OutageRun(json.loads(line) | json.loads(at_exit), exit_took, stderr)
