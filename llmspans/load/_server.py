"""vLLM's pressure over each level, from `llmspans.vllm.ServerMetrics`' samples (`--provider vllm`).

The sampler reads `/metrics` in its own thread; the load tool only looks at its latest snapshot now and
then from the event loop (no I/O, no lock) and keeps each new one, so a level's figures are the means and
maxima of the samples taken while it ran. Only the sampler's public surface is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from llmspans.load._model import ServerFigures
from llmspans.vllm import ServerMetrics, ServerSnapshot

SAMPLE_INTERVAL_S = 0.25


class LevelSampler:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._snapshots: list[ServerSnapshot] = []
        self._last: float | None = None

    async def watch(self, stop: asyncio.Event) -> None:
        """Keep each new snapshot until `stop` is set (run as a task for the length of a level)."""
        poll = self.metrics.interval / 2
        while not stop.is_set():
            self._take()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), poll)
        self._take()

    def _take(self) -> None:
        snapshot = self.metrics.snapshot
        if (
            snapshot is not None
            and snapshot.monotonic != self._last
            and snapshot.age < 2 * self.metrics.interval
        ):
            self._last = snapshot.monotonic
            self._snapshots.append(snapshot)

    def level_figures(self, since: float) -> ServerFigures | None:
        """The figures of the snapshots read at or after `since` (`time.monotonic()`), then forgets them."""
        taken = [snapshot for snapshot in self._snapshots if snapshot.monotonic >= since]
        self._snapshots.clear()
        if not taken:
            return None
        waiting = [snapshot.num_requests_waiting for snapshot in taken]
        running = [snapshot.num_requests_running for snapshot in taken]
        kv = [snapshot.kv_cache_usage for snapshot in taken if snapshot.kv_cache_usage is not None]
        preemptions = [snapshot.preemption_rate for snapshot in taken if snapshot.preemption_rate is not None]
        hits = [s.prefix_cache_hit_ratio for s in taken if s.prefix_cache_hit_ratio is not None]
        return ServerFigures(
            samples=len(taken),
            waiting_mean=sum(waiting) / len(waiting),
            waiting_max=max(waiting),
            running_mean=sum(running) / len(running),
            running_max=max(running),
            kv_cache_usage_mean=sum(kv) / len(kv) if kv else None,
            kv_cache_usage_max=max(kv) if kv else None,
            preemption_rate_mean=sum(preemptions) / len(preemptions) if preemptions else None,
            prefix_cache_hit_ratio_mean=sum(hits) / len(hits) if hits else None,
        )


def now() -> float:
    return time.monotonic()
