"""The shared scheduler: earliest playback deadline first, capacity respected, cancellation safe."""

from __future__ import annotations

import asyncio

from voicewire.realtime.scheduler import Scheduler


async def test_waiters_are_served_earliest_deadline_first() -> None:
    scheduler = Scheduler(1)
    order: list[str] = []
    gate = asyncio.Event()

    async def job(name: str, deadline: float) -> None:
        async with scheduler.slot(deadline):
            order.append(name)
            await gate.wait()

    first = asyncio.create_task(job("holder", 0.0))
    await asyncio.sleep(0)
    waiters = [asyncio.create_task(job(n, d)) for n, d in (("late", 30.0), ("urgent", 1.0), ("middle", 10.0))]
    await asyncio.sleep(0)
    assert scheduler.queue_depth == 3 and scheduler.in_use == 1
    gate.set()
    await asyncio.gather(first, *waiters)
    assert order == ["holder", "urgent", "middle", "late"]
    assert scheduler.in_use == 0 and scheduler.granted == 4


async def test_capacity_is_never_exceeded() -> None:
    scheduler = Scheduler(2)
    running = peak = 0

    async def job() -> None:
        nonlocal running, peak
        async with scheduler.slot(0.0):
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0)
            running -= 1

    await asyncio.gather(*(job() for _ in range(20)))
    assert peak == 2 and scheduler.in_use == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_loses_no_slot() -> None:
    scheduler = Scheduler(1)
    gate = asyncio.Event()

    async def holder() -> None:
        async with scheduler.slot(0.0):
            await gate.wait()

    async def waiter() -> None:
        async with scheduler.slot(1.0):
            pass

    h = asyncio.create_task(holder())
    await asyncio.sleep(0)
    w = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    w.cancel()
    gate.set()
    await h
    await asyncio.gather(w, return_exceptions=True)
    assert scheduler.in_use == 0 and scheduler.queue_depth == 0
    async with scheduler.slot(0.0):
        assert scheduler.in_use == 1


async def test_a_waiter_cancelled_in_the_instant_it_is_granted_hands_the_slot_on() -> None:
    scheduler = Scheduler(1)
    gate = asyncio.Event()
    served: list[str] = []

    async def job(name: str, deadline: float) -> None:
        async with scheduler.slot(deadline):
            served.append(name)
            if name == "holder":
                await gate.wait()

    h = asyncio.create_task(job("holder", 0.0))
    await asyncio.sleep(0)
    a = asyncio.create_task(job("a", 1.0))
    b = asyncio.create_task(job("b", 2.0))
    await asyncio.sleep(0)
    gate.set()
    await asyncio.sleep(0)  # the holder releases: "a" is granted but has not resumed yet
    a.cancel()
    await asyncio.gather(h, a, b, return_exceptions=True)
    assert "b" in served and scheduler.in_use == 0
