"""The scheduler serves a new session's first unit before another session's backlog, and a session speaking
normally keeps its turn while others send text built to be expensive for the engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator

import httpx
import websockets
from voicewire.adapters.base import Engine
from voicewire.adapters.registry import create_engine
from voicewire.protocol.engine import AudioPiece, SynthesisRequest
from voicewire.realtime.settings import Settings

from tests.faults import EngineWrapper
from tests.server import ServerThread
from tests.wsclient import Received, configure, recv_until, send

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


class GrantLog(EngineWrapper):
    """A real engine that notes each request's id as the server hands it over: the order the scheduler
    granted engine slots in."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner)
        self.granted: list[str] = []

    async def synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        self.granted.append(request.request_id)
        async with contextlib.aclosing(self.inner.synthesize(request)) as pieces:
            async for piece in pieces:
                yield piece


# Whitespace-free runs that hibari's G2P found costly (tests/test_hibari_engine.py, HOSTILE).
EXPENSIVE = ("-".join(["ab"] * 84), "aB" * 125, "a1" * 125, "a@b." * 60, "/".join(["ab"] * 84))
ATTACK_UTTERANCES = 20
BATCH_ITEMS = 32
CANARY = "Hello there. I am the canary, speaking normally. This is my third and last sentence."


async def test_a_normal_session_is_served_between_the_units_of_expensive_text_from_a_session_and_a_batch() -> None:
    """Issue 14 #4: one session and one REST batch send text built to be expensive for the phonemizer; a
    session that arrives after them gets its whole utterance, its units granted before most of either's."""
    log = GrantLog(create_engine("hibari", workers=1, isolation="process"))
    srv = ServerThread(Settings(engine_workers=1), log)
    try:
        async def attacking_session() -> Received:
            async with websockets.connect(srv.ws_url, max_size=None) as ws:  # a minute of audio in a frame
                await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
                for n in range(ATTACK_UTTERANCES):
                    await send(ws, {"type": "input.text", "text": EXPENSIVE[n % len(EXPENSIVE)]})
                    await send(ws, {"type": "input.done"})
                return await recv_until(ws, "session.done", count=ATTACK_UTTERANCES, timeout=600)

        async def attacking_batch() -> httpx.Response:
            # Short items, so the batch stays within max_response_audio_s.
            items = [{"input": EXPENSIVE[n % len(EXPENSIVE)][:60]} for n in range(BATCH_ITEMS)]
            async with httpx.AsyncClient(timeout=600) as client:
                return await client.post(f"{srv.http_url}/v1/audio/speech/batch",
                                         json={"items": items, "voice": "alloy", "response_format": "pcm"})

        async with asyncio.timeout(600):
            session = asyncio.create_task(attacking_session())
            batch = asyncio.create_task(attacking_batch())
            # Both are at the engine (so their work is queued) before the canary speaks.
            while not (any(g.startswith("sess_") for g in log.granted)
                       and any(g.startswith("speech-batch") for g in log.granted)):
                await asyncio.sleep(0.01)
            async with websockets.connect(srv.ws_url) as ws:
                updated = await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
                await send(ws, {"type": "input.text", "text": CANARY})
                await send(ws, {"type": "input.done"})
                canary = await recv_until(ws, "session.done", timeout=600)
            attack, batch_response = await session, await batch

        # The canary's utterance is whole: three sentences, no error, every byte its audio.done counts.
        assert not canary.of("error")
        done = canary.of("audio.done")
        assert len(done) == 3 and not any(d["error"] for d in done)
        audio = sum(len(item) for item in canary.items if isinstance(item, bytes))
        assert audio == sum(d["total_bytes"] for d in done) > 0
        # The attackers were served too.
        assert len(attack.of("session.done")) == ATTACK_UTTERANCES
        assert batch_response.status_code == 200
        assert all(r["status"] == "success" for r in batch_response.json()["results"])

        ours = f"{updated['session_id']}-"
        canary_last = max(i for i, g in enumerate(log.granted) if g.startswith(ours))
        before = log.granted[:canary_last]
        for name, prefix in (("session", "sess_"), ("batch", "speech-batch")):
            theirs = [g for g in log.granted if g.startswith(prefix) and not g.startswith(ours)]
            ahead = [g for g in before if g in theirs]
            assert len(ahead) < len(theirs) // 2, (
                f"the canary waited behind {len(ahead)} of the {name}'s {len(theirs)} units: {log.granted}")
    finally:
        srv.stop()
