"""The scheduler shared by all sessions: who gets the engine next.

Engine capacity is `capacity` concurrent requests (the engine's `max_concurrency`). Waiting requests are
ordered by playback deadline: the monotonic time at which the requesting session's listener would run
out of audio if this unit were late. A session that has not started playing yet asks with its commit
time, so a new session's first unit goes before sessions that still have seconds of audio buffered.
Ties go to the earlier request.

Cancellation is prompt and safe at any await: a waiter cancelled in the queue leaves it; a slot granted
to a waiter cancelled in the same instant is handed on, never lost. Memory: one heap entry per waiting
unit; sessions cap their own units in flight, so the heap is bounded by sessions x that cap.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field


@dataclass(order=True, slots=True)
class _Waiter:
    deadline: float
    seq: int
    future: asyncio.Future[None] = field(compare=False)


class Scheduler:
    """Earliest-deadline-first admission to a fixed number of engine slots."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._busy = 0
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self.granted = 0

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot (not counting ones already cancelled)."""
        return sum(1 for w in self._heap if not w.future.done())

    @property
    def in_use(self) -> int:
        return self._busy

    @asynccontextmanager
    async def slot(self, deadline: float) -> AsyncIterator[None]:
        """Hold one engine slot for the body; `deadline` is a `time.monotonic()` value."""
        await self._acquire(deadline)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, deadline: float) -> None:
        if self._busy < self.capacity and not self.queue_depth:
            self._busy += 1
            self.granted += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, _Waiter(deadline, next(self._seq), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()
            raise
        self.granted += 1

    def _release(self) -> None:
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if not waiter.future.done():
                waiter.future.set_result(None)
                return
        self._busy -= 1
