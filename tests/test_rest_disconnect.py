"""A REST client that hangs up stops its synthesis, whether the body streams or comes whole."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.server import ServerThread

LONG = " ".join(f"Sentence {n} of a long request whose client will not wait for the answer." for n in range(20))


@pytest.mark.parametrize("stream", [False, True])
async def test_hanging_up_cancels_the_remaining_units(server: ServerThread, stream: bool) -> None:
    engine = server.ctx.engine
    before = engine.stats  # type: ignore[attr-defined]
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(http.post(f"{server.http_url}/v1/audio/speech", json={
            "input": LONG, "voice": "alloy", "response_format": "wav", "stream": stream}))
        async with asyncio.timeout(60):
            while engine.stats.started == before.started:  # type: ignore[attr-defined]
                await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    async with asyncio.timeout(60):
        while (server.ctx.scheduler.in_use or server.ctx.scheduler.queue_depth):
            await asyncio.sleep(0.01)
    after = engine.stats  # type: ignore[attr-defined]
    assert after.started - before.started < 20, "the units after the hang-up never started"
    assert after.cancelled > before.cancelled
