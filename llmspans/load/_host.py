"""Is the generator in its own figures, or in the server's? Two checks a level makes about its own host.

The event loop's lateness (`LoopLag`): a task that asks to wake every `LAG_EVERY_S` and notes how late it
woke. Every chunk's stamp waits behind the same queue of ready callbacks, so the loop's lateness is how
much of each latency the generator's own work added. `inflated` says when it is a real share of the TTFT.

A shared host (`SharedHost`): the target listens on this machine and its process may run on the CPUs the
generator runs on; then the generator's CPU over a level is CPU the server did not get. `sharing` says
when it is enough to matter. Thresholds: docs/load.md, "Is the generator in the figures?".
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

# The monitor asks to wake this often (20 wake-ups a second: about 0.2% of a CPU on this busy machine).
LAG_EVERY_S = 0.05
# A level's latencies are inflated by the generator when its loop's median lateness is at least this share
# of the level's median TTFT and at least `INFLATED_MIN_S`: at 8 concurrent against a zero-delay server the
# loop was late by 2-10 ms against TTFTs of 5-15 ms (`vllm bench serve`: 5.8 ms); against vLLM on the tiny
# model it was late by under 0.5 ms against 150 ms (docs/load.md).
INFLATED_SHARE = 0.05
INFLATED_MIN_S = 0.0005
# A generator on the server's CPUs took enough of them to slow it when it used this much of one CPU over
# the level: 10% of a CPU is 5% of this 2-core machine, the spread of vLLM's requests/s between rounds.
SHARED_CPU_SHARE = 0.10


class LoopLag:
    """How late the event loop wakes a task that sleeps `LAG_EVERY_S`, in nanoseconds, while running."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._watch())

    async def stop(self) -> list[int]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        return self.samples

    async def _watch(self) -> None:
        clock, samples, every = time.perf_counter_ns, self.samples, int(LAG_EVERY_S * 1e9)
        while True:
            due = clock() + every
            await asyncio.sleep(LAG_EVERY_S)
            samples.append(max(0, clock() - due))


def inflated(loop_lag_p50_s: float | None, ttft_p50_s: float | None) -> bool:
    if loop_lag_p50_s is None or ttft_p50_s is None or ttft_p50_s <= 0:
        return False
    return loop_lag_p50_s >= INFLATED_MIN_S and loop_lag_p50_s >= INFLATED_SHARE * ttft_p50_s


@dataclass(frozen=True)
class SharedHost:
    """The target on this machine: its listening process (if found) and the CPUs both may use."""

    pid: int | None
    shared_cpus: frozenset[int]  # CPUs the generator and the server may both run on
    generator_cpus: frozenset[int]

    def words(self) -> str:
        server = f"the server (pid {self.pid})" if self.pid is not None else "the server"
        cpus = ",".join(str(cpu) for cpu in sorted(self.shared_cpus))
        return (
            f"{server} and the generator share CPU {cpus}"
            if len(self.shared_cpus) == 1
            else (f"{server} and the generator share CPUs {cpus}")
        )


def shared_host(base_url: str) -> SharedHost | None:
    """The target's process and shared CPUs when it listens on this machine and shares a CPU with this
    process (unknown affinity counts as shared); None when it is elsewhere or pinned apart."""
    parts = urllib.parse.urlsplit(base_url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    if not _is_this_machine(host):
        return None
    mine = _affinity(0)
    pid = _listener(port)
    theirs = _affinity(pid) if pid is not None else None
    if mine is None:
        mine = frozenset(range(os.cpu_count() or 1))
    shared = mine if theirs is None else mine & theirs
    if not shared:
        return None
    return SharedHost(pid, frozenset(shared), frozenset(mine))


def sharing(host: SharedHost | None, cpu_s: float | None, duration_s: float) -> float | None:
    """The share of one CPU the generator used over the level beside a server on its CPUs, when it is
    enough to have slowed it; None otherwise."""
    if host is None or cpu_s is None or duration_s <= 0:
        return None
    share = cpu_s / duration_s
    return share if share >= SHARED_CPU_SHARE else None


def _is_this_machine(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            return False
    if address.is_loopback:
        return True
    with contextlib.suppress(OSError):
        return str(address) in {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    return False


def _affinity(pid: int) -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        return None


def _listener(port: int) -> int | None:
    """The pid of the process listening on TCP `port` here (Linux's /proc), else None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(entry.name)
        except OSError:
            continue
    return None
