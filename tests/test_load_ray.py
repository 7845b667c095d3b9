"""`llmspans load --ray` on a real Ray cluster of two nodes on this machine, against the shipped simulator.

One cluster for the module (`ray.cluster_utils.Cluster`, one CPU a node, every Ray process on the loopback
with `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`), torn down at its end with a check that no process it
started is left. Each test runs its load on two generators (one per node) and compares with what one
process gives on the same seed: the same knee and the same "what grew" against a server out of batch
slots, the open loop's arrivals to the nanosecond, every request back with its generator and every call
span in the traces file; a generator killed mid-level counted as lost; Ctrl-C and `--max-seconds`
leaving nothing running; no cluster, or no Ray, one line and exit code 2.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from llmspans import _names as names
from llmspans.load._cli import build_result
from llmspans.load._html import render as render_html
from llmspans.load._model import SHAPE_CONCURRENCY, SHAPE_RATE, GeneratorStats, Level, Result
from llmspans.load._ray import Fleet, connect, generator_setups, generators_for, notes
from llmspans.load._requests import RequestRecord
from llmspans.load._runner import Runner, RunOutcome, new_run_id
from llmspans.load._text import render as render_text
from llmspans.load._workers import WorkerExport
from llmspans.load._workload import Plan, Workload, parse_levels
from llmspans.report._analysis import analyse
from llmspans.report._sources.file import FileSource
from llmspans.report._triage import FINDING_SERVER_QUEUE
from llmspans.tools.capacity import Capacity
from llmspans.tools.simulator import Behavior, SimulatedServer
from llmspans.vllm import ServerMetrics
from tests.support.realservers import real_servers_required
from tests.test_load import providers

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
NODES = 2
GONE_WITHIN_S = 20.0  # a killed actor's or a stopped node's processes exit within this (Ray reaps them)


def _children() -> dict[int, int]:
    """Every process of the machine, by pid, with its parent's pid."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(pid: int) -> set[int]:
    parents = _children()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: Sequence[int] | set[int]) -> set[int]:
    """Those still running (a zombie counts as gone: it has exited)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.add(pid)
    return running


def wait_gone(pids: Sequence[int] | set[int], within: float = GONE_WITHIN_S) -> set[int]:
    deadline = time.monotonic() + within
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


@dataclass
class RayCluster:
    address: str
    ray: Any


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    """Two nodes of one CPU on 127.0.0.1, this process connected as a driver; nothing of it left after."""
    if importlib.util.find_spec("ray") is None:
        if real_servers_required():
            pytest.fail("Ray is not installed: pip install -e '.[ray]' (.ci/run does)", pytrace=False)
        pytest.skip("Ray is not installed (pip install -e '.[ray]')")
    saved = {name: os.environ.get(name) for name in LOOPBACK}
    os.environ.update(LOOPBACK)  # before Ray is imported: it reads the variable then, here and in every node
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    assert not ray_constants.ENABLE_RAY_CLUSTER, "Ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"
    before = descendants(os.getpid())
    started: set[int] = set()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        for _ in range(NODES - 1):
            nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, logging_level=logging.ERROR, log_to_driver=False)
        assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
        yield RayCluster(nodes.address, ray)
    finally:
        started = descendants(os.getpid()) - before
        ray.shutdown()
        nodes.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    left = wait_gone(started)
    assert not left, f"Ray processes left running: {sorted(left)}"


@dataclass
class Ran:
    runner: Runner
    outcome: RunOutcome
    result: Result
    pids: list[int]


async def run_on(
    base_url: str,
    workload: Workload,
    plan: Plan,
    *,
    generators: int | None,
    traces: Path | None = None,
    provider: str | None = None,
    limiter_cap: int | None = None,
    progress: Any = None,
    stop: Any = None,
    fleets: list[Fleet] | None = None,
) -> Ran:
    """The plan on one process (`generators=None`) or on that many Ray generators, as the command runs it."""
    run_id = new_run_id()
    server = ServerMetrics(base_url, interval=0.1) if provider == "vllm" else None
    fleet = None
    if generators is not None:
        setups = generator_setups(
            workload, base_url=base_url, api_key="none", provider=provider, max_retries=0, timeout=30,
            run_id=run_id, service_name="llmspans-load-ray-test", client="httpx", limiter_cap=limiter_cap,
            file_export=traces is not None,
        )  # fmt: skip
        fleet = Fleet(connect(None), generators, setups)
        if fleets is not None:
            fleets.append(fleet)
    try:
        with providers() as (tracer_provider, _):
            runner = Runner(
                workload, plan, base_url=base_url, tracer_provider=tracer_provider, provider=provider,
                server_metrics=server, max_retries=0, timeout=30, run_id=run_id, fleet=fleet, progress=progress,
                export=WorkerExport("llmspans-load-ray-test", traces) if traces is not None else None,
            )  # fmt: skip
            outcome = await runner.run(stop)
    finally:
        if server is not None:
            server.close()
    said = notes(outcome.generators, {}, None) if fleet is not None else []
    result = build_result(
        outcome.levels, workload=workload, plan=plan, target=base_url, run_id=run_id,
        interrupted=outcome.interrupted, notes=[*outcome.notes, *said], generators=outcome.generators,
    )  # fmt: skip
    return Ran(runner, outcome, result, fleet.pids if fleet is not None else [])


def call_spans(path: Path) -> list[dict[str, Any]]:
    """Every call span in a traces file, by its attributes."""
    calls = []
    for line in path.read_text().splitlines():
        for resource in json.loads(line).get("resourceSpans", ()):
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    attributes = {
                        item["key"]: next(iter(item["value"].values())) for item in span["attributes"]
                    }
                    if attributes.get(names.STAGE) == names.STAGE_LLM:
                        calls.append(attributes)
    return calls


# --- the figures are the single machine's --------------------------------------------------------------


@pytest.fixture(scope="module")
def batch_slots() -> Iterator[SimulatedServer]:
    """Four batch slots; a request costs 200 ms of prefill (100 words) and 8 decode steps of 15 ms: at 8
    users half of them wait a whole request's time for a slot (p95 TTFT 2.6 times the prefill), and a
    false knee at 4 needs a stall of the prefill's length, far above a busy machine's noise. No prefix
    cache: the second run sends the first one's prompts (the same seed) and must find the server as cold."""
    capacity = Capacity(
        slots=4, prefill_per_token=0.002, decode_per_token=0.015, prefix_caching=False, model="sim-model"
    )
    with SimulatedServer(capacity=capacity, record=False) as server:
        yield server


