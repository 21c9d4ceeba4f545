"""`LoopThread`: an engine frontend's own event loop. Items cross to the caller's loop in order, errors
arrive as raised, an early close waits until the producer's cleanup has run, and one wake-up of the caller's
loop carries every item that was ready."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from voicewire.adapters.loop_thread import LoopThread


@pytest.fixture
def frontend() -> Iterator[LoopThread]:
    thread = LoopThread("test-frontend")
    yield thread
    thread.stop()


async def test_items_are_produced_on_the_thread_and_arrive_in_order(frontend: LoopThread) -> None:
    threads: set[str] = set()

    async def count(n: int) -> AsyncIterator[int]:
        for i in range(n):
            threads.add(threading.current_thread().name)
            await asyncio.sleep(0)
            yield i

    assert [i async for i in frontend.stream(count, 500)] == list(range(500))
    assert threads == {"test-frontend"}


async def test_call_returns_the_result_and_raises_the_error(frontend: LoopThread) -> None:
    async def where(x: int) -> tuple[str, int]:
        return threading.current_thread().name, x * 2

    async def fail() -> None:
        raise ValueError("bad prompt")

    assert await frontend.call(where, 21) == ("test-frontend", 42)
    with pytest.raises(ValueError, match="bad prompt"):
        await frontend.call(fail)


async def test_a_producer_error_reaches_the_consumer_after_its_items(frontend: LoopThread) -> None:
    async def two_then_fail() -> AsyncIterator[int]:
        yield 1
        yield 2
        raise KeyError("engine died")

    got: list[int] = []
    with pytest.raises(KeyError, match="engine died"):
        async for item in frontend.stream(two_then_fail):
            got.append(item)
    assert got == [1, 2]


async def test_closing_early_cancels_the_producer_and_waits_for_its_cleanup(frontend: LoopThread) -> None:
    cleaned: list[str] = []
    endless_started = threading.Event()

    async def endless() -> AsyncIterator[int]:
        try:
            i = 0
            while True:
                endless_started.set()
                await asyncio.sleep(0.001)
                yield i
                i += 1
        finally:
            await asyncio.sleep(0.05)  # an abort that takes a round trip
            cleaned.append(threading.current_thread().name)

    async with contextlib.aclosing(frontend.stream(endless)) as items:
        async for item in items:
            if item == 3:
                break
    assert cleaned == ["test-frontend"]  # the close returned only after the producer's finally ran
    assert endless_started.is_set()


async def test_a_consumer_cancelled_before_the_first_item_leaves_nothing_running(frontend: LoopThread) -> None:
    started = asyncio.Event()
    cleaned = threading.Event()

    async def slow() -> AsyncIterator[int]:
        try:
            await asyncio.sleep(3600)
            yield 0
        finally:
            cleaned.set()

    async def consume() -> None:
        started.set()
        async with contextlib.aclosing(frontend.stream(slow)) as items:
            async for _ in items:
                pass

    task = asyncio.create_task(consume())
    await started.wait()
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned.is_set()
    assert await frontend.call(_tasks_left) == 0


async def _tasks_left() -> int:
    return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])


async def test_ready_items_share_one_wake_up_of_the_callers_loop(frontend: LoopThread) -> None:
    wake_ups = 0
    loop = asyncio.get_running_loop()
    original = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal wake_ups
        wake_ups += 1
        return original(callback, *args, **kwargs)

    async def burst() -> AsyncIterator[int]:
        for i in range(1000):  # no await between items: all are ready before the caller's loop runs
            yield i

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        got = [i async for i in frontend.stream(burst)]
    finally:
        loop.call_soon_threadsafe = original  # type: ignore[method-assign]
    assert got == list(range(1000))
    assert wake_ups < 100  # one per batch of ready items, not one per item (1001 messages)


async def test_stop_ends_streams_still_running_with_an_error(frontend: LoopThread) -> None:
    async def forever() -> AsyncIterator[int]:
        yield 0
        await asyncio.sleep(3600)
        yield 1

    items = frontend.stream(forever)
    assert await anext(items) == 0
    await asyncio.to_thread(frontend.stop)
    with pytest.raises(RuntimeError, match="test-frontend: stopped"):
        await anext(items)


def test_a_second_callers_loop_is_refused(frontend: LoopThread) -> None:
    async def nothing() -> None:
        return None

    asyncio.run(frontend.call(nothing))
    with pytest.raises(RuntimeError, match="second event loop"):
        asyncio.run(frontend.call(nothing))
