"""The scheduler serves a new session's first unit before another session's backlog."""

from __future__ import annotations

import asyncio
import json

import websockets

from tests.server import ServerThread
from tests.wsclient import configure, send

BACKLOG = 30


async def test_a_backlog_does_not_starve_a_new_sessions_first_unit(server: ServerThread) -> None:
    a_done: list[int] = []
    a_started = asyncio.Event()

    async def backlogged() -> None:
        async with websockets.connect(server.ws_url) as ws:
            await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
            for n in range(BACKLOG):
                await send(ws, {"type": "input.text", "text": f"Backlog utterance number {n} is queued here."})
                await send(ws, {"type": "input.done"})
            while len(a_done) < BACKLOG:
                frame = await ws.recv()
                if isinstance(frame, bytes):
                    a_started.set()
                elif (event := json.loads(frame))["type"] == "session.done":
                    a_done.append(event["utterance_index"])

    async def newcomer() -> int:
        await a_started.wait()
        async with websockets.connect(server.ws_url) as ws:
            await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
            await send(ws, {"type": "input.text", "text": "I just arrived."})
            await send(ws, {"type": "input.done"})
            while not isinstance(await ws.recv(), bytes):
                pass
            return len(a_done)

    async with asyncio.timeout(300):
        a_task = asyncio.create_task(backlogged())
        finished_before_newcomer = await newcomer()
        await a_task
    assert finished_before_newcomer < BACKLOG // 3, finished_before_newcomer
