"""The winner's stream, as the app reads it: first the items read ahead of its first content chunk, each at the
instant its bytes came, then the rest as they come.

Each item's arrival is what the transport stamped on the winner's final attempt (the call's, once it won),
so the rest passes through untouched: a sync stream is the buffered items chained, in C, to the SDK's own
iteration; nothing is added per chunk.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import wrapt

from llmspans._call import Attempt


def _buffered(reads: Attempt, buffered: collections.deque[tuple[Any, int]]) -> Iterator[Any]:
    while buffered:
        item, reads.bytes_at_ns = buffered.popleft()
        yield item


class SyncReplay(wrapt.ObjectProxy[Any]):
    """The winning copy's SDK stream: the items read ahead of its first content chunk (stamped on `reads`, the
    attempt the stream is read from, as they arrived), then the stream's own items."""

    def __init__(self, stream: Any, reads: Attempt, buffered: collections.deque[tuple[Any, int]]) -> None:
        super().__init__(stream)
        self._self_reads = reads
        self._self_buffered = buffered

    def __iter__(self) -> Iterator[Any]:
        return itertools.chain(_buffered(self._self_reads, self._self_buffered), self.__wrapped__)

    def __next__(self) -> Any:
        buffered = self._self_buffered
        if buffered:
            item, self._self_reads.bytes_at_ns = buffered.popleft()
            return item
        return self.__wrapped__.__next__()


class AsyncReplay(wrapt.ObjectProxy[Any]):
    """`SyncReplay` for an `AsyncStream`."""

    def __init__(self, stream: Any, reads: Attempt, buffered: collections.deque[tuple[Any, int]]) -> None:
        super().__init__(stream)
        self._self_reads = reads
        self._self_buffered = buffered

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._self_items()

    async def _self_items(self) -> AsyncIterator[Any]:
        reads, buffered = self._self_reads, self._self_buffered
        while buffered:
            item, reads.bytes_at_ns = buffered.popleft()
            yield item
        async for item in self.__wrapped__:
            yield item

    async def __anext__(self) -> Any:
        buffered = self._self_buffered
        if buffered:
            item, self._self_reads.bytes_at_ns = buffered.popleft()
            return item
        return await self.__wrapped__.__anext__()