async def test_the_knee_and_what_grew_on_two_generators_are_one_processs_for_the_same_seed(
    cluster: RayCluster, batch_slots: SimulatedServer, tmp_path: Path
) -> None:
    """A closed-loop sweep from 2 users (one to four per generator) with --provider vllm and --slo, stopped
    by --max-requests after 2, 4 and 8 users: the same levels, the same knee, the same bucket grew, the
    same finding (the queue is on the server) as one process; every request back once, with the generator
    that sent it. Sixteen requests a level: with eight, the knee level lasted two requests' time, the
    driver's reads of vLLM's /metrics (every 0.25 s) caught two or three samples, and on a loaded machine
    their mean of vLLM's waiting requests could stay under the rule's rise of 1 (0.7 against 1.7)."""
    workload = Workload(model="sim-model", max_tokens=8, prompt_tokens=100)
    plan = Plan(
        shape=SHAPE_CONCURRENCY, levels=parse_levels("2", SHAPE_CONCURRENCY), sweep=True, requests_per_level=16,
        max_requests=48, max_seconds=120, slo={"ttft": 1.5},
    )  # fmt: skip
    # The SLO is for goodput only, and far above the knee's p95 TTFT (about 0.5 s): a level that breaks
    # it ends the sweep, and at 0.3 s a loaded machine's first level did (p95 381 ms at 2 users).
    alone = await run_on(batch_slots.base_url, workload, plan, generators=None, provider="vllm")
    spread = await run_on(batch_slots.base_url, workload, plan, generators=NODES, provider="vllm")
    text = render_text(spread.result)
    for ran in (alone, spread):
        assert ran.result.knee is not None, render_text(ran.result)
        assert ran.result.verdict is not None
    assert alone.result.knee is not None
    assert spread.result.knee is not None
    both = render_text(alone.result) + "\n" + text
    knees = [(ran.result.knee.before.label, ran.result.knee.at.label) for ran in (alone, spread)]
    assert knees[0] == knees[1], both
    assert (spread.result.knee.at.label, spread.result.verdict.grew) == ("concurrency=8", "first_token"), text
    assert spread.result.verdict.finding == alone.result.verdict.finding == FINDING_SERVER_QUEUE, both
    for ran in (alone, spread):
        assert [stats.level.label for stats in ran.outcome.levels] == [
            f"concurrency={users}" for users in (2, 4, 8)
        ]
        assert "stopped before 5 concurrent: --max-requests 48 reached" in ran.outcome.notes
    assert [stats.workers for stats in spread.outcome.levels] == [2, 2, 2]
    nodes = {generator.node for generator in spread.outcome.generators}
    assert len(nodes) == NODES  # one generator a node: spread
    attributes = {generator.attribute for generator in spread.outcome.generators}
    for stats in spread.outcome.levels:
        records = spread.outcome.records[stats.level.label]
        assert sorted(record.index for record in records) == [
            record.index for record in alone.outcome.records[stats.level.label]
        ]
        assert stats.completed == stats.requests == 16
        assert stats.good is not None
        assert stats.server is not None  # the driver read vLLM's /metrics over the level
        assert {record.generator for record in records} == attributes
    assert "The generators on Ray" in text
    assert render_html(spread.result).count('<tr class="generator"') == NODES
    document = json.loads(json.dumps(spread.result.to_dict()))
    assert [generator["attribute"] for generator in document["generators"]] == sorted(attributes)
    for generator in spread.outcome.generators:
        assert generator.requests == 24
        assert generator.lost == 0
        assert generator.cpu_s > 0
        # One machine: the generator's clocks are the driver's, within the measurement's own uncertainty.
        assert abs(generator.clock_offset_s) <= generator.clock_uncertainty_s + 0.001, generator
    assert not wait_gone(spread.pids)


