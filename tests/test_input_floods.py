"""Floods of tiny input over a real WebSocket (issue 14 #5): the flooder gets exactly what it said spoken,
and no client's input holds the event loop that every session shares."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import websockets
from voicewire.realtime.session import READ_BUDGET_PER_TURN, SessionRuntime

from tests.server import ServerThread
from tests.wsclient import Received, configure, recv_until, send

SPEAK = {"split_granularity": "sentence", "response_format": "pcm", "stream_audio": True}
FLOOD = 30_000


def flood_frames() -> list[str]:
    """The attack: "Hello." then 30,000 one-space deltas, then the next sentence and input.done."""
    deltas = ["Hello.", *[" "] * FLOOD, "World is fine."]
    return [*(json.dumps({"type": "input.text", "text": d}) for d in deltas), json.dumps({"type": "input.done"})]


async def test_a_whitespace_flood_is_read_a_few_messages_per_turn_of_the_loop(server: ServerThread) -> None:
    """A ticker on the server's loop records how many of the flooder's messages were read between two of its
    turns: never more than the reader's budget, where it used to be every frame aiohttp had buffered."""
    async with websockets.connect(server.ws_url) as ws:
        session_id = (await configure(ws, **SPEAK))["session_id"]
        jumps: list[int] = []
        stop = asyncio.Event()

        async def tick() -> None:
            last: int | None = None
            while not stop.is_set():
                runtime = next((s for s in server.ctx.sessions
                                if isinstance(s, SessionRuntime) and s.session_id == session_id), None)
                if runtime is not None:
                    if last is not None:
                        jumps.append(runtime.messages_received - last)
                    last = runtime.messages_received
                await asyncio.sleep(0)

        async def start_ticker() -> asyncio.Task[None]:
            return asyncio.create_task(tick())

        ticker = server.call(start_ticker)
        try:
            for frame in flood_frames():
                await ws.send(frame)
            got = await recv_until(ws, "session.done")
        finally:
            server.loop.call_soon_threadsafe(stop.set)
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asyncio.wait_for(ticker, 10), server.loop))
    assert [e["sentence_text"] for e in got.of("audio.start")] == ["Hello.", "World is fine."]
    assert all(e["error"] is False for e in got.of("audio.done"))
    assert sum(jumps) >= FLOOD  # the ticker watched the whole flood being read
    assert max(jumps) <= READ_BUDGET_PER_TURN


async def test_another_session_speaks_and_health_answers_while_a_client_floods(server: ServerThread) -> None:
    """The flooder keeps sending spaces until the canary session has spoken a whole utterance and /health
    has answered; only then does it finish. Both get exactly their sentences."""
    canary_done = asyncio.Event()
    health: list[int] = []

    async def canary() -> Received:
        async with websockets.connect(server.ws_url) as ws, aiohttp.ClientSession() as http:
            await configure(ws, **SPEAK)
            await send(ws, {"type": "input.text", "text": "The canary keeps singing."})
            await send(ws, {"type": "input.done"})
            got = await recv_until(ws, "session.done")
            async with http.get(f"{server.http_url}/health") as resp:
                health.append(resp.status)
        canary_done.set()
        return got

    async def flooder() -> tuple[Received, Received, int]:
        async with websockets.connect(server.ws_url) as ws:
            await configure(ws, **SPEAK)
            await send(ws, {"type": "input.text", "text": "Hello."})
            task = asyncio.create_task(canary())
            sent = 0
            while not canary_done.is_set():
                await asyncio.gather(*(ws.send('{"type": "input.text", "text": " "}') for _ in range(200)))
                sent += 200
                await asyncio.sleep(0)
            await send(ws, {"type": "input.text", "text": "World is fine."})
            await send(ws, {"type": "input.done"})
            got = await recv_until(ws, "session.done")
            return got, await task, sent

    flooded, sung, sent = await flooder()
    assert sent > 0 and health == [200]
    assert [e["sentence_text"] for e in sung.of("audio.start")] == ["The canary keeps singing."]
    assert sung.of("audio.done")[0]["error"] is False and any(isinstance(i, bytes) for i in sung.items)
    assert [e["sentence_text"] for e in flooded.of("audio.start")] == ["Hello.", "World is fine."]
    assert all(e["error"] is False for e in flooded.of("audio.done"))
