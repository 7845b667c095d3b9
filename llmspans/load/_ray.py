"""`llmspans load --ray`: the generators as Ray actors on a cluster, the driver keeping the schedule.

The driver (this process) connects to a running cluster (`connect`), starts one actor per generator
(`_ray_actor.GeneratorActor`, one CPU each, spread over the nodes) and, per level, deals them parts of
the one schedule it drew, as the runner deals worker processes theirs: a closed loop's users spread over
the generators, an open loop's arrival times dealt round-robin, so the aggregate is the single-machine
schedule for the same seed. Before each level it measures each generator's clock against its own (the
best of `CLOCK_PINGS` round trips, as AIPerf does): a part's times go out in the generator's monotonic
clock, and the raw records that stream back are put on the driver's; TTFT and e2e are differences on
one clock and never move. Spans go where each generator's `configure()` sends them, with the driver's
`OTEL_*` variables; with the embedded default's file each generator writes one on its node, which the
driver appends into its own traces file at the end.

Faults: a generator that dies (its process, its node) or is stuck past its deadline by `GRACE_S` is
lost; its requests in flight are counted as lost, the level says so, and the run goes on with the
others (`AllLost` when none is left). Ctrl-C and `--max-seconds` stop every part; the actors are killed
when the run ends, whatever ended it.

Ray is imported here only inside functions, and never by the instrumentation runtime. Two private Ray
names are used, both in `llmspans/_internals.py` with the versions they were checked on: what `auto`
means, found before connecting (`ray.init` waits minutes on an address where no cluster is), and the
driver's echo of its raylets' messages (a generator's death), off on a connection of ours: the driver's
stdout holds the result (`--json`) alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmspans import _exporters, _internals
from llmspans.load._generator import LoadError
from llmspans.load._model import GeneratorStats, Percentiles
from llmspans.load._ray_actor import Batch, GeneratorActor, GeneratorSetup, Identity
from llmspans.load._requests import RequestRecord
from llmspans.load._stats import BEHIND_SCHEDULE_S
from llmspans.load._workers import Part, PartDone, Setup
from llmspans.load._workload import Workload

INSTALL_RAY = "--ray needs Ray: pip install 'llmspans[ray]'"
# The epoch of a level is this far ahead of the moment its parts are sent (a call to each actor).
LEAD_S = 0.3
# A generator's clock offset is the best (shortest) of this many round trips, measured before each level.
CLOCK_PINGS = 5
# A node whose wall clock is further than this from the driver's (beyond the measurement's own
# uncertainty) is named: its spans' timestamps are that far off. NTP keeps hosts within a few ms.
CLOCK_OFF_S = 0.010
# An actor that has not started after this long (no free CPU for it, its imports, its warm-up request).
START_TIMEOUT_S = 120.0
# A generator whose part is not done this long after its deadline is stuck: it is killed and lost.
GRACE_S = 30.0
# Closing: each generator has this long to flush its spans.
EXIT_TIMEOUT_S = 15.0
# Before connecting, whether anything listens at the cluster's address, for this long.
PROBE_TIMEOUT_S = 5.0
# --provider vllm: each generator samples the server's /metrics this often, for its own call spans.
VLLM_INTERVAL_S = 0.25
# The driver's variables a generator's `configure()` reads (where spans go, sampling, content capture).
PASSED_PREFIXES = ("OTEL_", "LLMSPANS_")


class RayUnavailable(LoadError):
    """Ray is not installed, or no cluster answers at the address: one line, exit code 2."""


class AllLost(LoadError):
    """Every generator was lost: the run ends, with the levels finished before."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayUnavailable(INSTALL_RAY) from None
    return ray


# --- connecting ----------------------------------------------------------------------------------


@dataclass
class Connection:
    """The driver's connection to a cluster; `ours` when `connect` made it (then `close` ends it)."""

    ray: Any
    address: str
    ours: bool

    def cpus(self) -> int:
        return int(self.ray.cluster_resources().get("CPU", 0))

    def close(self) -> None:
        if self.ours and self.ray.is_initialized():
            self.ray.shutdown()