async def test_the_open_loops_arrivals_are_one_machines_and_every_call_span_reaches_the_traces_file(
    cluster: RayCluster, tmp_path: Path
) -> None:
    """Two levels of Poisson arrivals, given prompts, a limiter cap: the generators send the very schedule
    one process sends for the same seed (its runner's draws, dealt round-robin, aligned on the driver's
    clock), and each call span is in the driver's traces file with its level, run and generator, the
    limiter's cap on it."""
    prompts = tuple([{"role": "user", "content": f"prompt number {number}"}] for number in range(5))
    workload = Workload(model="sim-model", max_tokens=4, prompt_tokens=16, prompts=prompts)
    plan = Plan(
        shape=SHAPE_RATE, levels=parse_levels("25,50", SHAPE_RATE), requests_per_level=30, max_seconds=60
    )
    traces = tmp_path / "traces.jsonl"
    with SimulatedServer(Behavior(chunks=4, chunk_gap=0.001), record=True) as server:
        spread = await run_on(server.base_url, workload, plan, generators=NODES, traces=traces, limiter_cap=3)
        sent = [request for request in server.requests if request.path.endswith("/chat/completions")]
    with providers() as (tracer_provider, _):  # what one process would send: its runner's own draws
        alone = Runner(workload, plan, base_url=server.base_url, tracer_provider=tracer_provider)
        schedules = []
        for level in plan.levels:
            schedules.append(alone._schedule(level, 30, 0))
            alone._issued += 30
    for level, schedule in zip(plan.levels, schedules, strict=True):
        theirs = spread.outcome.records[level.label]
        assert [record.index for record in theirs] == [index for index, _ in schedule]
        due = [record.scheduled_ns or 0 for record in theirs]
        assert [at - due[0] for at in due] == [at for _, at in schedule]
        assert all(record.ok and record.recorded for record in theirs)
        assert {record.generator for record in theirs[::2]} == {spread.outcome.generators[0].attribute}
    # The prompts were sent in turn by index, whichever generator sent them (and each generator's warm-up).
    contents = sorted(request.body["messages"][0]["content"] for request in sent)
    assert contents == sorted(
        [f"prompt number {index % 5}" for index in range(60)] + ["prompt number 0"] * NODES
    )
    calls = call_spans(traces)
    assert len(calls) == 60
    assert {call[names.LOAD_RUN_ID] for call in calls} == {spread.runner.run_id}
    by_generator = {generator.attribute: generator.requests for generator in spread.outcome.generators}
    seen = [call[names.LOAD_GENERATOR] for call in calls]
    assert (
        {attribute: seen.count(attribute) for attribute in set(seen)}
        == by_generator
        == dict.fromkeys(by_generator, 30)
    )
    assert {int(call[names.LIMITER_CAP]) for call in calls} == {3}  # OTLP-JSON: an int as a string
    # `llmspans report` reads the run whole: both levels, every call.
    report = analyse(
        [span for batch in FileSource([traces], progress=False).batches() for span in batch], top=0
    )
    assert [(row.label, row.calls, row.failed) for row in report.levels] == [
        ("rate=25", 30, 0),
        ("rate=50", 30, 0),
    ]  # OTLP-JSON: an int as a string
    assert not glob.glob(
        f"{tempfile.gettempdir()}/llmspans-load-{spread.runner.run_id}-*"
    )  # the generators' own files
    assert not wait_gone(spread.pids)


