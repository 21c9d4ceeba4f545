"""Floods of tiny input over a real WebSocket (issue 14 #5): the flooder gets exactly what it said spoken,
and no client's input holds the event loop that every session shares."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import websockets
from voicewire.realtime.session import READ_BUDGET_PER_TURN, SessionRuntime

from tests.server import ServerThread
from tests.wsclient import configure, recv_until

SPEAK = {"split_granularity": "sentence", "response_format": "pcm", "stream_audio": True}
FLOOD = 30_000
ROUND_TRIP_TURNS = 32
"""Loop turns an HTTP request, or a WebSocket config and its answer, needs on loopback, with room to spare
(about 10 are seen)."""


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


def runtime_of(server: ServerThread, session_id: str) -> SessionRuntime:
    """The server's runtime of one session (read from the test's thread: only its counters are read)."""
    return next(s for s in list(server.ctx.sessions)
                if isinstance(s, SessionRuntime) and s.session_id == session_id)


async def test_health_and_another_session_answer_within_a_few_turns_while_a_client_floods(
        server: ServerThread) -> None:
    """A client sends the flood all at once; once the server has read 1,000 of its messages, a `/health`
    request and another session's `session.config` are each answered while the server reads at most a few
    hundred more of the flooder's (a round trip takes at most `ROUND_TRIP_TURNS` loop turns, the reader
    at most `READ_BUDGET_PER_TURN` messages a turn), and the flood is still being read after both answers.
    The reader that read every buffered frame before letting the loop turn, and the segmenter that
    rescanned the pending spaces on every message, held /health until the whole flood was read (issue 14
    #5: 23,000 messages). Counted in messages read on the server, not in time. The flooder then gets
    exactly its sentences."""
    frames = flood_frames()

    async def probe() -> tuple[int, int, int, str, int]:
        """On the server's loop: the flooder's messages read while /health, then a new session's config,
        waited for their answers, and how many of its frames were still to be read after both."""
        flood = runtime_of(server, session_id)
        async with aiohttp.ClientSession() as http:
            before = flood.messages_received
            async with http.get(f"{server.http_url}/health") as resp:
                status = resp.status
            health_gap = flood.messages_received - before
            async with http.ws_connect(server.ws_url) as canary:
                before = flood.messages_received
                await canary.send_json({"type": "session.config", **SPEAK})
                answer = await canary.receive_json()
                config_gap = flood.messages_received - before
        return status, health_gap, config_gap, answer["type"], 1 + len(frames) - flood.messages_received

    async with websockets.connect(server.ws_url) as ws:
        session_id = (await configure(ws, **SPEAK))["session_id"]
        flooder = runtime_of(server, session_id)
        probing: asyncio.Future[tuple[int, int, int, str, int]] | None = None
        for frame in frames:
            await ws.send(frame)
            if probing is None and flooder.messages_received >= 1_000:
                probing = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(probe(), server.loop))
        while probing is None:  # the whole flood fit in the socket buffers before the server read 1,000
            await asyncio.sleep(0.01)
            if flooder.messages_received >= 1_000:
                probing = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(probe(), server.loop))
        status, health_gap, config_gap, answer, unread = await probing
        flooded = await recv_until(ws, "session.done")
    assert status == 200 and answer == "session.updated"
    assert unread > 0  # both answers came while the flood was being read
    assert health_gap <= ROUND_TRIP_TURNS * READ_BUDGET_PER_TURN, health_gap
    assert config_gap <= ROUND_TRIP_TURNS * READ_BUDGET_PER_TURN, config_gap
    assert [e["sentence_text"] for e in flooded.of("audio.start")] == ["Hello.", "World is fine."]
    assert all(e["error"] is False for e in flooded.of("audio.done"))