def connect(address: str | None) -> Connection:
    """Connect to the cluster at `address` (what `ray.init` takes: `auto`, `host:port`, `ray://host:10001`;
    None: `RAY_ADDRESS`, else `auto`); RayUnavailable in one line when none answers. A connection this
    process already has is used as it is."""
    ray = import_ray()
    if ray.is_initialized():
        return Connection(ray, "the cluster this process is connected to", ours=False)
    target = _bootstrap(address)
    _probe(target)
    try:
        ray.init(address=target, logging_level=logging.ERROR, log_to_driver=False)
    except Exception as error:
        raise RayUnavailable(f"cannot connect to the Ray cluster at {target}: {_line(error)}") from None
    with contextlib.suppress(Exception):  # the run says itself what happened to its generators
        _internals.quiet_ray_worker_logs()
    return Connection(ray, target, ours=True)


def _bootstrap(address: str | None) -> str:
    """The address to connect to: a `ray://` URL as given, else the cluster's `host:port` (what `auto`
    finds: `RAY_ADDRESS`, then the cluster `ray start` made on this machine)."""
    given = address or os.environ.get("RAY_ADDRESS") or "auto"
    if given.startswith("ray://"):
        return given
    try:
        found = _internals.ray_bootstrap_address(given)
    except Exception as error:
        raise RayUnavailable(f"no Ray cluster at {given!r}: {_line(error)}") from None
    if found is None and given == "auto":  # this Ray does not say what `auto` means before connecting
        raise RayUnavailable(
            "this Ray version does not say where `auto` is: pass the cluster's host:port to --ray"
        )
    return found or given


def _probe(target: str) -> None:
    """Whether anything listens at `target`, in `PROBE_TIMEOUT_S` (`ray.init` would wait minutes)."""
    parts = urllib.parse.urlsplit(target if "://" in target else f"ray://{target}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or port is None:
        raise RayUnavailable(
            f"--ray takes an address such as auto, 10.0.0.5:6379 or ray://host:10001, got {target!r}"
        )
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as error:
        raise RayUnavailable(
            f"no Ray cluster answers at {target} ({error.strerror or error}): start one with `ray start --head`, "
            "or pass its address to --ray"
        ) from None


def generators_for(spec: str, cpus: int) -> int:
    """`--generators`: a whole number up to the cluster's CPUs (each generator takes one), or `per-cpu`;
    ValueError saying what to pass."""
    if cpus < 1:
        raise ValueError("the Ray cluster has no CPU for a generator: add a node with --num-cpus 1 or more")
    if spec == "per-cpu":
        return cpus
    try:
        count = int(spec)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"--generators takes a whole number of 1 or more, or per-cpu; got {spec!r}")
    if count > cpus:
        raise ValueError(
            f"--generators {count}: the Ray cluster has {cpus} CPUs and each generator takes one: pass "
            f"--generators {cpus} or fewer, or add nodes"
        )
    return count


def generator_setups(
    workload: Workload, *, base_url: str, api_key: str, provider: str | None, max_retries: int, timeout: float,
    run_id: str, service_name: str | None, client: str, limiter_cap: int | None, file_export: bool,
) -> Callable[[int], GeneratorSetup]:  # fmt: skip
    """What generator `index` is given: a worker process's set-up, its name, the limiter cap (its own),
    and the driver's variables for its `configure()`; `file_export` when the driver's spans go to the
    embedded default's file (the generators' are brought back into it at the end)."""
    environment = passed_environment()

    def setup(index: int) -> GeneratorSetup:
        return GeneratorSetup(
            Setup(
                index=index, workload=workload, base_url=base_url, api_key=api_key, provider=provider,
                max_retries=max_retries, timeout=timeout, run_id=run_id, service_name=service_name,
                traces_file=None, vllm_interval=VLLM_INTERVAL_S if provider == "vllm" else None, client=client,
            ),
            name=f"g{index + 1}", limiter_cap=limiter_cap, environment=environment, file_export=file_export,
        )  # fmt: skip

    return setup


