"""A progress bar on stderr for a read that takes more than a second, and none when stderr is not a terminal.

The report's output is on stdout (text or JSON) and stays clean: the bar is drawn on stderr only,
only on a terminal, only once the read has taken longer than `delay_s`, at most ten times a second,
and erased when the read ends.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

WIDTH = 30


class Progress:
    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        delay_s: float = 1.0,
    ) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.delay_s = delay_s
        self.started = clock()
        self.drawn_at: float | None = None
        try:
            self.live = self.stream.isatty()
        except (AttributeError, ValueError):
            self.live = False

    def update(self, done: int) -> None:
        if not self.live:
            return
        now = self.clock()
        if now - self.started < self.delay_s or (self.drawn_at is not None and now - self.drawn_at < 0.1):
            return
        self.drawn_at = now
        share = min(1.0, done / self.total)
        filled = round(WIDTH * share)
        rate = done / 1e6 / max(now - self.started, 1e-9)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {share:4.0%} {done / 1e6:,.0f} MB "
            f"{rate:,.0f} MB/s"
        )
        self.stream.flush()

    def finish(self) -> None:
        """Erase the bar if one was drawn."""
        if self.drawn_at is not None:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.drawn_at = None
