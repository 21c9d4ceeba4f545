"""Property-based fuzzing of the WebSocket protocol against a real server.

Hypothesis drives random sequences of valid, invalid and out-of-order client frames at one session. After
every frame: every event received so far decodes as one of our event types, and a second, healthy session
still gets a whole utterance back. After each sequence: the session never met an internal error (bad input
gets its own error code), and no server task, session or socket is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from voicewire.protocol.messages import ServerEvent
from voicewire.realtime.settings import Settings
from websockets.protocol import State

from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send

EVENT_DECODER = msgspec.json.Decoder(ServerEvent)

texts = st.text(alphabet=st.sampled_from(list("abc xyz.,!?'1234 Dr.\n\u3002\u00e9")), max_size=40)
json_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3), max_leaves=8)

config_fields = st.fixed_dictionaries({}, optional={
    "response_format": st.sampled_from(["pcm", "wav", "mulaw", "alaw", "flac", "mp3", "opus", "aiff", 3]),
    "stream_audio": st.booleans(),
    "split_granularity": st.sampled_from(["none", "sentence", "clause", "word"]),
    "speed": st.floats(0.1, 5.0),
    "sample_rate": st.sampled_from([8000, 16000, 22050, 24000, 48000, 7, 96000]),
    "word_timestamps": st.booleans(),
    "audio_frames": st.sampled_from(["binary", "json", "xml"]),
    "voice": st.sampled_from(["heart", "alloy", "nobody"]),
    "max_buffer_delay_ms": st.integers(-5, 6000),
})

frames: st.SearchStrategy[str | bytes] = st.one_of(
    config_fields.map(lambda c: json.dumps({"type": "session.config", **c})),
    texts.map(lambda t: json.dumps({"type": "input.text", "text": t})),
    st.just(json.dumps({"type": "input.done"})),
    st.just(json.dumps({"type": "input.cancel"})),
    st.sampled_from(["{", "[]", "null", '"x"', "{}", '{"type": 5}', '{"type": "input.text", "text": null}']),
    json_values.map(lambda v: json.dumps({"type": "input.text", "text": "ok", "extra": v})),
    json_values.map(json.dumps),
    # a field of the wrong type, then malformed JSON: the typed decode stops at the field before the rest
    st.tuples(json_values, st.sampled_from(["NaN", "-Infinity", "tru", "'x'", "01", ""])).map(
        lambda pair: f'{{"type": {json.dumps(pair[0])}, "text": 5, "x": {pair[1]}}}'),
    st.binary(max_size=16),
)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerThread]:
    srv = ServerThread(Settings(idle_timeout_s=30, max_utterance_chars=400))
    yield srv
    srv.stop()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def server_tasks(srv: ServerThread) -> int:
    async def count() -> int:
        return len(asyncio.all_tasks())
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(count(), srv.loop))


async def drain(ws: websockets.ClientConnection, into: list[Any]) -> bool:
    """Read what is there without waiting long; False once the server closed the socket."""
    while True:
        try:
            frame = await asyncio.wait_for(ws.recv(), 0.05)
        except TimeoutError:
            return True
        except websockets.ConnectionClosed:
            return False
        if isinstance(frame, str):
            into.append(EVENT_DECODER.decode(frame))


async def healthy(srv: ServerThread, ws: websockets.ClientConnection) -> None:
    await send(ws, {"type": "input.text", "text": "Still alive."})
    await send(ws, {"type": "input.done"})
    got = await recv_until(ws, "session.done", timeout=60)
    assert got.of("audio.done")[-1]["error"] is False


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequence=st.lists(frames, min_size=1, max_size=8), configured_first=st.booleans())
def test_random_message_sequences_never_hurt_the_server(fuzz_server: ServerThread, sequence: list[str | bytes],
                                                        configured_first: bool) -> None:
    asyncio.run(_run(fuzz_server, sequence, configured_first))


async def _run(srv: ServerThread, sequence: list[str | bytes], configured_first: bool) -> None:
    fds_before = open_fds()
    tasks_before = await server_tasks(srv)
    async with websockets.connect(srv.ws_url) as witness:
        await configure(witness, split_granularity="sentence", response_format="pcm", stream_audio=True)
        events: list[Any] = []
        async with websockets.connect(srv.ws_url, max_size=None) as ws:
            if configured_first:
                await ws.send(json.dumps({"type": "session.config", "split_granularity": "sentence"}))
            for frame in sequence:
                try:
                    await ws.send(frame)
                except websockets.ConnectionClosed:
                    break
                alive = await drain(ws, events)
                await healthy(srv, witness)
                if not alive:
                    break
            if ws.state is State.OPEN:
                await ws.send(json.dumps({"type": "input.done"}))
                await drain(ws, events)
        # `drain` decoded every event with our ServerEvent union: an unknown or malformed event raised.
        assert all(isinstance(e, msgspec.Struct) for e in events)
        # bad input gets its own error, never the server's: no internal error, no close for one (1011)
        assert [e for e in events if getattr(e, "code", None) == "internal_error"] == [], sequence
        assert ws.close_code != 1011, sequence
    async with asyncio.timeout(30):
        while len(srv.ctx.sessions) or await server_tasks(srv) > tasks_before:
            await asyncio.sleep(0.05)
    assert open_fds() <= fds_before + 2