def passed_environment() -> dict[str, str]:
    """The driver's variables every generator's `configure()` reads."""
    return {name: value for name, value in os.environ.items() if name.startswith(PASSED_PREFIXES)}


# --- the generators ------------------------------------------------------------------------------


@dataclass
class Clock:
    """A generator's clocks against the driver's: `monotonic_ns` is its `perf_counter_ns()` minus the
    driver's at the same instant, `wall_ns` its `time_ns()` minus the driver's; +-`uncertainty_ns`."""

    monotonic_ns: int = 0
    wall_ns: int = 0
    uncertainty_ns: int = 0


@dataclass
class _Member:
    index: int
    handle: Any
    identity: Identity | None = None
    clock: Clock = field(default_factory=Clock)
    lost: str | None = None  # why, once it is lost
    lost_during: str | None = None
    in_flight: set[int] = field(default_factory=set)  # at its last batch
    returned: set[int] = field(default_factory=set)  # this level's requests whose records came back
    lost_at_ns: int = 0  # when the driver saw it gone (its clock)
    requests: int = 0
    lost_requests: int = 0
    cpu_s: float = 0.0  # over the parts it finished
    cpu_requests: int = 0  # the requests of those parts
    lags_s: list[float] = field(default_factory=list)  # over the run
    level_lags_s: list[float] = field(default_factory=list)  # over this level
    worst: tuple[str, float] | None = None  # the level of its highest lag p99, and that p99

    @property
    def name(self) -> str:
        return f"g{self.index + 1}"

    @property
    def words(self) -> str:
        where = f" on node {self.identity.node}" if self.identity is not None else ""
        return f"generator {self.name}{where}"


@dataclass
class FleetLevel:
    """What the generators did over one level."""

    done: list[PartDone]  # from the generators that finished their part (records on the driver's clock)
    lost: int = 0  # requests in flight on lost generators
    lost_generators: list[str] = field(default_factory=list)  # one line per generator lost