# --- faults ----------------------------------------------------------------------------------------------


async def test_a_generator_killed_mid_level_is_counted_as_lost_and_the_run_ends_with_one_line(
    cluster: RayCluster,
) -> None:
    """Requests of a second each, 20 a second for 2 s: g2 killed (SIGKILL) once the first records are back,
    mid-level; the level counts its requests in flight as lost, not as errors, and those it had not sent
    yet as not sent (each of its requests is one or the other, or came back); the second level runs on g1
    alone, which is killed in turn: the run ends with one line, and no generator process is left."""
    workload = Workload(model="sim-model", max_tokens=4, prompt_tokens=16)
    plan = Plan(
        shape=SHAPE_RATE, levels=parse_levels("20,20.5", SHAPE_RATE), requests_per_level=40, max_seconds=60
    )
    killed: dict[str, int] = {}
    fleets: list[Fleet] = []

    def progress(level: Level, records: Sequence[RequestRecord], planned: int, final: bool) -> None:
        if final or level.label in killed or not records:
            return
        member = fleets[0].alive[-1]
        assert member.identity is not None
        os.kill(member.identity.pid, signal.SIGKILL)
        killed[level.label] = member.identity.pid

    with SimulatedServer(Behavior(chunks=4, chunk_gap=0.25), record=False) as server:
        ran = await run_on(
            server.base_url, workload, plan, generators=NODES, progress=progress, fleets=fleets
        )
    outcome = ran.outcome
    assert set(killed) == {"rate=20", "rate=20.5"}, killed
    assert len(outcome.levels) == 1  # the second level lost its last generator: not reported
    (first,) = outcome.levels
    assert first.lost >= 1, render_text(ran.result)
    assert not first.errors  # lost, not server errors
    assert first.completed == first.requests
    (line,) = first.lost_generators
    said = re.search(
        r"generator g2 .*: (\d+) requests in flight counted as lost, .*; (\d+) of its 20 requests", line
    )
    assert said is not None, line
    lost, unsent = int(said[1]), int(said[2])
    back = [record for record in outcome.records["rate=20"] if (record.generator or "").startswith("g2@")]
    assert (lost, len(back) + lost + unsent) == (first.lost, 20)
    assert unsent >= 1, line  # killed before its last arrivals were due
    assert outcome.failure is not None
    assert outcome.failure.startswith("every generator was lost")
    text = render_text(ran.result)
    assert (
        "lost"
        in text.splitlines()[text.splitlines().index("Throughput and errors per level (* the knee)") + 1]
    )
    by_name = {generator.name: generator for generator in outcome.generators}
    assert by_name["g2"].lost_during == "rate=20"
    assert by_name["g1"].lost_during == "rate=20.5"
    assert by_name["g2"].lost == first.lost
    assert not wait_gone(ran.pids)


