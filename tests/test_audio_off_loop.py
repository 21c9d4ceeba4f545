"""Heavy audio work runs off the event loop every session shares (issue 14 #14), against the real server and
engine: a profiler on the server's loop thread records which of the costly functions (time-stretch,
resample, mp3/Opus/FLAC encoding, REST's base64 and JSON of whole files) it ran, while real clients ask for speed
0.25 at 48 kHz in compressed formats over REST (whole, streamed, SSE, batch) and the WebSocket. None of
them may run there; the responses must still hold the audio asked for. Nothing here measures time."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import httpx
import pytest
import soundfile as sf
import websockets
from voicewire.realtime.offload import AudioThreads

from tests.rest_audio import decode
from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send

COSTLY = frozenset({
    "time_stretch", "ResampleStream.resample_chunk", "PyAVEncoder.encode", "PyAVEncoder.finish", "FlacEncoder.encode",
    "FlacEncoder.finish", "b64encode", "dumps",
})
"""Qualified names of the functions that must never run on the loop thread during these requests (for
`b64encode` and `json.dumps`: when they are given audio, see `LoopCalls.costly_call`)."""
FEED = "UnitRenderer.feed"
"""A cheap render (pcm at the engine's rate, speed 1) stays on the loop: the control that the profiler sees
the loop thread's calls."""
TEXT = "The weather was cold and windy this morning."
SLOW = {"speed": 0.25, "sample_rate": 48000}
SPEECH = "/v1/audio/speech"


class LoopCalls:
    """The names in `COSTLY` and `FEED` called on the server's loop thread while `watching`."""

    def __init__(self, server: ServerThread) -> None:
        self.server = server
        self.seen: list[str] = []
        self.loop_thread: int | None = None

    def _hook(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            name = frame.f_code.co_qualname
            if name == FEED or (name in COSTLY and self.costly_call(name, frame.f_locals)):
                self.seen.append(name)

    @staticmethod
    def costly_call(name: str, args: dict[str, Any]) -> bool:
        """base64 of more than a handshake's digest, JSON holding audio (a batch's results, an SSE delta)."""
        if name == "b64encode":
            return len(args["s"]) > 1024
        if name == "dumps":
            obj = args["obj"]
            return isinstance(obj, dict) and ("results" in obj or "audio" in obj)
        return True

    def __enter__(self) -> LoopCalls:
        async def install() -> None:
            self.loop_thread = threading.get_ident()
            sys.setprofile(self._hook)

        self.server.call(install)
        return self

    def __exit__(self, *exc: object) -> None:
        async def remove() -> None:
            sys.setprofile(None)

        self.server.call(remove)

    @property
    def costly(self) -> list[str]:
        return [name for name in self.seen if name in COSTLY]


@pytest.fixture
def loop_calls(server: ServerThread) -> Iterator[LoopCalls]:
    with LoopCalls(server) as calls:
        yield calls
    assert calls.loop_thread is not None and calls.loop_thread != threading.get_ident()


def seconds(data: bytes, fmt: str) -> float:
    samples, rate = decode(data, fmt)
    return len(samples) / rate


def test_the_profiler_sees_a_cheap_render_on_the_loop(server: ServerThread, loop_calls: LoopCalls) -> None:
    response = httpx.post(server.http_url + SPEECH, json={"input": TEXT, "response_format": "pcm"}, timeout=120)
    assert response.status_code == 200 and len(response.content) > 24000
    assert FEED in loop_calls.seen and not loop_calls.costly


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac"])
def test_a_whole_slow_48k_rest_file_is_rendered_and_encoded_off_the_loop(server: ServerThread,
                                                                         loop_calls: LoopCalls, fmt: str) -> None:
    response = httpx.post(server.http_url + SPEECH, json={"input": TEXT, "response_format": fmt, **SLOW},
                          timeout=120)
    assert response.status_code == 200
    assert seconds(response.content, fmt) > 6.0  # about 2.5 s at speed 1
    assert loop_calls.seen == []


def test_a_streamed_slow_mp3_and_sse_are_made_off_the_loop(server: ServerThread, loop_calls: LoopCalls) -> None:
    streamed = httpx.post(server.http_url + SPEECH, timeout=120,
                          json={"input": TEXT, "response_format": "mp3", "stream_format": "audio", **SLOW})
    assert streamed.status_code == 200 and seconds(streamed.content, "mp3") > 6.0
    sse = httpx.post(server.http_url + SPEECH, timeout=120,
                     json={"input": TEXT, "response_format": "pcm", "stream_format": "sse", **SLOW})
    events = [json.loads(line[len("data: "):]) for line in sse.text.splitlines() if line.startswith("data: ")]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert events[-1]["type"] == "speech.audio.done" and len(audio) / 2 / 48000 > 6.0
    assert loop_calls.seen == []


def test_a_batch_is_rendered_encoded_and_serialized_off_the_loop(server: ServerThread,
                                                                 loop_calls: LoopCalls) -> None:
    response = httpx.post(server.http_url + SPEECH + "/batch", timeout=120, json={
        "response_format": "wav", **SLOW, "items": [{"input": TEXT}, {"input": "A second item.", "speed": 1.0}]})
    body = response.json()
    assert response.status_code == 200 and body["succeeded"] == 2, body
    first, second = (sf.info(io.BytesIO(base64.b64decode(r["audio_data"]))) for r in body["results"])
    assert first.samplerate == 48000 and first.duration > 6.0 and second.duration < first.duration
    assert loop_calls.seen == []


async def test_a_websocket_session_at_slow_speed_in_mp3_is_rendered_off_the_loop(
        server: ServerThread, loop_calls: LoopCalls) -> None:
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        await configure(ws, split_granularity="sentence", response_format="mp3", **SLOW)
        await send(ws, {"type": "input.text", "text": TEXT + " And then it rained."})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
    files = [i for i in got.items if isinstance(i, bytes)]
    assert len(files) == 2 and not got.of("error")
    assert all(seconds(f, "mp3") > 2.0 for f in files)
    assert loop_calls.seen == []


async def test_a_cancel_while_units_render_off_the_loop_leaves_the_session_working(
        server: ServerThread, loop_calls: LoopCalls) -> None:
    """Barge-in once the first audio arrives, while the units after it are being synthesized and rendered
    on the audio threads: the cancel is answered, and the session's next utterance is whole."""
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True, **SLOW)
        for _ in range(2):
            await send(ws, {"type": "input.text", "text": " ".join([TEXT] * 4)})
            await send(ws, {"type": "input.done"})
            got = await recv_until(ws, "audio.start")
            while not any(isinstance(i, bytes) for i in got.items):
                got.items.append(await ws.recv())
            await send(ws, {"type": "input.cancel"})
            await recv_until(ws, "audio.cancelled")
        await send(ws, {"type": "input.text", "text": "Still here."})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
    audio = b"".join(i for i in got.items if isinstance(i, bytes))
    assert not got.of("error") and [d["error"] for d in got.of("audio.done")] == [False]
    assert len(audio) / 2 / 48000 > 1.5
    assert loop_calls.costly == []


async def test_a_cancelled_run_raises_only_after_its_call_has_ended() -> None:
    """Whoever cancels closes what the call works on (a renderer, an encoder), so the cancel waits for it."""
    threads = AudioThreads(1)
    started, release = threading.Event(), threading.Event()

    def work() -> str:
        started.set()
        release.wait()
        return "done"

    try:
        task = asyncio.create_task(threads.run(work))
        await asyncio.to_thread(started.wait)
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        release.set()
        threads.close()