class Fleet:
    """The run's generators: started once, each level dealt over those still alive, killed at the end."""

    def __init__(self, connection: Connection, count: int, setup: Callable[[int], GeneratorSetup]) -> None:
        self.connection = connection
        self.count = count
        self._setup = setup
        self.members: list[_Member] = []

    @property
    def alive(self) -> list[_Member]:
        return [member for member in self.members if member.lost is None]

    @property
    def pids(self) -> list[int]:
        return [member.identity.pid for member in self.members if member.identity is not None]

    async def start(self, stop: asyncio.Event) -> None:
        """Every generator started and warmed up, its clock measured; LoadError naming one that cannot."""
        ray = self.connection.ray
        actor = ray.remote(GeneratorActor)
        for index in range(self.count):
            handle = actor.options(
                num_cpus=1, scheduling_strategy="SPREAD", max_restarts=0, max_task_retries=0
            ).remote()
            self.members.append(_Member(index, handle))
        starting = {
            asyncio.ensure_future(_awaited(member.handle.start.remote(self._setup(member.index)))): member
            for member in self.members
        }
        stopping = asyncio.ensure_future(stop.wait())
        try:
            pending = set(starting)
            deadline = time.monotonic() + START_TIMEOUT_S
            while pending and not stop.is_set():
                done, pending = await asyncio.wait(
                    {*pending, stopping}, timeout=max(0.0, deadline - time.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )  # fmt: skip
                pending.discard(stopping)
                for future in done - {stopping}:
                    member = starting[future]
                    try:
                        member.identity = future.result()
                    except Exception as error:
                        raise LoadError(f"generator {member.name} could not start: {_cause(error)}") from None
                if pending and time.monotonic() >= deadline:
                    late = starting[next(iter(pending))]
                    raise LoadError(
                        f"generator {late.name} did not start within {START_TIMEOUT_S:g} s (each takes one CPU; "
                        f"the cluster has {self.connection.cpus()})"
                    )
        finally:
            stopping.cancel()
            for future in starting:
                future.cancel()
        if not stop.is_set():
            await self.measure_clocks()

    async def measure_clocks(self) -> None:
        """Each generator's clock offsets, the best of `CLOCK_PINGS` round trips."""
        await asyncio.gather(*(self._measure(member) for member in self.alive), return_exceptions=True)

    async def _measure(self, member: _Member) -> None:
        best: Clock | None = None
        for _ in range(CLOCK_PINGS):
            sent, sent_wall = time.perf_counter_ns(), time.time_ns()
            theirs, theirs_wall = await _awaited(member.handle.clock.remote())
            back, back_wall = time.perf_counter_ns(), time.time_ns()
            half = (back - sent) // 2
            if best is None or half < best.uncertainty_ns:
                best = Clock(theirs - (sent + half), theirs_wall - (sent_wall + back_wall) // 2, half)
        if best is not None:
            member.clock = best

    def share(self, users: int | None) -> list[_Member]:
        """The generators a level runs on: every one alive, or as many as a closed loop has users."""
        alive = self.alive
        return alive[: max(1, min(len(alive), users))] if users is not None else alive

    async def run_level(
        self,
        members: Sequence[_Member],
        parts: Sequence[Part],
        stop: asyncio.Event,
        on_records: Callable[[list[RequestRecord]], None],
    ) -> FleetLevel:
        """Each member its part (times on the driver's clock); what came back once all are done or lost."""
        outcome = FleetLevel(done=[])
        label = parts[0].level.label
        for member in members:
            member.in_flight, member.returned = set(), set()
            member.level_lags_s = []
        following: dict[asyncio.Future[Any], tuple[_Member, Part]] = {
            asyncio.ensure_future(self._follow(member, part, on_records, outcome)): (member, part)
            for member, part in zip(members, parts, strict=True)
        }
        stopping = asyncio.ensure_future(stop.wait())
        stopped = False
        deadline_ns = max(part.deadline_ns for part in parts) + int(GRACE_S * 1e9)
        pending: set[asyncio.Future[Any]] = set(following)
        try:
            while pending:
                if stop.is_set() and not stopped:
                    stopped = True
                    for member, _ in following.values():
                        if member.lost is None:
                            member.handle.stop.remote()
                left = (deadline_ns - time.perf_counter_ns()) / 1e9
                if left <= 0:
                    for future in pending:
                        member, _ = following[future]
                        member.lost = (
                            f"it did not finish {label} {GRACE_S:g} s after its deadline and was killed"
                        )
                        member.lost_at_ns = time.perf_counter_ns()
                        with contextlib.suppress(Exception):
                            self.connection.ray.kill(member.handle, no_restart=True)
                    await asyncio.wait(pending, timeout=EXIT_TIMEOUT_S)
                    break
                waiters = pending if stopped else {*pending, stopping}
                _, pending = await asyncio.wait(
                    waiters, timeout=min(left, 1.0), return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(stopping)
        finally:
            stopping.cancel()
            for future in following:
                future.cancel()
            await asyncio.gather(*following, return_exceptions=True)
        for member, part in following.values():
            figures = Percentiles.of(member.level_lags_s)
            if figures is not None and (member.worst is None or figures.p99 > member.worst[1]):
                member.worst = (label, figures.p99)
            if member.lost is not None and member.lost_during is None:
                member.lost_during = label
                outcome.lost_generators.append(self._lose(member, part, outcome))
        if not self.alive:
            raise AllLost(
                "every generator was lost: "
                + "; ".join(f"{member.words}, {member.lost}" for member in self.members)
            )
        return outcome

    async def _follow(
        self,
        member: _Member,
        part: Part,
        on_records: Callable[[list[RequestRecord]], None],
        outcome: FleetLevel,
    ) -> None:
        """A member's part: its batches read as they stream back, on the driver's clock."""
        ray = self.connection.ray
        offset = member.clock.monotonic_ns
        try:
            async for reference in member.handle.part.remote(_shift_part(part, offset)):
                item = await reference
                records = [_to_driver(record, offset, member) for record in item.records]
                member.returned.update(record.index for record in records)
                member.requests += len(records)
                lags = [record.start_offset_ns / 1e9 for record in records if record.scheduled_ns is not None]
                member.lags_s += lags
                member.level_lags_s += lags
                if records:
                    on_records(records)
                if isinstance(item, Batch):
                    member.in_flight = set(item.in_flight)
                elif isinstance(item, PartDone):
                    member.in_flight = set()
                    member.cpu_s += item.cpu_s
                    member.cpu_requests += len(member.returned)
                    outcome.done.append(item)
        except ray.exceptions.RayActorError as error:
            member.lost = member.lost or _died(error)
            member.lost_at_ns = member.lost_at_ns or time.perf_counter_ns()
        except Exception as error:  # its own failure (raised in its part): lost too, with the reason
            member.lost = member.lost or f"its part failed ({_cause(error)})"
            member.lost_at_ns = member.lost_at_ns or time.perf_counter_ns()

    def _lose(self, member: _Member, part: Part, outcome: FleetLevel) -> str:
        """Count what a lost member had in flight: at its last batch, and (open loop) the arrivals due
        between then and when the driver saw it gone, that did not come back; the rest of its part was not
        sent."""
        gone = member.lost_at_ns or time.perf_counter_ns()
        handed = [index for index, _ in part.schedule] if part.schedule else list(part.indices)
        due = {index for index, at in part.schedule if at <= gone} if part.schedule else set()
        lost = (member.in_flight | due) - member.returned
        unsent = len(handed) - len(member.returned) - len(lost)
        member.lost_requests += len(lost)
        outcome.lost += len(lost)
        return (
            f"{member.words} was lost mid-level, {member.lost}: {len(lost)} requests in flight counted as lost, not as "
            f"server errors; {max(0, unsent)} of its {len(handed)} requests were not sent"
        )

    async def close(self, traces_file: Path | None) -> list[str]:
        """Every generator's spans exported (and, with the embedded default's file, appended into
        `traces_file`), then every actor killed; notes for what could not be done."""
        notes: list[str] = []
        alive = [member for member in self.alive if member.identity is not None]
        closing = await asyncio.gather(
            *(asyncio.wait_for(_awaited(member.handle.close.remote()), EXIT_TIMEOUT_S) for member in alive),
            return_exceptions=True,
        )
        for member, closed in zip(alive, closing, strict=True):
            if isinstance(closed, BaseException):
                notes.append(f"{member.words} could not flush its spans: {_cause(closed)}")
                continue
            if traces_file is not None:
                await self._bring_spans(member, traces_file, notes)
        for member in self.members:
            if member.lost is not None and member.identity is not None and traces_file is not None:
                notes.append(
                    f"{member.words} was lost: its spans up to then are on its node, not in {traces_file}"
                )
        for member in self.members:
            with contextlib.suppress(Exception):
                self.connection.ray.kill(member.handle, no_restart=True)
        return notes

    async def _bring_spans(self, member: _Member, traces_file: Path, notes: list[str]) -> None:
        """A generator's spans file, in pieces, appended whole line by line into the traces file."""
        handle, scratch = tempfile.mkstemp(prefix=f"llmspans-load-{member.name}-", suffix=".jsonl")
        try:
            with os.fdopen(handle, "wb") as copy:
                offset, last = 0, False
                while not last:
                    piece, last = await _awaited(member.handle.spans.remote(offset))
                    copy.write(piece)
                    offset += len(piece)
            _exporters.append_whole_lines(traces_file, Path(scratch))
        except OSError as error:
            notes.append(
                f"{member.words}'s spans could not be appended to {traces_file}: {error.strerror or error}"
            )
        except Exception as error:  # it died meanwhile: its spans stay on its node
            notes.append(f"{member.words}'s spans could not be brought back: {_cause(error)}")
        finally:
            with contextlib.suppress(OSError):
                os.unlink(scratch)

    # --- what the run says about its generators ---------------------------------------------------

    def stats(self) -> tuple[GeneratorStats, ...]:
        return tuple(
            GeneratorStats(
                name=member.name,
                attribute=member.identity.attribute,
                node=member.identity.node,
                requests=member.requests,
                lost=member.lost_requests,
                cpu_s=member.cpu_s,
                cpu_per_request_s=member.cpu_s / member.cpu_requests if member.cpu_requests else None,
                lag=Percentiles.of(member.lags_s),
                lag_worst=member.worst,
                clock_offset_s=member.clock.wall_ns / 1e9,
                clock_uncertainty_s=member.clock.uncertainty_ns / 1e9,
                lost_during=member.lost_during,
            )
            for member in self.members
            if member.identity is not None
        )

    def driver_node(self) -> str | None:
        with contextlib.suppress(Exception):
            return str(self.connection.ray.util.get_node_ip_address())
        return None


def notes(
    generators: Sequence[GeneratorStats], environment: dict[str, str], driver_ip: str | None
) -> list[str]:
    """The lines a run says about its generators: one lagging behind its schedule, a node whose clock is
    off, an OTLP endpoint on the loopback that generators on other machines cannot reach."""
    said = []
    for generator in generators:
        if generator.lag_worst is not None and generator.lag_worst[1] > BEHIND_SCHEDULE_S:
            level, p99 = generator.lag_worst
            said.append(
                f"generator {generator.name} on node {generator.node} lags behind its schedule: lag p99 "
                f"{p99 * 1e3:.1f} ms at {level}, counted in its requests' latencies (a busy node, or too many "
                "requests/s for one generator: more --generators)"
            )
    for node, offset, uncertainty in sorted(
        {
            (generator.node, generator.clock_offset_s, generator.clock_uncertainty_s)
            for generator in generators
        }
    ):
        if abs(offset) - uncertainty > CLOCK_OFF_S:
            said.append(
                f"node {node}'s clock is {abs(offset) * 1e3:.0f} ms {'ahead of' if offset > 0 else 'behind'} the "
                f"driver's (+-{uncertainty * 1e3:.1f} ms): the spans its generators exported are stamped that far "
                "off; arrivals and latencies are not (each generator keeps the schedule on its own monotonic "
                "clock, aligned to the driver's)"
            )
    endpoint = environment.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environment.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if endpoint and driver_ip is not None and _loopback(endpoint):
        away = sorted(
            {generator.node for generator in generators if not generator.node.startswith(f"{driver_ip}:")}
        )
        if away:
            said.append(
                f"the spans go to {endpoint}, on the loopback: generators on other machines ({', '.join(away)}) "
                "sent theirs to their own machine. Point OTEL_EXPORTER_OTLP_ENDPOINT at a collector every node "
                "can reach"
            )
    return said


def _loopback(endpoint: str) -> bool:
    host = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}").hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"


# --- clocks and records --------------------------------------------------------------------------


def _shift_part(part: Part, offset_ns: int) -> Part:
    """A part with its times on the generator's clock."""
    return dataclasses.replace(
        part,
        start_ns=part.start_ns + offset_ns,
        until_ns=part.until_ns + offset_ns,
        deadline_ns=part.deadline_ns + offset_ns,
        schedule=tuple((index, due + offset_ns) for index, due in part.schedule),
    )


def _to_driver(record: RequestRecord, offset_ns: int, member: _Member) -> RequestRecord:
    """A record's stamps moved onto the driver's clock (their differences, TTFT and e2e, unchanged)."""
    if record.scheduled_ns is not None:
        record.scheduled_ns -= offset_ns
    if record.issued_ns:
        record.issued_ns -= offset_ns
    if record.done_ns:
        record.done_ns -= offset_ns
    record.chunk_ns = [stamp - offset_ns for stamp in record.chunk_ns]
    if member.identity is not None:
        record.generator = member.identity.attribute
    return record


async def _awaited(reference: Any) -> Any:
    return await reference


def _died(error: BaseException) -> str:
    """Why an actor is gone, in a few words: Ray's own line when it says more than that it died."""
    text = _line(error)
    said = text and not text.startswith("The actor died unexpectedly before finishing this task")
    return "its actor died" + (f" ({text})" if said else "")


def _cause(error: BaseException) -> str:
    cause = getattr(error, "cause", None)
    if isinstance(cause, LoadError):
        return str(cause)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {_line(cause)}"
    return f"{type(error).__name__}: {_line(error)}"


def _line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else ""