async def test_the_runs_time_cap_stops_every_generator_with_what_it_had_and_leaves_nothing_running(
    cluster: RayCluster,
) -> None:
    """A level of 10 s of arrivals capped by --max-seconds 1.5: every generator stops at the cap with what it
    had, the run ends cleanly with nothing left running, and the synthetic prompts with a shared prefix
    are the ones one machine would send."""
    workload = Workload(model="sim-model", max_tokens=4, prompt_tokens=16, shared_prefix=8)
    plan = Plan(shape=SHAPE_RATE, levels=(Level(SHAPE_RATE, 20),), requests_per_level=200, max_seconds=1.5)
    with SimulatedServer(Behavior(chunks=4, chunk_gap=0.05), record=True) as server:
        started = time.monotonic()
        capped = await run_on(server.base_url, workload, plan, generators=NODES)
        took = time.monotonic() - started
        sent = [request.body["messages"][0]["content"] for request in server.requests if request.body]
    (level,) = capped.outcome.levels
    assert 5 <= level.requests < 100, render_text(capped.result)
    assert not capped.outcome.interrupted
    assert took < 30, took  # the cap, the generators' start and the spans' flush; not the 10 s level
    records = capped.outcome.records[level.level.label]
    expected = {workload.messages(record.index)[0]["content"] for record in records}
    assert expected <= set(sent)
    assert len({" ".join(text.split()[:8]) for text in expected}) == 1  # the shared prefix
    assert not wait_gone(capped.pids)


def _generator_processes() -> set[int]:
    """This test process's Ray generators (actors' workers, which Ray names by their class)."""
    found = set()
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::GeneratorActor"):
                found.add(pid)
    return found


def test_ctrl_c_on_the_command_stops_every_generator_prints_what_it_had_and_leaves_nothing_running(
    cluster: RayCluster, tmp_path: Path
) -> None:
    """`llmspans load ... --ray ADDRESS --json` as a user runs it, Ctrl-C (SIGINT) once its generators are
    sending: exit code 130, the JSON document alone on stdout (Ray's own messages kept off it), the level
    interrupted with its requests, every call span in the traces file, and no generator left."""
    traces = tmp_path / "traces.jsonl"
    environment = {**os.environ, **LOOPBACK, "LLMSPANS_TRACES_FILE": str(traces)}
    with SimulatedServer(Behavior(chunks=4, chunk_gap=0.05), record=True) as server:
        command = [
            sys.executable, "-m", "llmspans", "load", server.base_url, "--model", "sim-model", "--rate", "20",
            "--requests", "400", "--max-tokens", "4", "--prompt-tokens", "16", "--json", "--ray", cluster.address,
        ]  # fmt: skip
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=ROOT
        )
        seen: set[int] = set()
        deadline = time.monotonic() + 120
        while len(server.requests) < NODES + 10 and process.poll() is None and time.monotonic() < deadline:
            seen |= _generator_processes()
            time.sleep(0.05)
        seen |= _generator_processes()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert len(seen) == NODES, seen
    document = json.loads(out)
    assert document["interrupted"] is True
    (level,) = document["levels"]
    assert 10 <= level["requests"] < 400
    assert len(document["generators"]) == NODES
    assert len(call_spans(traces)) == level["requests"]
    assert not wait_gone(seen)


