"""The winner's stream, as the app reads it: first the items read ahead of its first content chunk, each at
the instant its bytes came, then the rest as they come, the call's stamps taken from the copy's reads."""

from __future__ import annotations

import collections
from typing import Any

import wrapt

from llmspans._call import CallRecord
from llmspans._hedge.copies import HedgeCopy


class SyncReplay(wrapt.ObjectProxy[Any]):
    """The winning copy's SDK stream: first the items read ahead of its first content chunk, each at the
    instant its bytes came, then the rest as they come. The call's stamps are taken from the copy's reads."""

    def __init__(
        self, stream: Any, call: CallRecord, copy: HedgeCopy, buffered: collections.deque[tuple[Any, int]]
    ) -> None:
        super().__init__(stream)
        self._self_call = call
        self._self_copy = copy
        self._self_buffered = buffered

    def __iter__(self) -> Any:
        return self._self_items()

    def _self_items(self) -> Any:
        call, copy, buffered = self._self_call, self._self_copy, self._self_buffered
        while buffered:
            item, call.bytes_at_ns = buffered.popleft()
            yield item
        for item in self.__wrapped__:
            call.bytes_at_ns = copy.bytes_at_ns
            call.last_bytes = copy.last_bytes
            yield item
        call.last_bytes = copy.last_bytes

    def __next__(self) -> Any:
        buffered = self._self_buffered
        if buffered:
            item, self._self_call.bytes_at_ns = buffered.popleft()
            return item
        try:
            item = self.__wrapped__.__next__()
        finally:
            self._self_call.bytes_at_ns = self._self_copy.bytes_at_ns
            self._self_call.last_bytes = self._self_copy.last_bytes
        return item


class AsyncReplay(wrapt.ObjectProxy[Any]):
    """`SyncReplay` for an `AsyncStream`."""

    def __init__(
        self, stream: Any, call: CallRecord, copy: HedgeCopy, buffered: collections.deque[tuple[Any, int]]
    ) -> None:
        super().__init__(stream)
        self._self_call = call
        self._self_copy = copy
        self._self_buffered = buffered

    def __aiter__(self) -> Any:
        return self._self_items()

    async def _self_items(self) -> Any:
        call, copy, buffered = self._self_call, self._self_copy, self._self_buffered
        while buffered:
            item, call.bytes_at_ns = buffered.popleft()
            yield item
        async for item in self.__wrapped__:
            call.bytes_at_ns = copy.bytes_at_ns
            call.last_bytes = copy.last_bytes
            yield item
        call.last_bytes = copy.last_bytes

    async def __anext__(self) -> Any:
        buffered = self._self_buffered
        if buffered:
            item, self._self_call.bytes_at_ns = buffered.popleft()
            return item
        try:
            item = await self.__wrapped__.__anext__()
        finally:
            self._self_call.bytes_at_ns = self._self_copy.bytes_at_ns
            self._self_call.last_bytes = self._self_copy.last_bytes
        return item
