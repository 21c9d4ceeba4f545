"""Admission by capacity on a real server whose engine is slowed to a known speed (`PacedEngine`): once
the engine's capacity is spoken for, new sessions are refused with 1013, and the admitted ones play
through without running dry."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator

import pytest
import websockets
from voicewire.adapters.registry import create_engine
from voicewire.realtime.admission import WINDOW_ENGINE_S, Admission
from voicewire.realtime.metrics import Metrics
from voicewire.realtime.settings import Settings
from websockets.asyncio.client import ClientConnection

from tests.faults import PacedEngine
from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send

SPEED = 4.0
"""Audio seconds per second of the paced engine's one slot."""
UTILIZATION = 0.6
"""So the measured capacity is 0.6 x 1 x 4 = 2.4 streams: two speaking sessions fit, a third does not."""
BYTES_PER_SECOND = 24000 * 2
REPLY = " ".join(f"Sentence number {n} of this longer reply is spoken now." for n in range(5))


@pytest.fixture(scope="module")
def slow_engine_server() -> Iterator[ServerThread]:
    srv = ServerThread(Settings(engine_workers=1, admission_utilization=UTILIZATION),
                       PacedEngine(create_engine("hibari", workers=1), speed=SPEED))
    yield srv
    srv.stop()


def metric(srv: ServerThread, name: str) -> float:
    with urllib.request.urlopen(f"{srv.http_url}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def speak(ws: ClientConnection, text: str) -> None:
    await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True)
    await send(ws, {"type": "input.text", "text": text})
    await send(ws, {"type": "input.done"})


async def underruns(ws: ClientConnection, started: asyncio.Event) -> int:
    """Play the reply in real time from its first audio byte; count audio that came after the audio
    before it had finished playing (the listener ran dry)."""
    plays_until: float | None = None
    late = 0
    async with asyncio.timeout(120):
        while True:
            frame = await ws.recv()
            now = time.monotonic()
            if isinstance(frame, bytes):
                started.set()
                if plays_until is not None and now > plays_until:
                    late += 1
                plays_until = max(plays_until or now, now) + len(frame) / BYTES_PER_SECOND
            elif json.loads(frame)["type"] == "session.done":
                return late


async def test_sessions_past_the_measured_capacity_are_refused_and_admitted_ones_never_run_dry(
        slow_engine_server: ServerThread) -> None:
    srv = slow_engine_server
    async with websockets.connect(srv.ws_url) as warm:
        await speak(warm, REPLY)
        await recv_until(warm, "session.done")
    assert 2 <= metric(srv, "voicewire_capacity_streams") < 3, "two speaking sessions fit, three do not"

    async with websockets.connect(srv.ws_url) as a:
        await speak(a, REPLY)
        a_started = asyncio.Event()
        a_task = asyncio.create_task(underruns(a, a_started))
        await a_started.wait()
        async with websockets.connect(srv.ws_url) as b:  # one speaking: room for one more
            await speak(b, REPLY)
            b_started = asyncio.Event()
            b_task = asyncio.create_task(underruns(b, b_started))
            await b_started.wait()
            assert metric(srv, "voicewire_speaking_streams") == 2
            async with websockets.connect(srv.ws_url) as c:
                with pytest.raises(websockets.ConnectionClosed) as refused:
                    await c.recv()
            assert refused.value.rcvd is not None and refused.value.rcvd.code == 1013
            assert refused.value.rcvd.reason == "server at capacity; retry after 5 s"
            assert await a_task == 0 and await b_task == 0, "an admitted session ran dry"
    assert metric(srv, 'voicewire_sessions_refused_total{reason="capacity"}') == 1
    async with websockets.connect(srv.ws_url) as d:  # nobody speaks now: admitted again
        await speak(d, "Back to quiet.")
        assert (await recv_until(d, "session.done")).of("session.done")


def test_an_idle_server_admits_one_session_whatever_speed_was_measured() -> None:
    """Units that failed without audio (timeouts, a dead worker) measure a speed of 0: busy sessions are
    refused beside them, but an idle server still admits one, or every session would stay locked out."""
    metrics = Metrics()
    admission = Admission(metrics, utilization=0.8)
    metrics.engine_busy.inc(2 * WINDOW_ENGINE_S)  # engine time spent, no audio produced
    assert admission.capacity(slots=2) == 0.0
    assert admission.admits(speaking=0, slots=2)
    assert not admission.admits(speaking=1, slots=2)