def test_the_command_without_a_cluster_or_without_ray_says_so_in_one_line_and_the_runtime_never_imports_ray(
    tmp_path: Path,
) -> None:
    """`--ray ADDRESS` where nothing listens: one line and exit code 2, in seconds (`ray.init` alone would
    wait minutes). Without Ray: one line naming the extra, exit code 2; and importing llmspans, its load
    tool and the Ray mode's own modules imports no Ray."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once closed
    environment = {**os.environ, **LOOPBACK, "LLMSPANS_TRACES_FILE": str(tmp_path / "t.jsonl")}
    environment.pop("RAY_ADDRESS", None)
    arguments = ["load", "http://127.0.0.1:9/v1", "--model", "m", "--ray"]
    no_cluster = subprocess.Popen(
        [sys.executable, "-m", "llmspans", *arguments[:-1], f"--ray=127.0.0.1:{port}"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=environment, cwd=ROOT,
    )  # fmt: skip
    without_ray = (
        "import sys, llmspans, llmspans.load._cli, llmspans.load._runner, llmspans.load._ray, "
        "llmspans.load._ray_actor, llmspans.load._text, llmspans.load._html\n"
        "assert not [name for name in sys.modules if name.split('.')[0] == 'ray'], 'ray imported'\n"
        "sys.modules['ray'] = None  # as if it were not installed\n"
        "from llmspans.__main__ import main\n"
        f"sys.exit(main({arguments!r}))"
    )
    no_ray = subprocess.run(
        [sys.executable, "-c", without_ray],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=60,
    )
    assert no_ray.returncode == 2, no_ray.stderr
    assert no_ray.stderr == "llmspans load: --ray needs Ray: pip install 'llmspans[ray]'\n"
    out, err = no_cluster.communicate(timeout=60)
    assert no_cluster.returncode == 2, err
    assert not out
    assert err.count("\n") == 1, err
    assert err.startswith(f"llmspans load: no Ray cluster answers at 127.0.0.1:{port} ("), err


def test_the_run_names_a_generator_behind_its_schedule_a_node_whose_clock_is_off_and_a_loopback_collector() -> (
    None
):
    """The lines a run says about its generators, from their figures (a real cluster's clocks are one
    machine's here, so the clock line is fed an offset): nothing to say of generators that kept up."""

    def generator(name: str, node: str, worst: tuple[str, float] | None, offset: float) -> GeneratorStats:
        return GeneratorStats(
            name=name, attribute=f"{name}@{node}/0a1b2c3d", node=node, requests=100, lost=0, cpu_s=0.1, cpu_per_request_s=0.001,
            lag=None, lag_worst=worst, clock_offset_s=offset, clock_uncertainty_s=0.002,
        )  # fmt: skip

    calm = [generator("g1", "10.0.0.5:3f2a1b9c", ("rate=40", 0.0012), 0.004)]
    assert notes(calm, {}, "10.0.0.5") == []
    busy = generator("g2", "10.0.0.6:5e6f7a8b", ("rate=80", 0.0123), -0.250)
    said = notes([*calm, busy], {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:4318"}, "10.0.0.5")
    assert len(said) == 3, said
    assert said[0].startswith(
        "generator g2 on node 10.0.0.6:5e6f7a8b lags behind its schedule: lag p99 12.3 ms at rate=80"
    )
    assert said[1].startswith("node 10.0.0.6:5e6f7a8b's clock is 250 ms behind the driver's (+-2.0 ms)")
    assert said[2].startswith(
        "the spans go to http://localhost:4318, on the loopback: generators on other machines (10.0.0.6:5e6f7a8b)"
    )


def test_generators_per_cpu_or_a_number_the_cluster_can_place() -> None:
    assert generators_for("per-cpu", 6) == 6
    assert generators_for("3", 6) == 3
    for spec, cpus, says in (
        ("7", 6, "--generators 7: the Ray cluster has 6 CPUs and each generator takes one"),
        ("0", 6, "--generators takes a whole number of 1 or more, or per-cpu; got '0'"),
        ("many", 6, "--generators takes a whole number of 1 or more, or per-cpu; got 'many'"),
        ("per-cpu", 0, "the Ray cluster has no CPU for a generator"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            generators_for(spec, cpus)
