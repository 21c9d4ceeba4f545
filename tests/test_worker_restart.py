"""An engine worker process that dies is restarted; only the units it was computing fail."""

from __future__ import annotations

import asyncio
import os
import signal

import websockets
from voicewire.adapters.workers import ProcessEngine
from voicewire.realtime.settings import Settings

from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send

STREAM = {"split_granularity": "sentence", "response_format": "pcm", "stream_audio": True}
LONG = " ".join(f"Sentence {n} of a story long enough to keep an engine worker busy for a while." for n in range(30))


async def test_killing_a_busy_worker_fails_only_its_unit_and_the_worker_comes_back() -> None:
    srv = ServerThread(Settings(engine_workers=2, engine_isolation="process"))
    try:
        engine = srv.ctx.engine
        assert isinstance(engine, ProcessEngine)
        pids_before = engine.worker_pids()
        async with websockets.connect(srv.ws_url) as ws:
            await configure(ws, **STREAM)
            await send(ws, {"type": "input.text", "text": LONG})
            await send(ws, {"type": "input.done"})
            got = await recv_until(ws, "audio.start")
            async with asyncio.timeout(60):
                while not (busy := engine.busy_worker_pids()):
                    await asyncio.sleep(0.001)
            os.kill(busy[0], signal.SIGKILL)
            got = await recv_until(ws, "session.done", got)
        errors = got.of("error")
        assert errors, "the unit on the killed worker failed"
        assert all(e["code"] == "generation_failed" and "died" in e["message"] and not e["fatal"] for e in errors)
        done = got.of("audio.done")
        assert [d["sentence_index"] for d in done] == list(range(30))
        assert sum(d["error"] for d in done) == len(errors) <= 2, "only the units on that worker failed"
        async with asyncio.timeout(120):
            while engine.stats.restarts < 1 or None in engine.worker_pids():
                await asyncio.sleep(0.05)
        assert busy[0] not in engine.worker_pids() and len(set(engine.worker_pids()) - set(pids_before)) == 1
        # The server and the replacement worker serve a new session normally.
        async with websockets.connect(srv.ws_url) as ws:
            await configure(ws, **STREAM)
            await send(ws, {"type": "input.text", "text": "Back to normal. Both workers answer."})
            await send(ws, {"type": "input.done"})
            got = await recv_until(ws, "session.done")
        assert not got.of("error") and [d["error"] for d in got.of("audio.done")] == [False, False]
    finally:
        srv.stop()
